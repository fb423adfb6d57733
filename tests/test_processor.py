"""The daemon's message processor on a real LiteRT bundle: one answer per input, coded errors, windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import edgeline
from edgeline.daemon.codecs import get_codec
from edgeline.daemon.health import Metrics
from edgeline.daemon.messages import Message
from edgeline.daemon.processor import Processor
from edgeline.manifest import Window

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)


@pytest.fixture(scope="module")
def model(built_litert_bundle: Path) -> edgeline.Model:
    return edgeline.load(built_litert_bundle)


def processor(model: edgeline.Model, **options: object) -> Processor:
    metrics = Metrics(model=model.name, version=model.version)
    return Processor(model, get_codec("json"), metrics, publish="out/{name}/{device}", **options)  # type: ignore[arg-type]


def message(payload: object, device: str = "cam-1") -> Message:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return Message(topic=f"sensors/{device}/image", payload=data, device=device)


def image(seed: int = 0) -> list[float]:
    return np.random.default_rng(seed).random(64, dtype=np.float32).tolist()


@pytest.mark.quick
def test_a_good_message_gets_one_result_equal_to_predict(model: edgeline.Model) -> None:
    proc = processor(model)
    (answer,) = proc.process(message({"id": "m1", "data": image(1)}))
    assert not answer.is_error
    assert answer.topic == f"out/{model.name}/cam-1"
    record = json.loads(answer.payload)
    expected = model.predict(np.array(image(1), dtype=np.float32).reshape(1, 1, 8, 8))[0]
    np.testing.assert_allclose(np.array(record["outputs"][0]), expected, rtol=1e-6)
    assert (record["id"], record["device"], record["seq"], record["model"], record["version"]) == (
        "m1", "cam-1", 1, model.name, model.version,
    )  # fmt: skip
    assert record["class_index"] == int(np.argmax(expected))
    assert 0 < record["score"] <= 1
    assert record["latency_ms"] > 0 and record["timestamp"] > 0
    # the processor encodes its records unchecked (plain=True): the checked walk must find nothing to change
    assert answer.payload == get_codec("json").encode(answer.record)


BAD = [
    (b"{not json", "malformed"),
    ({"id": "x"}, "missing-input"),
    ({"id": "x", "data": [1.0, 2.0]}, "wrong-shape"),
    ({"id": "x", "data": ["a"] * 64}, "wrong-dtype"),
    (b'{"id": "x", "data": [NaN' + b", 0.5" * 63 + b"]}", "non-finite"),
    (b'{"id": "x", "data": [' + b"1e999," * 63 + b"1]}", "non-finite"),
]


@pytest.mark.quick
@pytest.mark.parametrize(("payload", "code"), BAD)
def test_bad_input_gets_one_coded_error_and_nothing_else_is_lost(
    model: edgeline.Model, payload: object, code: str
) -> None:
    proc = processor(model)
    (first,) = proc.process(message({"id": "before", "data": image(2)}))
    (error,) = proc.process(message(payload))
    (after,) = proc.process(message({"id": "after", "data": image(3)}))
    assert error.is_error
    record = json.loads(error.payload)
    assert record["error"]["code"] == code
    assert record["error"]["message"]
    assert record["seq"] == 2 and record["device"] == "cam-1"
    assert not first.is_error and not after.is_error
    assert json.loads(after.payload)["seq"] == 3
    for answer in (first, error, after):
        assert answer.payload == get_codec("json").encode(answer.record)
    status = proc.metrics.snapshot()
    assert status["errors"] == {code: 1}
    assert status["counts"]["results"] == 2


@pytest.mark.quick
def test_oversized_is_refused_before_decoding(model: edgeline.Model) -> None:
    proc = processor(model, max_payload_bytes=100)
    (error,) = proc.process(message(b"\xff" * 101))  # not even JSON: the size check comes first
    assert json.loads(error.payload)["error"]["code"] == "oversized"


@pytest.mark.quick
def test_errors_are_mirrored_to_the_error_topic(model: edgeline.Model) -> None:
    proc = processor(model, error_topic="errors/{device}")
    answers = proc.process(message(b"[]"))
    assert [a.topic for a in answers] == [f"out/{model.name}/cam-1", "errors/cam-1"]
    assert all(a.is_error for a in answers)


@pytest.mark.quick
def test_an_answer_carries_only_a_code_of_the_one_list(model: edgeline.Model) -> None:
    """``refuse`` takes its code as text from the daemon's threads; a code outside ``PAYLOAD_CODES`` is a bug of
    ours, raised, never an answer with a code no reader knows."""
    worker = processor(model)
    assert worker.refuse(message({"id": "a"}), "dropped", "queue full")[0].record["error"]["code"] == "dropped"
    with pytest.raises(ValueError, match="unknown error code 'queue-full'"):
        worker.refuse(message({"id": "b"}), "queue-full", "queue full")


@pytest.mark.quick
def test_windows_per_device(model: edgeline.Model) -> None:
    """An (8 rows x 8 channels) window over streamed rows, hop 4: rows from two devices never mix."""
    proc = processor(model, window=Window(size=8, hop=4, channels=8))
    rows = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 128.0
    results: dict[str, list[dict]] = {"a": [], "b": []}
    for start in range(0, 16, 4):
        for device in ("a", "b"):
            chunk = rows[start : start + 4] if device == "a" else rows[start : start + 4][::-1]
            answers = proc.process(message({"data": chunk.tolist()}, device=device))
            results[device] += [json.loads(a.payload) for a in answers]
    assert len(results["a"]) == len(results["b"]) == 3  # windows at rows 0, 4, 8 of 16
    for index, record in enumerate(results["a"]):
        expected = model.predict(rows[index * 4 : index * 4 + 8].reshape(1, 1, 8, 8))[0]
        np.testing.assert_allclose(np.array(record["outputs"][0]), expected, rtol=1e-6)
        assert record["window"] == 0  # the first (and only) window this message completed


@pytest.mark.quick
def test_windows_per_device_and_stream(model: edgeline.Model) -> None:
    """A board's two streams (the framed serial source sets ``Message.stream``) are windowed apart, like two
    devices: rows of one never complete a window of the other."""
    proc = processor(model, window=Window(size=8, hop=4, channels=8))
    rows = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 128.0
    counts = {"left": 0, "right": 0}
    for start in range(0, 16, 4):
        for stream in counts:
            chunk = rows[start : start + 4] if stream == "left" else rows[start : start + 4][::-1]
            payload = json.dumps({"data": chunk.tolist()}).encode()
            answers = proc.process(Message(topic=f"sensors/b/{stream}", payload=payload, device="b", stream=stream))
            for answer in answers:
                record = json.loads(answer.payload)
                if stream == "left":
                    first = (start - 4) if start >= 4 else 0
                    expected = model.predict(rows[first : first + 8].reshape(1, 1, 8, 8))[0]
                    np.testing.assert_allclose(np.array(record["outputs"][0]), expected, rtol=1e-6)
            counts[stream] += len(answers)
    assert counts == {"left": 3, "right": 3}  # each stream alone: windows at rows 0, 4, 8 of its 16


@pytest.mark.export
@pytest.mark.workstation  # needs a bundle only the export extra can make
def test_a_runtime_failure_is_answered_inference_failed_and_the_stream_goes_on(lookup_bundle: Path) -> None:
    lookup = edgeline.load(lookup_bundle)
    worker = processor(lookup)
    indices = [[1.0, 2.0, 3.0], [1.0, 2.0, 300.0], [7.0, 0.0, 5.0]]  # 300: past the table, only the runtime knows
    answers = [worker.process(message({"id": f"m{i}", "data": x})) for i, x in enumerate(indices)]
    assert [len(a) for a in answers] == [1, 1, 1]
    failed = answers[1][0].record
    assert (failed["id"], failed["seq"], failed["error"]["code"]) == ("m1", 2, "inference-failed")
    assert "index out of bounds" in failed["error"]["message"]
    for answer, x in zip((answers[0][0], answers[2][0]), (indices[0], indices[2]), strict=True):
        expected = lookup.predict(np.array(x, np.float32).reshape(1, 1, 3))[0]
        np.testing.assert_array_equal(answer.record["outputs"][0], expected.tolist())
    assert worker.metrics.snapshot()["errors"] == {"inference-failed": 1}
