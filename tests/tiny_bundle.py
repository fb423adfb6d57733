"""The tests' tiny classifier, its sample files, and its int8 LiteRT bundle for rpi5.

The workstation tier exports the bundle once per session (``built_litert_bundle`` in conftest). The device tier
(``scripts/test_device.sh``: the base install, no torch) cannot export: it uses the copy committed in
``tests/data/tiny-int8``, made by the same export. A device test verifies that copy (integrity and golden
self-test) and a workstation test checks that it still describes what the exporter writes today. Regenerate it,
with the export extra installed, after a change to the exporter or the manifest::

    python -m tests.tiny_bundle
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["CLASSES", "COMMITTED_BUNDLE", "IMAGE_SHAPE", "TINY_MODEL_SOURCE", "export_tiny", "write_samples"]

COMMITTED_BUNDLE = Path(__file__).parent / "data" / "tiny-int8"

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


def write_samples(root: Path) -> dict[str, Path]:
    """Seeded float32 images in [0, 1): calibration (32) and validation (16, with integer labels)."""
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


def export_tiny(model_file: Path, samples: dict[str, Path], out: Path) -> int:
    """``edgeline export`` of the tiny model for rpi5, LiteRT int8-static (needs the export extra)."""
    from edgeline.cli import main

    return main(
        ["export", f"{model_file}:model", "--profile", "rpi5", "--calibration", str(samples["calibration"]),
         "--validation", str(samples["validation"]), "--backend", "litert", "--precision", "int8-static",
         "--out", str(out)]
    )  # fmt: skip


def regenerate() -> int:
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        model_file = root / "tiny.py"
        model_file.write_text(TINY_MODEL_SOURCE, encoding="utf-8")
        code = export_tiny(model_file, write_samples(root), root / "tiny-int8")
        if code != 0:
            return code
        shutil.rmtree(COMMITTED_BUNDLE, ignore_errors=True)
        shutil.copytree(root / "tiny-int8", COMMITTED_BUNDLE)
    size = sum(path.stat().st_size for path in COMMITTED_BUNDLE.iterdir())
    print(f"wrote {COMMITTED_BUNDLE} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(regenerate())
