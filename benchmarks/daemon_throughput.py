"""End-to-end throughput and latency through a local Mosquitto, side by side in one run: `edgeline run`
against a hand-written baseline (paho-mqtt subscribe -> json -> LiteRT invoke -> publish), same bundle,
same messages, at QoS 0 and QoS 1. Messages are sent as fast as the publisher can (a backlog forms).
The daemon runs twice: as configured by default (queued inputs batched into one call when the model allows it)
and with batching off (``[queue] max_batch = 1``).

    python benchmarks/daemon_throughput.py --write benchmarks/results/daemon_throughput.md \
        --bundle artifacts/bench/bundles/ds_cnn-litert-int8-static artifacts/bench/bundles/resnet8-litert-int8-static
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import publish

from tests.mqtt_broker import running_broker

# The baseline a user would write in ~30 lines: inference on paho's network thread, no checks, no queue.
BASELINE = """
import json, sys
import numpy as np
import paho.mqtt.client as mqtt
from ai_edge_litert.interpreter import Interpreter

model, host, port, topic_in, topic_out, qos = sys.argv[1:7]
port, qos = int(port), int(qos)
it = Interpreter(model_path=model, num_threads=1)
it.allocate_tensors()
inp, out = it.get_input_details()[0], it.get_output_details()[0]
in_scale, in_zero = inp["quantization"]
out_scale, out_zero = out["quantization"]

def on_message(client, userdata, msg):
    message = json.loads(msg.payload)
    x = np.asarray(message["data"], dtype=np.float32).reshape(inp["shape"])
    if inp["dtype"] == np.int8:
        x = np.clip(np.round(x / in_scale) + in_zero, -128, 127).astype(np.int8)
    it.set_tensor(inp["index"], x)
    it.invoke()
    y = it.get_tensor(out["index"])
    if out["dtype"] == np.int8:
        y = (y.astype(np.float32) - out_zero) * out_scale
    result = {"id": message.get("id"), "outputs": y.tolist(), "label": int(np.argmax(y))}
    client.publish(topic_out, json.dumps(result), qos=qos)

