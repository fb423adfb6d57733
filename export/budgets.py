"""Checking a converted model against a profile's budgets.

Host timings are never held against a device budget: latency is checked on the device by `verify`.
"""

from __future__ import annotations

import math
from fractions import Fraction

from edgeline.device_profiles import Budgets, Precision
from edgeline.manifest import Fidelity, Firmware, Memory, Placement, percent

__all__ = [
    "INTERVAL_Z",
    "budget_violations",
    "decisive_measure",
    "drop_interval",
    "fidelity_shortfall",
    "fidelity_violations",
    "judged_share",
    "paired_drop_interval",
    "samples_for_budget",
    "uncertain_verdict",
    "wilson_interval",
]

INTERVAL_Z = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""


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
        return "accuracy", _points(fidelity, "accuracy", (fidelity.accuracy_float - fidelity.accuracy) * 100.0)
    if fidelity.top1_agreement is not None:
        return "top1", _points(fidelity, "top1", (1.0 - fidelity.top1_agreement) * 100.0)
    if fidelity.anomaly_agreement is not None:
        return "anomaly", _points(fidelity, "anomaly", (1.0 - fidelity.anomaly_agreement) * 100.0)
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


def _count(share: float | None, samples: int) -> int | None:
    """The number of ``samples`` a share of them is (a manifest's accuracy or agreement is count / samples): None
    when the share is not such a fraction (a figure built by hand)."""
    if share is None or samples <= 0:
        return None
    count = round(share * samples)
    return count if 0 <= count <= samples and abs(share * samples - count) <= 1e-6 else None


def _counted_points(fidelity: Fidelity, kind: str) -> Fraction | None:
    """The decisive measure's shortfall in points as an exact fraction, from the samples counted (the manifest's
    counts, else recovered from its shares): ``None`` for a measure that is not a count (mAP, cosine)."""
    samples = fidelity.samples
    if samples <= 0:
        return None
    lost: int | None
    if kind == "accuracy":
        if fidelity.lost_samples is not None and fidelity.gained_samples is not None:
            lost = fidelity.lost_samples - fidelity.gained_samples
        else:
            right, right_float = _count(fidelity.accuracy, samples), _count(fidelity.accuracy_float, samples)
            lost = None if right is None or right_float is None else right_float - right
    elif kind in ("top1", "anomaly"):
        agreement = fidelity.top1_agreement if kind == "top1" else fidelity.anomaly_agreement
        agreeing = _count(agreement, samples)
        lost = fidelity.disagreeing_samples
        if lost is None and agreeing is not None:
            lost = samples - agreeing
    else:
        return None
    return None if lost is None else Fraction(lost * 100, samples)


def _points(fidelity: Fidelity, kind: str, from_shares: float) -> float:
    """A counted measure's shortfall in points, from its counts where known (3 of 300 is 1.0, not the
    1.0000000000000009 of a difference of shares), else ``from_shares``."""
    counted = _counted_points(fidelity, kind)
    return from_shares if counted is None else float(counted)


def _budget(value: float) -> Fraction:
    """A budget as the decimal the profile wrote it: ``str`` gives a float's shortest form (0.3, where the float
    itself is 0.29999999999999998...), so a drop of exactly the budget meets it."""
    return Fraction(str(value))


def _over(fidelity: Fidelity, kind: str, value: float, budget: float) -> bool:
    """Whether the decisive measure's shortfall ``value`` exceeds ``budget``: on counts where it is one (accuracy
    and agreement: (287 - 284) of 300 is exactly 1 point, where floats make it 1.0000000000000009), else on the
    float rounded to 1e-9 point (mAP is computed in floats: a drop equal to the budget up to rounding meets it)."""
    counted = _counted_points(fidelity, kind)
    if counted is not None:
        return counted > _budget(budget)
    return round(value, 9) > budget


