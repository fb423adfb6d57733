"""Hostile input: every payload decoder, the line framing and record parsing of file sources, and the bundle reader,
fed garbage. Whatever a sensor sends, a recording holds or a copied bundle contains, the answer is a result or an
``EdgelineError`` with a message (a ``PayloadError`` with a code for payloads): never another exception, never a
dead process.

The codes for each kind of bad payload are pinned in test_codecs.py and the record forms in test_sources.py; here
are the properties over several model shapes, the exact framing invariant, and corrupted copies of a real bundle.

A signed but malformed model is loaded in a worker process of its own, since LiteRT's interpreter does not validate
the flatbuffer and may crash natively. A worker that dies (a signal, a non-zero exit, no answer) fails the test: the
only answers accepted are a clean refusal (an ``EdgelineError`` with a message) or a clean run. The one known crash
is pinned by the ``xfail`` test at the end.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import cbor2
import msgpack
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.strategies import SearchStrategy

import edgeline
from edgeline.bundle import MANIFEST_FILE, read_bundle
from edgeline.daemon.codecs import CODECS, Decoded, get_codec
from edgeline.daemon.sources import LineFramer, parse_record
from edgeline.daemon.topics import TopicFilter
from edgeline.errors import DAEMON_CODES, PAYLOAD_CODES, BundleError, EdgelineError, IntegrityError, PayloadError
from edgeline.manifest import Quantization, TensorSpec, Window
from edgeline.quantization import dequantize
from edgeline.samples import read_npz

pytestmark = [
    pytest.mark.quick,
    pytest.mark.device,
]  # the device tier runs these (scripts/test_device.sh): what a device decodes and loads

REPO = Path(__file__).resolve().parents[1]
HOSTILE = settings(deadline=None, max_examples=120, suppress_health_check=[HealthCheck.too_slow])
# What a decoder may answer: the size limit is checked by the caller, the last two are the daemon's own.
DECODE_CODES = set(PAYLOAD_CODES) - {"oversized", *DAEMON_CODES}
MAP_CODECS = ("json", "cbor", "msgpack")


# ---------------------------------------------------------------------------------------------------------------------
# models: specs (and a window) as a manifest gives them to the codecs

Q8 = Quantization(scale=0.05, zero_point=-3)
QU8 = Quantization(scale=0.5, zero_point=128)
MODELS: dict[str, tuple[tuple[TensorSpec, ...], Window | None]] = {
    "float32": ((TensorSpec(name="signal", dtype="float32", shape=(1, 3)),), None),
    "int8": ((TensorSpec(name="image", dtype="int8", shape=(1, 2, 2), quantization=Q8),), None),
    "uint8-named-data": ((TensorSpec(name="data", dtype="uint8", shape=(1, 5), quantization=QU8),), None),
    "two-inputs": (
        (
            TensorSpec(name="a", dtype="float32", shape=(1, 2)),
            TensorSpec(name="b", dtype="int8", shape=(2, 1, 2), quantization=Q8),
        ),
        None,
    ),
    "mixed": (
        (
            TensorSpec(name="half", dtype="float16", shape=(1, 2)),
            TensorSpec(name="flag", dtype="bool", shape=(1, 3)),
            TensorSpec(name="count", dtype="int32", shape=(2,)),
        ),
        None,
    ),
    "window-1": ((TensorSpec(name="x", dtype="float32", shape=(1, 4, 1)),), Window(size=4, hop=2, channels=1)),
    "window-3-int8": (
        (TensorSpec(name="accel", dtype="int8", shape=(1, 6, 3), quantization=Q8),),
        Window(size=6, hop=3, channels=3),
    ),
}
models = st.sampled_from(sorted(MODELS))


def decode_or_refuse(codec: str, payload: bytes, model: str) -> Decoded | PayloadError:
    """The decoder's answer, checked: arrays shaped like the specs (or the window), float32 and finite; or a
    PayloadError with a decoding code and a message. Any other exception fails the test."""
    specs, window = MODELS[model]
    try:
        decoded = get_codec(codec).decode(payload, specs, window=window)
    except PayloadError as error:
        assert error.code in DECODE_CODES, f"code {error.code!r} for {payload[:60]!r}"
        assert str(error).strip()
        return error
    assert decoded.id is None or isinstance(decoded.id, str)
    if window is None:
        assert [a.shape for a in decoded.arrays] == [spec.shape for spec in specs]
    else:
        (samples,) = decoded.arrays
        assert samples.ndim == 2 and samples.shape[0] >= 1 and samples.shape[1] == window.channels
    for array in decoded.arrays:
        assert array.dtype == np.float32
        assert np.isfinite(array).all()
    return decoded


# ---------------------------------------------------------------------------------------------------------------------
# valid payloads (round-trips, and the seeds that hostile mutations start from)

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
ids = st.one_of(st.none(), st.text(max_size=8), st.integers(-(2**63), 2**64 - 1))
clean_values = st.recursive(  # what every format carries as is: for the fields a model does not read
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)  # fmt: skip


def pack(codec: str, message: Any) -> bytes:
    if codec == "json":
        return json.dumps(message).encode()
    if codec == "cbor":
        return cbor2.dumps(message)
    packed: bytes = msgpack.packb(message, use_bin_type=True)
    return packed


def field_names(specs: tuple[TensorSpec, ...], draw: st.DrawFn) -> list[str]:
    if len(specs) == 1:
        return [draw(st.sampled_from(sorted({"data", specs[0].name})))]
    return [spec.name for spec in specs]


def map_form(codec: str, array: np.ndarray, window: Window | None, draw: st.DrawFn) -> Any:
    """The same values as a flat list, a nested list or (cbor, msgpack) a byte string of float32."""
    forms = ["flat", "nested"] + (["bytes"] if codec != "json" else [])
    form = draw(st.sampled_from(forms))
    if form == "bytes":
        return array.astype("<f4").tobytes()
    if form == "flat":
        return array.ravel().tolist()
    if window is None:
        return array.reshape(draw(st.sampled_from([array.shape, (-1, array.shape[-1]), (1, -1)]))).tolist()
    return array.reshape(draw(st.sampled_from([array.shape, (1, *array.shape)]))).tolist()


@st.composite
def valid_payloads(draw: st.DrawFn, codec: str, model: str) -> tuple[bytes, list[np.ndarray], str | None]:
    """A payload the codec must accept, with the arrays and id it must decode to."""
    specs, window = MODELS[model]
    if codec == "raw":
        return draw(raw_payloads(model))
    if window is not None:
        steps = draw(st.integers(1, 5))
        arrays = [draw(hnp.arrays(np.float32, (steps, window.channels), elements=finite32))]
    else:
        arrays = [draw(hnp.arrays(np.float32, spec.shape, elements=finite32)) for spec in specs]
    message: dict[str, Any] = {}
    for name, array in zip(field_names(specs, draw), arrays, strict=False):
        message[name] = map_form(codec, array, window, draw)
    ident = draw(ids)
    if ident is not None or draw(st.booleans()):
        message["id"] = ident
    taken = {"data", "id", *(spec.name for spec in specs)}
    extras = draw(st.dictionaries(st.text(max_size=6).filter(lambda k: k not in taken), clean_values, max_size=3))
    items = list({**message, **extras}.items())
    order = draw(st.permutations(range(len(items))))
    payload = pack(codec, dict(items[i] for i in order))
    expected = arrays if window is not None else [a.reshape(s.shape) for a, s in zip(arrays, specs, strict=True)]
    return payload, expected, None if ident is None else str(ident)


@st.composite
def raw_payloads(draw: st.DrawFn, model: str) -> tuple[bytes, list[np.ndarray], None]:
    specs, window = MODELS[model]
    if window is not None:
        samples = draw(hnp.arrays(np.float32, (draw(st.integers(1, 5)), window.channels), elements=finite32))
        return samples.astype("<f4").tobytes(), [samples], None
    payload, expected = b"", []
    for spec in specs:
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        if dtype.kind == "f":
            width: Literal[16, 32, 64] = 32 if dtype.itemsize == 4 else 64 if dtype.itemsize == 8 else 16
            elements = st.floats(width=width, allow_nan=False, allow_infinity=False)
            values = draw(hnp.arrays(dtype, spec.shape, elements=elements))
        else:
            values = draw(hnp.arrays(dtype, spec.shape))
        payload += values.tobytes()
        quantized = spec.quantization is not None and dtype.kind in "iu"
        expected.append(
            dequantize(values, spec.quantization)
            if spec.quantization is not None and quantized
            else values.astype(np.float32)
        )
    return payload, expected, None


@pytest.mark.parametrize("codec", sorted(CODECS))
@HOSTILE
@given(data=st.data())
def test_a_valid_payload_round_trips_for_every_model(codec: str, data: st.DataObject) -> None:
    model = data.draw(models)
    payload, expected, ident = data.draw(valid_payloads(codec, model))
    decoded = decode_or_refuse(codec, payload, model)
    assert isinstance(decoded, Decoded), f"refused a valid payload: {decoded}"
    assert decoded.id == ident
    assert len(decoded.arrays) == len(expected)
    for got, want in zip(decoded.arrays, expected, strict=True):
        np.testing.assert_array_equal(got, want.astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------------
# arbitrary and mutated bytes


@st.composite
def mutated(draw: st.DrawFn, payload: bytes) -> bytes:
    """``payload`` with one to four edits: a flipped byte, bytes inserted, a slice deleted or repeated, a cut."""
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "repeat", "truncate"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "set" and at < len(data):
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x1B, 0x5B, 0x9F, 0xDD, 0xFB]))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=9))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif kind == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
        else:
            del data[at:]
    return bytes(data)


@pytest.mark.parametrize("codec", sorted(CODECS))
@settings(deadline=None, max_examples=200)
@given(data=st.data())
def test_arbitrary_or_mutated_bytes_decode_or_raise_a_payload_error(codec: str, data: st.DataObject) -> None:
    model = data.draw(models)
    if data.draw(st.booleans()):
        payload = data.draw(st.binary(max_size=300))
    else:
        valid, _, _ = data.draw(valid_payloads(codec, model))
        payload = data.draw(mutated(valid))
    decode_or_refuse(codec, payload, model)


# ---------------------------------------------------------------------------------------------------------------------
# structured but wrong: valid JSON, CBOR and MessagePack maps with the wrong things in them

HUGE_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, 10**400, -(10**400)]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 3.5e38, -3.5e38, 1e-45, 5e-324, -0.0, 1.7976931348623157e308]
numbers = st.one_of(st.integers(), st.sampled_from(HUGE_INTS), st.floats(), st.sampled_from(ODD_FLOATS))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=6), st.binary(max_size=12))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=20,
)


def nest(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def near_inputs(draw: st.DrawFn, model: str) -> Any:
    """Almost an input: the right count (or one off) in a nesting that may not fit, with perhaps one bad value."""
    specs, window = MODELS[model]
    spec = draw(st.sampled_from(specs))
    count = window.channels * draw(st.integers(1, 4)) if window else spec.size
    count = max(0, count + draw(st.sampled_from([0, 0, 0, -1, 1])))
    values: list[Any] = draw(st.lists(numbers, min_size=count, max_size=count))
    spoil: bool = draw(st.booleans())
    if values and spoil:
        odd: SearchStrategy[Any] = scalars | st.lists(numbers, max_size=2)
        values[draw(st.integers(0, len(values) - 1))] = draw(odd)
    array: Any = values
    if len(values) > 1 and draw(st.booleans()):
        divisors = [d for d in range(1, len(values) + 1) if len(values) % d == 0]
        width = draw(st.sampled_from(divisors))
        array = [values[i : i + width] for i in range(0, len(values), width)]
    return nest(array, draw(st.integers(0, 3)))


@st.composite
def field_values(draw: st.DrawFn, model: str) -> Any:
    return draw(
        st.one_of(
            json_values,
            near_inputs(model),
            st.builds(nest, numbers | st.lists(numbers, max_size=3), st.integers(0, 45)),  # random depth
            hnp.arrays(np.float32, st.integers(0, 9), elements=st.floats(width=32)).map(lambda a: a.tobytes()),
        )
    )


@st.composite
def hostile_messages(draw: st.DrawFn, model: str) -> dict[str, Any]:
    specs, _ = MODELS[model]
    names = sorted({"data", "id", *(spec.name for spec in specs)})
    keys = draw(st.lists(st.sampled_from(names) | st.text(max_size=5), max_size=5, unique=True))
    message = {key: draw(field_values(model)) for key in keys}
    if draw(st.booleans()):
        message["id"] = draw(json_values)  # ids of every type
    return message


def msgpack_safe(value: Any) -> Any:
    """MessagePack has no integers beyond 64 bits: send those as the float they are closest to."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value) if abs(value) < 2**1023 else (math.inf if value > 0 else -math.inf)
    if isinstance(value, list):
        return [msgpack_safe(item) for item in value]
    if isinstance(value, dict):
        return {key: msgpack_safe(item) for key, item in value.items()}
    return value


