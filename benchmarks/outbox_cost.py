"""What the durable outbox costs `edgeline run` in throughput: the daemon with it and without it, side by side.

``daemon_throughput.py`` measures the outbox's cost as 1 - on/off between two of its four consumers, whose rounds
are minutes apart: on this shared 2-core machine one round's figure ranges over -38% to +45%. This runs only those
two consumers, in pairs one right after the other (the order turns each pair), with the same load and method
(``daemon_throughput.run_consumer``: 4,000 messages at QoS 1 as fast as one publisher can, after 300 untimed ones
to each fresh process), and reports the median of the pairs' own costs with its quartiles, and the CPU per message.

    python benchmarks/outbox_cost.py --write benchmarks/results/outbox_cost.md \
        --bundle artifacts/bench/bundles/ds_cnn-litert-int8-static artifacts/bench/bundles/resnet8-litert-int8-static
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_throughput as throughput
from report import publish

from tests.mqtt_broker import Broker, running_broker


def measure(bundle: Path, broker: Broker, scratch: Path, scripts: dict[str, Path], args: argparse.Namespace) -> str:
    import edgeline

    manifest = edgeline.read_bundle(bundle).manifest
    count = int(np.prod(manifest.inputs[0].shape))
    rng = np.random.default_rng(0)
    payloads = throughput.make_payloads([np.round(rng.random(count), 4) for _ in range(args.messages)], args.codec)
    costs, on_rates, off_rates, on_cpu, off_cpu = [], [], [], [], []
    names = [throughput.OUTBOX_ON, throughput.OUTBOX_OFF]
    for pair in range(args.pairs):
        runs = {}
        for number, name in enumerate(names if pair % 2 == 0 else names[::-1]):
            print(f"[{bundle.name} {args.codec}] pair {pair + 1}/{args.pairs}: {name}", file=sys.stderr, flush=True)
            tag = f"outbox/{bundle.name}/{pair}/{number}"
            runs[name] = throughput.run_consumer(
                name, bundle, manifest.name, broker, payloads, scratch, scripts, tag, args.codec, args.warmup
            )
        on, off = runs[throughput.OUTBOX_ON], runs[throughput.OUTBOX_OFF]
        if on.answered < args.messages or off.answered < args.messages:
            raise SystemExit(f"{bundle.name}: a run answered {on.answered} and {off.answered} of {args.messages}")
        costs.append(1 - on.throughput / off.throughput)
        on_rates.append(on.throughput)
        off_rates.append(off.throughput)
        on_cpu.append(on.cpu_us)
        off_cpu.append(off.cpu_us)
    low, high = np.percentile(costs, [25, 75])
    return (
        f"| `{bundle.name}` | {args.codec} | {args.pairs} | {statistics.median(on_rates):.0f} "
        f"| {statistics.median(off_rates):.0f} | **{statistics.median(costs):.1%}** | {low:.1%} to {high:.1%} "
        f"| {min(costs):.1%} to {max(costs):.1%} | {statistics.median(on_cpu):.0f} / {statistics.median(off_cpu):.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bundle", type=Path, nargs="+", default=[Path("artifacts/bench/bundles/ds_cnn-litert-int8-static")]
    )
    parser.add_argument("--codec", choices=["json", "msgpack"], default="msgpack")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    rows = []
    with running_broker() as broker, tempfile.TemporaryDirectory(prefix="edgeline-bench-") as temporary:
        scratch = Path(temporary)
        scripts = {"outbox_off": scratch / "outbox_off.toml"}
        scripts["outbox_off"].write_text("[outbox]\nenabled = false\n")
        for bundle in args.bundle:
            rows.append(measure(bundle, broker, scratch, scripts, args))
    table = "\n".join(
        [
            "| bundle | codec | pairs | on msg/s (median) | off msg/s (median) | outbox cost, median of the pairs "
            "| middle half | lowest to highest | CPU µs/msg on / off |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    publish(
        table,
        script=__file__,
        title="What the durable outbox costs in throughput",
        intro=f"`edgeline run` at QoS 1 with `[outbox]` on (the default: every answer committed to SQLite before its "
        f"input is acknowledged) and off, {args.messages} messages per run after {args.warmup} untimed ones, in "
        f"{args.pairs} interleaved pairs; cost = 1 - on/off per pair (goal: at most 10%).",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
