"""The tests' committed bundles: the tiny classifier (int8 LiteRT for rpi5) with its sample files, the sqrt model
(fp32 LiteRT, any batch size, NaN outputs for negative inputs), and ExecuTorch programs for the torch-free runtime:
the tiny classifier in fp32 and int8 (XNNPACK) and a model of two inputs in int8, with what ExecuTorch's Python
runtime answered on their golden inputs (``executorch_python_outputs.npz``: the device tier, which has no torch,
compares the torch-free runtime's answers with it); OpenVINO IRs of the tiny classifier in fp32 and int8 (NNCF).

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
    "COMMITTED_OV_BUNDLES",
    "COMMITTED_PTE_BUNDLES",
    "COMMITTED_SQRT_BUNDLE",
    "IMAGE_SHAPE",
    "PAIR_MODEL_SOURCE",
    "PYTHON_RUNTIME_OUTPUTS",
    "SQRT_MODEL_SOURCE",
    "TINY_MODEL_SOURCE",
    "export_committed",
    "export_sqrt",
    "export_target",
    "export_tiny",
    "write_samples",
]

DATA = Path(__file__).parent / "data"
COMMITTED_BUNDLE = DATA / "tiny-int8"
COMMITTED_SQRT_BUNDLE = DATA / "sqrt-fp32"
COMMITTED_PTE_BUNDLES = {name: DATA / name for name in ("tiny-pte-fp32", "tiny-pte-int8", "pair-pte-int8")}
"""ExecuTorch bundles (XNNPACK): the tiny classifier in fp32 (x86-64's target) and int8-static (rpi5's), and the
two-input model in int8-static (rpi5)."""
COMMITTED_OV_BUNDLES = {name: DATA / name for name in ("tiny-ov-fp32", "tiny-ov-int8")}
"""OpenVINO bundles (IR): the tiny classifier in fp32 and int8-static (NNCF), both x86-64's targets."""
TARGETS = {
    "tiny-pte-fp32": ("x86-64", "executorch-xnnpack", "fp32"),
    "tiny-pte-int8": ("rpi5", "executorch-xnnpack", "int8-static"),
    "pair-pte-int8": ("rpi5", "executorch-xnnpack", "int8-static"),
    "tiny-ov-fp32": ("x86-64", "openvino", "fp32"),
    "tiny-ov-int8": ("x86-64", "openvino", "int8-static"),
}
"""The fresh exports (``export_target``) of the committed bundles other than the LiteRT ones: profile, backend,
precision."""
PYTHON_RUNTIME_OUTPUTS = DATA / "executorch_python_outputs.npz"
"""``<bundle>/output_<j>``: ExecuTorch's Python runtime's outputs on each ExecuTorch bundle's golden inputs, one
sample per call, as its model takes them (made by ``python -m tests.tiny_bundle``)."""
COMMITTED_BUNDLES = {
    path.name: path
    for path in (
        COMMITTED_BUNDLE,
        COMMITTED_SQRT_BUNDLE,
        *COMMITTED_PTE_BUNDLES.values(),
        *COMMITTED_OV_BUNDLES.values(),
    )
}

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

PAIR_MODEL_SOURCE = '''\
import torch
from torch import nn


class Pair(nn.Module):
    """An image of 4 values and a mask of 2, concatenated into a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3)

    def forward(self, image, mask):
        return self.fc(torch.cat([image, mask], dim=1))


def model():
    return Pair()
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


def write_pair_samples(root: Path) -> dict[str, Path]:
    """The two-input model's samples: calibration (16) and validation (8, with labels), named by forward's
    parameters."""
    rng = np.random.default_rng(20261128)
    calibration, validation = root / "pair_calibration.npz", root / "pair_validation.npz"
    np.savez(calibration, image=rng.random((16, 4), dtype=np.float32), mask=rng.random((16, 2), dtype=np.float32))
    np.savez(
        validation,
        image=rng.random((8, 4), dtype=np.float32),
        mask=rng.random((8, 2), dtype=np.float32),
        labels=rng.integers(0, 3, 8),
    )
    return {"calibration": calibration, "validation": validation}


def export_target(name: str, work: Path, out: Path) -> int:
    """``edgeline export`` of a committed bundle of ``TARGETS`` (needs the export extra)."""
    from edgeline.cli import main

    profile, backend, precision = TARGETS[name]
    if name.startswith("pair"):
        model_file, samples = work / "pair.py", write_pair_samples(work)
        model_file.write_text(PAIR_MODEL_SOURCE, encoding="utf-8")
    else:
        model_file, samples = work / "tiny.py", write_samples(work)
        model_file.write_text(TINY_MODEL_SOURCE, encoding="utf-8")
    return main(
        ["export", f"{model_file}:model", "--profile", profile, "--calibration", str(samples["calibration"]),
         "--validation", str(samples["validation"]), "--backend", backend, "--precision", precision,
         "--out", str(out)]
    )  # fmt: skip


def python_runtime_outputs(bundle: Path) -> list[np.ndarray]:
    """ExecuTorch's Python runtime (torch) on the bundle's golden inputs, one sample per call, outputs stacked."""
    import torch
    from executorch.runtime import Runtime

    golden = np.load(bundle / "golden.npz")
    inputs = [golden[name] for name in sorted(k for k in golden.files if k.startswith("input_"))]
    method = Runtime.get().load_program(bundle / "model.pte").load_method("forward")
    answers = [
        [output.numpy().copy() for output in method.execute([torch.from_numpy(x[i : i + 1].copy()) for x in inputs])]
        for i in range(len(inputs[0]))
    ]
    return [np.concatenate([answer[j] for answer in answers]) for j in range(len(answers[0]))]


def write_python_runtime_outputs() -> Path:
    arrays = {
        f"{name}/output_{j}": output
        for name, bundle in COMMITTED_PTE_BUNDLES.items()
        for j, output in enumerate(python_runtime_outputs(bundle))
    }
    np.savez(PYTHON_RUNTIME_OUTPUTS, allow_pickle=False, **arrays)
    return PYTHON_RUNTIME_OUTPUTS


def export_committed(name: str, work: Path, out: Path) -> int:
    """Export the bundle committed as ``tests/data/<name>`` to ``out`` (``work``: a folder for its sources)."""
    if name == COMMITTED_SQRT_BUNDLE.name:
        return export_sqrt(work, out)
    if name in TARGETS:
        return export_target(name, work, out)
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
    if not names or set(names) & set(COMMITTED_PTE_BUNDLES):
        print(f"wrote {write_python_runtime_outputs()}")
    return 0


if __name__ == "__main__":
    sys.exit(regenerate(sys.argv[1:]))
