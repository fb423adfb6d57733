"""``edgeline doctor``: the machine report, and the verdict on a bundle that ``run``, ``verify`` and ``infer`` share.

The verdict is a pure function of the manifest, the bundle's files and the machine's facts: tested here with the
facts of machines this one is not (a Pi with an Ethos-U delegate, a Snapdragon with the HTP, macOS). On this machine,
the CLI refuses what cannot run with exit code 2 before opening the model, and the verdict agrees with what the
session then really does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgeline import read_bundle
from edgeline.cli import main
from edgeline.device_profiles import load_profile
from edgeline.doctor import (
    RUNTIMES,
    Facts,
    RuntimeFacts,
    cpu_features,
    gather,
    report,
    verdict,
)
from edgeline.machine import Machine, from_facts
from edgeline.manifest import Manifest

pytestmark = pytest.mark.device

PI4_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd08
CPU revision\t: 3

Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""
PI5_FEATURES = (
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
)
PI5_CPUINFO = f"processor\t: 0\n{PI5_FEATURES}\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n"


def _facts(machine: Machine | None = None, **overrides: Any) -> Facts:
    runtimes = {
        "litert": RuntimeFacts(version="2.3.0", imports=True),
        "onnxruntime": RuntimeFacts(version="1.24.2", imports=True, providers=("CPUExecutionProvider",)),
        "coreml": RuntimeFacts(version=None, imports=False, error="coremltools is not installed"),
        "tflite-micro": RuntimeFacts(version="0.dev1", imports=True),
    }
    fields: dict[str, Any] = {
        "system": "Linux",
        "machine": machine or from_facts("aarch64", PI4_CPUINFO),
        "runtimes": runtimes,
        "ethos_u_delegate": None,
        "ethos_u_missing": "no Ethos-U delegate at /usr/lib/libethosu_delegate.so",
        "qnn_missing": "onnxruntime-qnn is not installed",
    }
    fields.update(overrides)
    return Facts(**fields)


def _manifest(bundle: Path, **changes: Any) -> Manifest:
    data = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    for key, value in changes.items():
        data[key] = value
    if not any(entry["path"] == data["model"] for entry in data["files"]):  # another runtime's model file
        data["files"].append({"path": data["model"], "size": 1, "sha256": "0" * 64})
    return Manifest.model_validate(data)


def _placement(accelerator: str) -> dict[str, Any]:
    return {"accelerator": accelerator}


def _rewrite(bundle: Path, **changes: Any) -> None:
    data = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    data.update(changes)
    (bundle / "manifest.json").write_text(json.dumps(data, indent=2), encoding="utf-8")


# --- the verdict, on other machines' facts -----------------------------------------------------------------------


@pytest.mark.quick
def test_a_litert_bundle_runs_on_the_cpu_and_a_pi4_is_its_device_kind_only_for_a_pi4_profile(
    built_litert_bundle: Path,
) -> None:
    manifest = _manifest(built_litert_bundle, device={"arch": "aarch64", "cpu": "Cortex-A72"})
    files = {entry.path for entry in manifest.files}
    found = verdict(manifest, files, _facts())
    assert (found.runs, found.backend, found.accelerator, found.fallback, found.device) == (
        True, "litert", None, None, None,
    )  # fmt: skip
    on_pi5 = verdict(manifest, files, _facts(from_facts("aarch64", PI5_CPUINFO)))
    assert on_pi5.runs and on_pi5.device is not None and "not on an aarch64 Cortex-A72" in on_pi5.device


@pytest.mark.quick
def test_emulation_is_named_and_never_the_device(built_litert_bundle: Path) -> None:
    emulated = from_facts("aarch64", PI4_CPUINFO, kernel_arch="x86_64", emulator="qemu-user 10.0.2 -cpu cortex-a72")
    manifest = _manifest(built_litert_bundle, device={"arch": "aarch64", "cpu": "Cortex-A72"})
    found = verdict(manifest, {e.path for e in manifest.files}, _facts(emulated))
    assert found.runs
    assert found.emulated == "qemu-user 10.0.2 -cpu cortex-a72 (the kernel is x86_64)"
    assert found.device is not None and "emulated by qemu-user 10.0.2" in found.device
    # the variable alone, on a machine whose kernel is its own, emulates nothing
    assert from_facts("aarch64", PI4_CPUINFO, kernel_arch="aarch64", emulator="qemu-user").emulated is None


@pytest.mark.quick
def test_a_core_ml_model_is_refused_off_macos_and_runs_on_macos(built_litert_bundle: Path) -> None:
    manifest = _manifest(built_litert_bundle, backend="coreml", model="model.tflite")
    files = {e.path for e in manifest.files}
    refused = verdict(manifest, files, _facts())
    assert not refused.runs and refused.reason == "Core ML runs on macOS only (this is Linux)"
    mac = _facts(from_facts("arm64", brand="Apple M2"), system="Darwin",
                 runtimes={"coreml": RuntimeFacts(version="9.0", imports=True)})  # fmt: skip
    assert verdict(manifest, files, mac).runs


@pytest.mark.quick
def test_ethos_u_runs_on_its_delegate_falls_back_to_the_int8_copy_or_is_refused(built_litert_bundle: Path) -> None:
    manifest = _manifest(built_litert_bundle, placement=_placement("ethos-u"))
    files = {e.path for e in manifest.files}
    with_npu = verdict(manifest, files, _facts(ethos_u_delegate="/usr/lib/libethosu_delegate.so"))
    assert (with_npu.runs, with_npu.accelerator, with_npu.fallback) == (True, "ethos-u", None)
    with_copy = verdict(manifest, files | {"model_int8.tflite"}, _facts())
    assert with_copy.runs and with_copy.model == "model_int8.tflite" and with_copy.accelerator is None
    assert with_copy.fallback is not None and "no Ethos-U delegate" in with_copy.fallback
    without = verdict(manifest, files, _facts())
    assert not without.runs
    assert "vela model" in without.reason and "no model_int8.tflite" in without.reason


@pytest.mark.quick
def test_a_qnn_context_binary_runs_on_the_htp_of_its_soc_only(built_litert_bundle: Path) -> None:
    qnn = _manifest(built_litert_bundle, backend="onnxruntime", model="model.onnx", placement=_placement("qnn-htp"))
    context = {"model.onnx", "model_qnn.bin", "golden.npz"}
    profile = load_profile("qcs6490")
    htp = _facts(qnn_missing=None, soc="QCS6490")
    assert verdict(qnn, context, htp, profile=profile).accelerator == "qnn-htp"
    other_soc = _facts(qnn_missing=None, soc="SM8650")
    refused = verdict(qnn, context, other_soc, profile=profile)
    assert not refused.runs
    assert "soc_model 93, Qualcomm QCS6490; this SoC is SM8650" in refused.reason and "no QDQ copy" in refused.reason
    with_copy = verdict(qnn, context | {"model.qdq.onnx"}, other_soc, profile=profile)
    assert with_copy.runs and with_copy.model == "model.qdq.onnx" and with_copy.accelerator is None
    assert with_copy.fallback is not None and "this SoC is SM8650" in with_copy.fallback
    no_qnn = verdict(qnn, context, _facts(), profile=profile)
    assert not no_qnn.runs and "onnxruntime-qnn is not installed" in no_qnn.reason


@pytest.mark.quick
def test_a_missing_gpu_provider_falls_back_to_the_cpu_loudly(built_litert_bundle: Path) -> None:
    manifest = _manifest(
        built_litert_bundle,
        backend="onnxruntime",
        model="model.onnx",
        placement=_placement("TensorrtExecutionProvider"),
    )
    files = {"model.onnx", "golden.npz"}
    cpu = verdict(manifest, files, _facts())
    assert cpu.runs and cpu.accelerator is None
    assert cpu.fallback == "TensorrtExecutionProvider is not in this onnxruntime (it has CPUExecutionProvider)"
    gpus = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
    jetson = _facts(runtimes={"onnxruntime": RuntimeFacts(version="1.24.2", imports=True, providers=gpus)})
    on_gpu = verdict(manifest, files, jetson)
    assert (on_gpu.accelerator, on_gpu.fallback) == ("TensorrtExecutionProvider", None)


@pytest.mark.quick
def test_a_missing_or_too_old_runtime_is_refused_with_how_to_get_it(built_litert_bundle: Path) -> None:
    manifest = _manifest(built_litert_bundle, backend="onnxruntime", model="model.onnx")
    files = {"model.onnx", "golden.npz"}
    missing = verdict(manifest, files, _facts(runtimes={}))
    assert not missing.runs
    assert missing.reason == "its runtime onnxruntime is not installed here: pip install 'edgeline[onnx]'"
    old = _manifest(built_litert_bundle, runtime={"package": "ai-edge-litert", "min_version": "2.10"})
    too_old = verdict(old, files, _facts())
    assert not too_old.runs and too_old.reason == "it needs ai-edge-litert >= 2.10; this machine has 2.3.0"
    micro = _manifest(built_litert_bundle, backend="tflite-micro")
    assert "x86-64 Linux only" in verdict(micro, files, _facts()).reason


# --- the machine report ---------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_cpu_features_name_what_each_core_has() -> None:
    pi4 = cpu_features(from_facts("aarch64", PI4_CPUINFO), PI4_CPUINFO)
    assert pi4["neon"] and not pi4["dotprod"] and not pi4["i8mm"] and not pi4["sve"] and not pi4["fp16"]
    pi5 = cpu_features(from_facts("aarch64", PI5_CPUINFO), PI5_CPUINFO)
    assert pi5["neon"] and pi5["dotprod"] and pi5["fp16"] and not pi5["i8mm"] and not pi5["sve"]


@pytest.mark.quick
def test_the_report_names_the_profiles_a_machine_is_emulates_or_runs() -> None:
    from edgeline.device_profiles import list_profiles

    pi4 = report(_facts(), list_profiles(), PI4_CPUINFO)
    assert pi4["profiles"]["matches"] == ["rpi4"]
    assert "litert int8-static" in pi4["profiles"]["runs"]["rpi4"]
    assert pi4["accelerators"]["coreml"]["present"] is False
    emulated = from_facts("aarch64", PI4_CPUINFO, kernel_arch="x86_64", emulator="qemu-user 10.0.2 -cpu cortex-a72")
    under_qemu = report(_facts(emulated), list_profiles(), PI4_CPUINFO)
    assert under_qemu["profiles"]["matches"] == [] and under_qemu["profiles"]["emulates"] == ["rpi4"]
    assert under_qemu["machine"]["emulated"].startswith("qemu-user 10.0.2")


@pytest.mark.quick
def test_doctor_reports_this_machine_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["machine"]["arch"] in ("x86_64", "aarch64")
    assert document["runtimes"]["litert"]["imports"] is True  # the base install's runtime
    assert set(document["runtimes"]) == set(RUNTIMES)
    assert document["machine"]["cpus"] >= 1 and document["machine"]["memory_mb"]["total"] > 0


@pytest.mark.quick
def test_doctor_text_names_the_runtimes_and_accelerators(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for heading in ("machine:", "emulated:", "features:", "memory:", "os:", "runtimes:", "accelerators:", "profiles:"):
        assert heading in out
    assert "ethos-u" in out and "qnn-htp" in out and "tensorrt" in out


# --- one check, shared by doctor, run, verify and infer -------------------------------------------------------------


@pytest.mark.quick
def test_doctor_bundle_and_load_agree_on_this_machine(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(litert_bundle), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    import edgeline

    model = edgeline.load(litert_bundle)
    assert (said["runs"], said["backend"], said["model"], said["accelerator"]) == (
        True, model.backend, model.model_file, model.accelerator,
    )  # fmt: skip
    assert said["fallback"] is None and model.accelerator_fallback is None


@pytest.mark.quick
@pytest.mark.parametrize("command", ["verify", "infer", "run"])
def test_a_bundle_that_cannot_run_here_is_refused_with_the_reason_and_exit_2(
    litert_bundle: Path, sample_files_or_golden: Path, command: str
) -> None:
    _rewrite(litert_bundle, placement={"accelerator": "ethos-u"})  # a vela model, no delegate, no CPU copy
    args = {
        "verify": ["verify", str(litert_bundle)],
        "infer": ["infer", str(litert_bundle), "--input", str(sample_files_or_golden)],
        "run": ["run", str(litert_bundle), "--sim", "digits --count 1"],
    }[command]
    done = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"edgeline {command}: error:" in last and "cannot run here: a vela model for the Ethos-U NPU" in last
    assert "Traceback" not in done.stderr
    assert main(["doctor", str(litert_bundle)]) == 1


@pytest.fixture
def sample_files_or_golden(built_litert_bundle: Path) -> Path:
    return built_litert_bundle / "golden.npz"


@pytest.mark.quick
def test_gather_only_looks_for_runtimes_when_asked_not_to_import() -> None:
    facts = gather(["litert", "coreml"], try_import=False, qnn=False)
    assert facts.runtimes["litert"].imports is None and facts.runtimes["litert"].version is not None
    assert facts.qnn_missing == "not looked for"


@pytest.mark.quick
def test_read_bundle_is_untouched_by_doctor(litert_bundle: Path) -> None:
    before = (litert_bundle / "manifest.json").read_bytes()
    assert main(["doctor", str(litert_bundle)]) == 0
    assert (litert_bundle / "manifest.json").read_bytes() == before
    assert read_bundle(litert_bundle).manifest.name


# --- held to the exporters and to the sessions (workstation: export needs torch) -----------------------------------


@pytest.mark.quick
@pytest.mark.workstation
def test_the_target_table_is_what_the_exporters_write() -> None:
    from edgeline.doctor import TARGET_RUNTIMES
    from edgeline.export.backends import EXPORT_BACKENDS
    from edgeline.registry import resolve

    assert set(TARGET_RUNTIMES) == set(EXPORT_BACKENDS)
    for target, (runtime, _accelerator) in TARGET_RUNTIMES.items():
        exporter = resolve(EXPORT_BACKENDS, target, "export backend", RuntimeError)
        written = getattr(exporter, "runtime_backend", None)
        if target == "ethos-u":  # litert on Linux (the i.MX 93 runs it), tflite-micro elsewhere
            assert runtime == "litert"
            continue
        assert written == runtime, f"{target}: the exporter writes {written}, the table says {runtime}"


@pytest.mark.export
@pytest.mark.workstation
def test_the_verdict_is_what_the_session_does_for_a_gpu_bundle_without_its_gpu(
    tmp_path: Path, tiny_model_file: Path, sample_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import edgeline

    out = tmp_path / "jetson"
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", "jetson-orin-nano", "--backend", "onnxruntime",
         "--precision", "fp32", "--calibration", str(sample_files["calibration"]), "--validation",
         str(sample_files["validation"]), "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    capsys.readouterr()
    assert main(["doctor", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    model = edgeline.load(out)
    assert said["accelerator"] == model.accelerator is None  # no TensorRT on this machine
    assert said["model"] == model.model_file
    assert model.accelerator_fallback is not None and said["fallback"] is not None
    assert said["fallback"].startswith("TensorrtExecutionProvider is not in this onnxruntime")
    assert "TensorrtExecutionProvider" in model.accelerator_fallback


@pytest.mark.quick
def test_doctor_says_the_state_directorys_file_system_free_space_and_outbox_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a 3 MB tmpfs: its type and mount point, its free bytes, and the budget they lead to (half of it, below the
    default ``max_bytes``); an outbox already there is named with what it takes; ``[outbox] enabled = false`` says
    there is no budget on the disk."""
    from edgeline.daemon.outbox import Outbox
    from edgeline.disk import DISK_SHARE
    from tests.faults import can_mount, tmpfs

    if not can_mount():
        pytest.skip("mounting a tmpfs needs root and mount(8) (CI runs as root)")
    with tmpfs(tmp_path / "disk", "3m") as disk:
        state = disk / "state"
        Outbox(state / "tiny" / "outbox.sqlite").close()
        assert main(["doctor", "--json", "--state-dir", str(state)]) == 0
        found = json.loads(capsys.readouterr().out)["state_dir"]
        assert (found["fs_type"], found["mount_point"], found["total_bytes"]) == ("tmpfs", str(disk), 3 << 20)
        free = found["free_bytes"]
        assert 0 < free <= 3 << 20
        outbox = found["outbox"]
        assert outbox["share"] == DISK_SHARE and outbox["max_bytes"] == 64 << 20
        assert outbox["budget_bytes"] == int(DISK_SHARE * free) and outbox["wal_bytes"] == outbox["budget_bytes"] // 4
        assert set(outbox["existing"]) == {"tiny"} and outbox["existing"]["tiny"]["disk_bytes"] > 0

        assert main(["doctor", "--state-dir", str(state)]) == 0
        text = capsys.readouterr().out
        assert f"state dir:    {state} (tmpfs tmpfs mounted at {disk})" in text
        assert "outbox:       a budget of 1." in text and "50% of the free space" in text

        config = tmp_path / "daemon.toml"
        config.write_text("[outbox]\nenabled = false\n")
        assert main(["doctor", "--state-dir", str(state), "--config", str(config)]) == 0
        assert "outbox:       in memory" in capsys.readouterr().out


@pytest.mark.quick
def test_doctor_says_whether_the_camera_extra_is_installed_and_which_cameras_it_sees(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.metadata
    import importlib.util

    assert main(["doctor", "--json"]) == 0
    cameras = json.loads(capsys.readouterr().out)["cameras"]
    installed = importlib.util.find_spec("av") is not None
    assert cameras["extra"] == (importlib.metadata.version("av") if installed else None)
    assert (cameras["install"] is None) == installed
    picamera2 = [device for device in cameras["devices"] if device["kind"] == "picamera2"]
    assert picamera2 and picamera2[0]["importable"] == (importlib.util.find_spec("picamera2") is not None)
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if line.startswith("cameras:"))
    assert (f"PyAV {cameras['extra']}" if installed else "pip install 'edgeline[camera]'") in line
