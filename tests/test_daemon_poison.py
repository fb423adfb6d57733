"""Messages and faults that used to silence the daemon for good: each one now costs one coded answer (or a
clean non-zero exit), and what comes after it is still answered. Real broker, real bundles, real processes.

Device tier too (scripts/test_device.sh): the bundles are ``built_litert_bundle`` and ``sqrt_bundle`` (conftest),
exported with torch on the workstation and the committed copies in tests/data without it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeline
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.health import SystemdNotifier
from edgeline.daemon.messages import Message
from edgeline.daemon.service import EXIT_FAILED, Daemon
from edgeline.daemon.sources import SourceBase
from tests.mqtt_broker import Broker, Collector

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 30.0
LONG_DEVICE = "d" * 70_000


def record(device: str, identity: str, data: list[float]) -> str:
    return json.dumps({"topic": f"sensors/{device}/image", "device": device, "payload": {"id": identity, "data": data}})


def image(seed: int) -> list[float]:
    return np.random.default_rng(seed).random(64, dtype=np.float32).tolist()


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_devices_that_cannot_form_a_topic_are_answered_and_the_rest_goes_on(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """Replayed devices `a+b`, `#` and a 70,000-character name: each an `invalid-topic` error on the error topic
    and on stdout; every good message before and after them is answered on the broker; exit 0, no traceback."""
    lines = [
        record("cam", "g0", image(0)),
        record("a+b", "p-plus", image(1)),
        record("cam", "g1", image(2)),
        record("#", "p-hash", image(3)),
        record("cam", "g2", image(4)),
        record(LONG_DEVICE, "p-long", image(5)),
        record("cam", "g3", image(6)),
    ]
    recording = tmp_path / "poison.jsonl"
    recording.write_text("\n".join(lines) + "\n")
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[output]\npublish = "{unique_topic}/out/{{device}}"\nerror_topic = "{unique_topic}/errors/{{device}}"\n'
    )
    results = Collector(broker, f"{unique_topic}/out/#")
    errors = Collector(broker, f"{unique_topic}/errors/#")
    done = run_cli(
        ["run", str(built_litert_bundle), "--replay", str(recording), "--broker", broker.address,
         "--config", str(config), "--stdout"]
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(answers) == len(lines)  # exactly one answer each
    by_id = {a["id"]: a for a in answers}
    assert sorted(by_id) == ["g0", "g1", "g2", "g3", "p-hash", "p-long", "p-plus"]
    for poison in ("p-plus", "p-hash", "p-long"):
        assert by_id[poison]["error"]["code"] == "invalid-topic"
    assert len(by_id["p-long"]["device"]) <= 256  # the answer does not carry 70 KB of device name
    on_broker = [json.loads(payload) for _, payload, _ in results.wait_for(4)]
    assert sorted(a["id"] for a in on_broker) == ["g0", "g1", "g2", "g3"]
    mirrored = errors.wait_for(3)
    assert sorted(json.loads(payload)["id"] for _, payload, _ in mirrored) == ["p-hash", "p-long", "p-plus"]
    assert {topic for topic, _, _ in mirrored} == {f"{unique_topic}/errors/_invalid"}
    results.close()
    errors.close()


def test_a_nan_output_inside_a_batch_costs_one_answer(sqrt_bundle: Path, tmp_path: Path) -> None:
    """20 inputs queued at once (replay, block policy, max_batch 16): a full batch runs in one call; the inputs
    whose outputs are NaN get `inference-failed`, every other input its result, and the daemon ends with 0."""
    model = edgeline.load(sqrt_bundle)
    assert model.enable_batching(16) and model.batch_size == 16, model.batching
    rng = np.random.default_rng(5)
    rows = [rng.random(4, dtype=np.float32) + 0.1 for _ in range(20)]
    poisoned = {3, 11}
    for index in poisoned:
        rows[index] = -rows[index]
    recording = tmp_path / "batch.jsonl"
    recording.write_text("".join(json.dumps({"id": f"m{i}", "data": r.tolist()}) + "\n" for i, r in enumerate(rows)))
    done = run_cli(["run", str(sqrt_bundle), "--replay", str(recording)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    answers = {a["id"]: a for a in (json.loads(line) for line in done.stdout.splitlines())}
    assert sorted(answers) == sorted(f"m{i}" for i in range(20))
    assert {i for i in range(20) if "error" in answers[f"m{i}"]} == poisoned
    assert {answers[f"m{i}"]["error"]["code"] for i in poisoned} == {"inference-failed"}
    assert any(a.get("batch") == 16 for a in answers.values()), "no input ran in a batch: the case is not tested"
    for index, row in enumerate(rows):
        if index not in poisoned:
            np.testing.assert_allclose(
                answers[f"m{index}"]["outputs"][0], model.predict(row.reshape(1, 1, 4))[0], rtol=1e-5
            )


class CrashingSource(SourceBase):
    """A live source that fails after a few messages, as a driver or a USB port might."""

    description = "a source that crashes"

    def __init__(self, messages: list[Message]):
        self.messages = messages

    def open(self) -> None:
        pass

    def run(self, submit: Any, stopping: threading.Event) -> None:
        for message in self.messages:
            submit(message)
        raise OSError(5, "Input/output error")


def test_a_live_source_that_crashes_ends_the_daemon_with_a_failure(built_litert_bundle: Path) -> None:
    """What was submitted is answered; then the process exits non-zero so that systemd restarts it."""
    answers: list[Any] = []
    messages = [
        Message(topic="s/cam", payload=json.dumps({"id": f"m{i}", "data": image(i)}).encode(), device="cam")
        for i in range(3)
    ]
    config = DaemonConfig.model_validate({"source": {"kind": "serial", "url": "/dev/null-never-opened"}})
    daemon = Daemon(built_litert_bundle, config, echo=answers.append, source=CrashingSource(messages))
    assert daemon.run_until_signalled() == EXIT_FAILED
    assert sorted(a.record["id"] for a in answers) == ["m0", "m1", "m2"]


def test_a_dead_thread_ends_the_daemon_with_a_failure(built_litert_bundle: Path, tmp_path: Path) -> None:
    """A bug that escapes to a thread's top (here: a sink that raises) is not survived deaf: exit non-zero."""
    recording = tmp_path / "in.jsonl"
    recording.write_text("".join(json.dumps({"id": f"m{i}", "data": image(i)}) + "\n" for i in range(3)))

    def broken_sink(answer: Any) -> None:
        raise RuntimeError("a bug in a sink")

    config = DaemonConfig.model_validate({"source": {"kind": "replay", "path": str(recording)}})
    daemon = Daemon(built_litert_bundle, config, echo=broken_sink)
    assert daemon.run_until_signalled() == EXIT_FAILED
    assert daemon.supervisor.failure is not None and "edgeline-worker" in daemon.supervisor.failure


