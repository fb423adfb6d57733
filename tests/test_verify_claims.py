"""`verify` and `bundle show` claim no more than was measured: a device budget (latency, memory) is checked only on a
machine of the bundle's device kind, the file named is the file that ran, and memory is measured, not assumed.

The machine-kind rule is a pure function, fed here with the /proc/cpuinfo texts of other machines (parsing, not a
stand-in for anything a user runs). Everything else runs the real `edgeline` on real bundles: the session's LiteRT
bundle (or its committed copy in the device tier) with its manifest's `device` set to this machine's kind or to
another, and Ethos-U bundles exported here with real vela.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgeline.cli import main
from edgeline.machine import X86_64_LEVELS, Machine, from_facts, mismatch, normalise_arch, this_machine
from edgeline.manifest import Device
from edgeline.memory import resident_mb
from tests.cache import cached_export

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

RPI5_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x4
CPU part\t: 0xd0b
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 108.00
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x4
CPU part\t: 0xd0b
CPU revision\t: 1

Revision\t: d04170
Model\t\t: Raspberry Pi 5 Model B Rev 1.0
"""

BIG_LITTLE_CPUINFO = """\
processor\t: 0
CPU implementer\t: 0x41
CPU part\t: 0xd05

processor\t: 4
CPU implementer\t: 0x41
CPU part\t: 0xd41
"""

JETSON_CPUINFO = "processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd42\n"
QUALCOMM_OWN_CORE = "processor\t: 0\nCPU implementer\t: 0x51\nCPU part\t: 0xd0b\n"  # not Arm's part numbering


def _x86_cpuinfo(flags: set[str]) -> str:
    return (
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 154\n"
        f"model name\t: 12th Gen Intel(R) Core(TM) i7-1260P\nflags\t\t: fpu vme {' '.join(sorted(flags))}\n"
    )


# ---------------------------------------------------------------------------------------------------------------------
# the machine-kind rule (pure)


@pytest.mark.quick
def test_arch_names_are_normalised() -> None:
    assert [normalise_arch(name) for name in ("arm64", "AMD64", "aarch64", "x86_64")] == [
        "aarch64", "x86_64", "aarch64", "x86_64",
    ]  # fmt: skip


@pytest.mark.quick
def test_an_arm_core_is_read_from_its_part_number() -> None:
    rpi5 = from_facts("aarch64", RPI5_CPUINFO)
    assert rpi5.cores == {"Cortex-A76"}
    assert rpi5.cpu == "Raspberry Pi 5 Model B Rev 1.0: 2 x Cortex-A76"
    assert mismatch(Device(arch="aarch64", cpu="Cortex-A76"), rpi5) is None
    other = mismatch(Device(arch="aarch64", cpu="Cortex-A55"), rpi5)
    assert other == "measured on aarch64 (Raspberry Pi 5 Model B Rev 1.0: 2 x Cortex-A76), not on an aarch64 Cortex-A55"


@pytest.mark.quick
def test_a_core_name_is_matched_whole() -> None:
    """Cortex-A78 is not a Cortex-A78AE (Jetson Orin), nor the reverse."""
    jetson = from_facts("aarch64", JETSON_CPUINFO)
    assert jetson.cores == {"Cortex-A78AE"}
    assert mismatch(Device(arch="aarch64", cpu="Cortex-A78AE"), jetson) is None
    assert mismatch(Device(arch="aarch64", cpu="Cortex-A78"), jetson) is not None
    assert mismatch(Device(arch="aarch64", cpu="Cortex-A78AE"), from_facts("aarch64", BIG_LITTLE_CPUINFO)) is not None


@pytest.mark.quick
def test_a_profile_naming_several_cores_matches_a_machine_with_one_of_them() -> None:
    machine = from_facts("aarch64", BIG_LITTLE_CPUINFO)
    assert machine.cores == {"Cortex-A55", "Cortex-A78"}
    assert mismatch(Device(arch="aarch64", cpu="Kryo 670 (Cortex-A78 + Cortex-A55)"), machine) is None
    assert mismatch(Device(arch="aarch64", cpu="Cortex-X4 + Cortex-A720 + Cortex-A520"), machine) is not None


@pytest.mark.quick
def test_another_implementer_s_part_number_is_no_arm_core() -> None:
    machine = from_facts("aarch64", QUALCOMM_OWN_CORE)
    assert machine.cores == frozenset()
    assert mismatch(Device(arch="aarch64", cpu="Cortex-A76"), machine) is not None


