"""Issue 53, "smaller, found on the way": each case on a model of its own (tests/int8_smaller_models.py), real
converters and runtimes, nothing mocked.

- ``edgeline doctor BUNDLE`` says the ExecuTorch runtime ``infer`` will really use (``EDGELINE_EXECUTORCH_RUNTIME``).
- ``edgeline export --json`` prints the report of an explicit target that was rejected, and still fails.
- The per-layer reading of a TFLite Micro mixed-precision bundle reads the model's real output (after its final
  QUANTIZE) for the last layer.
- The OpenVINO layer report names every LayerNorm module.
- A QNN failure says what the tool said (a memory-allocation failure is not a refusal) and names the operator.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.int8_smaller_models import TRAIN, digits_flat, smaller_models
from tests.tiny_bundle import COMMITTED_PTE_BUNDLES

VALIDATION = 200  # held-out digits the exports judge their budgets on


def _edgeline(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args],
        capture_output=True, text=True, timeout=timeout, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


# -- doctor and EDGELINE_EXECUTORCH_RUNTIME -----------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("choice", ["python", "native"])
def test_doctor_bundle_names_the_executorch_runtime_infer_will_use(choice: str, monkeypatch: Any) -> None:
    """The runtime doctor's verdict names is the one ``edgeline.model.load`` (what ``infer`` runs) opens with."""
    from edgeline.backends.executorch import RUNTIME_CHOICE
    from edgeline.model import load

    bundle = COMMITTED_PTE_BUNDLES["tiny-pte-int8"]
    done = _edgeline("doctor", str(bundle), "--json", env={RUNTIME_CHOICE: choice})
    assert done.returncode == 0, done.stderr
    reason = json.loads(done.stdout)["reason"]
    monkeypatch.setenv(RUNTIME_CHOICE, choice)
    runtime = load(bundle).runtime
    assert runtime == {"python": "python", "native": "torch-free"}[choice]
    said = {"python": "ExecuTorch's Python runtime", "native": "the torch-free ExecuTorch runtime"}[choice]
    assert reason.startswith(said), reason
    if choice == "python":
        assert f"chosen by {RUNTIME_CHOICE}=python" in reason, reason
        text = _edgeline("doctor", env={RUNTIME_CHOICE: choice}).stdout
        line = next(line for line in text.splitlines() if line.strip().startswith("executorch"))
        assert "Python runtime, imports torch" in line and f"{RUNTIME_CHOICE}=python" in line, line


@pytest.mark.quick
def test_doctor_refuses_an_unknown_executorch_runtime_choice_as_infer_does() -> None:
    from edgeline.backends.executorch import RUNTIME_CHOICE

    bundle = COMMITTED_PTE_BUNDLES["tiny-pte-int8"]
    done = _edgeline("doctor", str(bundle), "--json", env={RUNTIME_CHOICE: "rust"})
    assert done.returncode == 1, done.stdout + done.stderr
    found = json.loads(done.stdout)
    assert not found["runs"] and f"{RUNTIME_CHOICE}='rust': choose native (torch-free) or python" in found["reason"]


# -- the outlier MLP: exports shared by the tests below ------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Path:
    return smaller_models()


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    features, labels = digits_flat()
    folder = tmp_path_factory.mktemp("samples")
    np.savez(folder / "cal.npz", x=features[:32])
    np.savez(folder / "val.npz", x=features[TRAIN : TRAIN + VALIDATION], labels=labels[TRAIN : TRAIN + VALIDATION])
    return folder / "cal.npz", folder / "val.npz"


