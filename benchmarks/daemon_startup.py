"""`edgeline run` start-up, side by side: time from process start to the first published result, and the
daemon's peak resident memory, for the same model as a LiteRT bundle and as an ExecuTorch bundle.

    python benchmarks/daemon_startup.py --bundles artifacts/bench/bundles --write benchmarks/results/daemon_startup.md

Uses bundles made by benchmarks/runtime_overhead.py (same --work directory) and a real Mosquitto on loopback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import publish

from tests.mqtt_broker import running_broker

TIMEOUT_S = 60.0


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def one_run(bundle: Path, broker_address: str, host: str, port: int, payload: bytes, topic: str) -> tuple[float, float]:
    got = threading.Event()
    listener = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    listener.on_message = lambda *_: got.set()
    listener.connect(host, port)
    listener.subscribe(f"{topic}/results/#", qos=1)
    listener.loop_start()
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--broker", broker_address,
         "--subscribe", f"{topic}/in/+", "--publish", f"{topic}/results/{{device}}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Publish until the first answer: the daemon is subscribed only once it has started.
        while not got.wait(0.01):
            listener.publish(f"{topic}/in/dev", payload, qos=0)
            if time.perf_counter() - start > TIMEOUT_S or process.poll() is not None:
                raise RuntimeError(f"no result from {bundle}: {process.stderr.read() if process.stderr else ''}")
        elapsed = time.perf_counter() - start
        rss = peak_rss_mb(process.pid)
    finally:
        process.terminate()
        process.communicate(timeout=TIMEOUT_S)
        listener.loop_stop()
        listener.disconnect()
    return elapsed, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundles", type=Path, default=Path("artifacts/bench/bundles"))
    parser.add_argument("--models", nargs="*", default=["ds_cnn", "resnet8"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    rows = []
    with running_broker() as broker:
        for name in args.models:
            variants = [(b, p) for b in ("litert", "executorch-xnnpack") for p in ("int8-static",)]
            timings: dict[str, list[tuple[float, float]]] = {}
            import edgeline

            for round_index in range(args.rounds):  # interleaved
                for backend, precision in variants:
                    bundle = args.bundles / f"{name}-{backend}-{precision}"
                    spec = edgeline.read_bundle(bundle).manifest.inputs[0]
                    count = 1
                    for dim in spec.shape:
                        count *= dim
                    payload = json.dumps({"data": [0.25] * count}).encode()
                    topic = f"bench/{name}/{backend}/{round_index}"
                    timings.setdefault(backend, []).append(
                        one_run(bundle, broker.address, broker.host, broker.port, payload, topic)
                    )
            for backend, results in timings.items():
                rows.append(
                    (name, backend, statistics.median(t for t, _ in results), statistics.median(m for _, m in results))
                )
    lines = ["| model | bundle | start to first result (s) | peak RSS (MB) |", "|---|---|---|---|"]
    lines += [f"| {n} | {b} int8-static | {t:.2f} | {m:.0f} |" for n, b, t, m in rows]
    publish(
        "\n".join(lines),
        script=__file__,
        title="Daemon start-up: LiteRT vs ExecuTorch bundle",
        intro=f"Median of {args.rounds} interleaved runs on this machine (2 cores, shared: compare within the run). "
        "Time from spawning `edgeline run` to the first result received by a subscriber through a local Mosquitto; "
        "peak RSS (VmHWM) of the daemon process.",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
