"""ExecuTorch without torch, side by side in one run: the torch-free C++ runtime (edgeline's shim) vs ExecuTorch's
Python runtime (torch) vs LiteRT, on the same reference models.

For each bundle and runtime, a fresh process (as a device's daemon starts): time from spawning it to the first
answer of ``Model.predict`` (imports, loading, one inference), its peak resident memory (VmHWM) then, and the
median time per ``predict`` call after it (batch 1, one thread). Rounds are interleaved, medians reported.

    python benchmarks/executorch_runtime.py --write benchmarks/results/executorch_runtime.md

Goals (issue 37): start-up and memory within 1.5x of LiteRT's, latency within 1.2x of the Python runtime's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from report import fresh_process_probe, markdown_table, publish  # benchmarks/report.py, next to this script

PROBE = r"""
import json, sys, time
start = time.perf_counter()
import numpy as np
from edgeline import load
bundle, seconds = sys.argv[1], float(sys.argv[2])
golden = np.load(f"{bundle}/golden.npz")
x = [golden[k][:1] for k in sorted(k for k in golden.files if k.startswith("input_"))]
model = load(bundle, threads=1)
model.predict(*x)
first = time.perf_counter() - start
peak = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
calls, begin = 0, time.perf_counter()
while time.perf_counter() - begin < seconds:
    model.predict(*x)
    calls += 1
per_call = (time.perf_counter() - begin) / calls
print(json.dumps({"first_s": first, "peak_mb": peak, "per_call_us": per_call * 1e6, "runtime": model.runtime,
                  "torch": "torch" in sys.modules}))
"""

RUNS = (
    ("executorch-xnnpack", "torch-free", {"EDGELINE_EXECUTORCH_RUNTIME": "native"}),
    ("executorch-xnnpack", "python (torch)", {"EDGELINE_EXECUTORCH_RUNTIME": "python"}),
    ("litert", "litert", {}),
)


def probe(bundle: Path, env: dict[str, str], seconds: float) -> dict[str, float]:
    return fresh_process_probe(PROBE, bundle, seconds, env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet8", "digits"])
    parser.add_argument("--precisions", nargs="*", default=["int8-static", "fp32"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent calling predict, per process")
    parser.add_argument("--work", type=Path, help="where to keep trained models and bundles (default: temporary)")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()

    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.reference import prepare
    from edgeline.native_output import capture_native_output

    work = args.work or Path(tempfile.mkdtemp(prefix="edgeline-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    profile = work / "bench.toml"
    profile.write_text(
        'id = "bench"\nname = "benchmark"\ndescription = "open budgets"\nmemory_mb = 4096\nos = "any"\n'
        '[cpu]\nname = "host"\narch = "x86_64"\ncores = 2\nisa_features = []\n'
        '[[targets]]\nbackend = "litert"\nprecision = "fp32"\nthreads = 1\n[budgets]\nmax_accuracy_drop = 100.0\n'
    )
    bundles: dict[tuple[str, str, str], Path] = {}
    for name in args.models:
        reference = prepare(name, work / name)
        for precision in args.precisions:
            for backend in ("executorch-xnnpack", "litert"):
                out = work / "bundles" / f"{name}-{backend}-{precision}"
                if not (out / "manifest.json").is_file():
                    print(f"[{name}] export {backend} {precision}", file=sys.stderr, flush=True)
                    with capture_native_output():
                        run_export(ExportOptions(
                            model=str(reference.model_path), profile=str(profile),
                            calibration=reference.calibration_path, validation=reference.validation_path,
                            backend=backend, precision=precision, out=out, force=True,
                            task=reference.task if reference.task != "classify" else None,  # type: ignore[arg-type]
                        ))  # fmt: skip
                bundles[(name, backend, precision)] = out

    results: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for round_index in range(args.rounds):  # interleaved: every variant once per round
        print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name in args.models:
            for precision in args.precisions:
                for backend, label, env in RUNS:
                    found = probe(bundles[(name, backend, precision)], env, args.seconds)
                    results.setdefault((name, precision, label), []).append(found)

    rows = [("model", "precision", "runtime", "torch loaded", "spawn to first answer (s)", "peak RSS (MB)",
             "predict (µs)", "start / LiteRT", "RSS / LiteRT", "predict / Python runtime")]  # fmt: skip
    for name in args.models:
        for precision in args.precisions:

            def median(label: str, key: str, name: str = name, precision: str = precision) -> float:
                return statistics.median(r[key] for r in results[(name, precision, label)])

            for _, label, _ in RUNS:
                torch_loaded = any(r["torch"] for r in results[(name, precision, label)])
                rows.append((
                    name, precision, label, "yes" if torch_loaded else "no",
                    f"{median(label, 'spawn_to_first_s'):.2f}", f"{median(label, 'peak_mb'):.0f}",
                    f"{median(label, 'per_call_us'):.1f}",
                    f"{median(label, 'spawn_to_first_s') / median('litert', 'spawn_to_first_s'):.2f}",
                    f"{median(label, 'peak_mb') / median('litert', 'peak_mb'):.2f}",
                    "-" if label == "litert"
                    else f"{median(label, 'per_call_us') / median('python (torch)', 'per_call_us'):.2f}",
                ))  # fmt: skip
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    publish(
        markdown_table(rows),
        script=__file__,
        title="ExecuTorch without torch: torch-free runtime vs Python runtime vs LiteRT",
        intro=f"Machine: {machine}; shared and noisy, so compare within this run. Median of {args.rounds} "
        "interleaved rounds; each cell a fresh process: `spawn to first answer` is a bare interpreter's start plus "
        "imports, loading the bundle and one `predict`; peak RSS is the process's VmHWM after that; `predict` is "
        f"the median time per call over {args.seconds:g} s after it (batch 1, one thread).",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
