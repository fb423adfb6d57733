"""Side by side, one run: torch eager, the raw runtime call, and edgeline's ``predict`` on the same bundle.

For every reference model and backend/precision: export time, bundle size, and per-inference latency
(median of interleaved rounds, batch 1, one thread everywhere). The goal: ``predict`` within 5% of the raw call.

    python benchmarks/runtime_overhead.py --write benchmarks/results/runtime_overhead.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from report import publish  # benchmarks/report.py, next to this script

TARGETS = (("litert", "fp32"), ("litert", "int8-static"), ("executorch-xnnpack", "fp32"),
           ("executorch-xnnpack", "int8-static"))  # fmt: skip


def raw_litert(bundle: Path, x: np.ndarray) -> Callable[[], np.ndarray]:
    """What a user writes by hand with ai-edge-litert, (de)quantizing int8 tensors as the LiteRT docs show."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(bundle / "model.tflite"), num_threads=1)
    interpreter.allocate_tensors()
    inp = interpreter.get_input_details()[0]
    out = interpreter.get_output_details()[0]
    if inp["dtype"] == np.int8:
        in_scale, in_zero = inp["quantization"]
        out_scale, out_zero = out["quantization"]

        def call() -> np.ndarray:
            interpreter.set_tensor(inp["index"], np.clip(np.round(x / in_scale) + in_zero, -128, 127).astype(np.int8))
            interpreter.invoke()
            return (interpreter.get_tensor(out["index"]).astype(np.float32) - out_zero) * out_scale

        return call

    def call_float() -> np.ndarray:
        interpreter.set_tensor(inp["index"], x)
        interpreter.invoke()
        return interpreter.get_tensor(out["index"])

    return call_float


def raw_executorch(bundle: Path, x: np.ndarray) -> Callable[[], np.ndarray]:
    import torch
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(bundle / "model.pte").load_method("forward")
    assert method is not None

    def call() -> np.ndarray:  # a caller gets a new array each time, so wrapping it is part of the call
        return method.execute([torch.from_numpy(x)])[0].numpy()

    return call


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls * 1e6
        calls = max(calls * 2, int(calls * seconds / max(elapsed, 1e-9)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="reference models (default: all)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.1, help="time per measurement")
    parser.add_argument("--work", type=Path, help="where to keep trained models (default: a temporary dir)")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()

    import torch

    from edgeline import load
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.reference import CATALOGUE, REFERENCE_MODELS, prepare
    from edgeline.native_output import capture_native_output
    from edgeline.samples import read_npz

    torch.set_num_threads(1)
    work = args.work or Path(tempfile.mkdtemp(prefix="edgeline-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    # (the detector's runtime figures are benchmarks/detection.py's: its samples are images, not an .npz)
    names = args.models or sorted(n for n in REFERENCE_MODELS if CATALOGUE[n].task != "detect")
    profile = work / "bench.toml"
    profile.write_text(
        'id = "bench"\nname = "benchmark"\ndescription = "open budgets"\nmemory_mb = 4096\nos = "any"\n'
        '[cpu]\nname = "host"\narch = "x86_64"\ncores = 2\nisa_features = []\n'
        '[[targets]]\nbackend = "litert"\nprecision = "fp32"\nthreads = 1\n[budgets]\nmax_accuracy_drop = 100.0\n'
    )
    rows = []
    for name in names:
        print(f"[{name}] preparing", file=sys.stderr, flush=True)
        ref = prepare(name, work / name)
        x = read_npz(ref.validation_path)["x"][:1].astype(np.float32)
        module = torch.export.load(str(ref.model_path)).module()
        tx = torch.from_numpy(x)

        def eager(module=module, tx=tx) -> object:
            with torch.no_grad():
                return module(tx)

        variants = []
        for backend, precision in TARGETS:
            out = work / "bundles" / f"{name}-{backend}-{precision}"
            print(f"[{name}] export {backend} {precision}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            with capture_native_output():
                run_export(ExportOptions(
                    model=str(ref.model_path), profile=str(profile), calibration=ref.calibration_path,
                    validation=ref.validation_path, backend=backend, precision=precision, out=out, force=True,
                    task=ref.task if ref.task != "classify" else None,  # type: ignore[arg-type]
                ))  # fmt: skip
            export_s = time.perf_counter() - start
            size = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model."))
            model = load(out, threads=1)
            raw = raw_litert(out, x) if backend == "litert" else raw_executorch(out, x)
            np.testing.assert_allclose(model.predict(x)[0], raw(), rtol=1e-5, atol=1e-5)
            variants.append((backend, precision, export_s, size, raw, lambda model=model, x=x: model.predict(x)))
        timings: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # interleaved: every variant once per round
            timings.setdefault("eager", []).append(per_call_us(eager, args.seconds))
            for backend, precision, _, _, raw, predict in variants:
                timings.setdefault(f"{backend}/{precision}/raw", []).append(per_call_us(raw, args.seconds))
                timings.setdefault(f"{backend}/{precision}/predict", []).append(per_call_us(predict, args.seconds))
        eager_us = statistics.median(timings["eager"])
        for backend, precision, export_s, size, _, _ in variants:
            raw_us = statistics.median(timings[f"{backend}/{precision}/raw"])
            predict_us = statistics.median(timings[f"{backend}/{precision}/predict"])
            rows.append((name, backend, precision, export_s, size, eager_us, raw_us, predict_us))

    header = ("| model | backend | precision | export s | model size | torch eager µs | raw call µs | "
              "predict µs | predict / raw |")  # fmt: skip
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for name, backend, precision, export_s, size, eager_us, raw_us, predict_us in rows:
        lines.append(
            f"| {name} | {backend} | {precision} | {export_s:.1f} | {size / 1024:.1f} KiB | {eager_us:.1f} | "
            f"{raw_us:.1f} | {predict_us:.1f} | {predict_us / raw_us:.3f} |"
        )
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    publish(
        "\n".join(lines),
        script=__file__,
        title="Runtime overhead: torch eager vs raw runtime call vs edgeline predict",
        intro=f"Machine: {machine}; shared and noisy, so compare ratios within this run. Median of {args.rounds} "
        "interleaved rounds, batch 1, one thread everywhere. 'raw call' is the minimal hand-written code for the "
        "same job (for int8 LiteRT models it quantizes the input and dequantizes the output as the LiteRT docs "
        "show).",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
