"""Checking a converted model against a profile's budgets.

Host timings are never held against a device budget: latency is checked on the device by `verify`.
"""

from __future__ import annotations

from edgeline.device_profiles import Budgets
from edgeline.manifest import Fidelity

__all__ = ["budget_violations"]


def budget_violations(budgets: Budgets, size_bytes: int, fidelity: Fidelity) -> list[str]:
    """Plain-language reasons this target misses the budgets; empty when it meets them."""
    found = []
    if budgets.max_model_bytes is not None and size_bytes > budgets.max_model_bytes:
        found.append(f"model size {size_bytes} B > budget {budgets.max_model_bytes} B")
    if fidelity.status != "measured":
        return found
    # The most meaningful measure available decides: accuracy against labels, else agreement with the float
    # model's decisions, else (raw and regression outputs) cosine similarity of the outputs. Cosine is not
    # used for classifiers: on a few near-zero logits one quantization step can flip it without changing
    # a single decision.
    drop_budget = budgets.max_accuracy_drop
    if fidelity.accuracy is not None and fidelity.accuracy_float is not None:
        drop = (fidelity.accuracy_float - fidelity.accuracy) * 100.0
        if drop > drop_budget:
            found.append(f"accuracy drop {drop:.2f} points > budget {drop_budget:g}")
    elif fidelity.top1_agreement is not None:
        disagreement = (1.0 - fidelity.top1_agreement) * 100.0
        if disagreement > drop_budget:
            found.append(f"top-1 disagreement with the float model {disagreement:.2f}% > budget {drop_budget:g}")
    elif fidelity.anomaly_agreement is not None:
        disagreement = (1.0 - fidelity.anomaly_agreement) * 100.0
        if disagreement > drop_budget:
            found.append(f"anomaly flags disagree on {disagreement:.2f}% of samples > budget {drop_budget:g}")
    elif (
        budgets.min_cosine is not None and fidelity.cosine_min is not None and fidelity.cosine_min < budgets.min_cosine
    ):
        found.append(f"minimum cosine similarity {fidelity.cosine_min:.4f} < budget {budgets.min_cosine:g}")
    return found