def pack_hostile(codec: str, message: dict[str, Any]) -> bytes:
    if codec == "json":  # Python's json writes NaN and Infinity, and huge integers in full
        return json.dumps(message, default=list).encode()
    if codec == "msgpack":
        return pack(codec, msgpack_safe(message))
    return pack(codec, message)


@pytest.mark.parametrize("codec", MAP_CODECS)
@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_maps_with_the_wrong_things_in_them_decode_or_raise_a_payload_error(codec: str, data: st.DataObject) -> None:
    model = data.draw(models)
    decode_or_refuse(codec, pack_hostile(codec, data.draw(hostile_messages(model))), model)


def cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, value)
    raise ValueError(value)


def cbor_tag(tag: int, body: bytes) -> bytes:
    return cbor_head(6, tag) + body


def cbor_data(body: bytes) -> bytes:
    return cbor_head(5, 1) + cbor2.dumps("data") + body


def shared_nesting(depth: int, fanout: int, leaf: list[float]) -> bytes:
    """A list nested ``depth`` deep whose every level holds the level below ``fanout`` times, all but once by
    reference (CBOR tags 28 and 29): ``fanout ** (depth - 1) * len(leaf)`` values from a few bytes per level."""
    body = cbor_tag(28, cbor2.dumps(leaf))  # shared values are numbered in the order they start: outermost is 0
    for level in range(depth - 2, -1, -1):
        refs = [cbor_tag(29, cbor_head(0, level + 1))] * (fanout - 1)
        body = cbor_tag(28, cbor_head(4, fanout) + body + b"".join(refs))
    return cbor_data(body)