@pytest.mark.quick
def test_an_x86_64_level_needs_every_feature_of_the_level() -> None:
    v3 = set(X86_64_LEVELS["x86-64-v3"])
    assert {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"} <= v3
    machine = from_facts("x86_64", _x86_cpuinfo(v3))
    assert machine.cpu == "12th Gen Intel(R) Core(TM) i7-1260P"  # not x86's numeric "model"
    assert mismatch(Device(arch="x86_64", cpu="x86-64-v3"), machine) is None
    assert mismatch(Device(arch="x86_64", cpu="x86-64-v2"), machine) is None
    lacking = mismatch(Device(arch="x86_64", cpu="x86-64-v4"), machine)
    assert lacking is not None and "lacks avx512bw" in lacking
    older = from_facts("x86_64", _x86_cpuinfo(v3 - {"avx2", "movbe"}))
    reason = mismatch(Device(arch="x86_64", cpu="x86-64-v3"), older)
    assert reason is not None and reason.endswith("(this CPU lacks avx2, movbe)")


@pytest.mark.quick
def test_another_architecture_is_never_the_device() -> None:
    workstation = from_facts("AMD64", _x86_cpuinfo(set(X86_64_LEVELS["x86-64-v3"])))
    assert workstation.arch == "x86_64"
    reason = mismatch(Device(arch="aarch64", cpu="Cortex-A76"), workstation)
    assert reason is not None and reason.startswith("measured on x86_64 (12th Gen Intel(R) Core(TM) i7-1260P)")
    assert mismatch(Device(arch="armv8.1-m", cpu="Cortex-M55"), from_facts("aarch64", RPI5_CPUINFO)) is not None


@pytest.mark.integration
def test_an_emulator_is_never_the_device() -> None:
    """qemu-user fakes uname and (QEMU 8.1 on) /proc/cpuinfo, but not the kernel's /proc/sys/kernel/arch."""
    emulated = from_facts("aarch64", RPI5_CPUINFO, kernel_arch="x86_64")
    assert emulated.emulated is not None and "x86_64" in emulated.emulated
    reason = mismatch(Device(arch="aarch64", cpu="Cortex-A76"), emulated)
    assert reason is not None and "emulated by qemu-user" in reason
    assert from_facts("aarch64", RPI5_CPUINFO, kernel_arch="aarch64").emulated is None
    rosetta = from_facts("x86_64", _x86_cpuinfo(set(X86_64_LEVELS["x86-64-v3"])), translated=True)
    assert mismatch(Device(arch="x86_64", cpu="x86-64-v3"), rosetta) is not None


@pytest.mark.quick
def test_an_apple_cpu_is_matched_by_its_brand_string() -> None:
    mac = from_facts("arm64", brand="Apple M2")
    assert mismatch(Device(arch="aarch64", cpu="Apple M2"), mac) is None
    assert mismatch(Device(arch="aarch64", cpu="Apple A17 Pro"), mac) is not None
    assert mismatch(Device(arch="aarch64", cpu="Apple M2"), from_facts("arm64", brand="Apple M1")) is not None


@pytest.mark.quick
def test_a_machine_whose_cpu_says_nothing_is_not_the_device() -> None:
    unknown = from_facts("aarch64", "")
    assert unknown.cpu == "CPU not identified"
    assert mismatch(Device(arch="aarch64", cpu="Cortex-A76"), unknown) is not None


# ---------------------------------------------------------------------------------------------------------------------
# resident memory


@pytest.mark.quick
def test_resident_memory_added_is_measured() -> None:
    """A 64 MiB array, written (so resident), held by what the callable returns: measured in a fresh process, as
    export measures a bundle. In a test worker, whatever earlier tests left running or freeing moves the resident
    set meanwhile (once 32 MB of the 64 were seen)."""
    if resident_mb() is None:
        pytest.skip("no /proc/self/status here")
    code = (
        "import numpy as np; from edgeline.memory import resident_mb_added; "
        "print(resident_mb_added(lambda: np.ones(64 * 2**20, dtype=np.uint8)), resident_mb_added(lambda: None))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    added, nothing = (float(word) for word in done.stdout.split())
    assert 60 <= added <= 80, done.stdout
    assert 0 <= nothing < 60, done.stdout


# ---------------------------------------------------------------------------------------------------------------------
# verify on real bundles


def _this_machine_s_device() -> Device:
    """This machine's kind as a profile would name it (or skip where it cannot be named)."""
    machine: Machine = this_machine()
    if machine.emulated is not None:
        pytest.skip(f"this machine is emulated ({machine.emulated})")
    if machine.cores:
        return Device(arch=machine.arch, cpu=sorted(machine.cores)[0])
    if machine.arch == "x86_64" and X86_64_LEVELS["x86-64-v3"] <= machine.flags:
        return Device(arch="x86_64", cpu="x86-64-v3")
    if machine.cpu != "CPU not identified":
        return Device(arch=machine.arch, cpu=machine.cpu)
    pytest.skip("this machine's CPU cannot be identified")


def _another_device() -> Device:
    if normalise_arch(platform.machine()) == "x86_64":
        return Device(arch="aarch64", cpu="Cortex-A76")
    return Device(arch="x86_64", cpu="x86-64-v3")


def _with_device(bundle: Path, device: Device | None) -> Path:
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    manifest.pop("device", None)
    if device is not None:
        manifest["device"] = device.model_dump()
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return bundle


def _verify_json(bundle: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    assert main(["verify", str(bundle), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    return report, {check["check"]: check for check in report["checks"]}


@pytest.mark.quick
def test_latency_on_another_machine_is_not_checked_against_the_device_budget(
    litert_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    device = _another_device()
    _with_device(litert_bundle, device)
    assert main(["verify", str(litert_bundle)]) == 0
    lines = capsys.readouterr().out.splitlines()
    latency = next(line for line in lines if "latency:" in line)
    host = this_machine().describe()
    assert latency.startswith("n/a   latency: median ")
    assert latency.endswith(
        f"; not checked against the rpi5 budget of 50 ms: measured on {host}, not on an {device.arch} {device.cpu}"
    )
    assert lines[-1] == "tiny v1: verified (not checked: latency, memory)"

    report, checks = _verify_json(litert_bundle, capsys)
    assert checks["latency"]["ok"] is None and checks["latency"]["budget_ms"] == 50
    assert checks["latency"]["reason"].startswith(f"measured on {host}")
    assert checks["latency"]["device"] == device.model_dump()
    assert report["ok"] is True and report["not_checked"] == ["latency", "memory"]


@pytest.mark.quick
def test_a_bundle_that_does_not_name_its_device_is_not_checked(
    litert_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, checks = _verify_json(_with_device(litert_bundle, None), capsys)
    for kind in ("latency", "memory"):
        assert checks[kind]["ok"] is None
        assert checks[kind]["reason"] == "the bundle does not name its device (exported before manifests recorded it)"


@pytest.mark.quick
def test_on_a_machine_of_the_device_s_kind_latency_and_memory_are_checked(
    litert_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _with_device(litert_bundle, _this_machine_s_device())
    if resident_mb() is None:
        pytest.skip("no /proc/self/status here: memory cannot be measured")
    report, checks = _verify_json(litert_bundle, capsys)
    latency, memory = checks["latency"], checks["memory"]
    assert latency["reason"] is None and latency["ok"] is (latency["median_ms"] <= latency["budget_ms"])
    assert memory["reason"] is None and memory["budget_mb"] == 1024
    assert memory["resident_mb"] > 0 and memory["ok"] is (memory["resident_mb"] <= 1024)
    assert report["not_checked"] == []
    assert main(["verify", str(litert_bundle)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "tiny v1: verified"
    assert any(line.startswith("ok    memory: loading the model and running it once adds ") for line in lines)
    assert any(line.endswith("; rpi5 budget 1024 MB") for line in lines)


@pytest.mark.quick
@pytest.mark.workstation  # TFLite Micro comes with the ethos-u extra, not the base install
def test_another_runtime_s_figures_are_not_the_bundle_s(
    litert_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--backend tflite-micro runs the same .tflite with another runtime: its speed is not the bundle's."""
    _with_device(litert_bundle, _this_machine_s_device())
    assert main(["verify", str(litert_bundle), "--json", "--backend", "tflite-micro"]) == 0
    checks = {check["check"]: check for check in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["latency"]["ok"] is None
    assert checks["latency"]["reason"] == "run with tflite-micro, not with the bundle's runtime litert"


@pytest.mark.quick
def test_verify_measures_the_memory_the_model_adds(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _with_device(litert_bundle, _another_device())
    _, checks = _verify_json(litert_bundle, capsys)
    memory = checks["memory"]
    if resident_mb() is None:
        assert memory["resident_mb"] is None and memory["reason"].startswith("not measured: ")
        return
    assert memory["resident_mb"] > 0 and memory["budget_mb"] == 1024
    assert memory["ok"] is None and memory["reason"].startswith("measured on ")


# ---------------------------------------------------------------------------------------------------------------------
# bundle show: memory at export, or why not, never the budget as if it were checked


def _set_memory(bundle: Path, memory: dict[str, Any] | None) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    manifest.pop("memory", None)
    if memory is not None:
        manifest["memory"] = memory
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def _memory_line(bundle: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["bundle", "show", str(bundle)]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("memory:"))


@pytest.mark.quick
def test_show_says_when_memory_was_not_measured(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _set_memory(litert_bundle, None)
    assert _memory_line(litert_bundle, capsys) == (
        "memory:       not measured at export (the manifest has no memory figures); profile budget 1,024 MB, "
        "not checked: `edgeline verify` checks it on the device"
    )
    _set_memory(litert_bundle, {"resident_mb": None, "unknown": {"resident_mb": "the runtime cannot run here"}})
    assert _memory_line(litert_bundle, capsys) == (
        "memory:       resident not measured at export: the runtime cannot run here; profile budget 1,024 MB, "
        "not checked: `edgeline verify` checks it on the device"
    )
    assert main(["bundle", "show", str(litert_bundle), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["memory"]["resident_mb"] is None and info["memory"]["max_memory_mb"] == 1024


@pytest.mark.quick
def test_show_gives_the_memory_measured_at_export(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _set_memory(litert_bundle, {"resident_mb": 3.25, "measured_with": "litert 1.4 on x86_64"})
    assert _memory_line(litert_bundle, capsys) == (
        "memory:       3.2 MB resident (measured at export with litert 1.4 on x86_64); profile budget 1,024 MB, "
        "not checked: `edgeline verify` checks it on the device"
    )


# ---------------------------------------------------------------------------------------------------------------------
# an Ethos-U bundle: verify names the file that ran


TINY_SHAPE = (1, 8, 8)


@pytest.fixture(scope="module")
def ethos_u_bundles(tiny_model_file: Path, sample_files: dict[str, Path]) -> dict[str, Path]:
    """The tiny model for the i.MX 93 (LiteRT, vela for its Ethos-U65) and for a Cortex-M55 with an Ethos-U55
    (TFLite Micro): real vela, real exports (once for this code: tests/cache.py)."""
    from tests.conftest import needs_torch

    needs_torch("the ethos_u_bundles fixture")
    samples = ["--calibration", sample_files["calibration"], "--validation", sample_files["validation"]]
    return {
        profile: cached_export(f"{tiny_model_file}:model", "--profile", profile, *samples, *extra)
        for profile, extra in (("imx93", []), ("ethos-u55-128", ["--backend", "ethos-u", "--precision", "int8-static"]))
    }


@pytest.mark.export
@pytest.mark.workstation
@pytest.mark.parametrize(("profile", "backend"), [("imx93", "litert"), ("ethos-u55-128", "tflite-micro")])
def test_verify_names_the_int8_model_that_ran_without_the_npu(
    ethos_u_bundles: dict[str, Path],
    profile: str,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle = ethos_u_bundles[profile]
    monkeypatch.setenv("EDGELINE_ETHOSU_DELEGATE", str(tmp_path / "absent.so"))  # no NPU here, whatever the host
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    assert (manifest["model"], manifest["backend"]) == ("model_vela.tflite", backend)
    assert main(["verify", str(bundle), "--json"]) == 0
    load = next(check for check in json.loads(capsys.readouterr().out)["checks"] if check["check"] == "load")
    assert (load["model"], load["bundle_model"], load["accelerator"]) == (
        "model_int8.tflite",
        "model_vela.tflite",
        None,
    )
    assert main(["verify", str(bundle)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "load:" in line)
    assert line.startswith(f"ok    load: {backend} opened model_int8.tflite in place of model_vela.tflite (WARNING: ")
