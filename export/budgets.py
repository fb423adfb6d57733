"""Checking a converted model against a profile's budgets.

Host timings are never held against a device budget: latency is checked on the device by `verify`.
"""

from __future__ import annotations

from edgeline.device_profiles import Budgets, Precision
from edgeline.manifest import Fidelity, Firmware, Memory, Placement, percent

__all__ = ["budget_violations", "decisive_measure", "fidelity_shortfall", "fidelity_violations", "judged_share"]


def budget_violations(
    budgets: Budgets,
    size_bytes: int,
    fidelity: Fidelity,
    placement: Placement | None = None,
    precision: Precision | None = None,
    memory: Memory | None = None,
    firmware: Firmware | None = None,
) -> list[str]:
    """Plain-language reasons this target misses the budgets; empty when it meets them. A memory figure that could
    not be measured is not held against ``max_memory_mb`` (the manifest says why; verify checks it on the device).
    A microcontroller bundle (``firmware``: its C sources) holds its model array against ``max_model_bytes``, what
    the flash stores, and the arena its header reserves, margin included, against ``max_arena_bytes``."""
    found = []
    if budgets.max_model_bytes is not None and size_bytes > budgets.max_model_bytes:
        what = "model array" if firmware is not None else "model size"
        found.append(f"{what} {size_bytes} B > budget {budgets.max_model_bytes} B")
    if budgets.max_arena_bytes is not None and firmware is not None and firmware.arena_bytes > budgets.max_arena_bytes:
        found.append(
            f"tensor arena {firmware.arena_bytes} B ({firmware.arena_basis} {firmware.arena_basis_bytes} B, "
            f"{firmware.arena_margin}) > budget {budgets.max_arena_bytes} B"
        )
    if budgets.max_memory_mb is not None and memory is not None:
        if memory.resident_mb is not None and memory.resident_mb > budgets.max_memory_mb:
            found.append(
                f"resident memory {memory.resident_mb:.1f} MB ({memory.measured_with}) "
                f"> budget {budgets.max_memory_mb} MB"
            )
        if memory.arena_bytes is not None and memory.arena_bytes > budgets.max_memory_mb * 2**20:
            found.append(f"TFLite Micro arena {memory.arena_bytes} B > budget {budgets.max_memory_mb} MB")
    found.extend(_placement_violations(budgets, placement, precision))
    found.extend(fidelity_violations(budgets, fidelity))
    return found


def _decisive(fidelity: Fidelity) -> tuple[str, float] | None:
    """The most meaningful measure available, as how far it is from perfect: a detector's mAP@0.5 points lost
    against labels, else its mAP@0.5 against the float model's detections; accuracy points lost against labels,
    else disagreement with the float model's decisions in percent (top-1, anomaly flags), else (raw and regression
    outputs) one minus the minimum cosine. Cosine is not used for classifiers: on a few near-zero logits one
    quantization step can flip it without changing a single decision."""
    if fidelity.map50 is not None and fidelity.map50_float is not None:
        return "map", (fidelity.map50_float - fidelity.map50) * 100.0
    if fidelity.map50_agreement is not None:
        return "map-agreement", (1.0 - fidelity.map50_agreement) * 100.0
    if fidelity.accuracy is not None and fidelity.accuracy_float is not None:
        return "accuracy", (fidelity.accuracy_float - fidelity.accuracy) * 100.0
    if fidelity.top1_agreement is not None:
        return "top1", (1.0 - fidelity.top1_agreement) * 100.0
    if fidelity.anomaly_agreement is not None:
        return "anomaly", (1.0 - fidelity.anomaly_agreement) * 100.0
    if fidelity.cosine_min is not None:
        return "cosine", 1.0 - fidelity.cosine_min
    return None


def decisive_measure(fidelity: Fidelity) -> str | None:
    """What decides ``fidelity``'s budget: "map", "map-agreement", "accuracy", "top1", "anomaly" or "cosine"
    (``_decisive``); None: nothing."""
    decisive = _decisive(fidelity) if fidelity.status == "measured" else None
    return None if decisive is None else decisive[0]


def fidelity_shortfall(fidelity: Fidelity) -> float:
    """How far the measure that decides the fidelity budget is from perfect, lower better (``_decisive``)."""
    decisive = _decisive(fidelity) if fidelity.status == "measured" else None
    return float("inf") if decisive is None else decisive[1]


