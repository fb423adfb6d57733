"""The id of an input that cannot be decoded: every error answer carries the input's own ``id`` whenever it can
be read, even when the rest of the payload cannot (NaN, ``1e400``, a 400-digit integer, 10,000 levels of nesting
after the id, bytes after a CBOR or MessagePack map).

JSON goes to orjson first; what orjson refuses is read one top-level member at a time with regular expressions
that skip values without building them (brackets counted, nothing recursive). CBOR and MessagePack maps are read
entry by entry. Bounded: at most ``SALVAGE_STEPS`` tokens or entries, and memory bounded by the id.
"""

from __future__ import annotations

import io
import re
from typing import Any

import orjson

from edgeline.daemon.codecs import answer_id

__all__ = ["SALVAGE_STEPS", "readable_id"]

SALVAGE_STEPS = 4096
"""How many tokens (JSON) or map entries (CBOR, MessagePack) ``readable_id`` reads at most: the id behind a
hostile message is given up rather than searched for at Python speed through a megabyte of it."""


def readable_id(payload: bytes, codec: str) -> str | None:
    """The ``id`` an answer echoes (``answer_id``) for a payload that did not decode as a whole, when it can still
    be read; never raises.

    A message the format's parser takes whole gives the id it holds. Otherwise the top-level map is read member by
    member, without building the values it skips, up to the fault or ``SALVAGE_STEPS``: an id before the fault is
    found (JSON: also one after a fault inside a value, such as NaN, 1e400 or nesting too deep for the parser,
    as long as the brackets still pair up). Of an id given twice, the last one read counts, as in a parsed map.
    Time is linear in the payload and memory bounded by the id; nothing recurses.
    """
    if codec == "raw" or not payload:
        return None
    try:
        if codec == "json":
            try:
                data: Any = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return answer_id(_json_member_id(payload))
            return answer_id(data.get("id")) if isinstance(data, dict) else None
        if codec == "cbor":
            return answer_id(_cbor_member_id(payload))
        if codec == "msgpack":
            return answer_id(_msgpack_member_id(payload))
    except Exception:  # whatever a broken payload makes a third-party parser raise: no id to read
        return None
    return None


_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: linear even when unterminated
_ID_INTEGER = re.compile(rb"-?(?:0|[1-9][0-9]{0,19})(?=[ \t\n\r]*[,}])")  # more digits: beyond 64 bits anyway
_SCALAR = re.compile(rb'[^,"\[\]{}]+')  # a number, a literal, NaN, Infinity, or what no parser takes
# A run of openings, each perhaps followed by a key without brackets (``{"a": [{"b": [[``): one step however deep.
_OPENINGS = rb'(?:[\[{]+[ \t\n\r]*(?:"[^"\\\[\]{}]*"[ \t\n\r]*:[ \t\n\r]*)?)+'
_INSIDE = re.compile(_OPENINGS + rb'|[\]}]+|"[^"\\]*(?:\\.[^"\\]*)*"|[^"\[\]{}]+', re.DOTALL)
_OPENING = frozenset(b"[{")
_CBOR_SELF_DESCRIBED = b"\xd9\xd9\xf7"  # tag 55799, which cbor2 reads through


def _json_member_id(payload: bytes) -> Any:
    """The value of the last ``id`` member read in the top-level map of a JSON text no parser takes, or None.

    Each step is one regular-expression match (C speed): a run of opening or closing brackets is one token, so
    10,000 levels of nesting cost two steps and never a recursion.
    """
    found: Any = None
    steps = SALVAGE_STEPS
    at = _space(payload, 0)
    if payload[at : at + 1] != b"{":
        return None
    at += 1
    while steps > 0:
        key = _STRING.match(payload, _space(payload, at))
        if key is None:
            break
        at = _space(payload, key.end())
        if payload[at : at + 1] != b":":
            break
        at = _space(payload, at + 1)
        if _is_id_key(key.group()):
            found = _json_id_value(payload, at)
        at, steps = _skip_json_value(payload, at, steps - 1)
        if at < 0:
            break
        at = _space(payload, at)
        if payload[at : at + 1] != b",":
            break
        at += 1
    return found


