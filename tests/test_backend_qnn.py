"""The qnn-htp backend on the real onnxruntime-qnn HTP emulator: the reference models export for the Snapdragon
8 Gen 3 within its budgets, the EP-context bundle reloads with identical outputs, placement matches the QDQ graph,
an operator QNN refuses fails the export by name, a device without QNN runs the kept QDQ model, loudly, and the same
command gives the same bytes wherever the bundle is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import edgeline
from edgeline.cli import main
from edgeline.device_profiles import Precision, Target, load_profile
from edgeline.errors import BundleError
from edgeline.export.backends import ExportRequest
from edgeline.export.budgets import budget_violations
from edgeline.export.conversion import convert
from edgeline.export.errors import ExportError, LoweringError
from edgeline.export.reference import Prepared
from edgeline.manifest import Manifest
from tests.cache import cached, cached_reference

pytestmark = pytest.mark.export  # trains two reference models (~30 s) and runs the HTP emulator

PROFILE = "snapdragon-8-gen-3"
REFERENCES = ("resnet8", "ds_cnn")


@pytest.fixture(scope="module")
def bundles() -> dict[str, Path]:
    """Each reference model exported for the HTP once for this code (tests/cache.py); never modified here."""
    made = {}
    for name in REFERENCES:
        prepared = cached_reference(name)

        def make(directory: Path, prepared: Prepared = prepared) -> None:
            code = main(
                ["export", str(prepared.model_path), "--profile", PROFILE,
                 "--calibration", str(prepared.calibration_path), "--validation", str(prepared.validation_path),
                 "--backend", "qnn-htp", "--precision", "int8-static", "--out", str(directory / "bundle")]
            )  # fmt: skip
            assert code == 0, prepared.name

        inputs = [PROFILE, prepared.model_path, prepared.calibration_path, prepared.validation_path]
        made[name] = cached("bundle", inputs, make) / "bundle"
    return made


def manifest(bundle: Path) -> Manifest:
    return Manifest.model_validate(json.loads((bundle / "manifest.json").read_text()))


@pytest.mark.parametrize("name", REFERENCES)
def test_fidelity_on_the_htp_emulator_meets_the_profile_budgets(name: str, bundles: dict[str, Path]) -> None:
    data = manifest(bundles[name])
    fidelity = data.fidelity
    assert fidelity.status == "measured"
    assert fidelity.measured_with is not None
    assert "HTP emulator" in fidelity.measured_with and "CPU fallback disabled" in fidelity.measured_with
    assert "soc_model 57" in fidelity.measured_with and "HTP v75" in fidelity.measured_with
    assert fidelity.computed_in == "f16"  # the HTP computes its float operators in fp16
    size = sum(entry.size for entry in data.files if entry.path != "golden.npz")
    profile = load_profile(PROFILE)
    assert budget_violations(profile.budgets, size, fidelity, data.placement, Precision.INT8_STATIC) == []
    assert fidelity.top1_agreement is not None and fidelity.top1_agreement >= 0.99


@pytest.mark.parametrize("name", REFERENCES)
def test_the_bundle_ships_the_context_binary_and_the_qdq_copy(name: str, bundles: dict[str, Path]) -> None:
    data = manifest(bundles[name])
    files = {entry.path for entry in data.files}
    assert files == {"model.onnx", "model_qnn.bin", "model.qdq.onnx", "golden.npz"}
    context = onnx.load(str(bundles[name] / "model.onnx")).graph.node
    assert [node.op_type for node in context] == ["EPContext"]
    assert data.backend == "onnxruntime" and data.runtime.package == "onnxruntime-qnn"


@pytest.mark.parametrize("name", REFERENCES)
def test_the_context_bundle_reloads_with_identical_outputs(name: str, bundles: dict[str, Path]) -> None:
    golden = np.load(bundles[name] / "golden.npz")
    first = edgeline.load(bundles[name])
    assert first.accelerator == "qnn-htp" and first.accelerator_fallback is None
    once = [first.predict(golden["input_0"][i : i + 1])[0] for i in range(4)]
    del first
    again = edgeline.load(bundles[name])
    twice = [again.predict(golden["input_0"][i : i + 1])[0] for i in range(4)]
    for a, b, expected in zip(once, twice, golden["output_0"][:4], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a[0], expected)  # the golden file was written by the same context binary


@pytest.mark.parametrize("name", REFERENCES)
def test_placement_matches_the_qdq_graph(name: str, bundles: dict[str, Path]) -> None:
    placement = manifest(bundles[name]).placement
    assert placement is not None
    nodes = list(onnx.load(str(bundles[name] / "model.qdq.onnx")).graph.node)
    made_by = {output: node.op_type for node in nodes for output in node.output}
    read_by: dict[str, set[str]] = {}
    for node in nodes:
        for tensor in node.input:
            read_by.setdefault(tensor, set()).add(node.op_type)
    compute = [node for node in nodes if node.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    quantized = [
        node
        for node in compute
        if made_by.get(node.input[0]) == "DequantizeLinear"
        and set().union(*(read_by.get(output, {"graph output"}) for output in node.output)) == {"QuantizeLinear"}
    ]
    assert placement.accelerator == "qnn-htp"
    assert placement.ops == len(compute) > 0
    assert placement.accelerator_ops == len(compute)  # the session with CPU fallback disabled opened
    assert placement.quantized_ops == len(quantized)
    assert sum(placement.fallback.values()) == len(compute) - len(quantized)


def test_an_ep_context_model_on_the_cpu_provider_is_refused_by_name(bundles: dict[str, Path]) -> None:
    from edgeline.backends import open_session

    with pytest.raises(BundleError, match="EP-context model"):
        open_session("onnxruntime", bundles["resnet8"] / "model.onnx")


def test_without_qnn_the_kept_qdq_model_runs_on_the_cpu_loudly(bundles: dict[str, Path]) -> None:
    """A device whose onnxruntime has no QNN provider (here: onnxruntime_qnn made unimportable in a fresh process,
    the way the device tier removes torch)."""
    code = (
        "import sys; sys.modules['onnxruntime_qnn'] = None\nfrom edgeline.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "verify", "--json", str(bundles["resnet8"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in done.stderr
    warning = [line for line in done.stderr.splitlines() if "qnn-htp" in line]
    assert len(warning) == 1 and "model.qdq.onnx on the CPU provider" in warning[0], done.stderr
    report = json.loads(done.stdout)
    load_check = next(check for check in report["checks"] if check["check"] == "load")
    assert (
        load_check["accelerator"] is None and "onnxruntime-qnn is not installed" in load_check["accelerator_fallback"]
    )
    assert load_check["computes"] == "f32" and "computed in f16" in load_check["computed_apart"]  # the CPU provider
    # the CPU's QDQ kernels land within the golden tolerance of the HTP's outputs (two output quantization steps)
    golden = next(check for check in report["checks"] if check["check"] == "golden")
    assert golden["ok"] is True, golden
    assert done.returncode == 0, done.stderr


ERF_MODEL = """\
import torch
from torch import nn


