"""Codecs: payloads to model inputs (and results to payloads), with a precise code for every bad payload."""

from __future__ import annotations

import json
import math
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import cbor2
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgeline.daemon.codecs import CODECS, Decoded, get_codec
from edgeline.errors import DAEMON_CODES, PAYLOAD_CODES, BackendUnavailableError, EdgelineError, PayloadError
from edgeline.manifest import Quantization, TensorSpec, Window
from edgeline.quantization import quantize

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

PROPERTY = settings(deadline=None, max_examples=100)
# What a codec may answer; the size limit is the caller's, checked before decoding.
DECODE_CODES = set(PAYLOAD_CODES) - {"oversized", *DAEMON_CODES}

MAP_CODECS = ("json", "cbor", "msgpack")
PACKERS: dict[str, Callable[[Any], bytes]] = {
    "json": lambda message: json.dumps(message).encode(),
    "cbor": cbor2.dumps,
    "msgpack": msgpack.packb,
}
UNPACKERS: dict[str, Callable[[bytes], Any]] = {"json": json.loads, "cbor": cbor2.loads, "msgpack": msgpack.unpackb}

IMAGE = TensorSpec(name="image", dtype="float32", shape=(1, 2, 3))
PAIR = (TensorSpec(name="a", dtype="float32", shape=(1, 4)), TensorSpec(name="b", dtype="float32", shape=(1, 2)))
WINDOW = Window(size=4, hop=2, channels=3)


def decode(codec: str, message: Any, specs: tuple[TensorSpec, ...] = (IMAGE,), window: Window | None = None) -> Decoded:
    return get_codec(codec).decode(PACKERS[codec](message), specs, window=window)


def refusal(codec: str, message: Any, specs: tuple[TensorSpec, ...] = (IMAGE,), **kwargs: Any) -> PayloadError:
    with pytest.raises(PayloadError) as info:
        decode(codec, message, specs, **kwargs)
    return info.value


finite_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def tensors(draw: st.DrawFn) -> np.ndarray:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, max_side=5))
    return draw(hnp.arrays(np.float32, shape, elements=finite_float32))


# ---------------------------------------------------------------------------------------------------------------------
# the registry


def test_every_registered_codec_resolves_under_its_own_name() -> None:
    assert set(CODECS) == {"json", "raw", "cbor", "msgpack"}
    for name in CODECS:
        assert get_codec(name).name == name


def test_the_codes_codecs_answer_with_are_payload_codes() -> None:
    assert set(PAYLOAD_CODES) >= DECODE_CODES


def test_an_unknown_codec_is_a_user_error_listing_the_valid_names() -> None:
    with pytest.raises(EdgelineError, match="unknown codec 'protobuf'; valid: cbor, json, msgpack, raw") as info:
        get_codec("protobuf")
    assert not isinstance(info.value, PayloadError)


