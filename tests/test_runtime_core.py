"""The device side on a real bundle: load, predict, payload checks, tampering, `verify`, `infer`, and no torch.

The bundle is exported once per session (``built_litert_bundle`` in conftest) with the real exporter; every test
here works on its own copy of it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeline
from edgeline.backends import RUNTIME_BACKENDS
from edgeline.cli import main
from edgeline.errors import BundleError, IntegrityError, PayloadError
from edgeline.postprocess import softmax

from .conftest import CLASSES, IMAGE_SHAPE

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)


def _image(seed: int = 0, *, batch: bool = True) -> np.ndarray:
    image = np.random.default_rng(seed).random(IMAGE_SHAPE, dtype=np.float32)
    return image[np.newaxis] if batch else image


def _manifest(bundle: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    return data


def _write_manifest(bundle: Path, data: dict[str, Any]) -> None:
    (bundle / "manifest.json").write_text(json.dumps(data, indent=2), encoding="utf-8")


def _no_traceback(captured: Any) -> None:
    assert "Traceback" not in captured.out + captured.err


def _error_line(captured: Any, command: str) -> str:
    _no_traceback(captured)
    lines = [line for line in captured.err.splitlines() if line.startswith(f"edgeline {command}: error: ")]
    assert len(lines) == 1, captured.err
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# load and predict


def test_manifest_describes_an_int8_model_with_quantization_params(litert_bundle: Path) -> None:
    model = edgeline.load(litert_bundle)
    manifest = model.manifest
    assert (manifest.backend, manifest.precision, manifest.profile) == ("litert", "int8-static", "rpi5")
    assert manifest.model == "model.tflite"
    assert {entry.path for entry in manifest.files} == {"model.tflite", "golden.npz"}
    assert len(manifest.inputs) == 1 and len(manifest.outputs) == 1
    (spec,) = manifest.inputs
    assert spec.shape == (1, *IMAGE_SHAPE)
    assert spec.dtype in ("int8", "uint8")
    assert spec.quantization is not None and spec.quantization.scale > 0
    info = np.iinfo(spec.dtype)
    assert info.min <= spec.quantization.zero_point <= info.max
    for output in manifest.outputs:
        assert output.dtype in ("int8", "uint8") and output.quantization is not None
    assert manifest.outputs[0].shape == (1, CLASSES)
    assert manifest.postprocess.kind == "classify"
    assert manifest.fidelity.status == "measured" and manifest.fidelity.samples == 16


def test_predict_with_and_without_the_batch_dimension(litert_bundle: Path) -> None:
    model = edgeline.load(litert_bundle)
    with_batch = model.predict(_image(1))
    without_batch = model.predict(_image(1, batch=False))
    for outputs in (with_batch, without_batch):
        assert len(outputs) == len(model.outputs)
        for got, spec in zip(outputs, model.outputs, strict=True):
            assert got.dtype == np.float32
            assert got.shape == spec.shape
            assert np.isfinite(got).all()
    for a, b in zip(with_batch, without_batch, strict=True):
        np.testing.assert_array_equal(a, b)
    # Different images give different logits: the model really ran on what it was given.
    assert not np.array_equal(model.predict(_image(2))[0], with_batch[0])


def test_predict_accepts_other_real_dtypes_as_float(litert_bundle: Path) -> None:
    model = edgeline.load(litert_bundle)
    image = _image(3)
    expected = model.predict(image)[0]
    np.testing.assert_array_equal(model.predict(image.astype(np.float64))[0], expected)
    integers = np.ones((1, *IMAGE_SHAPE), dtype=np.int32)
    np.testing.assert_array_equal(model.predict(integers)[0], model.predict(integers.astype(np.float32))[0])


def test_predict_reproduces_the_golden_outputs(litert_bundle: Path) -> None:
    model = edgeline.load(litert_bundle)
    golden = model.manifest.golden
    assert golden is not None
    with np.load(litert_bundle / golden.path, allow_pickle=False) as arrays:
        inputs, expected = arrays["input_0"], arrays["output_0"]
    assert inputs.shape[0] == golden.samples
    for i in range(golden.samples):
        got = model.predict(inputs[i : i + 1])[0]
        np.testing.assert_allclose(got, expected[i : i + 1], rtol=golden.rtol, atol=golden.atol[0])


# ---------------------------------------------------------------------------------------------------------------------
# bad payloads


def test_wrong_number_of_inputs_is_a_payload_error_naming_the_input(litert_bundle: Path) -> None:
    model = edgeline.load(litert_bundle)
    name = model.inputs[0].name
    for arrays in ((), (_image(), _image())):
        with pytest.raises(PayloadError) as raised:
            model.predict(*arrays)
        message = str(raised.value)
        assert f"got {len(arrays)}" in message
        assert name in message, f"the message should name the model's input(s): {message}"


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.zeros((1, 1, 8, 7), np.float32), r"shape \[1, 1, 8, 7\], expected \[1, 1, 8, 8\]"),
        (np.zeros((2, 1, 8, 8), np.float32), r"shape \[2, 1, 8, 8\]"),
        (np.zeros((64,), np.float32), r"shape \[64\]"),
        (np.full((1, 1, 8, 8), "a"), r"dtype <U1, expected float32"),
        (np.zeros((1, 1, 8, 8), dtype=bool), r"dtype bool, expected float32"),
        (np.zeros((1, 1, 8, 8), dtype=np.complex64), r"dtype complex64, expected float32"),
    ],
    ids=["wrong-width", "batch-of-two", "flat", "strings", "bool", "complex"],
)
def test_bad_arrays_are_payload_errors_naming_the_input(litert_bundle: Path, array: np.ndarray, expected: str) -> None:
    model = edgeline.load(litert_bundle)
    with pytest.raises(PayloadError, match=expected) as raised:
        model.predict(array)
    assert f"input 0 ({model.inputs[0].name})" in str(raised.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39], ids=["nan", "inf", "-inf", "float32-overflow"])
@pytest.mark.parametrize("position", [0, 37, 63])
def test_non_finite_values_are_payload_errors(litert_bundle: Path, bad: float, position: int) -> None:
    model = edgeline.load(litert_bundle)
    image = _image(4).astype(np.float64)
    image.reshape(-1)[position] = bad
    with pytest.raises(PayloadError, match="contains NaN or Inf") as raised:
        model.predict(image)
    assert model.inputs[0].name in str(raised.value)


# ---------------------------------------------------------------------------------------------------------------------
# tampering: every file is checked before a model byte reaches a parser


def test_one_flipped_byte_in_the_model_is_an_integrity_error(litert_bundle: Path) -> None:
    path = litert_bundle / "model.tflite"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"'model.tflite' does not match its sha256"):
        edgeline.load(litert_bundle)


def test_a_truncated_model_is_an_integrity_error_giving_both_sizes(litert_bundle: Path) -> None:
    path = litert_bundle / "model.tflite"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(
        IntegrityError, match=rf"'model.tflite' has {len(data) - 10} bytes, the manifest says {len(data)}"
    ):
        edgeline.load(litert_bundle)


def test_a_missing_golden_file_is_named(litert_bundle: Path) -> None:
    (litert_bundle / "golden.npz").unlink()
    with pytest.raises(IntegrityError, match=r"'golden.npz' listed in the manifest is missing"):
        edgeline.load(litert_bundle)


def test_a_manifest_that_is_not_json_is_a_bundle_error(litert_bundle: Path) -> None:
    (litert_bundle / "manifest.json").write_text('{"schema_version": 1, "name": ', encoding="utf-8")
    with pytest.raises(BundleError, match="not valid JSON"):
        edgeline.load(litert_bundle)


@pytest.mark.parametrize("content", ["[1, 2, 3]", '"manifest"', "null"])
def test_a_manifest_that_is_not_an_object_is_a_bundle_error(litert_bundle: Path, content: str) -> None:
    (litert_bundle / "manifest.json").write_text(content, encoding="utf-8")
    with pytest.raises(BundleError, match="must be a JSON object"):
        edgeline.load(litert_bundle)


def test_a_newer_schema_version_is_refused_naming_the_supported_one(litert_bundle: Path) -> None:
    data = _manifest(litert_bundle)
    data["schema_version"] = 2
    _write_manifest(litert_bundle, data)
    with pytest.raises(BundleError, match=r"schema_version 2 is not supported by this runtime \(supported: 1\)"):
        edgeline.load(litert_bundle)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "sub/../../x", "C:/x", ""])
def test_file_entries_outside_the_bundle_fail_validation(litert_bundle: Path, path: str) -> None:
    outside = litert_bundle.parent / "x"
    outside.write_bytes(b"outside")
    data = _manifest(litert_bundle)
    data["files"].append({"path": path, "size": 7, "sha256": hashlib.sha256(b"outside").hexdigest()})
    _write_manifest(litert_bundle, data)
    with pytest.raises(BundleError, match=r"invalid manifest: files\[2\]\.path: .*relative path inside the bundle"):
        edgeline.load(litert_bundle)


def test_a_symlink_pointing_outside_the_bundle_is_refused(litert_bundle: Path) -> None:
    secret = litert_bundle.parent / "secret.txt"
    secret.write_bytes(b"not yours")
    (litert_bundle / "link").symlink_to(secret)
    data = _manifest(litert_bundle)
    data["files"].append({"path": "link", "size": 9, "sha256": hashlib.sha256(b"not yours").hexdigest()})
    _write_manifest(litert_bundle, data)
    with pytest.raises(IntegrityError, match="points outside the bundle"):
        edgeline.load(litert_bundle)


def test_an_unknown_runtime_backend_lists_the_valid_ones(litert_bundle: Path) -> None:
    data = _manifest(litert_bundle)
    data["backend"] = "tensorrt"
    _write_manifest(litert_bundle, data)
    valid = ", ".join(sorted(RUNTIME_BACKENDS))
    with pytest.raises(BundleError, match=f"unknown runtime backend 'tensorrt'; valid: {valid}$"):
        edgeline.load(litert_bundle)
    with pytest.raises(BundleError, match=r"unknown runtime backend 'nope'; valid: "):
        edgeline.load(litert_bundle, backend="nope")


def test_a_manifest_whose_input_shape_differs_from_the_model_is_refused(litert_bundle: Path) -> None:
    data = _manifest(litert_bundle)
    data["inputs"][0]["shape"] = [1, 1, 4, 4]
    _write_manifest(litert_bundle, data)
    with pytest.raises(
        BundleError, match=r"model input .* is int8\[1, 1, 8, 8\], the manifest says int8\[1, 1, 4, 4\]"
    ):
        edgeline.load(litert_bundle)


def test_a_model_file_the_runtime_cannot_parse_is_a_bundle_error(litert_bundle: Path) -> None:
    garbage = b"this is not a flatbuffer" * 40
    (litert_bundle / "model.tflite").write_bytes(garbage)
    data = _manifest(litert_bundle)
    for entry in data["files"]:
        if entry["path"] == "model.tflite":
            entry.update(size=len(garbage), sha256=hashlib.sha256(garbage).hexdigest())
    _write_manifest(litert_bundle, data)
    with pytest.raises(BundleError, match="could not load the model"):
        edgeline.load(litert_bundle)


# ---------------------------------------------------------------------------------------------------------------------
# edgeline verify


def test_verify_passes_on_the_exported_bundle(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(litert_bundle), "--json"]) == 0
    captured = capsys.readouterr()
    _no_traceback(captured)
    report = json.loads(captured.out)
    assert report["ok"] is True
    checks = {check["check"]: check for check in report["checks"]}
    assert [check["ok"] for check in checks.values()][:3] == [True, True, True]
    manifest = _manifest(litert_bundle)
    assert (report["name"], report["version"], report["backend"]) == ("tiny", 1, manifest["backend"])
    assert checks["integrity"]["files"] == len(manifest["files"])
    assert checks["integrity"]["bytes"] == sum(entry["size"] for entry in manifest["files"])
    assert checks["load"]["model"] == manifest["model"]
    golden = checks["golden"]
    assert golden["samples"] == manifest["golden"]["samples"] and golden["mismatched_samples"] == 0
    assert 0 <= golden["max_abs_error"] <= max(golden["atol"])
    latency = checks["latency"]
    assert latency["median_ms"] > 0 and latency["threads"] >= 1
    assert latency["budget_ms"] == manifest.get("budgets", {}).get("max_latency_ms")
    checked = latency["budget_ms"] is not None and latency["reason"] is None  # a device budget: on its device only
    assert latency["ok"] is (latency["median_ms"] <= latency["budget_ms"] if checked else None)


def test_verify_fails_cleanly_on_a_tampered_bundle(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = litert_bundle / "golden.npz"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["verify", str(litert_bundle)]) == 2
    line = _error_line(capsys.readouterr(), "verify")
    assert "'golden.npz' does not match its sha256" in line


def test_verify_reports_a_golden_mismatch_as_failed(litert_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A golden file re-hashed after its outputs were changed: integrity holds, the self-test must not."""
    golden = litert_bundle / "golden.npz"
    with np.load(golden, allow_pickle=False) as arrays:
        changed = {key: arrays[key] for key in arrays.files}
    changed["output_0"] = changed["output_0"] + 1.0
    np.savez(golden, **changed)
    data = _manifest(litert_bundle)
    for entry in data["files"]:
        if entry["path"] == "golden.npz":
            entry.update(size=golden.stat().st_size, sha256=hashlib.sha256(golden.read_bytes()).hexdigest())
    _write_manifest(litert_bundle, data)
    assert main(["verify", str(litert_bundle), "--json"]) == 1
    captured = capsys.readouterr()
    _no_traceback(captured)
    report = json.loads(captured.out)
    assert report["ok"] is False
    golden = {check["check"]: check for check in report["checks"]}["golden"]
    assert golden["ok"] is False and golden["mismatched_samples"] == golden["samples"]
    assert golden["max_abs_error"] >= 1.0 - max(golden["atol"])


