"""Issue 53, mixed precision and budgets: a drop of exactly the budget meets it (counts, not floats), the budget's
uncertainty on the validation samples (a binomial interval on the drop, a warning when the budget lies inside it),
mixed precision trying the next group when one would hold more than half the weights, and OpenVINO's activation
ranges checked on validation accuracy.

The quick tests judge fidelity figures as ``compare_outputs`` makes them from a classifier's decisions, and the
reason mixed precision gives when it stops; the export test quantizes a model of its own (``HEAVY_SOURCE``), trained
on sklearn's digits with a fixed seed, with each of OpenVINO's range estimators.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.device_profiles import Budgets
from edgeline.export.budgets import (
    budget_violations,
    paired_drop_interval,
    samples_for_budget,
    uncertain_verdict,
    wilson_interval,
)
from edgeline.export.fidelity import compare_outputs
from edgeline.export.report import ExportReport, TargetOutcome, format_report
from edgeline.manifest import Fidelity, Postprocess
from edgeline.samples import SampleSet

ONE_POINT = Budgets(max_accuracy_drop=1.0)


def _decisions(float_right: int, bundle_right: int, both: int, samples: int) -> Fidelity:
    """``compare_outputs`` on ``samples`` one-hot logits of 3 classes: the float model right on ``float_right``, the
    bundle on ``bundle_right``, both on ``both`` of them (label 0 throughout; a wrong decision is class 1)."""
    lost, gained = float_right - both, bundle_right - both
    float_pred = np.array([0] * both + [0] * lost + [1] * gained + [1] * (samples - both - lost - gained))
    bundle_pred = np.array([0] * both + [1] * lost + [0] * gained + [2] * (samples - both - lost - gained))
    logits = np.eye(3, dtype=np.float32)
    reference = [[logits[p][None]] for p in float_pred]
    converted = [[logits[p][None]] for p in bundle_pred]
    samples_set = SampleSet([np.zeros((samples, 3), np.float32)], np.zeros(samples, np.int64), "decisions")
    return compare_outputs(reference, converted, samples_set, Postprocess(kind="classify"), "by hand")


@pytest.mark.quick
def test_an_accuracy_drop_of_exactly_the_budget_meets_it() -> None:
    """(287/300 - 284/300) * 100 is 1.0000000000000009 in floats: a drop of exactly 1 point was refused."""
    exact = _decisions(287, 284, 284, 300)
    assert (exact.lost_samples, exact.gained_samples) == (3, 0)
    assert budget_violations(ONE_POINT, 10, exact) == []
    (reason,) = budget_violations(ONE_POINT, 10, _decisions(288, 284, 284, 300))
    assert reason == "accuracy drop 1.33 points > budget 1"
    # a manifest written before the counts were kept: the counts are its shares times its samples
    shares_only = Fidelity(status="measured", reference="torch", samples=300, accuracy=284 / 300,
                           accuracy_float=287 / 300)  # fmt: skip
    assert budget_violations(ONE_POINT, 10, shares_only) == []


@pytest.mark.quick
def test_a_disagreement_of_exactly_a_decimal_budget_meets_it() -> None:
    """Without labels the budget judges top-1 disagreement: 3 of 1000 is exactly 0.3 points, where (1 - 0.997) * 100
    is 0.30000000000000027 and the float 0.3 is 0.29999999999999998."""
    budget = Budgets(max_accuracy_drop=0.3)
    logits = np.eye(3, dtype=np.float32)
    reference = [[logits[0][None]] for _ in range(1000)]
    converted = [[logits[1 if i < 3 else 0][None]] for i in range(1000)]
    unlabelled = SampleSet([np.zeros((1000, 3), np.float32)], None, "decisions")
    fidelity = compare_outputs(reference, converted, unlabelled, Postprocess(kind="classify"), "by hand")
    assert fidelity.disagreeing_samples == 3
    assert budget_violations(budget, 10, fidelity) == []
    converted[3] = [logits[2][None]]
    fidelity = compare_outputs(reference, converted, unlabelled, Postprocess(kind="classify"), "by hand")
    (reason,) = budget_violations(budget, 10, fidelity)
    assert reason == "top-1 disagreement with the float model 0.40% > budget 0.3"


@pytest.mark.quick
def test_the_intervals_are_the_published_ones() -> None:
    """Newcombe's worked examples: Wilson's interval for 81 of 263 (0.2553 to 0.3662, Statistics in Medicine 1998,
    17:857) and method 10 for the paired table 36 / 12 / 2 / 0 (0.0569 to 0.3404, 1998, 17:2635)."""
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=5e-5)
    assert paired_drop_interval(36, 12, 2, 0) == pytest.approx((0.0569, 0.3404), abs=5e-5)
    assert wilson_interval(0, 300)[0] == 0.0 and wilson_interval(300, 300)[1] == 1.0
    low, high = paired_drop_interval(280, 0, 0, 20)  # the same decisions everywhere: still not certain of 0
    assert low < 0 < high and high - low < 0.03


@pytest.mark.quick
def test_the_fidelity_carries_the_drop_s_interval_and_the_report_warns_when_the_budget_lies_inside_it() -> None:
    """One model passed cortex-m4 at 1.67 points of a 2-point budget on 300 samples and lost 3.0 held out."""
    fidelity = _decisions(290, 285, 280, 300)  # 10 lost, 5 gained: 1.67 points
    assert fidelity.drop_interval is not None and fidelity.drop_interval_method is not None
    low, high = fidelity.drop_interval
    assert low < 1.67 < high and low < 2.0 < high
    assert "Newcombe" in fidelity.drop_interval_method
    two_points = Budgets(max_accuracy_drop=2.0)
    assert budget_violations(two_points, 10, fidelity) == []
    warning = uncertain_verdict(two_points, fidelity)
    assert warning is not None and "1.67 points" in warning and "300 validation samples" in warning
    outcome = TargetOutcome("tflite-micro", "int8-static", 1, status="selected", fidelity=fidelity)
    text = format_report(ExportReport("m", "cortex-m4", out=Path("b"), outcomes=[outcome],
                                      budgets=two_points))  # fmt: skip
    assert f"tflite-micro int8-static: WARNING: {warning}" in text.splitlines()
    # far from the budget: the interval is said, with no warning
    sure = _decisions(290, 290, 290, 300)
    assert sure.drop_interval is not None and uncertain_verdict(Budgets(max_accuracy_drop=5.0), sure) is None
    outcome.fidelity = sure
    text = format_report(ExportReport("m", "cortex-m4", out=Path("b"), outcomes=[outcome],
                                      budgets=Budgets(max_accuracy_drop=5.0)))  # fmt: skip
    assert "tflite-micro int8-static: accuracy drop 0.00 points, 95% interval" in text and "WARNING" not in text


@pytest.mark.quick
def test_a_budget_needs_the_samples_the_docs_say() -> None:
    """The docs' table (docs/bundle.md, budgets): a bundle that disagrees on none of n samples has an interval
    below the budget from that n on, and not one sample before."""
    for budget in (0.25, 0.5, 1.0, 2.0, 5.0):
        needed = samples_for_budget(budget)
        assert needed is not None
        assert wilson_interval(0, needed)[1] * 100 < budget <= wilson_interval(0, needed - 1)[1] * 100
    assert samples_for_budget(1.0) == 381


# A digits CNN of this module's own: a main path with an outlier channel (as tests/outlier_model.py) and an
# untrained side branch that holds 63% of the weights

HEAVY_SOURCE = """\
import torch
from torch import nn
from pathlib import Path