# Found by this test: 165 bytes decoded into 16.7 million values (2 s); depth 31 asked for 2**31 (memory).
@settings(deadline=None, max_examples=60)
@given(depth=st.integers(1, 40), fanout=st.integers(1, 4), leaf=st.lists(finite32, min_size=1, max_size=3))
@example(depth=31, fanout=2, leaf=[1.0])
@example(depth=40, fanout=4, leaf=[1.0, 2.0, 3.0])
def test_cbor_lists_repeated_by_reference_cannot_multiply_the_values(
    depth: int, fanout: int, leaf: list[float]
) -> None:
    payload = shared_nesting(depth, fanout, leaf)
    values = fanout ** (depth - 1) * len(leaf)
    for model in ("window-1", "float32"):
        answer = decode_or_refuse("cbor", payload, model)
        if values > len(payload):
            assert isinstance(answer, PayloadError) and answer.code == "malformed"


def test_a_cbor_list_holding_itself_is_malformed() -> None:
    payload = cbor_data(cbor_tag(28, cbor_head(4, 1) + cbor_tag(29, cbor_head(0, 0))))
    for model in [name for name, (specs, _) in MODELS.items() if len(specs) == 1]:  # they take "data"
        answer = decode_or_refuse("cbor", payload, model)
        assert isinstance(answer, PayloadError) and answer.code == "malformed"


