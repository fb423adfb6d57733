"""The table printed at the end of ``edgeline export``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgeline.manifest import Fidelity

__all__ = ["ExportReport", "TargetOutcome", "format_report"]


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


def _fidelity(outcome: TargetOutcome) -> str:
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


def format_report(report: ExportReport) -> str:
    header = ("backend", "precision", "status", "size", "fidelity", "host latency", "bundle / reason")
    rows = [header]
    for o in report.outcomes:
        latency = f"{o.host_latency_ms:.3f} ms" if o.host_latency_ms is not None else "-"
        where = str(o.bundle) if o.bundle is not None else (o.reason or "")
        if o.status == "selected" and any(other.status == "passed" for other in report.outcomes):
            where += "  <- the profile's order picks this one"
        rows.append((o.backend, o.precision, o.status, _size(o), _fidelity(o), latency, where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    lines.append("")
    lines.append(
        "host latency: median on this machine, 1 thread; the device's latency is checked by "
        "`edgeline verify` on the device."
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