@pytest.fixture(scope="module")
def rejected(model: Path, samples: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``edgeline export --json`` of an explicit target plain int8 cannot hold the budget on."""
    calibration, validation = samples
    out = tmp_path_factory.mktemp("rejected") / "bundle"
    return _edgeline(
        "export", f"{model}:outlier_mlp", "--profile", "rpi4", "--backend", "litert", "--precision", "int8-static",
        "--no-mixed-precision", "--calibration", str(calibration), "--validation", str(validation), "--out", str(out),
        "--json", "-q",
    )  # fmt: skip


@pytest.mark.export
def test_export_json_prints_the_rejected_explicit_target_and_fails(rejected: Any) -> None:
    assert rejected.returncode == 2, rejected.stdout
    error = rejected.stderr.strip().splitlines()[-1]
    assert error.startswith("edgeline export: error: litert int8-static misses the rpi4 budgets"), rejected.stderr
    assert "edgeline export --json lists every layer" in error
    assert "Traceback" not in rejected.stderr
    document = json.loads(rejected.stdout)  # the error points here: the report is printed
    (outcome,) = document["targets"]
    assert outcome["backend"] == "litert" and outcome["precision"] == "int8-static"
    assert outcome["status"] == "rejected" and outcome["reason"].startswith("accuracy drop "), outcome
    assert document["bundle"] is None and document["next"] is None
    layers = {layer["module"]: layer for layer in outcome["layers"]}
    assert {"fc0", "act0", "fc1", "act1", "fc2", "act2", "head"} & set(layers), layers
    worst = min((layer for layer in outcome["layers"] if layer["added_sqnr_db"] is not None),
                key=lambda layer: layer["added_sqnr_db"])  # fmt: skip
    assert worst["module"] in error, (worst, error)  # the layer the error names is the report's


@pytest.mark.export
def test_export_json_prints_the_failed_explicit_target_and_fails(
    model: Path, samples: tuple[Path, Path], tmp_path: Path
) -> None:
    """A target that fails (rather than misses a budget) is printed too, with the reason the error gives."""
    calibration, validation = samples
    done = _edgeline(
        "export", f"{model}:outlier_mlp", "--profile", "rpi4", "--backend", "qnn-htp", "--precision", "int8-static",
        "--calibration", str(calibration), "--validation", str(validation), "--out", str(tmp_path / "bundle"),
        "--json", "-q",
    )  # fmt: skip
    assert done.returncode == 2, done.stdout
    error = done.stderr.strip().splitlines()[-1]
    assert error == "edgeline export: error: qnn-htp: profile rpi4 has no [qnn] section; it needs soc_model, htp_arch"
    (outcome,) = json.loads(done.stdout)["targets"]
    assert outcome["backend"] == "qnn-htp" and outcome["status"] == "failed"
    assert outcome["reason"] == error.removeprefix("edgeline export: error: ")
    assert not (tmp_path / "bundle").exists()


@pytest.fixture(scope="module")
def m4_bundle(model: Path, samples: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cortex-m4's automatic choice: TFLite Micro, int8 misses the budget, mixed precision keeps the outlier tensor
    float (``fc2``, ``act2`` and ``head``, the last layer)."""
    from edgeline.export.pipeline import ExportOptions, run_export

    calibration, validation = samples
    out = tmp_path_factory.mktemp("m4") / "bundle"
    report = run_export(
        ExportOptions(
            model=f"{model}:outlier_mlp", profile="cortex-m4", calibration=calibration, validation=validation, out=out
        )
    )
    assert report.selected is not None and report.selected.backend == "tflite-micro", report.as_dict()
    return out


def _sqnr_db(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    signal = sum(float(np.vdot(r.astype(np.float64), r.astype(np.float64))) for r in reference)
    noise = sum(
        float(np.sum(np.square(r.astype(np.float64) - g.astype(np.float64))))
        for r, g in zip(reference, got, strict=True)
    )
    return 10.0 * math.log10(signal / noise)


@pytest.mark.export
def test_a_microcontroller_bundles_last_layer_is_read_after_its_int8_output_step(m4_bundle: Path, model: Path) -> None:
    """The last layer computes in float and the firmware's output is int8 (one QUANTIZE after it): the layer report
    reads what the model really outputs, so its figure is the SQNR of the bundle's own answers."""
    import torch

    from edgeline.bundle import read_bundle
    from edgeline.export.layers import measure_layers
    from edgeline.export.loading import load_model
    from edgeline.model import load
    from edgeline.samples import SampleSet

    manifest = read_bundle(m4_bundle).manifest
    assert manifest.backend == "tflite-micro"
    assert "head" in {kept.module for kept in manifest.quantization.kept_float}
    assert manifest.outputs[0].dtype == "int8"
    features, _ = digits_flat()
    held_out = features[TRAIN : TRAIN + 64]
    module = load_model(f"{model}:outlier_mlp").module
    report = measure_layers(
        module, SampleSet([held_out], None, "held out"), "tflite-micro", "tflite-micro",
        m4_bundle / "model.tflite", [spec.name for spec in manifest.inputs],
    )  # fmt: skip
    head = next(layer for layer in report.layers if layer.module == "head")
    deployed = load(m4_bundle)
    answers = [deployed.predict(held_out[i : i + 1])[0] for i in range(len(held_out))]
    with torch.no_grad():
        reference = [module(torch.from_numpy(held_out[i : i + 1])).numpy() for i in range(len(held_out))]
    assert head.sqnr_db == pytest.approx(_sqnr_db(reference, answers), abs=0.01), (head, report.measured_with)


# -- OpenVINO: LayerNorm in the layer report -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def openvino_layernorm(model: Path, samples: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    from edgeline.device_profiles import Precision
    from edgeline.export.pipeline import ExportOptions, run_export

    calibration, _ = samples
    features, _ = digits_flat()
    validation = tmp_path_factory.mktemp("ln") / "val.npz"
    np.savez(validation, x=features[TRAIN : TRAIN + 64])  # no labels: random weights, judged by agreement
    report = run_export(
        ExportOptions(
            model=f"{model}:layernorm_mlp", profile="x86-64", calibration=calibration, validation=validation,
            out=tmp_path_factory.mktemp("ln") / "bundle", backend="openvino", precision=Precision.INT8_STATIC,
        )
    )  # fmt: skip
    assert report.selected is not None, report.as_dict()
    return report.selected


@pytest.mark.export
def test_the_openvino_layer_report_names_every_layernorm(openvino_layernorm: Any) -> None:
    """Each LayerNorm is read where OpenVINO computes it (MVN, its gain and shift: the operators named after
    ``native_layer_norm``, whose first output the module returns), between the Linear before and the ReLU after."""
    layers = {layer.module: layer for layer in openvino_layernorm.layers}
    assert {"norm1", "norm2"} <= set(layers), sorted(layers)
    for name in ("norm1", "norm2"):
        assert layers[name].operator == "LayerNorm" and layers[name].shape == (1, 32 if name == "norm1" else 24)
        assert layers[name].sqnr_db is not None and layers[name].sqnr_db > 20, layers[name]
    order = [layer.module for layer in openvino_layernorm.layers if not layer.module.startswith("input")]
    assert order == ["fc1", "norm1", "act1", "fc2", "norm2", "act2", "head"], order


# -- QNN: a graph the HTP cannot prepare is not a refusal ----------------------------------------------------------


@pytest.mark.export
@pytest.mark.parametrize("after_another", [False, True], ids=["first", "after-another-qnn-export"])
def test_a_qnn_graph_preparation_failure_is_not_a_refusal_and_names_the_operator(
    model: Path, tmp_path: Path, after_another: bool
) -> None:
    """QNN's HTP backend takes every node of the GRU model, then fails to finalize the graph with
    QNN_COMMON_ERROR_MEM_ALLOC; its own log says which operators it could not create (the GRU, and the Gather of the
    last step). The error says so, with the model's line, and never "refused". In a process that exported another
    model to QNN for another SoC before (HTP v75), the check's session prepares the graph and the context binary's
    compile fails instead (seen in the whole suite): the same diagnosis (it was "compiling the context binary ...
    failed", with no operator)."""
    import torch

    from edgeline.device_profiles import Precision, Target, load_profile
    from edgeline.export.backends import ExportRequest
    from edgeline.export.conversion import convert
    from edgeline.export.errors import LoweringError
    from edgeline.export.loading import load_model

    pytest.importorskip("onnxruntime_qnn")
    loaded = load_model(f"{model}:gru_tagger")
    if after_another:
        mlp = load_model(f"{model}:outlier_mlp").module
        inputs = [(torch.randn(1, 64, generator=torch.Generator().manual_seed(i)),) for i in range(4)]
        v75 = load_profile("snapdragon-8-gen-3")
        first = ExportRequest(module=mlp, example_inputs=inputs[0], calibration=inputs, precision=Precision.INT8_STATIC,
                              out_dir=tmp_path / "first", input_names=("x",), profile=v75)  # fmt: skip
        (tmp_path / "first").mkdir()
        convert(first, Target(backend="qnn-htp", precision=Precision.INT8_STATIC, threads=1))
    generator = torch.Generator().manual_seed(53)
    samples = [(torch.randn(1, 16, 3, generator=generator),) for _ in range(8)]
    request = ExportRequest(
        module=loaded.module, example_inputs=samples[0], calibration=samples, precision=Precision.INT8_STATIC,
        out_dir=tmp_path, input_names=("x",), profile=load_profile("qcs6490"),
    )  # fmt: skip
    with pytest.raises(LoweringError) as caught:
        convert(request, Target(backend="qnn-htp", precision=Precision.INT8_STATIC, threads=1))
    message = str(caught.value)
    assert "refused" not in message, message
    assert "QNN_COMMON_ERROR_MEM_ALLOC" in message and "memory" in message, message
    assert "GRU in gru (" in message and "smaller_models.py:" in message and "self.gru(x)" in message, message
    assert "GRU" in caught.value.operators, caught.value.operators
    assert "\n" not in message
