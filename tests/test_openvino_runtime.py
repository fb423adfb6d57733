"""The openvino runtime backend on a device: the committed OpenVINO bundles (the tiny classifier in fp32 and int8) run
without torch, answer as OpenVINO's own API does on the same IR, compute in the precision the bundle was measured in,
batch, fall back loudly from a GPU or NPU this machine lacks, and, in the daemon, keep compiled models in the state
directory so a restart does not compile again. Everything here runs in the device tier (the base install with the
openvino extra, no torch)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import edgeline
from edgeline.backends.openvino import CACHE_KEEP, OpenVINOSession, set_cache_dir
from edgeline.doctor import Facts, RuntimeFacts, gather, verdict
from edgeline.errors import BundleError
from edgeline.model import load
from tests.tiny_bundle import COMMITTED_OV_BUNDLES

pytestmark = pytest.mark.device

BLOCK_TORCH = "import sys; sys.modules.update(dict.fromkeys(('torch', 'executorch', 'torchao', 'nncf')))\n"
"""Prefixed to a subprocess's code: the export extra's packages fail to import, as on a device."""


def golden_inputs(bundle: Path) -> np.ndarray:
    return np.load(bundle / "golden.npz")["input_0"]


def openvino_answers(model_xml: Path, inputs: np.ndarray) -> np.ndarray:
    """OpenVINO's own API on the IR, one sample per call, the CPU plugin in f32 (what the bundles were measured in)."""
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(model_xml)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return np.concatenate([np.array(request.infer([x[None]])[compiled.output(0)]) for x in inputs])


def run_cli(*args: str, code_prefix: str = BLOCK_TORCH) -> subprocess.CompletedProcess[str]:
    code = code_prefix + "from edgeline.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, check=False
    )  # fmt: skip


@pytest.fixture(autouse=True)
def no_cache() -> object:
    """Every test starts and ends without a compiled-model cache (it is process-wide)."""
    set_cache_dir(None)
    yield
    set_cache_dir(None)


@pytest.mark.quick
@pytest.mark.parametrize("name", list(COMMITTED_OV_BUNDLES))
def test_a_committed_bundle_answers_as_openvino_itself_does(name: str) -> None:
    bundle = COMMITTED_OV_BUNDLES[name]
    model = load(bundle)
    assert model.backend == "openvino" and model.accelerator is None and model.accelerator_fallback is None
    inputs = golden_inputs(bundle)
    found = np.concatenate([model.predict(x)[0] for x in inputs])
    assert np.array_equal(found, openvino_answers(bundle / "model.xml", inputs))
    golden = np.load(bundle / "golden.npz")["output_0"]
    assert np.abs(found - golden).max() <= 1e-5  # the export machine's answers (the same plugin, x86)


@pytest.mark.quick
@pytest.mark.parametrize("name", list(COMMITTED_OV_BUNDLES))
def test_the_plugin_computes_in_the_precision_the_bundle_was_measured_in(name: str) -> None:
    bundle = COMMITTED_OV_BUNDLES[name]
    session = OpenVINOSession(bundle / "model.xml")
    assert session.precision == "f32"  # the IR's rt_info: what export measured fidelity with
    assert session.computes == "f32"  # what the compiled model was told (no bf16 of its own on a CPU with it)
    text = (bundle / "model.xml").read_text()
    assert '<inference_precision value="f32"' in text


@pytest.mark.quick
def test_an_ir_asking_for_an_unknown_precision_is_a_bundle_error(tmp_path: Path) -> None:
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-fp32"]
    shutil.copy(bundle / "model.bin", tmp_path / "model.bin")
    text = (
        (bundle / "model.xml")
        .read_text()
        .replace('<inference_precision value="f32"', '<inference_precision value="i4"')
    )
    (tmp_path / "model.xml").write_text(text)
    with pytest.raises(BundleError, match=r"inference_precision is 'i4', not one of f32, f16, bf16"):
        OpenVINOSession(tmp_path / "model.xml")


