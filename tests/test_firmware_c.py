"""The board's side of the wire protocol (firmware_bridge/c/edgeline_frame.h) against the host's, byte for byte:
test vectors made by the Python codec are encoded by the C header into the same bytes and decoded by it one byte
at a time into the same fields; damaged vectors are refused and counted by the same reasons. Compiled with the
host's gcc (C99, warnings as errors)."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from edgeline.firmware_bridge.protocol import HEADER, MAX_FRAME, Decoder, Frame, FrameType, encode

REPO = Path(__file__).resolve().parents[1]
HEADER_FILE = REPO / "firmware_bridge" / "c" / "edgeline_frame.h"

PROGRAM = r"""
#include <stdio.h>
#include "edgeline_frame.h"

typedef struct { uint8_t type, flags, stream; uint16_t seq; uint64_t t_us; const uint8_t *payload; size_t n;
                 const uint8_t *wire; size_t wire_len; } vector;
#include "vectors.inc"

static uint8_t out[EL_MAX_ENCODED];

int main(void) {
    int failures = 0;
    el_decoder d;
    el_decoder_init(&d);
    for (size_t i = 0; i < sizeof VECTORS / sizeof VECTORS[0]; i++) {
        const vector *v = &VECTORS[i];
        el_frame f = {v->type, v->flags, v->stream, v->seq, v->t_us, v->payload, v->n};
        size_t n = el_encode(&f, out, sizeof out);
        if (n != v->wire_len || memcmp(out, v->wire, n) != 0) { printf("encode %zu differs\n", i); failures++; }
        int got = 0;
        el_frame g;
        for (size_t j = 0; j < v->wire_len; j++) got += el_decode_byte(&d, v->wire[j], &g);
        if (got != 1 || g.type != v->type || g.flags != v->flags || g.stream != v->stream || g.seq != v->seq ||
            g.t_us != v->t_us || g.payload_len != v->n || (v->n && memcmp(g.payload, v->payload, v->n) != 0)) {
            printf("decode %zu differs\n", i); failures++;
        }
    }
    for (size_t j = 0; j < sizeof DAMAGED; j++) { el_frame g; el_decode_byte(&d, DAMAGED[j], &g); }
    printf("frames %u cobs %u short %u crc %u version %u flags %u type %u size %u failures %d\n",
           (unsigned)d.counts.frames, (unsigned)d.counts.cobs, (unsigned)d.counts.shorts, (unsigned)d.counts.crc,
           (unsigned)d.counts.version, (unsigned)d.counts.flags, (unsigned)d.counts.type, (unsigned)d.counts.size,
           failures);
    return failures != 0;
}
"""


def _c_bytes(data: bytes) -> str:
    return "{" + ",".join(str(b) for b in data) + "}" if data else "{0}"


def _vectors() -> list[Frame]:
    rng = random.Random(0)
    lengths = [0, 1, 2, 235, 236, 237, 253, 254, 255, 508, 509, 1000, MAX_FRAME - HEADER.size - 4]
    made = []
    for index, length in enumerate(lengths):
        # runs of non-zero bytes across COBS's 254-byte blocks, and zeros in every position class
        payload = bytes(rng.choice([0, 1, 0x7F, 0xFF, rng.randrange(256)]) for _ in range(length))
        if index % 3 == 0:
            payload = bytes(b or 1 for b in payload)  # no zero at all: the longest blocks
        made.append(Frame(int(list(FrameType)[index % len(FrameType)]), rng.randrange(256), rng.randrange(65536),
                          rng.randrange(2**64), payload, rng.randrange(16)))  # fmt: skip
    return made


@pytest.fixture(scope="module")
def gcc() -> str:
    found = shutil.which("gcc")
    assert found is not None, "the host's gcc (Debian's build-essential) builds the board's side for this test"
    return found


def test_the_c_header_encodes_and_decodes_the_host_s_frames_byte_for_byte(gcc: str, tmp_path: Path) -> None:
    frames = _vectors()
    lines = []
    for i, frame in enumerate(frames):
        lines.append(f"static const uint8_t P{i}[] = {_c_bytes(frame.payload)};")
        lines.append(f"static const uint8_t W{i}[] = {_c_bytes(encode(frame))};")
    lines.append("static const vector VECTORS[] = {")
    for i, f in enumerate(frames):
        wire = encode(f)
        lines.append(f"  {{{f.type}, {f.flags}, {f.stream}, {f.seq}, {f.t_us}ull, P{i}, {len(f.payload)}, W{i}, "
                     f"{len(wire)}}},")  # fmt: skip
    lines.append("};")
    # the same faults the host counts: a flipped bit, a truncated frame, another version, an unknown must-understand
    # flag, an unknown type, a run longer than any frame; then a good frame, which must still arrive
    good = encode(Frame(FrameType.HEARTBEAT, seq=7))
    flipped = bytearray(encode(Frame(FrameType.LOG, payload=b"bit")))
    flipped[5] ^= 0x10
    damaged = (
        bytes(flipped) + encode(Frame(FrameType.LOG, payload=b"cut"))[:9] + b"\x00"
        + encode(Frame(FrameType.LOG, version=2)) + encode(Frame(FrameType.LOG, flags=0x20))
        + encode(Frame(99)) + bytes([1 + i % 255 for i in range(5000)]) + b"\x00" + good
    )  # fmt: skip
    lines.append(f"static const uint8_t DAMAGED[] = {_c_bytes(damaged)};")
    (tmp_path / "vectors.inc").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.c").write_text(PROGRAM)
    binary = tmp_path / "test"
    subprocess.run([gcc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2", f"-I{HEADER_FILE.parent}",
                    f"-I{tmp_path}", str(tmp_path / "test.c"), "-o", str(binary)], check=True)  # fmt: skip
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout
    host = Decoder()
    got = host.feed(damaged)
    counts = dict(part.split(" ") for part in _pairs(done.stdout.strip()))
    assert got == [Frame(FrameType.HEARTBEAT, seq=7)]
    assert int(counts["frames"]) == len(frames) + 1
    for reason, c_name in (("crc", "crc"), ("version", "version"), ("flags", "flags"), ("type", "type"),
                           ("size", "size")):  # fmt: skip
        assert int(counts[c_name]) == host.refused[reason], (reason, done.stdout, host.refused)
    # a truncated frame is a short one or a COBS error, on either side alike
    assert int(counts["short"]) + int(counts["cobs"]) == host.refused["short"] + host.refused["cobs"]


def _pairs(text: str) -> list[str]:
    words = text.split()
    return [f"{words[i]} {words[i + 1]}" for i in range(0, len(words), 2)]
