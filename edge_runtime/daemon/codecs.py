"""Codecs: a sensor message's payload in, float32 model inputs out; a result record in, a payload out.

    json     {"id": ..., "data": [...]} for a one-input model, or {"id": ..., "<input name>": [...], ...};
             flat or nested lists of numbers, fitted to an input when the element count matches
    cbor     the same map; an input field may also be a byte string of little-endian float32 values
    msgpack  the same map as cbor
    raw      the inputs' little-endian tensor bytes in the model's own dtypes, concatenated in manifest order; no id

With a ``window`` (a time-series model) a message carries the new samples of one stream instead of whole inputs:
``n >= 1`` time steps of ``window.channels`` values (flat, or nested as ``[[c0, c1, ...], ...]``; raw: float32),
decoded to one float32 array of shape ``(n, channels)`` for ``edgeline.daemon.windowing``.

Decoding runs for every message: parsing and conversion run in C (simdjson, orjson, cbor2, msgpack, numpy), never
as a Python loop over the values; byte strings (cbor, msgpack) and raw payloads are not even copied.
Every bad payload raises ``PayloadError`` with a code from ``PAYLOAD_CODES`` and a message naming the field.
Decoded arrays may be read-only views of the payload: copy before writing into them.
"""

from __future__ import annotations

import io
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import numpy as np

from edgeline.arrays import all_finite
from edgeline.errors import EdgelineError, PayloadError
from edgeline.manifest import TensorSpec, Window
from edgeline.quantization import dequantize
from edgeline.registry import import_optional, resolve

__all__ = [
    "CODECS",
    "MAX_ID_CHARS",
    "CborCodec",
    "Codec",
    "Decoded",
    "JsonCodec",
    "MsgpackCodec",
    "RawCodec",
    "answer_id",
    "example_payload",
    "get_codec",
    "payload_fields",
]

CODECS: dict[str, str] = {
    "json": "edgeline.daemon.codecs:JsonCodec",
    "raw": "edgeline.daemon.codecs:RawCodec",
    "cbor": "edgeline.daemon.codecs:CborCodec",
    "msgpack": "edgeline.daemon.codecs:MsgpackCodec",
}

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_F32_LE = np.dtype("<f4")
_NUMBER_TYPES = frozenset({float, int})
_DATA = "data"
_MAX_DEPTH = 32  # deeper than any tensor shape; bounds the work a hostile payload can ask for
_F32_MAX = float(np.finfo(np.float32).max)
_ID_MIN, _ID_MAX = -(2**63), 2**64 - 1  # signed or unsigned 64-bit: what every map format carries natively

MAX_ID_CHARS = 1024
"""The longest ``id`` an answer echoes, the same for results and errors.

An answer echoes its input's id, so without a cap one input could make every answer as large as itself (a 900 KB
id, a 900 KB answer on every sink and in the outbox), and a result would carry a longer id than an error for the
same input. A message whose text id is longer is refused (``invalid-input``) rather than answered under a cut
id: a result always carries its id whole, so it can be matched to its input by plain equality. The refusal
itself, like any error answer whose input's id is too long, carries the first ``MAX_ID_CHARS`` characters, so
an answer's id is never longer than this and a cut one is always an error's.
"""


@dataclass(frozen=True)
class Decoded:
    """One message: its ``id`` (or None) and one float32 array per model input, shaped like its ``TensorSpec``.

    With a window: one array of shape ``(n, channels)``, the stream's new samples.
    """

    id: str | None
    arrays: tuple[np.ndarray, ...]


class Codec(Protocol):
    name: str

    def decode(self, payload: bytes, specs: Sequence[TensorSpec], *, window: Window | None = None) -> Decoded: ...

    def encode(self, record: Mapping[str, Any], *, plain: bool = False) -> bytes:
        """The record as a payload; numpy values become lists and numbers, and NaN or Inf anywhere is refused
        (``non-finite``). ``plain=True``: the caller vouches that the record holds only str, int, finite float,
        bool and None, in dicts and lists (the processor's own records); the walk that checks it is skipped."""
        ...


def get_codec(name: str) -> Codec:
    """The codec registered as ``name``; an unknown name raises ``EdgelineError`` listing the valid ones."""
    codec: Codec = resolve(CODECS, name, "codec", EdgelineError)()
    return codec


