"""The firmware bridge's wire protocol, version 1: framed, checked, sequenced messages between a microcontroller and
the host over a serial link (``docs/firmware-protocol.md`` spells it; this module is the host's side).

A frame is COBS-encoded and ends with one ``0x00`` byte, so a receiver finds the next frame after any garbage: the
delimiter never occurs inside. Decoded, it is, little-endian::

    u8 version (1) | u8 type | u8 flags | u8 stream | u16 seq | u64 t_us | payload | u32 crc32

``crc32`` is IEEE CRC-32 (``zlib.crc32``) over every byte before it. ``Decoder`` takes bytes as they come from a port,
in pieces of any size, and returns whole frames; whatever it refuses (a broken encoding, a short frame, a wrong CRC,
another version, a flag of bits 4-7 it does not know, an oversized frame) is counted by reason and never costs a
later frame. ``SequenceGaps`` counts frames lost on the wire from each stream's ``seq``.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections import Counter
from dataclasses import dataclass

from cobs import cobs

from edgeline.errors import EdgelineError

__all__ = [
    "ACK",
    "CRC_SIZE",
    "FLAG_ACK_REQUESTED",
    "HEADER",
    "MAX_ENCODED",
    "MAX_FRAME",
    "MAX_PAYLOAD",
    "MUST_UNDERSTAND",
    "SEQ_MODULO",
    "VERSION",
    "Decoder",
    "Frame",
    "FrameError",
    "FrameType",
    "SequenceGaps",
    "decode",
    "encode",
    "pack_ack",
    "unpack_ack",
]

VERSION = 1
HEADER = struct.Struct("<BBBBHQ")  # version, type, flags, stream, seq, t_us: 14 bytes
_CRC = struct.Struct("<I")
CRC_SIZE = _CRC.size
"""The CRC-32 after the payload (``EL_CRC_SIZE`` in the C header)."""
ACK = struct.Struct("<BH")  # an ACK's payload: stream, seq
MAX_FRAME = 4096
"""The largest frame, decoded: header, payload and CRC."""
MAX_PAYLOAD = MAX_FRAME - HEADER.size - CRC_SIZE
"""The largest payload a frame carries (``EL_MAX_PAYLOAD``): what a sample or an answer must fit in."""
MAX_ENCODED = MAX_FRAME + MAX_FRAME // 254 + 2
"""The largest frame on the wire, COBS overhead and the delimiter included."""
SEQ_MODULO = 1 << 16

FLAG_ACK_REQUESTED = 0x01
"""Bit 0: the sender wants an ACK once the frame is safe. Bits 0-3 may be ignored by a receiver that does not know
them; bits 4-7 must be understood: a frame with one this version does not define is refused."""
MUST_UNDERSTAND = 0xF0
_UNDERSTOOD = 0x00  # of bits 4-7, those version 1 defines: none


class FrameType(enum.IntEnum):
    # board to host
    HELLO = 1
    SAMPLES = 2
    RESULT = 3
    HEARTBEAT = 4
    LOG = 5
    ACK = 6
    # host to board
    ANSWER = 16
    CONFIG = 17
    HELLO_REQUEST = 18


_TYPES = frozenset(int(t) for t in FrameType)


class FrameError(EdgelineError):
    """A frame refused; ``reason`` is the counter it goes to (``cobs``, ``short``, ``crc``, ``version``, ``type``,
    ``flags``, ``size``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Frame:
    type: int
    stream: int = 0
    seq: int = 0
    t_us: int = 0
    payload: bytes = b""
    flags: int = 0
    version: int = VERSION

    @property
    def ack_requested(self) -> bool:
        return bool(self.flags & FLAG_ACK_REQUESTED)


def encode(frame: Frame) -> bytes:
    """The frame as it goes on the wire: COBS-encoded, then the ``0x00`` delimiter."""
    if not (0 <= frame.stream <= 0xFF and 0 <= frame.seq < SEQ_MODULO and 0 <= frame.t_us < 1 << 64):
        raise FrameError("size", f"frame fields out of range: stream {frame.stream}, seq {frame.seq}")
    body = HEADER.pack(frame.version, frame.type, frame.flags, frame.stream, frame.seq, frame.t_us) + frame.payload
    body += _CRC.pack(zlib.crc32(body))
    if len(body) > MAX_FRAME:
        raise FrameError("size", f"a frame of {len(body)} bytes is larger than the protocol's {MAX_FRAME}")
    return bytes(cobs.encode(body)) + b"\x00"


def decode(packet: bytes) -> Frame:
    """One frame from the bytes between two delimiters (COBS-encoded, the delimiter left out)."""
    if len(packet) > MAX_ENCODED:
        raise FrameError("size", f"{len(packet)} bytes without a delimiter: larger than any frame")
    try:
        body = bytes(cobs.decode(packet))
    except cobs.DecodeError as exc:
        raise FrameError("cobs", f"not a COBS-encoded frame: {exc}") from exc
    if len(body) < HEADER.size + CRC_SIZE:
        raise FrameError("short", f"{len(body)} bytes: shorter than a frame's header and CRC")
    if len(body) > MAX_FRAME:
        raise FrameError("size", f"a frame of {len(body)} bytes is larger than the protocol's {MAX_FRAME}")
    (crc,) = _CRC.unpack_from(body, len(body) - CRC_SIZE)
    if zlib.crc32(body[:-CRC_SIZE]) != crc:
        raise FrameError("crc", "the CRC-32 does not match the frame's bytes")
    version, kind, flags, stream, seq, t_us = HEADER.unpack_from(body)
    if version != VERSION:
        raise FrameError("version", f"protocol version {version}; this host speaks {VERSION}")
    if flags & MUST_UNDERSTAND & ~_UNDERSTOOD:
        raise FrameError("flags", f"flags 0x{flags:02x} set a bit of 4-7 that version {VERSION} does not define")
    if kind not in _TYPES:
        raise FrameError("type", f"frame type {kind} is not one of version {VERSION}'s")
    return Frame(kind, stream, seq, t_us, body[HEADER.size : -CRC_SIZE], flags, version)


def pack_ack(stream: int, seq: int) -> bytes:
    """An ACK's payload: every frame of ``stream`` up to ``seq`` is safe."""
    return ACK.pack(stream, seq % SEQ_MODULO)


def unpack_ack(payload: bytes) -> tuple[int, int]:
    if len(payload) != ACK.size:
        raise FrameError("short", f"an ACK's payload is {ACK.size} bytes, not {len(payload)}")
    stream, seq = ACK.unpack(payload)
    return stream, seq


class Decoder:
    """Frames from a byte stream that arrives in pieces of any size, with what it refused counted.

    Bytes are kept until a delimiter; a run longer than any frame is dropped up to the next delimiter (a resync), so
    no amount of garbage grows the buffer past ``MAX_ENCODED`` or hides a later frame."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._overflowing = False
        self.frames = 0
        self.bytes = 0
        self.resyncs = 0
        self.refused: Counter[str] = Counter()

    def feed(self, data: bytes) -> list[Frame]:
        self.bytes += len(data)
        frames: list[Frame] = []
        start = 0
        while True:
            end = data.find(b"\x00", start)
            if end < 0:
                self._keep(data[start:])
                return frames
            self._keep(data[start:end])
            start = end + 1
            if self._overflowing:  # the end of a run too long to be a frame: the next frame starts here
                self._overflowing = False
                self._buffer.clear()
                continue
            packet, self._buffer = bytes(self._buffer), bytearray()
            if not packet:
                continue  # two delimiters in a row (a sender's flush): nothing between them
            try:
                frames.append(decode(packet))
                self.frames += 1
            except FrameError as exc:
                self.refused[exc.reason] += 1

    def _keep(self, piece: bytes) -> None:
        if self._overflowing:
            return
        self._buffer += piece
        if len(self._buffer) > MAX_ENCODED:
            self._buffer.clear()
            self._overflowing = True
            self.resyncs += 1
            self.refused["size"] += 1


class SequenceGaps:
    """Frames lost on the wire, per stream, from ``seq`` (a per-stream, per-direction count wrapping at 65,536).

    A frame more than half the sequence space ahead of the last one is behind it: a resend (reliable mode) or a
    replay, counted in ``repeats``, not a gap, and the last one stays where it was. When the frame after such a one
    follows it, the stream has jumped there (a board that restarted unseen, a counter reset): gaps are counted from
    there again, instead of every later frame being "behind". A board that restarts starts again from any number:
    call ``reset``."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self._behind: dict[int, int] = {}
        """Per stream, the last frame taken as a repeat: the next one following it means the stream jumped."""
        self.lost = 0
        self.repeats = 0

    def observe(self, stream: int, seq: int) -> int:
        """The frames missing before this one: 0 when it follows the last one, or is a repeat (``repeats``)."""
        last = self._last.get(stream)
        behind = self._behind.pop(stream, None)
        if last is None or (behind is not None and seq == (behind + 1) % SEQ_MODULO):
            self._last[stream] = seq
            return 0
        ahead = (seq - last) % SEQ_MODULO
        if ahead == 0 or ahead > SEQ_MODULO // 2:
            self.repeats += 1
            self._behind[stream] = seq
            return 0
        self._last[stream] = seq
        self.lost += ahead - 1
        return ahead - 1

    def reset(self) -> None:
        self._last.clear()
        self._behind.clear()
