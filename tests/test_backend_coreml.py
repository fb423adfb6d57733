"""Core ML targets on the small user model: the .mlpackage (fp16, int8 weights) and the ExecuTorch .pte lowered to
Core ML, exported for iphone-15-pro. Linux cannot run either, so the packages are inspected (spec, deployment target,
compute units, inputs and outputs against the torch model, operations counted independently through coremltools'
MIL loader), the manifest must say fidelity was not measured and why, and verify must say it cannot run them. A
float-reference golden (what such bundles ship for verify on the device) is exercised for real on LiteRT.
Predicting needs macOS: that one test is skipped elsewhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil.frontend.milproto.load import load as load_mil_program
from coremltools.converters.mil.mil import types as mil_types

import edgeline
from edgeline import bundle as bundle_io
from edgeline import device_profiles
from edgeline.backends import open_session
from edgeline.cli import main
from edgeline.device_profiles import Precision
from edgeline.device_profiles.schema import CoreML
from edgeline.errors import BackendUnavailableError, IntegrityError
from edgeline.export.backends import ExportRequest, Verification
from edgeline.export.backends.coreml import check_package, read_spec
from edgeline.export.backends.litert import LiteRTExporter
from edgeline.export.errors import BudgetError, ExportError
from edgeline.export.pipeline import ExportOptions, run_export
from edgeline.export.report import ExportReport, format_report
from edgeline.manifest import Manifest

PROFILE = "iphone-15-pro"
NOT_HERE = "Core ML runs on macOS only"
PACKAGES = ("coreml-fp16", "coreml-int8-weights")


def _float_model(model_file: Path) -> Any:
    """The module export used: export seeds torch with 0 before it builds the model."""
    spec = importlib.util.spec_from_file_location("tiny_user_model", model_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.model().eval()


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_file: Path, sample_files: dict[str, Path]
) -> ExportReport:
    """Every iphone-15-pro target, each written to OUT/BACKEND-PRECISION (--all). The tiny model's convolution has
    fewer than 2,048 weights, which Core ML keeps in float: its int8-weights package has int8 weights for 58% of the
    work, under the bundled profile's 80% (``test_the_bundled_profile_rejects_a_package_mostly_in_float_weights``),
    so the packages are made with a copy of the profile without that budget."""
    root = tmp_path_factory.mktemp("coreml")
    text = (device_profiles_dir() / f"{PROFILE}.toml").read_text()
    profile = root / f"{PROFILE}.toml"
    profile.write_text(re.sub(r"^min_quantized_share = .*$", "", text, flags=re.MULTILINE))
    return run_export(
        ExportOptions(
            model=f"{tiny_model_file}:model",
            profile=str(profile),
            calibration=sample_files["calibration"],
            validation=sample_files["validation"],
            out=root / "tiny",
            all_targets=True,
        )
    )


def device_profiles_dir() -> Path:
    return Path(device_profiles.__file__).parent / "profiles"


def _bundle(report: ExportReport, name: str) -> Path:
    for outcome in report.outcomes:
        if f"{outcome.backend}-{outcome.precision}" == name:
            assert outcome.bundle is not None, (name, outcome.status, outcome.reason)
            return outcome.bundle
    raise AssertionError(f"no outcome {name}")


def _manifest(bundle: Path) -> Manifest:
    return bundle_io.read_bundle(bundle).manifest


def _spec(bundle: Path) -> Any:
    return ct.models.MLModel(str(bundle / "model.mlpackage"), skip_model_load=True).get_spec()


@pytest.mark.export
def test_the_bundled_profile_rejects_a_package_mostly_in_float_weights(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(BudgetError, match=r"of the work \(\d+/\d+ MACs; \d+/\d+ ops\) in int8-weights < budget 80%"):
        run_export(
            ExportOptions(
                model=f"{tiny_model_file}:model",
                profile=PROFILE,
                calibration=sample_files["calibration"],
                validation=sample_files["validation"],
                out=tmp_path / "tiny",
                backend="coreml",
                precision=Precision.INT8_WEIGHTS,
            )
        )


@pytest.mark.export
def test_export_for_the_iphone_picks_coreml_fp16_and_says_fidelity_was_not_measured(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", PROFILE,
         "--calibration", str(sample_files["calibration"]), "--validation", str(sample_files["validation"]),
         "--out", str(out)]
    )  # fmt: skip
    table = capsys.readouterr().out
    assert code == 0
    row = next(line for line in table.splitlines() if line.startswith("coreml"))
    assert row.split()[:3] == ["coreml", "fp16", "selected"]
    assert f"not measured: {NOT_HERE}" in row
    assert f"next: edgeline verify {out}  (on the device: {NOT_HERE})" in table
    data = json.loads((out / "manifest.json").read_text())
    assert (data["backend"], data["precision"], data["model"]) == ("coreml", "fp16", "model.mlpackage")
    fidelity = data["fidelity"]
    assert (fidelity["status"], fidelity["reason"], fidelity["samples"]) == ("not-measured", NOT_HERE, 0)
    numbers = ("max_abs_error", "mean_abs_error", "cosine_min", "top1_agreement", "accuracy", "accuracy_float")
    assert all(fidelity[key] is None for key in numbers)


@pytest.mark.export
@pytest.mark.parametrize("name", PACKAGES)
def test_the_package_is_the_torch_models_and_asks_what_the_profile_asks(
    name: str, exported: ExportReport, tiny_model_file: Path
) -> None:
    bundle = _bundle(exported, name)
    spec = _spec(bundle)
    assert spec.WhichOneof("Type") == "mlProgram"
    assert spec.specificationVersion == ct.target.iOS17.value  # the profile's minimum_deployment_target
    assert spec.description.metadata.userDefined["edgeline.compute_units"] == "ALL"
    image = torch.zeros(1, 1, 8, 8)
    logits = _float_model(tiny_model_file)(image)
    float32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT32
    found = [
        (f.name, tuple(f.type.multiArrayType.shape), f.type.multiArrayType.dataType) for f in spec.description.input
    ]
    assert found == [("image", tuple(image.shape), float32)]
    found = [
        (f.name, tuple(f.type.multiArrayType.shape), f.type.multiArrayType.dataType) for f in spec.description.output
    ]
    assert found == [("output_0", tuple(logits.shape), float32)]
    manifest = _manifest(bundle)
    assert [(s.name, s.dtype, s.shape) for s in manifest.inputs] == [("image", "float32", (1, 1, 8, 8))]
    assert [(s.name, s.dtype, s.shape) for s in manifest.outputs] == [("output_0", "float32", tuple(logits.shape))]
    assert manifest.fidelity.status == "not-measured"
    assert manifest.fidelity.reason == NOT_HERE


def _independent_counts(bundle: Path) -> tuple[int, int, dict[str, int]]:
    """Operations, those reading int8 weights and those with float weights, through coremltools' MIL loader (its
    Python objects, not the protobuf the exporter walks)."""
    package = bundle / "model.mlpackage"
    spec = _spec(bundle)
    program = load_mil_program(spec, spec.specificationVersion, str(package / "Data/com.apple.CoreML/weights"))
    ops, compressed, float_weights = 0, 0, {}
    for op in program.functions["main"].operations:
        if op.op_type == "const" or op.op_type.startswith("constexpr_"):
            continue
        ops += 1
        producers = [(var.op.op_type, var) for var in op.inputs.values() if getattr(var, "op", None) is not None]
        weights = [kind for kind, var in producers if var.rank >= 2 and mil_types.is_float(var.dtype)]
        weights = [kind for kind in weights if kind == "const" or kind.startswith("constexpr_")]
        if weights and all(kind != "const" for kind in weights):
            compressed += 1
        elif weights:
            float_weights[op.op_type] = float_weights.get(op.op_type, 0) + 1
    return ops, compressed, float_weights


@pytest.mark.quick
def test_placement_is_counted_from_the_program(exported: ExportReport) -> None:
    fp16 = _manifest(_bundle(exported, "coreml-fp16")).placement
    int8 = _manifest(_bundle(exported, "coreml-int8-weights")).placement
    assert fp16 is not None and int8 is not None
    ops, _, _ = _independent_counts(_bundle(exported, "coreml-fp16"))
    assert (fp16.ops, fp16.quantized_ops, fp16.fallback) == (ops, None, {})
    ops, compressed, float_weights = _independent_counts(_bundle(exported, "coreml-int8-weights"))
    # weightless operations have nothing to quantize: only those with float weights count against the share
    assert (int8.ops, int8.quantized_ops, int8.fallback) == (ops, ops - sum(float_weights.values()), float_weights)
    assert compressed == 1  # the linear layer's 6,400 weights; the convolution's 36 stay in float (under the threshold)
    assert "linear" not in int8.fallback and int8.fallback.get("conv") == 1
    for placement in (fp16, int8):
        assert placement.accelerator == "neural-engine"
        assert placement.accelerator_ops is None
        assert "when the model loads on the device" in placement.unknown["accelerator_ops"]


@pytest.mark.quick
def test_int8_weights_make_a_smaller_package(exported: ExportReport) -> None:
    fp16, int8 = (_manifest(_bundle(exported, name)) for name in PACKAGES)
    assert sum(e.size for e in int8.model_entries) < sum(e.size for e in fp16.model_entries)


@pytest.mark.quick
def test_the_manifest_hashes_every_file_of_the_package_and_nothing_else_is_accepted(
    exported: ExportReport, tmp_path: Path
) -> None:
    bundle = Path(shutil.copytree(_bundle(exported, "coreml-int8-weights"), tmp_path / "b"))
    manifest = _manifest(bundle)
    inside = {p.relative_to(bundle).as_posix() for p in (bundle / "model.mlpackage").rglob("*") if p.is_file()}
    assert {e.path for e in manifest.model_entries} == inside
    assert "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin" in inside
    assert manifest.golden is not None and manifest.golden.reference == "float"
    stray = bundle / "model.mlpackage/Data/com.apple.CoreML/extra.bin"
    stray.write_bytes(b"x")
    with pytest.raises(IntegrityError, match="not listed in the manifest"):
        bundle_io.read_bundle(bundle)
    stray.unlink()
    weights = bundle / "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(IntegrityError, match=r"weight\.bin"):
        bundle_io.read_bundle(bundle)


@pytest.mark.quick
def test_executorch_coreml_delegates_the_model_and_cannot_run_here(exported: ExportReport) -> None:
    bundle = _bundle(exported, "executorch-coreml-fp16")
    manifest = _manifest(bundle)
    placement = manifest.placement
    assert placement is not None and placement.accelerator == "coreml"
    assert placement.ops is not None and placement.ops > 0
    assert placement.accelerator_ops == placement.ops - sum(placement.fallback.values())
    assert placement.accelerator_ops == placement.ops  # the Core ML partitioner takes conv, relu, view and linear
    assert manifest.fidelity.status == "not-measured"
    assert manifest.fidelity.reason == "the Core ML delegate runs on Apple devices only"
    assert [(s.name, s.dtype, s.shape) for s in manifest.inputs] == [("image", "float32", (1, 1, 8, 8))]
    if sys.platform != "darwin":  # the pip wheel's runtime has no Core ML delegate
        # refused before ExecuTorch parses it (edgeline doctor's verdict), as every Core ML model off macOS
        with pytest.raises(BackendUnavailableError, match=r"cannot run here: Core ML runs on macOS only"):
            edgeline.load(bundle)


@pytest.mark.quick
def test_the_cpu_target_closes_the_list(exported: ExportReport) -> None:
    last = exported.outcomes[-1]
    assert (last.backend, last.precision) == ("executorch-xnnpack", "int8-static")
    assert last.fidelity is not None and last.fidelity.status == "measured"
    assert NOT_HERE in format_report(exported)


@pytest.mark.quick
def test_verify_off_macos_checks_the_files_then_says_core_ml_runs_on_macos_only(
    exported: ExportReport, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["verify", str(_bundle(exported, "coreml-fp16"))])
    if sys.platform == "darwin":  # Core ML runs: verify measures fidelity (test_predict_on_macos)
        assert code == 0
        return
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "files match their sizes and sha256, but " in err and " cannot run here: " in err
    assert err.endswith(f"{NOT_HERE} (this is {platform.system()})")


@pytest.mark.quick
@pytest.mark.skipif(sys.platform != "darwin", reason=NOT_HERE)
@pytest.mark.parametrize("name", PACKAGES)
def test_predict_on_macos(
    name: str, exported: ExportReport, tiny_model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = _bundle(exported, name)
    image = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
    (logits,) = edgeline.load(bundle).predict(image)
    expected = _float_model(tiny_model_file)(torch.from_numpy(image)).detach().numpy()
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() < 0.05
    assert main(["verify", str(bundle)]) == 0
    assert "fidelity against the float model" in capsys.readouterr().out


# --- float-reference golden, on a runtime that runs here -------------------------------------------------------------


@pytest.fixture
def float_reference_bundle(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A LiteRT bundle exported as if nothing here could run it: the pipeline ships the float model's outputs."""
    real_export = LiteRTExporter.export

    def unverified(self: LiteRTExporter, request: Any) -> Any:
        made = real_export(self, request)
        session = open_session("litert", request.out_dir / made.model_file)  # the specs an exporter gives
        return dataclasses.replace(
            made,
            verification=Verification(backend=None, reason="test: not run at export"),
            inputs=tuple(session.input_specs()),
            outputs=tuple(session.output_specs()),
        )

    monkeypatch.setattr(LiteRTExporter, "export", unverified)
    out = tmp_path / "tiny"
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", "x86-64", "--backend", "litert", "--precision", "fp32",
         "--calibration", str(sample_files["calibration"]), "--validation", str(sample_files["validation"]),
         "--task", "classify", "--out", str(out), "--json"]
    )  # fmt: skip
    assert code == 0
    return out


