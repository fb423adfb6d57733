"""The firmware bridge's wire protocol, version 1, on the host's side: every frame round-trips byte for byte, and
whatever the wire does to a stream of frames (garbage, truncation, a flipped bit, frames merged or split across
reads) is refused by the CRC or the framing, counted by reason, and costs no later frame."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeline.firmware_bridge
from edgeline.firmware_bridge.protocol import (
    CRC_SIZE,
    FLAG_ACK_REQUESTED,
    HEADER,
    MAX_ENCODED,
    MAX_FRAME,
    MAX_PAYLOAD,
    VERSION,
    Decoder,
    Frame,
    FrameError,
    FrameType,
    SequenceGaps,
    decode,
    encode,
    pack_ack,
    unpack_ack,
)

pytestmark = [pytest.mark.quick, pytest.mark.device]

frames = st.builds(
    Frame,
    type=st.sampled_from(list(FrameType)).map(int),
    stream=st.integers(0, 255),
    seq=st.integers(0, 65535),
    t_us=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=MAX_PAYLOAD),
    flags=st.integers(0, 15),
)


def test_the_c_header_states_the_sizes_of_the_python_side() -> None:
    """The board's header and the host agree on every size by name, so neither side writes ``4096 - 18``."""
    header = (Path(edgeline.firmware_bridge.__file__).parent / "c" / "edgeline_frame.h").read_text()
    defined = dict(re.findall(r"^#define (EL_\w+) (.+)$", header, flags=re.MULTILINE))
    numbers = {name: int(value.rstrip("u")) for name, value in defined.items() if re.fullmatch(r"\d+u?", value)}
    assert numbers["EL_VERSION"] == VERSION
    assert numbers["EL_HEADER_SIZE"] == HEADER.size
    assert numbers["EL_CRC_SIZE"] == CRC_SIZE
    assert numbers["EL_MAX_FRAME"] == MAX_FRAME
    assert defined["EL_MAX_PAYLOAD"] == "(EL_MAX_FRAME - EL_HEADER_SIZE - EL_CRC_SIZE)"


@given(frames)
def test_every_frame_round_trips(frame: Frame) -> None:
    wire = encode(frame)
    assert wire.endswith(b"\x00") and b"\x00" not in wire[:-1]
    assert len(wire) <= MAX_ENCODED
    assert decode(wire[:-1]) == frame


def test_the_layout_is_the_documented_one() -> None:
    """u8 version | u8 type | u8 flags | u8 stream | u16 seq | u64 t_us | payload | u32 crc32, little-endian, the
    CRC as zlib.crc32 over every byte before it: a frame built by hand decodes."""
    body = bytes([1, 2, FLAG_ACK_REQUESTED, 7]) + (513).to_bytes(2, "little") + (10**12).to_bytes(8, "little") + b"ab"
    body += zlib.crc32(body).to_bytes(4, "little")
    from cobs import cobs

    frame = decode(bytes(cobs.encode(body)))
    assert frame == Frame(FrameType.SAMPLES, 7, 513, 10**12, b"ab", FLAG_ACK_REQUESTED)
    assert frame.ack_requested
    assert encode(frame) == bytes(cobs.encode(body)) + b"\x00"


def test_a_frame_larger_than_the_protocol_allows_is_refused_at_both_ends() -> None:
    with pytest.raises(FrameError, match="larger than the protocol's 4096"):
        encode(Frame(FrameType.SAMPLES, payload=bytes(MAX_FRAME)))


@pytest.mark.parametrize(
    ("version", "flags", "kind", "reason"),
    [(2, 0, 2, "version"), (1, 0x10, 2, "flags"), (1, 0x80, 2, "flags"), (1, 0, 99, "type")],
)
def test_frames_this_version_does_not_understand_are_refused_by_reason(
    version: int, flags: int, kind: int, reason: str
) -> None:
    wire = encode(Frame(kind, flags=flags, version=version)) if kind != 99 else None
    if wire is None:
        body = HEADER.pack(version, kind, flags, 0, 0, 0)
        from cobs import cobs

        wire = bytes(cobs.encode(body + zlib.crc32(body).to_bytes(4, "little"))) + b"\x00"
    decoder = Decoder()
    assert decoder.feed(wire) == []
    assert decoder.refused == {reason: 1}


def test_flag_bits_0_to_3_a_receiver_does_not_know_are_ignored() -> None:
    assert decode(encode(Frame(FrameType.HEARTBEAT, flags=0x0E))[:-1]).flags == 0x0E


def _damage(data: st.DataObject, wire: bytes) -> bytes:
    """One fault of the wire on one encoded frame (delimiter included)."""
    fault = data.draw(st.sampled_from(["flip", "truncate", "garbage"]))
    if fault == "flip":
        position = data.draw(st.integers(0, len(wire) - 2))
        bit = data.draw(st.integers(0, 7))
        damaged = bytearray(wire)
        damaged[position] ^= 1 << bit
        return bytes(damaged)
    if fault == "truncate":
        return wire[: data.draw(st.integers(0, len(wire) - 2))] + b"\x00"
    return data.draw(st.binary(min_size=1, max_size=64)) + b"\x00"


@settings(max_examples=200, deadline=None)
@given(st.lists(frames, min_size=1, max_size=12), st.data())
def test_faults_cost_only_the_damaged_frames_in_any_split_of_the_stream(sent: list[Frame], data: st.DataObject) -> None:
    damaged = set(data.draw(st.sets(st.integers(0, len(sent) - 1))))
    stream = b"".join(_damage(data, encode(f)) if i in damaged else encode(f) for i, f in enumerate(sent))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    decoder = Decoder()
    got: list[Frame] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):  # merged and split across reads
        got += decoder.feed(stream[start:end])
    intact = [f for i, f in enumerate(sent) if i not in damaged]
    # every intact frame arrives, in order; a damaged one never arrives as something else
    assert [f for f in got if f in intact] == intact
    assert all(f in sent for f in got)  # nothing the wire made up (a CRC collision is a 1-in-2^32 chance)
    refused = sum(decoder.refused.values())
    assert decoder.frames == len(got)
    # a damaged frame is refused (counted) unless the fault left it a valid frame (a flip caught by nothing cannot
    # pass the CRC; garbage may hold a valid frame only by a 1-in-2^32 chance, and is then delivered)
    assert refused + decoder.frames >= len(intact)
    assert decoder.bytes == len(stream)


def test_garbage_longer_than_any_frame_is_dropped_and_the_next_frame_arrives() -> None:
    decoder = Decoder()
    noise = bytes(range(1, 256)) * 40  # 10,200 bytes without a delimiter
    frame = Frame(FrameType.LOG, payload=b"after the noise")
    got = decoder.feed(noise[:5000]) + decoder.feed(noise[5000:] + b"\x00" + encode(frame))
    assert got == [frame]
    assert decoder.resyncs == 1 and decoder.refused == {"size": 1}


def test_acks_carry_a_stream_and_a_sequence_number() -> None:
    assert unpack_ack(pack_ack(3, 70000)) == (3, 70000 % 65536)
    with pytest.raises(FrameError):
        unpack_ack(b"\x01")


def test_sequence_gaps_count_frames_lost_on_the_wire_across_the_wrap() -> None:
    gaps = SequenceGaps()
    for seq in (65533, 65534, 1, 2, 2, 5):  # 65535 and 0 lost at the wrap, 2 repeated, 3 and 4 lost
        gaps.observe(0, seq)
    assert (gaps.lost, gaps.repeats) == (4, 1)
    assert gaps.observe(1, 100) == 0  # another stream counts on its own
