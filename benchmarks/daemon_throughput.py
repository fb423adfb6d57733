"""`edgeline run` throughput and latency at QoS 1 through a local Mosquitto, against its two rooflines, side by side.

Per bundle and codec, the same N messages (default 4000) are sent as fast as one publisher can (a backlog forms) to:

- ``edgeline run`` as configured by default (outbox on: every answer committed to SQLite before its input is
  acknowledged), and with ``[outbox] enabled = false`` (answers handed straight to the MQTT client);
- the transport roofline: a paho-mqtt program with no model that subscribes at QoS 1, takes the ``id`` out of each
  payload and publishes ``{"id": ...}`` at QoS 1, all on paho's network thread (MQTT 5, receive maximum 65535);
- the hand-written baseline (paho subscribe -> decode -> LiteRT invoke -> publish, inference on the network thread).

Codecs (``--codec``): ``json`` sends ``{"id": "m1", "data": [0.1234, ...]}`` (values with 4 decimals, as a sensor
that rounds its readings sends them); ``msgpack`` sends ``{"id": "m1", "data": <float32 bytes>}``, the binary form
``edgeline run --codec msgpack`` takes without building a Python float per value. Every consumer answers in the
codec it was sent (the transport roofline's answer is only the id).

Each consumer is a separate process; a fresh daemon gets a fresh ``--state-dir`` and a unique ``--instance``.
Each fresh process first answers ``--warmup`` messages (default 300), untimed: the figures are the steady state a
daemon that runs for months is in, not its first half second (a cold interpreter, the outbox's first pages).
The model roofline is ``edgeline.load(bundle)`` called in this process on the same inputs (already decoded):
``predict(x)`` one sample per call, and ``predict_batch`` at the batch size the daemon's default
``[queue] max_batch`` (16) gets from ``Model.enable_batching`` when the model allows batching. The roofline is the
faster of the calls the daemon can make. Rounds are interleaved; each number is the median over rounds.

    python benchmarks/daemon_throughput.py --write benchmarks/results/daemon_throughput.md \
        --bundle artifacts/bench/bundles/ds_cnn-litert-int8-static artifacts/bench/bundles/resnet8-litert-int8-static

The last table sums up every bundle and codec in one row each. To see what the daemon reaches when the model costs
nothing, add the bundles ``benchmarks/null_model.py`` makes (the reference model's input, output and int8 path, a
model that only averages): ``results/daemon_null_model.md`` puts each beside its reference model, in one run.

A smoke run: add ``--messages 300 --warmup 50 --rounds 1 --codec json``. Full scale (5 rounds) takes about 8 minutes
on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgpack
import numpy as np
import orjson
import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import publish

from tests.mqtt_broker import Broker, running_broker

T = TypeVar("T")

QOS = 1
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0

# The baseline a user would write in ~30 lines: inference on paho's network thread, no checks, no queue.
BASELINE = """
import json, sys
import msgpack
import numpy as np
import paho.mqtt.client as mqtt
from ai_edge_litert.interpreter import Interpreter

model, host, port, topic_in, topic_out, qos, client_id, codec = sys.argv[1:9]
port, qos = int(port), int(qos)
loads, dumps = (json.loads, lambda r: json.dumps(r).encode()) if codec == "json" else (msgpack.unpackb, msgpack.packb)
it = Interpreter(model_path=model, num_threads=1)
it.allocate_tensors()
inp, out = it.get_input_details()[0], it.get_output_details()[0]
in_scale, in_zero = inp["quantization"]
out_scale, out_zero = out["quantization"]

def on_message(client, userdata, msg):
    message = loads(msg.payload)
    data = message["data"]
    x = (np.frombuffer(data, "<f4") if isinstance(data, bytes) else np.asarray(data, np.float32)).reshape(inp["shape"])
    if inp["dtype"] == np.int8:
        x = np.clip(np.round(x / in_scale) + in_zero, -128, 127).astype(np.int8)
    it.set_tensor(inp["index"], x)
    it.invoke()
    y = it.get_tensor(out["index"])
    if out["dtype"] == np.int8:
        y = (y.astype(np.float32) - out_zero) * out_scale
    result = {"id": message.get("id"), "outputs": y.tolist(), "label": int(np.argmax(y))}
    client.publish(topic_out, dumps(result), qos=qos)

