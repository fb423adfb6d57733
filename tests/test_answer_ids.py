"""The ``id`` of every answer: the input's own whenever it can be read, even from a payload that cannot be decoded,
and never longer than ``MAX_ID_CHARS``. Driven through ``Processor.process``, as the daemon drives it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import cbor2
import msgpack
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import edgeline
from edgeline.daemon import salvage
from edgeline.daemon.codecs import MAX_ID_CHARS, get_codec
from edgeline.daemon.health import Metrics
from edgeline.daemon.messages import Message
from edgeline.daemon.processor import Processor
from edgeline.daemon.salvage import SALVAGE_STEPS, readable_id

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

DIGITS_400 = "9" * 400
NESTED_10K = "[" * 10_000 + "1" + "]" * 10_000
# The data of a payload no JSON parser takes whole; each keeps its input's id, before or after it.
UNREADABLE = [
    pytest.param(json.dumps([math.nan, 1.0]), "non-finite", id="NaN"),  # Python's json.dumps writes NaN
    pytest.param(json.dumps([math.inf]), "non-finite", id="Infinity"),
    pytest.param(json.dumps([1.0, -math.inf]), "non-finite", id="-Infinity"),
    pytest.param("[1e400]", "non-finite", id="1e400"),
    pytest.param(f"[{DIGITS_400}]", "non-finite", id="400-digit-integer"),
    pytest.param(f"[-{DIGITS_400}, 1]", "non-finite", id="-400-digit-integer"),
    pytest.param(NESTED_10K, "malformed", id="10000-levels"),
    pytest.param('{"a": ' * 10_000 + "1" + "}" * 10_000, "malformed", id="10000-levels-of-maps"),
]


@pytest.fixture(scope="module")
def model(built_litert_bundle: Path) -> edgeline.Model:
    return edgeline.load(built_litert_bundle)


def processor(model: edgeline.Model, codec: str = "json") -> Processor:
    metrics = Metrics(model=model.name, version=model.version)
    return Processor(model, get_codec(codec), metrics, publish="out/{name}/{device}")


def answer(proc: Processor, payload: bytes) -> dict[str, Any]:
    """The record of the one answer of ``payload``."""
    (only,) = proc.process(Message(topic="sensors/cam-1/image", payload=payload, device="cam-1"))
    assert only.payload == proc.result_codec.encode(only.record)
    return only.record


def image() -> list[float]:
    return np.random.default_rng(0).random(64, dtype=np.float32).tolist()


class SalvageSteps:
    """Every regular-expression match the salvage makes (its steps: each one scan at C speed), by pattern."""

    def __init__(self) -> None:
        self.by_pattern: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_pattern.values())

    def counting(self, name: str, pattern: re.Pattern[bytes]) -> Any:
        steps = self

        class Counting:
            def match(self, *args: Any) -> re.Match[bytes] | None:
                steps.by_pattern[name] = steps.by_pattern.get(name, 0) + 1
                return pattern.match(*args)

        return Counting()


def count_salvage_steps(monkeypatch: pytest.MonkeyPatch) -> SalvageSteps:
    """Count the salvage's steps from now on: its module's patterns, each wrapped in a counter."""
    steps, wrapped = SalvageSteps(), []
    for name, value in list(vars(salvage).items()):
        if isinstance(value, re.Pattern):
            monkeypatch.setattr(salvage, name, steps.counting(name, value))
            wrapped.append(name)
    assert {"_INSIDE", "_STRING", "_SCALAR"} <= set(wrapped), wrapped  # what the salvage steps with
    return steps


@pytest.mark.parametrize(("data", "code"), UNREADABLE)
@pytest.mark.parametrize("ident", ["a1", 42, -(2**63), 2**64 - 1], ids=["text", "int", "int64-min", "uint64-max"])
@pytest.mark.parametrize("id_first", [True, False], ids=["id-first", "id-last"])
def test_an_unreadable_payload_is_answered_with_its_own_id(
    model: edgeline.Model, data: str, code: str, ident: str | int, id_first: bool
) -> None:
    members = [f'"id": {json.dumps(ident)}', f'"data": {data}']
    payload = ("{" + ", ".join(members if id_first else members[::-1]) + "}").encode()
    record = answer(processor(model), payload)
    assert record["error"]["code"] == code
    assert record["id"] == str(ident)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"id": "a6", "data": [1.0, 2.0',  # cut short
        b'{"id": "a6", "data": [1.0, 2.0]]}',
        b'{"id": "a6", "data": [1.0, 2.0], }',
        b'{"id": "a6", "data": [1.0 2.0]}',
        b'{"id": "a6", "data": [1.0, 2.0]} trailing',
        b'{"id": "a6", "id": "a6", "data": [NaN]}',  # a key given twice: the last counts, as in a valid message
        b'{"id": "other", "data": [1e999], "id": "a6"}',
    ],
)
def test_json_that_breaks_after_the_id_keeps_it(model: edgeline.Model, payload: bytes) -> None:
    record = answer(processor(model), payload)
    assert record["error"]["code"] in {"malformed", "non-finite"}
    assert record["id"] == "a6"


@pytest.mark.parametrize(
    "payload",
    [
        b'{"id": "a7", "data": [1.0, 2.0]}',  # valid JSON, the wrong shape
        b'{"id": "a7", "data": [NaN, 1.0]}',
        b'{"id": "a7", "data": ' + NESTED_10K.encode() + b"}",
    ],
)
def test_an_integer_id_beyond_int64_but_within_uint64_is_kept_in_errors(model: edgeline.Model, payload: bytes) -> None:
    """Valid answers take ids up to 2**64 - 1; error answers used to stop at 2**63 - 1."""
    record = answer(processor(model), payload.replace(b'"a7"', str(2**64 - 1).encode()))
    assert record["id"] == str(2**64 - 1)


@pytest.mark.parametrize(
    ("payload", "most_steps"),
    [
        (b'{"id": "whole", "data": ' + b"[" * 1_000_000 + b"}", 32),
        (b'{"data": ' + b"[" * 500_000 + b"]" * 500_000 + b', "id": "whole"}', 32),
        (b'{"id": "whole", "data": ' + b'[0, "' * 200_000 + b"}", SALVAGE_STEPS + 32),  # a token per string
    ],
    ids=["1MB-open", "1MB-balanced-id-last", "1MB-strings"],
)
def test_a_megabyte_of_nesting_is_answered_in_bounded_steps_with_its_id(
    model: edgeline.Model, payload: bytes, most_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step is one scan at C speed and a run of brackets is one token whatever its depth: a megabyte of
    nesting costs a few steps, one of strings at most ``SALVAGE_STEPS`` (nothing recurses, nothing goes level by
    level). Counted in steps, not timed: a busy machine cannot fail it, a step per level would."""
    steps = count_salvage_steps(monkeypatch)
    record = answer(processor(model), payload)
    assert record["error"]["code"] == "malformed"
    assert record["id"] == "whole"
    assert 0 < steps.total <= most_steps, steps.by_pattern


