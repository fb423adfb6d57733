"""The board's side of the wire protocol (firmware_bridge/c/edgeline_frame.h) against the host's, byte for byte:
test vectors made by the Python codec are encoded by the C header into the same bytes and decoded by it one byte
at a time into the same fields; damaged vectors are refused and counted by the same reasons. Compiled with the
host's gcc (C99, warnings as errors)."""

from __future__ import annotations

import os
import random
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from edgeline.firmware_bridge.protocol import MAX_PAYLOAD, Decoder, Frame, FrameType, encode

pytestmark = pytest.mark.integration

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
    lengths = [0, 1, 2, 235, 236, 237, 253, 254, 255, 508, 509, 1000, MAX_PAYLOAD]
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


def _write_vectors(path: Path) -> tuple[list[Frame], bytes]:
    """vectors.inc: the frames, their wire bytes (from the host's codec) and a stream of damaged frames."""
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
    path.write_text("\n".join(lines) + "\n")
    return frames, damaged


def _expected(frames: list[Frame], damaged: bytes, report: str) -> None:
    """The C decoder's counts (its report line) are the host decoder's, for the same bytes."""
    host = Decoder()
    got = host.feed(damaged)
    counts = dict(part.split(" ") for part in _pairs(report.strip()))
    assert got == [Frame(FrameType.HEARTBEAT, seq=7)]
    assert counts["failures"] == "0", report
    assert int(counts["frames"]) == len(frames) + 1
    for reason in ("crc", "version", "flags", "type", "size"):
        assert int(counts[reason]) == host.refused[reason], (reason, report, host.refused)
    # a truncated frame is a short one or a COBS error, on either side alike
    assert int(counts["short"]) + int(counts["cobs"]) == host.refused["short"] + host.refused["cobs"]


def test_the_c_header_encodes_and_decodes_the_host_s_frames_byte_for_byte(gcc: str, tmp_path: Path) -> None:
    frames, damaged = _write_vectors(tmp_path / "vectors.inc")
    (tmp_path / "test.c").write_text(PROGRAM)
    binary = tmp_path / "test"
    subprocess.run([gcc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2", f"-I{HEADER_FILE.parent}",
                    f"-I{tmp_path}", str(tmp_path / "test.c"), "-o", str(binary)], check=True)  # fmt: skip
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout
    _expected(frames, damaged, done.stdout)


def _pairs(text: str) -> list[str]:
    words = text.split()
    return [f"{words[i]} {words[i + 1]}" for i in range(0, len(words), 2)]


BOARD = r"""
#include "edgeline_frame.h"

typedef struct { uint8_t type, flags, stream; uint16_t seq; uint64_t t_us; const uint8_t *payload; size_t n;
                 const uint8_t *wire; size_t wire_len; } vector;
#include "vectors.inc"

/* -nostdlib: the few string functions the header and the compiler use */
void *memset(void *d, int c, size_t n) { uint8_t *p = d; while (n--) *p++ = (uint8_t)c; return d; }
void *memcpy(void *d, const void *s, size_t n) {
    uint8_t *p = d; const uint8_t *q = s;
    while (n--) *p++ = *q++;
    return d;
}
int memcmp(const void *a, const void *b, size_t n) {
    const uint8_t *p = a, *q = b;
    for (; n; n--, p++, q++) if (*p != *q) return *p - *q;
    return 0;
}

#define UART_DATA (*(volatile uint32_t *)0x40004000u)
#define UART_STATE (*(volatile uint32_t *)0x40004004u)
#define UART_CTRL (*(volatile uint32_t *)0x40004008u)
#define UART_BAUDDIV (*(volatile uint32_t *)0x40004010u)

static void put(char c) { while (UART_STATE & 1u) {} UART_DATA = (uint8_t)c; }
static void say(const char *s) { while (*s) put(*s++); }
static void number(uint32_t v) {
    char digits[10]; int n = 0;
    do { digits[n++] = (char)('0' + v % 10u); v /= 10u; } while (v);
    while (n) put(digits[--n]);
}
static void field(const char *name, uint32_t v) { say(name); put(' '); number(v); put(' '); }

static uint8_t out[EL_MAX_ENCODED];
static el_decoder d;

int main(void) {
    uint32_t failures = 0;
    UART_BAUDDIV = 16u;
    UART_CTRL = 3u;
    el_decoder_init(&d);
    for (size_t i = 0; i < sizeof VECTORS / sizeof VECTORS[0]; i++) {
        const vector *v = &VECTORS[i];
        el_frame f = {v->type, v->flags, v->stream, v->seq, v->t_us, v->payload, v->n};
        size_t n = el_encode(&f, out, sizeof out);
        if (n != v->wire_len || memcmp(out, v->wire, n) != 0) failures++;
        int got = 0;
        el_frame g;
        for (size_t j = 0; j < v->wire_len; j++) got += el_decode_byte(&d, v->wire[j], &g);
        if (got != 1 || g.type != v->type || g.flags != v->flags || g.stream != v->stream || g.seq != v->seq ||
            g.t_us != v->t_us || g.payload_len != v->n || (v->n && memcmp(g.payload, v->payload, v->n) != 0)) {
            failures++;
        }
    }
    for (size_t j = 0; j < sizeof DAMAGED; j++) { el_frame g; el_decode_byte(&d, DAMAGED[j], &g); }
    field("frames", d.counts.frames); field("cobs", d.counts.cobs); field("short", d.counts.shorts);
    field("crc", d.counts.crc); field("version", d.counts.version); field("flags", d.counts.flags);
    field("type", d.counts.type); field("size", d.counts.size); say("failures "); number(failures); say("\n");
    for (;;) {}
}

extern uint32_t _stack_top;
extern uint32_t _sbss, _ebss;
void reset(void) {
    for (uint32_t *p = &_sbss; p < &_ebss; p++) *p = 0;
    main();
}
__attribute__((section(".vectors"), used)) static const void *const VECTOR_TABLE[2] = {&_stack_top, (void *)reset};
"""