def _space(payload: bytes, at: int) -> int:
    """Where the JSON whitespace from ``at`` ends."""
    space = _WHITESPACE.match(payload, at)
    return space.end() if space is not None else at


def _is_id_key(key: bytes) -> bool:
    if key == b'"id"':
        return True
    return b"\\" in key and len(key) < 64 and _json_string(key) == "id"  # an escaped spelling, "\u0069d"


def _json_string(token: bytes) -> str | None:
    try:
        text = orjson.loads(token)
    except orjson.JSONDecodeError:  # an invalid escape, a control character, invalid UTF-8
        return None
    return text if isinstance(text, str) else None


def _json_id_value(payload: bytes, at: int) -> str | int | None:
    string = _STRING.match(payload, at)
    if string is not None:
        return _json_string(string.group())
    integer = _ID_INTEGER.match(payload, at)
    return int(integer.group()) if integer is not None else None


def _skip_json_value(payload: bytes, at: int, steps: int) -> tuple[int, int]:
    """Where the JSON value at ``at`` ends, and the steps left; -1 when it cannot be told (cut short, a stray
    quote, out of steps). Brackets are counted, not matched by kind: a fault is found by the parser, not here."""
    if payload[at : at + 1] == b'"':
        string = _STRING.match(payload, at)
        return (string.end() if string is not None else -1), steps
    if at >= len(payload) or payload[at] not in _OPENING:
        scalar = _SCALAR.match(payload, at)
        return (scalar.end() if scalar is not None else -1), steps
    depth = 0
    while steps > 0:
        steps -= 1
        token = _INSIDE.match(payload, at)
        if token is None:
            return -1, steps
        end = token.end()
        if payload[at] in _OPENING:
            depth += payload.count(b"[", at, end) + payload.count(b"{", at, end)
        elif payload[at] in b"]}":
            if end - at >= depth:
                return at + depth, steps
            depth -= end - at
        at = end
    return -1, steps


def _cbor_member_id(payload: bytes) -> Any:
    """The value of the last ``id`` key read in a CBOR map, entry by entry until one cannot be decoded."""
    import cbor2

    start = 3 if payload.startswith(_CBOR_SELF_DESCRIBED) else 0
    head = payload[start]
    if head >> 5 != 5:  # major type 5: a map
        return None
    info = head & 31
    stream = io.BytesIO(payload)
    stream.seek(start + 1)
    if info < 24:
        count = info
    elif info <= 27:
        width = 1 << (info - 24)
        count = int.from_bytes(stream.read(width), "big")
    elif info == 31:  # indefinite length, closed by a break (0xff)
        count = SALVAGE_STEPS
    else:
        return None
    decoder = cbor2.CBORDecoder(stream)  # its default nesting limit; a value past it ends the search
    found: Any = None
    for _ in range(min(count, SALVAGE_STEPS)):
        if info == 31 and payload[stream.tell() : stream.tell() + 1] in (b"\xff", b""):
            break
        try:
            key = decoder.decode()
            value = decoder.decode()
        except Exception:  # whatever cbor2 raises on the entry it cannot read: keep what was read before it
            break
        if isinstance(key, str) and key == "id":
            found = value
    return found


def _msgpack_member_id(payload: bytes) -> Any:
    """The value of the last ``id`` key read in a MessagePack map; the other values are skipped, not built."""
    import msgpack

    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(payload))
    unpacker.feed(payload)
    found: Any = None
    try:
        count = unpacker.read_map_header()
        for _ in range(min(count, SALVAGE_STEPS)):
            key = unpacker.unpack()
            if isinstance(key, str) and key == "id":
                found = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # whatever msgpack raises on the entry it cannot read: keep what was read before it
        pass
    return found
