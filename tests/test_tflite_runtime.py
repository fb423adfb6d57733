"""edgeline on the legacy ``tflite-runtime`` package: its own environment (numpy<2), no torch, no ai-edge-litert.

Bundles come from the real exporter (litert-torch, fp32 and static int8 with int8 input/output tensors) in the main
environment; ``edgeline infer`` and ``edgeline verify`` then run them with ``--backend tflite-runtime`` in the
environment of ``tests/tflite_runtime_env.py`` and must agree with the default ``litert`` backend here.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline import Manifest, read_bundle
from tests.cache import cached_export
from tests.tflite_runtime_env import FORBIDDEN_MODULES, TFLiteEnv, TFLiteEnvError, ensure_env, subprocess_env

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"),
        reason="tflite-runtime 2.14 has wheels for Linux x86-64 and aarch64 only",
    ),
    pytest.mark.skipif(sys.version_info >= (3, 12), reason="tflite-runtime (last release 2.14.0) stops at cp311"),
]

PRECISIONS = ("fp32", "int8-static")
RUN_TIMEOUT = 180

MODEL_SOURCE = """\
import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def model():
    torch.manual_seed(0)
    return TinyCNN().eval()
"""

# Loads and predicts through the Python API in the tflite-runtime environment, then reports what got imported.
API_SCRIPT = textwrap.dedent(
    """\
    import importlib.util, json, sys
    import numpy as np
    import edgeline
    from edgeline.cli import build_parser

    bundle, validation, *forbidden = sys.argv[1:]
    build_parser()  # registers every subcommand, as `edgeline` does
    model = edgeline.load(bundle, backend="tflite-runtime")
    with np.load(validation, allow_pickle=False) as data:
        x = data["x"]
    outputs = [model.predict(x[i])[0] for i in range(len(x))]
    loaded = [name for name in forbidden if name in sys.modules]
    if loaded:
        sys.exit(f"imported {loaded} while loading and predicting")
    print(json.dumps({
        "backend": model.backend,
        "numpy": np.__version__,
        "tflite_runtime_loaded": "tflite_runtime.interpreter" in sys.modules,
        "forbidden_installed": [name for name in forbidden if importlib.util.find_spec(name) is not None],
        "dtypes": sorted({str(o.dtype) for o in outputs}),
        "outputs": [o.tolist() for o in outputs],
    }))
    """
)


@dataclass(frozen=True)
class Data:
    calibration: Path
    validation: Path
    samples: int


@dataclass(frozen=True)
class ExportedBundle:
    precision: str
    path: Path
    manifest: Manifest


def _check(proc: subprocess.CompletedProcess[str], what: str) -> str:
    if proc.returncode != 0:
        pytest.fail(f"{what}: exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _run_main_env(args: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, *args],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"python {' '.join(args)} did not finish in {RUN_TIMEOUT} s (main environment)")


def _run_tflite_env(env: TFLiteEnv, args: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return env.run(args, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python {' '.join(args[:4])} ... did not finish in {RUN_TIMEOUT} s (tflite-runtime environment)")


def _records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _available_cpus() -> int:
    return len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def tflite_env() -> TFLiteEnv:
    try:
        return ensure_env()
    except TFLiteEnvError as exc:
        problem = str(exc)
    pytest.fail(f"tflite-runtime environment: {problem}", pytrace=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("tflite-data")
    rng = np.random.default_rng(20240611)
    calibration = root / "cal.npz"
    validation = root / "val.npz"
    np.savez(calibration, x=rng.standard_normal((64, 1, 8, 8)).astype(np.float32))
    np.savez(
        validation,
        x=rng.standard_normal((24, 1, 8, 8)).astype(np.float32),
        labels=rng.integers(0, 3, size=24),
    )
    return Data(calibration, validation, 24)


@pytest.fixture(scope="module", params=PRECISIONS)
def bundle(request: pytest.FixtureRequest, data: Data, tmp_path_factory: pytest.TempPathFactory) -> ExportedBundle:
    """Exported once for this code (tests/cache.py); never modified here."""
    precision: str = request.param
    model_file = tmp_path_factory.mktemp(f"tflite-{precision}") / "tiny_cnn.py"
    model_file.write_text(MODEL_SOURCE)
    out = cached_export(
        f"{model_file}:model", "--profile", "rpi5", "--calibration", data.calibration,
        "--validation", data.validation, "--backend", "litert", "--precision", precision,
    )  # fmt: skip
    return ExportedBundle(precision, out, read_bundle(out).manifest)


@pytest.fixture(scope="module")
def litert_records(bundle: ExportedBundle, data: Data) -> list[dict[str, Any]]:
    """``edgeline infer --json`` in the main environment with the manifest's backend (litert)."""
    args = ["-m", "edgeline.cli", "infer", str(bundle.path), "--input", str(data.validation), "--json"]
    return _records(_check(_run_main_env(args), f"litert infer ({bundle.precision})"))


