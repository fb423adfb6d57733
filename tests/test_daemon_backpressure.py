"""What a device left alone for months meets, against a real Mosquitto: a backlog bigger than every buffer, a
broker slow to acknowledge, a full disk, and a clone with the same client id. The daemon slows down instead of
dropping (the intake gate: ``edgeline.daemon.intake``), pauses on a full disk instead of dying, and recognises a
session taken over without the broker's reason code."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from edgeline.daemon.config import BrokerConfig, DaemonConfig
from edgeline.daemon.intake import MAX_HELD
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.reconnect import TAKEOVER_AFTER, TAKEOVER_BACKOFF_S, Backoff, Lost
from edgeline.daemon.service import Daemon
from edgeline.daemon.state import instance_id
from tests import waiting
from tests.faults import can_mount, fill, tmpfs
from tests.mqtt_broker import Broker, Collector

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 240.0


def config_for(
    broker: Broker | tuple[str, int], topic: str, state_dir: Path, **sections: dict[str, Any]
) -> DaemonConfig:
    host, port = (broker.host, broker.port) if isinstance(broker, Broker) else broker
    settings: dict[str, dict[str, Any]] = {
        "broker": {"host": host, "port": port, "client_id": f"bp-{topic.replace('/', '-')}"},
        "input": {"subscribe": [f"{topic}/in/+"], "silence_warning_s": 0},
        "output": {"publish": f"{topic}/out/{{device}}"},
        "daemon": {"state_dir": str(state_dir), "instance": "bp"},
    }
    for name, values in sections.items():
        settings[name] = {**settings.get(name, {}), **values}
    return DaemonConfig.model_validate(settings)


def payload(index: int) -> bytes:
    return json.dumps({"id": f"m{index}", "data": [((index + k) % 10) / 10 for k in range(64)]}).encode()


def publish_all(broker: Broker, topic: str, indices: range, *, rate: float | None = None) -> None:
    """QoS 1 inputs from a paho client of the test's own; returns once the broker acknowledged every one."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        infos = []
        start = time.monotonic()
        for n, index in enumerate(indices):
            infos.append(client.publish(f"{topic}/in/cam{index % 4}", payload(index), qos=1))
            if rate is not None and (ahead := start + n / rate - time.monotonic()) > 0:
                time.sleep(ahead)
        for info in infos:
            info.wait_for_publish(60)
    finally:
        client.loop_stop()
        client.disconnect()