client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="baseline")
client.on_connect = lambda c, *a: (c.subscribe(topic_in, qos=qos), print("subscribed", flush=True))
client.on_message = on_message
client.connect(host, port)
client.loop_forever()
"""


def drive(host: str, port: int, topic: str, payloads: list[bytes], qos: int, timeout: float) -> dict[str, float]:
    """Send every payload as fast as possible; collect answers; throughput and send-to-answer latency."""
    sent: dict[str, float] = {}
    answered: dict[str, float] = {}
    done = threading.Event()
    lock = threading.Lock()

    def on_message(client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        identity = json.loads(msg.payload).get("id")
        with lock:
            answered.setdefault(identity, time.perf_counter())
            if len(answered) >= len(payloads):
                done.set()

    listener = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    listener.on_message = on_message
    subscribed = threading.Event()
    listener.on_subscribe = lambda *_: subscribed.set()
    listener.connect(host, port)
    listener.subscribe(f"{topic}/out/#", qos=qos)
    listener.loop_start()
    subscribed.wait(10)
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    publisher.max_inflight_messages_set(1000)
    publisher.connect(host, port)
    publisher.loop_start()
    start = time.perf_counter()
    for index, payload in enumerate(payloads):
        sent[f"m{index}"] = time.perf_counter()
        publisher.publish(f"{topic}/in/dev", payload, qos=qos)
    done.wait(timeout)
    end = max(answered.values(), default=time.perf_counter())
    publisher.loop_stop()
    listener.loop_stop()
    latencies = [answered[i] - sent[i] for i in answered if i in sent]
    return {
        "answered": len(answered),
        "throughput": len(answered) / (end - start) if answered else 0.0,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) * 1000 if latencies else float("nan"),
    }


CONSUMERS = ("baseline", "edgeline run", "edgeline run, max_batch 1")


def batching_of(bundle: Path) -> str:
    import edge_runtime

    model = edge_runtime.load(bundle)
    model.enable_batching(16)
    return f"the daemon batches up to {model.batch_size}" if model.batch_size > 1 else model.batching


def measure(
    broker: object, bundle: Path, baseline_file: Path, unbatched: Path, messages: int, rounds: int
) -> list[tuple[str, int, float, float, float, float]]:
    import edge_runtime

    spec = edge_runtime.read_bundle(bundle).manifest.inputs[0]
    rng = np.random.default_rng(0)
    count = int(np.prod(spec.shape))
    payloads = [
        json.dumps({"id": f"m{i}", "data": rng.random(count, dtype=np.float32).round(4).tolist()}).encode()
        for i in range(messages)
    ]
    host, port, address = broker.host, broker.port, broker.address  # type: ignore[attr-defined]
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for round_index in range(rounds):  # interleaved
        for qos in (0, 1):
            for number, name in enumerate(CONSUMERS):
                topic = f"bench/{bundle.name}/{round_index}/{qos}/{number}"
                if name == "baseline":
                    command = [sys.executable, str(baseline_file), str(bundle / "model.tflite"), host, str(port),
                               f"{topic}/in/+", f"{topic}/out/dev", str(qos)]  # fmt: skip
                else:
                    command = [sys.executable, "-m", "edge_runtime.cli", "run", str(bundle), "--broker", address,
                               "--subscribe", f"{topic}/in/+", "--publish", f"{topic}/out/{{device}}",
                               "--qos", str(qos)]  # fmt: skip
                    if "max_batch 1" in name:
                        command += ["--config", str(unbatched)]
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                try:
                    assert process.stdout is not None
                    while "subscribed" not in (line := process.stdout.readline()):
                        if not line:
                            raise RuntimeError(f"{name} did not start")
                    time.sleep(0.2)
                    results.setdefault((name, qos), []).append(drive(host, port, topic, payloads, qos, timeout=120))
                finally:
                    process.terminate()
                    process.wait(timeout=30)
    rows = [
        (name, qos, *(statistics.median(r[k] for r in runs) for k in ("answered", "throughput", "p50_ms", "p99_ms")))
        for (name, qos), runs in results.items()
    ]
    rows.sort(key=lambda r: (r[1], CONSUMERS.index(r[0])))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bundle", type=Path, nargs="+", default=[Path("artifacts/bench/bundles/ds_cnn-litert-int8-static")]
    )
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    tables = []
    with running_broker() as broker, tempfile.TemporaryDirectory() as scratch:
        baseline_file = Path(scratch) / "baseline.py"
        baseline_file.write_text(BASELINE)
        unbatched = Path(scratch) / "unbatched.toml"
        unbatched.write_text("[queue]\nmax_batch = 1\n")
        for bundle in args.bundle:
            rows = measure(broker, bundle, baseline_file, unbatched, args.messages, args.rounds)
            lines = [
                f"### `{bundle.name}` ({batching_of(bundle)})",
                "",
                "| QoS | consumer | answered / sent | throughput msg/s | latency p50 ms | latency p99 ms |",
                "|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {q} | {n} | {a:.0f} / {args.messages} | {t:.0f} | {p50:.1f} | {p99:.1f} |"
                for n, q, a, t, p50, p99 in rows
            ]
            tables.append("\n".join(lines))
    publish(
        "\n\n".join(tables),
        script=__file__,
        title="Daemon throughput vs a hand-written baseline",
        intro=f"{args.messages} JSON messages per run, sent as fast as one publisher can through a local Mosquitto; "
        f"median of {args.rounds} interleaved rounds. Latency is from publish to the answer's arrival at a "
        "subscriber, so under this backlog it is mostly queueing. The daemon runs with every feature on "
        "(validation, coded errors, status, availability).",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