LINKER = """
MEMORY { FLASH (rx) : ORIGIN = 0x00000000, LENGTH = 4M
         RAM (rwx) : ORIGIN = 0x20000000, LENGTH = 4M }
SECTIONS {
  .text : { KEEP(*(.vectors)) *(.text*) *(.rodata*) } > FLASH
  .data : { *(.data*) } > RAM
  .bss : { _sbss = .; *(.bss*) *(COMMON) . = ALIGN(4); _ebss = .; } > RAM
  _stack_top = ORIGIN(RAM) + LENGTH(RAM);
}
"""


def test_an_emulated_cortex_m4_encodes_and_decodes_the_host_s_frames_byte_for_byte(tmp_path: Path) -> None:
    """The header built by Debian's arm-none-eabi-gcc for a Cortex-M4 and run on QEMU's mps2-an386: the same
    vectors, the same counts, reported over its UART."""
    compiler, qemu = shutil.which("arm-none-eabi-gcc"), shutil.which("qemu-system-arm")
    assert compiler is not None and qemu is not None, "scripts/setup.sh installs gcc-arm-none-eabi and qemu-system-arm"
    frames, damaged = _write_vectors(tmp_path / "vectors.inc")
    (tmp_path / "board.c").write_text(BOARD)
    (tmp_path / "board.ld").write_text(LINKER)
    firmware = tmp_path / "board.elf"
    subprocess.run([compiler, "-std=c99", "-Wall", "-Wextra", "-Werror", "-mcpu=cortex-m4", "-mthumb", "-Os",
                    "-ffreestanding", "-nostdlib", f"-I{HEADER_FILE.parent}", f"-I{tmp_path}", "-T",
                    str(tmp_path / "board.ld"), str(tmp_path / "board.c"), "-lgcc", "-o", str(firmware)],
                   check=True)  # fmt: skip
    command = [qemu, "-M", "mps2-an386", "-nographic", "-monitor", "none", "-serial", "stdio", "-kernel", str(firmware)]
    board = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    report = b""
    try:
        assert board.stdout is not None
        deadline = time.monotonic() + 60
        while b"\n" not in report and time.monotonic() < deadline:  # the board reports once, then idles
            ready, _, _ = select.select([board.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(board.stdout.fileno(), 4096)
                if not chunk:
                    break
                report += chunk
    finally:
        board.kill()
        board.wait(timeout=10)
    assert b"\n" in report, f"the emulated board reported nothing in 60 s: {report!r}"
    _expected(frames, damaged, report.decode("ascii", "replace").splitlines()[0])
