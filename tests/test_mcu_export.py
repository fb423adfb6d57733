"""Microcontroller bundles carry C sources (``c/``): the model as a 16-byte aligned array in its own section, a header
with the tensors, quantization, labels and tensor arena, and golden samples for an on-board self-test. Real exports of
a model for the digits data (``cortex-m4``, and ``ethos-u55-128``'s NPU target); the sources are compiled with
Debian's arm-none-eabi-gcc for each profile's core and linked into the part's memories, and what the ELF says (flash
taken, the array's address and section) is checked; the host's gcc reads the header back. Nothing mocked."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgeline.bundle import read_bundle
from edgeline.cli import main
from edgeline.device_profiles import load_profile
from edgeline.errors import IntegrityError

pytestmark = pytest.mark.export

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("arm-none-eabi-gcc", "arm-none-eabi-size", "arm-none-eabi-readelf", "gcc")
M4_FLAGS = ("-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16")
M55_FLAGS = ("-mcpu=cortex-m55", "-mthumb", "-mfloat-abi=hard")
STRICT = ("-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic")
# What the test model's classes are called: a quote, a backslash, a trigraph and UTF-8 must survive the C string.
LABELS = ["zero", "one", "two", "three", "four", "five", "six", "seven", 'eight "8" \\ ??=', "neun ü"]

MODEL = """\
import torch
from torch import nn


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
"""

FIRMWARE_MAIN = r"""
#include <stdalign.h>
#include <stdint.h>

#include "model_data.h"

/* What a firmware reserves for TFLite Micro: the header's arena, 16-byte aligned. */
static alignas(16) uint8_t arena[EDGELINE_ARENA_BYTES];
volatile uint32_t edgeline_sink;

int main(void) {
    uint32_t sum = edgeline_model_len;
    for (unsigned int i = 0; i < edgeline_model_len; i++) sum += edgeline_model[i];
    for (int s = 0; s < EDGELINE_GOLDEN_SAMPLES; s++) {
        for (int i = 0; i < EDGELINE_INPUT_0_ELEMENTS; i++) sum += (uint32_t)edgeline_golden_input_0[s][i];
        for (int j = 0; j < EDGELINE_OUTPUT_0_ELEMENTS; j++) sum += (uint32_t)edgeline_golden_output_0[s][j];
    }
    arena[sum % EDGELINE_ARENA_BYTES] = (uint8_t)sum;
    edgeline_sink = sum + arena[0];
    return 0;
}

void Reset_Handler(void) {
    main();
    for (;;) {
    }
}
"""

LINKER_SCRIPT = """\
MEMORY
{{
  FLASH (rx)  : ORIGIN = 0x08000000, LENGTH = {flash}
  RAM   (rwx) : ORIGIN = 0x20000000, LENGTH = {ram}
}}
ENTRY(Reset_Handler)
SECTIONS
{{
  .text : {{ *(.text*) *(.rodata*) }} > FLASH
  .edgeline_model : ALIGN(16) {{ KEEP(*(.edgeline_model)) }} > FLASH
  .data : {{ *(.data*) }} > RAM AT > FLASH
  .bss (NOLOAD) : {{ *(.bss*) *(COMMON) }} > RAM
}}
"""

HEADER_READER = r"""
#include <stdio.h>

#include "model_data.h"

