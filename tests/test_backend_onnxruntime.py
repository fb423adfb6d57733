"""The onnxruntime backend: export (fp32 and int8 QDQ) of the small user model, placement counted from the graph,
the runtime session, and a bundle built for a GPU this machine lacks: it runs on the CPU provider and says so in
``verify``, ``infer``, and the daemon's log, status and metrics."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import edgeline
from edgeline.cli import main
from edgeline.errors import BundleError

pytestmark = pytest.mark.export

GPU = "TensorrtExecutionProvider"


def export(model_file: Path, samples: dict[str, Path], out: Path, profile: str, precision: str) -> None:
    code = main(
        ["export", f"{model_file}:model", "--profile", profile,
         "--calibration", str(samples["calibration"]), "--validation", str(samples["validation"]),
         "--backend", "onnxruntime", "--precision", precision, "--out", str(out)]
    )  # fmt: skip
    assert code == 0, (profile, precision)


@pytest.fixture(scope="module")
def bundles(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_file: Path, sample_files: dict[str, Path]
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnxruntime")
    made = {}
    for key, profile, precision in (
        ("fp32", "x86-64", "fp32"),
        ("int8", "x86-64", "int8-static"),
        ("gpu", "jetson-orin-nano", "fp32"),
    ):
        made[key] = root / key
        export(tiny_model_file, sample_files, made[key], profile, precision)
    return made


def manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_text())


def independent_counts(model_path: Path) -> tuple[int, int, Counter[str]]:
    """(compute nodes, quantized nodes, float nodes by type), walked here from the ONNX file itself."""
    nodes = list(onnx.load(str(model_path)).graph.node)
    made_by = {name: node.op_type for node in nodes for name in node.output}
    read_by: dict[str, list[str]] = {}
    for node in nodes:
        for name in node.input:
            read_by.setdefault(name, []).append(node.op_type)
    compute = [node for node in nodes if node.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    quantized = [
        node
        for node in compute
        if made_by.get(node.input[0]) == "DequantizeLinear"
        and {kind for output in node.output for kind in read_by.get(output, ["graph output"])} == {"QuantizeLinear"}
    ]
    left = Counter(node.op_type for node in compute if node not in quantized)
    return len(compute), len(quantized), left


@pytest.mark.parametrize("key", ["fp32", "int8"])
def test_exports_measure_fidelity_and_verify(key: str, bundles: dict[str, Path], capsys: Any) -> None:
    bundle = bundles[key]
    data = manifest(bundle)
    assert data["backend"] == "onnxruntime"
    assert data["fidelity"]["status"] == "measured"
    assert data["fidelity"]["cosine_min"] > 0.99
    assert data["inputs"][0]["quantization"] is None  # QDQ: floats at the model's edges
    assert main(["verify", str(bundle)]) == 0
    assert "verified" in capsys.readouterr().out
    golden = np.load(bundle / "golden.npz")
    model = edgeline.load(bundle)
    assert model.accelerator is None and model.accelerator_fallback is None
    (output,) = model.predict(golden["input_0"][:1])
    np.testing.assert_allclose(output, golden["output_0"][:1], rtol=1e-5, atol=1e-5)


def test_int8_placement_matches_the_graph(bundles: dict[str, Path]) -> None:
    placement = manifest(bundles["int8"])["placement"]
    ops, quantized, left = independent_counts(bundles["int8"] / "model.onnx")
    assert placement["ops"] == ops
    assert placement["quantized_ops"] == quantized
    assert placement["fallback"] == dict(left)
    assert quantized > 0
    assert placement["accelerator"] is None and placement["accelerator_ops"] is None


def test_fp32_placement_counts_every_node_in_float(bundles: dict[str, Path]) -> None:
    placement = manifest(bundles["fp32"])["placement"]
    nodes = onnx.load(str(bundles["fp32"] / "model.onnx")).graph.node
    assert placement["ops"] == len(nodes)
    assert placement["quantized_ops"] is None  # fp32 declares no integer precision, like every backend's float
    assert placement["fallback"] == {}  # nothing was meant to be quantized


def test_a_gpu_bundle_names_its_provider_and_why_its_share_is_unknown(bundles: dict[str, Path]) -> None:
    placement = manifest(bundles["gpu"])["placement"]
    assert placement["accelerator"] == GPU
    assert placement["accelerator_ops"] is None
    assert "not on this machine" in placement["unknown"]["accelerator_ops"]
    measured_with = manifest(bundles["gpu"])["fidelity"]["measured_with"]
    assert "CPU provider" in measured_with and f"built for {GPU}, which was not measured" in measured_with


def test_a_gpu_bundle_runs_on_the_cpu_here_and_says_so(bundles: dict[str, Path]) -> None:
    import onnxruntime

    assert GPU not in onnxruntime.get_available_providers()  # the premise: this machine has no TensorRT
    model = edgeline.load(bundles["gpu"])
    assert model.accelerator is None
    assert model.accelerator_fallback is not None
    assert model.accelerator_fallback.startswith(f"built for {GPU} but running on the CPU")
    assert GPU in model.accelerator_fallback and "CUDAExecutionProvider" in model.accelerator_fallback


def test_verify_and_infer_print_one_warning_line(bundles: dict[str, Path], capsys: Any, tmp_path: Path) -> None:
    bundle = bundles["gpu"]
    assert main(["verify", str(bundle)]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if GPU in line]
    assert len(warnings) == 1 and "running on the CPU" in warnings[0]
    golden = np.load(bundle / "golden.npz")
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, image=golden["input_0"])
    assert main(["infer", str(bundle), "--input", str(inputs)]) == 0
    captured = capsys.readouterr()
    assert len([line for line in captured.err.splitlines() if GPU in line]) == 1


def test_the_daemon_says_so_in_its_log_status_and_metrics(
    bundles: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from edgeline.daemon.config import DaemonConfig
    from edgeline.daemon.service import Daemon

    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text("")
    config = DaemonConfig.model_validate({"source": {"kind": "replay", "path": str(payloads)}})
    daemon = Daemon(bundles["gpu"], config)
    with caplog.at_level(logging.WARNING):
        daemon.start()
    try:
        assert any(GPU in record.getMessage() and record.levelno == logging.WARNING for record in caplog.records)
        status = daemon.status()
        assert status["accelerator"]["wanted"] == GPU
        assert status["accelerator"]["in_use"] is None
        assert "running on the CPU" in status["accelerator"]["fallback"]
        families = {family.name: family for family in text_string_to_metric_families(daemon.metrics.prometheus())}
        (sample,) = families["edgeline_accelerator_fallback"].samples
        assert sample.value == 1.0
        assert sample.labels["wanted"] == GPU and sample.labels["in_use"] == "cpu"
    finally:
        daemon.stop()


def test_a_cpu_bundle_has_no_accelerator_status_or_gauge(bundles: dict[str, Path], tmp_path: Path) -> None:
    from edgeline.daemon.config import DaemonConfig
    from edgeline.daemon.service import Daemon

    payloads = tmp_path / "payloads.jsonl"
    payloads.write_text("")
    daemon = Daemon(bundles["int8"], DaemonConfig.model_validate({"source": {"kind": "replay", "path": str(payloads)}}))
    assert "accelerator" not in daemon.status()
    assert "edgeline_accelerator_fallback" not in daemon.metrics.prometheus()


def test_input_names_that_differ_from_the_model_are_a_bundle_error(bundles: dict[str, Path]) -> None:
    from edgeline.backends import open_session

    with pytest.raises(BundleError, match="differ from the manifest"):
        open_session("onnxruntime", bundles["fp32"] / "model.onnx", input_names=["not_there"])


def test_a_missing_onnxruntime_names_the_extra(bundles: dict[str, Path]) -> None:
    code = "import sys; sys.modules['onnxruntime'] = None\nfrom edgeline.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, "verify", str(bundles["fp32"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "onnxruntime" in done.stderr and "pip install 'edgeline[onnx]'" in done.stderr


def test_running_an_onnxruntime_bundle_never_imports_torch(bundles: dict[str, Path]) -> None:
    code = (
        "import sys, numpy as np, edgeline\n"
        "model = edgeline.load(sys.argv[1])\n"
        "model.predict(np.zeros(model.inputs[0].shape, np.float32))\n"
        "sys.exit('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(bundles["int8"])], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr or "torch was imported"
