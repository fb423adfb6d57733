"""Every precision each export backend offers, on the small user model from conftest: it converts, the
runtime reads the precision's I/O correctly, fidelity is measured, and the bundle verifies."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import edgeline
from edgeline.cli import main
from tests.cache import cached_export

pytestmark = pytest.mark.export

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "litert": ("fp32", "fp16", "int8-dynamic", "int8-static"),
    "executorch-xnnpack": ("fp32", "int8-dynamic", "int8-static"),
}
CASES = [(backend, precision) for backend, precisions in PRECISIONS.items() for precision in precisions]


@pytest.fixture(scope="module")
def bundles(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_file: Path, sample_files: dict[str, Path]
) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("precisions")
    # x86-64 without its quantized-share budget: ExecuTorch's int8-dynamic leaves the convolution in float, which
    # the budget rejects (tests/test_placement.py); here every precision must be written
    text = (REPO / "device_profiles" / "profiles" / "x86-64.toml").read_text()
    assert "\nmin_quantized_share = 0.8\n" in text
    profile = root / "x86-64-open.toml"
    profile.write_text(text.replace("\nmin_quantized_share = 0.8\n", "\n"))
    samples = ["--calibration", sample_files["calibration"], "--validation", sample_files["validation"]]
    return {
        (backend, precision): cached_export(
            f"{tiny_model_file}:model", "--profile", profile, *samples, "--backend", backend, "--precision", precision
        )
        for backend, precision in CASES
    }


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


@pytest.mark.parametrize(("backend", "precision"), CASES)
def test_precision_exports_measures_and_verifies(
    backend: str, precision: str, bundles: dict[tuple[str, str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = bundles[(backend, precision)]
    data = manifest(bundle)
    assert data["precision"] == precision
    assert data["fidelity"]["status"] == "measured"
    assert data["fidelity"]["samples"] == 16
    assert data["fidelity"]["cosine_min"] > 0.99
    assert main(["verify", str(bundle)]) == 0
    assert "verified" in capsys.readouterr().out
    image = np.full((1, 1, 8, 8), 0.5, dtype=np.float32)
    (logits,) = edgeline.load(bundle).predict(image)
    assert logits.dtype == np.float32
    assert logits.shape == (1, 10)


def test_litert_int8_static_has_quantized_io_and_dynamic_has_float_io(bundles: dict[tuple[str, str], Path]) -> None:
    static = manifest(bundles[("litert", "int8-static")])
    dynamic = manifest(bundles[("litert", "int8-dynamic")])
    assert static["inputs"][0]["dtype"] == "int8"
    assert static["inputs"][0]["quantization"]["scale"] > 0
    assert static["outputs"][0]["dtype"] == "int8"
    assert dynamic["inputs"][0]["dtype"] == "float32"
    assert dynamic["inputs"][0]["quantization"] is None


def test_reduced_precisions_shrink_the_model(bundles: dict[tuple[str, str], Path]) -> None:
    def size(backend: str, precision: str) -> int:
        return (bundles[(backend, precision)] / manifest(bundles[(backend, precision)])["model"]).stat().st_size

    fp32 = size("litert", "fp32")
    assert size("litert", "fp16") < 0.75 * fp32
    assert size("litert", "int8-static") < 0.5 * fp32
    # A .pte carries more fixed overhead than a .tflite; on a 2.6k-parameter model that is a third of it.
    assert size("executorch-xnnpack", "int8-static") < 0.75 * size("executorch-xnnpack", "fp32")


def test_manifest_names_inputs_like_forward_and_keeps_tensor_names(bundles: dict[tuple[str, str], Path]) -> None:
    litert = manifest(bundles[("litert", "fp32")])["inputs"][0]
    executorch = manifest(bundles[("executorch-xnnpack", "fp32")])["inputs"][0]
    assert litert["name"] == executorch["name"] == "image"
    assert litert["tensor"]  # the .tflite tensor the runtime binds to
    placement = manifest(bundles[("executorch-xnnpack", "fp32")])["placement"]
    assert placement["accelerator"] == "xnnpack"
    assert 0 < placement["accelerator_ops"] <= placement["ops"]
    assert placement["quantized_ops"] is None  # fp32
    for precision in ("int8-static", "int8-dynamic"):
        quantized = manifest(bundles[("litert", precision)])["placement"]
        assert quantized["accelerator"] is None
        assert quantized["quantized_ops"] + sum(quantized["fallback"].values()) == quantized["ops"] > 0
    dynamic = manifest(bundles[("executorch-xnnpack", "int8-dynamic")])["placement"]
    assert dynamic["fallback"] == {"aten.convolution.default": 1}  # XNNPACK's dynamic quantizer leaves it in float


@pytest.mark.parametrize("backend", sorted(PRECISIONS))
def test_results_survive_the_next_predict(backend: str, bundles: dict[tuple[str, str], Path]) -> None:
    """Runtimes may reuse output buffers; a result the caller keeps must not change under it."""
    model = edgeline.load(bundles[(backend, "fp32")])
    first = model.predict(np.zeros((1, 1, 8, 8), dtype=np.float32))[0]
    kept = first.copy()
    second = model.predict(np.ones((1, 1, 8, 8), dtype=np.float32))[0]
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)


def test_exporting_leaves_the_callers_logging_alone(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path
) -> None:
    """executorch calls logging.basicConfig() on import and logging.debug() while lowering; in a fresh process
    (pytest's own handlers would hide it) an export must leave the root logger as it found it."""
    script = (
        "import logging, sys\n"
        "from edgeline.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "root = logging.getLogger()\n"
        "print(code, len(root.handlers), root.level)\n"
    )
    args = ["export", f"{tiny_model_file}:model", "--profile", "x86-64",
            "--calibration", str(sample_files["calibration"]), "--backend", "executorch-xnnpack",
            "--precision", "fp32", "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-1].split() == ["0", "0", str(logging.WARNING)], done.stderr[-2000:]


def test_an_executorch_int8_export_quantizes_the_model_once(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer report reads the PT2E graph the .pte was lowered from: the export's own, not a second quantization
    of the same model on the same calibration samples (a pass of the observed model over every sample)."""
    from torchao.quantization.pt2e import quantize_pt2e

    prepared: list[object] = []
    real = quantize_pt2e.prepare_pt2e

    def counted(*args: object, **kwargs: object) -> object:  # the real quantizer, counted
        prepared.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(quantize_pt2e, "prepare_pt2e", counted)
    out = tmp_path / "bundle"
    args = ["export", f"{tiny_model_file}:model", "--profile", "x86-64",
            "--calibration", str(sample_files["calibration"]), "--validation", str(sample_files["validation"]),
            "--backend", "executorch-xnnpack", "--precision", "int8-static", "--out", str(out), "-q"]  # fmt: skip
    assert main(args) == 0
    quantization = manifest(out)["quantization"]
    assert quantization["layers"]
    assert "numeric debugger on the quantized graph the .pte was lowered from" in quantization["layers_measured_with"]
    assert len(prepared) == 1
