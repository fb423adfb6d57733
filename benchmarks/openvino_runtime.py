"""OpenVINO on x86-64, side by side in one run: OpenVINO fp32 and int8 (NNCF) vs LiteRT int8 and ONNX Runtime int8,
on the same reference models, each exported for the x86-64 profile as ``edgeline export`` does; then NNCF's accuracy
control on the model whose plain int8 misses its accuracy budget.

For each reference model (``edgeline reference prepare``: digits, ds_cnn, resnet8, vww, the anomaly autoencoder) and
each bundle, ``edgeline export MODEL --profile x86-64 --backend B --precision P --calibration ... --validation ...
[--labels ...]``: the size of the model files (the manifest's ``files`` but golden.npz), the manifest's fidelity
(accuracy against the float model's, or top-1 agreement and cosine where there are no labels), and, in a fresh
process per run (as a device's daemon starts): the time from spawning it to the first answer of ``Model.predict``
(imports, loading, one inference), its peak resident memory (VmHWM) then, and the median time per ``predict`` call
after it (batch 1, one thread). A target the exporter fails or the profile's budgets reject has its reason in the
table. Rounds are interleaved, medians reported.

Second table: ``tests/outlier_model.py``'s digits CNN (one channel 300 times the others), whose plain int8 loses
10-15 points: the float model's accuracy on the 397 held-out digits, OpenVINO's plain int8 (``mixed_precision``
off, exported against open budgets so that it is written), and the bundle NNCF's accuracy control makes against the
x86-64 profile's 1-point budget: its held-out accuracy (``edgeline.load(bundle).predict``), the layers it kept float,
its size and its latency.

    python benchmarks/openvino_runtime.py --write benchmarks/results/openvino_runtime.md

Every figure is a host timing on the machine it ran on (the one the committed results name: a 2-core shared
x86-64 VM, AMD EPYC with AVX2 and FMA but neither VNNI nor AVX-512), not a device's: the profile's latency budget is
a figure on the device, checked by ``edgeline verify`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/outlier_model.py
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
times = []
begin = time.perf_counter()
while time.perf_counter() - begin < seconds:
    tick = time.perf_counter()
    model.predict(*x)
    times.append(time.perf_counter() - tick)
print(json.dumps({"first_s": first, "peak_mb": peak, "per_call_us": sorted(times)[len(times) // 2] * 1e6}))
"""

MODELS = ("digits", "ds_cnn", "resnet8", "vww", "autoencoder")
TARGETS = (("openvino", "fp32"), ("openvino", "int8-static"), ("litert", "int8-static"), ("onnxruntime", "int8-static"))
PROFILE = "x86-64"

OPEN_PROFILE = """\
# x86-64 with open budgets: plain int8 of the outlier model is written, not rejected (benchmarks/openvino_runtime.py)
id = "x86-64-open"
name = "x86-64, open budgets"
description = "benchmark only"
memory_mb = 8192
os = "any"
[cpu]
name = "x86-64-v3"
arch = "x86_64"
cores = 4
isa_features = ["sse4.2", "avx2", "fma"]
[[targets]]
backend = "openvino"
precision = "int8-static"
threads = 4
[budgets]
max_accuracy_drop = 100.0
"""


def probe(bundle: Path, seconds: float) -> dict[str, float]:
    return fresh_process_probe(PROBE, bundle, seconds)


def _cpu() -> str:
    """The CPU's name and the vector extensions int8 speed depends on, from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = " ".join(fields.get("model name\t", platform.processor() or platform.machine()).split())
    flags = set(fields.get("flags\t\t", "").split())
    vnni = "VNNI" if flags & {"avx512_vnni", "avx_vnni"} else "no VNNI"
    avx512 = "AVX-512" if "avx512f" in flags else "no AVX-512"
    return f"{name}, {'AVX2' if 'avx2' in flags else 'no AVX2'}, {vnni}, {avx512}"


def _reason(exc: BaseException) -> str:
    """An exception as one table cell."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 400 else text[:397] + "..."
    return f"{type(exc).__name__}: {text}".replace("|", "\\|")


