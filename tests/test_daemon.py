"""The daemon end to end through a real Mosquitto: `edgeline run` as its own process, fed by Debian's
mosquitto_pub (a client we did not write), answers checked by a paho-mqtt subscriber."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeline
from tests import waiting
from tests.mqtt_broker import Broker, Collector

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 20.0


@pytest.fixture
def daemon(broker: Broker, built_litert_bundle: Path, unique_topic: str) -> Iterator[subprocess.Popen[str]]:
    args = [
        sys.executable, "-m", "edgeline.cli", "run", str(built_litert_bundle),
        "--broker", broker.address, "--subscribe", f"{unique_topic}/sensors/+/image",
        "--publish", f"{unique_topic}/results/{{device}}", "--qos", "1", "--instance", "t",
    ]  # fmt: skip
    since = broker.log_size()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client_id = f"edgeline-{edgeline.read_bundle(built_litert_bundle).manifest.name}-t"
    subscribed = broker.wait_for_subscription(
        client_id, f"{unique_topic}/sensors/+/image", timeout=TIMEOUT_S, since=since
    )
    if not subscribed:
        process.kill()
        pytest.fail(f"the daemon did not subscribe: {process.communicate(timeout=10)[1][-3000:]}")
    yield process
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def mosquitto_pub(broker: Broker, topic: str, payload: bytes) -> None:
    subprocess.run(
        ["mosquitto_pub", *broker.client_args, "-q", "1", "-t", topic, "-s"], input=payload, check=True, timeout=10
    )


def stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    return process.returncode, stderr


def then_nothing_more(
    results: Collector, count: int, send_sentinel: Any, sentinel_id: str = "sentinel", decode: Any = json.loads
) -> list[tuple[str, bytes, bool]]:
    """A barrier instead of a pause: with ``count`` answers in, send one more input through the same path and wait
    for its answer; anything extra (a duplicate) would have been sent before it. The ``count`` answers before it."""
    send_sentinel()
    messages = results.wait_for(count + 1)
    assert len(messages) == len(results.messages) == count + 1, [decode(m[1]).get("id") for m in messages]
    assert decode(messages[-1][1])["id"] == sentinel_id, "an answer came after everything else had been answered"
    return messages[:count]


def test_every_input_gets_exactly_one_answer_equal_to_infer(
    broker: Broker, daemon: subprocess.Popen[str], built_litert_bundle: Path, unique_topic: str
) -> None:
    results = Collector(broker, f"{unique_topic}/results/#")
    rng = np.random.default_rng(7)
    images = rng.random((12, 64), dtype=np.float32)
    bad = [b"{oops", json.dumps({"id": "short", "data": [1.0]}).encode(), b'{"id": "nan", "data": [NaN]}']
    for index, row in enumerate(images):
        device = f"cam-{index % 3}"
        mosquitto_pub(
            broker,
            f"{unique_topic}/sensors/{device}/image",
            json.dumps({"id": f"m{index}", "data": row.tolist()}).encode(),
        )
    for payload in bad:
        mosquitto_pub(broker, f"{unique_topic}/sensors/cam-9/image", payload)
    results.wait_for(len(images) + len(bad))
    sentinel = json.dumps({"id": "sentinel", "data": [0.5] * 64}).encode()
    answers = then_nothing_more(  # exactly one answer per input
        results, len(images) + len(bad), lambda: mosquitto_pub(broker, f"{unique_topic}/sensors/cam-0/image", sentinel)
    )
    records = [json.loads(payload) for _, payload, _ in answers]
    by_id = {r["id"]: r for r in records if "error" not in r}
    assert sorted(by_id) == sorted(f"m{i}" for i in range(len(images)))
    model = edgeline.load(built_litert_bundle)
    for index, row in enumerate(images):
        record = by_id[f"m{index}"]
        assert record["device"] == f"cam-{index % 3}"
        np.testing.assert_allclose(np.array(record["outputs"][0]), model.predict(row.reshape(1, 1, 8, 8))[0], rtol=1e-6)
    errors = sorted(r["error"]["code"] for r in records if "error" in r)
    assert errors == ["malformed", "non-finite", "wrong-shape"]
    topics = {topic for topic, _, _ in answers}
    assert f"{unique_topic}/results/cam-9" in topics
    code, stderr = stop(daemon)
    assert code == 0, stderr
    assert "Traceback" not in stderr
    results.close()


def test_availability_online_then_offline_on_sigterm(
    broker: Broker, daemon: subprocess.Popen[str], built_litert_bundle: Path
) -> None:
    name = edgeline.read_bundle(built_litert_bundle).manifest.name
    watcher = Collector(broker, f"edgeline/{name}/t/availability")
    first = watcher.wait_for(1)
    assert first[0][1] == b"online" and first[0][2]  # retained
    code, stderr = stop(daemon)
    assert code == 0, stderr
    assert [payload for _, payload, _ in watcher.wait_for(2)] == [b"online", b"offline"]
    watcher.close()
    late = Collector(broker, f"edgeline/{name}/t/availability")  # a newcomer sees the retained state
    assert late.wait_for(1)[0][1] == b"offline"
    late.close()


def test_an_unreachable_broker_is_a_clear_error(built_litert_bundle: Path, tmp_path: Path) -> None:
    from tests.mqtt_broker import free_port

    args = ["run", str(built_litert_bundle), "--broker", f"127.0.0.1:{free_port()}"]
    done = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert done.returncode == 2
    assert "edgeline run: error: broker 127.0.0.1:" in done.stderr
    assert "Traceback" not in done.stderr


def test_systemd_ready_watchdog_and_stopping(broker: Broker, built_litert_bundle: Path, tmp_path: Path) -> None:
    """Run as systemd would (Type=notify, WatchdogSec): READY once connected, WATCHDOG pings, STOPPING on TERM."""
    import socket

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        receiver.settimeout(3 * TIMEOUT_S)  # a hang guard: a start on a loaded CI machine took over 20 s
        env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
        args = [sys.executable, "-m", "edgeline.cli", "run", str(built_litert_bundle), "--broker", broker.address,
                "--state-dir", str(tmp_path / "state")]  # fmt: skip
        log = tmp_path / "daemon.log"
        with log.open("wb") as out:  # a file, not a pipe nobody reads while it runs (a full pipe blocks the daemon)
            process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert receiver.recv(64) == b"READY=1"
            assert receiver.recv(64) == b"WATCHDOG=1"
            assert receiver.recv(64) == b"WATCHDOG=1"
            process.send_signal(signal.SIGTERM)
            states = []
            while (state := receiver.recv(64)) != b"STOPPING=1":
                states.append(state)
            assert set(states) <= {b"WATCHDOG=1"}
            assert process.wait(timeout=TIMEOUT_S) == 0
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"{exc!r}; the daemon said:\n{log.read_text(errors='replace')[-3000:]}") from exc
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


TORCH_FREE_DAEMON = """
import json, sys, time
from pathlib import Path
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.service import Daemon

