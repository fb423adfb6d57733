"""Shared fixtures: a tiny classifier written as a user would write it, its sample files, and real bundles.

Each bundle is exported once per test session with the real LiteRT exporter (about 10 s on two cores); tests
that change one work on their own copy (``litert_bundle``). Without torch (the device tier: scripts/test_device.sh
runs the tests marked ``device`` but not ``workstation`` in the base install) ``built_litert_bundle`` and
``sqrt_bundle`` are the copies committed in tests/data (see ``tests.tiny_bundle``); the other bundles need torch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tests.tiny_bundle
from tests.cache import cached, cached_export
from tests.tiny_bundle import (
    CLASSES,
    COMMITTED_BUNDLE,
    COMMITTED_SQRT_BUNDLE,
    IMAGE_SHAPE,
    TINY_MODEL_SOURCE,
    export_sqrt,
    write_samples,
)

# Hypothesis's own clocks are timing assertions: a per-example deadline (200 ms) and a health check that fails a
# test whose inputs are slow to generate. On a busy machine both fail tests that are right; examples stay counted.
# The suite draws the same examples every run (derandomize: a run's verdict is the code's, not the draw's);
# EDGELINE_HYPOTHESIS=explore draws new ones, to look for what the fixed draw misses.
settings.register_profile(
    "edgeline", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None
)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("EDGELINE_HYPOTHESIS", "edgeline"))

# One OpenMP thread per test process, and for the processes tests start: the suite runs one process per core
# (pytest-xdist), and torch's default of one intra-op thread per core puts two threads on each core, which then spend
# their CPU waiting for each other in OpenMP's barriers. Measured here (tests/torch_threads.py): a whole `edgeline
# export` of a small CNN took 25.9 s of CPU on two threads of the loaded machine, 11.4 s on one, with the same bytes
# in every file of the bundle. Reference models still train on exactly two threads (export/reference/training.py),
# so their weights do not depend on it. A caller's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

HAVE_TORCH = importlib.util.find_spec("torch") is not None
"""False in the device tier: the base install, without the export extra."""
if HAVE_TORCH:
    # torch binds logging StreamHandlers to sys.stderr when first imported (torch._logging). Imported inside a
    # test, that is the test's capture stream, closed afterwards, and a later torch warning fails to write to it.
    # Importing it here binds them to the session's stream. (The torch-free tests run in fresh subprocesses.)
    import torch  # noqa: F401

# The device tier collects every module: leave out those that import, at import time, what the base install lacks.
collect_ignore = [
    module
    for module, needs in (
        ("test_reference_models.py", "torch"),
        ("test_float_reference.py", "torch"),
        ("test_compute_placement.py", "torch"),
        ("test_target_failures.py", "torch"),
        ("test_mcu_export.py", "torch"),
        ("test_health.py", "prometheus_client"),
        ("test_backend_coreml.py", "coremltools"),
        ("test_backend_onnxruntime.py", "torch"),
        ("test_backend_qnn.py", "torch"),
        ("test_backend_qnn.py", "onnxruntime_qnn"),  # no wheel for macOS
        ("test_imaging.py", "PIL"),  # Pillow: the export extra's (image folders)
        ("test_export_preprocess.py", "PIL"),
        ("test_detection_oracles.py", "pycocotools"),  # the oracles are the dev extra's and the export extra's
        ("test_detection_oracles.py", "onnx"),
        ("test_detection_data.py", "PIL"),
        ("test_shapes_reference.py", "torch"),
        ("test_detection_export.py", "torch"),
        ("test_detection_daemon.py", "torch"),
        ("test_infer_images.py", "PIL"),  # the images extra's
    )
    if importlib.util.find_spec(needs) is None
]

pytest_plugins = [
    "tests.mqtt_broker",  # real-Mosquitto fixtures: broker, session_broker, unique_topic
    "tests.camera_server",  # cameras: camera_server (edgeline sim camera), silent_server, stalling_server
    "tests.tiers",  # every test has one cost tier, and its time bound
    "pytester",  # tests/test_suite_tiers.py runs small suites of its own
]

TINY_BUNDLE_PY = Path(tests.tiny_bundle.__file__)
"""The exports of the tiny and sqrt bundles, their seeds and sources: part of their cache keys."""

__all__ = ["CLASSES", "HAVE_TORCH", "IMAGE_SHAPE", "TINY_MODEL_SOURCE", "TinyExport"]


def needs_torch(what: str) -> None:
    """Fail a device-tier test that asked for something only the workstation tier (the export extra) can make."""
    if not HAVE_TORCH:
        pytest.fail(
            f"{what} needs torch (the export extra), which the device tier lacks: mark the test `workstation`, "
            "or give it a bundle from tests/data"
        )


_EXIT_STATUS = [0]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS[0] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A camera open a test gave up on (its deadline passed) goes on inside PyAV until PyAV's own bound, and one still
    there when this process's interpreter shuts down crashes it (``edgeline.video``): wait for them, bounded, last
    of all (an xdist worker has sent its results by now)."""
    video = sys.modules.get("edgeline.video")
    if video is not None and video.leave_library(60.0):
        print("conftest: a camera call still inside PyAV after 60 s: leaving without the interpreter's shutdown")
        sys.stdout.flush()
        os._exit(_EXIT_STATUS[0])


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's daemons (in this process or started from it) keep their outbox in a state folder of the test's
    own: an answer left over by one test must never be published into the next."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    return state


