"""Property tests of the pure pieces: quantization maths, metrics, post-processing and sample matching.

Quantization is tested where inferences go through it: the converters ``Model`` builds once per input and output
(``edgeline.model``), which compute in place with precomputed constants. ``edgeline.quantization`` holds the plain
formulas; the converters must agree with them exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgeline.errors import PayloadError
from edgeline.export.metrics import accuracy, confusion_matrix, cosine_similarity_rows, macro_f1
from edgeline.manifest import Postprocess, Preprocess, Quantization, TensorSpec
from edgeline.model import _InputConverter, _output_converter
from edgeline.postprocess import interpret, softmax
from edgeline.quantization import dequantize, quantize
from edgeline.samples import sample_set

pytestmark = pytest.mark.quick

# No deadline: the first example pays for numpy's warm-up; a deadline would be a timing assertion.
PROPERTY = settings(deadline=None, max_examples=150)

INTEGER_DTYPES = [np.dtype(np.int8), np.dtype(np.uint8)]

# ---------------------------------------------------------------------------------------------------------------------
# quantization


class _NoPreprocess:
    preprocess = None  # all of the manifest an input converter reads


def to_model(values: np.ndarray, params: Quantization, dtype: np.dtype) -> np.ndarray:
    """What an inference feeds the model for these float values: the input converter of an int input."""
    spec = TensorSpec(name="x", dtype=str(dtype), shape=(1, values.size), quantization=params)
    convert = _InputConverter(0, spec, _NoPreprocess())
    return convert(np.asarray(values, dtype=np.float32).reshape(1, -1)).reshape(values.shape).copy()


def from_model(codes: np.ndarray, params: Quantization) -> np.ndarray:
    """What an inference returns for these output codes: the output converter of an int output."""
    spec = TensorSpec(name="y", dtype=str(codes.dtype), shape=(1, codes.size), quantization=params)
    convert = _output_converter(spec)
    assert convert is not None
    return convert(codes.reshape(1, -1)).reshape(codes.shape)


@st.composite
def quantization_params(draw: st.DrawFn) -> tuple[Quantization, np.dtype]:
    dtype = draw(st.sampled_from(INTEGER_DTYPES))
    info = np.iinfo(dtype)
    # A float32-exact scale: the runtime computes in float32, so this is the scale it really uses.
    scale = float(np.float32(draw(st.floats(min_value=1e-6, max_value=1e4, allow_subnormal=False))))
    zero_point = draw(st.integers(int(info.min), int(info.max)))
    return Quantization(scale=scale, zero_point=zero_point), dtype


@PROPERTY
@given(params=quantization_params(), data=st.data())
def test_round_trip_error_is_at_most_half_a_step_inside_the_range(
    params: tuple[Quantization, np.dtype], data: st.DataObject
) -> None:
    quant, dtype = params
    info = np.iinfo(dtype)
    steps = data.draw(
        hnp.arrays(
            np.float64,
            st.integers(1, 32),
            elements=st.floats(float(info.min - quant.zero_point), float(info.max - quant.zero_point)),
        )
    )
    values = (steps * quant.scale).astype(np.float32)
    quantized = to_model(values, quant, dtype)
    assert quantized.dtype == dtype
    assert quantized.shape == values.shape
    restored = from_model(quantized, quant)
    assert restored.dtype == np.float32
    error = np.abs(restored.astype(np.float64) - values.astype(np.float64))
    # Half a step, plus float32 rounding of the division and the multiplication (far below a step).
    assert error.max() <= quant.scale / 2 + quant.scale * 1e-4


@PROPERTY
@given(params=quantization_params(), beyond=st.floats(min_value=0.01, max_value=1e6), sign=st.sampled_from([1, -1]))
def test_values_outside_the_range_saturate(params: tuple[Quantization, np.dtype], beyond: float, sign: int) -> None:
    quant, dtype = params
    info = np.iinfo(dtype)
    if sign > 0:
        value, expected = (info.max - quant.zero_point + 0.5 + beyond) * quant.scale, info.max
    else:
        value, expected = (info.min - quant.zero_point - 0.5 - beyond) * quant.scale, info.min
    assume(math.isfinite(float(np.float32(value))))
    quantized = to_model(np.array([value, -value], dtype=np.float32), quant, dtype)
    assert quantized[0] == expected
    with pytest.raises(PayloadError, match="NaN or Inf") as refused:
        to_model(np.array([value, sign * np.inf], dtype=np.float32), quant, dtype)
    assert refused.value.code == "non-finite"


@PROPERTY
@given(dtype=st.sampled_from(INTEGER_DTYPES), exponent=st.integers(-10, 4), data=st.data())
def test_exact_halves_round_to_even(dtype: np.dtype, exponent: int, data: st.DataObject) -> None:
    info = np.iinfo(dtype)
    zero_point = data.draw(st.integers(int(info.min), int(info.max) - 1))
    below = data.draw(st.integers(int(info.min) - zero_point, int(info.max) - zero_point - 1))
    scale = 2.0**exponent  # powers of two make (below + 0.5) * scale and its division exact
    quant = Quantization(scale=scale, zero_point=zero_point)
    value = np.array([(below + 0.5) * scale], dtype=np.float32)
    nearest_even = below if below % 2 == 0 else below + 1
    assert int(to_model(value, quant, dtype)[0]) == nearest_even + zero_point


@PROPERTY
@given(params=quantization_params(), data=st.data())
def test_quantize_is_monotonic(params: tuple[Quantization, np.dtype], data: st.DataObject) -> None:
    quant, dtype = params
    values = data.draw(
        hnp.arrays(np.float32, st.integers(2, 32), elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False))
    )
    ordered = np.sort(values)
    quantized = to_model(ordered, quant, dtype).astype(np.int64)
    assert (np.diff(quantized) >= 0).all()


@PROPERTY
@given(params=quantization_params(), data=st.data())
def test_every_code_dequantizes_and_quantizes_back_to_itself(
    params: tuple[Quantization, np.dtype], data: st.DataObject
) -> None:
    quant, dtype = params
    info = np.iinfo(dtype)
    codes = data.draw(hnp.arrays(dtype, st.integers(1, 32), elements=st.integers(int(info.min), int(info.max))))
    assert np.array_equal(to_model(from_model(codes, quant), quant, dtype), codes)


@PROPERTY
@given(params=quantization_params(), data=st.data())
def test_the_converters_agree_with_the_formulas_exactly(
    params: tuple[Quantization, np.dtype], data: st.DataObject
) -> None:
    quant, dtype = params
    info = np.iinfo(dtype)
    values = data.draw(
        hnp.arrays(np.float32, st.integers(1, 32), elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False))
    )
    assert np.array_equal(to_model(values, quant, dtype), quantize(values, quant, dtype))
    codes = data.draw(hnp.arrays(dtype, st.integers(1, 32), elements=st.integers(int(info.min), int(info.max))))
    assert np.array_equal(from_model(codes, quant), dequantize(codes, quant))


class _Scaled:
    def __init__(self, scale: float, offset: float):
        self.preprocess = Preprocess(scale=scale, offset=offset)


@PROPERTY
@given(
    params=quantization_params(),
    kind=st.sampled_from(["quantized", "quantized, preprocessed", "float, preprocessed", "float16"]),
    pre=st.tuples(st.floats(-100, 100, width=32), st.floats(-100, 100, width=32)),
    data=st.data(),
)
def test_a_batch_converts_as_its_samples_do_one_by_one(
    params: tuple[Quantization, np.dtype], kind: str, pre: tuple[float, float], data: st.DataObject
) -> None:
    """``Model.predict_batch`` converts all its rows in one pass: bit for bit what ``predict`` feeds each one."""
    quant, dtype = params
    width, rows = data.draw(st.integers(1, 16)), data.draw(st.integers(2, 8))
    quantized = kind.startswith("quantized")
    spec = TensorSpec(
        name="x",
        dtype=str(dtype) if quantized else ("float16" if kind == "float16" else "float32"),
        shape=(1, width),
        quantization=quant if quantized else None,
    )
    manifest = _Scaled(*pre) if "preprocessed" in kind else _NoPreprocess()
    values = data.draw(
        hnp.arrays(np.float32, (rows, width), elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False))
    )
    convert = _InputConverter(0, spec, manifest)
    one_by_one = np.concatenate([convert(values[row : row + 1]).copy() for row in range(rows)])
    together = convert.convert(values, np.empty(values.shape, spec.dtype))
    assert together.dtype == np.dtype(spec.dtype)
    np.testing.assert_array_equal(together, one_by_one)


# ---------------------------------------------------------------------------------------------------------------------
# metrics


@st.composite
def predictions(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    classes = draw(st.integers(1, 8))
    count = draw(st.integers(1, 60))
    labels = st.integers(0, classes - 1)
    truth = np.array(draw(st.lists(labels, min_size=count, max_size=count)), dtype=np.int64)
    predicted = np.array(draw(st.lists(labels, min_size=count, max_size=count)), dtype=np.int64)
    return truth, predicted, classes


def reference_macro_f1(truth: list[int], predicted: list[int], classes: int) -> float:
    """F1 per class present in truth or predictions, averaged; written from the definition."""
    scores = []
    for label in range(classes):
        tp = sum(1 for t, p in zip(truth, predicted, strict=True) if t == label and p == label)
        fp = sum(1 for t, p in zip(truth, predicted, strict=True) if t != label and p == label)
        fn = sum(1 for t, p in zip(truth, predicted, strict=True) if t == label and p != label)
        if tp + fp + fn == 0:
            continue
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        scores.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


@PROPERTY
@given(case=predictions())
def test_accuracy_is_a_fraction_and_the_confusion_diagonal_over_n(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    truth, predicted, classes = case
    value = accuracy(truth, predicted)
    assert 0.0 <= value <= 1.0
    matrix = confusion_matrix(truth, predicted, classes)
    assert matrix.shape == (classes, classes)
    assert matrix.sum() == truth.size
    assert (matrix >= 0).all()
    assert np.trace(matrix) / truth.size == pytest.approx(value, abs=1e-12)
    assert matrix.sum(axis=1).tolist() == np.bincount(truth, minlength=classes).tolist()
    assert matrix.sum(axis=0).tolist() == np.bincount(predicted, minlength=classes).tolist()


@PROPERTY
@given(case=predictions())
def test_confusion_matrix_counts_each_pair(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    truth, predicted, classes = case
    matrix = confusion_matrix(truth, predicted, classes)
    for t in range(classes):
        for p in range(classes):
            assert matrix[t, p] == int(np.sum((truth == t) & (predicted == p)))


@PROPERTY
@given(case=predictions())
def test_macro_f1_matches_a_reference_implementation(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    truth, predicted, classes = case
    value = macro_f1(truth, predicted, classes)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(reference_macro_f1(truth.tolist(), predicted.tolist(), classes), abs=1e-12)


@PROPERTY
@given(case=predictions())
def test_perfect_predictions_score_one(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    truth, _, classes = case
    assert accuracy(truth, truth.copy()) == 1.0
    assert macro_f1(truth, truth.copy(), classes) == 1.0
    assert np.array_equal(np.diag(confusion_matrix(truth, truth, classes)), np.bincount(truth, minlength=classes))


def test_accuracy_of_no_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="no samples"):
        accuracy(np.array([], dtype=np.int64), np.array([], dtype=np.int64))


# Magnitudes where float64 dot products are exact enough for "== 1"; no subnormal squares.
cosine_elements = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-3, max_value=1e3),
    st.floats(min_value=-1e3, max_value=-1e-3),
)


@st.composite
def row_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 12)))
    a = draw(hnp.arrays(np.float64, shape, elements=cosine_elements))
    b = draw(hnp.arrays(np.float64, shape, elements=cosine_elements))
    return a, b


@PROPERTY
@given(rows=row_pairs())
def test_cosine_of_a_row_with_itself_is_one(rows: tuple[np.ndarray, np.ndarray]) -> None:
    a, _ = rows
    assert cosine_similarity_rows(a, a) == pytest.approx(np.ones(a.shape[0]), abs=1e-9)
    assert cosine_similarity_rows(a.astype(np.float32), 3.0 * a) == pytest.approx(np.ones(a.shape[0]), abs=1e-6)


@PROPERTY
@given(rows=row_pairs())
def test_cosine_is_within_minus_one_and_one_and_symmetric(rows: tuple[np.ndarray, np.ndarray]) -> None:
    a, b = rows
    cosine = cosine_similarity_rows(a, b)
    assert cosine.shape == (a.shape[0],)
    assert ((cosine >= -1.0) & (cosine <= 1.0)).all()
    assert cosine == pytest.approx(cosine_similarity_rows(b, a), abs=1e-12)
    nonzero = np.linalg.norm(a, axis=1) > 0
    assert cosine_similarity_rows(a, -a)[nonzero] == pytest.approx(-np.ones(int(nonzero.sum())), abs=1e-9)


def test_cosine_of_zero_rows() -> None:
    zero = np.zeros((1, 3))
    assert cosine_similarity_rows(zero, zero).tolist() == [1.0]
    assert cosine_similarity_rows(zero, np.array([[1.0, 2.0, 3.0]])).tolist() == [0.0]
    assert cosine_similarity_rows(np.array([[1.0, 0.0]]), np.array([[0.0, 5.0]])).tolist() == [0.0]


# ---------------------------------------------------------------------------------------------------------------------
# post-processing

finite_logits = hnp.arrays(np.float64, st.integers(1, 20), elements=st.floats(-1e300, 1e300))


@PROPERTY
@given(logits=finite_logits)
def test_softmax_is_a_distribution_that_keeps_the_argmax(logits: np.ndarray) -> None:
    probabilities = softmax(logits)
    assert probabilities.shape == logits.shape
    assert np.isfinite(probabilities).all()
    assert ((probabilities >= 0) & (probabilities <= 1)).all()
    assert probabilities.sum() == pytest.approx(1.0, abs=1e-9)
    # The largest logit gets the largest probability (near-equal logits may share it).
    assert probabilities[int(np.argmax(logits))] == probabilities.max()


@PROPERTY
@given(
    logits=hnp.arrays(np.float64, st.integers(1, 20), elements=st.floats(-50, 50)),
    shift=st.floats(-100, 100),
)
def test_softmax_ignores_a_common_shift(logits: np.ndarray, shift: float) -> None:
    assert softmax(logits + shift) == pytest.approx(softmax(logits), abs=1e-9)


@st.composite
def classifier_outputs(draw: st.DrawFn) -> tuple[np.ndarray, tuple[str, ...]]:
    classes = draw(st.integers(2, 12))
    logits = draw(hnp.arrays(np.float32, (1, classes), elements=st.floats(-100, 100, width=32, allow_subnormal=False)))
    labels = tuple(draw(st.lists(st.text(min_size=1, max_size=8), min_size=classes, max_size=classes, unique=True)))
    return logits, labels


@PROPERTY
@given(case=classifier_outputs(), top_k=st.integers(1, 15))
def test_classify_picks_the_argmax_label(case: tuple[np.ndarray, tuple[str, ...]], top_k: int) -> None:
    logits, labels = case
    row = logits.reshape(-1).astype(np.float64)
    answer = interpret(Postprocess(kind="classify", labels=labels), [np.zeros(1)], [logits], top_k=top_k)
    assert answer.index is not None and answer.score is not None
    scores = softmax(row)
    assert answer.label == labels[answer.index]
    # The highest output, the first of equal ones (softmax's rounding may give near outputs one score: the output
    # decides), and its softmax score to the bit, whether top_k takes the general path or the top-1 shortcut.
    assert answer.index == int(np.argmax(row))
    assert answer.score == scores[answer.index] == scores.max()
    assert [label for label, _ in answer.top_k] == [labels[i] for i in np.argsort(-row, kind="stable")[:top_k]]
    assert len(answer.top_k) == min(top_k, row.size)
    assert answer.top_k[0] == (answer.label, answer.score)
    top_scores = [score for _, score in answer.top_k]
    assert top_scores == sorted(top_scores, reverse=True)
    as_dict = answer.as_dict()
    assert as_dict["label"] == answer.label and as_dict["class_index"] == answer.index
    assert as_dict["score"] == answer.score
    assert ("top_k" in as_dict) == (len(answer.top_k) > 1)


@PROPERTY
@given(case=classifier_outputs())
def test_classify_identity_scores_and_default_labels(case: tuple[np.ndarray, tuple[str, ...]]) -> None:
    probabilities, _ = case
    answer = interpret(Postprocess(kind="classify", score="identity"), [np.zeros(1)], [probabilities])
    best = int(np.argmax(probabilities.reshape(-1)))
    assert answer.index == best
    assert answer.label == str(best)
    assert answer.score == pytest.approx(float(probabilities.reshape(-1)[best]))


@PROPERTY
@given(
    data=st.data(),
    size=st.integers(1, 32),
    threshold=st.floats(0, 1e4),
)
def test_reconstruction_anomaly_flag_iff_score_above_threshold(
    data: st.DataObject, size: int, threshold: float
) -> None:
    elements = st.floats(-100, 100, width=32)
    sample = data.draw(hnp.arrays(np.float32, (1, size), elements=elements))
    reconstruction = data.draw(hnp.arrays(np.float32, (1, size), elements=elements))
    post = Postprocess(kind="anomaly", threshold=threshold)
    answer = interpret(post, [sample], [reconstruction])
    expected = float(np.mean((sample.astype(np.float64) - reconstruction.astype(np.float64)) ** 2))
    assert answer.anomaly_score == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert answer.anomaly is (answer.anomaly_score > threshold)
    assert set(answer.as_dict()) == {"anomaly_score", "anomaly"}


@PROPERTY
@given(score=st.floats(-1e6, 1e6, width=32), threshold=st.floats(-1e6, 1e6))
def test_output_anomaly_flag_iff_score_above_threshold(score: float, threshold: float) -> None:
    post = Postprocess(kind="anomaly", anomaly_score="output", threshold=threshold)
    answer = interpret(post, [np.zeros((1, 4), np.float32)], [np.array([[score]], dtype=np.float32)])
    assert answer.anomaly_score == score
    assert answer.anomaly is (score > threshold)


def test_anomaly_score_equal_to_the_threshold_is_not_flagged() -> None:
    post = Postprocess(kind="anomaly", anomaly_score="output", threshold=0.5)
    assert interpret(post, [np.zeros(1)], [np.array([0.5], dtype=np.float32)]).anomaly is False
    assert interpret(post, [np.zeros(1)], [np.array([0.5000001], dtype=np.float32)]).anomaly is True


def test_raw_models_are_not_interpreted() -> None:
    answer = interpret(Postprocess(kind="raw"), [np.zeros(1)], [np.arange(3.0)])
    assert answer.as_dict() == {}


# ---------------------------------------------------------------------------------------------------------------------
# sample files matched to model inputs

NAMES = ("image", "audio", "accel", "gyro")


@st.composite
def model_inputs(draw: st.DrawFn) -> list[TensorSpec]:
    count = draw(st.integers(1, 3))
    names = draw(st.permutations(NAMES))[:count]
    specs = []
    for name in names:
        per_sample = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
        specs.append(TensorSpec(name=name, dtype="float32", shape=(1, *per_sample)))
    return specs


def _filled(spec: TensorSpec, count: int, seed: int) -> np.ndarray:
    """Samples whose values identify the spec they were made for."""
    per_sample = spec.shape[1:]
    return np.arange(count * math.prod(per_sample), dtype=np.float64).reshape(count, *per_sample) + seed * 1000.0


@PROPERTY
@given(specs=model_inputs(), count=st.integers(1, 5), data=st.data())
def test_arrays_are_matched_by_name_in_any_file_order(specs: list[TensorSpec], count: int, data: st.DataObject) -> None:
    arrays = {spec.name: _filled(spec, count, seed) for seed, spec in enumerate(specs)}
    file_order = data.draw(st.permutations(list(arrays)))
    shuffled = {name: arrays[name] for name in file_order}
    samples = sample_set(shuffled, specs, "x.npz")
    assert len(samples) == count
    assert samples.labels is None
    for spec, got in zip(specs, samples.inputs, strict=True):
        assert got.dtype == np.float32
        assert got.shape == (count, *spec.shape[1:])
        assert np.array_equal(got, arrays[spec.name].astype(np.float32))
    assert [a.shape for a in samples.sample(count - 1)] == [spec.shape for spec in specs]


@PROPERTY
@given(specs=model_inputs(), count=st.integers(1, 5))
def test_arrays_are_matched_by_order_when_the_names_differ(specs: list[TensorSpec], count: int) -> None:
    arrays = {f"arr_{i}": _filled(spec, count, i) for i, spec in enumerate(specs)}
    samples = sample_set(arrays, specs, "x.npz")
    for i, got in enumerate(samples.inputs):
        assert np.array_equal(got, arrays[f"arr_{i}"].astype(np.float32))


@PROPERTY
@given(specs=model_inputs())
def test_one_sample_without_its_sample_axis(specs: list[TensorSpec]) -> None:
    arrays = {spec.name: np.asarray(_filled(spec, 1, i)[0]) for i, spec in enumerate(specs)}
    samples = sample_set(arrays, specs, "one.npz")
    assert len(samples) == 1
    for spec, got in zip(specs, samples.inputs, strict=True):
        assert got.shape == (1, *spec.shape[1:])
        assert np.array_equal(got[0], arrays[spec.name].astype(np.float32))


@PROPERTY
@given(specs=model_inputs(), count=st.integers(1, 5), data=st.data())
def test_a_wrong_shape_names_the_input(specs: list[TensorSpec], count: int, data: st.DataObject) -> None:
    wrong = data.draw(st.integers(0, len(specs) - 1))
    arrays = {spec.name: _filled(spec, count, i) for i, spec in enumerate(specs)}
    per_sample = specs[wrong].shape[1:]
    bad_shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple))
    assume(bad_shape[1:] != per_sample and bad_shape != per_sample)
    arrays[specs[wrong].name] = np.zeros(bad_shape, dtype=np.float32)
    with pytest.raises(PayloadError) as raised:
        sample_set(arrays, specs, "x.npz")
    message = str(raised.value)
    assert f"x.npz[{specs[wrong].name}]" in message
    assert repr(specs[wrong].name) in message
    assert str(list(bad_shape)) in message


def test_wrong_number_of_arrays_lists_the_model_inputs() -> None:
    specs = [
        TensorSpec(name="image", dtype="float32", shape=(1, 2)),
        TensorSpec(name="audio", dtype="float32", shape=(1, 3)),
    ]
    with pytest.raises(PayloadError, match=r"holds 1 input arrays \(image\) but the model takes 2 \(image, audio\)"):
        sample_set({"image": np.zeros((4, 2))}, specs, "x.npz")
    with pytest.raises(PayloadError, match="holds 0 input arrays"):
        sample_set({"labels": np.zeros(4)}, specs, "x.npz")


def test_sample_counts_and_labels_must_agree() -> None:
    specs = [
        TensorSpec(name="image", dtype="float32", shape=(1, 2)),
        TensorSpec(name="audio", dtype="float32", shape=(1, 3)),
    ]
    with pytest.raises(PayloadError, match=r"disagree on the number of samples: \[3, 4\]"):
        sample_set({"image": np.zeros((4, 2)), "audio": np.zeros((3, 3))}, specs, "x.npz")
    with pytest.raises(PayloadError, match=r"x.npz\[labels\]: 5 labels for 4 samples"):
        sample_set({"image": np.zeros((4, 2)), "audio": np.zeros((4, 3)), "labels": np.zeros(5)}, specs, "x.npz")
    labelled = sample_set({"image": np.zeros((4, 2)), "audio": np.zeros((4, 3)), "labels": np.arange(4)}, specs, "x")
    assert labelled.labels is not None and labelled.labels.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "array",
    [np.array([["a", "b"]]), np.array([[True, False]]), np.array([[1 + 2j, 3j]]), np.array([[None, 1]], dtype=object)],
    ids=["str", "bool", "complex", "object"],
)
def test_non_real_dtypes_are_refused_naming_the_array(array: np.ndarray) -> None:
    specs = [TensorSpec(name="image", dtype="float32", shape=(1, 2))]
    with pytest.raises(PayloadError, match=r"x.npz\[image\]: dtype .* is not a real number type"):
        sample_set({"image": array}, specs, "x.npz")


# ---------------------------------------------------------------------------------------------------------------------
# labels


@PROPERTY
@given(
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.uint8, np.int64]),
    values=st.lists(st.integers(0, 200), min_size=1, max_size=20),
)
def test_labels_holding_whole_numbers_are_class_indices_whatever_their_dtype(dtype: type, values: list[int]) -> None:
    image = np.zeros((len(values), 3), np.float32)
    spec = TensorSpec(name="x", dtype="float32", shape=(1, 3))
    samples = sample_set({"x": image, "labels": np.asarray(values, dtype=dtype)}, [spec], "v.npz")
    assert samples.labels is not None and samples.labels.dtype == np.int64
    assert samples.labels.tolist() == values


@pytest.mark.parametrize(
    ("labels", "found"),
    [
        (np.array([0.0, 1.5, 2.0]), "found 1.5 at index 1"),
        (np.array([0.0, np.nan, 2.0]), "found nan at index 1"),
        (np.array([np.inf, 1.0, 2.0]), "found inf at index 0"),
        (np.array(["a", "b", "c"]), "dtype <U1"),
    ],
)
def test_labels_that_are_not_class_indices_are_refused(labels: np.ndarray, found: str) -> None:
    image = np.zeros((3, 3), np.float32)
    spec = TensorSpec(name="x", dtype="float32", shape=(1, 3))
    with pytest.raises(PayloadError, match=r"v\.npz\[labels\]: ") as refused:
        sample_set({"x": image, "labels": labels}, [spec], "v.npz")
    assert found in str(refused.value)
