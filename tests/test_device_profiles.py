"""Device profiles: the bundled files, the loader's error messages and ``edgeline profiles``."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from edgeline import device_profiles
from edgeline.cli import main
from edgeline.device_profiles import (
    Precision,
    Profile,
    ProfileError,
    list_profiles,
    load_profile,
    profile_ids,
    profile_json_schema,
)
from edgeline.device_profiles import loader as profile_loader
from edgeline.export.backends import EXPORT_BACKENDS

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

REQUIRED_IDS = [
    "cortex-m4",
    "ethos-u55-128",
    "jetson-orin-nano",
    "qcs6490",
    "rpi-zero-2w",
    "rpi4",
    "rpi5",
    "snapdragon-8-gen-3",
    "x86-64",
]

VALID_TOML = """\
id = "my-board"
name = "My board"
description = "A board of my own."
memory_mb = 2048
os = "Debian 12 64-bit"

[cpu]
name = "Cortex-A55"
arch = "aarch64"
cores = 4
isa_features = ["neon", "dotprod"]

[[targets]]
backend = "litert"
precision = "int8-static"
threads = 4

[[targets]]
backend = "litert"
precision = "fp32"
threads = 2

[budgets]
max_model_bytes = 33_554_432
max_accuracy_drop = 1.0
min_cosine = 0.99
max_latency_ms = 80.0
"""


def write_profile(tmp_path: Path, text: str, name: str = "board.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# Bundled profiles


def bundled_files() -> list[str]:
    folder = resources.files("device_profiles").joinpath("profiles")
    return sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".toml"))


@pytest.mark.parametrize("file_name", bundled_files())
def test_every_bundled_profile_loads_and_its_id_is_its_file_name(file_name: str) -> None:
    profile_id = file_name.removesuffix(".toml")
    profile = load_profile(profile_id)
    assert profile.id == profile_id
    assert profile.source.endswith(file_name)
    assert profile.targets
    assert all(target.backend in EXPORT_BACKENDS for target in profile.targets)
    assert all(target.threads <= profile.cpu.cores for target in profile.targets)


def test_the_required_profiles_exist_and_are_listed_sorted() -> None:
    assert set(REQUIRED_IDS) <= set(profile_ids())
    assert profile_ids() == sorted(profile_ids())
    assert [profile.id for profile in list_profiles()] == profile_ids()


@pytest.mark.parametrize(
    ("profile_id", "cpu", "cores", "mhz", "features", "absent"),
    [
        ("rpi4", "Cortex-A72", 4, 1800, {"neon"}, {"dotprod", "fp16"}),
        ("rpi5", "Cortex-A76", 4, 2400, {"neon", "dotprod", "fp16"}, {"i8mm"}),
        ("rpi-zero-2w", "Cortex-A53", 4, 1000, {"neon"}, {"dotprod"}),
        ("jetson-orin-nano", "Cortex-A78AE", 6, 1500, {"dotprod", "fp16"}, {"i8mm"}),
        ("x86-64", "x86-64-v3", 4, None, {"avx2", "fma"}, set()),
    ],
)
def test_bundled_cpu_facts(
    profile_id: str, cpu: str, cores: int, mhz: int | None, features: set[str], absent: set[str]
) -> None:
    profile = load_profile(profile_id)
    assert (profile.cpu.name, profile.cpu.cores, profile.cpu.max_freq_mhz) == (cpu, cores, mhz)
    assert features <= set(profile.cpu.isa_features)
    assert not absent & set(profile.cpu.isa_features)


@pytest.mark.parametrize(
    ("profile_id", "soc_model", "htp_arch", "daemon"),
    [("snapdragon-8-gen-3", 57, 75, False), ("qcs6490", 93, 68, True)],
)
def test_qualcomm_profiles_put_the_npu_first_and_the_cpu_last(
    profile_id: str, soc_model: int, htp_arch: int, daemon: bool
) -> None:
    profile = load_profile(profile_id)
    assert profile.qnn is not None
    assert (profile.qnn.soc_model, profile.qnn.htp_arch, profile.daemon) == (soc_model, htp_arch, daemon)
    assert (profile.targets[0].backend, profile.targets[0].precision) == ("qnn-htp", Precision.INT8_STATIC)
    assert profile.targets[-1].backend == "litert"
    assert profile.budgets.min_accelerator_share == 1.0
    assert profile.budgets.min_quantized_share is not None


def test_the_jetson_has_a_gpu_target_behind_a_base_install_one() -> None:
    jetson = load_profile("jetson-orin-nano")
    assert jetson.onnxruntime is not None
    assert jetson.onnxruntime.providers[0] == "TensorrtExecutionProvider"
    assert jetson.onnxruntime.providers[-1] == "CPUExecutionProvider"
    backends = [target.backend for target in jetson.targets]
    assert backends[0] == "litert" and "onnxruntime" in backends


def test_small_device_has_int8_targets_and_a_tight_size_budget() -> None:
    zero = load_profile("rpi-zero-2w")
    assert zero.memory_mb == 512
    assert {target.precision for target in zero.targets} <= {Precision.INT8_STATIC, Precision.INT8_DYNAMIC}
    assert zero.budgets.max_model_bytes is not None
    assert zero.budgets.max_model_bytes <= 8 * 1024 * 1024


def test_the_cortex_m4_is_a_microcontroller_whose_budgets_fit_its_memories() -> None:
    m4 = load_profile("cortex-m4")
    assert (m4.cpu.name, m4.cpu.arch, m4.cpu.cores, m4.daemon) == ("Cortex-M4", "armv7e-m", 1, False)
    assert {"dsp", "fpv4_sp"} <= set(m4.cpu.isa_features)
    assert [(t.backend, t.precision) for t in m4.targets] == [("tflite-micro", Precision.INT8_STATIC)]
    part = m4.microcontroller
    assert part is not None and m4.memory_mb is None
    assert (part.part, part.flash_bytes, part.sram_bytes, part.largest_sram_block_bytes) == (
        "STM32F407VG",
        1024 * 1024,
        192 * 1024,
        128 * 1024,
    )
    assert m4.budgets.max_model_bytes is not None and m4.budgets.max_model_bytes < part.flash_bytes
    assert m4.budgets.max_arena_bytes is not None and m4.budgets.max_arena_bytes < part.largest_sram_block_bytes


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("max_model_bytes = 786_432", "max_model_bytes = 2_000_000", "budgets.max_model_bytes: 2000000 is more than "
         "microcontroller.flash_bytes (1048576)"),
        ("max_arena_bytes = 98_304", "max_arena_bytes = 150_000", "budgets.max_arena_bytes: 150000 is more than "
         "microcontroller.largest_sram_block_bytes (131072)"),
        ('[microcontroller]\npart = "STM32F407VG"', '[wrong]\npart = "STM32F407VG"', "wrong: unknown key"),
    ],
)  # fmt: skip
def test_a_microcontroller_budget_over_its_memories_is_refused(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    text = (Path(device_profiles.__file__).parent / "profiles" / "cortex-m4.toml").read_text(encoding="utf-8")
    assert old in text
    with pytest.raises(ProfileError) as caught:
        load_profile(write_profile(tmp_path, text.replace(old, new, 1)))
    assert expected in str(caught.value)


def test_a_profile_without_memory_mb_needs_a_microcontroller_section(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"memory_mb: required field is missing \(or a \[microcontroller\]"):
        load_profile(write_profile(tmp_path, VALID_TOML.replace("memory_mb = 2048\n", "")))


def test_public_api_is_listed() -> None:
    assert set(device_profiles.__all__) == {
        "Profile",
        "Target",
        "Budgets",
        "Cpu",
        "Precision",
        "load_profile",
        "list_profiles",
        "profile_ids",
        "profile_json_schema",
        "ProfileError",
    }
    assert [precision.value for precision in Precision] == [
        "fp32",
        "fp16",
        "int8-dynamic",
        "int8-static",
        "int8-weights",
    ]
    assert [p.value for p in Precision if p.integer] == ["int8-dynamic", "int8-static", "int8-weights"]


# Loading and its errors


def test_unknown_id_lists_the_valid_ids() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("xyz")
    assert str(caught.value) == (
        f"unknown profile 'xyz'; valid profiles: {', '.join(profile_ids())} (or --profile path/to/file.toml)"
    )


def test_user_file_loads_by_path(tmp_path: Path) -> None:
    path = write_profile(tmp_path, VALID_TOML)
    for given in (str(path), path):
        profile = load_profile(given)
        assert profile.id == "my-board"
        assert profile.source == str(path)
        assert [target.precision for target in profile.targets] == [Precision.INT8_STATIC, Precision.FP32]
        assert profile.budgets.max_memory_mb is None
        assert profile.cpu.max_freq_mhz is None


def test_user_file_id_need_not_match_its_file_name(tmp_path: Path) -> None:
    assert load_profile(write_profile(tmp_path, VALID_TOML, "other-name.toml")).id == "my-board"


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ProfileError, match="not found") as caught:
        load_profile(missing)
    assert str(missing) in str(caught.value)


def test_bundled_name_with_toml_suffix_gets_a_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError, match=r"use 'rpi5' without \.toml"):
        load_profile("rpi5.toml")


def test_bundled_profile_whose_id_differs_from_its_file_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_profile(tmp_path, VALID_TOML, "not-my-board.toml")
    monkeypatch.setattr(profile_loader, "_bundled_dir", lambda: tmp_path)
    with pytest.raises(ProfileError, match="id: 'my-board' does not match the file name") as caught:
        list_profiles()
    assert "not-my-board.toml" in str(caught.value)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('name = "My board"', 'name = "My board', ["not valid TOML", "line 2, column"]),
        (
            'precision = "fp32"',
            'precision = "fp8"',
            ["targets[1].precision", "'fp8'", "valid: fp32, fp16, int8-dynamic, int8-static"],
        ),
        ('arch = "aarch64"', 'arch = "arm64"', ["cpu.arch", "valid: aarch64, armv7l, x86_64"]),
        ("memory_mb = 2048\n", "", ["memory_mb: required field is missing"]),
        ("threads = 2\n", "threads = 2\nthread = 2\n", ["targets[1].thread: unknown key", "threads"]),
        ("cores = 4", "cores = 0", ["cpu.cores", "greater than 0"]),
        ("cores = 4", 'cores = "4"', ["cpu.cores", "valid integer"]),
        ("min_cosine = 0.99", "min_cosine = 1.5", ["budgets.min_cosine", "less than or equal to 1"]),
        ('backend = "litert"', 'backend = "LiteRT"', ["targets[0].backend"]),
        ("threads = 4", "threads = 8", ["targets[0].threads", "cpu.cores"]),
        ('id = "my-board"', 'source = "x"\nid = "my-board"', ["source: unknown key"]),
    ],
)
def test_broken_profile_names_the_file_and_the_field(tmp_path: Path, old: str, new: str, expected: list[str]) -> None:
    assert old in VALID_TOML
    path = write_profile(tmp_path, VALID_TOML.replace(old, new, 1))
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert str(path) in message
    for part in expected:
        assert part in message


def test_every_failing_field_is_reported(tmp_path: Path) -> None:
    text = VALID_TOML.replace("cores = 4", "cores = 0").replace('precision = "fp32"', 'precision = "fp8"')
    with pytest.raises(ProfileError) as caught:
        load_profile(write_profile(tmp_path, text))
    lines = str(caught.value).splitlines()
    assert len(lines) == 3
    assert "2 problems" in lines[0]
    assert any("cpu.cores" in line for line in lines[1:])
    assert any("targets[1].precision" in line for line in lines[1:])


def test_profiles_are_frozen() -> None:
    profile = load_profile("rpi5")
    with pytest.raises(ValueError):
        profile.memory_mb = 1  # type: ignore[misc]


def test_json_schema_describes_the_file_format() -> None:
    schema = profile_json_schema()
    assert "properties" in schema
    assert "source" not in schema["properties"]
    assert set(schema["required"]) >= {"id", "cpu", "targets", "budgets"}


# The command line


def test_cli_list_prints_an_aligned_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["ID", "NAME"]
    assert [line.split()[0] for line in lines[1:]] == profile_ids()
    assert "Cortex-A76" in next(line for line in lines if line.startswith("rpi5 "))
    name_column = lines[0].index("NAME")
    assert all(line[name_column - 1] == " " and line[name_column] != " " for line in lines)


def test_cli_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [entry["id"] for entry in listed] == profile_ids()
    assert all(Profile.model_validate(entry) for entry in listed)


def test_cli_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "show", "rpi5"]) == 0
    out = capsys.readouterr().out
    assert "Raspberry Pi 5" in out
    assert "1. litert" in out and "int8-static" in out
    assert "on the device" in out
    assert "0.99" in out


def test_cli_show_json_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "show", "jetson-orin-nano", "--json"]) == 0
    shown = Profile.model_validate(json.loads(capsys.readouterr().out))
    assert shown == load_profile("jetson-orin-nano").model_copy(update={"source": ""})


def test_cli_show_a_user_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_profile(tmp_path, VALID_TOML)
    assert main(["profiles", "show", str(path)]) == 0
    assert "my-board: My board" in capsys.readouterr().out


def test_cli_unknown_id_exits_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "show", "xyz"]) == 2
    captured = capsys.readouterr()
    assert "unknown profile 'xyz'" in captured.err
    assert ", ".join(profile_ids()) in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_cli_broken_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_profile(tmp_path, VALID_TOML.replace('precision = "fp32"', 'precision = "fp8"'))
    assert main(["profiles", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "targets[1].precision" in err
    assert "Traceback" not in err


def test_cli_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "schema"]) == 0
    out = capsys.readouterr().out
    assert "\n  " in out  # indented
    assert "properties" in json.loads(out)


def test_importing_the_package_imports_nothing_else_of_ours() -> None:
    code = (
        "import sys, edgeline.device_profiles, edgeline.device_profiles.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('edgeline.') and m.split('.')[1] != 'device_profiles'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    assert result.stderr == ""


@pytest.mark.parametrize("profile_id", profile_ids())
def test_every_profile_with_an_int8_target_has_a_quantized_share_budget(profile_id: str) -> None:
    """An "int8" bundle that computes mostly in float must not pass on any bundled profile (iphone-15-pro and mac-m2
    had none: ExecuTorch int8 passed there with a quarter of its operators in int8)."""
    profile = load_profile(profile_id)
    if any(target.precision.integer for target in profile.targets):
        assert profile.budgets.min_quantized_share is not None
        assert profile.budgets.min_quantized_share >= 0.5