def example_payload(codec: str, specs: Sequence[TensorSpec], window: Window | None = None) -> str:
    """What a message for this model looks like in ``codec``, its values abbreviated: for the map codecs the map
    as JSON text, e.g. ``{"id": "1", "data": [...64 floats...]}``; for raw, the byte layout."""
    if codec == "raw":
        if window is not None:
            return f"n x {window.channels} little-endian float32 values (n time steps of {window.channels} channels)"
        layout = " + ".join(f"{spec.size} {spec.dtype} ({spec.name} {list(spec.shape)})" for spec in specs)
        return f"{sum(s.size * np.dtype(s.dtype).itemsize for s in specs)} bytes, little-endian: {layout}; no id"
    if window is not None:
        values = f"[[...{window.channels} floats...], ...] (time steps of {window.channels} channels)"
        fields = [f'"{_DATA}": {values}']
    else:
        fields = [f"{json.dumps(key)}: [...{count} floats...]" for key, count in payload_fields(specs).items()]
    return "{" + ", ".join(['"id": "1"', *fields]) + "}"


def payload_fields(specs: Sequence[TensorSpec], window: Window | None = None) -> dict[str, int]:
    """The input fields of a map payload and how many values each takes (with a window: per time step)."""
    if window is not None:
        return {_DATA: window.channels}
    if len(specs) == 1:
        return {_DATA: specs[0].size}
    return {spec.name: spec.size for spec in specs}


# ---------------------------------------------------------------------------------------------------------------------
# the map codecs: json, cbor, msgpack


class JsonCodec:
    """JSON via simdjson where it can vouch for a message, else orjson (about ten times faster than the standard
    library on number arrays), which also names what is wrong with a bad one.

    simdjson (``pysimdjson``) validates the whole message and reads a flat list of numbers straight into float64
    without a Python float per value: about twice as fast as orjson on long lists (``benchmarks/results/
    json_decode.md``). It has no wheel for 32-bit Arm; without it every message takes the orjson path.
    """

    name = "json"

    def __init__(self, *, simdjson: bool = True) -> None:
        orjson = import_optional("orjson", f"the {self.name} codec", "pip install orjson")
        self._loads = orjson.loads
        self._dumps = orjson.dumps
        self._error = orjson.JSONDecodeError
        self._simdjson: Any = None
        if simdjson:
            try:
                import simdjson as module
            except ImportError:
                pass
            else:
                self._simdjson = module

    def decode(self, payload: bytes, specs: Sequence[TensorSpec], *, window: Window | None = None) -> Decoded:
        if self._simdjson is not None:
            message = _simd_message(self._simdjson, payload)
            if message is not None:
                return _decode_map(message, specs, window, "JSON", len(payload))
        try:
            message = self._loads(payload)
        except self._error as exc:
            raise _json_failure(payload, exc) from exc
        return _decode_map(message, specs, window, "JSON", len(payload), json_text=payload)

    def encode(self, record: Mapping[str, Any], *, plain: bool = False) -> bytes:
        encoded: bytes = self._dumps(record if plain else _plain_record(record))
        return encoded


def _simd_message(simdjson: Any, payload: bytes) -> dict[str, Any] | None:
    """The message as a map whose lists of numbers are float32 arrays already, when simdjson can vouch for it;
    None otherwise, and the orjson path decides (the same outcome, its errors naming the fault).

    It vouches for a map whose values are scalars or flat lists of numbers, each key once. A list holding
    anything but numbers (a boolean, null, a string) fails ``as_buffer``; nested lists would be flattened by it,
    so the message may hold no ``[`` but those of its top-level lists (one in a string only costs the fast path);
    an id given as a list or a map, a duplicate key (simdjson keeps the first, orjson the last) and any parse
    error (invalid JSON, an integer beyond 64 bits, a number beyond float64) go to orjson.
    ``test_json_decodes_alike_with_and_without_simdjson`` holds the two paths together.
    """
    first = payload.find(b"[")
    if first >= 0 and payload[first + 1 : first + 64].lstrip().startswith(b"["):
        return None  # nested rows: declined after the parse anyway, so do not pay for it
    try:
        document = simdjson.Parser().parse(payload)  # a parser per call: thread-safe, and as fast as a kept one
        if not isinstance(document, simdjson.Object):
            return None
        message: dict[str, Any] = {}
        lists = 0
        for key in document.keys():  # noqa: SIM118 - items() would build every list's Python floats
            value = document[key]
            if isinstance(value, simdjson.Array) and key != "id":
                lists += 1
                message[key] = _narrowed(value.as_buffer(of_type="d"))
            elif isinstance(value, simdjson.Array | simdjson.Object):
                return None
            else:
                message[key] = value
        if len(message) != len(document) or _brackets(payload, lists + 1) != lists:
            return None
    except Exception:  # whatever the parser raises on a message it refuses: orjson's path names the fault
        return None
    return message