DEEP = 100_000
NASTY: dict[str, list[bytes]] = {
    "json": [
        b'{"data": ' + b"[" * DEEP + b"1" + b"]" * DEEP + b"}",
        b'{"data": [1, 2, 3], "extra": ' + b"[" * DEEP + b"}",
        b'{"data": [1, 2, 3], "id": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        b'{"data": [1, ' + b"9" * 5000 + b", 3]}",
        b'{"data": [1, 1' + b"0" * 400 + b", 3]}",
        b'{"data": [1, 2, 3], "id": ' + b"9" * 5000 + b"}",
        b'{"data": [NaN, Infinity, -Infinity]}',
        b'\xef\xbb\xbf{"data": [1, 2, 3]}',
        '{"data": [1, 2, 3]}'.encode("utf-16"),
        b'{"data": [1, 2, 3], "id": "\\ud800"}',
        b'{"data": [1, 2, 3], "data": [4, 5, 6]}',
    ],
    "cbor": [
        cbor_data(cbor_head(4, 1) * DEEP + b"\x01"),
        cbor_data(b"\x9f" * DEEP),
        cbor_data(cbor_head(4, 2**63)),
        cbor_data(cbor_head(2, 2**62)),
        cbor_head(5, 2**40),
        cbor_data(cbor_tag(2, cbor2.dumps(b"\xff" * 5000))),
        cbor_data(cbor_tag(5, cbor_head(4, 2) + cbor2.dumps(2**62) + b"\x01")),
        cbor_data(cbor_tag(30, cbor_head(4, 2) + b"\x01\x00")),
        cbor_data(cbor_tag(1, cbor2.dumps(2**63 - 1))),
        cbor_data(cbor_tag(35, cbor2.dumps("("))),
        cbor_data(cbor_tag(29, cbor_head(0, 7))),
        cbor_data(cbor_tag(25, cbor_head(0, 3))),
        cbor_tag(55799, cbor_data(cbor2.dumps([1.0, 2.0, 3.0]))),
    ],
    "msgpack": [
        b"\x81\xa4data" + b"\x91" * DEEP + b"\x01",
        b"\x81\xa4data\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\x81\xa4data\xd7\xff" + b"\xff" * 8,
        b"\x81\xa4data\xc7\x01\x05a",
        b"\x81\x01\x02",
        b"\x81\xa4data\x93\xcf" + b"\xff" * 8 + b"\xd3\x80" + bytes(7) + b"\x01",
    ],
}


@pytest.mark.parametrize(("codec", "payload"), [(codec, p) for codec, ps in NASTY.items() for p in ps])
def test_nasty_payloads_decode_or_raise_a_payload_error(codec: str, payload: bytes) -> None:
    for model in MODELS:
        decode_or_refuse(codec, payload, model)


# ---------------------------------------------------------------------------------------------------------------------
# file sources: line framing and recorded records


def framed(framer: LineFramer, stream: bytes, cuts: list[int]) -> list[tuple[bytes, int]]:
    got: list[tuple[bytes, int]] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += framer.feed(stream[start:end])
        assert len(framer._buffer) <= framer.limit  # never holds more than a line's limit
    return got + list(framer.flush())


pieces = st.sampled_from([b"\n", b"\r", b"\r\n", b" ", b"\t", b"x", b"{}", b"\n\n", b"\r\r"]) | st.binary(max_size=12)


@settings(deadline=None, max_examples=300)
@given(
    stream=st.lists(pieces, max_size=40).map(b"".join),
    limit=st.integers(0, 24) | st.just(1 << 20),
    data=st.data(),
)
def test_line_framer_yields_every_non_blank_line_once_whatever_the_cuts(
    stream: bytes, limit: int, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    got = framed(LineFramer(limit), stream, cuts)
    # The stream is its newline-separated segments; each is a line (trailing \r removed), skipped as over-long
    # (reported with its length and no bytes), or blank (whitespace only: dropped).
    expected: list[tuple[bytes, int]] = []
    dropped = 0
    for segment in stream.split(b"\n"):
        line = segment.rstrip(b"\r")
        if len(segment) > limit:
            expected.append((b"", len(segment)))
        elif line.strip():
            expected.append((line, len(line)))
            dropped += len(segment) - len(line)
        else:
            dropped += len(segment)
    assert got == expected
    for line, size in got:
        if line:
            assert size == len(line) <= limit and b"\n" not in line and not line.endswith(b"\r")
        else:
            assert size > limit
    # Every byte is accounted for: in a reported line, a newline, a dropped \r or a blank line.
    assert sum(size for _, size in got) + stream.count(b"\n") + dropped == len(stream)


FILTERS = (TopicFilter("sensors/+/accel"), TopicFilter("plant/#"))
RECORD_KEYS = ["topic", "payload", "payload_base64", "device", "t"]
DEPTHS = [200, 254, 255, 256, 999, 1000, 1023, 1024, 1100]
topics = st.sampled_from(["sensors/p1/accel", "sensors//accel", "plant", "plant/a/b", "+", "#", "", "a\x00b", "é/€"])


@st.composite
def record_lines(draw: st.DrawFn) -> bytes:
    """A recorded line: a JSON map with some of the record keys holding anything, perhaps one nested very deep."""
    record: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(RECORD_KEYS), unique=True)):
        record[key] = draw(topics | json_values | st.text(alphabet="ABCDabcd0123+/=", max_size=12))
    deep = draw(st.none() | st.sampled_from(RECORD_KEYS))
    if deep is not None:
        record[deep] = "\x00DEEP\x00"
    text = json.dumps(record, default=list).encode()
    if deep is not None:
        depth = draw(st.sampled_from(DEPTHS))
        opening, closing = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        text = text.replace(json.dumps("\x00DEEP\x00").encode(), opening * depth + b"1" + closing * depth)
    return draw(st.sampled_from([b"", b" ", b"\t"])) + text


@settings(deadline=None, max_examples=300)
@given(
    line=st.binary(max_size=200)
    | record_lines()
    | st.tuples(topics, st.binary(max_size=20)).map(lambda tp: tp[0].encode() + b" " + tp[1])
)
@example(line=b'{"topic": "t", "payload": ' + b"[" * 300 + b"]" * 300 + b"}")  # found: orjson writes 254 levels
@example(line=b'{"topic": ' + b"[" * 1000 + b"]" * 1000 + b', "payload": 1}')  # found: str() of 1000 levels
def test_parse_record_never_raises(line: bytes) -> None:
    message, when = parse_record(line, FILTERS, "replay-device")
    assert isinstance(message.topic, str) and isinstance(message.device, str)
    assert isinstance(message.payload, bytes)
    assert when is None or isinstance(when, float)
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return
    recorded = isinstance(record, dict) and isinstance(record.get("topic"), str) and "payload" in record
    if recorded and "payload_base64" not in record and message.topic != "replay":
        assert message.topic == record["topic"]
        assert orjson.loads(message.payload) == record["payload"]  # the payload re-encoded, unchanged


# ---------------------------------------------------------------------------------------------------------------------
# the bundle reader: corrupted copies of a real exported bundle


def checked_load(bundle: Path, *, load: bool = True) -> object:
    """read_bundle (then load): a result, or a BundleError / EdgelineError with a message; nothing else."""
    try:
        verified = read_bundle(bundle)
    except BundleError as error:
        assert str(error).strip()
        return error
    root = bundle.resolve()
    assert all((bundle / entry.path).resolve().is_relative_to(root) for entry in verified.manifest.files)
    if not load:
        return verified
    try:
        return edgeline.load(bundle, threads=1)
    except EdgelineError as error:
        assert str(error).strip()
        return error


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile_bundles")


@contextlib.contextmanager
def bundle_copy(pristine: Path, scratch: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        yield Path(shutil.copytree(pristine, Path(tmp) / "bundle"))


def read_manifest_json(bundle: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((bundle / MANIFEST_FILE).read_text())
    return manifest


def sign(bundle: Path, relative: str) -> None:
    """Make the manifest agree with the file as it now is: a corrupt file that passes the integrity check."""
    manifest = read_manifest_json(bundle)
    data = (bundle / relative).read_bytes()
    for entry in manifest["files"]:
        if entry["path"] == relative:
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (bundle / MANIFEST_FILE).write_text(json.dumps(manifest))


RAW_JSON = [
    b"9" * 5000,
    b"-" + b"1" * 4400,
    b"1" + b"0" * 400,
    b"1e400",
    b"NaN",
    b"-Infinity",
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'"\\ud800"',
    b'"a\\u0000b"',
    b'"../../etc/passwd"',
    b'"/etc/passwd"',
]
MANIFEST_KEYS = ["path", "size", "sha256", "scale", "zero_point", "shape", "dtype", "name", "labels", "kind", "model"]
manifest_values = st.one_of(
    json_values,
    st.sampled_from(range(len(RAW_JSON))).map(lambda i: f"\x00RAW{i}\x00"),
    st.sampled_from(["model.tflite", "golden.npz", "", "float32", "int8", "litert", "classify", "anomaly"]),
    st.sampled_from([[], [1], [1, 10], [0], [-1], [10**30], [1, 1, 8, 8]]),
    st.dictionaries(st.sampled_from(MANIFEST_KEYS), json_values, max_size=3),
)


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, item in items:
        yield from json_paths(item, (*prefix, key))


def dumps_with_raw(manifest: Any) -> bytes:
    text = json.dumps(manifest, default=list).encode()
    for i, raw in enumerate(RAW_JSON):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00").encode(), raw)
    return text


@st.composite
def manifest_mutations(draw: st.DrawFn, manifest: dict[str, Any]) -> bytes:
    """The manifest with one to three values replaced, deleted or joined by an extra key, anywhere in it."""
    manifest = json.loads(json.dumps(manifest))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in json_paths(manifest) if p]
        path = draw(st.sampled_from(paths))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        # a copy: sampled_from hands out the same list object every time, which a later step could append to
        # itself (a cycle: RecursionError in json_paths) or change for the next example (Hypothesis: flaky)
        value = copy.deepcopy(draw(manifest_values))
        if action == "replace":
            parent[path[-1]] = value
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(MANIFEST_KEYS) | st.text(max_size=6))] = value
        else:
            parent.append(value)
    return dumps_with_raw(manifest)