/* The header and arrays, as a C compiler reads them: one "key values..." line each. */
int main(int argc, char **argv) {
    static const int input_shape[] = EDGELINE_INPUT_0_SHAPE, output_shape[] = EDGELINE_OUTPUT_0_SHAPE;
    printf("input_name %s\ninput_shape", EDGELINE_INPUT_0_NAME);
    for (int i = 0; i < EDGELINE_INPUT_0_RANK; i++) printf(" %d", input_shape[i]);
    printf("\ninput_type_bytes %d\n", (int)sizeof(EDGELINE_INPUT_0_TYPE));
    printf("input_scale %.9g\ninput_zero_point %d\n", (double)EDGELINE_INPUT_0_SCALE, EDGELINE_INPUT_0_ZERO_POINT);
    printf("output_name %s\noutput_shape", EDGELINE_OUTPUT_0_NAME);
    for (int i = 0; i < EDGELINE_OUTPUT_0_RANK; i++) printf(" %d", output_shape[i]);
    printf("\noutput_type_bytes %d\n", (int)sizeof(EDGELINE_OUTPUT_0_TYPE));
    printf("output_scale %.9g\noutput_zero_point %d\n", (double)EDGELINE_OUTPUT_0_SCALE, EDGELINE_OUTPUT_0_ZERO_POINT);
    printf("arena %u\nmodel_len %u %u\n", EDGELINE_ARENA_BYTES, edgeline_model_len, EDGELINE_MODEL_BYTES);
    printf("tolerance %d\nsamples %d\ntask %s\n", EDGELINE_GOLDEN_OUTPUT_0_TOLERANCE, EDGELINE_GOLDEN_SAMPLES,
           EDGELINE_TASK);
    for (int i = 0; i < EDGELINE_LABEL_COUNT; i++) printf("label %s\n", edgeline_labels[i]);
    for (int s = 0; s < EDGELINE_GOLDEN_SAMPLES; s++) {
        printf("golden_input");
        for (int i = 0; i < EDGELINE_INPUT_0_ELEMENTS; i++) printf(" %d", edgeline_golden_input_0[s][i]);
        printf("\ngolden_output");
        for (int j = 0; j < EDGELINE_OUTPUT_0_ELEMENTS; j++) printf(" %d", edgeline_golden_output_0[s][j]);
        printf("\n");
    }
    FILE *out = argc > 1 ? fopen(argv[1], "wb") : NULL;
    if (out == NULL || fwrite(edgeline_model, 1, edgeline_model_len, out) != edgeline_model_len) return 1;
    return fclose(out) != 0;
}
"""


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    found = {name: shutil.which(name) for name in TOOLS}
    missing = [name for name, path in found.items() if path is None]
    assert not missing, (
        f"{', '.join(missing)} not installed: scripts/setup.sh installs them "
        "(Debian's gcc, gcc-arm-none-eabi and libnewlib-arm-none-eabi)"
    )
    return {name: str(path) for name, path in found.items()}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("mcu")
    (root / "model.py").write_text(MODEL, encoding="utf-8")
    (root / "labels.txt").write_text("\n".join(LABELS) + "\n", encoding="utf-8")
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    np.savez(root / "cal.npz", images[:64])
    np.savez(root / "val.npz", images[64:128], labels=digits.target[64:128])
    return root


def _export(root: Path, profile: str | Path, out: Path, *extra: str) -> int:
    return main(["export", f"{root / 'model.py'}:mlp", "--profile", str(profile), "--calibration",
                 str(root / "cal.npz"), "--validation", str(root / "val.npz"), "--labels", str(root / "labels.txt"),
                 "--out", str(out), *extra])  # fmt: skip


@pytest.fixture(scope="module")
def m4_bundle(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("m4") / "bundle"
    assert _export(workspace, "cortex-m4", out) == 0, "export for cortex-m4 failed"
    return out


@pytest.fixture(scope="module")
def u55_bundle(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("u55") / "bundle"
    code = _export(workspace, "ethos-u55-128", out, "--backend", "ethos-u", "--precision", "int8-static")
    assert code == 0, "ethos-u export for ethos-u55-128 failed"
    return out


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _defines(bundle: Path) -> dict[str, str]:
    text = (bundle / "c" / "model_data.h").read_text()
    return dict(re.findall(r"^#define (EDGELINE_\w+) (.+)$", text, flags=re.MULTILINE))


def _unwrapped(path: Path) -> str:
    """The header with its comments' lines joined: a phrase may be wrapped anywhere."""
    return path.read_text().replace("\n * ", " ")