# ---------------------------------------------------------------------------------------------------------------------
# edgeline infer


@pytest.fixture
def infer_input(tmp_path: Path) -> tuple[Path, np.ndarray]:
    images = np.random.default_rng(7).random((5, *IMAGE_SHAPE), dtype=np.float32)
    path = tmp_path / "samples.npz"
    np.savez(path, image=images)
    return path, images


def _json_records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_infer_json_prints_one_object_per_sample_matching_predict(
    litert_bundle: Path, infer_input: tuple[Path, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    path, images = infer_input
    assert main(["infer", str(litert_bundle), "--input", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    _no_traceback(captured)
    records = _json_records(captured.out)
    assert len(records) == len(images)
    model = edgeline.load(litert_bundle)
    for index, record in enumerate(records):
        assert {"outputs", "label", "score"} <= set(record)
        expected = model.predict(images[index])
        assert len(record["outputs"]) == len(expected)
        for got, want in zip(record["outputs"], expected, strict=True):
            np.testing.assert_array_equal(np.array(got, dtype=np.float32), want)
        logits = expected[0].reshape(-1).astype(np.float64)
        assert record["label"] == str(int(np.argmax(logits)))
        assert record["class_index"] == int(np.argmax(logits))
        assert record["sample"] == index
        assert record["score"] == pytest.approx(float(softmax(logits).max()))
        assert "expected" not in record


def test_infer_json_reports_expected_labels(
    litert_bundle: Path, sample_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    validation = sample_files["validation"]
    assert main(["infer", str(litert_bundle), "--input", str(validation), "--json", "--top-k", "3"]) == 0
    captured = capsys.readouterr()
    _no_traceback(captured)
    records = _json_records(captured.out)
    with np.load(validation) as arrays:
        labels = arrays["labels"].tolist()
    assert [record["expected"] for record in records] == labels
    for record in records:
        assert len(record["top_k"]) == 3
        assert record["top_k"][0] == {"label": record["label"], "score": record["score"]}


def test_infer_of_one_sample_without_its_sample_axis(
    litert_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "one.npz"
    np.savez(path, image=_image(9, batch=False))
    assert main(["infer", str(litert_bundle), "--input", str(path), "--json"]) == 0
    records = _json_records(capsys.readouterr().out)
    assert len(records) == 1
    expected = edgeline.load(litert_bundle).predict(_image(9))[0]
    np.testing.assert_array_equal(np.array(records[0]["outputs"][0], dtype=np.float32), expected)


def test_infer_summary_without_json(
    litert_bundle: Path, sample_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["infer", str(litert_bundle), "--input", str(sample_files["validation"]), "--show", "2"]) == 0
    captured = capsys.readouterr()
    _no_traceback(captured)
    lines = captured.out.splitlines()
    assert lines[0].startswith("sample 0: label=") and "(expected " in lines[0]
    assert lines[2] == "... 14 more samples"
    assert "16 samples through tiny v1 (litert, int8-static)" in lines[3]
    assert lines[4].startswith("accuracy: bundle ")


def test_infer_top_k_shows_the_classes_in_text_too(
    litert_bundle: Path, sample_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["infer", str(litert_bundle), "--input", str(sample_files["validation"]), "--top-k", "3"]
    assert main([*args, "--json"]) == 0
    records = _json_records(capsys.readouterr().out)
    assert main([*args, "--show", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for record, line in zip(records[:2], lines[:2], strict=True):
        shown = line.split("; top ", 1)[1].split(" (expected")[0].split(", ")
        assert [entry.split()[0] for entry in shown] == [entry["label"] for entry in record["top_k"]]
        assert [float(entry.split()[1]) for entry in shown] == pytest.approx(
            [entry["score"] for entry in record["top_k"]], rel=1e-3
        )


# ---------------------------------------------------------------------------------------------------------------------
# the device never needs torch

TORCH_FREE_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    import numpy as np

    import edgeline
    from edgeline.cli import main

    bundle, samples = sys.argv[1], sys.argv[2]
    model = edgeline.load(bundle)
    outputs = model.predict(np.zeros(model.inputs[0].shape, dtype=np.float32))
    code = main(["infer", bundle, "--input", samples, "--json"])
    code_verify = main(["verify", bundle])
    heavy = sorted(
        name for name in sys.modules
        if name.split(".")[0] in ("torch", "executorch", "litert_torch", "torchao", "ai_edge_quantizer")
    )
    shape = list(outputs[0].shape)
    print("RESULT " + json.dumps({"infer": code, "verify": code_verify, "shape": shape, "heavy": heavy}))
    """
)


def test_the_runtime_runs_without_importing_torch(
    litert_bundle: Path, infer_input: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    path, images = infer_input
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_SCRIPT, str(litert_bundle), str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    result_lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(result_lines) == 1, result.stdout
    report = json.loads(result_lines[0].removeprefix("RESULT "))
    assert report["heavy"] == [], f"the runtime imported {report['heavy']}"
    assert report["infer"] == 0 and report["verify"] == 0
    assert report["shape"] == [1, CLASSES]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(records) == len(images)