def _brackets(payload: bytes, most: int) -> int:
    """How many ``[`` the payload holds, counting up to ``most`` (``find`` is memchr: 20 times faster than
    ``count`` on a long message)."""
    found, at = 0, payload.find(b"[")
    while at >= 0 and found < most:
        found += 1
        at = payload.find(b"[", at + 1)
    return found


class CborCodec:
    name = "cbor"

    def __init__(self) -> None:
        cbor2 = import_optional("cbor2", f"the {self.name} codec", "pip install cbor2")
        self._decoder = cbor2.CBORDecoder
        self._errors = (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError, RecursionError)
        self._dumps = cbor2.dumps

    def decode(self, payload: bytes, specs: Sequence[TensorSpec], *, window: Window | None = None) -> Decoded:
        stream = io.BytesIO(payload)
        try:
            message = self._decoder(stream, max_depth=_MAX_DEPTH, strict_hashable_types=True).decode()
        except self._errors as exc:
            raise PayloadError(f"not valid CBOR: {exc}", code="malformed") from exc
        if stream.tell() != len(payload):
            raise PayloadError(
                f"not valid CBOR: {len(payload) - stream.tell()} bytes after the end of the message", code="malformed"
            )
        return _decode_map(message, specs, window, "CBOR", len(payload))

    def encode(self, record: Mapping[str, Any], *, plain: bool = False) -> bytes:
        encoded: bytes = self._dumps(record if plain else _plain_record(record))
        return encoded


class MsgpackCodec:
    name = "msgpack"

    def __init__(self) -> None:
        msgpack = import_optional("msgpack", f"the {self.name} codec", "pip install msgpack")
        self._unpackb = msgpack.unpackb
        self._errors = (ValueError, TypeError, OverflowError, RecursionError)  # msgpack's own errors are ValueErrors
        self._packb = msgpack.packb

    def decode(self, payload: bytes, specs: Sequence[TensorSpec], *, window: Window | None = None) -> Decoded:
        try:
            message = self._unpackb(payload, raw=False, strict_map_key=True, use_list=True)
        except self._errors as exc:
            raise PayloadError(f"not valid MessagePack: {exc}", code="malformed") from exc
        return _decode_map(message, specs, window, "MessagePack", len(payload))

    def encode(self, record: Mapping[str, Any], *, plain: bool = False) -> bytes:
        encoded: bytes = self._packb(record if plain else _plain_record(record), use_bin_type=True)
        return encoded


def _decode_map(
    message: Any,
    specs: Sequence[TensorSpec],
    window: Window | None,
    fmt: str,
    payload_bytes: int,
    *,
    json_text: bytes | None = None,
) -> Decoded:
    if not isinstance(message, dict):
        raise PayloadError(
            f"a {fmt} message must be a map with the input fields, got {_describe(message)}", code="malformed"
        )
    ident = _identity(message.get("id"))
    if window is not None:
        _check_windowed(specs)
        field, value = _field(message, specs, 0)
        return Decoded(ident, (_samples(_numbers(value, field, payload_bytes, json_text), window, field),))
    arrays = []
    for index, spec in enumerate(specs):
        field, value = _field(message, specs, index)
        array = _numbers(value, field, payload_bytes, json_text)
        if array.size != spec.size:
            raise PayloadError(
                f"field {field!r} holds {array.size} values; input {spec.name!r} of shape {list(spec.shape)} "
                f"takes {spec.size}",
                code="wrong-shape",
            )
        array = array.reshape(spec.shape)
        _check_finite(array, f"field {field!r}")
        arrays.append(array)
    return Decoded(ident, tuple(arrays))


def _check_windowed(specs: Sequence[TensorSpec]) -> None:
    if len(specs) != 1:
        raise EdgelineError(f"windowing feeds a model with exactly one input; this model has {len(specs)}")


def _identity(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) <= MAX_ID_CHARS:  # the one check a valid message pays for the cap
            return value
        raise PayloadError(
            f"field 'id' holds {len(value)} characters, more than the {MAX_ID_CHARS} an id may have",
            code="invalid-input",
        )
    if isinstance(value, int) and not isinstance(value, bool) and _ID_MIN <= value <= _ID_MAX:
        return str(value)
    raise PayloadError(f"field 'id' must be a string or a 64-bit integer, got {_describe(value)}", code="invalid-input")


