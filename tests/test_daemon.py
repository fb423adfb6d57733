"""The daemon end to end through a real Mosquitto: `edgeline run` as its own process, fed by Debian's
mosquitto_pub (a client we did not write), answers checked by a paho-mqtt subscriber."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

import edge_runtime
from tests.mqtt_broker import Broker

TIMEOUT_S = 20.0


class Collector:
    """A paho 2.x subscriber that keeps every (topic, payload) and can wait for a count."""

    def __init__(self, broker: Broker, topic_filter: str) -> None:
        self.messages: list[tuple[str, bytes, bool]] = []
        self.lock = threading.Condition()
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_connect = lambda client, *_: client.subscribe(topic_filter, qos=1)
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert self.subscribed.wait(TIMEOUT_S)

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.messages.append((message.topic, bytes(message.payload), bool(message.retain)))
            self.lock.notify_all()

    def wait_for(self, count: int, timeout: float = TIMEOUT_S) -> list[tuple[str, bytes, bool]]:
        with self.lock:
            self.lock.wait_for(lambda: len(self.messages) >= count, timeout=timeout)
            return list(self.messages)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def daemon(broker: Broker, built_litert_bundle: Path, unique_topic: str) -> Iterator[subprocess.Popen[str]]:
    args = [
        sys.executable, "-m", "edge_runtime.cli", "run", str(built_litert_bundle),
        "--broker", broker.address, "--subscribe", f"{unique_topic}/sensors/+/image",
        "--publish", f"{unique_topic}/results/{{device}}", "--qos", "1",
    ]  # fmt: skip
    since = broker.log_size()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client_id = f"edgeline-{edge_runtime.read_bundle(built_litert_bundle).manifest.name}"
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
    answers = results.wait_for(len(images) + len(bad))
    time.sleep(0.5)  # anything extra would arrive now: exactly one answer per input
    assert len(results.messages) == len(images) + len(bad)
    records = [json.loads(payload) for _, payload, _ in answers]
    by_id = {r["id"]: r for r in records if "error" not in r}
    assert sorted(by_id) == sorted(f"m{i}" for i in range(len(images)))
    model = edge_runtime.load(built_litert_bundle)
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
    name = edge_runtime.read_bundle(built_litert_bundle).manifest.name
    watcher = Collector(broker, f"edgeline/{name}/availability")
    first = watcher.wait_for(1)
    assert first[0][1] == b"online" and first[0][2]  # retained
    code, stderr = stop(daemon)
    assert code == 0, stderr
    assert [payload for _, payload, _ in watcher.wait_for(2)] == [b"online", b"offline"]
    watcher.close()
    late = Collector(broker, f"edgeline/{name}/availability")  # a newcomer sees the retained state
    assert late.wait_for(1)[0][1] == b"offline"
    late.close()


def test_an_unreachable_broker_is_a_clear_error(built_litert_bundle: Path, tmp_path: Path) -> None:
    from tests.mqtt_broker import free_port

    args = ["run", str(built_litert_bundle), "--broker", f"127.0.0.1:{free_port()}"]
    done = subprocess.run(
        [sys.executable, "-m", "edge_runtime.cli", *args],
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
        receiver.settimeout(TIMEOUT_S)
        env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
        args = [sys.executable, "-m", "edge_runtime.cli", "run", str(built_litert_bundle), "--broker", broker.address]
        process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        finally:
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=10)


TORCH_FREE_DAEMON = """
import json, sys, time
from pathlib import Path
from edge_runtime.config import DaemonConfig
from edge_runtime.daemon import Daemon

bundle, address, topic = sys.argv[1:4]
config = DaemonConfig().with_overrides(broker=address, subscribe=[topic + "/+/x"], publish=topic + "/r/{device}")
daemon = Daemon(Path(bundle), config)
daemon.start()
daemon.client.publish(topic + "/dev/x", json.dumps({"data": [0.5] * 64}), qos=1)
deadline = time.monotonic() + 20
while daemon.metrics.snapshot()["counts"].get("results", 0) < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
daemon.stop()
heavy = sorted(m for m in ("torch", "executorch", "litert_torch", "export") if m in sys.modules)
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
    from edge_runtime.cli import main

    data = tmp_path / "prepared"
    (data / "digits").mkdir(parents=True)
    rng = np.random.default_rng(11)
    np.savez(
        data / "digits" / "validation.npz", x=rng.random((20, 1, 8, 8), dtype=np.float32), labels=np.arange(20) % 10
    )
    sent = Collector(broker, f"{unique_topic}/sensors/#")
    results = Collector(broker, f"{unique_topic}/results/#")
    sim = [
        sys.executable, "-m", "edge_runtime.cli", "sim", "digits", "--broker", broker.address, "--data", str(data),
        "--devices", "3", "--device", "cam", "--count", "5", "--rate", "0", "--qos", "1",
        "--topic", f"{unique_topic}/sensors/{{device}}/image",
    ]  # fmt: skip
    done = subprocess.run(sim, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    messages = [json.loads(payload) for _, payload, _ in sent.wait_for(15)]
    answers = [json.loads(payload) for _, payload, _ in results.wait_for(15)]
    time.sleep(0.5)  # an extra answer would arrive now
    assert len(messages) == len(sent.messages) == 15
    assert len(answers) == len(results.messages) == 15
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