def _assert_outputs_agree(bundle: ExportedBundle, got: list[Any], want: list[Any], where: str) -> None:
    for j, spec in enumerate(bundle.manifest.outputs):
        a = np.asarray(got[j], dtype=np.float64)
        b = np.asarray(want[j], dtype=np.float64)
        assert a.shape == b.shape, f"{where}, output {j}: shape {a.shape} vs {b.shape}"
        diff = float(np.abs(a - b).max())
        if spec.quantization is not None and spec.dtype.startswith(("int", "uint")):
            step = spec.quantization.scale
            assert diff <= step * 1.0001, f"{where}, output {j}: max |diff| {diff:.3g} > one step ({step:.3g})"
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{where}, output {j}")


def test_environment_is_tflite_runtime_only(tflite_env: TFLiteEnv) -> None:
    versions = tflite_env.versions
    assert versions["tflite-runtime"] == "2.14.0"
    assert int(versions["numpy"].split(".")[0]) == 1, versions
    assert versions["python"] == sys.version.split()[0]


def test_exported_bundle_is_what_the_test_needs(bundle: ExportedBundle) -> None:
    manifest = bundle.manifest
    assert (manifest.backend, manifest.precision) == ("litert", bundle.precision)
    assert manifest.model.endswith(".tflite")
    tensors = [*manifest.inputs, *manifest.outputs]
    if bundle.precision == "int8-static":
        # The interesting case: the runtime quantizes inputs and dequantizes outputs itself.
        assert all(t.dtype == "int8" and t.quantization is not None for t in tensors), tensors
    else:
        assert all(t.dtype == "float32" and t.quantization is None for t in tensors), tensors


def test_infer_agrees_with_litert(
    bundle: ExportedBundle, data: Data, tflite_env: TFLiteEnv, litert_records: list[dict[str, Any]]
) -> None:
    args = ["-m", "edgeline.cli", "infer", str(bundle.path), "--input", str(data.validation), "--json"]
    tflite_records = _records(
        _check(_run_tflite_env(tflite_env, [*args, "--backend", "tflite-runtime"]), "tflite-runtime infer")
    )
    assert len(tflite_records) == len(litert_records) == data.samples
    for position, (got, want) in enumerate(zip(tflite_records, litert_records, strict=True)):
        where = f"{bundle.precision} sample {position}"
        assert (got["label"], got["class_index"], got["expected"]) == (
            want["label"],
            want["class_index"],
            want["expected"],
        ), where
        _assert_outputs_agree(bundle, got["outputs"], want["outputs"], where)


def test_python_api_imports_neither_torch_nor_litert(
    bundle: ExportedBundle, data: Data, tflite_env: TFLiteEnv, litert_records: list[dict[str, Any]]
) -> None:
    args = ["-c", API_SCRIPT, str(bundle.path), str(data.validation), *FORBIDDEN_MODULES]
    report = json.loads(_check(_run_tflite_env(tflite_env, args), "load + predict").strip().splitlines()[-1])
    assert report["backend"] == "tflite-runtime"
    assert report["tflite_runtime_loaded"] is True
    assert report["forbidden_installed"] == []
    assert report["numpy"].startswith("1.")
    assert report["dtypes"] == ["float32"]  # callers speak float, whatever the model's tensors hold
    assert len(report["outputs"]) == data.samples
    for position, (got, want) in enumerate(zip(report["outputs"], litert_records, strict=True)):
        _assert_outputs_agree(bundle, [got], want["outputs"], f"{bundle.precision} sample {position} (API)")


def test_verify_passes(bundle: ExportedBundle, tflite_env: TFLiteEnv) -> None:
    proc = _run_tflite_env(
        tflite_env, ["-m", "edgeline.cli", "verify", str(bundle.path), "--backend", "tflite-runtime", "--json"]
    )
    assert proc.returncode in (0, 1), f"verify: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    checks = {check["check"]: check for check in report["checks"]}
    for name in ("integrity", "load", "golden"):
        assert checks[name]["ok"] is True, checks[name]
    assert checks["load"]["backend"] == "tflite-runtime", checks["load"]
    assert proc.returncode == 0, json.dumps(report, indent=2)


THREADS_SCRIPT = textwrap.dedent(
    """\
    import json, sys
    import edgeline

    model = edgeline.load(sys.argv[1], backend="tflite-runtime", threads=int(sys.argv[2]))
    print(json.dumps({"threads": model.threads}))
    """
)


def test_threads_are_clamped_to_the_cpus_available(bundle: ExportedBundle, tflite_env: TFLiteEnv) -> None:
    """tflite-runtime 2.14 slows down by orders of magnitude with more threads than CPUs (measured: 0.002 ms per
    call with 1-2 threads, 16-48 ms with 2-4 threads pinned to one core), so the runtime never asks for more."""
    asked = _available_cpus() + 2
    output = _check(_run_tflite_env(tflite_env, ["-c", THREADS_SCRIPT, str(bundle.path), str(asked)]), "threads")
    assert json.loads(output.splitlines()[-1]) == {"threads": _available_cpus()}