@pytest.mark.export
def test_verify_measures_fidelity_against_a_float_reference_golden(
    float_reference_bundle: Path, tiny_model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _manifest(float_reference_bundle)
    assert manifest.fidelity.status == "not-measured" and manifest.golden is not None
    assert manifest.golden.reference == "float" and manifest.golden.samples == 16
    golden = np.load(float_reference_bundle / "golden.npz", allow_pickle=False)
    with torch.no_grad():
        expected = _float_model(tiny_model_file)(torch.from_numpy(golden["input_0"])).numpy()
    np.testing.assert_allclose(golden["output_0"], expected, rtol=1e-5, atol=1e-6)  # the float model's outputs
    capsys.readouterr()
    assert main(["verify", str(float_reference_bundle), "--json"]) == 0
    check = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["check"] == "fidelity")
    model = edgeline.load(float_reference_bundle)
    got = np.concatenate([model.predict(golden["input_0"][i : i + 1])[0] for i in range(16)])
    assert check["max_abs_error"] == pytest.approx(float(np.abs(got - expected).max()), rel=1e-5)
    assert check["top1_agreement"] == float(np.mean(got.argmax(1) == expected.argmax(1)))
    assert check["ok"] is True and check["samples"] == 16
    assert main(["verify", str(float_reference_bundle)]) == 0
    assert "fidelity against the float model (golden.npz): 16 samples" in capsys.readouterr().out