@pytest.fixture(autouse=True)
def openvino_cache_off_after() -> Iterator[None]:
    """A daemon run in this process points OpenVINO's compiled-model cache (a process-wide setting) into its state
    directory: the next test of this worker must not compile into, or load from, what that test left."""
    yield
    module = sys.modules.get("edgeline.backends.openvino")
    if module is not None:
        module.set_cache_dir(None)


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user_model") / "tiny.py"
    path.write_text(TINY_MODEL_SOURCE, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def sample_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seeded float32 images in [0, 1): calibration (32) and validation (16, with integer labels)."""
    return write_samples(tmp_path_factory.mktemp("samples"))


TinyExport = Callable[[str, str, str], Path]
"""``tiny_export(profile, backend, precision)``: the tiny model's bundle for that target."""


@pytest.fixture(scope="session")
def tiny_export(tiny_model_file: Path, sample_files: dict[str, Path]) -> TinyExport:
    """The tiny model exported for a profile's target by ``edgeline export``, once for this code and these libraries
    (tests/cache.py), whichever test or process asks first: never modify what it returns."""

    def export(profile: str, backend: str, precision: str) -> Path:
        needs_torch("the tiny_export fixture")
        samples = ["--calibration", sample_files["calibration"], "--validation", sample_files["validation"]]
        target = ["--profile", profile, "--backend", backend, "--precision", precision]
        return cached_export(f"{tiny_model_file}:model", *samples, *target)

    return export


@pytest.fixture(scope="session")
def built_litert_bundle(tiny_export: TinyExport) -> Path:
    """The pristine int8-static LiteRT bundle for rpi5; never modify it, use ``litert_bundle``. Exported with torch;
    without it (the device tier), the committed copy made by the same export."""
    if not HAVE_TORCH:
        return COMMITTED_BUNDLE
    return tiny_export("rpi5", "litert", "int8-static")


@pytest.fixture(scope="session")
def sqrt_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An fp32 LiteRT bundle of sqrt then linear, (1, 1, 4) in, any batch size: a negative input gives NaN outputs
    (never modify it). Exported here with torch; without it (the device tier), the committed copy."""
    if not HAVE_TORCH:
        return COMMITTED_SQRT_BUNDLE

    def make(directory: Path) -> None:
        assert export_sqrt(directory, directory / "sqrt") == 0, "exporting the sqrt model (litert fp32) failed"

    return cached("bundle", [TINY_BUNDLE_PY], make) / "sqrt"


@pytest.fixture(scope="session")
def fresh_bundles() -> Callable[[str], Path]:
    """``fresh_bundles(name)``: the ExecuTorch or OpenVINO bundle committed as ``tests/data/<name>``, exported today
    by the same command (cached by content; never modify it)."""
    needs_torch("the fresh_bundles fixture")

    def fresh(name: str) -> Path:
        def make(directory: Path) -> None:
            assert tests.tiny_bundle.export_target(name, directory, directory / name) == 0, f"exporting {name} failed"

        return cached("bundle", [TINY_BUNDLE_PY, name], make) / name

    return fresh


@pytest.fixture
def litert_bundle(built_litert_bundle: Path, tmp_path: Path) -> Path:
    """A fresh copy of the exported bundle, for this test only."""
    return Path(shutil.copytree(built_litert_bundle, tmp_path / "bundle"))


POOLED_MODEL_SOURCE = '''\
import torch
from torch import nn


class Pooled(nn.Module):
    """conv + global average pool + linear on 3-channel images: no reshape to a fixed batch, so it can run
    batches (with one channel, the converter's NCHW to NHWC step is a RESHAPE fixed to batch 1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, image):
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(image))), 1))


def model():
    return Pooled()
'''


@pytest.fixture(scope="session")
def batchable_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An int8-static LiteRT bundle of a (1, 3, 8, 8) model whose graph takes any batch size (never modify it)."""
    needs_torch("the batchable_bundle fixture")

    root = tmp_path_factory.mktemp("pooled_model")
    source = root / "pooled.py"
    source.write_text(POOLED_MODEL_SOURCE, encoding="utf-8")
    rng = np.random.default_rng(20261121)
    np.savez(root / "calibration.npz", image=rng.random((32, 3, 8, 8), dtype=np.float32))
    np.savez(root / "validation.npz", image=rng.random((16, 3, 8, 8), dtype=np.float32), labels=np.arange(16) % 10)
    return cached_export(
        f"{source}:model", "--profile", "rpi5", "--calibration", root / "calibration.npz",
        "--validation", root / "validation.npz", "--backend", "litert", "--precision", "int8-static",
    )  # fmt: skip


LOOKUP_MODEL_SOURCE = '''\
import torch
from torch import nn


class Lookup(nn.Module):
    """A table lookup by the input's values: an index past the table makes the runtime itself fail."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(8, 4)

    def forward(self, x):
        return self.table(x.to(torch.int64))


def model():
    return Lookup()
'''


@pytest.fixture(scope="session")
def lookup_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An fp32 LiteRT bundle taking (1, 1, 3) indices in [0, 8); 300 passes every input check but the runtime's
    EMBEDDING_LOOKUP refuses it: a real ``inference-failed`` (never modify it)."""
    needs_torch("the lookup_bundle fixture")

    root = tmp_path_factory.mktemp("lookup_model")
    source = root / "lookup.py"
    source.write_text(LOOKUP_MODEL_SOURCE, encoding="utf-8")
    rng = np.random.default_rng(8)
    np.savez(root / "calibration.npz", x=rng.integers(0, 8, (16, 1, 3)).astype(np.float32))
    np.savez(root / "validation.npz", x=rng.integers(0, 8, (8, 1, 3)).astype(np.float32))
    return cached_export(
        f"{source}:model", "--profile", "rpi5", "--calibration", root / "calibration.npz",
        "--validation", root / "validation.npz", "--backend", "litert", "--precision", "fp32",
    )  # fmt: skip
