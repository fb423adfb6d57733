"""A bundle like a reference model's whose model costs next to nothing: for measuring the daemon without the model.

The model takes the reference model's input (same shape, same int8 quantization path, same calibration and
validation data) and answers as many classes, but computes only a mean per channel and one small linear layer. Run
``daemon_throughput.py`` on it and the daemon's table shows what the daemon reaches when the model's CPU is taken
away and everything else (MQTT, decoding, checks, batching, outbox, answers) stays.

    python benchmarks/null_model.py --like resnet8 ds_cnn --work artifacts/bench

writes ``artifacts/bench/bundles/{name}_null-litert-int8-static`` for each (the reference model is prepared in
``--work`` first if it is not there yet, as ``runtime_overhead.py`` does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", nargs="+", default=["resnet8", "ds_cnn"], help="reference models to imitate")
    parser.add_argument(
        "--fixed-batch", nargs="*", default=["ds_cnn"],
        help="of those, the ones whose null model is fixed to a batch of 1, as the reference model's export is "
        "(the daemon then calls it one sample at a time; the others it batches)",
    )  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("artifacts/bench"))
    args = parser.parse_args()

    import torch

    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.reference import prepare
    from edgeline.native_output import capture_native_output
    from edgeline.samples import read_npz

    torch.manual_seed(0)
    profile = args.work / "null.toml"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(  # the accuracy budget is open: the null model is not meant to be right
        'id = "null"\nname = "null model"\ndescription = "open budgets"\nmemory_mb = 4096\nos = "any"\n'
        '[cpu]\nname = "host"\narch = "x86_64"\ncores = 2\nisa_features = []\n'
        '[[targets]]\nbackend = "litert"\nprecision = "int8-static"\nthreads = 1\n'
        "[budgets]\nmax_accuracy_drop = 100.0\n"
    )
    for name in args.like:
        reference = prepare(name, args.work / name)
        x = read_npz(reference.validation_path)["x"]
        model = _null(x.shape[1], len(reference.labels), fixed=name in args.fixed_batch).eval()
        path = args.work / f"{name}_null" / "model.pt2"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.export.save(torch.export.export(model, (torch.from_numpy(x[:1].astype(np.float32)),)), str(path))
        out = args.work / "bundles" / f"{name}_null-litert-int8-static"
        print(f"[{name}] null model -> {out}", file=sys.stderr, flush=True)
        with capture_native_output():
            run_export(ExportOptions(
                model=str(path), profile=str(profile), calibration=reference.calibration_path,
                validation=reference.validation_path, backend="litert", precision="int8-static", out=out,
                name=f"{name}_null", force=True, labels=reference.labels,
            ))  # fmt: skip
    return 0


def _null(channels: int, classes: int, *, fixed: bool) -> torch.nn.Module:
    """A mean per channel, then a linear layer. ``fixed``: a reshape to a batch of 1 in between, which LiteRT cannot
    resize (the daemon then runs it one sample per call); else nothing stops the daemon from batching it."""
    import torch

    class Null(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(channels, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            means = x.reshape(1, channels, -1).mean(dim=2) if fixed else x.mean(dim=(2, 3))
            return self.linear(means)

    return Null()


if __name__ == "__main__":
    raise SystemExit(main())