@HOSTILE
@given(data=st.data())
def test_a_mangled_manifest_is_refused_with_a_bundle_error(
    built_litert_bundle: Path, scratch: Path, data: st.DataObject
) -> None:
    with bundle_copy(built_litert_bundle, scratch) as bundle:
        manifest = read_manifest_json(bundle)
        text = data.draw(
            manifest_mutations(manifest)
            | json_values.map(lambda v: json.dumps(v, default=list).encode())  # any JSON at all
            | st.sampled_from(RAW_JSON)
            | mutated(json.dumps(manifest).encode())  # bytes flipped, cut, inserted
        )
        (bundle / MANIFEST_FILE).write_bytes(text)
        checked_load(bundle)


# Found by the test above: IndexError (a classifier with labels whose output 0 is a scalar), OverflowError in load
# (a zero_point of 10**350), RecursionError and ValueError (deep nesting, a 5000-digit integer).
@pytest.mark.parametrize(
    ("change", "refused"),
    [
        pytest.param(lambda m: m["outputs"][0].update(shape=[]) or m["postprocess"].update(labels=["a"]), False,
                     id="scalar"),
        pytest.param(lambda m: m["outputs"][0]["quantization"].update(zero_point=10**350), True, id="zero-point"),
        pytest.param(lambda m: m.update(export="\x00RAW6\x00"), True, id="deep"),
        pytest.param(lambda m: m.update(version="\x00RAW0\x00"), True, id="digits"),
    ],
)  # fmt: skip
def test_manifest_values_that_broke_the_reader(
    built_litert_bundle: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None], refused: bool
) -> None:
    bundle = Path(shutil.copytree(built_litert_bundle, tmp_path / "bundle"))
    manifest = read_manifest_json(bundle)
    change(manifest)
    (bundle / MANIFEST_FILE).write_bytes(dumps_with_raw(manifest))
    assert isinstance(checked_load(bundle), BundleError if refused else edgeline.Model)


def outside_setup(bundle: Path) -> Path:
    """A copy of golden.npz beside the bundle (same size and sha256), and symlinks inside that lead to it."""
    secret = bundle.parent / "secret.npz"
    shutil.copy(bundle / "golden.npz", secret)
    (bundle / "link.npz").symlink_to("../secret.npz")
    (bundle / "link-dir").symlink_to("..")
    (bundle / "sub").mkdir()
    return secret