@pytest.mark.parametrize(("codec", "package"), [("json", "orjson"), ("cbor", "cbor2"), ("msgpack", "msgpack")])
def test_a_codec_whose_package_is_missing_names_it_and_how_to_install_it(
    codec: str, package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``edgeline.registry``, the one lazy loader: a sentence, not a traceback."""
    monkeypatch.setitem(sys.modules, package, None)  # as if left out: importing it raises ImportError
    expected = f"the {codec} codec is not available in this install: {package} is missing (pip install {package})"
    with pytest.raises(BackendUnavailableError) as info:
        get_codec(codec)
    assert str(info.value) == expected


def test_importing_the_daemon_pieces_loads_no_codec_library_nor_torch() -> None:
    # A fresh interpreter: this test process has torch loaded already (conftest).
    script = (
        "import sys, edgeline.daemon.codecs as c, edgeline.daemon.windowing, edgeline.daemon.queueing; "
        "c.get_codec('raw'); "
        "print(sorted(m for m in ('torch', 'orjson', 'cbor2', 'msgpack') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------------
# the map codecs: what they accept


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize("form", ["flat", "nested", "nested-batch", "named"])
@PROPERTY
@given(array=tensors(), ident=st.one_of(st.none(), st.text(max_size=8), st.integers(-(2**40), 2**40)))
def test_map_codecs_return_the_values_sent_shaped_like_the_input(
    codec: str, form: str, array: np.ndarray, ident: str | int | None
) -> None:
    spec = TensorSpec(name="signal", dtype="float32", shape=(1, *array.shape))
    values = {"flat": array.ravel().tolist(), "nested": array.tolist(), "nested-batch": array[np.newaxis].tolist()}
    message: dict[str, Any] = {"signal" if form == "named" else "data": values.get(form, array.tolist())}
    if ident is not None:
        message["id"] = ident
    decoded = decode(codec, message, (spec,))
    assert decoded.id == (None if ident is None else str(ident))
    (got,) = decoded.arrays
    assert got.dtype == np.float32
    assert got.shape == spec.shape
    np.testing.assert_array_equal(got, array[np.newaxis])


@pytest.mark.parametrize("codec", ["cbor", "msgpack"])
@PROPERTY
@given(array=tensors())
def test_binary_map_codecs_take_a_byte_string_of_little_endian_float32(codec: str, array: np.ndarray) -> None:
    spec = TensorSpec(name="signal", dtype="float32", shape=(1, *array.shape))
    decoded = decode(codec, {"data": array.astype("<f4").tobytes()}, (spec,))
    np.testing.assert_array_equal(decoded.arrays[0], array[np.newaxis])
    assert decoded.arrays[0].shape == spec.shape


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_several_inputs_come_by_name_in_the_manifest_order_whatever_the_message_order(codec: str) -> None:
    decoded = decode(codec, {"b": [5, 6], "id": "x", "a": [[1, 2, 3, 4]], "extra": "ignored"}, PAIR)
    assert [a.tolist() for a in decoded.arrays] == [[[1, 2, 3, 4]], [[5, 6]]]
    assert all(a.dtype == np.float32 for a in decoded.arrays)


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_a_one_input_model_takes_its_input_by_name_or_as_data(codec: str) -> None:
    by_name = decode(codec, {"image": [1, 2, 3, 4, 5, 6]})
    as_data = decode(codec, {"data": [1, 2, 3, 4, 5, 6]})
    np.testing.assert_array_equal(by_name.arrays[0], as_data.arrays[0])


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_integers_are_numbers_too(codec: str) -> None:
    (got,) = decode(codec, {"data": [0, 255, -3, 2**40, 1, 2]}).arrays
    assert got.ravel().tolist() == [0, 255, -3, 2**40, 1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# the map codecs: what they refuse, and with which code


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_a_message_that_is_not_a_map_is_malformed(codec: str) -> None:
    error = refusal(codec, [1, 2, 3, 4, 5, 6])
    assert error.code == "malformed"
    assert "a list" in str(error)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize("garbage", [b"", b"\xff\xfe\x00", b'{"data": [1, 2', b"\xc1"])
def test_bytes_the_format_cannot_parse_are_malformed(codec: str, garbage: bytes) -> None:
    with pytest.raises(PayloadError) as info:
        get_codec(codec).decode(garbage, [IMAGE])
    assert info.value.code == "malformed"


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_bytes_after_the_message_are_malformed(codec: str) -> None:
    payload = PACKERS[codec]({"data": [1, 2, 3, 4, 5, 6]}) + PACKERS[codec]({"data": [1]})
    with pytest.raises(PayloadError) as info:
        get_codec(codec).decode(payload, [IMAGE])
    assert info.value.code == "malformed"


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_a_missing_input_names_the_field(codec: str) -> None:
    error = refusal(codec, {"id": "x", "a": [1, 2, 3, 4], "data": [5, 6]}, PAIR)
    assert error.code == "missing-input"
    assert "'b'" in str(error) and "a, b" in str(error)
    error = refusal(codec, {"id": "x", "imag": [1, 2, 3, 4, 5, 6]})
    assert error.code == "missing-input"
    assert "'data' (or 'image')" in str(error)


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_an_input_sent_twice_is_refused_rather_than_guessed(codec: str) -> None:
    error = refusal(codec, {"data": [1, 2, 3, 4, 5, 6], "image": [6, 5, 4, 3, 2, 1]})
    assert error.code == "invalid-input"
    assert "'data'" in str(error) and "'image'" in str(error)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize("ident", [1.5, True, [1], {"a": 1}])
def test_an_id_that_is_neither_string_nor_integer_is_refused(codec: str, ident: Any) -> None:
    error = refusal(codec, {"id": ident, "data": [1, 2, 3, 4, 5, 6]})
    assert error.code == "invalid-input"
    assert "'id'" in str(error)


@pytest.mark.parametrize(
    ("codec", "ident"),
    [("json", 2**64), ("json", -(2**63) - 1), ("cbor", 2**64), ("cbor", -(2**63) - 1), ("cbor", 10**5000)],
    ids=["json-2**64", "json-(-2**63-1)", "cbor-2**64", "cbor-(-2**63-1)", "cbor-10**5000"],
)
def test_an_integer_id_must_fit_64_bits(codec: str, ident: int) -> None:
    error = refusal(codec, {"id": ident, "data": [1, 2, 3, 4, 5, 6]})
    assert error.code == "invalid-input"
    assert "'id'" in str(error)
    assert decode(codec, {"id": 2**64 - 1, "data": [1, 2, 3, 4, 5, 6]}).id == str(2**64 - 1)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize(
    ("values", "described"),
    [
        (["1.5", 2, 3, 4, 5, 6], "a string"),
        ([1.0, True, 3, 4, 5, 6], "a boolean"),
        ([1.0, 2, 3, 4, 5, None], "null"),
        ([1.0, 2, 3, 4, 5, {"x": 1}], "a map"),
        ([[1, 2, 3], [4, 5, "6"]], "a string"),
        ("123456", "a string"),
        (None, "null"),
        (True, "a boolean"),
    ],
)
def test_values_that_are_not_numbers_are_the_wrong_dtype(codec: str, values: Any, described: str) -> None:
    error = refusal(codec, {"data": values})
    assert error.code == "wrong-dtype"
    assert "field 'data'" in str(error) and described in str(error)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize("values", [[[1, 2, 3], [4, 5]], [[1, 2, 3], 4, 5, 6], [1, 2, 3, 4, 5, [6]]])
def test_ragged_or_mixed_nesting_is_malformed(codec: str, values: Any) -> None:
    error = refusal(codec, {"data": values})
    assert error.code == "malformed"
    assert "field 'data'" in str(error)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize("count", [0, 1, 5, 7, 12])
def test_an_element_count_that_does_not_fit_is_the_wrong_shape(codec: str, count: int) -> None:
    error = refusal(codec, {"data": list(range(count))})
    assert error.code == "wrong-shape"
    assert f"holds {count} values" in str(error) and "takes 6" in str(error)


@pytest.mark.parametrize("codec", ["cbor", "msgpack"])
@pytest.mark.parametrize("size", [23, 20, 28])
def test_a_byte_string_of_the_wrong_length_is_the_wrong_shape(codec: str, size: int) -> None:
    assert refusal(codec, {"data": bytes(size)}).code == "wrong-shape"


@pytest.mark.parametrize("codec", ["cbor", "msgpack"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e39])
def test_binary_formats_carry_nan_and_inf_but_the_codec_refuses_them(codec: str, bad: float) -> None:
    error = refusal(codec, {"data": [1, 2, 3, bad, 5, 6]})
    assert error.code == "non-finite"
    assert "field 'data'" in str(error)


@pytest.mark.parametrize("codec", ["cbor", "msgpack"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_byte_strings_holding_nan_or_inf_are_non_finite(codec: str, bad: float) -> None:
    as_bytes = np.array([1, 2, 3, bad, 5, 6], dtype="<f4").tobytes()
    assert refusal(codec, {"data": as_bytes}).code == "non-finite"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_json_nan_and_infinity_are_non_finite_and_name_the_field(literal: str) -> None:
    payload = f'{{"id": "x", "data": [1, 2, 3, {literal}, 5, 6]}}'.encode()
    with pytest.raises(PayloadError) as info:
        get_codec("json").decode(payload, [IMAGE])
    assert info.value.code == "non-finite"
    assert "field 'data'" in str(info.value)


def test_json_nan_anywhere_makes_the_message_invalid_json() -> None:
    payload = b'{"id": "x", "temperature": NaN, "data": [1, 2, 3, 4, 5, 6]}'
    with pytest.raises(PayloadError, match="field 'temperature'") as info:
        get_codec("json").decode(payload, [IMAGE])
    assert info.value.code == "non-finite"


def test_numbers_beyond_float32_are_non_finite() -> None:
    assert refusal("json", {"data": [1, 2, 3, 4, 5, 1e39]}).code == "non-finite"
    assert refusal("cbor", {"data": [1, 2, 3, 4, 5, 10**400]}).code == "non-finite"  # a CBOR bignum


# Any bytes at all: a Decoded or a PayloadError, never another exception (the daemon answers every message).
@pytest.mark.parametrize("codec", list(CODECS))
@settings(deadline=None, max_examples=300)
@given(payload=st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_a_payload_error(codec: str, payload: bytes) -> None:
    for window in (None, WINDOW):
        try:
            decoded = get_codec(codec).decode(payload, [IMAGE], window=window)
        except PayloadError as error:
            assert error.code in DECODE_CODES
        else:
            assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in decoded.arrays)


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=4),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=12,
)


@pytest.mark.parametrize("codec", MAP_CODECS)
@settings(deadline=None, max_examples=300)
@given(
    data=json_values | st.lists(st.floats() | st.integers() | st.booleans(), min_size=2, max_size=2), ident=json_values
)
def test_arbitrary_structures_decode_or_raise_a_payload_error(codec: str, data: Any, ident: Any) -> None:
    message = {"id": ident, "data": data}
    try:
        payload = PACKERS[codec](message)
    except (ValueError, TypeError, OverflowError):
        return  # not representable in this format
    try:
        decoded = get_codec(codec).decode(payload, [TensorSpec(name="x", dtype="float32", shape=(1, 2))])
    except PayloadError:
        return
    assert decoded.arrays[0].shape == (1, 2)
    assert decoded.arrays[0].tolist() == [[float(np.float32(v)) for v in np.ravel(data)]]


# JSON's faster path (numpy reads the lists) must decide exactly as the checked one: same array, or same error.
number_lists = st.recursive(
    st.lists(st.sampled_from([0, 1, 0.0, 1.0, -2.5, True, False, 3]) | st.floats(width=32), max_size=6),
    lambda children: st.lists(children, min_size=1, max_size=3),
    max_leaves=24,
)


@settings(deadline=None, max_examples=400)
@given(value=number_lists | json_values)
def test_the_json_fast_path_decides_as_the_checked_path(value: Any) -> None:
    from edgeline.daemon import codecs

    try:
        text = json.dumps({"id": "1", "data": value}, allow_nan=False).encode()
    except ValueError:
        return  # NaN or Infinity: not JSON, refused before any list is read
    data = json.loads(text)["data"]

    def outcome(**fast: bytes) -> Any:
        try:
            array = codecs._numbers(data, "data", len(text), **fast)
        except PayloadError as error:
            return error.code
        return array.dtype, array.shape, array.tobytes()

    assert outcome(json_text=text) == outcome()


# simdjson reads the messages it can vouch for, orjson the rest: the two must decide alike, to the error's text.
RAW_NUMBERS = ["1e400", "-1e400", "123456789012345678901234567890", "18446744073709551615", "-0.0", "1E-7", "3.5e38"]
RAW_NUMBERS += ["NaN", "Infinity", "true", "null", '"["', "[1]", "[]"]
json_value_texts = (number_lists | json_values).map(json.dumps) | st.lists(
    st.sampled_from(RAW_NUMBERS) | finite_float32.map(repr), max_size=6
).map(lambda items: "[" + ", ".join(items) + "]")
json_messages = st.lists(st.tuples(st.sampled_from(["id", "data", "a", "b", "x["]), json_value_texts), max_size=4).map(
    lambda fields: ("{" + ", ".join(f'"{key}": {value}' for key, value in fields) + "}").encode()
)


@settings(deadline=None, max_examples=400)
@given(payload=json_messages | json_values.map(lambda value: json.dumps(value).encode()))
@pytest.mark.parametrize(
    ("specs", "window"),
    [((TensorSpec(name="x", dtype="float32", shape=(1, 2)),), None), (PAIR, None), ((IMAGE,), WINDOW)],
    ids=["one-input", "two-inputs", "window"],
)
def test_json_decodes_alike_with_and_without_simdjson(
    payload: bytes, specs: tuple[TensorSpec, ...], window: Window | None
) -> None:
    from edgeline.daemon.codecs import JsonCodec

    def outcome(codec: JsonCodec) -> Any:
        try:
            decoded = codec.decode(payload, specs, window=window)
        except PayloadError as error:
            return error.code, str(error)
        return decoded.id, [(array.dtype, array.shape, array.tobytes()) for array in decoded.arrays]

    assert outcome(JsonCodec()) == outcome(JsonCodec(simdjson=False))


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"), reason="pysimdjson has no wheel for this CPU"
)
def test_json_takes_the_simdjson_path_for_a_plain_message() -> None:
    from edgeline.daemon import codecs

    codec = codecs.JsonCodec()
    assert codec._simdjson is not None, "pysimdjson is a dependency on this platform: is it installed?"
    payload = json.dumps({"id": "m1", "data": [0.5, -1.25, 3.0]}).encode()
    message = codecs._simd_message(codec._simdjson, payload)
    assert message is not None and message["id"] == "m1"
    np.testing.assert_array_equal(message["data"], np.array([0.5, -1.25, 3.0], np.float32))
    # what it cannot vouch for goes to orjson's path
    for refused in (b'{"data": [[1, 2]]}', b'{"data": [1, true]}', b'{"data": [1], "data": [2]}', b'{"id": [1]}'):
        assert codecs._simd_message(codec._simdjson, refused) is None, refused


# ---------------------------------------------------------------------------------------------------------------------
# windowed streams


@pytest.mark.parametrize("codec", MAP_CODECS)
@PROPERTY
@given(steps=st.integers(1, 9), nested=st.booleans(), data=st.data())
def test_a_window_message_carries_any_number_of_time_steps(
    codec: str, steps: int, nested: bool, data: st.DataObject
) -> None:
    samples = data.draw(hnp.arrays(np.float32, (steps, WINDOW.channels), elements=finite_float32))
    values = samples.tolist() if nested else samples.ravel().tolist()
    decoded = decode(codec, {"id": 3, "data": values}, window=WINDOW)
    (got,) = decoded.arrays
    assert got.shape == (steps, WINDOW.channels)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, samples)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize("values", [[], [1, 2], [1, 2, 3, 4], [[1, 2], [3, 4], [5, 6]], [[1, 2, 3, 4, 5, 6]]])
def test_window_messages_that_are_not_whole_time_steps_are_the_wrong_shape(codec: str, values: Any) -> None:
    error = refusal(codec, {"data": values}, window=WINDOW)
    assert error.code == "wrong-shape"
    assert "3 channels" in str(error)


def test_window_messages_are_checked_for_nan() -> None:
    assert refusal("cbor", {"data": [1, 2, math.nan]}, window=WINDOW).code == "non-finite"


@pytest.mark.parametrize("codec", list(CODECS))
def test_windowing_a_model_with_two_inputs_is_a_setup_error_not_a_payload_error(codec: str) -> None:
    payload = bytes(12) if codec == "raw" else PACKERS[codec]({"a": [1, 2, 3]})
    with pytest.raises(EdgelineError, match="exactly one input") as info:
        get_codec(codec).decode(payload, PAIR, window=WINDOW)
    assert not isinstance(info.value, PayloadError)


# ---------------------------------------------------------------------------------------------------------------------
# raw


@PROPERTY
@given(first=tensors(), second=tensors())
def test_raw_splits_concatenated_float32_inputs_in_manifest_order(first: np.ndarray, second: np.ndarray) -> None:
    specs = (
        TensorSpec(name="first", dtype="float32", shape=(1, *first.shape)),
        TensorSpec(name="second", dtype="float32", shape=(1, *second.shape)),
    )
    payload = first.astype("<f4").tobytes() + second.astype("<f4").tobytes()
    decoded = get_codec("raw").decode(payload, specs)
    assert decoded.id is None
    assert [a.shape for a in decoded.arrays] == [s.shape for s in specs]
    np.testing.assert_array_equal(decoded.arrays[0], first[np.newaxis])
    np.testing.assert_array_equal(decoded.arrays[1], second[np.newaxis])


@PROPERTY
@given(
    dtype=st.sampled_from(["int8", "uint8"]),
    scale=st.floats(1e-4, 10.0).map(lambda s: float(np.float32(s))),
    zero_point=st.integers(-20, 20),
    data=st.data(),
)
def test_raw_quantized_inputs_come_back_as_floats_that_requantize_to_the_same_bytes(
    dtype: str, scale: float, zero_point: int, data: st.DataObject
) -> None:
    quantization = Quantization(scale=scale, zero_point=zero_point)
    spec = TensorSpec(name="q", dtype=dtype, shape=(1, 16), quantization=quantization)
    tensor = data.draw(hnp.arrays(np.dtype(dtype), (1, 16)))
    (floats,) = get_codec("raw").decode(tensor.tobytes(), [spec]).arrays
    assert floats.dtype == np.float32
    np.testing.assert_array_equal(quantize(floats, quantization, np.dtype(dtype)), tensor)


def test_raw_converts_other_model_dtypes_to_float() -> None:
    specs = (
        TensorSpec(name="half", dtype="float16", shape=(1, 2)),
        TensorSpec(name="ids", dtype="int32", shape=(1, 2)),
    )
    payload = np.array([1.5, -2], dtype="<f2").tobytes() + np.array([7, -9], dtype="<i4").tobytes()
    half, ids = get_codec("raw").decode(payload, specs).arrays
    assert half.dtype == ids.dtype == np.float32
    assert half.tolist() == [[1.5, -2.0]] and ids.tolist() == [[7.0, -9.0]]


@pytest.mark.parametrize("size", [0, 23, 25, 48])
def test_raw_needs_the_exact_byte_length(size: int) -> None:
    with pytest.raises(PayloadError, match=f"{size} bytes; the model takes 24 bytes") as info:
        get_codec("raw").decode(bytes(size), [IMAGE])
    assert info.value.code == "wrong-shape"


def test_raw_refuses_nan() -> None:
    payload = np.array([1, 2, 3, np.nan, 5, 6], dtype="<f4").tobytes()
    with pytest.raises(PayloadError) as info:
        get_codec("raw").decode(payload, [IMAGE])
    assert info.value.code == "non-finite"


@pytest.mark.parametrize("steps", [1, 2, 7])
def test_raw_window_messages_are_float32_time_steps(steps: int) -> None:
    samples = np.arange(steps * 3, dtype="<f4").reshape(steps, 3)
    (got,) = get_codec("raw").decode(samples.tobytes(), [IMAGE], window=WINDOW).arrays
    np.testing.assert_array_equal(got, samples)
    with pytest.raises(PayloadError) as info:
        get_codec("raw").decode(samples.tobytes()[:-4], [IMAGE], window=WINDOW)
    assert info.value.code == "wrong-shape"


def test_raw_does_not_encode_results() -> None:
    with pytest.raises(EdgelineError, match="json, cbor or msgpack"):
        get_codec("raw").encode({"id": "x"})


# ---------------------------------------------------------------------------------------------------------------------
# results


RESULT = {
    "id": "m-1",
    "device": "pi-7",
    "sequence": np.int64(12),
    "outputs": [np.array([[0.25, 0.5]], dtype=np.float32), np.array([3, 4], dtype=np.int8)],
    "label": "yes",
    "score": np.float32(0.75),
    "anomaly": np.bool_(False),
    "nested": {"latency_ms": 1.5, "flags": (True, None)},
}
PLAIN = {
    "id": "m-1",
    "device": "pi-7",
    "sequence": 12,
    "outputs": [[[0.25, 0.5]], [3, 4]],
    "label": "yes",
    "score": 0.75,
    "anomaly": False,
    "nested": {"latency_ms": 1.5, "flags": [True, None]},
}


@pytest.mark.parametrize("codec", MAP_CODECS)
def test_results_encode_to_the_same_plain_record_in_every_format(codec: str) -> None:
    assert UNPACKERS[codec](get_codec(codec).encode(RESULT)) == PLAIN


def test_json_results_are_compact_and_match_the_standard_library() -> None:
    encoded = get_codec("json").encode(RESULT)
    assert encoded == json.dumps(PLAIN, separators=(",", ":"), allow_nan=False).encode()


@PROPERTY
@given(array=tensors())
def test_float32_outputs_survive_encoding_exactly(array: np.ndarray) -> None:
    for codec in MAP_CODECS:
        decoded = UNPACKERS[codec](get_codec(codec).encode({"outputs": [array]}))
        np.testing.assert_array_equal(np.asarray(decoded["outputs"][0], dtype=np.float32), array)


@pytest.mark.parametrize("codec", MAP_CODECS)
@pytest.mark.parametrize(
    ("record", "where"),
    [
        ({"outputs": [np.zeros(2), np.array([1.0, np.nan])]}, "outputs[1]"),
        ({"score": float("inf")}, "score"),
        ({"extra": {"scores": [0.5, np.float32("-inf")]}}, "extra.scores[1]"),
    ],
)
def test_results_holding_nan_or_inf_are_refused_naming_the_field(codec: str, record: Any, where: str) -> None:
    with pytest.raises(PayloadError, match=re.escape(f"result field {where} holds")) as info:
        get_codec(codec).encode(record)
    assert info.value.code == "non-finite"


@pytest.mark.parametrize("value", [object(), {1: "non-string key"}, np.array(["text"]), b"bytes"])
def test_values_no_result_should_hold_are_a_bug_not_a_payload_error(value: Any) -> None:
    with pytest.raises(TypeError):
        get_codec("json").encode({"value": value})
