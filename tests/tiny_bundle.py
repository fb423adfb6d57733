"""The tests' committed bundles: the tiny classifier (int8 LiteRT for rpi5) with its sample files, and the sqrt model
(fp32 LiteRT, any batch size, NaN outputs for negative inputs).

The workstation tier exports each bundle once per session (``built_litert_bundle`` and ``sqrt_bundle`` in
conftest). The device tier (``scripts/test_device.sh``: the base install, no torch) cannot export: it uses the copies
committed in ``tests/data``, made by the same exports. A device test verifies each copy (integrity and golden
self-test) and a workstation test checks that it still describes what the exporter writes today. Regenerate them
(or the ones named: ``tiny-int8``, ``sqrt-fp32``), with the export extra installed, after a change to the exporter
or the manifest::

    python -m tests.tiny_bundle [NAME ...]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

__all__ = [
    "CLASSES",
    "COMMITTED_BUNDLE",
    "COMMITTED_BUNDLES",
    "COMMITTED_SQRT_BUNDLE",
    "IMAGE_SHAPE",
    "SQRT_MODEL_SOURCE",
    "TINY_MODEL_SOURCE",
    "export_committed",
    "export_sqrt",
    "export_tiny",
    "write_samples",
]

DATA = Path(__file__).parent / "data"
COMMITTED_BUNDLE = DATA / "tiny-int8"
COMMITTED_SQRT_BUNDLE = DATA / "sqrt-fp32"
COMMITTED_BUNDLES = {path.name: path for path in (COMMITTED_BUNDLE, COMMITTED_SQRT_BUNDLE)}

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

SQRT_MODEL_SOURCE = '''\
import torch
from torch import nn


class Sqrt(nn.Module):
    """sqrt then linear: a negative input gives NaN outputs, a positive one finite outputs; any batch size."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.sqrt(x))


def model():
    return Sqrt()
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


def export_sqrt(root: Path, out: Path) -> int:
    """``edgeline export`` of the sqrt model for rpi5, LiteRT fp32, its samples written in ``root`` (needs the export
    extra). Calibration and validation inputs are positive: the golden outputs are finite."""
    from edgeline.cli import main

    source = root / "sqrt.py"
    source.write_text(SQRT_MODEL_SOURCE, encoding="utf-8")
    rng = np.random.default_rng(3)
    np.savez(root / "calibration.npz", x=rng.random((16, 1, 4), dtype=np.float32) + 0.1)
    np.savez(root / "validation.npz", x=rng.random((8, 1, 4), dtype=np.float32) + 0.1)
    return main(
        ["export", f"{source}:model", "--profile", "rpi5", "--calibration", str(root / "calibration.npz"),
         "--validation", str(root / "validation.npz"), "--backend", "litert", "--precision", "fp32",
         "--out", str(out)]
    )  # fmt: skip


def export_committed(name: str, work: Path, out: Path) -> int:
    """Export the bundle committed as ``tests/data/<name>`` to ``out`` (``work``: a folder for its sources)."""
    if name == COMMITTED_SQRT_BUNDLE.name:
        return export_sqrt(work, out)
    model_file = work / "tiny.py"
    model_file.write_text(TINY_MODEL_SOURCE, encoding="utf-8")
    return export_tiny(model_file, write_samples(work), out)


def regenerate(names: list[str]) -> int:
    unknown = sorted(set(names) - set(COMMITTED_BUNDLES))
    if unknown:
        known = ", ".join(COMMITTED_BUNDLES)
        print(f"no committed bundle {', '.join(unknown)}; the committed bundles: {known}", file=sys.stderr)
        return 2
    for name in names or list(COMMITTED_BUNDLES):
        committed = COMMITTED_BUNDLES[name]
        with tempfile.TemporaryDirectory() as work:
            out = Path(work) / "out" / name
            code = export_committed(name, Path(work), out)
            if code != 0:
                return code
            shutil.rmtree(committed, ignore_errors=True)
            shutil.copytree(out, committed)
        size = sum(path.stat().st_size for path in committed.iterdir())
        print(f"wrote {committed} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(regenerate(sys.argv[1:]))
