"""What the daemon claims for a device left alone, checked against a real Mosquitto and the real daemon (in this
process, or as `edgeline run`): answers past their time to live are never delivered, even those paho would send
again after a reconnection; counters exist from the start and count exactly what was lost; SIGHUP reloads in the
same process; the logs of a condition that repeats thousands of times stay a handful of lines; SIGTERM and a
restart on a full disk.

The broker is cut off with ``tests.faults.BlackHoleProxy`` (paused: every byte vanishes, nothing is closed), so
answers can be sent and stay unacknowledged, as in a real partition. Where the inputs must reach the daemon while
its answers cannot leave, they arrive first and the worker waits (``hold_worker``) until the link is cut, or they
come from a source that does not go through the broker (serial lines over pyserial's ``socket://``).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

import edgeline
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.service import Daemon
from edgeline.lograte import SUMMARY_EVERY_S
from tests import test_daemon_backpressure as backpressure
from tests import waiting
from tests.faults import BlackHoleProxy, DurableCollector, DurablePublisher
from tests.mqtt_broker import Broker, Collector, free_port
from tests.test_daemon_backpressure import config_for, fill, payload, publish_all
from tests.test_daemon_durability import missing_answers

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 30.0
TTL_S = 2.0
EDGELINE_RUN = [sys.executable, "-m", "edgeline.cli", "run"]

small_disk = backpressure.small_disk  # the 4 MB tmpfs fixture (root only)


class TimedCollector(Collector):
    """A ``Collector`` that also keeps the wall-clock time each message arrived."""

    def __init__(self, broker: Broker, topic_filter: str, timeout: float = TIMEOUT_S) -> None:
        self.arrivals: list[tuple[float, bytes]] = []
        super().__init__(broker, topic_filter, timeout)

    def _on_message(self, client: object, userdata: object, message: object) -> None:
        with self.lock:
            self.arrivals.append((time.time(), bytes(message.payload)))  # type: ignore[attr-defined]
        super()._on_message(client, userdata, message)

    def ids(self) -> set[str]:
        with self.lock:
            return {json.loads(body)["id"] for _, body in self.arrivals}


wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)


def hold_worker(daemon: Daemon) -> threading.Event:
    """Make the daemon's worker wait before its first batch until the returned event is set: inputs are taken and
    queued, and no answer exists until the test says so. Model, queue, outbox and client are the real ones."""
    gate = threading.Event()
    process_batch = daemon.processor.process_batch

    def held(messages: Any) -> Any:
        gate.wait(TIMEOUT_S)
        return process_batch(messages)

    daemon.processor.process_batch = held  # type: ignore[method-assign]
    return gate


def scrape(port: int) -> dict[str, Any]:
    """The daemon's /metrics by family name, parsed by prometheus_client's own parser (the workstation venv)."""
    from tests.test_health import parse

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def counter(families: dict[str, Any], name: str) -> float:
    """The value of a counter family's ``_total`` sample (one daemon: one sample)."""
    family = families[name]
    assert family.type == "counter", f"{name} is a {family.type}"
    (value,) = [s.value for s in family.samples if s.name == f"{name}_total"]
    return float(value)


class DaemonChild:
    """`edgeline run ARGS` as its own process; its stderr goes to ``log`` (kept across restarts, appended)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args = [*EDGELINE_RUN, *args]
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log)
        return self.process

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.log_text().splitlines() if needle in line]

    def wait_for_log(self, needle: str, count: int = 1, timeout: float = TIMEOUT_S) -> bool:
        return wait_until(lambda: len(self.lines(needle)) >= count, timeout=timeout, every_s=0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def configured(
    endpoint: Broker | tuple[str, int], topic: str, state_dir: Path, **sections: dict[str, Any]
) -> DaemonConfig:
    """``config_for`` (``tests.test_daemon_backpressure``) with any section added to, ``[broker]`` included."""
    settings = config_for(endpoint, topic, state_dir).model_dump()
    for name, values in sections.items():
        settings[name] = {**settings[name], **values}
    return DaemonConfig.model_validate(settings)


def client_id(bundle: Path, instance: str) -> str:
    return f"edgeline-{edgeline.read_bundle(bundle).manifest.name}-{instance}"


# -- 1. answers past their time to live ------------------------------------------------------------------------


@dataclass(frozen=True)
class Outage:
    sent: int
    """Answers that were in flight (sent, unacknowledged) when the link was cut."""
    arrivals: list[tuple[float, dict[str, Any]]]
    """(arrival time, answer) of everything the subscriber received."""
    counts: dict[str, int]
    """The daemon's status counts at the end."""


