"""What a shared core costs the daemon's own work: the same code, CPU time per message, alone on a core and sharing it.

``daemon_throughput.py`` runs the daemon next to the broker and the load generator on the same cores, and there the
daemon's threads spend more CPU per message than ``Processor.process`` does in-process. This measures that effect
apart from MQTT: ``Processor.process_batch`` (decode, checks, model, result; batches of the daemon's default
``[queue] max_batch``) runs pinned to one core, in interleaved rounds,

- alone on that core, and
- sharing it with a neighbour process that streams 32 MB through the caches and yields every 0.2 ms (a stand-in
  for a broker and a load generator: it evicts the caches the daemon's code and the model's weights live in).

CPU time is the process's own (``time.process_time``): the neighbour's time is not counted, only what the same work
costs when the caches are not its own. Linux only (CPU affinity).

    python benchmarks/shared_core.py --write benchmarks/results/shared_core.md \
        --bundle artifacts/bench/bundles/ds_cnn-litert-int8-static artifacts/bench/bundles/resnet8-litert-int8-static
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_throughput as throughput
from report import publish

if TYPE_CHECKING:
    from edgeline.daemon.messages import Message

CORE = 0
NEIGHBOUR = """
import os, sys, time
import numpy as np
os.sched_setaffinity(0, {int(sys.argv[1])})
data = np.random.default_rng(0).random(4 << 20)  # 32 MB of float64
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    data.sum()
    time.sleep(0.0002)
"""


def cpu_per_message(
    process_batch: Callable[[list[Message]], object], batches: list[list[Message]], count: int
) -> float:
    """This process's CPU microseconds per message over ``batches`` (``count`` messages in all)."""
    start = time.process_time()
    for batch in batches:
        process_batch(batch)
    return (time.process_time() - start) / count * 1e6


def measure(bundle: Path, codec: str, messages: int, rounds: int) -> str:
    import edgeline
    from edgeline.daemon.codecs import get_codec
    from edgeline.daemon.config import QueueConfig
    from edgeline.daemon.health import Metrics
    from edgeline.daemon.messages import Message
    from edgeline.daemon.processor import Processor

    model = edgeline.load(bundle)
    size = max(1, model.enable_batching(QueueConfig().max_batch))
    count = int(np.prod(model.inputs[0].shape))
    rng = np.random.default_rng(0)
    payloads = throughput.make_payloads([np.round(rng.random(count), 4) for _ in range(messages)], codec)
    processor = Processor(model, get_codec(codec), Metrics(model=model.name, version=1), publish="out/{device}")
    batches = [[Message("in/dev", p, "dev") for p in payloads[i : i + size]] for i in range(0, messages, size)]
    cpu_per_message(processor.process_batch, batches[:4], 4 * size)  # warm-up
    alone, shared = [], []
    for _ in range(rounds):
        alone.append(cpu_per_message(processor.process_batch, batches, messages))
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(CORE), "120"])
        try:
            time.sleep(1.0)  # its 32 MB allocated and streaming
            shared.append(cpu_per_message(processor.process_batch, batches, messages))
        finally:
            neighbour.kill()
            neighbour.wait()
    a, s = statistics.median(alone), statistics.median(shared)
    return (
        f"| `{bundle.name}` | {codec} | {size} | {a:.0f} ({min(alone):.0f}-{max(alone):.0f}) "
        f"| {s:.0f} ({min(shared):.0f}-{max(shared):.0f}) | **{s / a - 1:+.0%}** |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bundle", type=Path, nargs="+", default=[Path("artifacts/bench/bundles/resnet8-litert-int8-static")]
    )
    parser.add_argument("--codec", nargs="+", choices=["json", "msgpack"], default=["json", "msgpack"])
    parser.add_argument("--messages", type=int, default=1600)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("shared_core.py pins processes to a core: Linux only")
    os.sched_setaffinity(0, {CORE})
    rows = [measure(bundle, codec, args.messages, args.rounds) for bundle in args.bundle for codec in args.codec]
    table = "\n".join(
        [
            "| bundle | codec | batch | alone on the core: CPU µs/msg, median (range) | sharing it | cost of sharing |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    publish(
        table,
        script=__file__,
        title="The daemon's own work, alone on a core and sharing it",
        intro=f"`Processor.process_batch` on {args.messages} messages per round, pinned to core {CORE}; median of "
        f"{args.rounds} interleaved rounds (range in brackets). Sharing: a neighbour process on the same core "
        "streams 32 MB through the caches and yields every 0.2 ms. CPU time is this process's own.",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