client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
client.on_connect = lambda c, *a: c.subscribe(topic_in, qos=qos)
client.on_message = on_message
client.connect(host, port)
client.loop_forever()
"""

# The transport roofline: what MQTT alone costs per message, as a careful paho program does it. Everything runs
# on the network thread (no hand-off), only the id is taken out of the payload (JSON: a regex on the first bytes,
# no decoding of the data; MessagePack: unpacking, which leaves the data as one bytes object), and nothing limits
# the number of messages in flight either way.
TRANSPORT = """
import re, sys
import msgpack
import orjson
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

host, port, topic_in, topic_out, qos, client_id, codec = sys.argv[1:8]
port, qos = int(port), int(qos)
ID = re.compile(rb'"id"\\s*:\\s*"([^"]*)"')

def on_message(client, userdata, msg):
    if codec == "json":
        found = ID.search(msg.payload)
        identity = found.group(1).decode() if found else None
        client.publish(topic_out, orjson.dumps({"id": identity}), qos=qos)
    else:
        client.publish(topic_out, msgpack.packb({"id": msgpack.unpackb(msg.payload)["id"]}), qos=qos)

client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
client.max_inflight_messages_set(65535)
client.max_queued_messages_set(0)
client.on_connect = lambda c, *a: c.subscribe(topic_in, qos=qos)
client.on_message = on_message
properties = Properties(PacketTypes.CONNECT)
properties.ReceiveMaximum = 65535
client.connect(host, port, properties=properties)
client.loop_forever()
"""

OUTBOX_ON = "edgeline run (outbox on, default)"
OUTBOX_OFF = "edgeline run, outbox off"
TRANSPORT_ROW = "transport roofline (paho, no model)"
BASELINE_ROW = "hand-written baseline"
CONSUMERS = (TRANSPORT_ROW, OUTBOX_ON, OUTBOX_OFF, BASELINE_ROW)


@dataclass
class Run:
    answered: float
    errors: float
    sent_per_s: float
    throughput: float
    p50_ms: float
    p99_ms: float
    codes: Counter[str]
    """Coded error answers by code."""
    cpu_us: float = float("nan")
    """The consumer process's CPU time (user + system) per message sent, over the run."""
    threads: dict[str, float] = field(default_factory=dict)
    """The same, by thread name (the daemon names its threads for the kernel: ``edgeline-worker``...)."""
    idle: float = float("nan")
    """The machine's idle share over the run (all cores): near 0, the whole machine was the limit."""
    steal: float = float("nan")
    """The share of the run's CPU time the hypervisor gave to other guests (a virtual machine's noise)."""