bundle, address, topic = sys.argv[1:4]
config = DaemonConfig().with_overrides(broker=address, subscribe=[topic + "/in/+"], publish=topic + "/out/{device}")
daemon = Daemon(Path(bundle), config)
daemon.start()
daemon.connection.publish(topic + "/in/dev", json.dumps({"data": [0.5] * 64}).encode(), qos=1)
deadline = time.monotonic() + 20
while daemon.metrics.snapshot()["counts"].get("results", 0) < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
daemon.stop()
heavy = sorted(m for m in ("torch", "executorch", "litert_torch", "edgeline.export") if m in sys.modules)
print(json.dumps({"results": daemon.metrics.snapshot()["counts"].get("results", 0), "heavy": heavy}))
"""


def test_the_daemon_never_imports_torch_for_a_litert_bundle(
    broker: Broker, built_litert_bundle: Path, unique_topic: str
) -> None:
    args = [sys.executable, "-c", TORCH_FREE_DAEMON, str(built_litert_bundle), broker.address, unique_topic]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"results": 1, "heavy": []}


def test_a_simulated_fleet_through_the_daemon_matches_edgeline_infer(
    broker: Broker,
    daemon: subprocess.Popen[str],
    built_litert_bundle: Path,
    unique_topic: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """sim (its own process) -> Mosquitto -> daemon -> Mosquitto -> checker: every message answered exactly once,
    and each answer's outputs equal what `edgeline infer` gives for the same input."""
    from edgeline.cli import main

    data = tmp_path / "prepared"
    (data / "digits").mkdir(parents=True)
    rng = np.random.default_rng(11)
    np.savez(
        data / "digits" / "validation.npz", x=rng.random((20, 1, 8, 8), dtype=np.float32), labels=np.arange(20) % 10
    )
    sent = Collector(broker, f"{unique_topic}/sensors/#")
    results = Collector(broker, f"{unique_topic}/results/#")
    sim = [
        sys.executable, "-m", "edgeline.cli", "sim", "digits", "--broker", broker.address, "--data", str(data),
        "--devices", "3", "--device", "cam", "--count", "5", "--rate", "0", "--qos", "1",
        "--topic", f"{unique_topic}/sensors/{{device}}/image",
    ]  # fmt: skip
    done = subprocess.run(sim, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    messages = [json.loads(payload) for _, payload, _ in sent.wait_for(15)]
    results.wait_for(15)
    sentinel = json.dumps({"id": "sentinel", "data": [0.5] * 64}).encode()
    answers = [
        json.loads(payload)
        for _, payload, _ in then_nothing_more(
            results, 15, lambda: mosquitto_pub(broker, f"{unique_topic}/sensors/cam-001/image", sentinel)
        )
    ]
    assert len(sent.wait_for(16)) == len(sent.messages) == 16  # sim sent 15, then the sentinel
    assert sent.messages[-1][1] == sentinel and len(messages) == 15
    assert sorted(a["id"] for a in answers) == sorted(m["id"] for m in messages)
    assert {a["device"] for a in answers} == {"cam-001", "cam-002", "cam-003"}

    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, image=np.array([m["data"] for m in messages], dtype=np.float32).reshape(-1, 1, 8, 8))
    capsys.readouterr()
    assert main(["infer", str(built_litert_bundle), "--input", str(inputs), "--json"]) == 0
    infer = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_id = {a["id"]: a for a in answers}
    for message, expected in zip(messages, infer, strict=True):
        answer = by_id[message["id"]]
        np.testing.assert_allclose(answer["outputs"][0], expected["outputs"][0], rtol=1e-6, atol=1e-7)
        assert answer["label"] == expected["label"]
    sent.close()
    results.close()