SIDE_SCALE = 1e-5


class HeavySideCNN(nn.Module):
    \"\"\"A digits CNN (conv1, mix, conv3, conv4, fc) and a side branch (probe, side) that holds 63% of the weights
    and adds a hundred-thousandth of its output to the logits.\"\"\"

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 9, 3, padding=1)
        self.act1 = nn.ReLU()
        self.mix = nn.Conv2d(9, 8, 1)
        self.act2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 16, 3, padding=1)
        self.act3 = nn.ReLU()
        self.conv4 = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.act4 = nn.ReLU()
        self.fc = nn.Linear(16 * 4 * 4, 10)
        self.probe = nn.Conv2d(1, 16, 3, padding=1)
        self.act_probe = nn.ReLU()
        self.side = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        x = x / 16.0
        side = self.side(torch.flatten(self.act_probe(self.probe(x)), 1))
        main = self.act2(self.mix(self.act1(self.conv1(x))))
        main = self.act4(self.conv4(self.act3(self.conv3(main))))
        return self.fc(torch.flatten(main, 1)) + side * SIDE_SCALE


def heavy():
    model = HeavySideCNN()
    weights = Path(__file__).with_name("heavy.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""
HEAVY_TRAIN = 1400  # digits trained on and calibrated with; those after are held out
MAIN_OUTLIER = 150.0  # conv1's channel 8 (mix reads it divided by as much): plain int8 loses about 4 points, and
# act1's worst channel keeps about 1.3 dB: ranked after act_probe, which keeps nothing
SIDE_OUTLIER = 3000.0  # probe's channel 8, made positive: int8 crushes the other channels, and it costs nothing


def _trained_heavy_model() -> Path:
    """The model's source with its weights beside it: the main path trained on the digits (seed 0), the side branch
    left as initialised; then each branch's outlier planted: the main path computes the same function (ReLU commutes
    with a positive scale); the side branch's channel 8 is made large and positive, so it survives int8 and the other
    channels do not (act_probe's worst channel: 0 dB). Each branch is ranked on its own: a layer by the noise it adds
    to what the layers it computes from had, so the side branch's lost signal hides nothing on the main path."""
    from tests.training import digit_images, trained_model

    images, labels = digit_images()

    def main_path(module: Any) -> list[Any]:
        return [p for name, p in module.named_parameters() if not name.startswith(("probe", "side"))]

    def plant(module: Any) -> None:
        module.conv1.weight[8] *= MAIN_OUTLIER
        module.conv1.bias[8] *= MAIN_OUTLIER
        module.mix.weight[:, 8] /= MAIN_OUTLIER
        module.probe.weight[8] = module.probe.weight[8].abs() * SIDE_OUTLIER
        module.probe.bias[8] = 0.5 * SIDE_OUTLIER

    x, y = images[:HEAVY_TRAIN], labels[:HEAVY_TRAIN]
    key = [MAIN_OUTLIER, SIDE_OUTLIER]
    return trained_model(
        HEAVY_SOURCE, "heavy_model.py", "heavy", "heavy.pt", x, y, key=key, parameters=main_path, edit=plant
    )


@pytest.fixture(scope="module")
def heavy_samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """32 training digits to calibrate with, 300 held-out ones to validate on."""
    from tests.training import digit_images

    images, labels = digit_images()
    folder = tmp_path_factory.mktemp("heavy_samples")
    np.savez(folder / "cal.npz", x=images[:32])
    held = slice(HEAVY_TRAIN, HEAVY_TRAIN + 300)
    np.savez(folder / "val.npz", x=images[held], labels=labels[held])
    return folder / "cal.npz", folder / "val.npz"


@pytest.mark.export
@pytest.mark.parametrize(("profile", "backend"), [("rpi4", "litert"), ("x86-64", "onnxruntime")])
def test_mixed_precision_skips_a_group_holding_most_of_the_weights_and_keeps_the_next_one_float(
    profile: str, backend: str, heavy_samples: tuple[Path, Path], tmp_path: Path
) -> None:
    """The side branch's probe ranks first by the noise int8 adds (its outlier crushes every other channel), but
    keeping it float takes ``side`` with it: 63% of the weights. It is skipped, said so, and the next group in the
    ranking (the main path's outlier tensor) is kept float and meets the budget. A ``break`` there stopped mixed
    precision with no layer kept and the budget missed."""
    import io

    from edgeline.device_profiles import Precision
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.progress import Progress
    from edgeline.manifest import worst_layers

    stream = io.StringIO()
    calibration, validation = heavy_samples
    options = ExportOptions(model=f"{_trained_heavy_model()}:heavy", profile=profile, calibration=calibration,
                            validation=validation, out=tmp_path / "bundle", backend=backend,
                            precision=Precision.INT8_STATIC)  # fmt: skip
    report = run_export(options, progress=Progress(stream, live=False))
    said = stream.getvalue().splitlines()
    (outcome,) = [o for o in report.outcomes if o.backend == backend]
    assert outcome.status == "selected", outcome.reason
    # the ranking, as the bundle's own layer report gives it: the side branch first, the main path's outlier next
    ranked = [layer.module for layer in worst_layers(outcome.layers)]
    assert ranked[:2] == ["act_probe", "act1"], outcome.layers
    skipped = [line for line in said if "not keeping probe, act_probe, side in float" in line]
    assert len(skipped) == 1 and "63% of the weights would be float (at most 50%)" in skipped[0], said
    kept = {k.module: k.reason for k in outcome.kept_float}
    assert set(kept) == {"conv1", "act1", "mix"}, kept
    assert kept["act1"].startswith("its output ranked 2 by the noise int8 adds to it")
    assert (
        "skipped before it, as more than 50% of the weights would be float: probe, act_probe, side (63%" in kept["act1"]
    )
    assert outcome.int8_missed is not None and outcome.int8_missed.startswith("accuracy drop")
    # the bundle itself, on the validation digits, against the float model: within the 1-point budget (in counts)
    import torch

    from edgeline.export.loading import load_model
    from edgeline.model import load

    data = np.load(validation)
    deployed = load(tmp_path / "bundle")
    found = np.array([int(np.argmax(deployed.predict(x[None])[0])) for x in data["x"]])
    bundle_right = int((found == data["labels"]).sum())
    with torch.no_grad():
        decided = load_model(f"{_trained_heavy_model()}:heavy").module(torch.from_numpy(data["x"])).argmax(1)
    float_right = int((decided.numpy() == data["labels"]).sum())
    assert (float_right - bundle_right) * 100 <= 1 * len(data["labels"]), (float_right, bundle_right)


@pytest.mark.quick
def test_the_reason_says_which_groups_were_skipped_for_the_weight_limit_and_why_it_stopped() -> None:
    from edgeline.export.pipeline import MIXED_STEPS, _why_mixed_stopped

    said = _why_mixed_stopped([], ["probe, act_probe, side (60% of the weights)"], 7)
    assert said == (
        "no layer could be kept in float (mixed precision); skipped, as more than 50% of the weights would be float "
        "(a float target is cheaper then): probe, act_probe, side (60% of the weights); no other layer of the 7 ranked "
        "by the noise int8 adds was left to try"
    )
    said = _why_mixed_stopped(["a", "b", "c", "d"][:MIXED_STEPS], [], 9)
    assert said.endswith(f"; stopped after {MIXED_STEPS} groups tried (the most it tries)")


# OpenVINO: the activation range estimator checked on the validation accuracy the budget judges


def _openvino_choice(model_file: Path, judge_labels: bool) -> dict[str, Any]:
    """``choose_ranges`` on the model's OpenVINO IR (calibration: 32 training digits; validation: 300 held-out ones),
    and every estimator's int8 model scored independently: output error on the calibration samples, accuracy on the
    validation samples against their labels."""
    import torch

    from edgeline.device_profiles import Precision
    from edgeline.export.backends import AccuracyControl, ExportRequest
    from edgeline.export.backends.openvino import (
        RANGE_ESTIMATORS,
        _outputs,
        choose_ranges,
        import_export_tools,
        output_error,
        quantization_parameters,
        to_openvino,
    )
    from edgeline.export.loading import load_model
    from tests.training import digit_images

    images, labels = digit_images()
    calibration = images[:32]
    held, held_labels = images[HEAVY_TRAIN : HEAVY_TRAIN + 300], labels[HEAVY_TRAIN : HEAVY_TRAIN + 300]
    module = load_model(f"{model_file}:heavy").module
    request = ExportRequest(
        module=module,
        example_inputs=(torch.from_numpy(calibration[:1]),),
        calibration=[(torch.from_numpy(calibration[i : i + 1]),) for i in range(32)],
        precision=Precision.INT8_STATIC,
        out_dir=model_file.parent,
        input_names=("x",),
    )
    ov, nncf = import_export_tools()
    model, _ = to_openvino(ov, request)
    feeds = [{"x": calibration[i : i + 1]} for i in range(32)]
    validation_feeds = [{"x": held[i : i + 1]} for i in range(len(held))]

    def accuracy(indices: Any, outputs: Any) -> float:
        chosen = list(indices)
        decided = np.array([int(np.argmax(outputs[k][0])) for k in range(len(chosen))])
        return float(np.mean(decided == held_labels[chosen]) * 100.0)

    judge = AccuracyControl(samples=[(x,) for x in held], score=accuracy, max_drop=1.0, measure="accuracy")
    options = dict(preset=nncf.QuantizationPreset.PERFORMANCE, target_device=nncf.TargetDevice.CPU, subset_size=32)
    chosen, _, said = choose_ranges(
        ov, nncf, model, feeds, options, (judge, validation_feeds) if judge_labels else None
    )
    reference = _outputs(ov, model, feeds)
    errors, scores = {}, {}
    for estimator in RANGE_ESTIMATORS:
        quantized = nncf.quantize(
            model.clone(), nncf.Dataset(feeds), advanced_parameters=quantization_parameters(estimator), **options
        )
        errors[estimator] = output_error(_outputs(ov, quantized, feeds), reference)
        compiled = ov.Core().compile_model(quantized, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        decided = np.array([int(np.argmax(compiled(feed)[0])) for feed in validation_feeds])
        scores[estimator] = float(np.mean(decided == held_labels) * 100.0)
    return {"chosen": chosen, "said": said, "errors": errors, "scores": scores}


@pytest.fixture(scope="module")
def openvino_choice() -> dict[str, Any]:
    return _openvino_choice(_trained_heavy_model(), judge_labels=True)


@pytest.mark.export
def test_openvino_keeps_the_range_estimator_with_the_best_validation_accuracy(openvino_choice: dict[str, Any]) -> None:
    """The choice by the calibration samples' output error is checked on the accuracy the budget judges: the
    estimator kept has the best held-out accuracy (recomputed here, each estimator quantized again), the least output
    error winning only a tie; the manifest's sentence gives every score. On this model the two measures disagree
    (min-max's outputs are nearest the float model's, mean-min-max decides one more held-out digit right), so a choice
    by the output error alone fails here."""
    errors, scores = openvino_choice["errors"], openvino_choice["scores"]
    nearest = min(errors, key=lambda name: errors[name])
    best = max(scores, key=lambda name: (scores[name], name == nearest))
    assert nearest != best, f"the estimators agree on this model: the test no longer tells the measures apart: {scores}"
    assert openvino_choice["chosen"] == best, openvino_choice
    said = openvino_choice["said"]
    assert "accuracy on the 300 validation samples" in said and all(f"{n} {s:.2f}" in said for n, s in scores.items())