@pytest.mark.export
def test_verify_fails_a_bundle_that_disagrees_with_the_float_reference(
    float_reference_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    golden_path = float_reference_bundle / "golden.npz"
    arrays = dict(np.load(golden_path, allow_pickle=False))
    arrays["output_0"] = -arrays["output_0"]  # every decision flipped: far outside a 1-point budget
    np.savez(golden_path, allow_pickle=False, **arrays)
    manifest = _manifest_unchecked(float_reference_bundle)
    files = tuple(bundle_io.file_entry(float_reference_bundle, e.path) for e in manifest.files)
    bundle_io.write_manifest(float_reference_bundle, manifest.model_copy(update={"files": files}))
    assert main(["verify", str(float_reference_bundle)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  fidelity against the float model" in out
    assert "budget top-1 disagreement <= 1%" in out


def _manifest_unchecked(bundle: Path) -> Manifest:
    return Manifest.model_validate_json((bundle / "manifest.json").read_text())


# --- what the exporter refuses ---------------------------------------------------------------------------------------


def _request(module: Any, names: tuple[str, ...] = ("image",)) -> ExportRequest:
    return ExportRequest(
        module=module,
        example_inputs=(torch.zeros(1, 1, 8, 8),),
        calibration=[],
        precision=Precision.FP16,
        out_dir=Path("unused"),
        input_names=names,
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    ("settings", "names", "message"),
    [
        (CoreML(compute_units="ALL", minimum_deployment_target="iOS16"), ("image",), "version 8, but iOS16"),
        (CoreML(compute_units="CPU_ONLY", minimum_deployment_target="iOS17"), ("image",), "asks for 'CPU_ONLY'"),
        (CoreML(compute_units="ALL", minimum_deployment_target="iOS17"), ("pixels",), "do not match the torch model"),
    ],
)
def test_a_package_that_is_not_what_the_profile_or_the_model_asks_is_refused(
    settings: CoreML, names: tuple[str, ...], message: str, exported: ExportReport, tiny_model_file: Path
) -> None:
    package = _bundle(exported, "coreml-fp16") / "model.mlpackage"
    spec = read_spec(package)
    with pytest.raises(ExportError, match=re.escape(message)):
        check_package(spec, _request(_float_model(tiny_model_file), names), settings, package)


@pytest.mark.export
def test_a_coreml_target_without_a_coreml_section_is_refused_in_one_line(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (device_profiles_dir() / "iphone-15-pro.toml").read_text()
    start, end = text.index("[coreml]"), text.index("# Tried first to last.")
    board = tmp_path / "board.toml"
    board.write_text((text[:start] + text[end:]).replace('id = "iphone-15-pro"', 'id = "board"'))
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", str(board), "--backend", "coreml", "--precision", "fp16",
         "--calibration", str(sample_files["calibration"]), "--out", str(tmp_path / "out")]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.endswith(
        "coreml: profile board has no [coreml] section; it needs compute_units and minimum_deployment_target"
    )
    assert "Traceback" not in err


@pytest.mark.integration
def test_the_runtime_side_imports_neither_torch_nor_coremltools() -> None:
    code = (
        "import sys, edgeline.backends.coreml\n"
        "print(sorted(m for m in ('torch', 'coremltools', 'edgeline.export') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