class Peak:
    """Samples a value in the background; ``peak`` is the largest seen."""

    def __init__(self, read: Any, every_s: float = 0.005) -> None:
        self.peak = 0
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, int(read()))
                time.sleep(every_s)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def answered(results: Collector, count: int, timeout: float = TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """The answers by id once ``count`` distinct ids have one (duplicates, allowed at QoS 1, do not count), or
    what has come when ``timeout`` is over (the caller checks)."""
    answers: dict[str, dict[str, Any]] = {}
    seen = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        messages = list(results.messages)
        for _, body, _ in messages[seen:]:
            record = json.loads(body)
            answers[record["id"]] = record
        seen = len(messages)
        if len(answers) >= count:
            break
        time.sleep(0.2)
    return answers


@pytest.mark.integration
def test_a_backlog_of_50000_waits_at_the_broker_and_every_input_is_answered(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """The daemon's persistent session collects 50,000 inputs while it is stopped; started with an outbox of
    1,000 answers, it answers every one, drops none, and its outbox never goes past its cap."""
    count = 50_000
    config = config_for(broker, unique_topic, tmp_path / "state", outbox={"max_answers": 1000})
    first = Daemon(built_litert_bundle, config)
    first.start()  # the persistent session and its subscription
    first.stop()
    results = Collector(broker, f"{unique_topic}/out/#", timeout=TIMEOUT_S)
    publish_all(broker, unique_topic, range(count))
    daemon = Daemon(built_litert_bundle, config)
    daemon.start()
    assert daemon.outbox is not None
    outbox = daemon.outbox
    peak, held = Peak(lambda: outbox.depth), Peak(lambda: len(daemon.intake.held))
    try:
        answers = answered(results, count)
    finally:
        highest, most_held = peak.stop(), held.stop()
        status = daemon.status()
        daemon.stop()
        results.close()
    missing = {f"m{i}" for i in range(count)} - set(answers)
    assert not missing, f"{len(missing)} of {count} inputs never answered, e.g. {sorted(missing)[:5]}"
    assert not [a for a in answers.values() if "error" in a]
    assert status["counts"]["outbox_overflowed"] == 0 and status["counts"]["dropped"] == 0
    assert highest <= 1000, f"the outbox held {highest} answers, above its cap of 1000"
    assert status["counts"]["intake_pauses"] >= 1  # the gate did the holding back, not luck
    # Mosquitto 2.0.11 sends far past our Receive Maximum here: what is held in memory stays bounded all the same
    assert most_held <= MAX_HELD


class PacketRelay:
    """A TCP relay between the daemon and the broker, packet by packet: ``up(packet)`` (daemon to broker) and
    ``down(packet)`` (broker to daemon) give what passes on, and may hold it; as they are, every packet passes."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def up(self, packet: bytes) -> bytes:
        return packet

    def down(self, packet: bytes) -> bytes:
        return packet

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.broker.host, self.broker.port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream, self.up), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, self.down), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, change: Callable[[bytes], bytes]) -> None:
        buffer = b""
        try:
            while data := source.recv(65536):
                buffer += data
                while (packet := _one_packet(buffer)) is not None:
                    buffer = buffer[len(packet) :]
                    sink.sendall(change(packet))
        except OSError:
            pass
        finally:
            for side in (source, sink):
                side.close()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for sock in self._sockets:
            sock.close()


class SlowAckRelay(PacketRelay):
    """Lets the broker's PUBACKs through at ``acks_per_s`` at most (every other packet passes at once): a broker slow
    to acknowledge the daemon's answers."""

    def __init__(self, broker: Broker, acks_per_s: float) -> None:
        self.interval = 1.0 / acks_per_s
        self.held = 0
        self._next_ack = time.monotonic()
        super().__init__(broker)

    def down(self, packet: bytes) -> bytes:
        if packet[0] >> 4 == 4:  # PUBACK: waits for its turn
            self.held += 1
            self._next_ack = max(self._next_ack + self.interval, time.monotonic())
            time.sleep(max(0.0, self._next_ack - time.monotonic()))
        return packet


def _one_packet(buffer: bytes) -> bytes | None:
    """The first whole MQTT packet of ``buffer`` (fixed header, remaining length), or None."""
    length, shift, index = 0, 0, 1
    while True:
        if index >= len(buffer):
            return None
        digit = buffer[index]
        length |= (digit & 127) << shift
        index += 1
        shift += 7
        if digit < 128:
            break
    return buffer[: index + length] if len(buffer) >= index + length else None


@pytest.mark.integration
def test_a_broker_slow_to_acknowledge_holds_the_inputs_back_and_loses_none(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """Inputs arrive at about 1,000 a second, the broker acknowledges answers at 300 a second: the outbox fills to
    its high-water mark, the daemon stops taking inputs until it drains, and every input is answered."""
    count = 4000
    relay = SlowAckRelay(broker, acks_per_s=300)
    config = config_for(("127.0.0.1", relay.port), unique_topic, tmp_path / "state", outbox={"max_answers": 500})
    results = Collector(broker, f"{unique_topic}/out/#", timeout=TIMEOUT_S)
    daemon = Daemon(built_litert_bundle, config)
    daemon.start()
    assert daemon.outbox is not None
    outbox = daemon.outbox
    peak = Peak(lambda: outbox.depth)
    try:
        publish_all(broker, unique_topic, range(count), rate=1000)
        answers = answered(results, count)
    finally:
        highest = peak.stop()
        status = daemon.status()
        daemon.stop()
        relay.close()
        results.close()
    missing = {f"m{i}" for i in range(count)} - set(answers)
    assert not missing, f"{len(missing)} of {count} inputs never answered"
    assert relay.held >= count  # the relay really stood between the daemon and the broker
    assert status["counts"]["outbox_overflowed"] == 0
    assert status["counts"]["intake_pauses"] >= 1
    assert highest <= 500


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs of the test's own (root only: CI runs as root), unmounted at teardown."""
    if not can_mount():
        pytest.skip("mounting a tmpfs needs root and mount(8) (CI runs as root)")
    with tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


def commits_refused_for_room(outbox: Any) -> list[float]:
    """Spies on ``outbox.add`` and ``outbox.remove``: one entry for every commit the disk had no room for (the
    committer retries it)."""
    from edgeline.daemon.outbox import DiskFull

    refused: list[float] = []

    def counting(write: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return write(*args, **kwargs)
            except DiskFull:
                refused.append(time.monotonic())
                raise

        return counted

    outbox.add, outbox.remove = counting(outbox.add), counting(outbox.remove)
    return refused


wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)


@pytest.mark.integration
def test_a_full_disk_pauses_intake_and_every_input_is_answered_once_it_has_room(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edgeline")
    config = config_for(broker, unique_topic, small_disk / "state", outbox={"max_bytes": 2 << 20})
    filler = small_disk / "filler"
    filler.touch()
    results = Collector(broker, f"{unique_topic}/out/#", timeout=TIMEOUT_S)
    daemon = Daemon(built_litert_bundle, config)
    daemon.start()
    assert daemon.delivery is not None
    delivery = daemon.delivery
    full_commits = commits_refused_for_room(delivery.outbox)
    try:
        publish_all(broker, unique_topic, range(300))
        answered(results, 300, timeout=60)
        # SQLite reuses its WAL and free pages in place, answers leave about as fast as they come, and the outbox
        # gives back what its WAL took beyond its share once a second (its budget shrinks on a full disk: that is
        # what keeps a daemon from filling a disk it cannot work its way out of): so the filler takes again what
        # the outbox gave back before every burst the broker takes unpaced, until a commit needs room the disk does
        # not have (bounded: 60 bursts)
        sent = 300
        while delivery.disk_full_episodes == 0 and sent < 30300:
            fill(filler)
            publish_all(broker, unique_topic, range(sent, sent + 500))
            sent += 500
        assert delivery.disk_full_episodes >= 1, "the commits never met the full disk"
        # a while on a full disk (two more retries, or room again by itself): nothing may die, nothing may be
        # acknowledged unstored
        met = len(full_commits)
        assert wait_until(lambda: len(full_commits) >= met + 2 or delivery.disk_full_since is None)
        assert not daemon.supervisor.failed.is_set(), daemon.supervisor.failure
        filler.unlink()
        answers = answered(results, sent)
    finally:
        status = daemon.status()
        daemon.stop()
        results.close()
    missing = {f"m{i}" for i in range(sent)} - set(answers)
    assert not missing, f"{len(missing)} of {sent} inputs never answered across the full disk"
    assert not [a for a in answers.values() if "error" in a]
    # SQLite reuses its WAL in place, so a full disk may stop one commit and let the next through: episodes >= 1
    assert status["counts"]["disk_full"] >= 1
    assert status["counts"]["outbox_overflowed"] == 0
    said = [r for r in caplog.records if "the disk is full" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(said) == 1, [r.getMessage() for r in said]  # logged once, however many retries and episodes


@pytest.mark.quick
def test_a_corrupted_outbox_is_set_aside_and_a_new_one_started(tmp_path: Path) -> None:
    from edgeline.daemon.outbox import Outbox

    path = tmp_path / "outbox.sqlite"
    path.write_bytes(b"this is not a database, it was cut short by a power failure" * 100)
    box = Outbox(path)
    try:
        assert box.set_aside is not None and box.set_aside.exists()
        assert box.set_aside.name.startswith("outbox.sqlite.corrupt-")
        assert box.stats().corrupt == 1
        box.add([("results/a", b"{}", time.time())])
        assert box.depth == 1
    finally:
        box.close()
    again = Outbox(path)  # the new one is sound: nothing set aside the next time
    assert again.set_aside is None and again.depth == 1
    again.close()


@pytest.mark.quick
def test_clones_of_one_image_get_different_instance_ids(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = instance_id(state, identity="/etc/machine-id=0123456789abcdef0123456789abcdef")
    clone = instance_id(state, identity="/etc/machine-id=fedcba9876543210fedcba9876543210")
    assert first != clone
    assert first == instance_id(state, identity="/etc/machine-id=0123456789abcdef0123456789abcdef")  # stable
    assert first.split("-")[0] == clone.split("-")[0]  # the host name stays readable in front


@pytest.mark.integration
def test_two_clients_with_one_client_id_back_off_and_say_so_once(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Mosquitto 2.0 closes the older connection without reason 142: each side recognises the pattern, logs it
    once naming the client id, counts it, and backs off instead of taking turns several times a second.

    Counted, not timed: every wait between attempts is the one ``Backoff`` chose (recorded as chosen), and the
    test waits for the event that shows the back-off (a wait beyond ``reconnect_max_s``, which only a recognised
    takeover allows), then checks each chosen wait against the schedule computed from the back-off's parameters."""
    caplog.set_level(logging.INFO, logger="edgeline")
    settings = BrokerConfig(host=broker.host, port=broker.port, reconnect_max_s=1.0, keepalive_s=5)
    connections = [MqttConnection(settings, client_id="clone-of-one-image") for _ in range(2)]
    changed = threading.Condition()
    chosen: list[list[tuple[int, float, float, int]]] = [[] for _ in connections]
    """Per connection: (attempt, cap, delay, takeovers so far) of every wait it chose."""
    losses: list[list[Lost]] = [[] for _ in connections]

    def record(index: int, backoff: Backoff) -> None:
        next_delay, lost = backoff.next_delay, backoff.lost

        def recorded_delay(*, accepted: bool) -> float:
            delay = next_delay(accepted=accepted)
            with changed:
                chosen[index].append((backoff.attempt, backoff.cap_s, delay, backoff.takeovers))
                changed.notify_all()
            return delay

        def recorded_loss(now: float, *, taken_over: bool = False) -> Lost:
            outcome = lost(now, taken_over=taken_over)
            with changed:
                losses[index].append(outcome)
                changed.notify_all()
            return outcome

        backoff.next_delay = recorded_delay  # type: ignore[method-assign]
        backoff.lost = recorded_loss  # type: ignore[method-assign]

    def run(target: Any) -> threading.Thread:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    def backed_off() -> bool:
        return any(delay > settings.reconnect_max_s for waits in chosen for _, _, delay, _ in waits)

    def taking_turns() -> bool:  # no back-off yet after this many losses: it would take turns for ever
        return any(len(outcomes) > 4 * TAKEOVER_AFTER for outcomes in losses)

    try:
        for index, connection in enumerate(connections):
            record(index, connection.backoff)
            connection.start(run)
        with changed:
            changed.wait_for(lambda: backed_off() or taking_turns(), timeout=TIMEOUT_S)  # a hang guard only
            assert backed_off(), f"no wait beyond the usual cap after {[len(o) for o in losses]} losses: {chosen}"
    finally:
        for connection in connections:
            connection.close(1)
    for index, connection in enumerate(connections):
        first_s = connection.backoff._retry.first_s
        for attempt, cap, delay, takeovers in chosen[index]:
            step = min(cap, first_s * 2 ** (attempt - 1))
            assert step / 2 <= delay <= step, (index, chosen[index])  # the schedule's own wait, jitter included
            # Beyond the usual cap only once a takeover was recognised, and then up to TAKEOVER_BACKOFF_S.
            assert cap == settings.reconnect_max_s or (cap == TAKEOVER_BACKOFF_S and takeovers), chosen[index]
    assert sum(c.backoff.takeovers for c in connections) >= 1
    said = [r for r in caplog.records if "session taken over" in r.getMessage()]
    first_seen = sum(outcomes.count(Lost.TAKEOVER) for outcomes in losses)
    assert len(said) == first_seen >= 1, (said, losses)  # once per recognition; again and again only counted
    assert all("clone-of-one-image" in r.getMessage() for r in said)


@pytest.mark.quick
def test_shared_subscriptions_get_a_short_session_expiry_unless_one_is_set() -> None:
    from edgeline.daemon.config import SESSION_EXPIRY_S, SHARED_SESSION_EXPIRY_S

    assert BrokerConfig().session_expiry(shared=False) == SESSION_EXPIRY_S
    assert BrokerConfig().session_expiry(shared=True) == SHARED_SESSION_EXPIRY_S < SESSION_EXPIRY_S
    assert BrokerConfig(session_expiry_s=3600).session_expiry(shared=True) == 3600
    data = DaemonConfig().with_overrides(subscribe=["$share/g/sensors/+/+"]).broker  # through the command line
    assert data.session_expiry_s is None and data.session_expiry(shared=True) == SHARED_SESSION_EXPIRY_S
