"""How many inputs a bad version answers before its trial stops (``edgeline.updates.trial``): the real trial
(``TrialRunner`` and ``Trial``, the default gates: 200 inputs, 90% agreement, at most 1% failures) on real bundles,
v1 the tests' tiny classifier (``tests/data/tiny-int8``) and, as v2 in turn:

- random weights: the tiny model initialised with other seeds (seed 7 is the "retrained" version of
  ``tests/test_updates_daemon.py``), exported here as int8 LiteRT bundles (needs the export extra);
- a version whose runtime fails on every input (``tests.update_repo.versioned(fail_every_input=True)``);
- v1 itself as v2: never stopped, committed after its 200 inputs.

Each runs on ``--streams`` input streams of the daemon tests' inputs (64 uniform floats in [0, 1), one seed per
stream); the agreement column is the share of 200 inputs on which v2's top-1 class is v1's, over all streams.

    python benchmarks/trial_early_stop.py --work artifacts/bench-trial-stop \
        --write benchmarks/results/trial_early_stop.md

About a minute on a 2-core machine, most of it the exports (kept in WORK and reused when their source is the same).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table, publish

from edgeline.model import Model, load
from edgeline.updates.policy import Gates
from edgeline.updates.swap import TrialRunner
from edgeline.updates.trial import Trial, agree
from tests.tiny_bundle import COMMITTED_BUNDLE, TINY_MODEL_SOURCE, export_tiny, write_samples
from tests.update_repo import versioned

SEEDS = (7, 1, 2, 3)


def random_weights(work: Path, seed: int) -> Path:
    """The tiny model initialised with ``seed``, exported as v2 (reused when WORK has it from the same source)."""
    source = TINY_MODEL_SOURCE.replace(
        "def model():\n    return Tiny()", f"def model():\n    torch.manual_seed({seed})\n    return Tiny()"
    )
    folder = work / "exports" / f"seed{seed}"
    model_file, out = folder / "tiny.py", folder / "bundle"
    if not (out / "manifest.json").is_file() or model_file.read_text() != source:
        folder.mkdir(parents=True, exist_ok=True)
        model_file.write_text(source)
        if export_tiny(model_file, write_samples(folder), out) != 0:
            raise SystemExit(f"the export of seed {seed} failed")
    return versioned(work / "versions" / f"seed{seed}", 2, source=out, manifest={"name": "tiny"})


def image(rng: np.random.Generator) -> np.ndarray:
    return rng.random(64, dtype=np.float32).reshape(1, 1, 8, 8)


def one_trial(previous: Model, new: Model, stream: int) -> tuple[int, int, bool]:
    """(inputs the trial took, answers the new version gave, committed) on one stream."""
    trial = Trial(version=2, previous_version=1, gates=Gates(), kind="classify", latency_budget_ms=None)
    runner = TrialRunner(previous, trial)
    rng = np.random.default_rng(stream)
    answered = 0
    while not trial.done():
        model, _, _ = runner.run(new, [image(rng)])
        answered += model is new
    return trial.inputs, answered, trial.judge().commit


def agreement(previous: Model, new: Model, streams: int) -> str:
    agreed = total = 0
    for stream in range(streams):
        rng = np.random.default_rng(stream)
        for _ in range(200):
            x = image(rng)
            try:
                outputs = new.predict(x)
            except RuntimeError:
                continue
            agreed += agree("classify", outputs, previous.predict(x), tolerance=0.1)
            total += 1
    return f"{agreed / total:.1%}" if total else "none answered"


def spread(values: list[int]) -> str:
    return f"{statistics.median(values):g} ({min(values)}-{max(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("artifacts/bench-trial-stop"))
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    previous = load(COMMITTED_BUNDLE)
    versions = {f"random weights, seed {seed}": random_weights(args.work, seed) for seed in SEEDS}
    versions["fails on every input"] = versioned(args.work / "versions" / "failing", 2, fail_every_input=True)
    versions["v1 itself"] = versioned(args.work / "versions" / "same", 2)
    rows = [("v2", "agreement with v1", "inputs until the verdict", "answers by v2", "committed")]
    for name, bundle in versions.items():
        new = load(bundle)
        runs = [one_trial(previous, new, stream) for stream in range(args.streams)]
        committed = sum(commit for _, _, commit in runs)
        rows.append((name, agreement(previous, new, args.streams), spread([r[0] for r in runs]),
                     spread([r[1] for r in runs]), f"{committed} of {len(runs)}"))  # fmt: skip
    intro = (
        f"The default gates (200 inputs, 90% agreement, at most 1% failures), {args.streams} input streams per "
        "version; inputs and answers: median (min-max) over the streams. v1 answers what v2 fails on."
    )
    publish(markdown_table(rows), script=__file__, title="A trial stops once its verdict is certain", intro=intro,
            write=args.write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