def fidelity_violations(budgets: Budgets, fidelity: Fidelity) -> list[str]:
    """The fidelity budget's share of ``budget_violations``: nothing for a fidelity not measured. A drop of exactly
    the budget meets it (``_over``)."""
    decisive = _decisive(fidelity) if fidelity.status == "measured" else None
    if decisive is None:
        return []
    kind, value = decisive
    if kind == "map" and _over(fidelity, kind, value, budgets.max_map_drop):
        return [f"mAP@0.5 drop {value:.2f} points > budget {budgets.max_map_drop:g}"]
    if kind == "map-agreement" and _over(fidelity, kind, value, budgets.max_map_drop):
        return [f"mAP@0.5 against the float model's detections {100 - value:.2f} misses {value:.2f} points > budget "
                f"{budgets.max_map_drop:g}"]  # fmt: skip
    budget = budgets.max_accuracy_drop
    over = _over(fidelity, kind, value, budget)
    if kind == "accuracy" and over:
        return [f"accuracy drop {value:.2f} points > budget {budget:g}"]
    if kind == "top1" and over:
        return [f"top-1 disagreement with the float model {value:.2f}% > budget {budget:g}"]
    if kind == "anomaly" and over:
        return [f"anomaly flags disagree on {value:.2f}% of samples > budget {budget:g}"]
    cosine = fidelity.cosine_min
    if kind == "cosine" and budgets.min_cosine is not None and cosine is not None and cosine < budgets.min_cosine:
        return [f"minimum cosine similarity {cosine:.4f} < budget {budgets.min_cosine:g}"]
    return []


def wilson_interval(count: int, samples: int, z: float = INTERVAL_Z) -> tuple[float, float]:
    """Wilson's score interval of a binomial proportion ``count / samples`` (0..1). Chosen over the normal (Wald)
    interval, which collapses to a point at 0 or all disagreements, exactly where a good bundle sits, and over the
    exact (Clopper-Pearson) one, which is conservative by construction; Wilson's covers close to its level from a few
    dozen samples on (Brown, Cai and DasGupta 2001)."""
    if samples <= 0:
        return 0.0, 1.0
    share, z2 = count / samples, z * z
    centre = (share + z2 / (2 * samples)) / (1 + z2 / samples)
    half = z * math.sqrt(share * (1 - share) / samples + z2 / (4 * samples * samples)) / (1 + z2 / samples)
    return (0.0 if count <= 0 else max(0.0, centre - half)), (1.0 if count >= samples else min(1.0, centre + half))


def paired_drop_interval(both: int, lost: int, gained: int, neither: int, z: float = INTERVAL_Z) -> tuple[float, float]:
    """The interval of an accuracy drop (float model's accuracy less the bundle's, 0..1) measured on the same samples:
    ``both`` right, ``lost`` (float right, bundle wrong), ``gained`` (bundle right, float wrong), ``neither``.

    Newcombe's hybrid score interval for a paired difference of proportions (his method 10, Statistics in Medicine
    1998): each model's accuracy gets its Wilson interval, and the two are combined with the correlation of the pairs
    (the models err on mostly the same samples, which makes the drop far surer than two independent accuracies would).
    Sound where a budget sits: it stays inside [-1, 1], does not collapse when no sample is lost or gained, and covers
    close to its level at a few hundred samples. An interval on the discordant pairs alone (``lost`` out of ``lost +
    gained``) would hold their number fixed, which is itself random."""
    samples = both + lost + gained + neither
    if samples <= 0:
        return -1.0, 1.0
    right_float, right = (both + lost) / samples, (both + gained) / samples
    low_float, high_float = wilson_interval(both + lost, samples, z)
    low, high = wilson_interval(both + gained, samples, z)
    margins = (both + lost) * (gained + neither) * (both + gained) * (lost + neither)
    phi = (both * neither - lost * gained) / math.sqrt(margins) if margins else 0.0
    below = math.sqrt(
        max(
            0.0,
            (right_float - low_float) ** 2 - 2 * phi * (right_float - low_float) * (high - right) + (high - right) ** 2,
        )
    )
    above = math.sqrt(
        max(
            0.0,
            (high_float - right_float) ** 2 - 2 * phi * (high_float - right_float) * (right - low) + (right - low) ** 2,
        )
    )
    drop = right_float - right
    return max(-1.0, drop - below), min(1.0, drop + above)