def decode_answer(codec: str, payload: bytes) -> dict[str, object]:
    import cbor2
    import msgpack

    decoded = cbor2.loads(payload) if codec == "cbor" else msgpack.unpackb(payload)
    assert isinstance(decoded, dict)
    return decoded


@pytest.mark.parametrize("codec", ["cbor", "msgpack"])
def test_binary_codecs_and_the_error_topic_through_the_broker(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path, codec: str
) -> None:
    """Payloads made by cbor2/msgpack, sent by mosquitto_pub; answers in the same codec; errors mirrored."""
    import cbor2
    import msgpack

    encode = cbor2.dumps if codec == "cbor" else msgpack.packb
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[input]\nsubscribe = ["{unique_topic}/in/+"]\ncodec = "{codec}"\nmax_payload_bytes = 2048\n'
        f'[output]\npublish = "{unique_topic}/out/{{device}}"\nerror_topic = "{unique_topic}/errors/{{device}}"\n'
    )
    since = broker.log_size()
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeline.cli", "run", str(built_litert_bundle), "--config", str(config),
         "--broker", broker.address, "--instance", "t"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        client_id = f"edgeline-{edgeline.read_bundle(built_litert_bundle).manifest.name}-t"
        assert broker.wait_for_subscription(client_id, f"{unique_topic}/in/+", timeout=TIMEOUT_S, since=since)
        results = Collector(broker, f"{unique_topic}/out/#")
        errors = Collector(broker, f"{unique_topic}/errors/#")
        rng = np.random.default_rng(8)
        images = {f"b{i}": rng.random(64, dtype=np.float32) for i in range(4)}
        for identity, x in images.items():  # float32 values as a nested list, the model's own shape
            mosquitto_pub(broker, f"{unique_topic}/in/cam", encode({"id": identity, "data": x.reshape(8, 8).tolist()}))
        bad = {
            "malformed": b"\xff\x00 not " + codec.encode(),
            "oversized": encode({"id": "big", "data": [0.5] * 600}),
            "wrong-shape": encode({"id": "short", "data": [0.5] * 63}),
        }
        for payload in bad.values():
            mosquitto_pub(broker, f"{unique_topic}/in/bad", payload)
        results.wait_for(len(images) + len(bad))
        errors.wait_for(len(bad))
        sentinel = encode({"id": "sentinel", "data": [0.5] * 63})  # refused: answered, and mirrored on the error topic

        def decode(payload: bytes) -> dict[str, object]:
            return decode_answer(codec, payload)

        answers = [
            decode(payload)
            for _, payload, _ in then_nothing_more(
                results,
                len(images) + len(bad),
                lambda: mosquitto_pub(broker, f"{unique_topic}/in/bad", sentinel),
                decode=decode,
            )
        ]
        mirrored = [
            decode(payload) for _, payload, _ in then_nothing_more(errors, len(bad), lambda: None, decode=decode)
        ]
        model = edgeline.load(built_litert_bundle)
        by_id = {a["id"]: a for a in answers if "error" not in a}
        for identity, x in images.items():
            outputs = by_id[identity]["outputs"]
            assert isinstance(outputs, list)
            np.testing.assert_allclose(outputs[0], model.predict(x.reshape(1, 1, 8, 8))[0], rtol=1e-6)
        refused = [a for a in answers if "error" in a]
        assert [a["error"]["code"] for a in refused] == list(bad)  # type: ignore[index]
        assert mirrored == refused
        code, stderr = stop(process)
        assert code == 0 and "Traceback" not in stderr, stderr[-2000:]
        results.close()
        errors.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


