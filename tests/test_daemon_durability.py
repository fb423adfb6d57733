"""Nothing lost at QoS 1: `edgeline run` as its own process against a real Mosquitto with persistence on, while
the broker is SIGKILLed, the daemon is SIGKILLed, stopped with SIGTERM, or cut off by a network black hole.

Inputs come from a persistent publisher that sends again whatever the broker did not acknowledge, answers go to
a persistent subscriber; both survive broker restarts (``tests.faults``). Each test counts the inputs whose id
never came back in an answer: it must be zero. Duplicates are allowed (at least once) and reported.

One loss no client can prevent is kept out of the broker-kill test: Mosquitto acknowledges a PUBLISH before it
saves it (``tests.mqtt_broker.Broker``), and a save of a busy database takes tens of milliseconds, so a SIGKILL
soon after a PUBACK can lose that input inside the broker. Before each kill the publisher pauses until the broker
has saved what it acknowledged; the daemon keeps working through its backlog throughout, and the broker's trace
tells a loss inside the broker from one by the daemon.
"""

from __future__ import annotations

import datetime
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest

import edgeline
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.service import Daemon
from tests import waiting
from tests.faults import BlackHoleProxy, DurableCollector, DurablePublisher, kill_and_restart
from tests.mqtt_broker import Broker, BrokerFactory, Collector

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 60.0
INSTANCE = "durable"


def inputs(topic: str, count: int, prefix: str = "m") -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(count)
    return [
        (topic, json.dumps({"id": f"{prefix}{i}", "data": rng.random(64, dtype=np.float32).tolist()}).encode())
        for i in range(count)
    ]


class DaemonProcess:
    """`edgeline run` in a child process, its log in a file that survives kills; same state dir on every start."""

    def __init__(self, bundle: Path, broker_address: str, topic: str, state_dir: Path, config: str = "") -> None:
        self.broker_address = broker_address
        self.subscription = f"{topic}/sensors/+/image"
        self.client_id = f"edgeline-{edgeline.read_bundle(bundle).manifest.name}-{INSTANCE}"
        self.log = state_dir.parent / f"{state_dir.name}.log"
        config_file = state_dir.parent / f"{state_dir.name}.toml"
        config_file.write_text(config)
        self.args = [
            sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--broker", broker_address,
            "--subscribe", self.subscription, "--publish", f"{topic}/results/{{device}}", "--qos", "1",
            "--state-dir", str(state_dir), "--instance", INSTANCE, "--config", str(config_file),
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, broker: Broker) -> None:
        since = broker.log_size()
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log)
        self.starts += 1
        if not broker.wait_for_subscription(self.client_id, self.subscription, timeout=TIMEOUT_S, since=since):
            self.kill()
            pytest.fail(f"the daemon did not subscribe:\n{self.log_text()[-3000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def terminate(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=TIMEOUT_S)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def logged_at(self, needle: str) -> list[float]:
        """Wall-clock times of the log lines containing ``needle``."""
        times = []
        for line in self.log_text().splitlines():
            if needle in line:
                stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                times.append(stamp.timestamp())
        return times


@pytest.fixture
def daemon(
    built_litert_bundle: Path, durable_broker: Broker, unique_topic: str, tmp_path: Path
) -> Iterator[DaemonProcess]:
    process = DaemonProcess(built_litert_bundle, durable_broker.address, unique_topic, tmp_path / "state")
    yield process
    process.kill()


def missing_answers(collector: DurableCollector, ids: set[str], timeout: float = TIMEOUT_S) -> set[str]:
    """The ids still without an answer once all have one or ``timeout`` has passed (polled: counting is O(n))."""
    deadline = time.monotonic() + timeout
    while True:
        missing = ids - set(map(str, collector.id_counts()))
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


def coded_errors(collector: DurableCollector) -> Counter[str]:
    """Error answers by code: an input answered ``dropped`` was not lost to the network but it was lost."""
    answers = (json.loads(payload) for payload in collector.payloads)
    return Counter(answer["error"]["code"] for answer in answers if "error" in answer)


def publish_in_background(
    publisher: DurablePublisher, messages: list[tuple[str, bytes]], rate: float
) -> threading.Thread:
    thread = threading.Thread(target=publisher.publish_all, args=(messages, rate), daemon=True)
    thread.start()
    return thread


def report(collector: DurableCollector, sent: int) -> str:
    counts = collector.id_counts()
    duplicated = sum(times - 1 for times in counts.values())
    return f"{sent} inputs, {len(counts)} answered, {duplicated} duplicate answers"


def hops(broker: Broker, topic: str) -> dict[str, set[tuple[str, str]]]:
    """From the broker's trace: for each topic under ``topic``, the (direction, client) of every PUBLISH it logged."""
    seen: dict[str, set[tuple[str, str]]] = {}
    pattern = re.compile(r"(Received|Sending) PUBLISH (?:from|to) (\S+) \(d\d, q\d, r\d, m\d+, '([^']+)'")
    for match in pattern.finditer(broker.log_text()):
        if match[3].startswith(topic):
            seen.setdefault(match[3], set()).add((match[1], match[2]))
    return seen


def where_lost(broker: Broker, topic: str, daemon: DaemonProcess, missing: set[str]) -> dict[str, list[str]]:
    """Each unanswered input (id ``mI`` came from device ``camI``) by the last hop the broker logged for it.

    "in the broker": it took the input (or the answer) and never sent it on: Mosquitto acknowledged, then lost it
    in the SIGKILL before its save. "by the daemon": the broker gave the daemon the input and never got an answer.
    """
    seen = hops(broker, topic)
    lost: dict[str, list[str]] = {"in the broker": [], "by the daemon": [], "never logged": []}
    for identity in sorted(missing):
        device = identity.removeprefix("m")
        inbound = seen.get(f"{topic}/sensors/cam{device}/image", set())
        outbound = seen.get(f"{topic}/results/cam{device}", set())
        if ("Sending", daemon.client_id) in inbound and ("Received", daemon.client_id) not in outbound:
            lost["by the daemon"].append(identity)
        elif inbound or outbound:
            lost["in the broker"].append(identity)
        else:
            lost["never logged"].append(identity)
    return lost


wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)