DROP_INTERVAL_METHODS = {
    "accuracy": "95%, Newcombe's hybrid score interval for paired samples (method 10)",
    "top1": "95%, Wilson score interval on the share of samples whose decision differs",
    "anomaly": "95%, Wilson score interval on the share of samples whose decision differs",
}


def drop_interval(fidelity: Fidelity) -> tuple[tuple[float, float], str] | None:
    """The 95% interval of the decisive measure's drop in points and how it was made, for the measures that count
    samples (accuracy against labels, agreement with the float model's decisions); None for the others (mAP,
    cosine) and where the counts are unknown."""
    kind = decisive_measure(fidelity)
    samples = fidelity.samples
    if kind == "accuracy" and fidelity.lost_samples is not None and fidelity.gained_samples is not None:
        right = _count(fidelity.accuracy, samples)
        if right is None:
            return None
        lost, gained = fidelity.lost_samples, fidelity.gained_samples
        both = right - gained
        low, high = paired_drop_interval(both, lost, gained, samples - both - lost - gained)
    elif kind in ("top1", "anomaly"):
        agreement = fidelity.top1_agreement if kind == "top1" else fidelity.anomaly_agreement
        agreeing = _count(agreement, samples)
        differing = (
            fidelity.disagreeing_samples
            if fidelity.disagreeing_samples is not None
            else (None if agreeing is None else samples - agreeing)
        )
        if differing is None:
            return None
        low, high = wilson_interval(differing, samples)
    else:
        return None
    assert kind is not None
    return (low * 100.0, high * 100.0), DROP_INTERVAL_METHODS[kind]


def uncertain_verdict(budgets: Budgets, fidelity: Fidelity) -> str | None:
    """A warning when the budget lies inside the drop's interval (``Fidelity.drop_interval``): these validation
    samples cannot tell whether the bundle meets the budget, whatever the verdict; None otherwise."""
    kind = decisive_measure(fidelity)
    interval = fidelity.drop_interval
    if kind not in DROP_INTERVAL_METHODS or interval is None:
        return None
    budget = budgets.max_accuracy_drop
    low, high = interval
    if not low <= budget <= high:
        return None
    value = fidelity_shortfall(fidelity)
    what = {"accuracy": "accuracy drop", "top1": "top-1 disagreement", "anomaly": "anomaly flag disagreement"}[kind]
    needed = samples_for_budget(budget)
    more = f"; about {needed} samples would settle a {budget:g}-point budget" if needed is not None else ""
    return (
        f"{what} {value:.2f} points, 95% interval {low:.2f} to {high:.2f} on {fidelity.samples} validation samples: "
        f"the budget {budget:g} lies inside it, so these samples cannot tell whether the bundle meets it{more} "
        "(docs/bundle.md, budgets)"
    )


def samples_for_budget(budget: float, limit: int = 10_000_000) -> int | None:
    """The fewest validation samples for which a bundle that disagrees with the float model on none of them has a
    95% interval of its disagreement below ``budget`` points (Wilson's upper end, z^2 / (n + z^2)): the least a
    budget needs to be decided at all; a bundle that flips decisions needs more (docs/bundle.md's table). None past
    ``limit`` or for a budget of 0 or less."""
    share = budget / 100.0
    if share <= 0:
        return None
    if share >= 1:
        return 1
    needed = math.floor(INTERVAL_Z * INTERVAL_Z * (1 - share) / share) + 1
    return needed if needed <= limit else None


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