def answer_id(value: Any) -> str | None:
    """What an answer echoes of a message's ``id`` field ``value``, which may be anything: a string cut to
    ``MAX_ID_CHARS``, a 64-bit integer as its digits, else None (no id). Never raises."""
    if isinstance(value, str):
        return value[:MAX_ID_CHARS]
    if isinstance(value, int) and not isinstance(value, bool) and _ID_MIN <= value <= _ID_MAX:
        return str(value)
    return None


def _field(message: dict[Any, Any], specs: Sequence[TensorSpec], index: int) -> tuple[str, Any]:
    name = specs[index].name
    if len(specs) == 1 and name != _DATA:
        if name in message and _DATA in message:
            raise PayloadError(f"both fields 'data' and {name!r} are given; send the input once", code="invalid-input")
        if _DATA in message:
            return _DATA, message[_DATA]
    if name in message:
        return name, message[name]
    if len(specs) == 1:
        wanted = "'data'" if name == _DATA else f"'data' (or {name!r})"
        raise PayloadError(f"missing field {wanted} with the model's input", code="missing-input")
    names = ", ".join(spec.name for spec in specs)
    raise PayloadError(f"missing field {name!r} (the model's inputs: {names})", code="missing-input")


def _numbers(value: Any, field: str, payload_bytes: int, json_text: bytes | None = None) -> np.ndarray:
    """A number, a (nested) list of numbers or a float32 byte string, as float32 in the nested shape.

    Every value's type is checked: numpy alone would turn true into 1.0, "1.5" into 1.5 and null into NaN without
    a word. ``payload_bytes``, the message's length, bounds the number of values. ``json_text``: the JSON message
    the value came from, which allows a faster conversion (``_json_floats``).
    """
    if isinstance(value, np.ndarray):  # a flat JSON list simdjson already read (``_simd_message``)
        return value
    if isinstance(value, bytes):
        if len(value) % 4:
            raise PayloadError(
                f"field {field!r}: a byte string of {len(value)} bytes is not a whole number of float32 values",
                code="wrong-shape",
            )
        return np.frombuffer(value, _F32_LE)
    leaves, shape = _leaves(value, field, payload_bytes)
    if json_text is not None:
        found = _json_floats(leaves, json_text)
        if found is not None:
            return found.reshape(shape)
    _check_numbers(leaves, field)
    try:
        with np.errstate(over="ignore"):  # beyond float32's range becomes Inf, refused as non-finite
            return np.fromiter(leaves, _F32, len(leaves)).reshape(shape)
    except OverflowError as exc:  # an integer too large even for float64
        raise PayloadError(f"field {field!r} holds a number beyond float32's range", code="non-finite") from exc


def _json_floats(leaves: list[Any], json_text: bytes) -> np.ndarray | None:
    """The flat values of a JSON message as float32 in one C loop, several times faster than checking each value's
    type first; None when that cannot vouch for them, and the checked path decides.

    ``struct.pack`` with ``d`` takes ints and floats and raises on anything else (a string, null, a list, a map,
    an integer beyond float64), with one exception: booleans, which it reads as 1 and 0. So values holding a 0 or
    a 1 are taken only from a message without ``true`` and ``false``. Beyond float32's range becomes Inf, refused
    as non-finite like on the checked path. ``test_the_json_fast_path_decides_as_the_checked_path`` holds the two
    paths together. (``struct`` packs float64 2-3 times faster than ``array.array("f")`` converts, and numpy
    narrows the result in one pass: ``benchmarks/results/json_decode.md``.)
    """
    try:
        packed = struct.pack(f"{len(leaves)}d", *leaves)
    except (struct.error, TypeError, OverflowError):
        return None
    found = _narrowed(packed)
    if ((found == 0) | (found == 1)).any() and (b"true" in json_text or b"false" in json_text):
        return None
    return found


def _narrowed(float64s: Any) -> np.ndarray:
    """A buffer of float64 values as a float32 array, in one pass; beyond float32's range becomes Inf (refused as
    non-finite later, like on the checked path)."""
    with np.errstate(over="ignore"):
        return np.frombuffer(float64s, _F64).astype(_F32)