def point_golden_at(bundle: Path, path: str) -> None:
    """List golden.npz's size and sha256 under ``path`` instead."""
    manifest = read_manifest_json(bundle)
    (entry,) = [e for e in manifest["files"] if e["path"] == "golden.npz"]
    entry["path"] = manifest["golden"]["path"] = path
    (bundle / MANIFEST_FILE).write_text(json.dumps(manifest))


ESCAPES = [
    "../secret.npz",
    "./../secret.npz",
    "sub/../../secret.npz",
    "..\\secret.npz",
    "link.npz",
    "link-dir/secret.npz",
    "link-dir/../secret.npz",
    "../../../../../../../../etc/passwd",
    "{secret}",
    "C:/secret.npz",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_a_file_outside_the_bundle_is_refused_even_with_the_right_hash(
    built_litert_bundle: Path, tmp_path: Path, path: str
) -> None:
    bundle = Path(shutil.copytree(built_litert_bundle, tmp_path / "bundle"))
    secret = outside_setup(bundle)
    point_golden_at(bundle, path.format(secret=secret))
    with pytest.raises(BundleError, match=r"outside the bundle|a relative path inside the bundle"):
        read_bundle(bundle)


segments = st.sampled_from(["..", ".", "", "secret.npz", "golden.npz", "link.npz", "link-dir", "sub", "bundle"])
odd_segments = st.sampled_from(["~", "C:", "\\", "..\\..", "\x00", "\ud800", "a" * 255, "b" * 300, "\n"])


@HOSTILE
@given(parts=st.lists(segments | odd_segments, min_size=1, max_size=7), absolute=st.booleans())
@example(parts=["golden\x00.npz"], absolute=False)  # found: ValueError (embedded null byte)
@example(parts=["a" * 5000], absolute=False)  # found: OSError (file name too long)
@example(parts=["\ud800"], absolute=False)  # found: UnicodeEncodeError
def test_a_listed_path_is_inside_the_bundle_or_refused(
    built_litert_bundle: Path, scratch: Path, parts: list[str], absolute: bool
) -> None:
    with bundle_copy(built_litert_bundle, scratch) as bundle:
        outside_setup(bundle)
        point_golden_at(bundle, ("/" if absolute else "") + "/".join(parts))
        checked_load(bundle, load=False)  # refused, or every listed file resolves inside the bundle


def corrupt_file(path: Path, kind: str, data: st.DataObject) -> None:
    content = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(content[: data.draw(st.integers(0, len(content) - 1))])
    elif kind == "flip":
        corrupted = bytearray(content)
        for at in data.draw(st.lists(st.integers(0, len(content) - 1), min_size=1, max_size=8, unique=True)):
            corrupted[at] ^= data.draw(st.integers(1, 255))
        path.write_bytes(bytes(corrupted))
    elif kind == "append":
        path.write_bytes(content + data.draw(st.binary(min_size=1, max_size=64)))
    elif kind == "delete":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    elif kind == "symlink-loop":
        path.unlink()
        path.symlink_to(path.name)
    elif kind == "symlink-outside":  # the very same bytes, one level up
        outside = path.parent.parent / path.name
        path.rename(outside)
        path.symlink_to(os.path.relpath(outside, path.parent))


@HOSTILE
@given(
    name=st.sampled_from(["model.tflite", "golden.npz"]),
    kind=st.sampled_from(
        ["truncate", "flip", "append", "delete", "empty", "directory", "symlink-loop", "symlink-outside"]
    ),
    data=st.data(),
)
@example(name="model.tflite", kind="symlink-loop", data=None)  # found: RuntimeError (symlink loop)
def test_a_damaged_file_fails_the_integrity_check(
    built_litert_bundle: Path, scratch: Path, name: str, kind: str, data: st.DataObject | None
) -> None:
    with bundle_copy(built_litert_bundle, scratch) as bundle:
        corrupt_file(bundle / name, kind, data)  # type: ignore[arg-type]
        error = checked_load(bundle)
        assert isinstance(error, IntegrityError), error


# -- signed corruption: the manifest agrees with the corrupt file, so the runtime parses it ----------------------------

WORKER = r"""
import faulthandler, json, sys, traceback
from pathlib import Path
import numpy as np
import edgeline
from edgeline.errors import EdgelineError
faulthandler.enable()
repo = Path.cwd().resolve()

def where(exc):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve().is_relative_to(repo)
              and "/.venv/" not in f.filename]
    return str(Path(frames[-1].filename).resolve().relative_to(repo)) if frames else "?"

def answer(stage, **fields):
    print(json.dumps({"stage": stage, **fields}), flush=True)

for line in sys.stdin:
    try:
        model = edgeline.load(line.strip(), threads=1)
    except EdgelineError as exc:
        answer("load", outcome="edgeline", type=type(exc).__name__, message=str(exc))
        continue
    except Exception as exc:
        answer("load", outcome="other", type=type(exc).__name__, message=str(exc)[:300], where=where(exc))
        continue
    answer("load", outcome="ok")
    try:  # the daemon answers any failure of a running model "inference-failed"; only a dead process matters
        model.predict(*(np.zeros(spec.shape, np.float32) for spec in model.inputs))
        answer("predict", outcome="ok")
    except Exception as exc:
        answer("predict", outcome="raised", type=type(exc).__name__)
"""


class Worker:
    """A torch-free process that loads bundles: a corrupt model file may crash the native interpreter. ``script``
    (``WORKER`` unless a test of the judging gives another) reads bundle paths and answers JSON lines."""

    def __init__(self, stderr: Path, script: str = WORKER):
        self._stderr_path = stderr
        self._script = script
        self._start()

    def _start(self) -> None:
        self._stderr = self._stderr_path.open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._process = subprocess.Popen(
            [sys.executable, "-c", self._script], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True,
        )  # fmt: skip

    def _read(self) -> dict[str, Any] | None:
        watchdog = threading.Timer(60, self._process.kill)  # a hung interpreter is a failure too
        watchdog.start()
        try:
            line = self._process.stdout.readline()  # type: ignore[union-attr]
        finally:
            watchdog.cancel()
        return json.loads(line) if line else None

    def ask(self, bundle: Path) -> dict[str, Any]:
        """What loading (then running) the bundle did: the load answer, or ``died`` with the exit code."""
        self._process.stdin.write(f"{bundle}\n")  # type: ignore[union-attr]
        self._process.stdin.flush()  # type: ignore[union-attr]
        loaded = self._read()
        ran = self._read() if loaded and loaded["outcome"] == "ok" else {}
        if loaded is None or ran is None:
            code = self._process.wait()
            self._stderr.close()
            stage = "load" if loaded is None else "predict"
            tail = self._stderr_path.read_text(errors="replace")[-600:]
            self._start()
            return {"outcome": "died", "stage": stage, "code": code, "stderr": tail}
        return loaded

    def close(self) -> int:
        """End the worker (its input closed, as at the end of a file): its exit code, 0 unless it crashed on the way."""
        self._process.stdin.close()  # type: ignore[union-attr]
        try:
            code = self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait(timeout=10)
        self._stderr.close()
        return code

    def stderr_tail(self) -> str:
        return self._stderr_path.read_text(errors="replace")[-600:]


@pytest.fixture(scope="module")
def worker(scratch: Path) -> Iterator[Worker]:
    process = Worker(scratch / "worker-stderr.txt")
    yield process
    code = process.close()  # a crash on the way out (heap damage from an earlier model) is a dead process too
    assert code == 0, f"the worker ended with {exit_status(code)}:\n{process.stderr_tail()}"


def exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def check_signed(answer: dict[str, Any]) -> None:
    """Refused cleanly (an EdgelineError with a message) or ran; a worker that died fails, whatever killed it."""
    assert answer["outcome"] != "died", (
        f"the worker process died ({exit_status(answer['code'])}) during {answer['stage']}:\n{answer['stderr']}"
    )
    assert answer["outcome"] in ("ok", "edgeline"), answer
    if answer["outcome"] == "edgeline":
        assert answer["message"].strip() and "Traceback" not in answer["message"], answer


@st.composite
def model_corruptions(draw: st.DrawFn, model: bytes) -> bytes:
    data = bytearray(model)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "run", "int32", "truncate", "insert"]))
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "run":
            fill = draw(st.sampled_from([0x00, 0xFF]) | st.integers(0, 255))
            data[at : at + draw(st.integers(1, 64))] = bytes([fill]) * len(data[at : at + 64])
        elif kind == "int32":  # offsets, lengths and tensor indices are 32-bit
            at -= at % 4
            value = draw(st.sampled_from([-1, 0, 1, 7, 2**31 - 1, -(2**31), 2**16]) | st.integers(-(2**31), 2**31 - 1))
            data[at : at + 4] = struct.pack("<i", value)
        elif kind == "truncate":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        if not data:
            data = bytearray(b"\x00")
    return bytes(data[: len(model) + 256])


@settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_signed_corrupt_model_is_refused_cleanly_or_runs(
    built_litert_bundle: Path, scratch: Path, worker: Worker, data: st.DataObject
) -> None:
    with bundle_copy(built_litert_bundle, scratch) as bundle:
        model = bundle / "model.tflite"
        model.write_bytes(data.draw(model_corruptions(model.read_bytes())))
        sign(bundle, "model.tflite")
        answer = worker.ask(bundle)
        check_signed(answer)
        event(f"load: {answer['outcome']}")


# The judging above, against real processes that speak the worker's protocol: a fake interpreter that crashes must fail
# the property, one that refuses cleanly or runs must pass it.
FAKE_WORKER = r"""
import json, os, signal, sys
def answer(stage, **fields):
    print(json.dumps({"stage": stage, **fields}), flush=True)
for line in sys.stdin:
    BEHAVIOUR
"""
DYING = {
    "segfault-at-load": "os.kill(os.getpid(), signal.SIGSEGV)",
    "abort-at-load": "os.abort()",
    "killed-at-load": "os.kill(os.getpid(), signal.SIGKILL)",
    "segfault-at-predict": "answer('load', outcome='ok'); os.kill(os.getpid(), signal.SIGSEGV)",
    "exit-1-with-a-traceback": "raise RuntimeError('the interpreter gave up')",
    "exit-0-without-an-answer": "sys.exit(0)",
}
CLEAN = {
    "refused": "answer('load', outcome='edgeline', type='BundleError', message='model.tflite: not a LiteRT model')",
    "ran": "answer('load', outcome='ok'); answer('predict', outcome='ok')",
    "ran-and-predict-raised": "answer('load', outcome='ok'); answer('predict', outcome='raised', type='RuntimeError')",
}


def fake_worker(tmp_path: Path, behaviour: str) -> Worker:
    return Worker(tmp_path / "fake-stderr.txt", FAKE_WORKER.replace("BEHAVIOUR", behaviour))


@pytest.mark.parametrize("behaviour", list(DYING.values()), ids=list(DYING))
def test_a_worker_that_dies_fails_the_signed_model_check(
    built_litert_bundle: Path, tmp_path: Path, behaviour: str
) -> None:
    worker = fake_worker(tmp_path, behaviour)
    try:
        answer = worker.ask(built_litert_bundle)
        with pytest.raises(AssertionError, match=r"the worker process died \((signal SIG[A-Z]+|exit code \d+)\)"):
            check_signed(answer)
    finally:
        worker.close()