def fidelity_violations(budgets: Budgets, fidelity: Fidelity) -> list[str]:
    """The fidelity budget's share of ``budget_violations``: nothing for a fidelity not measured."""
    decisive = _decisive(fidelity) if fidelity.status == "measured" else None
    if decisive is None:
        return []
    kind, value = decisive
    if kind == "map" and value > budgets.max_map_drop:
        return [f"mAP@0.5 drop {value:.2f} points > budget {budgets.max_map_drop:g}"]
    if kind == "map-agreement" and value > budgets.max_map_drop:
        return [f"mAP@0.5 against the float model's detections {100 - value:.2f} misses {value:.2f} points > budget "
                f"{budgets.max_map_drop:g}"]  # fmt: skip
    budget = budgets.max_accuracy_drop
    if kind == "accuracy" and value > budget:
        return [f"accuracy drop {value:.2f} points > budget {budget:g}"]
    if kind == "top1" and value > budget:
        return [f"top-1 disagreement with the float model {value:.2f}% > budget {budget:g}"]
    if kind == "anomaly" and value > budget:
        return [f"anomaly flags disagree on {value:.2f}% of samples > budget {budget:g}"]
    cosine = fidelity.cosine_min
    if kind == "cosine" and budgets.min_cosine is not None and cosine is not None and cosine < budgets.min_cosine:
        return [f"minimum cosine similarity {cosine:.4f} < budget {budgets.min_cosine:g}"]
    return []


def _fallback(placement: Placement) -> str:
    items = sorted(placement.fallback.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{op} x{count}" for op, count in items[:6])
    return f" (fell back: {shown}{f' and {len(items) - 6} more' if len(items) > 6 else ''})" if items else ""


def judged_share(placement: Placement, kind: str) -> tuple[float | None, str]:
    """The share a ``min_{kind}_share`` budget judges (kind: "accelerator" or "quantized") and what it is: the share of
    the model's work (multiply-accumulates) when that was counted, else the share of its operators."""
    by_work = getattr(placement, f"{kind}_macs_share")
    if by_work is not None:
        return by_work, "work"
    return getattr(placement, f"{kind}_share"), "ops"


def _share_text(placement: Placement, kind: str, where: str) -> str:
    """E.g. "99.9% of the work (1.7 M of 1.7 M MACs; 7/8 ops) on ethos-u"."""
    count = getattr(placement, f"{kind}_ops")
    share, measure = judged_share(placement, kind)
    assert share is not None
    ops = f"{count}/{placement.ops} ops"
    if measure == "work":
        macs = f"{getattr(placement, f'{kind}_macs')}/{placement.macs} MACs"
        return f"{percent(share)} of the work ({macs}; {ops}) {where}"
    why = placement.unknown.get("macs", "not recorded")
    return f"{ops} {where} ({percent(share, 0)}; the work is unknown: {why})"


def _placement_violations(budgets: Budgets, placement: Placement | None, precision: Precision | None) -> list[str]:
    """The accelerator and quantized shares against the profile's minimums: the share of the work when it was
    counted, else of the operators (the reason says which). An unknown share never passes a budget that asks for
    one: it is named as unknown, with the reason."""
    found = []
    wanted = budgets.min_accelerator_share
    if wanted is not None and placement is not None and placement.accelerator is not None:
        share, _ = judged_share(placement, "accelerator")
        if share is None:
            why = placement.unknown.get("accelerator_ops", "not recorded")
            found.append(f"share on {placement.accelerator} unknown ({why}); budget >= {wanted:.0%}")
        elif share < wanted:
            found.append(
                f"{_share_text(placement, 'accelerator', f'on {placement.accelerator}')} "
                f"< budget {wanted:.0%}{_fallback(placement)}"
            )
    wanted = budgets.min_quantized_share
    if wanted is not None and precision is not None and precision.integer:
        share, _ = judged_share(placement, "quantized") if placement is not None else (None, "ops")
        if share is None:
            why = placement.unknown.get("quantized_ops", "not recorded") if placement else "placement not recorded"
            found.append(f"quantized share unknown ({why}); budget >= {wanted:.0%}")
        elif share < wanted:
            assert placement is not None
            found.append(
                f"{_share_text(placement, 'quantized', f'in {precision.value}')} "
                f"< budget {wanted:.0%}{_fallback(placement)}"
            )
    return found
