"""The budget gate: which fidelity measure decides, and that every miss is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from edgeline.device_profiles import Budgets, Precision
from edgeline.export.budgets import budget_violations, decisive_measure, fidelity_shortfall
from edgeline.manifest import Fidelity, Placement

pytestmark = pytest.mark.quick

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


def test_a_detector_is_decided_by_map_points_against_its_own_budget() -> None:
    detector = measured(map50=0.95, map50_float=0.975, cosine_min=0.5, map50_agreement=0.9)
    assert BUDGETS.max_map_drop == 2.0  # the default
    (reason,) = budget_violations(BUDGETS, 10, detector)
    assert reason == "mAP@0.5 drop 2.50 points > budget 2"  # not the cosine, not the agreement
    assert budget_violations(BUDGETS.model_copy(update={"max_map_drop": 3.0}), 10, detector) == []
    assert decisive_measure(detector) == "map" and fidelity_shortfall(detector) == pytest.approx(2.5)


def test_an_unlabelled_detector_is_decided_by_its_map_against_the_float_model_s_detections() -> None:
    detector = measured(map50_agreement=0.97, cosine_min=0.5)
    (reason,) = budget_violations(BUDGETS, 10, detector)
    assert "mAP@0.5 against the float model's detections 97.00 misses 3.00 points > budget 2" in reason
    assert decisive_measure(detector) == "map-agreement"
    assert budget_violations(BUDGETS, 10, measured(map50_agreement=0.99, cosine_min=0.5)) == []


def test_not_measured_fidelity_checks_only_what_was_measured() -> None:
    fidelity = Fidelity(status="not-measured", reason="Core ML runs only on macOS", reference="torch")
    assert budget_violations(BUDGETS, 10, fidelity) == []
    assert len(budget_violations(BUDGETS, 5000, fidelity)) == 1


# Placement: the accelerator and quantized shares


def placed(**fields: object) -> Placement:
    return Placement.model_validate(fields)


SHARES = Budgets(max_accuracy_drop=1.0, min_accelerator_share=0.9, min_quantized_share=0.8)


def test_shares_within_budget_pass() -> None:
    placement = placed(accelerator="npu", ops=10, accelerator_ops=9, quantized_ops=8, fallback={"TANH": 1})
    assert budget_violations(SHARES, 10, measured(cosine_min=1.0), placement, Precision.INT8_STATIC) == []


def test_accelerator_share_below_budget_names_what_fell_back() -> None:
    placement = placed(accelerator="npu", ops=10, accelerator_ops=6, quantized_ops=10, fallback={"TANH": 3, "EXP": 1})
    (reason,) = budget_violations(SHARES, 10, measured(cosine_min=1.0), placement, Precision.INT8_STATIC)
    assert (
        reason == "6/10 ops on npu (60%; the work is unknown: not recorded) < budget 90% (fell back: TANH x3, EXP x1)"
    )


def test_the_share_budgets_judge_the_work_when_it_was_counted() -> None:
    # MobileNetV3-small on an Ethos-U55: 54 of 62 operators on the NPU (87%), every multiply-accumulate but the
    # squeeze-excite hard-sigmoids' ~1,900 element operations (0.07% of the work).
    mobilenet = placed(accelerator="ethos-u", ops=62, accelerator_ops=54, quantized_ops=54, macs=2_560_000,
                       accelerator_macs=2_558_100, quantized_macs=2_558_100, fallback={"ADD": 4, "MUL": 4})  # fmt: skip
    assert budget_violations(SHARES, 10, measured(cosine_min=1.0), mobilenet, Precision.INT8_STATIC) == []
    # The other way round: nine small operators on the NPU, the one large matrix product left on the CPU.
    heavy = placed(accelerator="ethos-u", ops=10, accelerator_ops=9, quantized_ops=10, macs=1_000_000,
                   accelerator_macs=40_000, quantized_macs=1_000_000, fallback={"BATCH_MATMUL": 1})  # fmt: skip
    (reason,) = budget_violations(SHARES, 10, measured(cosine_min=1.0), heavy, Precision.INT8_STATIC)
    assert reason == (
        "4.0% of the work (40000/1000000 MACs; 9/10 ops) on ethos-u < budget 90% (fell back: BATCH_MATMUL x1)"
    )


def test_quantized_share_applies_to_integer_precisions_only() -> None:
    placement = placed(ops=100, quantized_ops=3, fallback={"LOGISTIC": 60, "TANH": 37})
    (reason,) = budget_violations(SHARES, 10, measured(cosine_min=1.0), placement, Precision.INT8_STATIC)
    assert reason.startswith(
        "3/100 ops in int8-static (3%; the work is unknown: not recorded) < budget 80% (fell back:"
    )
    float_placement = placed(ops=100)
    assert budget_violations(SHARES, 10, measured(cosine_min=1.0), float_placement, Precision.FP16) == []


def test_an_unknown_share_never_passes_a_budget_that_asks_for_it() -> None:
    placement = placed(
        accelerator="neural-engine",
        ops=12,
        unknown={"accelerator_ops": "decided when the model loads on the device"},
    )
    (reason,) = budget_violations(SHARES, 10, measured(cosine_min=1.0), placement, Precision.FP16)
    assert reason == "share on neural-engine unknown (decided when the model loads on the device); budget >= 90%"
    (reason,) = budget_violations(SHARES, 10, measured(cosine_min=1.0), None, Precision.INT8_STATIC)
    assert reason == "quantized share unknown (placement not recorded); budget >= 80%"


def test_placement_written_by_an_older_edgeline_still_reads() -> None:
    old = placed(delegate="xnnpack", delegated={"aten.convolution.default": 3}, not_delegated={"aten.mean.dim": 1})
    assert (old.accelerator, old.ops, old.accelerator_ops, old.quantized_ops) == ("xnnpack", 4, 3, None)
    assert old.fallback == {"aten.mean.dim": 1}
    assert "quantized_ops" in old.unknown


def test_placement_refuses_more_placed_operators_than_there_are() -> None:
    with pytest.raises(ValidationError, match="accelerator_ops"):
        placed(accelerator="npu", ops=3, accelerator_ops=4)


def test_the_table_shows_both_shares_and_marks_the_one_a_budget_judged() -> None:
    from edgeline.export.report import ExportReport, TargetOutcome, format_report

    outcome = TargetOutcome("ethos-u", "int8-static", 1, status="selected")
    outcome.placement = placed(accelerator="ethos-u", ops=8, accelerator_ops=7, quantized_ops=8, macs=1_725_856,
                               accelerator_macs=1_725_824, quantized_macs=1_725_856, fallback={"MEAN": 1})  # fmt: skip
    report = ExportReport(name="m", profile="ethos-u55-128", out=Path("m"), outcomes=[outcome], budgets=SHARES)
    row = format_report(report).splitlines()[2]
    # 1,725,824 of 1,725,856 MACs is not all of them: never rounded up to 100%
    assert "99.998% work*, 7/8 ops ethos-u" in row and "100.0% work*, 8/8 ops" in row
    # without the work counted, the budget judges the operators: the mark moves to them
    outcome.placement = placed(accelerator="ethos-u", ops=8, accelerator_ops=7, quantized_ops=8,
                               unknown={"macs": "not counted"})  # fmt: skip
    row = format_report(report).splitlines()[2]
    assert "7/8 ops* (88%) ethos-u" in row
    report.budgets = Budgets(max_accuracy_drop=1.0)  # no share budget: nothing judged, nothing marked
    assert "*" not in format_report(report).splitlines()[2]


def test_a_share_is_never_rounded_to_all_or_nothing_when_it_is_not() -> None:
    from edgeline.manifest import percent

    assert percent(801_382 / 801_414) == "99.996%"
    assert percent(1.0) == "100.0%" and percent(0.0) == "0.0%" and percent(1.0, 0) == "100%"
    assert percent(0.5) == "50.0%" and percent(0.123456) == "12.3%" and percent(0.876, 0) == "88%"
    assert percent(0.9996, 0) == "99.96%" and percent(0.00004) == "0.004%"
    assert percent(1 - 1e-9) == ">99.9999%" and percent(1e-9) == "<0.0001%"
