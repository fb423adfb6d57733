"""The trial's rules, on real models: agreement by kind, the gates' judgement, and the previous version answering
an input the new one fails on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_the_inputs_of_a_batch_past_the_trial_s_end_are_answered_but_not_counted() -> None:
    """The trial ends between two batches: the rest of the batch that reached its inputs is not counted (a trial of
    40 said it had taken 41)."""
    t = trial(inputs=40)
    for _ in range(45):
        t.record(new_ok=True, agreed=True, new_s=0.001, old_s=0.001)
    assert t.inputs == 40 and t.agreed == 40 and t.done()


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
    # one model twice, on a busy machine: about half the calls of each delayed by the scheduler, so the medians land
    # in different modes (seen in the suite: 1.22 ms against 0.137 ms, and the same bundle rolled back)
    busy = trial(inputs=31)
    for i in range(31):
        new_s, old_s = (0.0012 if i % 2 == 0 else 0.00013), (0.0012 if i % 2 and i < 29 else 0.00013)
        busy.record(new_ok=True, agreed=True, new_s=new_s, old_s=old_s)
    figures = busy.figures()
    assert figures["median_ms"] > 2 * figures["previous_median_ms"] and figures["median_ms"] > 1.0, figures
    assert busy.judge().commit, "its prompt calls (the lower quartile) are as fast as the previous version's"
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


def feed(t: Trial, outcomes: str, *, now: float | None = None) -> int:
    """Record ``outcomes`` (``a`` agreed, ``d`` disagreed, ``f`` failed) until the trial is done; the inputs taken."""
    for outcome in outcomes:
        t.record(new_ok=outcome != "f", agreed=outcome == "a", new_s=0.001, old_s=0.001, failure="RuntimeError: boom")
        if t.done(now=now):
            break
    return t.inputs


def test_a_trial_stops_as_soon_as_its_gates_can_no_longer_be_met() -> None:
    # 90% of 200: 20 disagreements are allowed, the 21st decides: random weights (17% agreement) stop at ~25
    random_weights = trial()
    assert feed(random_weights, "ddddda" * 40) == 25, "21 disagreements among 25: 89.5% at best"
    verdict = random_weights.judge()
    assert not verdict.commit and "on 4 of 25 inputs" in verdict.reason and "stopped early" in verdict.reason
    assert "175 inputs left" in verdict.reason and "89.5%" in verdict.reason, verdict.reason

    at_the_gate = trial()
    assert feed(at_the_gate, "d" * 20 + "a" * 180) == 200, "20 disagreements may still make 90%: never stopped"
    assert at_the_gate.judge().commit

    # 1% of 200: 2 failures are allowed, the 3rd decides
    failing = trial()
    assert feed(failing, "f" * 200) == 3
    verdict = failing.judge()
    assert not verdict.commit and "failed on 3 of 3 inputs" in verdict.reason and "boom" in verdict.reason
    assert "more than 1.0% of even 200" in verdict.reason, verdict.reason


def test_once_its_seconds_are_up_a_trial_can_take_only_the_inputs_it_lacks() -> None:
    quiet = trial(inputs=200, seconds=60, min_inputs=20)
    assert feed(quiet, "d" * 5, now=quiet.started + 1) == 5, "before its time: 195 inputs may still come"
    assert quiet.remaining(now=quiet.started + 1) == 195
    assert quiet.remaining(now=quiet.started + 61) == 15, "after it: the trial ends at its 20th input"
    assert quiet.done(now=quiet.started + 61), "15 more agreeing of 20: 75% at best"
    assert not trial(inputs=200, seconds=60, min_inputs=20).done(now=quiet.started + 61), "nothing seen, nothing known"


@settings(max_examples=300, deadline=None)
@given(
    outcomes=st.text(alphabet="aadf", min_size=1, max_size=60),
    min_agreement=st.sampled_from([0.0, 0.5, 0.8, 0.9, 0.95, 1.0]),
    max_error_rate=st.sampled_from([0.0, 0.01, 0.05, 0.2, 1.0]),
)
def test_a_trial_stops_early_exactly_when_no_continuation_could_pass(
    outcomes: str, min_agreement: float, max_error_rate: float
) -> None:
    gates = {"inputs": len(outcomes), "min_agreement": min_agreement, "max_error_rate": max_error_rate}
    stopped = feed(trial(**gates), outcomes)
    for taken in range(1, len(outcomes) + 1):
        best = trial(**gates)
        for outcome in outcomes[:taken] + "a" * (len(outcomes) - taken):  # the rest all answered and agreeing
            best.record(new_ok=outcome != "f", agreed=outcome == "a", new_s=0.001, old_s=0.001)
        hopeless = not best.judge().commit
        if taken < stopped:
            assert not hopeless, f"{outcomes[:taken]}: could not pass any more, yet the trial went on"
        elif taken == stopped and stopped < len(outcomes):
            assert hopeless, f"stopped after {outcomes[:taken]}, yet it could still pass"


def test_the_rollback_reason_quotes_the_runtimes_error_once(tmp_path: Path) -> None:
    """LiteRT's error reporter keeps every message it was given and says them all at each failure: the fourth
    failure quoted the first three too, and a rollback reason said "gather index out of bounds" four times."""
    previous = load(COMMITTED_BUNDLE)
    failing = load(versioned(tmp_path / "v2", 2, fail_every_input=True))
    image = np.full((1, 1, 8, 8), 0.5, np.float32)
    said = []
    for _ in range(3):
        with pytest.raises(RuntimeError) as caught:
            failing.predict(image)
        said.append(str(caught.value))
    assert said[0] == said[1] == said[2] and said[0].count("gather index out of bounds") == 1, said

    t = Trial(version=2, previous_version=1, gates=Gates(), kind="classify", latency_budget_ms=None)
    runner = TrialRunner(previous, t)
    rng = np.random.default_rng(0)
    while not t.done():
        answered_by, _, _ = runner.run(failing, [rng.random((1, 1, 8, 8), dtype=np.float32)])
        assert answered_by is previous, "the previous version answers what the new one fails on"
    verdict = t.judge()
    assert t.inputs == 3 and not verdict.commit
    assert verdict.reason.count("gather index out of bounds") == 1, verdict.reason