def drive(broker: Broker, topic: str, payloads: list[bytes], timeout: float, codec: str = "json") -> Run:
    """Send every payload as fast as one publisher can; collect answers; throughput and send-to-answer latency.

    Throughput is answers over the time from the first publish to the last answer; the sending rate is messages
    over the time from the first publish to the last PUBACK. Coded error answers (an answer with an ``error``
    field) are counted apart and not as answered.
    """
    sent: dict[str, float] = {}
    answered: dict[str, float] = {}
    errors: set[str] = set()
    codes: Counter[str] = Counter()
    done = threading.Event()
    lock = threading.Lock()

    loads = orjson.loads if codec == "json" else msgpack.unpackb  # the lightest reader: the load shares the CPU

    def on_message(client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        now = time.perf_counter()
        record = loads(msg.payload)
        identity = record.get("id")
        with lock:
            if "error" in record:
                errors.add(identity)
                codes[str(record["error"].get("code"))] += 1
            else:
                answered.setdefault(identity, now)
            if len(answered) + len(errors) >= len(payloads):
                done.set()

    listener = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    listener.on_message = on_message
    subscribed = threading.Event()
    listener.on_subscribe = lambda *_: subscribed.set()
    listener.connect(broker.host, broker.port)
    listener.subscribe(f"{topic}/out/#", qos=QOS)
    listener.loop_start()
    acknowledged = [0]
    all_acknowledged = threading.Event()
    acknowledged_at = [float("nan")]

    def on_publish(client: mqtt.Client, userdata: object, mid: int, reason: object, properties: object) -> None:
        acknowledged[0] += 1  # paho's network thread only
        if acknowledged[0] == len(payloads):
            acknowledged_at[0] = time.perf_counter()
            all_acknowledged.set()

    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    publisher.max_inflight_messages_set(1000)
    publisher.on_publish = on_publish
    publisher.connect(broker.host, broker.port)
    publisher.loop_start()
    try:
        if not subscribed.wait(10):
            raise RuntimeError("the listener got no SUBACK")
        start, machine = time.perf_counter(), machine_times()
        for index, payload in enumerate(payloads):
            sent[f"m{index}"] = time.perf_counter()
            publisher.publish(f"{topic}/in/dev", payload, qos=QOS)
        done.wait(timeout)
        spent = [after - was for after, was in zip(machine_times(), machine, strict=True)]
        all_acknowledged.wait(5)
    finally:
        publisher.loop_stop()
        listener.loop_stop()
        publisher.disconnect()
        listener.disconnect()
    with lock:
        arrivals = dict(answered)
    end = max(arrivals.values(), default=time.perf_counter())
    latencies = [arrivals[i] - sent[i] for i in arrivals if i in sent]
    return Run(
        answered=len(arrivals),
        errors=len(errors),
        sent_per_s=len(payloads) / (acknowledged_at[0] - start),
        throughput=len(arrivals) / (end - start) if arrivals else 0.0,
        p50_ms=statistics.median(latencies) * 1000 if latencies else float("nan"),
        p99_ms=float(np.percentile(latencies, 99)) * 1000 if latencies else float("nan"),
        codes=codes,
        idle=(spent[3] + spent[4]) / max(sum(spent), 1),
        steal=spent[7] / max(sum(spent), 1),
    )


def wait_ready(broker: Broker, process: subprocess.Popen[bytes], client_id: str, topic_filter: str, since: int) -> None:
    """Until the broker logs the consumer's subscription (then nothing published later is missed)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not broker.wait_for_subscription(client_id, topic_filter, timeout=0.5, since=since):
        if process.poll() is not None:
            raise RuntimeError(f"{client_id} exited with code {process.returncode} before subscribing")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{client_id} did not subscribe to {topic_filter} within {START_TIMEOUT_S:g} s")


def consumer_command(
    name: str, bundle: Path, broker: Broker, topic: str, client_id: str, scripts: dict[str, Path], state: Path,
    instance: str, codec: str,
) -> list[str]:  # fmt: skip
    if name == BASELINE_ROW:
        return [sys.executable, str(scripts["baseline"]), str(bundle / "model.tflite"), broker.host, str(broker.port),
                f"{topic}/in/+", f"{topic}/out/dev", str(QOS), client_id, codec]  # fmt: skip
    if name == TRANSPORT_ROW:
        return [sys.executable, str(scripts["transport"]), broker.host, str(broker.port), f"{topic}/in/+",
                f"{topic}/out/dev", str(QOS), client_id, codec]  # fmt: skip
    command = [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--broker", broker.address,
               "--subscribe", f"{topic}/in/+", "--publish", f"{topic}/out/{{device}}", "--qos", str(QOS),
               "--state-dir", str(state), "--instance", instance, "--codec", codec]  # fmt: skip
    if name == OUTBOX_OFF:
        command += ["--config", str(scripts["outbox_off"])]
    return command


def machine_times() -> list[int]:
    """The machine's CPU time counters (``/proc/stat``'s first line: user, nice, system, idle, iowait, irq,
    softirq, steal)."""
    return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process so far (Linux ``/proc``)."""
    return _stat_seconds(Path(f"/proc/{pid}/stat"))