@pytest.mark.quick
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncated", "OpenVINO could not read the model"),
        ("no-weights", "OpenVINO could not read the model"),
    ],
)
def test_a_broken_ir_is_one_line_naming_the_file(damage: str, expected: str, tmp_path: Path) -> None:
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    text = (bundle / "model.xml").read_bytes()
    (tmp_path / "model.xml").write_bytes(text[: len(text) // 2] if damage == "truncated" else text)
    if damage != "no-weights":
        shutil.copy(bundle / "model.bin", tmp_path / "model.bin")
    with pytest.raises(BundleError) as caught:
        OpenVINOSession(tmp_path / "model.xml")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'model.xml'}: {expected}") and "\n" not in message


@pytest.mark.quick
def test_batches_answer_as_single_calls() -> None:
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    model = load(bundle)
    assert model.enable_batching(4) == 4
    inputs = golden_inputs(bundle)[:4]
    batch = model.predict_batch([(x,) for x in inputs])
    singles = [model.predict(x) for x in inputs]
    for got, single in zip(batch, singles, strict=True):
        assert np.array_equal(got[0], single[0][0]) or np.array_equal(got[0], single[0])


@pytest.mark.quick
@pytest.mark.parametrize("device", ["GPU", "NPU"])
def test_a_device_this_machine_lacks_falls_back_to_the_cpu_and_says_why(device: str) -> None:
    import openvino as ov

    assert not any(found.startswith(device) for found in ov.Core().available_devices)  # the premise
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    session = OpenVINOSession(bundle / "model.xml", accelerator=device)
    assert session.accelerator is None
    assert session.fallback_reason is not None and f"no {device} plugin device here" in session.fallback_reason
    inputs = golden_inputs(bundle)
    assert np.array_equal(session.run([inputs[:1]])[0], openvino_answers(bundle / "model.xml", inputs[:1]))


@pytest.mark.quick
def test_doctor_reports_openvino_its_devices_and_the_verdict_for_an_npu_bundle() -> None:
    done = run_cli("doctor", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    openvino = report["runtimes"]["openvino"]
    assert openvino["imports"] is True and openvino["version"].startswith("2026.")
    assert "CPU" in openvino["devices"]
    assert report["accelerators"]["intel-npu"]["present"] is False
    assert "OpenVINO devices: CPU" in report["accelerators"]["intel-npu"]["detail"]
    manifest = edgeline.read_bundle(COMMITTED_OV_BUNDLES["tiny-ov-int8"]).manifest
    placement = manifest.placement
    assert placement is not None
    npu = manifest.model_copy(update={"placement": placement.model_copy(update={"accelerator": "NPU"})})
    found = verdict(npu, ["model.xml", "model.bin"], gather(["openvino"]))
    assert found.runs and found.accelerator is None
    assert found.fallback is not None and "OpenVINO has no NPU device here (it has CPU" in found.fallback
    assert found.reason == "the CPU plugin runs any IR"


@pytest.mark.quick
def test_the_verdict_refuses_a_bundle_without_openvino_and_names_the_extra() -> None:
    from edgeline.machine import this_machine

    facts = Facts(
        system="Linux",
        machine=this_machine(),
        runtimes={"openvino": RuntimeFacts(version=None, imports=False, error="openvino is not installed")},
    )
    manifest = edgeline.read_bundle(COMMITTED_OV_BUNDLES["tiny-ov-int8"]).manifest
    found = verdict(manifest, ["model.xml", "model.bin"], facts)
    assert not found.runs
    assert found.reason is not None and "pip install 'edgeline[openvino]'" in found.reason


@pytest.mark.integration
def test_running_an_openvino_bundle_never_imports_torch_and_a_missing_openvino_names_the_extra() -> None:
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    code = (
        BLOCK_TORCH + "import numpy as np, edgeline\n"
        "model = edgeline.load(sys.argv[1])\n"
        "model.predict(np.zeros(model.inputs[0].shape, np.float32))\n"
        "sys.exit('torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(bundle)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr or "torch was imported"
    missing = run_cli("verify", str(bundle), code_prefix=BLOCK_TORCH + "sys.modules['openvino'] = None\n")
    assert missing.returncode == 2, missing.stderr
    assert "Traceback" not in missing.stderr
    assert "pip install 'edgeline[openvino]'" in missing.stderr


# -- the compiled-model cache ---------------------------------------------------------------------------------------


@pytest.mark.quick
def test_a_second_session_loads_the_compiled_model_from_the_cache(tmp_path: Path) -> None:
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    cache = tmp_path / "cache"
    set_cache_dir(cache)
    first = OpenVINOSession(bundle / "model.xml")
    assert first.from_cache is False
    blobs = sorted(cache.glob("*.blob"))
    assert len(blobs) == 1
    second = OpenVINOSession(bundle / "model.xml")
    assert second.from_cache is True
    inputs = golden_inputs(bundle)[:1]
    assert np.array_equal(first.run([inputs])[0], second.run([inputs])[0])
    assert sorted(cache.glob("*.blob")) == blobs


@pytest.mark.quick
def test_setting_the_cache_keeps_the_newest_compiled_models_only(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    now = time.time()
    for index in range(CACHE_KEEP + 3):
        blob = cache / f"{index}.blob"
        blob.write_bytes(b"x")
        os.utime(blob, (now - 1000 + index, now - 1000 + index))
    (cache / "notes.txt").write_text("not ours")
    set_cache_dir(cache)
    kept = sorted(int(path.stem) for path in cache.glob("*.blob"))
    assert kept == list(range(3, CACHE_KEEP + 3))
    assert (cache / "notes.txt").exists()


@pytest.mark.quick
def test_a_blob_in_the_cache_that_is_not_a_regular_file_is_removed_before_openvino_reads_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    set_cache_dir(cache)
    OpenVINOSession(COMMITTED_OV_BUNDLES["tiny-ov-int8"] / "model.xml")
    (blob,) = cache.glob("*.blob")
    blob.unlink()
    os.mkfifo(blob)  # the compiled model's own name: opening it would block until a writer came
    (cache / "elsewhere.blob").symlink_to("/dev/zero")
    set_cache_dir(cache)
    assert list(cache.glob("*.blob")) == []
    session = OpenVINOSession(COMMITTED_OV_BUNDLES["tiny-ov-int8"] / "model.xml")  # compiled again, not blocked
    assert session.from_cache is False and blob.is_file()


@pytest.mark.quick
def test_a_cache_that_cannot_be_made_leaves_caching_off_and_the_model_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache's parent would be")
    with caplog.at_level(logging.WARNING, logger="edgeline.backends.openvino"):
        set_cache_dir(blocker / "cache")
    assert [r.getMessage() for r in caplog.records if "not cached" in r.getMessage()], caplog.text
    session = OpenVINOSession(COMMITTED_OV_BUNDLES["tiny-ov-int8"] / "model.xml")
    assert session.from_cache is False


@pytest.mark.quick
def test_a_corrupted_cached_model_is_compiled_again(tmp_path: Path) -> None:
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    set_cache_dir(tmp_path)
    OpenVINOSession(bundle / "model.xml")
    (blob,) = tmp_path.glob("*.blob")
    blob.write_bytes(b"\x00garbage" * 64)
    session = OpenVINOSession(bundle / "model.xml")
    inputs = golden_inputs(bundle)
    assert np.array_equal(session.run([inputs[:1]])[0], openvino_answers(bundle / "model.xml", inputs[:1]))


@pytest.mark.integration
def test_a_full_disk_under_the_cache_costs_a_compilation_never_the_model(tmp_path: Path) -> None:
    from tests.faults import can_mount, fill, tmpfs

    if not can_mount("tmpfs"):
        pytest.skip("mounting a tmpfs needs root and mount(8): CI has them")
    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    with tmpfs(tmp_path / "disk", "1m") as disk:
        set_cache_dir(disk / "cache")
        filler = disk / "filler"
        filler.touch()
        fill(filler)
        session = OpenVINOSession(bundle / "model.xml")
        inputs = golden_inputs(bundle)
        assert np.array_equal(session.run([inputs[:1]])[0], openvino_answers(bundle / "model.xml", inputs[:1]))
        assert session.from_cache is False
        assert [path.stat().st_size for path in (disk / "cache").glob("*.blob")] in ([], [0])  # no complete blob
        again = OpenVINOSession(bundle / "model.xml")
        assert again.from_cache is False  # nothing half-written was loaded
        set_cache_dir(None)


@pytest.mark.integration
def test_the_daemon_keeps_compiled_models_in_its_state_directory_across_restarts(tmp_path: Path) -> None:
    from edgeline.daemon.assembly import OPENVINO_CACHE
    from edgeline.daemon.config import DaemonConfig
    from edgeline.daemon.service import Daemon

    bundle = COMMITTED_OV_BUNDLES["tiny-ov-int8"]
    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text("")
    state = tmp_path / "state"
    config = DaemonConfig.model_validate(
        {"source": {"kind": "replay", "path": str(payloads)}, "daemon": {"state_dir": str(state)}}
    )
    cache = state / edgeline.read_bundle(bundle).manifest.name / OPENVINO_CACHE
    seen, blobs = [], []
    for _ in range(2):
        daemon = Daemon(bundle, config)
        daemon.start()
        try:
            seen.append(daemon.processor.model.from_cache)
        finally:
            daemon.stop()
        blobs.append(sorted(path.name for path in cache.glob("*.blob")))
    assert seen == [False, True]
    # the model as it runs single samples and as it runs the configured batches: two compiled models, kept
    assert len(blobs[0]) == 2 and blobs[1] == blobs[0]
