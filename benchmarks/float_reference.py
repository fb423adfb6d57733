"""The float reference of `edgeline export`: one call per sample against batches (direct or vectorised), side by side.

For each reference model's ``model.pt2`` (exported for a batch of 1) and its validation samples, the float outputs
are computed the old way (one call per sample) and by ``run_float`` (batches of 64 through ``torch.vmap`` when the
program refuses a batch); both are checked to agree. Median of interleaved rounds.

    python benchmarks/float_reference.py --write benchmarks/results/float_reference.md

Needs the reference models: ``python benchmarks/runtime_overhead.py --work artifacts/bench`` prepares them, or
``edgeline reference prepare all --out artifacts/bench``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import publish

from edgeline.export.fidelity import _batched_call, _single, run_float
from edgeline.export.loading import load_model
from edgeline.samples import SampleSet, match_inputs, read_npz

MODELS = ("digits", "resnet8", "ds_cnn", "vww", "autoencoder")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("artifacts/bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = ["| model | samples | way taken | one call per sample, s | batched, s | speed-up | max abs difference |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in MODELS:
        folder = args.work / name
        if not (folder / "model.pt2").is_file():
            print(f"{name}: no {folder / 'model.pt2'}, skipped", file=sys.stderr)
            continue
        loaded = load_model(str(folder / "model.pt2"))
        _, arrays, labels = match_inputs(read_npz(folder / "validation.npz"), loaded.forward_parameters, name)
        samples = SampleSet([a.astype(np.float32) for a in arrays], labels, name)
        old_times, new_times = [], []
        with torch.no_grad():
            way = _batched_call(loaded.module, samples)
            for _ in range(args.rounds):
                start = time.perf_counter()
                old = [_single(loaded.module, samples.sample(i)) for i in range(len(samples))]
                old_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                new = run_float(loaded.module, samples).outputs
                new_times.append(time.perf_counter() - start)
        difference = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(old, new, strict=True))
        before, after = statistics.median(old_times), statistics.median(new_times)
        rows.append(
            f"| {name} | {len(samples)} | {way.__name__ if way else 'one per sample'} | {before:.2f} | {after:.2f} "
            f"| {before / after:.1f}x | {difference:.1e} |"
        )
    publish(
        "\n".join(rows),
        script=__file__,
        title="Float reference: one call per sample vs batches",
        intro=f"Each reference model's `model.pt2` on its validation samples, 1 torch thread, median of {args.rounds} "
        "interleaved rounds on this 2-core machine.",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