def _leaves(value: Any, field: str, payload_bytes: int) -> tuple[list[Any], tuple[int, ...]]:
    """The flat values and nested shape of a regular list of lists, or the reason it is not one; the values' types
    are checked by ``_check_numbers`` (or vouched for by ``_json_floats``).

    Every value takes at least one byte of the message, unless the format repeats a list by reference (CBOR's
    shared values, tags 28/29): 200 bytes then nest one list into 2**30 values. Refused before flattening.
    """
    if not isinstance(value, list):
        value, shape = [value], []
    else:
        shape = [len(value)]
    level: list[Any] = value
    while level and isinstance(level[0], list):
        if len(shape) > _MAX_DEPTH:
            raise PayloadError(f"field {field!r} nests lists deeper than {_MAX_DEPTH} levels", code="malformed")
        if set(map(type, level)) != {list}:
            raise PayloadError(f"field {field!r} mixes lists and single values at one level", code="malformed")
        lengths = set(map(len, level))
        if len(lengths) != 1:
            raise PayloadError(
                f"field {field!r} is a ragged nested list (lengths {sorted(lengths)[:2]} at depth {len(shape)})",
                code="malformed",
            )
        shape.append(lengths.pop())
        if (count := math.prod(shape)) > payload_bytes:
            raise PayloadError(
                f"field {field!r} nests {count} elements, more than its {payload_bytes}-byte message can carry: "
                "lists repeated by reference are not accepted",
                code="malformed",
            )
        level = list(chain.from_iterable(level))
    return level, tuple(shape)


def _check_numbers(leaves: list[Any], field: str) -> None:
    """Every value an int or a float (one C-level pass), else the first odd one named."""
    types = set(map(type, leaves))
    if not types <= _NUMBER_TYPES:
        odd = next(item for item in leaves if type(item) not in _NUMBER_TYPES)
        code = "malformed" if isinstance(odd, list) else "wrong-dtype"
        raise PayloadError(f"field {field!r} holds {_describe(odd)} where a number belongs", code=code)


def _samples(array: np.ndarray, window: Window, field: str) -> np.ndarray:
    channels = window.channels
    if array.ndim >= 2 and array.shape[-1] != channels:
        raise PayloadError(
            f"field {field!r}: nested shape {list(array.shape)} has {array.shape[-1]} values per time step, "
            f"the window takes {channels} channels",
            code="wrong-shape",
        )
    if array.size == 0 or array.size % channels:
        raise PayloadError(
            f"field {field!r} holds {array.size} values, not a positive multiple of the window's {channels} channels",
            code="wrong-shape",
        )
    array = array.reshape(-1, channels)
    _check_finite(array, f"field {field!r}")
    return array


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string ({value[:20]!r})"
    if isinstance(value, bytes):
        return "a byte string"
    if isinstance(value, dict):
        return "a map"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int | float):
        return "a number"
    return f"a value of type {type(value).__name__}"


def _check_finite(array: np.ndarray, where: str) -> None:
    if not all_finite(array):
        raise PayloadError(f"{where} holds NaN or Inf", code="non-finite")


def _json_failure(payload: bytes, exc: ValueError) -> PayloadError:
    """Why orjson refused: NaN, Infinity and overflowing numbers, floats or integers (which Python's json
    accepts), are non-finite. Nesting too deep for Python's json is malformed (it stops at its recursion limit)."""
    constants: list[str] = []

    def constant(word: str) -> float:
        constants.append(word)
        return float(word)

    try:
        message = json.loads(payload, parse_constant=constant)
    except (ValueError, RecursionError):
        return PayloadError(f"not valid JSON: {exc}", code="malformed")
    fields = message.items() if isinstance(message, dict) else [("", message)]
    culprit = next((key for key, value in fields if _holds_non_finite(value, 0)), None)
    if culprit is None:
        return PayloadError(f"not valid JSON: {exc}", code="malformed")
    where = f"field {culprit!r}" if culprit else "the message"
    return PayloadError(
        f"{where} holds NaN, Infinity or a number beyond float32's range (NaN and Infinity are not JSON numbers)",
        code="non-finite",
    )


def _holds_non_finite(value: Any, depth: int) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return not -_F32_MAX <= value <= _F32_MAX  # as the checked path decides (``_numbers``); exact for any int
    if depth < _MAX_DEPTH and isinstance(value, list | dict):
        items = value.values() if isinstance(value, dict) else value
        return any(_holds_non_finite(item, depth + 1) for item in items)
    return False


# ---------------------------------------------------------------------------------------------------------------------
# raw