def _read_header(bundle: Path, gcc: str, tmp_path: Path) -> tuple[dict[str, list[str]], bytes]:
    """The host's gcc builds the header reader against the bundle's sources: what it prints, and the model array."""
    (tmp_path / "reader.c").write_text(HEADER_READER)
    binary = tmp_path / "reader"
    subprocess.run([gcc, *STRICT, "-O1", f"-I{bundle / 'c'}", str(tmp_path / "reader.c"),
                    str(bundle / "c" / "model_data.c"), "-o", str(binary)], check=True)  # fmt: skip
    done = subprocess.run([str(binary), str(tmp_path / "model.bin")], capture_output=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    read: dict[str, list[str]] = {}
    for line in done.stdout.decode("utf-8").splitlines():
        key, _, value = line.partition(" ")
        read.setdefault(key, []).append(value)
    return read, (tmp_path / "model.bin").read_bytes()


def _firmware(
    bundle: Path, tools: dict[str, str], flags: tuple[str, ...], tmp_path: Path, flash: int, ram: int
) -> Path:
    """model_data.c and a main that uses the array, the golden samples and an arena of the header's size, compiled
    for the core (warnings are errors) and linked into a part of ``flash`` and ``ram`` bytes."""
    gcc = tools["arm-none-eabi-gcc"]
    (tmp_path / "main.c").write_text(FIRMWARE_MAIN)
    (tmp_path / "link.ld").write_text(LINKER_SCRIPT.format(flash=flash, ram=ram))
    sources = bundle / "c"
    for source, obj in ((sources / "model_data.c", "model_data.o"), (tmp_path / "main.c", "main.o")):
        subprocess.run([gcc, *flags, *STRICT, "-Os", f"-I{sources}", "-c", str(source), "-o", str(tmp_path / obj)],
                       check=True)  # fmt: skip
    elf = tmp_path / "firmware.elf"
    subprocess.run([gcc, *flags, "-nostartfiles", "-nostdlib", "-T", str(tmp_path / "link.ld"), "-Wl,--gc-sections",
                    str(tmp_path / "main.o"), str(tmp_path / "model_data.o"), "-o", str(elf)], check=True)  # fmt: skip
    return elf


def _run(*command: str) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _section_of(readelf: str, elf: Path, symbol: str) -> tuple[int, str, int]:
    """``symbol``'s address and section in the ELF's symbol table, and that section's alignment."""
    sections = {}
    for line in _run(readelf, "-W", "-S", str(elf)).splitlines():
        found = re.match(r"\s*\[\s*(\d+)\]\s+(.*)$", line)
        if found:
            fields = found.group(2).split()  # Name Type Address Off Size ES [Flg] Lk Inf Al
            sections[found.group(1)] = (fields[0], int(fields[-1]))
    for line in _run(readelf, "-W", "-s", str(elf)).splitlines():
        fields = line.split()
        if len(fields) == 8 and fields[7] == symbol:
            name, alignment = sections[fields[6]]
            return int(fields[1], 16), name, alignment
    raise AssertionError(f"{symbol} is not in {elf}'s symbol table")


def test_the_c_sources_are_in_the_bundle_and_checked_like_its_other_files(m4_bundle: Path, tmp_path: Path) -> None:
    data = manifest(m4_bundle)
    listed = {entry["path"]: entry for entry in data["files"]}
    assert {"c/model_data.c", "c/model_data.h"} <= set(listed)
    assert data["firmware"]["sources"] == "c"
    read_bundle(m4_bundle)
    copy = Path(shutil.copytree(m4_bundle, tmp_path / "copy"))
    header = copy / "c" / "model_data.h"
    header.write_text(header.read_text().replace("EDGELINE_ARENA_BYTES", "EDGELINE_ARENA_BYTEZ", 1))
    with pytest.raises(IntegrityError, match=r"c/model_data\.h"):
        read_bundle(copy)


def test_the_header_says_what_the_manifest_says(m4_bundle: Path, tools: dict[str, str], tmp_path: Path) -> None:
    data = manifest(m4_bundle)
    read, model = _read_header(m4_bundle, tools["gcc"], tmp_path)
    for kind, spec in (("input", data["inputs"][0]), ("output", data["outputs"][0])):
        assert read[f"{kind}_name"] == [spec["name"]]
        assert read[f"{kind}_shape"] == [" ".join(map(str, spec["shape"]))]
        assert spec["dtype"] == "int8" and read[f"{kind}_type_bytes"] == ["1"]
        assert np.float32(read[f"{kind}_scale"][0]) == np.float32(spec["quantization"]["scale"])
        assert int(read[f"{kind}_zero_point"][0]) == spec["quantization"]["zero_point"]
    defines = _defines(m4_bundle)
    assert defines["EDGELINE_INPUT_0_TFLITE_TYPE"] == "kTfLiteInt8"
    assert read["label"] == LABELS == data["postprocess"]["labels"]
    assert read["task"] == ["classify"]
    assert model == (m4_bundle / data["model"]).read_bytes()
    assert read["model_len"] == [f"{len(model)} {len(model)}"]
    assert data["firmware"]["model_bytes"] == len(model)


def test_the_arena_is_tflite_micro_s_measurement_plus_the_stated_margin(
    m4_bundle: Path, tools: dict[str, str], tmp_path: Path
) -> None:
    from edgeline.backends.tflite_micro import TFLiteMicroSession

    data = manifest(m4_bundle)
    firmware = data["firmware"]
    measured = firmware["arena_basis_bytes"]
    assert firmware["arena_basis"] == "measured"
    # one arena figure: the manifest's memory is what the firmware reserves, labelled with what it rests on
    memory = data["memory"]
    assert memory["arena_bytes"] == firmware["arena_bytes"] and memory["resident_mb"] is None
    assert memory["measured_with"].startswith("the tensor arena the firmware reserves (EDGELINE_ARENA_BYTES)")
    assert f"{measured:,} B measured (TFLite Micro " in memory["measured_with"]
    assert "resident memory" not in memory["measured_with"]
    assert firmware["arena_basis_with"].startswith("TFLite Micro ")
    # the margin as the header and docs/bundle.md state it: +10%, rounded up to 16 B, +2048 B
    assert firmware["arena_margin"] == "+10%, rounded up to 16 B, +2048 B"
    grown = -(-measured * 110 // 100)  # +10%, rounded up to a byte
    expected = -(-grown // 16) * 16 + 2048
    assert firmware["arena_bytes"] == expected
    read, _ = _read_header(m4_bundle, tools["gcc"], tmp_path)
    assert read["arena"] == [str(expected)]
    defines = _defines(m4_bundle)
    assert defines["EDGELINE_ARENA_BASIS_BYTES"] == f"{measured}u" and defines["EDGELINE_ARENA_MEASURED"] == "1"
    header = _unwrapped(m4_bundle / "c" / "model_data.h")
    assert f"{measured} B measured at export" in header and "+10%, rounded up to 16 B, +2048 B" in header
    # measured again here, with TFLite Micro's own figure (its recording allocator, after a run): the same arena, up
    # to where the allocator happened to align its start
    session = TFLiteMicroSession(m4_bundle / data["model"])
    session.run([np.zeros(data["inputs"][0]["shape"], np.int8)])
    again = session.arena_used_bytes()
    assert again is not None and abs(again - measured) <= 16


def test_the_golden_samples_are_what_tflite_micro_gives_on_them(
    m4_bundle: Path, tools: dict[str, str], tmp_path: Path
) -> None:
    from edgeline.backends.tflite_micro import TFLiteMicroSession
    from edgeline.manifest import Quantization
    from edgeline.quantization import quantize

    data = manifest(m4_bundle)
    read, _ = _read_header(m4_bundle, tools["gcc"], tmp_path)
    inputs = np.array([row.split() for row in read["golden_input"]], dtype=np.int8)
    outputs = np.array([row.split() for row in read["golden_output"]], dtype=np.int8)
    assert len(inputs) == len(outputs) == int(read["samples"][0]) == 4
    golden = np.load(m4_bundle / "golden.npz")
    spec = data["inputs"][0]
    expected = quantize(golden["input_0"][:4], Quantization(**spec["quantization"]), np.dtype(np.int8))
    np.testing.assert_array_equal(inputs, expected.reshape(4, -1))
    session = TFLiteMicroSession(m4_bundle / data["model"])
    for sample, output in zip(inputs, outputs, strict=True):
        (found,) = session.run([sample.reshape(spec["shape"])])
        np.testing.assert_array_equal(found.reshape(-1), output)
    tolerance = int(read["tolerance"][0])
    assert tolerance >= 2  # at least the two quantization steps golden.npz allows another CPU's rounding


def test_the_sources_compile_for_the_cortex_m4_and_fit_its_memories(
    m4_bundle: Path, tools: dict[str, str], tmp_path: Path
) -> None:
    profile = load_profile("cortex-m4")
    part = profile.microcontroller
    assert part is not None
    data = manifest(m4_bundle)
    length = data["firmware"]["model_bytes"]
    elf = _firmware(m4_bundle, tools, M4_FLAGS, tmp_path, part.flash_bytes, part.largest_sram_block_bytes)
    berkeley = _run(tools["arm-none-eabi-size"], str(elf)).splitlines()[1].split()
    text, flash_data, bss = int(berkeley[0]), int(berkeley[1]), int(berkeley[2])
    assert text + flash_data >= length  # the flash the firmware takes holds the whole model array
    assert bss >= data["firmware"]["arena_bytes"]  # and the RAM the arena
    sections = dict(
        (fields[0], int(fields[1]))
        for fields in (line.split() for line in _run(tools["arm-none-eabi-size"], "-A", str(elf)).splitlines())
        if len(fields) == 3 and fields[1].isdigit()
    )
    assert sections[".edgeline_model"] == length
    address, section, alignment = _section_of(tools["arm-none-eabi-readelf"], elf, "edgeline_model")
    assert address % 16 == 0 and section == ".edgeline_model" and alignment >= 16
    _, section, alignment = _section_of(tools["arm-none-eabi-readelf"], tmp_path / "model_data.o", "edgeline_model")
    assert section == ".edgeline_model" and alignment == 16  # aligned by the source itself, not only the script
    assert 0x08000000 <= address < 0x08000000 + part.flash_bytes  # placed in flash


def test_an_ethos_u55_bundle_carries_c_sources_with_vela_s_estimate(
    u55_bundle: Path, tools: dict[str, str], tmp_path: Path
) -> None:
    data = manifest(u55_bundle)
    firmware, estimates = data["firmware"], data["estimates"]
    assert {"c/model_data.c", "c/model_data.h"} <= {entry["path"] for entry in data["files"]}
    assert data["model"] == "model_vela.tflite"
    assert firmware["model_bytes"] == (u55_bundle / "model_vela.tflite").stat().st_size
    # TFLite Micro cannot run the ethos-u operator here: the arena is vela's SRAM figure, and both places say so
    assert firmware["arena_basis"] == "estimated"
    assert firmware["arena_basis_bytes"] == estimates["sram_bytes"]
    assert firmware["arena_basis_with"].startswith(estimates["tool"])
    # the manifest's memory is the same figure (not the arena of the int8 copy TFLite Micro measured here)
    assert data["memory"]["arena_bytes"] == firmware["arena_bytes"]
    assert f"{estimates['sram_bytes']:,} B estimated" in data["memory"]["measured_with"]
    header = _unwrapped(u55_bundle / "c" / "model_data.h")
    assert "ESTIMATED, not measured" in header and estimates["tool"] in header
    assert _defines(u55_bundle)["EDGELINE_ARENA_MEASURED"] == "0"
    _, model = _read_header(u55_bundle, tools["gcc"], tmp_path)
    assert model == (u55_bundle / "model_vela.tflite").read_bytes()
    elf = _firmware(u55_bundle, tools, M55_FLAGS, tmp_path, 2 * 2**20, 4 * 2**20)
    address, section, _ = _section_of(tools["arm-none-eabi-readelf"], elf, "edgeline_model")
    assert address % 16 == 0 and section == ".edgeline_model"


def _tight(root: Path, **budgets: int) -> Path:
    """The bundled cortex-m4 profile with other budgets."""
    text = (REPO / "device_profiles" / "profiles" / "cortex-m4.toml").read_text()
    for key, value in budgets.items():
        text, found = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.MULTILINE)
        assert found == 1, key
    path = root / "tight.toml"
    path.write_text(text)
    return path


def test_a_model_over_the_flash_and_arena_budgets_is_refused_naming_bytes(
    workspace: Path, m4_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = manifest(m4_bundle)
    length, arena = data["firmware"]["model_bytes"], data["firmware"]["arena_bytes"]
    tight = _tight(tmp_path, max_model_bytes=length - 1, max_arena_bytes=arena - 16)
    capsys.readouterr()
    code = _export(workspace, tight, tmp_path / "b", "--backend", "tflite-micro", "--precision", "int8-static")
    assert code == 2
    assert not (tmp_path / "b").exists()
    err = capsys.readouterr().err
    assert f"model array {length} B > budget {length - 1} B" in err
    # this export measured the arena again: the same figure, up to where the allocator aligned its start
    found = re.search(
        rf"tensor arena (\d+) B \(measured (\d+) B, \+10%, rounded up to 16 B, \+2048 B\) > budget {arena - 16} B", err
    )
    assert found is not None, err
    assert abs(int(found.group(2)) - data["firmware"]["arena_basis_bytes"]) <= 16 and int(found.group(1)) > arena - 16
    assert "Traceback" not in err


def test_verify_judges_a_microcontroller_bundle_by_its_arena_not_a_process(
    m4_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = manifest(m4_bundle)
    capsys.readouterr()
    assert main(["verify", "--json", str(m4_bundle)]) == 0
    report = json.loads(capsys.readouterr().out)
    memory = next(check for check in report["checks"] if check["check"] == "memory")
    assert memory["resident_mb"] is None  # no process runs on a microcontroller
    assert memory["firmware_arena_bytes"] == data["firmware"]["arena_bytes"]
    assert memory["budget_arena_bytes"] == 98_304 and memory["ok"] is True, memory
    # TFLite Micro ran the model array here: what it needs fits in what the firmware reserves
    assert memory["arena_bytes"] is not None and memory["arena_bytes"] <= memory["firmware_arena_bytes"]
    assert main(["verify", str(m4_bundle)]) == 0
    text = capsys.readouterr().out
    assert f"the firmware reserves {data['firmware']['arena_bytes']:,} B (budget 98,304 B): ok" in text, text


def test_the_export_report_holds_the_arena_against_the_arena_budget() -> None:
    from edgeline.device_profiles import load_profile
    from edgeline.export.report import memory_summary
    from edgeline.manifest import Memory

    budgets = load_profile("cortex-m4").budgets
    memory = Memory(arena_bytes=12_000, measured_with="the tensor arena the firmware reserves")
    assert memory_summary(memory, budgets) == (
        "tensor arena 12,000 B (the tensor arena the firmware reserves), within the 98,304 B arena budget"
    )
    over = memory.model_copy(update={"arena_bytes": 99_000})
    assert "over the 98,304 B arena budget" in memory_summary(over, budgets)