def thread_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time of each live thread of a process so far, summed by thread name."""
    seconds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            seconds[name] = seconds.get(name, 0.0) + _stat_seconds(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
    return seconds


def _stat_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processor_cost(bundle: Path, payloads: list[bytes], codec: str) -> float:
    """Microseconds per message of the daemon's own work, in-process and without MQTT: ``Processor.process``
    (size check, decode with its checks, model call, interpretation, encode, metrics)."""
    import edgeline
    from edgeline.daemon.codecs import get_codec
    from edgeline.daemon.health import Metrics
    from edgeline.daemon.messages import Message
    from edgeline.daemon.processor import Processor

    model = edgeline.load(bundle)
    processor = Processor(model, get_codec(codec), Metrics(model=model.name, version=1), publish="out/{device}")
    return microseconds_each(processor.process, [Message("in/dev", payload, "dev") for payload in payloads])


def decode_cost(bundle: Path, payloads: list[bytes], codec: str) -> float:
    """Microseconds per message to turn a payload into the model's float32 input with the daemon's own codec (its
    checks included): work any consumer must add to the transport roofline's before it can run the model."""
    import edgeline
    from edgeline.daemon.codecs import get_codec

    inputs = edgeline.read_bundle(bundle).manifest.inputs
    decoder = get_codec(codec)
    return microseconds_each(lambda payload: decoder.decode(payload, inputs), payloads)


def microseconds_each(call: Callable[[T], object], items: list[T]) -> float:
    """Wall-clock microseconds per ``call(item)`` over ``items``, after the first 50 untimed (warm-up)."""
    for item in items[:50]:
        call(item)
    start = time.perf_counter()
    for item in items:
        call(item)
    return (time.perf_counter() - start) / len(items) * 1e6


def ceiling(transport: Run, extra_us: float) -> tuple[float, float]:
    """The machine's CPU per message under the transport roofline (all processes: broker, load, consumer, kernel),
    and the daemon / roofline a consumer would reach that spends ``extra_us`` more per message and nothing else,
    the machine as busy: ``C / (C + extra)``. Where the broker and the load share the consumer's cores, the model's
    CPU adds to the transport's rather than overlapping it, as ``min(transport, model)`` assumes."""
    machine_us = (os.cpu_count() or 1) * (1 - transport.idle) / transport.throughput * 1e6
    return machine_us, machine_us / (machine_us + extra_us)


def run_consumer(
    name: str, bundle: Path, model_name: str, broker: Broker, payloads: list[bytes], scratch: Path,
    scripts: dict[str, Path], tag: str, codec: str, warmup: int,
) -> Run:  # fmt: skip
    topic = f"bench/{tag}"
    unique = uuid.uuid4().hex[:10]
    daemon = name in (OUTBOX_ON, OUTBOX_OFF)
    client_id = f"edgeline-{model_name}-bench-{unique}" if daemon else f"bench-{unique}"
    state = Path(tempfile.mkdtemp(prefix="state-", dir=scratch))
    command = consumer_command(name, bundle, broker, topic, client_id, scripts, state, f"bench-{unique}", codec)
    since = broker.log_size()
    with open(scratch / f"{unique}.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(broker, process, client_id, f"{topic}/in/+", since)
            if warmup:  # steady state: the first messages of a fresh process (caches, allocations) are not timed
                drive(broker, topic, payloads[:warmup], timeout=60.0, codec=codec)
            before, threads_before = cpu_seconds(process.pid), thread_seconds(process.pid)
            run = drive(broker, topic, payloads, timeout=max(60.0, len(payloads) / 20), codec=codec)
            run.cpu_us = (cpu_seconds(process.pid) - before) / len(payloads) * 1e6
            run.threads = {
                name: (seconds - threads_before.get(name, 0.0)) / len(payloads) * 1e6
                for name, seconds in thread_seconds(process.pid).items()
            }
            return run
        finally:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)


def model_rooflines(bundle: Path, arrays: list[np.ndarray], max_batch: int) -> tuple[float, float | None, str]:
    """Calls per second, in-process: ``predict`` one sample per call, and ``predict_batch`` at the daemon's batch."""
    import edgeline

    model = edgeline.load(bundle)
    for x in arrays[:20]:  # warm-up
        model.predict(x)
    start = time.perf_counter()
    for x in arrays:
        model.predict(x)
    single = len(arrays) / (time.perf_counter() - start)
    size = model.enable_batching(max_batch)
    if size <= 1:
        return single, None, model.batching
    chunks = [[[x] for x in arrays[i : i + size]] for i in range(0, len(arrays) - len(arrays) % size, size)]
    model.predict_batch(chunks[0])
    start = time.perf_counter()
    for chunk in chunks:
        model.predict_batch(chunk)
    batched = sum(len(c) for c in chunks) / (time.perf_counter() - start)
    return single, batched, f"the daemon batches up to {size}"