class RawCodec:
    """The inputs' tensor bytes, exactly as the model holds them: no id, no framing, nothing to parse.

    Quantized integer inputs arrive quantized and are dequantized here, so that the ``Model`` re-quantizes
    them to the very same integers. Results cannot be published raw: encode them with json, cbor or msgpack.
    """

    name = "raw"

    def decode(self, payload: bytes, specs: Sequence[TensorSpec], *, window: Window | None = None) -> Decoded:
        if window is not None:
            _check_windowed(specs)
            step = 4 * window.channels
            if not payload or len(payload) % step:
                raise PayloadError(
                    f"raw payload of {len(payload)} bytes is not a positive multiple of {step} bytes "
                    f"(one float32 time step of {window.channels} channels)",
                    code="wrong-shape",
                )
            samples = np.frombuffer(payload, _F32_LE).reshape(-1, window.channels)
            _check_finite(samples, "raw payload")
            return Decoded(None, (samples,))
        dtypes = [np.dtype(spec.dtype).newbyteorder("<") for spec in specs]
        expected = sum(spec.size * dtype.itemsize for spec, dtype in zip(specs, dtypes, strict=True))
        if len(payload) != expected:
            layout = " + ".join(f"{s.name} {s.dtype}{list(s.shape)}" for s in specs)
            raise PayloadError(
                f"raw payload of {len(payload)} bytes; the model takes {expected} bytes ({layout})", code="wrong-shape"
            )
        arrays = []
        offset = 0
        for spec, dtype in zip(specs, dtypes, strict=True):
            values = np.frombuffer(payload, dtype, count=spec.size, offset=offset).reshape(spec.shape)
            offset += spec.size * dtype.itemsize
            if dtype.kind == "b" and values.view(np.uint8).max() > 1:
                raise PayloadError(f"raw input {spec.name!r}: boolean bytes must be 0 or 1", code="wrong-dtype")
            if spec.quantization is not None and dtype.kind in "iu":
                array = dequantize(values, spec.quantization)
            else:
                array = values.astype(_F32, copy=False)
                _check_finite(array, f"raw input {spec.name!r}")
            arrays.append(array)
        return Decoded(None, tuple(arrays))

    def encode(self, record: Mapping[str, Any], *, plain: bool = False) -> bytes:
        raise EdgelineError("the raw codec decodes inputs only; results are published with json, cbor or msgpack")


# ---------------------------------------------------------------------------------------------------------------------
# results


class _NonFinite(Exception):
    def __init__(self, path: list[str] | None = None) -> None:
        self.path: list[str] = path or []


def _plain_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record in plain Python types (arrays as nested lists); NaN or Inf anywhere is refused (non-finite).

    A result is the same record in every codec, so NaN is refused even where the format could carry it.
    """
    try:
        plain: dict[str, Any] = _plain(record)
    except _NonFinite as exc:
        where = "".join(exc.path).lstrip(".")
        raise PayloadError(f"result field {where} holds NaN or Inf", code="non-finite") from None
    return plain


def _plain(value: Any) -> Any:
    kind = type(value)
    # the types a result record is made of, by exact type first (a record is encoded for every answer)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        if value - value != 0.0:  # NaN or Inf, without a call
            raise _NonFinite
        return value
    if kind is dict:
        return _plain_map(value)
    return _plain_other(value)


def _plain_map(value: Mapping[Any, Any]) -> dict[str, Any]:
    plain = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"cannot encode a map key of type {type(key).__name__}")
        item_kind = type(item)
        if item_kind is str or item_kind is int or item is None:
            plain[key] = item
            continue
        try:
            plain[key] = _plain(item)
        except _NonFinite as exc:
            exc.path.insert(0, f".{key}")
            raise
    return plain


def _plain_other(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"cannot encode an array of dtype {value.dtype}")
        if not all_finite(value):
            raise _NonFinite
        return value.tolist()
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _NonFinite
        return value
    if value is None or isinstance(value, str | int):
        return value
    if isinstance(value, Mapping):
        return _plain_map(value)
    if isinstance(value, list | tuple):
        if value and set(map(type, value)) == {float}:  # a row of outputs: checked in one C-level pass
            if not all(map(math.isfinite, value)):
                raise _NonFinite([f"[{next(i for i, v in enumerate(value) if not math.isfinite(v))}]"])
            return list(value)
        items = []
        for index, item in enumerate(value):
            try:
                items.append(_plain(item))
            except _NonFinite as exc:
                exc.path.insert(0, f"[{index}]")
                raise
        return items
    raise TypeError(f"cannot encode a value of type {type(value).__name__}")