def _manifest(bundle: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((bundle / "manifest.json").read_text())
    return document


def _size(manifest: dict[str, Any]) -> int:
    return sum(int(f["size"]) for f in manifest["files"] if f["path"] != "golden.npz")


def _fidelity(manifest: dict[str, Any]) -> str:
    fidelity = manifest.get("fidelity") or {}
    if fidelity.get("status") != "measured":
        return f"not measured ({fidelity.get('reason')})"
    accuracy, float_accuracy = fidelity.get("accuracy"), fidelity.get("accuracy_float")
    if accuracy is not None and float_accuracy is not None:
        return f"accuracy {accuracy:.2%} (float {float_accuracy:.2%})"
    found = []
    if fidelity.get("anomaly_agreement") is not None:
        found.append(f"anomaly agreement {fidelity['anomaly_agreement']:.2%}")
    if fidelity.get("top1_agreement") is not None:
        found.append(f"top-1 agreement {fidelity['top1_agreement']:.2%}")
    if fidelity.get("cosine_min") is not None:
        found.append(f"cosine ≥ {fidelity['cosine_min']:.4f}")
    return ", ".join(found) or "-"


def _int8_share(manifest: dict[str, Any]) -> str:
    placement = manifest.get("placement") or {}
    ops, quantized = placement.get("ops"), placement.get("quantized_ops")
    if manifest["precision"] == "fp32" or ops is None or quantized is None:
        return "-"
    macs, quantized_macs = placement.get("macs"), placement.get("quantized_macs")
    share = f" ({quantized_macs / macs:.1%} of MACs)" if macs and quantized_macs is not None else ""
    return f"{quantized}/{ops}{share}"


def _kept(manifest: dict[str, Any]) -> str:
    quantization = manifest.get("quantization") or {}
    return ", ".join(kept["module"] for kept in quantization.get("kept_float") or ()) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="reference models (those that exist)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="time spent calling predict, per process")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "build" / "bench-openvino",
        help="the trained reference models (prepared once) and the bundles (exported each run)",
    )
    parser.add_argument("--reuse", action="store_true", help="keep bundles already exported in --work")
    parser.add_argument("--write", type=Path, help="also write the tables (markdown) here")
    args = parser.parse_args()
    began = time.perf_counter()

    import numpy as np

    from edgeline import load
    from edgeline.device_profiles import Precision
    from edgeline.device_profiles.errors import EdgelineError
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.reference import find_prepared, prepare
    from edgeline.export.reference.registry import REFERENCE_MODELS
    from edgeline.native_output import capture_native_output

    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    known = set(REFERENCE_MODELS)
    models = [name for name in args.models if name in known]
    skipped = [name for name in args.models if name not in known]
    if skipped:
        print(f"no reference model {', '.join(skipped)}; known: {', '.join(sorted(known))}", file=sys.stderr)

    def export(options: ExportOptions) -> tuple[Path | None, str, float]:
        """(the bundle or None, why not, seconds), the export's outcome as a cell."""
        assert options.out is not None
        if args.reuse and (options.out / "manifest.json").is_file():
            return options.out, "", 0.0
        begin = time.perf_counter()
        try:
            with capture_native_output():
                run_export(options)
        except (EdgelineError, RuntimeError, ValueError) as exc:  # rejected by budgets, or the exporter failed
            return None, _reason(exc), time.perf_counter() - begin
        return options.out, "", time.perf_counter() - begin

    # -- the reference models, four bundles each --------------------------------------------------------------------
    exported: dict[tuple[str, str, str], tuple[Path | None, str, float]] = {}
    trained = " (the reference models already prepared)"
    for name in models:
        if find_prepared(name, work / "reference" / name) is None:
            trained = ", training the reference models"
        reference = prepare(name, work / "reference" / name)  # trains once; reused when already prepared
        for backend, precision in TARGETS:
            print(f"[{name}] export {backend} {precision}", file=sys.stderr, flush=True)
            exported[(name, backend, precision)] = export(ExportOptions(
                model=str(reference.model_path), profile=PROFILE,
                calibration=reference.calibration_path, validation=reference.validation_path,
                backend=backend, precision=Precision(precision), out=work / "bundles" / f"{name}-{backend}-{precision}",
                force=True, labels=reference.labels or None, threshold=reference.threshold,
                task=reference.task if reference.task != "classify" else None,  # type: ignore[arg-type]
            ))  # fmt: skip
            print(f"  {exported[(name, backend, precision)][1] or 'ok'}", file=sys.stderr, flush=True)

    # -- the outlier model: float, plain int8, NNCF's accuracy control -----------------------------------------------
    import torch

    from edgeline.export.loading import load_model
    from tests.outlier_model import CALIBRATION, TRAIN, digits, trained_outlier_model

    images, labels = digits()
    held_out, truth = images[TRAIN:], labels[TRAIN:]
    outlier = trained_outlier_model()
    with torch.no_grad():
        found = load_model(f"{outlier}:outlier").module(torch.from_numpy(held_out)).argmax(1).numpy()
    float_accuracy = float(np.mean(found == truth))
    samples = work / "outlier"
    samples.mkdir(exist_ok=True)
    np.savez(samples / "cal.npz", x=images[:CALIBRATION])
    np.savez(samples / "val.npz", x=images[TRAIN : TRAIN + 64], labels=labels[TRAIN : TRAIN + 64])
    (samples / "open.toml").write_text(OPEN_PROFILE)
    variants = (  # label, budget, precision, profile, mixed precision
        ("OpenVINO fp32", "x86-64 (1 point)", Precision.FP32, PROFILE, True),
        ("OpenVINO int8, plain (no mixed precision)", "open", Precision.INT8_STATIC, str(samples / "open.toml"), False),
        ("OpenVINO int8, NNCF accuracy control", "x86-64 (1 point)", Precision.INT8_STATIC, PROFILE, True),
    )
    outlier_bundles: dict[str, tuple[Path | None, str, float]] = {}
    for label, _, precision_, profile, mixed in variants:
        print(f"[outlier] export {label}", file=sys.stderr, flush=True)
        outlier_bundles[label] = export(ExportOptions(
            model=f"{outlier}:outlier", profile=profile, calibration=samples / "cal.npz",
            validation=samples / "val.npz", out=samples / f"bundle-{len(outlier_bundles)}", backend="openvino",
            precision=precision_, force=True, mixed_precision=mixed,
        ))  # fmt: skip
        print(f"  {outlier_bundles[label][1] or 'ok'}", file=sys.stderr, flush=True)
    held_accuracy: dict[str, float] = {}
    for label, (bundle, _, _) in outlier_bundles.items():
        if bundle is not None:
            deployed = load(bundle)
            answers = [int(np.argmax(deployed.predict(image[None])[0])) for image in held_out]
            held_accuracy[label] = float(np.mean(np.array(answers) == truth))

    # -- timings: every bundle once per round, each in a fresh process -----------------------------------------------
    bundles = {key: bundle for key, (bundle, _, _) in exported.items() if bundle is not None}
    bundles.update({("outlier", label, ""): b for label, (b, _, _) in outlier_bundles.items() if b is not None})
    results: dict[tuple[str, str, str], list[dict[str, float]]] = {key: [] for key in bundles}
    loads = [os.getloadavg()[0]]  # another process on the 2 cores shows in the timings: said with them
    for round_index in range(args.rounds):  # interleaved: every bundle once per round
        print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for key, bundle in bundles.items():
            results[key].append(probe(bundle, args.seconds))
        loads.append(os.getloadavg()[0])

    def median(key: tuple[str, str, str], field: str) -> float:
        return statistics.median(r[field] for r in results[key])

    def timings(key: tuple[str, str, str]) -> tuple[str, str, str]:
        return (f"{median(key, 'spawn_to_first_s'):.2f}", f"{median(key, 'peak_mb'):.0f}",
                f"{median(key, 'per_call_us'):.1f}")  # fmt: skip

    rows: list[tuple[str, ...]] = [
        ("model", "backend", "precision", "export", "export (s)", "model bytes", "fidelity (validation set)",
         "int8 operators (share of MACs)", "kept float", "spawn to first answer (s)", "peak RSS (MB)", "predict (µs)")
    ]  # fmt: skip
    for name in models:
        for backend, precision in TARGETS:
            key = (name, backend, precision)
            bundle, reason, seconds = exported[key]
            if bundle is None:
                rows.append((name, backend, precision, f"**not written**: {reason}", f"{seconds:.0f}", *["-"] * 7))
                continue
            manifest = _manifest(bundle)
            rows.append((
                name, backend, precision, "written", f"{seconds:.0f}", f"{_size(manifest):,}", _fidelity(manifest),
                _int8_share(manifest), _kept(manifest), *timings(key),
            ))  # fmt: skip

    second: list[tuple[str, ...]] = [
        ("variant", "budget", "export (s)", "validation (64 digits, manifest)", "held-out accuracy (397 digits)",
         "kept float", "int8 operators (share of MACs)", "model bytes", "spawn to first answer (s)", "peak RSS (MB)",
         "predict (µs)")
    ]  # fmt: skip
    second.append(("float32, torch eager (the reference)", "-", "-", "-", f"{float_accuracy:.2%}", *["-"] * 6))
    missed = ""
    for label, budget, _, _, _ in variants:
        bundle, reason, seconds = outlier_bundles[label]
        if bundle is None:
            second.append((label, budget, f"{seconds:.0f}", f"**not written**: {reason}", *["-"] * 7))
            continue
        manifest = _manifest(bundle)
        missed = ((manifest.get("quantization") or {}).get("int8_missed") or "") or missed
        second.append((
            label, budget, f"{seconds:.0f}", _fidelity(manifest), f"{held_accuracy[label]:.2%}", _kept(manifest),
            _int8_share(manifest), f"{_size(manifest):,}", *timings(("outlier", label, "")),
        ))  # fmt: skip

    total = time.perf_counter() - began
    machine = f"{platform.machine()}, {os.cpu_count()} cores ({_cpu()}), Python {platform.python_version()}"
    versions = []
    for package in ("openvino", "nncf", "ai-edge-litert", "onnxruntime"):
        with contextlib.suppress(PackageNotFoundError):  # a runtime not installed is only not named
            versions.append(f"{package} {version(package)}")
    second_intro = (
        "tests/outlier_model.py's digits CNN (channel 8 of `act1` 300 times the others; the float function unchanged), "
        f"calibrated on the first {CALIBRATION} digits, validated (the manifest's fidelity, what the budget judges) on "
        f"the 64 after the {TRAIN} trained on, and run here with `edgeline.load(bundle).predict` on all 397 held-out "
        "digits. Plain int8 is exported with mixed precision off against open budgets, so that it is written; the "
        "accuracy-controlled bundle against the x86-64 profile, whose 1-point budget plain int8 misses"
        + (f" (its manifest: plain int8 {missed})" if missed else "")
        + ", so that the export runs NNCF's `quantize_with_accuracy_control`; `kept float`: the modules whose "
        "weighted operators it reverted. Timings as above."
    )
    publish(
        f"{markdown_table(rows)}\n\n## NNCF's accuracy control: the outlier model\n\n{second_intro}\n\n"
        f"{markdown_table(second)}",
        script=__file__,
        title="OpenVINO on x86-64: fp32 and int8 (NNCF) vs LiteRT and ONNX Runtime int8",
        intro=f"Machine: {machine}; a shared VM, noisy, so compare within this run. These are **host timings on "
        "this machine, not a device's** (the x86-64 profile's latency budget is judged on the device). "
        f"{', '.join(versions)}. Each bundle exported as `edgeline export MODEL --profile x86-64 --backend B "
        "--precision P` with the reference model's calibration, validation and labels (`edgeline reference "
        "prepare`), judged by the x86-64 profile's budgets (1 point of accuracy; for int8, 80% of the work in int8, "
        "by multiply-accumulates where they are counted, else by operators): "
        "a bundle not written has the exporter's reason. `model bytes`: the manifest's files but golden.npz; "
        "`fidelity`: the manifest's, on the reference model's validation set; `kept float`: what mixed precision "
        f"left in float. Median of {args.rounds} interleaved rounds; each cell a fresh process: `spawn to first "
        "answer` is a bare interpreter's start plus imports, loading the bundle (OpenVINO: compiling it; no "
        "compiled-model cache) and one `predict`; peak RSS is the process's VmHWM after that; `predict` is the "
        f"median call over {args.seconds:g} s after it (batch 1, one thread); the 1-minute load average was "
        f"{', '.join(f'{load:.2f}' for load in loads)} before the timed rounds and after each (the probes' own "
        f"process counts: about 1). The whole run took {total / 60:.1f} minutes{trained}.",
        write=args.write,
    )
    print(f"took {total:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