def make_payloads(data: list[np.ndarray], codec: str) -> list[bytes]:
    if codec == "json":  # float64 values with 4 decimals print as "0.1234"
        return [json.dumps({"id": f"m{i}", "data": d.tolist()}).encode() for i, d in enumerate(data)]
    return [msgpack.packb({"id": f"m{i}", "data": d.astype("<f4").tobytes()}) for i, d in enumerate(data)]


def measure_bundle(
    broker: Broker, bundle: Path, scratch: Path, scripts: dict[str, Path], messages: int, rounds: int, max_batch: int,
    codec: str, warmup: int,
) -> tuple[str, str]:  # fmt: skip
    """The bundle's table and notes, and its row of the summary (``SUMMARY_HEADER``)."""
    import edgeline

    manifest = edgeline.read_bundle(bundle).manifest
    spec = manifest.inputs[0]
    rng = np.random.default_rng(0)
    count = int(np.prod(spec.shape))
    data = [np.round(rng.random(count), 4) for _ in range(messages)]
    payloads = make_payloads(data, codec)
    arrays = [d.astype(np.float32).reshape(spec.shape) for d in data]
    runs: dict[str, list[Run]] = {name: [] for name in CONSUMERS}
    singles: list[float] = []
    costs: list[float] = []
    decodes: list[float] = []
    batches: list[float] = []
    batching = ""
    for round_index in range(rounds):  # interleaved; the order turns each round
        order = CONSUMERS[round_index % len(CONSUMERS) :] + CONSUMERS[: round_index % len(CONSUMERS)]
        for number, name in enumerate(order):
            tag = f"{bundle.name}/{codec}/{round_index}/{number}"
            print(f"[{bundle.name} {codec}] round {round_index + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            runs[name].append(
                run_consumer(name, bundle, manifest.name, broker, payloads, scratch, scripts, tag, codec, warmup)
            )
        single, batched, batching = model_rooflines(bundle, arrays, max_batch)
        costs.append(processor_cost(bundle, payloads, codec))
        decodes.append(decode_cost(bundle, payloads, codec))
        singles.append(single)
        if batched is not None:
            batches.append(batched)

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs[name])

    size = statistics.median(len(p) for p in payloads)
    lines = [
        f"### `{bundle.name}`, {codec} ({size:.0f}-byte messages; {batching})",
        "",
        "| consumer | answered / sent | errors | sent msg/s | throughput msg/s | latency p50 ms | latency p99 ms "
        "| CPU µs/msg | machine idle | steal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONSUMERS:
        lines.append(
            f"| {name} | {median(name, 'answered'):.0f} / {messages} | {median(name, 'errors'):.0f} "
            f"| {median(name, 'sent_per_s'):.0f} | {median(name, 'throughput'):.0f} "
            f"| {median(name, 'p50_ms'):.1f} | {median(name, 'p99_ms'):.1f} | {median(name, 'cpu_us'):.0f} "
            f"| {median(name, 'idle'):.0%} | {median(name, 'steal'):.0%} |"
        )
    model_single = statistics.median(singles)
    lines.append(f"| model roofline: `predict(x)`, 1 sample per call | | | | {model_single:.0f} | | | | | |")
    model_best = model_single
    taken = "`predict(x)`: the daemon cannot batch this model"
    if batches:
        model_batched = statistics.median(batches)
        lines.append(f"| model roofline: `predict_batch`, {max_batch} per call | | | | {model_batched:.0f} | | | | | |")
        model_best = max(model_single, model_batched)
        taken = f"the faster of `predict(x)` and `predict_batch` by {max_batch} (both are calls the daemon makes)"
    lines.append(
        f"| the daemon's own work in-process, no MQTT (`Processor.process`) | | | | "
        f"{1e6 / statistics.median(costs):.0f} | | | {statistics.median(costs):.0f} (wall) | | |"
    )
    for name in CONSUMERS:
        codes = sum((r.codes for r in runs[name]), Counter())
        if codes:
            listed = ", ".join(f"{n} `{code}`" for code, n in codes.most_common())
            lines.append(f"\n{name}: coded error answers over all rounds: {listed}")
    transport = median(TRANSPORT_ROW, "throughput")
    on, off = median(OUTBOX_ON, "throughput"), median(OUTBOX_OFF, "throughput")
    roof = min(transport, model_best)
    which = "transport" if transport <= model_best else "model"
    lines += [
        "",
        f"- outbox cost = 1 - on/off = 1 - {on:.0f}/{off:.0f} = **{1 - on / off:.1%}** (goal <= 10%)"
        if off > 0
        else "- outbox cost: n/a (no answers with the outbox off)",
        f"- roofline = min(transport {transport:.0f}, model {model_best:.0f}) = {roof:.0f} msg/s ({which}); "
        f"model roofline taken: {taken}",
        f"- daemon / roofline = **{on / roof:.2f}** with the outbox on, {off / roof:.2f} with it off (goal >= 0.8)"
        if roof > 0
        else "- daemon / roofline: n/a",
    ]
    lines += spread(runs, model_best)
    lines += by_thread(runs)
    extra = 1e6 / model_best + statistics.median(decodes)
    ceilings = [ceiling(run, extra) for run in runs[TRANSPORT_ROW] if run.throughput > 0]
    nan = float("nan")
    best = statistics.median(r for _, r in ceilings) if ceilings else nan
    outbox_costs, ratios = per_round(runs, model_best)
    summary = (
        f"| `{bundle.name}` | {codec} | {1e6 / model_best:.0f} | {median(OUTBOX_ON, 'cpu_us'):.0f} "
        f"| {on / roof if roof > 0 else nan:.2f} | {statistics.median(ratios) if ratios else nan:.2f} "
        f"| {statistics.median(outbox_costs) if outbox_costs else nan:.1%} | {best:.2f} |"
    )
    if ceilings and roof > 0:
        machine_us = statistics.median(c for c, _ in ceilings)
        lines.append(
            f"- CPU estimate: a consumer that adds only the model ({1e6 / model_best:.0f} µs, the model roofline) and "
            f"the data's decoding ({statistics.median(decodes):.0f} µs, the daemon's codec) to the transport "
            f"roofline's work would reach about **{best:.2f}** of the roofline here (median of the rounds' own); the "
            f"daemon reaches **{on / roof / best:.2f}** of that. Under the transport roofline the machine spends "
            f"C = {machine_us:.0f} µs of CPU per message (all processes, {os.cpu_count()} cores), so C / (C + "
            f"{extra:.0f}): a rough estimate from CPU accounting, as noisy as the rest"
        )
    return "\n".join(lines), summary


SUMMARY_HEADER = (
    "| bundle | codec | model µs/sample | daemon CPU µs/msg | daemon / roofline | rounds' own "
    "| outbox cost (rounds' own) | CPU estimate |\n|---|---|---|---|---|---|---|---|"
)
"""One row per table: the model roofline's time per sample, the daemon's CPU per message (outbox on), daemon /
roofline (medians, and the median of the rounds' own), the outbox cost and the CPU estimate."""


def by_thread(runs: dict[str, list[Run]]) -> list[str]:
    """The daemon's CPU per message by thread (median over rounds), with the outbox on and off: where the CPU goes,
    steadier on a shared machine than throughput is. Threads under 1 µs per message are summed as "others". The
    kernel counts in clock ticks (10 ms on Linux), so a figure is good to one tick over the run's messages: 2.5 µs
    at 4,000."""
    names = {name for row in (OUTBOX_ON, OUTBOX_OFF) for run in runs[row] for name in run.threads}
    if not names:
        return []

    def spent(row: str, name: str) -> float:
        return statistics.median(run.threads.get(name, 0.0) for run in runs[row])

    main = sorted(
        (n for n in names if max(spent(OUTBOX_ON, n), spent(OUTBOX_OFF, n)) >= 1), key=lambda n: -spent(OUTBOX_ON, n)
    )
    parts = [f"`{n}` {spent(OUTBOX_ON, n):.0f} / {spent(OUTBOX_OFF, n):.0f}" for n in main]
    rest = [n for n in names if n not in main]
    if rest:
        parts.append(
            f"others {sum(spent(OUTBOX_ON, n) for n in rest):.0f} / {sum(spent(OUTBOX_OFF, n) for n in rest):.0f}"
        )
    return ["- the daemon's CPU by thread, µs per message (outbox on / off, medians): " + ", ".join(parts)]


def per_round(runs: dict[str, list[Run]], model_best: float) -> tuple[list[float], list[float]]:
    """Each round's outbox cost and daemon / roofline (against that round's transport roofline)."""
    costs, ratios = [], []
    for rnd in range(len(runs[OUTBOX_ON])):
        on, off = runs[OUTBOX_ON][rnd].throughput, runs[OUTBOX_OFF][rnd].throughput
        roof = min(runs[TRANSPORT_ROW][rnd].throughput, model_best)
        if off > 0:
            costs.append(1 - on / off)
        if roof > 0:
            ratios.append(on / roof)
    return costs, ratios


def spread(runs: dict[str, list[Run]], model_best: float) -> list[str]:
    """Each round's outbox cost and daemon / roofline, lowest to highest: how far one round can be from the medians
    above on this machine; and their medians, which pair each daemon run with the roofline measured minutes from it
    (this machine's speed drifts between rounds)."""
    costs, ratios = per_round(runs, model_best)
    if len(ratios) < 2 or not costs:
        return []
    return [
        f"- per round, lowest to highest: outbox cost {min(costs):.1%} to {max(costs):.1%}; "
        f"daemon / roofline {min(ratios):.2f} to {max(ratios):.2f} ({len(ratios)} rounds); "
        f"median of the rounds' own: outbox cost {statistics.median(costs):.1%}, "
        f"daemon / roofline **{statistics.median(ratios):.2f}**"
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bundle", type=Path, nargs="+", default=[Path("artifacts/bench/bundles/ds_cnn-litert-int8-static")]
    )
    parser.add_argument("--codec", nargs="+", choices=["json", "msgpack"], default=["json", "msgpack"])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=300, help="messages each consumer answers before the timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    from edgeline.daemon.config import QueueConfig

    max_batch = QueueConfig().max_batch  # the daemon's default, which the daemon rows run with

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwind: the running consumer and the broker are stopped on the way out

    signal.signal(signal.SIGTERM, interrupted)
    tables, rows = [], []
    with running_broker() as broker, tempfile.TemporaryDirectory(prefix="edgeline-bench-") as temporary:
        scratch = Path(temporary)
        scripts = {"baseline": scratch / "baseline.py", "transport": scratch / "transport.py"}
        scripts["baseline"].write_text(BASELINE)
        scripts["transport"].write_text(TRANSPORT)
        scripts["outbox_off"] = scratch / "outbox_off.toml"
        scripts["outbox_off"].write_text("[outbox]\nenabled = false\n")
        for bundle in args.bundle:
            for codec in args.codec:
                table, row = measure_bundle(
                    broker, bundle, scratch, scripts, args.messages, args.rounds, max_batch, codec, args.warmup
                )
                tables.append(table)
                rows.append(row)
    publish(
        "\n\n".join([*tables, "### Summary\n\n" + "\n".join([SUMMARY_HEADER, *rows])]),
        script=__file__,
        title="Daemon throughput at QoS 1 against its rooflines",
        intro=f"{args.messages} messages per run at QoS 1 ({' and '.join(args.codec)}), sent as fast as one "
        "publisher can through a local "
        "Mosquitto (`sent msg/s`: from the first publish to the last PUBACK), after "
        f"{args.warmup} untimed messages to each fresh consumer process (steady state, not start-up); "
        f"median of {args.rounds} interleaved rounds. Latency is from publish to the "
        "answer's arrival at a subscriber, so under this backlog it is mostly queueing. The daemon runs with every "
        "feature on (validation, coded errors, status, availability); the rooflines are described in "
        "`benchmarks/daemon_throughput.py`. Throughput is bounded by the sending rate: a consumer faster than "
        "`sent msg/s` only shows it.",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