def wait_until_saved(broker: Broker, publisher: DurablePublisher, answered: Callable[[], bool] | None = None) -> None:
    """Until Mosquitto has saved every input it acknowledged: two saves completed after the last PUBACK (the first
    may have begun before it). While the daemon works through a backlog every pass saves. When no second save comes
    within 2 s there may be nothing left to save (the inputs have all gone on to the daemon), or the save that came
    may have begun before the last inputs were stored. Then, in either case, wait until ``answered()`` says the
    answers have reached their subscriber: an answer the broker has acknowledged to the daemon but not yet sent on
    is, like an input, only in the broker's memory until its next save (a loaded CI machine once lost the last answer
    of a batch that way, after two saves of the inputs). That is the event the kill waits for, however long a busy
    machine takes (``TIMEOUT_S`` is a hang guard: past it the test fails here, rather than losing answers in the kill
    and failing later for a reason that is not the daemon's)."""
    assert publisher.wait_acknowledged(TIMEOUT_S), f"{len(publisher.pending)} inputs never acknowledged"
    for _ in range(2):
        if not broker.wait_for_save(broker.persistence_mark(), timeout=2.0):
            break
    if answered is not None:
        assert wait_until(answered), "the batch's answers never all reached their subscriber before the kill"


def test_broker_sigkilled_four_times_while_inputs_arrive_loses_nothing(
    broker_factory: BrokerFactory, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """Each input comes from its own device, so the broker's trace tells which hop a lost one reached last."""
    broker = broker_factory(persistence=True, trace=True)
    # The collector comes back before the daemon does, so answers go straight to it rather than into a queue
    # that Mosquitto would only save after acknowledging them.
    collector = DurableCollector(
        broker, f"{unique_topic}/results/#", protocol=mqtt.MQTTv5, reconnect_delay_s=(0.05, 0.1)
    )
    collector.start_and_subscribe()
    daemon = DaemonProcess(built_litert_bundle, broker.address, unique_topic, tmp_path / "state")
    try:
        with DurablePublisher(broker, protocol=mqtt.MQTTv5) as publisher:
            daemon.start(broker)
            messages = [
                (f"{unique_topic}/sensors/cam{i}/image", payload)
                for i, (_, payload) in enumerate(inputs(unique_topic, 2000))
            ]
            for index in range(0, len(messages), 400):
                publisher.publish_all(messages[index : index + 400], rate=400)
                if index + 400 < len(messages):
                    batch = {f"m{i}" for i in range(index, index + 400)}
                    wait_until_saved(
                        broker, publisher, lambda batch=batch: batch <= set(map(str, collector.id_counts()))
                    )
                    kill_and_restart(broker, down_s=0.5)
            assert publisher.wait_acknowledged(TIMEOUT_S), f"{len(publisher.pending)} inputs never acknowledged"
        missing = missing_answers(collector, {f"m{i}" for i in range(2000)})
        lost = where_lost(broker, unique_topic, daemon, missing)
        print(f"{report(collector, 2000)}; unanswered: {lost}")
        assert not lost["by the daemon"] and not lost["never logged"], f"{lost}\n{daemon.log_text()[-3000:]}"
        assert daemon.process is not None and daemon.process.poll() is None, "the daemon did not survive the broker"
        assert len(daemon.logged_at("reconnected to")) == 4, daemon.log_text()[-3000:]
        assert not missing, f"lost inside Mosquitto, after its PUBACK and before its save: {lost}"
        assert not coded_errors(collector), coded_errors(collector)
    finally:
        daemon.kill()
        collector.close()


def test_daemon_sigkilled_three_times_mid_stream_loses_nothing(
    durable_broker: Broker, answers: DurableCollector, publisher: DurablePublisher, daemon: DaemonProcess,
    unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    sending = publish_in_background(publisher, inputs(f"{unique_topic}/sensors/cam/image", 2000), rate=250)
    for _ in range(3):
        time.sleep(2.0)
        daemon.kill()
        daemon.start(durable_broker)  # same state dir and instance: same session, same outbox
    sending.join(TIMEOUT_S)
    missing = missing_answers(answers, {f"m{i}" for i in range(2000)})
    assert not missing, f"{len(missing)} inputs never answered ({report(answers, 2000)}):\n{daemon.log_text()[-3000:]}"
    assert not coded_errors(answers), coded_errors(answers)
    print(report(answers, 2000))


def test_sigterm_mid_stream_then_a_restart_answers_everything(
    durable_broker: Broker, answers: DurableCollector, publisher: DurablePublisher, daemon: DaemonProcess,
    unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    messages = inputs(f"{unique_topic}/sensors/cam/image", 1500)
    # mid-stream by construction: the SIGTERM comes once answers flow and before the second half is sent at all
    sending = publish_in_background(publisher, messages[:750], rate=500)
    assert wait_until(lambda: len(answers.id_counts()) > 0), daemon.log_text()[-3000:]
    assert daemon.terminate() == 0, daemon.log_text()[-3000:]
    answered_by_the_first = len(answers.id_counts())
    sending.join(TIMEOUT_S)
    assert not sending.is_alive()
    publisher.publish_all(messages[750:], 500)  # into the daemon's persistent session while it is stopped
    assert 0 < answered_by_the_first <= 750, "SIGTERM did not land mid-stream"
    daemon.start(durable_broker)
    missing = missing_answers(answers, {f"m{i}" for i in range(1500)})
    assert not missing, f"{len(missing)} inputs never answered ({report(answers, 1500)}):\n{daemon.log_text()[-3000:]}"
    assert not coded_errors(answers), coded_errors(answers)
    assert "Traceback" not in daemon.log_text()


def test_sigterm_with_the_broker_down_keeps_the_outbox_for_the_next_start(
    durable_broker: Broker, answers: DurableCollector, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """Inputs are taken, the broker dies, the worker answers them into the outbox, SIGTERM: exit 0 with the
    answers on disk; the next start (a child process, as systemd would start it) delivers them."""
    topic = unique_topic
    config = DaemonConfig.model_validate(
        {
            "broker": {"host": durable_broker.host, "port": durable_broker.port, "client_id": "first-run"},
            "daemon": {"state_dir": str(tmp_path / "state"), "instance": INSTANCE},
            "input": {"subscribe": [f"{topic}/sensors/+/image"]},
            "output": {"publish": f"{topic}/results/{{device}}"},
        }
    )
    first = Daemon(built_litert_bundle, config)
    gate, entered = threading.Event(), threading.Event()
    process = first.processor.process

    def held(message: object) -> object:
        entered.set()
        gate.wait(TIMEOUT_S)
        return process(message)  # type: ignore[arg-type]

    first.processor.process = held  # type: ignore[assignment,method-assign]

    since = durable_broker.log_size()

    def drive() -> None:
        durable_broker.wait_for_subscription("first-run", f"{topic}/sensors/+/image", timeout=TIMEOUT_S, since=since)
        with DurablePublisher(durable_broker, protocol=mqtt.MQTTv5) as sender:
            sender.wait_connected()
            sender.publish_all(inputs(f"{topic}/sensors/cam/image", 5))
            sender.wait_acknowledged()
        entered.wait(TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while first.queue.stats().enqueued < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        durable_broker.kill()
        gate.set()
        while (first.outbox is None or first.outbox.depth < 5) and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.raise_signal(signal.SIGTERM)  # handled in this (the main) thread by run_until_signalled

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    assert first.run_until_signalled() == 0
    driver.join(TIMEOUT_S)
    assert first.queue.stats().enqueued == 5
    durable_broker.restart()

    second = DaemonProcess(built_litert_bundle, durable_broker.address, topic, tmp_path / "state")
    try:
        second.start(durable_broker)
        assert "5 answers left by the last run wait in the outbox" in second.log_text()
        missing = missing_answers(answers, {f"m{i}" for i in range(5)})
        assert not missing, second.log_text()[-3000:]
        assert not coded_errors(answers), coded_errors(answers)
    finally:
        second.kill()


def test_a_black_hole_is_noticed_within_two_keepalives_and_nothing_is_lost(
    built_litert_bundle: Path, durable_broker: Broker, answers: DurableCollector, publisher: DurablePublisher,
    unique_topic: str, tmp_path: Path,
) -> None:  # fmt: skip
    keepalive_s = 2
    with BlackHoleProxy.to(durable_broker) as proxy:
        daemon = DaemonProcess(
            built_litert_bundle,
            proxy.address,
            unique_topic,
            tmp_path / "state",
            f"[broker]\nkeepalive_s = {keepalive_s}\n",
        )
        try:
            daemon.start(durable_broker)
            sending = publish_in_background(publisher, inputs(f"{unique_topic}/sensors/cam/image", 600), rate=50)
            assert wait_until(lambda: len(answers.id_counts()) >= 50)  # mid-stream
            paused_at = time.time()
            outage_ends = time.monotonic() + 3 * keepalive_s + 1  # longer than the stall delay (3 keepalives)
            proxy.pause()
            # noticed by the keepalive while the link is still a black hole (not by the resume closing it); how
            # soon is not checked here: on a busy machine that is the machine's speed
            assert wait_until(lambda: any(t >= paused_at - 0.01 for t in daemon.logged_at("lost the broker")))
            time.sleep(max(0.0, outage_ends - time.monotonic()))  # the fault's length, not a check
            proxy.resume()
            sending.join(TIMEOUT_S)
            missing = missing_answers(answers, {f"m{i}" for i in range(600)})
            assert not missing, f"{len(missing)} never answered ({report(answers, 600)}):\n{daemon.log_text()[-3000:]}"
            assert not coded_errors(answers), coded_errors(answers)
            noticed = [t - paused_at for t in daemon.logged_at("lost the broker") if t >= paused_at - 0.01]
            assert noticed, daemon.log_text()[-3000:]
            assert daemon.logged_at("reconnected to"), daemon.log_text()[-3000:]
            # an outage longer than the stall delay (3 keepalives) is not a stall: what is resent gets its PUBACK
            assert not daemon.logged_at("no PUBACK"), daemon.log_text()[-3000:]
            # the broker published our will ("offline") when the link went silent; back, the daemon says online
            name = edgeline.read_bundle(built_litert_bundle).manifest.name
            availability = Collector(durable_broker, f"edgeline/{name}/{INSTANCE}/availability")
            try:
                assert [p for _, p, _ in availability.wait_for(1)] == [b"online"], daemon.log_text()[-3000:]
            finally:
                availability.close()
            print(f"noticed after {noticed[0]:.1f} s; {report(answers, 600)}")
        finally:
            daemon.kill()
