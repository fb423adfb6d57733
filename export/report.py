"""The table printed at the end of ``edgeline export``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgeline.manifest import Estimates, Fidelity, Placement

__all__ = ["ExportReport", "TargetOutcome", "fidelity_summary", "format_report", "shares"]


@dataclass
class TargetOutcome:
    backend: str
    precision: str
    threads: int
    status: Literal["selected", "passed", "rejected", "failed", "not tried"] = "not tried"
    """selected: the profile's order picks it; passed: it met the budgets too, written with ``--all``."""
    reason: str | None = None
    size_bytes: int | None = None
    fidelity: Fidelity | None = None
    host_latency_ms: float | None = None
    placement: Placement | None = None
    estimates: Estimates | None = None
    seconds: float | None = None
    bundle: Path | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "precision": self.precision,
            "threads": self.threads,
            "status": self.status,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "fidelity": self.fidelity.model_dump(mode="json") if self.fidelity else None,
            "host_latency_ms": self.host_latency_ms,
            "placement": self.placement.model_dump(mode="json") if self.placement else None,
            "accelerator_share": self.placement.accelerator_share if self.placement else None,
            "quantized_share": self.placement.quantized_share if self.placement else None,
            "estimates": self.estimates.model_dump(mode="json") if self.estimates else None,
            "export_seconds": self.seconds,
            "bundle": str(self.bundle) if self.bundle is not None else None,
        }


@dataclass
class ExportReport:
    name: str
    profile: str
    out: Path
    outcomes: list[TargetOutcome] = field(default_factory=list)
    version: int | None = None
    validation: Path | None = None

    @property
    def selected(self) -> TargetOutcome | None:
        return next((o for o in self.outcomes if o.status == "selected"), None)

    def next_command(self) -> str:
        selected = self.selected
        if selected is not None and selected.fidelity is not None and selected.fidelity.status == "not-measured":
            # Nothing here ran it (Core ML on Linux): the fidelity check waits for the device.
            return f"edgeline verify {self.out}  (on the device: {selected.fidelity.reason})"
        samples = self.validation or "SAMPLES.npz"
        return f"edgeline infer {self.out} --input {samples}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "profile": self.profile,
            "bundle": str(self.out) if self.selected else None,
            "version": self.version,
            "targets": [o.as_dict() for o in self.outcomes],
            "next": self.next_command() if self.selected else None,
        }


def _size(outcome: TargetOutcome) -> str:
    if outcome.size_bytes is None:
        return "-"
    kib = outcome.size_bytes / 1024
    return f"{kib:.1f} KiB" if kib < 1024 else f"{kib / 1024:.2f} MiB"


def fidelity_summary(outcome: TargetOutcome) -> str:
    fid = outcome.fidelity
    if fid is None:
        return "-"
    if fid.status != "measured":
        return f"not measured: {fid.reason}"
    if fid.accuracy is not None and fid.accuracy_float is not None:
        return f"acc {fid.accuracy * 100:.1f}% (float {fid.accuracy_float * 100:.1f}%)"
    if fid.top1_agreement is not None:
        return f"top-1 agree {fid.top1_agreement * 100:.1f}%"
    if fid.anomaly_agreement is not None:
        return f"flags agree {fid.anomaly_agreement * 100:.1f}%"
    return f"cos min {fid.cosine_min:.4f}"


def _share(value: float | None, known: bool) -> str:
    return f"{value:.0%}" if value is not None else ("?" if known else "-")


def shares(outcome: TargetOutcome) -> tuple[str, str]:
    """The accelerator and quantized shares: "-" where there is no accelerator or no integer precision, "?" where
    the share exists but cannot be known (the manifest says why)."""
    placement = outcome.placement
    if placement is None:
        return "-", "-"
    accelerator = _share(placement.accelerator_share, placement.accelerator is not None)
    if placement.accelerator is not None and placement.accelerator_share is not None:
        accelerator = f"{accelerator} {placement.accelerator}"
    quantized = _share(placement.quantized_share, "quantized_ops" in placement.unknown)
    return accelerator, quantized


def _latency(outcome: TargetOutcome) -> str:
    estimates = outcome.estimates
    if outcome.host_latency_ms is not None:
        return f"{outcome.host_latency_ms:.3f} ms"
    if estimates is not None and estimates.inference_ms is not None:
        return f"~{estimates.inference_ms:.3g} ms (est.)"
    return "-"


def format_report(report: ExportReport) -> str:
    header = ("backend", "precision", "status", "size", "fidelity", "accel.", "quant.", "latency", "bundle / reason")
    rows = [header]
    for o in report.outcomes:
        where = str(o.bundle) if o.bundle is not None else (o.reason or "")
        if o.status == "selected" and any(other.status == "passed" for other in report.outcomes):
            where += "  <- the profile's order picks this one"
        rows.append((o.backend, o.precision, o.status, _size(o), fidelity_summary(o), *shares(o), _latency(o), where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    lines.append("")
    lines.append(
        "accel./quant.: share of the model's operators on the accelerator / in the integer precision ('-' none, "
        "'?' unknown: see the manifest's placement); latency: median on this machine, 1 thread, for CPU targets, or "
        "the compiler's estimate for the device (est.); the device's latency is checked by `edgeline verify` on it."
    )
    for o in report.outcomes:
        if o.estimates is not None and o.status in ("selected", "passed"):
            e = o.estimates
            lines.append(
                f"{o.backend} {o.precision}: estimated by {e.tool} for {e.target}: "
                + ", ".join(
                    f
                    for f in (
                        f"{e.cycles:,} cycles" if e.cycles is not None else "",
                        f"SRAM {e.sram_bytes:,} B" if e.sram_bytes is not None else "",
                        f"flash {e.flash_bytes:,} B" if e.flash_bytes is not None else "",
                        f"DRAM {e.dram_bytes:,} B" if e.dram_bytes is not None else "",
                    )
                    if f
                )
            )
    selected = report.selected
    if selected is None:
        lines.append(f"no target met the {report.profile} budgets; nothing was written.")
    else:
        fid = selected.fidelity
        if fid and fid.max_abs_error is not None:
            lines.append(
                f"selected {selected.backend} {selected.precision}: max |error| {fid.max_abs_error:.3g}, "
                f"mean |error| {fid.mean_abs_error:.3g}, min cosine {fid.cosine_min:.4f} "
                f"over {fid.samples} samples."
            )
        lines.append(f"next: {report.next_command()}")
    return "\n".join(lines)
