"""Batched inference: allowed only when the runtime can resize the model and the resized model gives the
single-sample outputs on golden.npz; then full batches of queued inputs run in one call, each input still gets
its own answer, and a bad input in a batch costs only its own answer."""

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
from edgeline.errors import PayloadError


def images(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((1, 3, 8, 8), dtype=np.float32) for _ in range(count)]


@pytest.mark.quick
def test_a_graph_fixed_to_batch_1_runs_one_sample_per_call(built_litert_bundle: Path) -> None:
    model = edgeline.load(built_litert_bundle)  # conv -> flatten(1): a reshape to [1, 256] in the graph
    assert model.enable_batching(16) == 1
    assert "fixed to a batch of 1" in model.batching


@pytest.mark.export
def test_batching_off_when_asked_for_one(batchable_bundle: Path) -> None:
    model = edgeline.load(batchable_bundle)
    assert model.enable_batching(1) == 1 and model.batching == "off"


@pytest.mark.export
def test_batches_give_the_single_sample_outputs(batchable_bundle: Path) -> None:
    model = edgeline.load(batchable_bundle)
    assert model.enable_batching(8) == 8, model.batching
    samples = images(8, seed=1)
    for sample, answer in zip(samples, model.predict_batch([[x] for x in samples]), strict=True):
        assert not isinstance(answer, PayloadError)
        np.testing.assert_array_equal(answer[0], model.predict(sample)[0])
    partial = samples[:3]  # fewer than the batch: the spare rows are never read
    for sample, answer in zip(partial, model.predict_batch([[x] for x in partial]), strict=True):
        assert not isinstance(answer, PayloadError)
        np.testing.assert_array_equal(answer[0], model.predict(sample)[0])


@pytest.mark.export
def test_a_bad_sample_costs_only_its_own_answer(batchable_bundle: Path) -> None:
    model = edgeline.load(batchable_bundle)
    model.enable_batching(4)
    samples = images(4, seed=2)
    poisoned = samples[1].copy()
    poisoned[0, 2, 3, 3] = np.nan
    answers = model.predict_batch([[samples[0]], [poisoned], [np.zeros(5, np.float32)], [samples[3]]])
    assert isinstance(answers[1], PayloadError) and answers[1].code == "non-finite"
    assert isinstance(answers[2], PayloadError) and answers[2].code == "wrong-shape"
    for index in (0, 3):
        answer = answers[index]
        assert not isinstance(answer, PayloadError)
        np.testing.assert_array_equal(answer[0], model.predict(samples[index])[0])


@pytest.mark.export
def test_the_processor_batches_full_batches_and_answers_every_message_in_order(batchable_bundle: Path) -> None:
    model = edgeline.load(batchable_bundle)
    model.enable_batching(4)
    processor = Processor(model, get_codec("json"), Metrics(model="pooled", version=1), publish="r/{device}")
    samples = images(10, seed=3)
    payloads = [json.dumps({"id": f"m{i}", "data": x.ravel().tolist()}).encode() for i, x in enumerate(samples)]
    payloads.insert(2, b"{broken")
    answers = processor.process_batch([Message(topic="s/cam", payload=p, device="cam") for p in payloads])
    assert [len(a) for a in answers] == [1] * 11
    records = [a[0].record for a in answers]
    assert [r["seq"] for r in records] == list(range(1, 12))
    assert records[2]["error"]["code"] == "malformed"
    results = [r for r in records if "error" not in r]
    assert [r["id"] for r in results] == [f"m{i}" for i in range(10)]
    assert [r.get("batch", 1) for r in results] == [4] * 8 + [1] * 2  # two full batches, then one by one
    for record, sample in zip(results, samples, strict=True):
        np.testing.assert_array_equal(record["outputs"][0], model.predict(sample)[0].tolist())