class Erf(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, kernel_size=3)

    def forward(self, image):
        return torch.erf(self.conv(image))


def model():
    return Erf().eval()
"""


def _request(tmp_path: Path, profile: str, precision: Precision = Precision.INT8_STATIC) -> ExportRequest:
    import torch

    namespace: dict[str, Any] = {}
    exec(ERF_MODEL, namespace)  # the user's model file, as the loader would import it
    module = namespace["model"]()
    samples = [(torch.rand(1, 1, 8, 8),) for _ in range(4)]
    return ExportRequest(
        module=module,
        example_inputs=samples[0],
        calibration=samples,
        precision=precision,
        out_dir=tmp_path,
        input_names=("image",),
        profile=load_profile(profile),
    )


def test_an_operator_qnn_refuses_fails_the_export_by_name(tmp_path: Path) -> None:
    target = Target(backend="qnn-htp", precision=Precision.INT8_STATIC, threads=1)
    with pytest.raises(LoweringError) as caught:
        convert(_request(tmp_path, PROFILE), target)
    assert "Erf x1" in str(caught.value)
    assert caught.value.operators == ("Erf",)
    assert not (tmp_path / "model.onnx").exists()  # nothing compiled


def test_a_profile_without_a_qnn_section_is_refused(tmp_path: Path) -> None:
    target = Target(backend="qnn-htp", precision=Precision.INT8_STATIC, threads=1)
    with pytest.raises(
        ExportError, match=r"qnn-htp: profile x86-64 has no \[qnn\] section; it needs soc_model, htp_arch"
    ):
        convert(_request(tmp_path, "x86-64"), target)


def test_qnn_exports_int8_static_only(tmp_path: Path) -> None:
    target = Target(backend="qnn-htp", precision=Precision.FP32, threads=1)
    with pytest.raises(ExportError, match="valid: int8-static"):
        convert(_request(tmp_path, PROFILE, Precision.FP32), target)


def test_verify_never_holds_the_emulators_speed_against_the_device_budget(
    bundles: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--json", str(bundles["ds_cnn"])]) == 0
    report = json.loads(capsys.readouterr().out)
    latency = next(check for check in report["checks"] if check["check"] == "latency")
    assert latency["ok"] is None and "HTP emulator" in latency["emulator"]
    assert latency["budget_ms"] is not None  # the profile has one: it is the device's, checked on the device
    memory = next(check for check in report["checks"] if check["check"] == "memory")
    # every check that says where it was measured names the emulator (the memory check said null)
    assert memory["ok"] is None and "HTP emulator" in memory["emulator"], memory


def test_the_same_command_gives_the_same_bytes_wherever_the_bundle_is_written(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path
) -> None:
    """onnxruntime names the EPContext node, and the graph inside the context binary, after the model it compiles:
    a hash of its path when it has one. The command, run twice with --out in two places, must give the same bytes
    all the same (all but the manifest's ``created``). Each run has its own process, as from a shell: QNN's HTP
    backend numbers the graphs it serializes per process, so a second compile in one process differs inside."""
    bundles = [tmp_path / place / "tiny" for place in ("here", "there")]
    for out in bundles:
        done = subprocess.run(
            [sys.executable, "-m", "edgeline.cli", "export", f"{tiny_model_file}:model", "--profile", PROFILE,
             "--calibration", str(sample_files["calibration"]), "--validation", str(sample_files["validation"]),
             "--backend", "qnn-htp", "--precision", "int8-static", "--out", str(out)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    files = [sorted(path.name for path in bundle.iterdir()) for bundle in bundles]
    assert files[0] == files[1] and "model_qnn.bin" in files[0]
    for name in sorted(files[0], key=lambda name: name == "manifest.json"):  # the model files' own bytes first
        first, second = ((bundle / name).read_bytes() for bundle in bundles)
        if name == "manifest.json":
            first, second = (json.dumps({**json.loads(text), "created": None}).encode() for text in (first, second))
        assert first == second, f"{name} differs between the two exports"