def gated_daemon(
    broker: Broker, bundle: Path, topic: str, policy: str, capacity: int, sections: dict[str, Any] | None = None
) -> tuple[Any, Any, Any]:
    """A daemon in this process whose worker waits at a gate before its first inference: a consumer slower than
    the stream, made deterministic. Broker, client, queue and model are the real ones. ``sections`` add to the
    configuration's sections."""
    from edgeline.daemon.config import DaemonConfig
    from edgeline.daemon.service import Daemon
    from tests.mqtt_broker import free_port

    settings: dict[str, dict[str, Any]] = {
        "broker": {"host": broker.host, "port": broker.port, "client_id": f"gated-{policy}"},
        "input": {"subscribe": [f"{topic}/in/+"]},
        "output": {"publish": f"{topic}/out/{{device}}"},
        "queue": {"capacity": capacity, "policy": policy},
        "health": {"status_topic": f"{topic}/status", "status_interval_s": 0.2, "prometheus_port": free_port()},
    }
    for name, values in (sections or {}).items():
        settings[name] = {**settings.get(name, {}), **values}
    config = DaemonConfig.model_validate(settings)
    daemon = Daemon(bundle, config)
    gate, entered = threading.Event(), threading.Event()
    process = daemon.processor.process

    def slow_consumer(message: Any) -> Any:
        entered.set()
        gate.wait(TIMEOUT_S)
        return process(message)

    daemon.processor.process = slow_consumer  # type: ignore[method-assign]
    daemon.start()
    return daemon, gate, entered


def publish_behind_a_busy_worker(broker: Broker, topic: str, payloads: list[bytes], entered: threading.Event) -> None:
    """The first payload goes to the worker, which holds it at the gate; the rest meet the queue."""
    mosquitto_pub(broker, topic, payloads[0])
    assert entered.wait(TIMEOUT_S)
    for payload in payloads[1:]:
        mosquitto_pub(broker, topic, payload)


wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
def test_a_full_drop_oldest_queue_answers_dropped_and_loses_nothing_else(
    broker: Broker, built_litert_bundle: Path, unique_topic: str
) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    daemon, gate, entered = gated_daemon(broker, built_litert_bundle, unique_topic, "drop-oldest", capacity=4)
    try:
        results = Collector(broker, f"{unique_topic}/out/#")
        rng = np.random.default_rng(9)
        images = [rng.random(64, dtype=np.float32) for _ in range(11)]
        payloads = [json.dumps({"id": f"m{i}", "data": x.tolist()}).encode() for i, x in enumerate(images)]
        publish_behind_a_busy_worker(broker, f"{unique_topic}/in/cam", payloads, entered)
        assert wait_until(lambda: daemon.queue.stats().enqueued == 11)
        port = daemon._metrics_server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        samples = {
            (sample.name, sample.labels.get("code")): sample.value
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
        }
        assert samples[("edgeline_dropped_total", None)] == 6
        assert samples[("edgeline_errors_total", "dropped")] == 6
        assert ("edgeline_queue_depth", None) in samples
        gate.set()
        results.wait_for(11)
        sentinel = json.dumps({"id": "sentinel", "data": [0.5] * 64}).encode()
        answers = [
            json.loads(payload)
            for _, payload, _ in then_nothing_more(
                results, 11, lambda: mosquitto_pub(broker, f"{unique_topic}/in/cam", sentinel)
            )
        ]
        kept = [a["id"] for a in answers if "error" not in a]
        dropped = [a for a in answers if "error" in a]
        assert sorted(kept) == ["m0", "m10", "m7", "m8", "m9"]  # the oldest queued (m1..m6) made room
        assert [a["error"]["code"] for a in dropped] == ["dropped"] * 6
        assert sorted(a["seq"] for a in answers) == list(range(1, 12))
        status = Collector(broker, f"{unique_topic}/status")  # the retained one may predate the last drop:

        def reported() -> list[dict[str, Any]]:  # wait for the status that counted them all (a busy machine's
            return [json.loads(payload) for payload in status.payloads]  # status thread comes late)

        assert wait_until(lambda: any(doc["counts"].get("dropped") == 6 for doc in reported()))
        latest = next(doc for doc in reported() if doc["counts"].get("dropped") == 6)
        assert latest["errors"] == {"dropped": 6}
        assert all(doc["counts"].get("dropped", 0) <= 6 for doc in reported())
        status.close()
        results.close()
    finally:
        gate.set()
        daemon.stop()


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
def test_a_full_block_queue_holds_the_stream_back_and_loses_nothing(
    broker: Broker, built_litert_bundle: Path, unique_topic: str
) -> None:
    daemon, gate, entered = gated_daemon(broker, built_litert_bundle, unique_topic, "block", capacity=2)
    try:
        results = Collector(broker, f"{unique_topic}/out/#")
        payloads = [json.dumps({"id": f"m{i}", "data": [i / 10] * 64}).encode() for i in range(8)]
        publish_behind_a_busy_worker(broker, f"{unique_topic}/in/cam", payloads, entered)
        assert wait_until(lambda: daemon.queue.stats().depth == 2)
        assert daemon.queue.stats().enqueued == 3  # the network thread waits for room; the broker keeps the rest
        gate.set()
        answers = [json.loads(payload) for _, payload, _ in results.wait_for(8)]
        assert sorted(a["id"] for a in answers) == sorted(f"m{i}" for i in range(8))
        assert all("error" not in a for a in answers)
        assert daemon.queue.stats().dropped == 0
        results.close()
    finally:
        gate.set()
        daemon.stop()


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
@pytest.mark.parametrize("on_disk", [True, False], ids=["outbox", "memory-outbox"])
def test_answers_the_client_cannot_take_wait_in_the_outbox_and_leave_in_order(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path, on_disk: bool
) -> None:
    """40 answers at once against a client that holds 4 publishes (besides its window of 16 in flight): the rest
    wait in the outbox, are read back as PUBACKs make room, and reach the subscriber in the order they were
    answered, each once. The broker is frozen (SIGSTOP) while the answers are made, so no PUBACK makes room early:
    what the client takes, and so what must come back from the outbox, does not depend on how fast the broker is."""
    daemon, gate, entered = gated_daemon(
        broker, built_litert_bundle, unique_topic, "block", capacity=64,
        sections={
            "broker": {"max_queued": 4, "max_inflight": 16, "client_id": f"spill-{on_disk}"},
            "outbox": {"enabled": on_disk},
            "daemon": {"state_dir": str(tmp_path / "state")},
        },
    )  # fmt: skip
    try:
        results = Collector(broker, f"{unique_topic}/out/#")
        payloads = [json.dumps({"id": f"m{i}", "data": [i / 100] * 64}).encode() for i in range(40)]
        publish_behind_a_busy_worker(broker, f"{unique_topic}/in/cam", payloads, entered)
        assert wait_until(lambda: daemon.queue.stats().enqueued == 40)
        delivery, connection = daemon.delivery, daemon.connection
        assert delivery is not None and connection is not None and daemon.outbox is not None

        in_flight_at_most = min(connection.window, delivery.max_queued)  # paho's own queue is capped at max_queued

        def held_still() -> bool:
            """All 40 stored; as many in flight as the client takes; the answers ready for it as many as they get
            (the read-back waits for room for ``max(1, max_queued // 2)``); the rest marked to be read back:
            nothing moves until a PUBACK."""
            room = delivery.max_queued - len(delivery._ready)
            return (
                delivery.settled and daemon.outbox.depth == 40 and connection.in_flight == in_flight_at_most
                and room < max(1, delivery.max_queued // 2) and delivery._spilled
            )  # fmt: skip

        with broker.frozen():
            gate.set()
            assert wait_until(held_still), (connection.in_flight, len(delivery._ready), daemon.outbox.depth)
            took = delivery._handed  # seqs 1..took: in flight or queued in the client, nothing acknowledged
            assert took == connection.in_flight + len(delivery._ready)
            read_back_while_frozen = daemon.status()["counts"].get("outbox_read_back", 0)
        answers = [json.loads(p) for _, p, _ in results.wait_for(40)]
        assert wait_until(lambda: daemon.outbox.depth == 0)
        read_back = daemon.status()["counts"]["outbox_read_back"]
        straight = took - read_back_while_frozen  # handed to the client as they were stored
        assert read_back == 40 - straight  # every other answer came back from the outbox, each once
        assert read_back - read_back_while_frozen == 40 - took >= 40 - in_flight_at_most - delivery.max_queued
        sentinel = json.dumps({"id": "sentinel", "data": [0.5] * 64}).encode()
        mosquitto_pub(broker, f"{unique_topic}/in/cam", sentinel)  # answered after all 40: a duplicate comes first
        answers = [json.loads(p) for _, p, _ in results.wait_for(41)]
        assert len(answers) == 41 and answers[-1]["id"] == "sentinel"
        answers = answers[:40]
        assert all("error" not in a for a in answers)
        assert [a["seq"] for a in answers] == list(range(1, 41))  # the order they were answered in
        assert sorted(a["id"] for a in answers) == sorted(f"m{i}" for i in range(40))
        results.close()
    finally:
        gate.set()
        daemon.stop()


@pytest.mark.workstation  # needs a bundle only the export extra can make
def test_under_backlog_the_daemon_batches_what_is_queued(
    broker: Broker, batchable_bundle: Path, unique_topic: str
) -> None:
    """19 messages queued behind a busy worker: one full batch of 16 in one call, then the other 3 one by one;
    every message still gets its own answer, equal to a single-sample predict."""
    daemon, gate, entered = gated_daemon(broker, batchable_bundle, unique_topic, "block", capacity=64)
    try:
        assert daemon.model.batch_size == 16, daemon.model.batching
        results = Collector(broker, f"{unique_topic}/out/#")
        rng = np.random.default_rng(12)
        images = [rng.random((1, 3, 8, 8), dtype=np.float32) for _ in range(20)]
        payloads = [json.dumps({"id": f"m{i}", "data": x.ravel().tolist()}).encode() for i, x in enumerate(images)]
        publish_behind_a_busy_worker(broker, f"{unique_topic}/in/cam", payloads, entered)
        assert wait_until(lambda: daemon.queue.stats().enqueued == 20)
        gate.set()
        answers = {a["id"]: a for a in (json.loads(p) for _, p, _ in results.wait_for(20))}
        assert sorted(answers) == sorted(f"m{i}" for i in range(20))
        assert sorted(a.get("batch", 1) for a in answers.values()) == [1] * 4 + [16] * 16
        model = edgeline.load(batchable_bundle)
        for index, image in enumerate(images):
            np.testing.assert_array_equal(answers[f"m{index}"]["outputs"][0], model.predict(image)[0].tolist())
        assert daemon.status()["batch_size"] == 16
        results.close()
    finally:
        gate.set()
        daemon.stop()