def test_the_watchdog_stops_while_the_worker_is_stuck(built_litert_bundle: Path, tmp_path: Path) -> None:
    """WATCHDOG=1 flows while idle, stops while the worker is stuck in a call, and comes back once it is free; the
    status says whether the worker waits for input and whether the source waits for room (back-pressure)."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        receiver.settimeout(0.1)

        def pings(seconds: float) -> int:
            count, deadline = 0, time.monotonic() + seconds
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    count += receiver.recv(64) == b"WATCHDOG=1"
            return count

        def pings_arrive(expected: int) -> bool:
            """``expected`` pings, however long a busy machine takes to send them (bounded)."""
            count, deadline = 0, time.monotonic() + TIMEOUT_S
            while count < expected and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    count += receiver.recv(64) == b"WATCHDOG=1"
            return count >= expected

        def pings_stop(quiet_s: float = 0.6) -> bool:
            """Pings stop: ``quiet_s`` (12 watchdog intervals) pass without one, however late the tick that saw the
            worker start sends its last (bounded). A daemon that pings while stuck never falls quiet."""
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                if pings(quiet_s) == 0:
                    return True
            return False

        feed: list[Message] = []
        gate, entered = threading.Event(), threading.Event()

        class HeldSource(SourceBase):
            description = "a test source"

            def open(self) -> None:
                pass

            def run(self, submit: Any, stopping: threading.Event) -> None:
                while not stopping.is_set():
                    while feed:
                        submit(feed.pop(0))
                    stopping.wait(0.02)

        config = DaemonConfig.model_validate(
            {"source": {"kind": "serial", "url": "unused"}, "queue": {"capacity": 1, "policy": "block"}}
        )
        notifier = SystemdNotifier(address=path, watchdog_usec="100000")  # a ping every 50 ms while healthy
        daemon = Daemon(built_litert_bundle, config, echo=lambda a: None, source=HeldSource(), notifier=notifier)
        process = daemon.processor.process_batch

        def stuck(batch: Any) -> Any:
            entered.set()
            gate.wait(TIMEOUT_S)
            return process(batch)

        daemon.processor.process_batch = stuck  # type: ignore[method-assign]
        daemon.start()
        try:
            assert pings_arrive(3)  # idle: healthy
            gauges = daemon.metrics.snapshot()
            assert (gauges["worker_idle"], gauges["source_blocked"]) == (True, False)
            payload = json.dumps({"data": image(1)}).encode()
            feed.extend(Message(topic="s", payload=payload, device="d") for _ in range(3))  # 1 in the worker,
            assert entered.wait(TIMEOUT_S)  # 1 queued, 1 waiting for room
            deadline = time.monotonic() + TIMEOUT_S
            while not daemon.metrics.snapshot()["source_blocked"] and time.monotonic() < deadline:
                time.sleep(0.02)
            gauges = daemon.metrics.snapshot()
            assert (gauges["worker_idle"], gauges["source_blocked"]) == (False, True)
            assert pings_stop()  # stuck: no ping, systemd would restart us
            gate.set()
            assert pings_arrive(3)  # moving again
        finally:
            gate.set()
            daemon.stopping.set()
            daemon.stop()


def test_sigterm_with_the_broker_down_exits_0(broker: Broker, built_litert_bundle: Path, unique_topic: str) -> None:
    since = broker.log_size()
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeline.cli", "run", str(built_litert_bundle), "--broker", broker.address,
         "--subscribe", f"{unique_topic}/in/+", "--publish", f"{unique_topic}/out/{{device}}", "--instance", "p"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        client_id = f"edgeline-{edgeline.read_bundle(built_litert_bundle).manifest.name}-p"
        assert broker.wait_for_subscription(client_id, f"{unique_topic}/in/+", timeout=TIMEOUT_S, since=since)
        broker.stop()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=TIMEOUT_S)
        assert process.returncode == 0, stderr[-3000:]
        assert "Traceback" not in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


def test_a_publish_template_matching_the_subscription_is_refused(built_litert_bundle: Path) -> None:
    done = run_cli(["run", str(built_litert_bundle), "--subscribe", "sensors/+/x", "--publish", "sensors/{device}/x"])
    assert done.returncode == 2
    assert "can match the subscription 'sensors/+/x'" in done.stderr and "Traceback" not in done.stderr


def test_a_window_that_does_not_fit_the_model_is_refused_with_both_shapes(
    built_litert_bundle: Path, tmp_path: Path
) -> None:
    config = tmp_path / "daemon.toml"
    config.write_text("[window]\nsize = 10\nhop = 5\nchannels = 3\n")
    done = run_cli(["run", str(built_litert_bundle), "--config", str(config), "--replay", os.devnull])
    assert done.returncode == 2
    assert "size 10 x channels 3 = 30 values" in done.stderr and "[1, 1, 8, 8] (64 values)" in done.stderr