@pytest.mark.parametrize("behaviour", list(CLEAN.values()), ids=list(CLEAN))
def test_a_worker_that_refuses_cleanly_or_runs_passes_the_signed_model_check(
    built_litert_bundle: Path, tmp_path: Path, behaviour: str
) -> None:
    worker = fake_worker(tmp_path, behaviour)
    check_signed(worker.ask(built_litert_bundle))
    check_signed(worker.ask(built_litert_bundle))  # and it is still there for the next bundle
    assert worker.close() == 0


@HOSTILE
@given(data=st.data())
def test_a_signed_corrupt_golden_file_does_not_break_loading(
    built_litert_bundle: Path, scratch: Path, data: st.DataObject
) -> None:
    with bundle_copy(built_litert_bundle, scratch) as bundle:
        golden = bundle / "golden.npz"
        corrupt_file(golden, data.draw(st.sampled_from(["truncate", "flip", "append", "empty"])), data)
        sign(bundle, "golden.npz")
        assert isinstance(checked_load(bundle), edgeline.Model)  # golden.npz is read by verify, not by load
        try:
            read_npz(golden, "golden")
        except EdgelineError as error:
            assert str(error).strip()


# -- pinned: what still escapes, and the fixes that keep the rest from coming back -----------------------------------


def signed_variant(pristine: Path, tmp_path: Path, patch: Callable[[bytearray], None]) -> Path:
    bundle = Path(shutil.copytree(pristine, tmp_path / "bundle"))
    data = bytearray((bundle / "model.tflite").read_bytes())
    patch(data)
    (bundle / "model.tflite").write_bytes(bytes(data))
    sign(bundle, "model.tflite")
    return bundle


def operator_inputs_at(model: bytes, op_name: str) -> int:
    """The file offset of the first input index of the graph's first operator called ``op_name``."""
    schema = pytest.importorskip("ai_edge_litert.schema_py_generated")
    root = schema.Model.GetRootAsModel(model, 0)
    graph = root.Subgraphs(0)
    names = {value: name for name, value in vars(schema.BuiltinOperator).items() if not name.startswith("_")}
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        code = root.OperatorCodes(op.OpcodeIndex())
        if names.get(max(code.BuiltinCode(), code.DeprecatedBuiltinCode())) == op_name:
            offset: int = op._tab.Vector(op._tab.Offset(6))  # Operator.inputs
            return offset
    pytest.skip(f"the exported model has no {op_name} operator")


@pytest.mark.xfail(
    reason="ai-edge-litert 2.3.0 segfaults in allocate_tensors (XNNPACK) on a signed model whose TRANSPOSE takes "
    "tensor -1 as its permutation. A signed model is what our exporter wrote, so this takes a broken signing key "
    "or exporter; a fix would validate the flatbuffer before the interpreter sees it or load in a child process",
    strict=False,  # out-of-bounds reads: whether it crashes depends on the heap layout
)
def test_pinned_a_transpose_without_its_permutation_does_not_kill_the_process(
    built_litert_bundle: Path, tmp_path: Path, worker: Worker
) -> None:
    def patch(data: bytearray) -> None:
        struct.pack_into("<i", data, operator_inputs_at(bytes(data), "TRANSPOSE") + 4, -1)

    answer = worker.ask(signed_variant(built_litert_bundle, tmp_path, patch))
    assert answer["outcome"] == "edgeline", answer


def test_pinned_a_tensor_name_that_is_not_utf8_is_a_bundle_error(
    built_litert_bundle: Path, tmp_path: Path, worker: Worker
) -> None:
    name = read_manifest_json(built_litert_bundle)["inputs"][0]["tensor"].encode()

    def patch(data: bytearray) -> None:
        data[data.index(name)] = 0xFF

    answer = worker.ask(signed_variant(built_litert_bundle, tmp_path, patch))
    assert answer["outcome"] == "edgeline", answer


def test_pinned_a_negative_input_scale_in_the_model_is_a_bundle_error(
    built_litert_bundle: Path, tmp_path: Path, worker: Worker
) -> None:
    scale = np.float32(read_manifest_json(built_litert_bundle)["inputs"][0]["quantization"]["scale"])

    def patch(data: bytearray) -> None:
        schema = pytest.importorskip("ai_edge_litert.schema_py_generated")
        graph = schema.Model.GetRootAsModel(bytes(data), 0).Subgraphs(0)
        params = graph.Tensors(graph.Inputs(0)).Quantization()
        at = params._tab.Vector(params._tab.Offset(8))  # QuantizationParameters.scale[0]
        assert data[at : at + 4] == scale.tobytes()
        data[at : at + 4] = (-scale).tobytes()

    answer = worker.ask(signed_variant(built_litert_bundle, tmp_path, patch))
    assert answer["outcome"] == "edgeline", answer


@pytest.mark.parametrize(("field", "value"), [(10, 99), (8, 1)], ids=["compression", "encrypted"])
def test_pinned_a_signed_golden_file_zip_cannot_read_is_an_edgeline_error(
    built_litert_bundle: Path, tmp_path: Path, field: int, value: int
) -> None:
    golden = Path(shutil.copy(built_litert_bundle / "golden.npz", tmp_path / "golden.npz"))
    data = bytearray(golden.read_bytes())
    at = data.index(b"PK\x01\x02")  # the first central directory entry: flags at +8, compression at +10
    struct.pack_into("<H", data, at + field, value)
    golden.write_bytes(bytes(data))
    with pytest.raises(EdgelineError):
        read_npz(golden, "golden")
