"""The budget gate: which fidelity measure decides, and that every miss is named."""

from __future__ import annotations

from edgeline.device_profiles import Budgets
from edgeline.export.budgets import budget_violations
from edgeline.manifest import Fidelity

BUDGETS = Budgets(max_model_bytes=1000, max_accuracy_drop=1.0, min_cosine=0.99)


def measured(**fields: float) -> Fidelity:
    return Fidelity(status="measured", reference="torch", samples=10, **fields)


def test_within_budget_is_empty() -> None:
    assert budget_violations(BUDGETS, 1000, measured(accuracy=0.95, accuracy_float=0.955, cosine_min=0.999)) == []


def test_size_over_budget_is_named() -> None:
    (reason,) = budget_violations(BUDGETS, 1001, measured(accuracy=0.9, accuracy_float=0.9))
    assert "model size 1001 B > budget 1000 B" in reason


def test_accuracy_drop_in_points() -> None:
    (reason,) = budget_violations(BUDGETS, 10, measured(accuracy=0.93, accuracy_float=0.95))
    assert "accuracy drop 2.00 points > budget 1" in reason


def test_classifier_decided_by_decisions_not_by_cosine_of_near_zero_logits() -> None:
    assert budget_violations(BUDGETS, 10, measured(top1_agreement=0.995, cosine_min=-0.75)) == []
    (reason,) = budget_violations(BUDGETS, 10, measured(top1_agreement=0.98, cosine_min=0.999))
    assert "top-1 disagreement" in reason


def test_raw_outputs_decided_by_cosine() -> None:
    (reason,) = budget_violations(BUDGETS, 10, measured(cosine_min=0.98, max_abs_error=0.1))
    assert "minimum cosine similarity 0.9800 < budget 0.99" in reason
    assert budget_violations(BUDGETS, 10, measured(cosine_min=0.995)) == []


def test_not_measured_fidelity_checks_only_what_was_measured() -> None:
    fidelity = Fidelity(status="not-measured", reason="Core ML runs only on macOS", reference="torch")
    assert budget_violations(BUDGETS, 10, fidelity) == []
    assert len(budget_violations(BUDGETS, 5000, fidelity)) == 1
