"""The table printed at the end of ``edgeline export``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgeline.export.budgets import decisive_measure, fidelity_shortfall, uncertain_verdict
from edgeline.manifest import (
    Budgets,
    Estimates,
    Fidelity,
    KeptFloat,
    LayerFidelity,
    Memory,
    Placement,
    Rewrite,
    percent,
    worst_layers,
)

__all__ = [
    "ExportReport",
    "TargetOutcome",
    "fidelity_summary",
    "format_report",
    "memory_summary",
    "shares",
]


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
    memory: Memory | None = None
    rewrites: tuple[Rewrite, ...] = ()
    """What the export changed of the function the model computes (the manifest's ``quantization.rewrites``)."""
    layers: tuple[LayerFidelity, ...] = ()
    """Per torch layer, plain int8 against the float model (the manifest's ``quantization.layers``)."""
    kept_float: tuple[KeptFloat, ...] = ()
    """Mixed precision: the layers left in float (the manifest's ``quantization.kept_float``)."""
    int8_missed: str | None = None
    ranking: tuple[int, ...] = ()
    """The validation samples ``layers`` were measured on: those plain int8 did worst on (NNCF's ranking subset)."""
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
            "accelerator_macs_share": self.placement.accelerator_macs_share if self.placement else None,
            "quantized_macs_share": self.placement.quantized_macs_share if self.placement else None,
            "estimates": self.estimates.model_dump(mode="json") if self.estimates else None,
            "memory": self.memory.model_dump(mode="json") if self.memory else None,
            "rewrites": [rewrite.model_dump(mode="json") for rewrite in self.rewrites],
            "layers": [layer.model_dump(mode="json") for layer in self.layers],
            "kept_float": [kept.model_dump(mode="json") for kept in self.kept_float],
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
    budgets: Budgets | None = None
    """The profile's: the table marks the share each share budget judged."""
    box_scaling: str | None = None
    """A detector's: what the export did about its pixel boxes beside its scores (``Detection.box_scaling``)."""

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
            **({"box_scaling": self.box_scaling} if self.box_scaling is not None else {}),
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
    if fid.map50 is not None and fid.map50_float is not None:
        return f"mAP50 {fid.map50:.3f} (float {fid.map50_float:.3f})"
    if fid.map50_agreement is not None:
        return f"mAP50 vs float {fid.map50_agreement:.3f}"
    if fid.accuracy is not None and fid.accuracy_float is not None:
        return f"acc {percent(fid.accuracy)} (float {percent(fid.accuracy_float)})"
    if fid.top1_agreement is not None:
        return f"top-1 agree {percent(fid.top1_agreement)}"
    if fid.anomaly_agreement is not None:
        return f"flags agree {percent(fid.anomaly_agreement)}"
    return f"cos min {fid.cosine_min:.4f}"


def _drop_interval_line(outcome: TargetOutcome, budgets: Budgets | None) -> str | None:
    """The budget's uncertainty: the decisive drop with its 95% interval on the validation samples, a warning when
    the budget lies inside it (``budgets.uncertain_verdict``); None where there is no interval (mAP, cosine)."""
    fid = outcome.fidelity
    if fid is None or fid.status != "measured" or fid.drop_interval is None:
        return None
    warning = uncertain_verdict(budgets, fid) if budgets is not None else None
    if warning is not None:
        return f"WARNING: {warning}"
    what = {"accuracy": "accuracy drop", "top1": "top-1 disagreement", "anomaly": "anomaly flag disagreement"}
    kind = decisive_measure(fid)
    low, high = fid.drop_interval
    budget = f" (budget {budgets.max_accuracy_drop:g})" if budgets is not None else ""
    return (
        f"{what.get(kind or '', 'drop')} {fidelity_shortfall(fid):.2f} points, 95% interval {low:.2f} to {high:.2f} "
        f"on {fid.samples} validation samples{budget}"
    )


def _share_cell(placement: Placement, kind: str, judged: bool) -> str:
    """E.g. "99.9% work*, 7/8 ops": the share of the work (multiply-accumulates) and the operator count; ``*`` marks
    the share a budget judged (the work's when it was counted, else the operators')."""
    count = getattr(placement, f"{kind}_ops")
    if count is None:
        return "?" if f"{kind}_ops" in placement.unknown else "-"
    mark = "*" if judged else ""
    work = getattr(placement, f"{kind}_macs_share")
    ops = f"{count}/{placement.ops} ops"
    if work is not None:
        return f"{percent(work)} work{mark}, {ops}"
    share = getattr(placement, f"{kind}_share")
    return f"{ops}{mark}" + (f" ({percent(share, 0)})" if share is not None else "")


def shares(outcome: TargetOutcome, budgets: Budgets | None = None) -> tuple[str, str]:
    """The accelerator and quantized shares: "-" where there is no accelerator or no integer precision, "?" where
    the share exists but cannot be known (the manifest says why). With the profile's ``budgets``, ``*`` marks the
    share each share budget judged."""
    placement = outcome.placement
    if placement is None:
        return "-", "-"
    accelerator = "-"
    if placement.accelerator is not None:
        judged = budgets is not None and budgets.min_accelerator_share is not None
        accelerator = f"{_share_cell(placement, 'accelerator', judged)} {placement.accelerator}"
    judged = budgets is not None and budgets.min_quantized_share is not None
    quantized = _share_cell(placement, "quantized", judged)
    return accelerator, quantized


def memory_summary(memory: Memory, budgets: Budgets | None) -> str:
    """What the bundle needs in memory, what measured it, and the budget it was held against (or why not)."""
    budget = budgets.max_memory_mb if budgets is not None else None
    if memory.arena_bytes is not None and memory.resident_mb is None:  # a microcontroller: the arena is its figure
        arena_budget = budgets.max_arena_bytes if budgets is not None else None
        if arena_budget is None:
            judged = ", no arena budget"
        else:
            where = "within" if memory.arena_bytes <= arena_budget else "over"
            judged = f", {where} the {arena_budget:,} B arena budget"
        return f"tensor arena {memory.arena_bytes:,} B ({memory.measured_with}){judged}"
    parts = []
    if memory.resident_mb is not None:
        parts.append(f"resident {memory.resident_mb:.1f} MB")
    if memory.arena_bytes is not None:
        parts.append(f"TFLite Micro arena {memory.arena_bytes:,} B")
    if not parts:
        why = "; ".join(dict.fromkeys(memory.unknown.values())) or "not recorded"
        limit = f"; the {budget} MB budget is not checked here" if budget is not None else ""
        return f"not measured ({why}){limit}"
    limit = f", within the {budget} MB budget" if budget is not None else ", no memory budget"
    return f"{', '.join(parts)} ({memory.measured_with}){limit}"


def _latency(outcome: TargetOutcome) -> str:
    estimates = outcome.estimates
    if outcome.host_latency_ms is not None:
        return f"{outcome.host_latency_ms:.3f} ms"
    if estimates is not None and estimates.inference_ms is not None:
        return f"~{estimates.inference_ms:.3g} ms (est.)"
    return "-"


def _db(value: float | None) -> str:
    return "exact" if value is None else f"{value:.1f} dB"


def _layer_cells(layer: LayerFidelity) -> str:
    added, channel = _db(layer.added_sqnr_db), _db(layer.channel_sqnr_db)
    return f"{layer.module} ({layer.operator}) {added}, {channel}, {layer.cosine:.4f}"


def _kept_cost(kept: KeptFloat, placement: Placement | None) -> str:
    """``Conv2d, +270 B, 1.7% of the work off ethos-u``: what keeping a layer in float costs."""
    cost = f"{kept.operator}, +{kept.added_bytes:,} B"
    if kept.accelerator_macs_share is not None and placement is not None and placement.accelerator is not None:
        cost += f", {percent(kept.accelerator_macs_share)} of the work off {placement.accelerator}"
    return cost


def format_report(report: ExportReport) -> str:
    header = ("backend", "precision", "status", "size", "fidelity", "accel.", "quant.", "latency", "bundle / reason")
    rows = [header]
    for o in report.outcomes:
        where = str(o.bundle) if o.bundle is not None else (o.reason or "")
        if o.status == "selected" and any(other.status == "passed" for other in report.outcomes):
            where += "  <- the profile's order picks this one"
        rows.append(
            (
                o.backend,
                o.precision,
                o.status,
                _size(o),
                fidelity_summary(o),
                *shares(o, report.budgets),
                _latency(o),
                where,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    lines.append("")
    lines.append(
        "accel./quant.: share of the model's work (multiply-accumulates) and count of its operators on the "
        "accelerator / in the integer precision ('-' none, '?' unknown: see the manifest's placement); '*' marks the "
        "share the profile's budget judged; latency: median on this machine, 1 thread, for CPU targets, or "
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
                + (f" ({e.covers})" if e.covers else "")
            )
    for o in report.outcomes:  # a share is never the only place an operator left out shows: its module and line
        left_out = o.placement.describe_sources() if o.placement is not None else None
        if left_out and o.status in ("selected", "passed", "rejected"):
            lines.append(f"{o.backend} {o.precision}: {left_out}")
    for o in report.outcomes:
        for rewrite in o.rewrites if o.status in ("selected", "passed", "rejected") else ():
            lines.append(
                f"{o.backend} {o.precision}: {rewrite.operator} ({rewrite.count}) computes {rewrite.replacement}: "
                f"{rewrite.reason}; the fidelity figures include it"
            )
    for o in report.outcomes:
        worst = worst_layers(o.layers) if o.status in ("selected", "passed", "rejected") else []
        if worst:
            lines.append(
                f"{o.backend} {o.precision}: the layers that lost the most with every layer int8 (SQNR of the noise "
                "each adds; the worst "
                "channel's SQNR; cosine): "
                + "; ".join(_layer_cells(layer) for layer in worst)
                + (f"; every layer: edgeline bundle show {o.bundle} --layers" if o.bundle is not None else "")
            )  # fmt: skip
    for o in report.outcomes:
        if o.kept_float and o.status in ("selected", "passed", "rejected"):
            lines.append(
                f"{o.backend} {o.precision}: mixed precision: with every layer int8, {o.int8_missed}; so "
                + "; ".join(f"{k.module} ({_kept_cost(k, o.placement)}) stays {k.precision}: {k.reason}"
                            for k in o.kept_float)
                + "; every other layer int8"
            )  # fmt: skip
    for o in report.outcomes:
        interval = _drop_interval_line(o, report.budgets) if o.status in ("selected", "passed", "rejected") else None
        if interval is not None:
            lines.append(f"{o.backend} {o.precision}: {interval}")
    for o in report.outcomes:
        if o.memory is not None and o.status in ("selected", "passed"):
            lines.append(f"{o.backend} {o.precision}: memory: {memory_summary(o.memory, report.budgets)}")
    selected = report.selected
    if selected is None and all(o.status == "failed" for o in report.outcomes):
        lines.append(f"no target of {report.profile} could be exported (each row says why); nothing was written.")
    elif selected is None:
        lines.append(f"no target met the {report.profile} budgets; nothing was written.")
    else:
        fid = selected.fidelity
        if fid and fid.max_abs_error is not None:
            lines.append(
                f"selected {selected.backend} {selected.precision}: max |error| {fid.max_abs_error:.3g}, "
                f"mean |error| {fid.mean_abs_error:.3g}, min cosine {fid.cosine_min:.4f} "
                f"over {fid.samples} samples."
            )
        if fid and fid.map50 is not None and fid.map50_95 is not None:
            lines.append(
                f"mAP@0.5 {fid.map50:.3f}, mAP@0.5:0.95 {fid.map50_95:.3f} (float model: {fid.map50_float:.3f}, "
                f"{fid.map50_95_float:.3f}) on {fid.samples} validation images"
            )
        scaling = report.box_scaling
        if scaling is not None:
            lines.append(f"boxes: {scaling}")
        lines.append(f"next: {report.next_command()}")
    return "\n".join(lines)
