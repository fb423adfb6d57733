"""Per reference model and target, one table: fidelity, size, placement and quantized shares, and the figures each
target can honestly give here: host latency for CPU targets, the HTP emulator's fidelity for Qualcomm, vela's
estimates for Ethos-U, "not measured" for Core ML off macOS.

Each row is one target of one device profile, exported as `edgeline export` would (the profile's budgets decide the
status), so a rejection shows the same reason the user would see.

    python benchmarks/accelerators.py --write benchmarks/results/accelerators.md
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from report import markdown_table, publish  # benchmarks/report.py, next to this script

REPO = Path(__file__).resolve().parents[1]

ROWS = (
    ("rpi5", "litert", "fp32"),
    ("rpi5", "litert", "int8-static"),
    ("rpi5", "executorch-xnnpack", "int8-static"),
    ("jetson-orin-nano", "onnxruntime", "fp32"),
    ("snapdragon-8-gen-3", "onnxruntime", "int8-static"),
    ("snapdragon-8-gen-3", "qnn-htp", "int8-static"),
    ("qcs6490", "qnn-htp", "int8-static"),
    ("ethos-u55-128", "ethos-u", "int8-static"),
    ("imx93", "ethos-u", "int8-static"),
    ("iphone-15-pro", "coreml", "fp16"),
    ("iphone-15-pro", "coreml", "int8-weights"),
    ("iphone-15-pro", "executorch-coreml", "fp16"),
    ("iphone-15-pro", "executorch-xnnpack", "int8-static"),
)


def single_target_profile(profile_id: str, backend: str, precision: str, work: Path) -> Path:
    """The bundled profile with its targets replaced by one: its budgets and accelerator sections decide."""
    text = (REPO / "device_profiles" / "profiles" / f"{profile_id}.toml").read_text()
    kept = re.sub(r"\[\[targets\]\]\n(?:[a-z_]+ = .*\n)+\n?", "", text)
    first_table = re.search(r"^\[(?!\[)", kept, flags=re.MULTILINE)
    assert first_table is not None, profile_id
    target = f'[[targets]]\nbackend = "{backend}"\nprecision = "{precision}"\nthreads = 1\n\n'
    path = work / f"{profile_id}-{backend}-{precision}.toml"
    path.write_text(kept[: first_table.start()] + target + kept[first_table.start() :])
    return path


def export_target(ref: object, profile: Path, out: Path) -> object:
    """The one target of ``profile`` exported for the prepared reference model ``ref`` into ``out``, as
    ``edgeline export`` would: its ``TargetOutcome``."""
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.native_output import capture_native_output

    with capture_native_output():
        report = run_export(ExportOptions(
            model=str(ref.model_path), profile=str(profile), calibration=ref.calibration_path,  # type: ignore[attr-defined]
            validation=ref.validation_path, out=out, force=True,  # type: ignore[attr-defined]
            task=ref.task if ref.task != "classify" else None,  # type: ignore[attr-defined]
        ))  # fmt: skip
    return report.outcomes[0]


def fidelity_cell(outcome: object) -> str:
    """The export table's fidelity, tagged with where it was measured when that was not the bundle's own runtime."""
    from edgeline.export.report import TargetOutcome, fidelity_summary

    assert isinstance(outcome, TargetOutcome)
    figure = fidelity_summary(outcome)
    where = outcome.fidelity.measured_with if outcome.fidelity is not None else None
    if where and "HTP emulator" in where:
        figure += " [HTP emulator]"
    elif where and "TFLite Micro" in where:
        figure += " [TFLM, int8 model]"
    elif where and where.startswith("LiteRT") and "vela" in where:
        figure += " [LiteRT, int8 model]"
    return figure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="reference models (default: all)")
    parser.add_argument("--rows", nargs="*", help="PROFILE/BACKEND/PRECISION rows (default: all)")
    parser.add_argument("--work", type=Path, help="where to keep trained models (default: a temporary dir)")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()

    from edgeline.device_profiles import load_profile
    from edgeline.export.reference import CATALOGUE, REFERENCE_MODELS, prepare
    from edgeline.export.report import TargetOutcome

    work = args.work or Path(tempfile.mkdtemp(prefix="edgeline-accel-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [tuple(r.split("/")) for r in args.rows] if args.rows else list(ROWS)
    header = ("model", "profile", "target", "status", "size", "fidelity", "accel.", "quant.", "memory",
              "latency / estimate", "notes")  # fmt: skip
    table = [header]
    # (the detector's per-target figures are benchmarks/detection.py's)
    for name in args.models or sorted(n for n in REFERENCE_MODELS if CATALOGUE[n].task != "detect"):
        print(f"[{name}] preparing", file=sys.stderr, flush=True)
        ref = prepare(name, work / name)
        for profile_id, backend, precision in rows:
            print(f"[{name}] {profile_id} {backend} {precision}", file=sys.stderr, flush=True)
            profile = single_target_profile(profile_id, backend, precision, work)
            out = work / "bundles" / f"{name}-{profile_id}-{backend}-{precision}"
            try:
                outcome = export_target(ref, profile, out)
            except Exception as exc:  # a row says what went wrong, and the table goes on
                outcome = TargetOutcome(backend, precision, 1, status="failed", reason=f"{type(exc).__name__}: {exc}")
            table.append(row(name, profile_id, outcome, load_profile(str(profile)).budgets))
    publish(
        markdown_table(table),
        script=__file__,
        title="Accelerator targets: fidelity, size, placement and the figures each can give here",
        intro=(
            "One row per reference model and device-profile target, exported with the profile's budgets. "
            "accel./quant.: the share of the model's work (multiply-accumulates, counted from the converted graph) "
            "and the count of its operators on the accelerator / computing in the integer precision; '*' marks the "
            "share the profile's budget judged ('-': no accelerator or a float precision; '?': unknown, the "
            "manifest says why). Memory: resident memory a fresh process gains loading the bundle and running it "
            "once on this machine (CPU targets), or TFLite Micro's arena; '-' where it does not run here as on the "
            "device. Latency: host "
            "median (1 thread, this x86-64 machine) for CPU targets only; vela's estimate for Ethos-U (not a "
            "measurement); nothing for the HTP emulator or Core ML, whose host figures say nothing of the device."
        ),
        write=args.write,
    )
    return 0


def row(name: str, profile_id: str, outcome: object, budgets: object) -> tuple[str, ...]:
    from edgeline.export.report import TargetOutcome, shares
    from edgeline.manifest import Budgets

    assert isinstance(outcome, TargetOutcome) and isinstance(budgets, Budgets)
    size = f"{outcome.size_bytes / 1024:.1f} KiB" if outcome.size_bytes is not None else "-"
    accelerator, quantized = shares(outcome, budgets)
    memory = "-"
    if outcome.memory is not None and outcome.memory.resident_mb is not None:
        memory = f"{outcome.memory.resident_mb:.1f} MB"
    elif outcome.memory is not None and outcome.memory.arena_bytes is not None:
        memory = f"arena {outcome.memory.arena_bytes / 1024:.1f} KiB"
    estimates = outcome.estimates
    if outcome.host_latency_ms is not None:
        latency = f"{outcome.host_latency_ms:.3f} ms (host)"
    elif estimates is not None and estimates.inference_ms is not None:
        sram = f", SRAM {estimates.sram_bytes / 1024:.1f} KiB" if estimates.sram_bytes is not None else ""
        latency = f"~{estimates.inference_ms:.3g} ms, {estimates.cycles:,} cycles{sram} (vela est.)"
    else:
        latency = "-"
    notes = (outcome.reason or "").replace("|", "/")[:160]
    return (name, profile_id, f"{outcome.backend} {outcome.precision}", outcome.status, size,
            fidelity_cell(outcome), accelerator, quantized, memory, latency, notes)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