@pytest.fixture(scope="module")
def ttl_outage(session_broker: Broker, built_litert_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Outage:
    """Ten answers are published into a black hole (sent, no PUBACK: paho keeps them to send again after the
    reconnection); the outage outlasts their time to live of ``TTL_S``; then the link heals. The inputs were
    never acknowledged either (their PUBACKs went into the hole too), so the broker sends them again and they are
    answered afresh."""
    broker, count = session_broker, 10
    topic = f"edgeline-test/{uuid.uuid4().hex}"
    results = TimedCollector(broker, f"{topic}/out/#")
    state = tmp_path_factory.mktemp("ttl") / "state"
    with BlackHoleProxy.to(broker) as proxy:
        daemon = Daemon(
            built_litert_bundle, config_for((proxy.host, proxy.port), topic, state, outbox={"ttl_s": TTL_S})
        )
        gate = hold_worker(daemon)
        daemon.start()
        assert daemon.connection is not None
        connection = daemon.connection
        try:
            publish_all(broker, topic, range(count))
            assert wait_until(lambda: daemon.queue.stats().enqueued == count), daemon.queue.stats()
            proxy.pause()
            gate.set()
            assert wait_until(lambda: connection.in_flight == count), f"{connection.in_flight} in flight"
            time.sleep(TTL_S + 1.5)  # the outage outlasts the time to live of the answers in flight
            proxy.resume()  # the link that lost bytes is closed: the daemon reconnects and paho would resend
            answered = wait_until(lambda: len(results.ids()) == count)
            assert answered, f"answered: {sorted(results.ids())}; {daemon.status()}; held {len(daemon.intake.held)}"
            # A stale answer sent again after the fresh ones would come before the answer of one more input.
            publish_all(broker, topic, range(count, count + 1))
            assert wait_until(lambda: f"m{count}" in results.ids()), "the sentinel was never answered"
        finally:
            counts = daemon.status()["counts"]
            daemon.stop()
            results.close()
    arrivals = [(at, json.loads(body)) for at, body in results.arrivals]
    assert arrivals[-1][1]["id"] == f"m{count}", "an answer came after everything else had been answered"
    return Outage(count, arrivals[:-1], counts)


def test_answers_in_flight_when_the_link_drops_are_never_delivered_past_their_ttl(ttl_outage: Outage) -> None:
    # ``timestamp`` is the wall-clock time the worker made the answer, just before the outbox committed it (the
    # time to live counts from that commit): an answer's age at arrival is at most its time to live, plus the
    # commit's few milliseconds.
    ages = sorted(round(at - answer["timestamp"], 3) for at, answer in ttl_outage.arrivals)
    print(f"ages at arrival (s): {ages}")
    assert {answer["id"] for _, answer in ttl_outage.arrivals} == {f"m{i}" for i in range(ttl_outage.sent)}
    late = [age for age in ages if age > TTL_S + 0.25]
    assert not late, f"delivered past their time to live of {TTL_S:g} s: {late}"
    assert ttl_outage.counts["outbox_expired"] >= ttl_outage.sent, ttl_outage.counts  # exactly: the next test


def test_each_answer_that_expired_in_flight_is_counted_once(ttl_outage: Outage) -> None:
    """Dropped from the outbox by its expiry and then dropped by the client's resend check: one answer, counted
    once."""
    assert ttl_outage.counts["outbox_expired"] == ttl_outage.sent, ttl_outage.counts


# -- 2. counters -------------------------------------------------------------------------------------------------

COUNTERS = (
    "edgeline_outbox_expired", "edgeline_outbox_overflowed", "edgeline_reconnects", "edgeline_publish_stalls",
    "edgeline_session_takeovers", "edgeline_received", "edgeline_dropped",
)  # fmt: skip


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
def test_every_counter_exists_at_zero_from_the_start_labelled_by_daemon(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    config = config_for(broker, unique_topic, tmp_path / "state", health={"prometheus_port": free_port()})
    daemon = Daemon(built_litert_bundle, config)
    daemon.start()
    try:
        assert daemon._metrics_server is not None
        families = scrape(daemon._metrics_server.port)
    finally:
        daemon.stop()
    for name in COUNTERS:
        assert name in families, f"{name} missing before the first event: {sorted(families)}"
        assert counter(families, name) == 0, name
    samples = [(family, sample) for family in families.values() for sample in family.samples]
    gauges = {s.name for family, s in samples if family.type == "gauge"}
    assert not gauges & {"edgeline_outbox_expired", "edgeline_reconnects"}, "a counter exposed as a gauge"
    assert not [s for _, s in samples if "instance" in s.labels], "the label instance is Prometheus' own"
    ours = [s for _, s in samples if s.name.startswith("edgeline_")]
    assert ours and all(s.labels.get("daemon") == daemon.instance == "bp" for s in ours)


@dataclass(frozen=True)
class Overflow:
    inputs: int
    arrived: int
    """Distinct answers the subscriber received."""
    overflowed: int
    """``edgeline_outbox_overflowed_total`` at the end."""
    counts: dict[str, int]


def overflow_behind_a_black_hole(
    broker: Broker, bundle: Path, topic: str, state_dir: Path, *, slow_hand_over_s: float = 0.0
) -> Overflow:
    """QoS 0 inputs (drop policy, no intake gate) reach the daemon; its worker answers them only once the link to
    the broker is a black hole, into an outbox of 20 answers and a client that holds 8 in flight and 8 queued;
    then the link heals. ``slow_hand_over_s``: the network thread takes that long over each batch of committed
    answers handed to it (a busy device)."""
    count = 200
    results = TimedCollector(broker, f"{topic}/out/#")
    with BlackHoleProxy.to(broker) as proxy:
        config = configured(
            (proxy.host, proxy.port), topic, state_dir,
            input={"qos": 0}, outbox={"max_answers": 20}, broker={"max_inflight": 8, "max_queued": 8},
            health={"prometheus_port": free_port()},
        )  # fmt: skip
        daemon = Daemon(bundle, config)
        gate = hold_worker(daemon)
        daemon.start()
        assert daemon.gate is None and daemon._metrics_server is not None  # a source that cannot wait
        assert daemon.delivery is not None
        if slow_hand_over_s:
            delivery, handed_over = daemon.delivery, daemon.delivery._handed_over

            def slowly(*args: Any) -> None:
                time.sleep(slow_hand_over_s)
                handed_over(*args)

            delivery._handed_over = slowly  # type: ignore[method-assign]
        port = daemon._metrics_server.port
        try:
            # QoS 0 has no session: an input published before the daemon's subscription is in is never sent to it.
            # Its "online" follows its SUBSCRIBE on the same connection: once "online" is out, the broker has both.
            availability = Collector(broker, daemon.availability_topic)
            try:
                said = availability.wait_for(1, timeout=30)
            finally:
                availability.close()
            assert said and said[-1][1] == b"online", f"the daemon never said online: {said}"
            publish_all(broker, topic, range(count))
            assert wait_until(lambda: daemon.queue.stats().enqueued == count), daemon.queue.stats()
            proxy.pause()
            gate.set()
            assert wait_until(lambda: daemon.status()["counts"]["results"] == count)
            time.sleep(0.5 + 10 * slow_hand_over_s)  # the last commits and hand-overs
            proxy.resume()

            def overflowed() -> int:
                return int(counter(scrape(port), "edgeline_outbox_overflowed"))

            wait_until(lambda: len(results.ids()) + overflowed() >= count, every_s=0.2)
            # Anything still on its way comes before the answer of one more input (a barrier, not a pause).
            publish_all(broker, topic, range(count, count + 1))
            assert wait_until(lambda: f"m{count}" in results.ids()), "the sentinel was never answered"
            lost, arrived = overflowed(), len(results.ids() - {f"m{count}"})
            last = json.loads(results.arrivals[-1][1])["id"]
            assert last == f"m{count}", f"{last} came after everything else had been answered"
        finally:
            counts = daemon.status()["counts"]
            daemon.stop()
            results.close()
    print(f"{count} inputs: {arrived} answered, {lost} counted as overflowed; {counts}")
    assert counts["dropped"] == 0 and counts["results"] == count + 1  # one answer per input (and the sentinel)
    assert lost > 0, "nothing overflowed: the outbox was not tested"
    return Overflow(count, arrived, lost, counts)


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
def test_the_overflow_counter_counts_exactly_the_answers_that_never_arrived(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """Every input has one answer; each one that never arrives must be counted as overflowed, and no other."""
    run = overflow_behind_a_black_hole(broker, built_litert_bundle, unique_topic, tmp_path / "state")
    assert run.overflowed == run.inputs - run.arrived, f"{run.inputs - run.arrived} never arrived: {run}"


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
def test_the_overflow_counter_stays_exact_when_the_network_thread_is_slow(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """The same, with a network thread that takes 50 ms over each hand-over of committed answers (a busy device):
    commits every 20 ms drop answers whose hand-over is still on its way to the client."""
    run = overflow_behind_a_black_hole(
        broker, built_litert_bundle, unique_topic, tmp_path / "state", slow_hand_over_s=0.05
    )
    assert run.overflowed == run.inputs - run.arrived, f"{run.inputs - run.arrived} never arrived: {run}"


# -- 3. SIGHUP ---------------------------------------------------------------------------------------------------


def test_sighup_drains_and_starts_again_in_the_same_process_with_the_new_configuration(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    topic, subscription = unique_topic, f"{unique_topic}/in/+"
    config = tmp_path / "daemon.toml"
    config.write_text(f'[output]\npublish = "{topic}/before/{{device}}"\n')
    child = DaemonChild(
        [str(built_litert_bundle), "--config", str(config), "--broker", broker.address, "--subscribe", subscription,
         "--qos", "1", "--state-dir", str(tmp_path / "state"), "--instance", "hup"],
        tmp_path / "daemon.log",
    )  # fmt: skip
    identity = client_id(built_litert_bundle, "hup")
    before, after = Collector(broker, f"{topic}/before/#"), Collector(broker, f"{topic}/after/#")
    everything = Collector(broker, f"{topic}/#")  # one connection: the answers in the order the broker took them
    since = broker.log_size()
    process = child.start()
    try:
        assert broker.wait_for_subscription(identity, subscription, timeout=TIMEOUT_S, since=since), child.log_text()
        publish_all(broker, topic, range(0, 1))
        assert [json.loads(body)["id"] for _, body, _ in before.wait_for(1)] == ["m0"]
        config.write_text(f'[output]\npublish = "{topic}/after/{{device}}"\n')  # read again at the reload
        since = broker.log_size()
        process.send_signal(signal.SIGHUP)
        resubscribed = broker.wait_for_subscription(identity, subscription, timeout=TIMEOUT_S, since=since)
        assert resubscribed, child.log_text()[-3000:]
        assert process.poll() is None, child.log_text()[-3000:]  # the same process (execv keeps its id)
        assert child.lines("SIGHUP: draining"), child.log_text()[-3000:]
        assert child.wait_for_log(" edgeline run: ", count=2), child.log_text()[-3000:]  # it started again
        publish_all(broker, topic, range(1, 2))
        assert [json.loads(body)["id"] for _, body, _ in after.wait_for(1)] == ["m1"], child.log_text()[-3000:]
        publish_all(broker, topic, range(2, 3))  # a sentinel: anything extra would come before its answer
        assert len(after.wait_for(2)) == 2, child.log_text()[-3000:]
        seen = everything.wait_for(6)  # three inputs, three answers
        answers = [(t.split("/")[-2], json.loads(body)["id"]) for t, body, _ in seen if "/in/" not in t]
        assert answers == [("before", "m0"), ("after", "m1"), ("after", "m2")], answers
        assert len(before.messages) == 1 and len(after.messages) == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=TIMEOUT_S) == 0, child.log_text()[-3000:]
        assert "Traceback" not in child.log_text()
    finally:
        child.kill()
        before.close()
        after.close()
        everything.close()


# -- 4. bounded logs -----------------------------------------------------------------------------------------------


class SerialFeed:
    """A loopback TCP server that plays a serial device for pyserial's ``socket://`` URL: one connection, kept
    open, and lines written to it at a given rate (a sensor that cannot wait for anyone)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(TIMEOUT_S)
        self.url = f"socket://127.0.0.1:{self.server.getsockname()[1]}"
        self.connection: socket.socket | None = None

    def send(self, lines: list[bytes], rate: float) -> None:
        if self.connection is None:
            self.connection, _ = self.server.accept()
        start = time.monotonic()
        for index in range(0, len(lines), 10):
            if (ahead := start + index / rate - time.monotonic()) > 0:
                time.sleep(ahead)
            self.connection.sendall(b"".join(line + b"\n" for line in lines[index : index + 10]))

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.server.close()


@pytest.fixture
def serial_feed() -> Iterator[SerialFeed]:
    feed = SerialFeed()
    yield feed
    feed.close()


@pytest.mark.workstation  # its daemon serves metrics: prometheus-client (metrics extra)
def test_an_outbox_overflowing_for_ten_seconds_logs_a_handful_of_lines_and_counts_every_drop(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path, serial_feed: SerialFeed
) -> None:
    """Serial lines for 10 s (a source that cannot wait: drop policy, no gate) while the broker is unreachable and
    the outbox holds 5 answers: an answer dropped at every line, and a few lines of log. (100 lines a second:
    pyserial's ``socket://`` reads a byte at a time, some 150 lines a second here; a real port reads in blocks.)"""
    count, rate, port = 1000, 100.0, free_port()
    config = tmp_path / "daemon.toml"
    config.write_text(
        f"[broker]\nmax_inflight = 8\nmax_queued = 8\n[outbox]\nmax_answers = 5\n[health]\nprometheus_port = {port}\n"
    )
    lines = [
        json.dumps({"id": f"s{i}", "data": [((i + k) % 10) / 10 for k in range(64)]}, separators=(",", ":")).encode()
        for i in range(count)
    ]
    results = TimedCollector(broker, f"{unique_topic}/out/#")
    with BlackHoleProxy.to(broker) as proxy:
        child = DaemonChild(
            [str(built_litert_bundle), "--serial", serial_feed.url, "--device", "mcu", "--broker", proxy.address,
             "--publish", f"{unique_topic}/out/{{device}}", "--config", str(config),
             "--state-dir", str(tmp_path / "state"), "--instance", "flood"],
            tmp_path / "daemon.log",
        )  # fmt: skip
        process = child.start()

        def taken() -> int:
            families = scrape(port)
            return int(counter(families, "edgeline_received") + counter(families, "edgeline_dropped"))

        def overflowed() -> int:
            return int(counter(scrape(port), "edgeline_outbox_overflowed"))

        try:
            assert child.wait_for_log(" edgeline run: "), child.log_text()[-3000:]
            proxy.pause()
            serial_feed.send(lines, rate)
            assert wait_until(lambda: taken() == count, every_s=0.1), f"{taken()} of {count} lines taken"
            said = child.lines("outbox full")
            proxy.resume()
            wait_until(lambda: len(results.ids()) + overflowed() >= count, every_s=0.2)
            # Anything still on its way comes before the answer of one more line (a barrier, not a pause).
            serial_feed.send([json.dumps({"id": "sentinel", "data": [0.5] * 64}).encode()], rate)
            assert wait_until(lambda: "sentinel" in results.ids()), "the sentinel was never answered"
            last = json.loads(results.arrivals[-1][1])["id"]
            assert last == "sentinel", f"{last} came after everything else had been answered"
            lost, arrived = overflowed(), len(results.ids() - {"sentinel"})
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=TIMEOUT_S) == 0, child.log_text()[-3000:]
        finally:
            child.kill()
            results.close()
    print(f"{count} lines: {arrived} answered, {lost} overflowed; logged: {said}")
    # However long the flood took on this machine: one line when it started, then at most a summary per
    # SUMMARY_EVERY_S (each says how long since the last line: never less) and one when it ended.
    summaries = [float(m[1]) for line in said if (m := re.search(r"more in the last (\d+) s", line))]
    over = [line for line in said if ": over (" in line]
    shown = "\n".join(said[:10])
    assert len(said) == 1 + len(summaries) + len(over) and len(over) <= 1, shown
    assert all(interval >= SUMMARY_EVERY_S for interval in summaries), shown
    assert lost > count // 2, f"only {lost} of {count} overflowed: the outbox was not tested"
    assert lost == count - arrived, f"{count - arrived} answers never arrived, {lost} counted as overflowed"


# -- 5. a full disk, as a process ----------------------------------------------------------------------------------

DRAIN_S = 3.0
HANG_GUARD_S = DRAIN_S + 60
"""How long after SIGTERM a daemon counts as hung: a guard, far past the drain time (how soon it exits within the
drain time is a speed, not what a test decides on)."""


@dataclass
class DiskRig:
    """`edgeline run` with its state on a 4 MB tmpfs (its log and configuration elsewhere), a persistent QoS 1
    publisher of inputs and a persistent subscriber of answers, and a filler file that takes the disk's room."""

    broker: Broker
    child: DaemonChild
    identity: str
    subscription: str
    messages: list[tuple[str, bytes]]
    publisher: DurablePublisher
    answers: DurableCollector
    filler: Path

    def start(self) -> subprocess.Popen[bytes]:
        """Start the daemon; return once it subscribed, or has exited (the caller looks at which)."""
        since = self.broker.log_size()
        process = self.child.start()

        def subscribed() -> bool:
            return self.broker.wait_for_subscription(self.identity, self.subscription, timeout=0.05, since=since)

        assert wait_until(lambda: process.poll() is not None or subscribed()), self.child.log_text()[-3000:]
        return process

    def terminate(self) -> int | None:
        """SIGTERM; the exit code, or None: still running ``HANG_GUARD_S`` after it (a drain time ignored)."""
        assert self.child.process is not None
        self.child.process.send_signal(signal.SIGTERM)
        try:
            return self.child.process.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            return None

    def all_answered(self, count: int) -> None:
        assert self.publisher.wait_acknowledged(TIMEOUT_S), f"{len(self.publisher.pending)} inputs unacknowledged"
        missing = missing_answers(self.answers, {f"m{i}" for i in range(count)}, timeout=60)
        assert not missing, f"{len(missing)} of {count} never answered:\n{self.child.log_text()[-3000:]}"


@pytest.fixture
def disk_rig(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path, small_disk: Path
) -> Iterator[DiskRig]:
    topic, subscription = unique_topic, f"{unique_topic}/in/+"
    config = tmp_path / "daemon.toml"
    config.write_text(f"[outbox]\nmax_bytes = {2 << 20}\n[daemon]\ndrain_timeout_s = {DRAIN_S}\n")
    child = DaemonChild(
        [str(built_litert_bundle), "--config", str(config), "--broker", broker.address, "--subscribe", subscription,
         "--publish", f"{topic}/out/{{device}}", "--qos", "1", "--state-dir", str(small_disk / "state"),
         "--instance", "disk"],
        tmp_path / "daemon.log",
    )  # fmt: skip
    filler = small_disk / "filler"
    filler.touch()
    answers = DurableCollector(broker, f"{topic}/out/#", protocol=mqtt.MQTTv5).start_and_subscribe()
    publisher = DurablePublisher(broker, protocol=mqtt.MQTTv5)
    publisher.start()
    try:
        assert publisher.wait_connected()
        messages = [(f"{topic}/in/cam{i % 4}", payload(i)) for i in range(4000)]
        yield DiskRig(
            broker, child, client_id(built_litert_bundle, "disk"), subscription, messages, publisher, answers, filler
        )
    finally:
        child.kill()
        publisher.close()
        answers.close()


def test_sigterm_on_a_full_disk_exits_with_0_and_loses_nothing(disk_rig: DiskRig) -> None:
    """The disk fills under a backlog; SIGTERM ends the process (not hung past its drain time), with 0 and no fatal
    error; started again once there is room, it answers every input (those it could not store were not
    acknowledged)."""
    rig, child = disk_rig, disk_rig.child
    rig.start()
    rig.publisher.publish_all(rig.messages[:200])
    rig.all_answered(200)
    fill(rig.filler)
    sent = 200
    while not child.lines("the disk is full") and sent < len(rig.messages):  # a backlog: the outbox must grow
        rig.publisher.publish_all(rig.messages[sent : sent + 400])
        sent += 400
        child.wait_for_log("the disk is full", timeout=2.0)
    assert child.lines("the disk is full"), child.log_text()[-3000:]
    code = rig.terminate()
    first_run = child.log_text()
    assert code == 0, f"exit {code} (None: hung past its drain time of {DRAIN_S:g} s):\n{first_run[-3000:]}"
    assert "Fatal Python error" not in first_run and "Traceback" not in first_run, first_run[-3000:]
    rig.filler.unlink()
    process = rig.start()
    assert process.poll() is None, child.log_text()[len(first_run) :]
    rig.all_answered(sent)
    print(f"{sent} inputs, {len(rig.answers.messages)} answers")
    code = rig.terminate()
    assert code == 0, child.log_text()[-3000:]


def test_a_restart_on_a_full_disk_stays_up_and_answers_once_there_is_room(disk_rig: DiskRig) -> None:
    """Stopped cleanly; the disk fills while it is stopped (a log, another service) and inputs wait at the
    broker; started again, it must stay up (not exit into a restart loop) and answer everything once there is
    room, without another restart."""
    rig, child = disk_rig, disk_rig.child
    rig.start()
    rig.publisher.publish_all(rig.messages[:100])
    rig.all_answered(100)
    code = rig.terminate()
    assert code == 0, child.log_text()[-3000:]
    first_run = child.log_text()
    fill(rig.filler)
    rig.publisher.publish_all(rig.messages[100:300])  # they wait at the broker, in the daemon's session
    assert rig.publisher.wait_acknowledged(TIMEOUT_S)
    process = rig.start()
    assert process.poll() is None, f"exited {process.returncode}: {child.log_text()[len(first_run) :][-2000:]}"

    def met_the_full_disk() -> bool:  # the event the restart is tested on: its first commit found no room
        return "the disk is full" in child.log_text()[len(first_run) :] or process.poll() is not None

    assert wait_until(met_the_full_disk), f"never said the disk is full: {child.log_text()[len(first_run) :][-2000:]}"
    assert process.poll() is None, f"exited {process.returncode}: {child.log_text()[len(first_run) :][-2000:]}"
    rig.filler.unlink()
    rig.all_answered(300)
    code = rig.terminate()
    assert code == 0, child.log_text()[-3000:]
