"""JSON number lists to float32, side by side in one run: the checked path (a type check over every value, then
``np.fromiter``) against the fast path the JSON codec takes (the values flattened, packed as float64 by
``struct.pack`` in one C loop and narrowed to float32 by numpy; booleans still refused), and the whole
``JsonCodec.decode``, whose first step, ``orjson.loads``, is shown alone for scale. The decoder runs twice: as it
ships (simdjson reads a flat list of numbers straight into float64, orjson takes the rest) and with orjson alone
(as on a platform without a pysimdjson wheel).

    python benchmarks/json_decode.py --write benchmarks/results/json_decode.md

Sizes are those of the reference models' inputs: 490 values (DS-CNN), 3,072 (ResNet-8), 27,648 (VWW); values
carry 4 decimals, as in ``daemon_throughput.py``. Each figure is the best of 15 repeats of 300 calls,
interleaved, in microseconds per message.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import publish

from edgeline.daemon import codecs
from edgeline.manifest import TensorSpec

SIZES = {
    "DS-CNN (49 x 10)": (1, 49, 10, 1),
    "ResNet-8 (32 x 32 x 3)": (1, 32, 32, 3),
    "VWW (96 x 96 x 3)": (1, 96, 96, 3),
}


def best_us(call: str, scope: dict[str, object], number: int, repeats: int) -> float:
    return min(timeit.repeat(call, globals=scope, number=number, repeat=repeats)) / number * 1e6


def measure(shape: tuple[int, ...], nested: bool, number: int, repeats: int) -> dict[str, float]:
    values = np.round(np.random.default_rng(0).random(shape), 4)
    data = values.reshape(-1, shape[-1]).tolist() if nested else values.reshape(-1).tolist()
    text = json.dumps({"id": "m1", "data": data}).encode()
    spec = TensorSpec(name="input", dtype="float32", shape=shape)
    scope: dict[str, object] = {
        "codecs": codecs, "data": data, "text": text, "n": len(text), "orjson": orjson,
        "codec": codecs.JsonCodec(), "orjson_codec": codecs.JsonCodec(simdjson=False), "specs": [spec],
    }  # fmt: skip
    fast = codecs._numbers(data, "data", len(text), text)
    checked = codecs._numbers(data, "data", len(text))
    assert fast.dtype == checked.dtype and fast.tobytes() == checked.tobytes(), "the two paths disagree"
    shipped, alone = scope["codec"].decode(text, [spec]), scope["orjson_codec"].decode(text, [spec])  # type: ignore[attr-defined]
    assert shipped.arrays[0].tobytes() == alone.arrays[0].tobytes(), "simdjson and orjson disagree"
    calls = {
        "checked path": "codecs._numbers(data, 'data', n)",
        "fast path": "codecs._numbers(data, 'data', n, text)",
        "orjson.loads": "orjson.loads(text)",
        "JsonCodec.decode, orjson alone": "orjson_codec.decode(text, specs)",
        "JsonCodec.decode": "codec.decode(text, specs)",
    }
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):  # interleaved, so that a slow moment of the machine hits every column alike
        for name, call in calls.items():
            best[name] = min(best[name], best_us(call, scope, number, 1))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the table (markdown) to this file")
    parser.add_argument("--number", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    lines = [
        "| input | layout | checked path µs | fast path µs | speed-up | orjson.loads µs "
        "| JsonCodec.decode, orjson alone µs | JsonCodec.decode µs (simdjson) | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, shape in SIZES.items():
        for nested in (False, True):
            best = measure(shape, nested, args.number, args.repeats)
            lines.append(
                f"| {label} | {'nested rows' if nested else 'flat'} | {best['checked path']:.1f} | "
                f"{best['fast path']:.1f} | {best['checked path'] / best['fast path']:.2f}x | "
                f"{best['orjson.loads']:.1f} | {best['JsonCodec.decode, orjson alone']:.1f} | "
                f"{best['JsonCodec.decode']:.1f} | "
                f"{best['JsonCodec.decode, orjson alone'] / best['JsonCodec.decode']:.2f}x |"
            )
    publish(
        "\n".join(lines),
        script=__file__,
        title="JSON number lists to float32: the checked path against the fast path",
        intro=(
            f"Best of {args.repeats} interleaved repeats of {args.number} calls, µs per message, on this machine. "
            "The checked path is what every map codec used before; JSON now takes the fast path and falls back to "
            "the checked one for anything that is not a regular list of numbers (which then gets its precise error). "
            "`JsonCodec.decode` is the whole decoder (parse, conversion, finite check): with orjson alone, and as "
            "it ships, where simdjson reads flat lists (nested rows decline it and take orjson's path)."
        ),
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
