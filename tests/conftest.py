"""Shared fixtures: a tiny classifier written as a user would write it, its sample files, and one real bundle.

The bundle is exported once per test session with the real LiteRT exporter (about 10 s on two cores); tests
that change it work on their own copy (``litert_bundle``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

# torch binds logging StreamHandlers to sys.stderr when first imported (torch._logging). Imported inside a test,
# that is the test's capture stream, closed afterwards, and a later torch warning fails to write to it. Importing
# it here binds them to the session's stream. (The torch-free tests run in fresh subprocesses.)
import torch  # noqa: F401

from edge_runtime.cli import main

pytest_plugins = ["tests.mqtt_broker"]  # real-Mosquitto fixtures: broker, session_broker, unique_topic

TINY_MODEL_SOURCE = '''\
import torch
from torch import nn


class Tiny(nn.Module):
    """conv + linear: a (1, 1, 8, 8) image to 10 class logits."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, image):
        return self.fc(torch.relu(self.conv(image)).flatten(1))


def model():
    return Tiny()
'''

IMAGE_SHAPE = (1, 8, 8)
CLASSES = 10


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user_model") / "tiny.py"
    path.write_text(TINY_MODEL_SOURCE, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def sample_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seeded float32 images in [0, 1): calibration (32) and validation (16, with integer labels)."""
    root = tmp_path_factory.mktemp("samples")
    rng = np.random.default_rng(20240607)
    calibration = root / "calibration.npz"
    validation = root / "validation.npz"
    np.savez(calibration, image=rng.random((32, *IMAGE_SHAPE), dtype=np.float32))
    np.savez(
        validation,
        image=rng.random((16, *IMAGE_SHAPE), dtype=np.float32),
        labels=rng.integers(0, CLASSES, size=16),
    )
    return {"calibration": calibration, "validation": validation}


@pytest.fixture(scope="session")
def built_litert_bundle(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_file: Path, sample_files: dict[str, Path]
) -> Path:
    """The pristine int8-static LiteRT bundle; never modify it, use ``litert_bundle``."""
    out = tmp_path_factory.mktemp("exported") / "tiny"
    code = main(
        [
            "export",
            f"{tiny_model_file}:model",
            "--profile",
            "rpi5",
            "--calibration",
            str(sample_files["calibration"]),
            "--validation",
            str(sample_files["validation"]),
            "--backend",
            "litert",
            "--precision",
            "int8-static",
            "--out",
            str(out),
        ]
    )
    assert code == 0, "exporting the tiny model for rpi5 (litert int8-static) failed"
    return out


@pytest.fixture
def litert_bundle(built_litert_bundle: Path, tmp_path: Path) -> Path:
    """A fresh copy of the exported bundle, for this test only."""
    return Path(shutil.copytree(built_litert_bundle, tmp_path / "bundle"))
