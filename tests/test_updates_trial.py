"""The trial's rules, on real models: agreement by kind, the gates' judgement, and the previous version answering
an input the new one fails on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeline.model import Model, load
from edgeline.updates.policy import Gates
from edgeline.updates.swap import TrialRunner
from edgeline.updates.trial import Trial, agree
from tests.tiny_bundle import COMMITTED_BUNDLE
from tests.update_repo import versioned

pytestmark = [pytest.mark.quick, pytest.mark.device]


def trial(**gates: float) -> Trial:
    return Trial(version=2, previous_version=1, gates=Gates(**gates), kind="classify", latency_budget_ms=None)


def test_agreement_is_top1_for_classifiers_the_flag_for_anomalies_and_a_relative_tolerance_otherwise() -> None:
    a, b = [np.array([[0.1, 0.9, 0.0]])], [np.array([[0.0, 0.6, 0.4]])]
    assert agree("classify", a, b, tolerance=0.1)
    assert not agree("classify", a, [np.array([[0.9, 0.1, 0.0]])], tolerance=0.1)
    assert agree("anomaly", a, b, tolerance=0.0, new_flag=True, old_flag=True)
    assert not agree("anomaly", a, a, tolerance=1.0, new_flag=True, old_flag=False)
    assert agree("regress", [np.array([10.5])], [np.array([10.0])], tolerance=0.1)
    assert not agree("regress", [np.array([11.5])], [np.array([10.0])], tolerance=0.1)
    assert not agree("raw", [np.zeros((2,))], [np.zeros((3,))], tolerance=1.0), "other shapes never agree"


def test_the_trial_ends_at_its_inputs_or_after_its_seconds_with_enough_inputs() -> None:
    t = trial(inputs=5, seconds=10, min_inputs=3)
    for _ in range(4):
        t.record(new_ok=True, agreed=True, new_s=0.001, old_s=0.001)
    assert not t.done(now=t.started + 1)
    t.record(new_ok=True, agreed=True, new_s=0.001, old_s=0.001)
    assert t.done(now=t.started + 1)
    slow = trial(inputs=100, seconds=10, min_inputs=3)
    slow.record(new_ok=True, agreed=True, new_s=0.001, old_s=0.001)
    assert not slow.done(now=slow.started + 60), "too few inputs to judge: the trial goes on"
    for _ in range(2):
        slow.record(new_ok=True, agreed=True, new_s=0.001, old_s=0.001)
    assert slow.done(now=slow.started + 60)


def test_the_judgement_names_the_gate_that_failed() -> None:
    good = trial(inputs=10)
    for _ in range(10):
        good.record(new_ok=True, agreed=True, new_s=0.002, old_s=0.002)
    assert good.judge().commit

    failing = trial(inputs=10, max_error_rate=0.05)
    for i in range(10):
        failing.record(new_ok=i != 3, agreed=True, new_s=0.002, old_s=0.002, failure="RuntimeError: boom")
    verdict = failing.judge()
    assert not verdict.commit and "failed on 1 of 10" in verdict.reason and "boom" in verdict.reason

    disagreeing = trial(inputs=10, min_agreement=0.9)
    for i in range(10):
        disagreeing.record(new_ok=True, agreed=i < 8, new_s=0.002, old_s=0.002)
    verdict = disagreeing.judge()
    assert not verdict.commit and "80.0%" in verdict.reason and verdict.figures["agreement"] == 0.8

    slow = trial(inputs=10)
    for _ in range(10):
        slow.record(new_ok=True, agreed=True, new_s=0.030, old_s=0.002)
    assert not slow.judge().commit and "twice" in slow.judge().reason, "without a budget: twice the previous median"
    within = Trial(version=2, previous_version=1, gates=Gates(inputs=10), kind="classify", latency_budget_ms=50.0)
    for _ in range(10):
        within.record(new_ok=True, agreed=True, new_s=0.030, old_s=0.002)
    assert within.judge().commit, "within the device's budget, slower than before is allowed"
    over = Trial(version=2, previous_version=1, gates=Gates(inputs=10, max_latency_ms=10), kind="classify",
                 latency_budget_ms=50.0)  # fmt: skip
    for _ in range(10):
        over.record(new_ok=True, agreed=True, new_s=0.030, old_s=0.002)
    assert not over.judge().commit and "10 ms" in over.judge().reason, "the publisher's gate wins"


class FailsOnBrightImages:
    """A real model with a fault: it raises on inputs whose mean is above 0.6 (a new version's runtime bug)."""

    def __init__(self, model: Model):
        self.model = model
        self.version = model.version

    def predict(self, *arrays: np.ndarray) -> list[np.ndarray]:
        if float(np.mean(arrays[0])) > 0.6:
            raise RuntimeError("the delegate failed")
        return self.model.predict(*arrays)


def test_the_previous_version_answers_what_the_new_one_fails_on(tmp_path: Path) -> None:
    previous = load(COMMITTED_BUNDLE)
    new = load(versioned(tmp_path / "v2", 2))
    t = Trial(version=2, previous_version=1, gates=Gates(inputs=4), kind="classify", latency_budget_ms=None)
    runner = TrialRunner(previous, t)
    broken = FailsOnBrightImages(new)
    dark = np.full((1, 1, 8, 8), 0.2, np.float32)
    bright = np.full((1, 1, 8, 8), 0.9, np.float32)
    answered_by, outputs, _ = runner.run(broken, [dark])  # type: ignore[arg-type]
    assert answered_by is broken and np.allclose(outputs[0], previous.predict(dark)[0])
    answered_by, outputs, _ = runner.run(broken, [bright])  # type: ignore[arg-type]
    assert answered_by is previous and np.allclose(outputs[0], previous.predict(bright)[0])
    assert (t.inputs, t.failures, t.agreed) == (2, 1, 1)
    assert "the delegate failed" in (t.last_failure or "")
