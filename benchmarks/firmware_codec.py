"""The board's side of the wire protocol (firmware_bridge/c/edgeline_frame.h) on Cortex-M cores: the flash and RAM
each part takes, built by Debian's arm-none-eabi-gcc at -Os and measured with arm-none-eabi-size. Each row is one
small firmware object that uses the part (and nothing else of the header); RAM is the static state a board keeps.

    python benchmarks/firmware_codec.py --write benchmarks/results/firmware_codec.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from report import markdown_table, publish  # benchmarks/report.py, next to this script

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "firmware_bridge" / "c"

PARTS = {
    "CRC-32 (bitwise, no table)": ("uint32_t use(const uint8_t *p, size_t n) { return el_crc32(0, p, n); }",),
    "encoder (el_encode, with CRC-32)": (
        "size_t use(const el_frame *f, uint8_t *out, size_t cap) { return el_encode(f, out, cap); }",
    ),
    "decoder (el_decode_byte, with CRC-32)": (
        "int use(el_decoder *d, uint8_t b, el_frame *f) { return el_decode_byte(d, b, f); }",
    ),
    "decoder state (one el_decoder)": ("el_decoder decoder;",),
    "encode buffer (EL_MAX_ENCODED bytes)": ("uint8_t wire[EL_MAX_ENCODED];",),
}

CORES = ("cortex-m0plus", "cortex-m4", "cortex-m55")


def size_of(source: str, core: str, work: Path) -> tuple[int, int]:
    """(flash, RAM) in bytes of one object: text + data, and data + bss."""
    path = work / "part.c"
    path.write_text(f'#include "edgeline_frame.h"\n{source}\n')
    obj = work / "part.o"
    subprocess.run(["arm-none-eabi-gcc", "-std=c99", "-Wall", "-Werror", f"-mcpu={core}", "-mthumb", "-Os",
                    "-ffreestanding", "-fno-common", f"-I{HEADER}", "-c", str(path), "-o", str(obj)],
                   check=True)  # fmt: skip
    lines = subprocess.run(["arm-none-eabi-size", str(obj)], capture_output=True, text=True, check=True).stdout
    text, data, bss = (int(v) for v in lines.splitlines()[1].split()[:3])
    return text + data, data + bss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    version = subprocess.run(["arm-none-eabi-gcc", "--version"], capture_output=True, text=True, check=True)
    rows = [("part", *[f"{core} flash / RAM" for core in CORES])]
    with tempfile.TemporaryDirectory() as scratch:
        for name, (source,) in PARTS.items():
            cells = []
            for core in CORES:
                flash, ram = size_of(source, core, Path(scratch))
                cells.append(f"{flash:,} B / {ram:,} B")
            rows.append((name, *cells))
    publish(
        markdown_table(rows),
        script=__file__,
        title="The firmware bridge's C codec on Cortex-M cores: flash and RAM",
        intro=(
            f"Built with {version.stdout.splitlines()[0]} at -Os, -mthumb; sizes from arm-none-eabi-size of one "
            "object per part (flash: text + data; RAM: data + bss). The decoder keeps one whole frame (4,096 bytes) "
            "to check its CRC before handing it over; the encoder writes into the caller's buffer, which is the "
            "board's to size (EL_MAX_ENCODED fits the largest frame)."
        ),
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