def test_the_salvage_reads_a_bounded_number_of_tokens(model: edgeline.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """An id behind a megabyte of alternating nesting costs too many steps to find: the salvage gives up after
    ``SALVAGE_STEPS`` tokens (counted, not timed) and the answer goes out under ``DEVICE-SEQ``."""
    payload = b'{"data": ' + b"[0," * 300_000 + b' "id": "far"}'
    steps = count_salvage_steps(monkeypatch)
    record = answer(processor(model), payload)
    assert (record["error"]["code"], record["id"]) == ("malformed", "cam-1-1")
    # As far as allowed, no further: one step went to the member "data", the rest to tokens inside its value.
    assert steps.by_pattern["_INSIDE"] == SALVAGE_STEPS - 1, steps.by_pattern
    assert steps.total <= SALVAGE_STEPS + 16, steps.by_pattern


@pytest.mark.parametrize("codec", ["cbor", "msgpack"])
def test_binary_payloads_too_deep_or_with_bytes_after_them_keep_their_id(model: edgeline.Model, codec: str) -> None:
    proc = processor(model, codec)
    if codec == "cbor":
        deep = b"\xa2" + cbor2.dumps("id") + cbor2.dumps("b1") + cbor2.dumps("data") + b"\x81" * 10_000 + b"\x01"
        extra = cbor2.dumps({"id": "b1", "data": image()}) + b"\x00"
    else:
        deep = b"\x82" + msgpack.packb("id") + msgpack.packb("b1") + msgpack.packb("data") + b"\x91" * 10_000 + b"\x01"
        extra = msgpack.packb({"id": "b1", "data": image()}) + b"\x00"
    for payload in (deep, extra):
        record = answer(proc, payload)
        assert (record["error"]["code"], record["id"]) == ("malformed", "b1")


# ---------------------------------------------------------------------------------------------------------------------
# one length cap for every answer


@pytest.mark.parametrize("codec", ["json", "cbor", "msgpack"])
def test_an_id_of_the_cap_is_echoed_whole_in_a_result(model: edgeline.Model, codec: str) -> None:
    ident = "r" * MAX_ID_CHARS
    record = answer(processor(model, codec), get_codec(codec).encode({"id": ident, "data": image()}))
    assert "error" not in record
    assert record["id"] == ident


@pytest.mark.parametrize("codec", ["json", "cbor", "msgpack"])
@pytest.mark.parametrize("length", [MAX_ID_CHARS + 1, 900_000])
def test_an_id_over_the_cap_is_refused_under_its_cut_id(model: edgeline.Model, codec: str, length: int) -> None:
    ident = "x" * (length - 1) + "é"
    only = processor(model, codec).process(
        Message(topic="t", payload=get_codec(codec).encode({"id": ident, "data": image()}), device="cam-1")
    )
    (record,) = [a.record for a in only]
    assert record["error"]["code"] == "invalid-input"
    assert f"{length}" in record["error"]["message"] and f"{MAX_ID_CHARS}" in record["error"]["message"]
    assert record["id"] == ident[:MAX_ID_CHARS]
    assert len(only[0].payload) < 2 * MAX_ID_CHARS + 1000


def test_an_error_answer_cuts_an_over_long_id_at_the_same_cap(model: edgeline.Model) -> None:
    ident = "y" * 900_000
    payload = json.dumps({"id": ident, "data": [math.nan, 1.0]}).encode()
    record = answer(processor(model), payload)
    assert (record["error"]["code"], record["id"]) == ("non-finite", ident[:MAX_ID_CHARS])


# ---------------------------------------------------------------------------------------------------------------------
# properties

ids = st.text(max_size=MAX_ID_CHARS + 8) | st.integers(-(2**63), 2**64 - 1) | st.just("z" * (MAX_ID_CHARS + 1))
JSONISH = "[]{},: \n0123456789.eE+-NaIfinyl\"\\'"


@settings(deadline=None, max_examples=300)
@given(ident=ids, tail=st.text(alphabet=JSONISH, max_size=40))
@example(ident="a5", tail=NESTED_10K)
@example(ident=7, tail="[NaN]}")
@example(ident="q", tail='"open')
def test_whatever_follows_the_id_the_answer_carries_it(model: edgeline.Model, ident: str | int, tail: str) -> None:
    assume('"id"' not in tail)  # no second id member for the parse to prefer
    payload = f'{{"id": {json.dumps(ident)}, "data": {tail}'.encode()
    record = answer(processor(model), payload)
    assert record["id"] == str(ident)[:MAX_ID_CHARS]


@pytest.mark.parametrize("codec", ["json", "cbor", "msgpack", "raw"])
@settings(deadline=None, max_examples=300)
@given(
    payload=st.binary(max_size=64) | st.text(alphabet=JSONISH, max_size=64).map(lambda s: ('{"id": 1, ' + s).encode())
)
def test_readable_id_never_raises_and_keeps_to_the_cap(codec: str, payload: bytes) -> None:
    found = readable_id(payload, codec)
    assert found is None or (isinstance(found, str) and len(found) <= MAX_ID_CHARS)
