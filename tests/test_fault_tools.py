"""The fault-injection tools against a real Mosquitto: persistence across SIGKILL, clients that survive restarts,
a network black hole, and a TLS listener with passwords and an ACL.

Each test starts its own broker(s); the whole file runs in about half a minute.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from tests.faults import (
    BlackHoleProxy,
    DurableCollector,
    DurablePublisher,
    Pki,
    count_ids,
)
from tests.mqtt_broker import Broker, BrokerFactory, Collector

pytestmark = pytest.mark.integration

TIMEOUT_S = 10.0
PROTOCOLS = [pytest.param(mqtt.MQTTv311, id="mqtt311"), pytest.param(mqtt.MQTTv5, id="mqtt5")]

USERS = {"device": "right-password", "viewer": "viewer-password"}
ACL = """\
user device
topic readwrite sensors/#
topic read answers/#

user viewer
topic read sensors/#
"""
"""``device`` may publish sensor data but not answers; anything not granted is denied."""


def json_message(topic: str, index: int) -> tuple[str, bytes]:
    return topic, json.dumps({"id": index, "data": [float(index)]}).encode()


# --- persistence across SIGKILL ------------------------------------------------------------------------------


def queue_for_offline_subscriber(broker: Broker, protocol: mqtt.MQTTProtocolVersion, topic: str) -> str:
    """A persistent subscriber subscribes and leaves; one QoS 1 message is published for it; its client id."""
    subscriber = DurableCollector(broker, topic, protocol=protocol).start_and_subscribe(TIMEOUT_S)
    subscriber.close()
    with DurablePublisher(broker, protocol=protocol) as publisher:
        assert publisher.wait_connected(TIMEOUT_S)
        publisher.publish_all([json_message(topic, 1)])
        assert publisher.wait_acknowledged(TIMEOUT_S), "no PUBACK"
        assert len(publisher.acknowledged) == 1
    return subscriber.client_id


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_queued_message_survives_sigkill_with_persistence(
    broker_factory: BrokerFactory, protocol: mqtt.MQTTProtocolVersion
) -> None:
    broker = broker_factory(persistence=True)
    client_id = queue_for_offline_subscriber(broker, protocol, "sensors/queued")
    # The save follows the PUBACK; killing before it ends loses the message (see the Broker docstring). This test
    # is about what a save keeps, so it waits for a saved database that holds the message.
    _, payload = json_message("sensors/queued", 1)
    deadline = time.monotonic() + TIMEOUT_S
    while payload not in (broker.persistence_path.read_bytes() if broker.persistence_path.exists() else b""):
        assert time.monotonic() < deadline, f"no save of the queued message:\n{broker.log_text()}"
        time.sleep(0.01)
    broker.kill()
    assert not broker.running
    broker.restart()

    with DurableCollector(broker, "sensors/queued", client_id=client_id, protocol=protocol) as subscriber:
        assert subscriber.wait_connected(TIMEOUT_S)
        assert subscriber.sessions_resumed == 1, "the broker forgot the session across the SIGKILL"
        assert subscriber.wait_for(1, TIMEOUT_S), broker.log_text()
        assert count_ids(subscriber.payloads) == {1: 1}


def test_without_persistence_the_same_sigkill_loses_the_message(broker_factory: BrokerFactory) -> None:
    """The contrast that shows the test above can fail."""
    broker = broker_factory()
    client_id = queue_for_offline_subscriber(broker, mqtt.MQTTv311, "sensors/queued")
    broker.kill()
    broker.restart()

    with DurableCollector(broker, "sensors/queued", client_id=client_id) as subscriber:
        assert subscriber.wait_connected(TIMEOUT_S)
        assert subscriber.sessions_resumed == 0
        assert subscriber.wait_for(1, 1.0) == []


def wait_caught_up(collector: DurableCollector, publisher: DurablePublisher, *, connections: int) -> None:
    """Until the collector is connected (``connections`` times so far) and has every message acknowledged by now."""
    assert collector.wait_connected(TIMEOUT_S, connections=connections), "the collector did not come back"
    acknowledged = set(count_ids(payload for _, payload in publisher.acknowledged))
    collector.wait_for(lambda got: acknowledged <= set(count_ids(payload for _, payload in got)), TIMEOUT_S)


# --- the black hole ------------------------------------------------------------------------------------------


class WatchedClient:
    """A plain paho client that records when it connects and disconnects, and why it disconnected."""

    def __init__(self, endpoint: BlackHoleProxy, keepalive: int) -> None:
        self.connects: list[float] = []
        self.disconnects: list[float] = []
        self.disconnect_reasons: list[ReasonCode] = []
        self.changed = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watched-{endpoint.port}")
        self.client.reconnect_delay_set(1, 1)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.connect_async(endpoint.host, endpoint.port, keepalive=keepalive)
        self.client.loop_start()

    def wait(self, events: list[float], count: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(events) >= count, timeout=timeout)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, *args: object) -> None:
        with self.changed:
            self.connects.append(time.monotonic())
            self.changed.notify_all()

    def _on_disconnect(
        self, client: object, userdata: object, flags: object, reason: ReasonCode, properties: object
    ) -> None:
        with self.changed:
            self.disconnects.append(time.monotonic())
            self.disconnect_reasons.append(reason)
            self.changed.notify_all()


@pytest.fixture
def proxy(broker: Broker) -> Iterator[BlackHoleProxy]:
    with BlackHoleProxy.to(broker) as running:
        yield running


def test_black_hole_makes_the_keepalive_fire_and_resume_lets_the_client_back(
    broker: Broker, proxy: BlackHoleProxy
) -> None:
    keepalive = 2
    observer = Collector(broker, "sensors/#")
    watched = WatchedClient(proxy, keepalive)
    try:
        assert watched.wait(watched.connects, 1, TIMEOUT_S), "never connected through the proxy"
        info = watched.client.publish("sensors/before", b"1", qos=1)
        info.wait_for_publish(TIMEOUT_S)
        assert info.is_published() and observer.wait_for(1, TIMEOUT_S)
        assert proxy.accepted == 1

        proxy.pause()
        assert watched.wait(watched.disconnects, 1, TIMEOUT_S), "the keepalive never noticed the black hole"
        # Nothing was closed: it is paho's keepalive that gave up (a PINGREQ with no PINGRESP), not a lost socket.
        reason = watched.disconnect_reasons[0]  # (later attempts into the hole end the same way)
        assert reason == ReasonCode(PacketTypes.DISCONNECT, "Keep alive timeout"), watched.disconnect_reasons
        deadline = time.monotonic() + TIMEOUT_S
        while proxy.accepted < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.accepted >= 2, "the client did not try again while paused"
        assert len(watched.connects) == 1, "a connection got through the black hole"

        proxy.resume()
        assert watched.wait(watched.connects, 2, TIMEOUT_S), "no reconnection after resume"
        info = watched.client.publish("sensors/after", b"2", qos=1)
        info.wait_for_publish(TIMEOUT_S)
        assert info.is_published()
        observer.wait_for(2, TIMEOUT_S)
        assert observer.payloads == [b"1", b"2"]
        threads = proxy.threads
        assert len(threads) >= 3, threads  # the accept loop and the two pumps of the link in use
    finally:
        watched.close()
        observer.close()
    proxy.close()  # each join is bounded: a thread it could not end is still alive below
    assert not [thread.name for thread in threads if thread.is_alive()], "close() left threads running"
    assert proxy.open_links == 0


def test_black_hole_refuses_when_the_target_is_down_and_forwards_when_it_is_back(
    broker: Broker, proxy: BlackHoleProxy
) -> None:
    broker.kill()
    with DurableCollector(proxy, "sensors/#") as collector:
        deadline = time.monotonic() + TIMEOUT_S
        while proxy.accepted < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.accepted >= 2 and not collector.connected  # accepted, then closed: the target refused
        broker.restart()
        assert collector.wait_connected(TIMEOUT_S)


# --- TLS, passwords and the ACL ------------------------------------------------------------------------------


class Attempt:
    """One paho connection to the TLS listener; what the handshake, the CONNACK and the PUBACKs said."""

    def __init__(
        self,
        broker: Broker,
        *,
        ca: Path,
        user: str | None = "device",
        password: str = USERS["device"],
        protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv5,
        client_cert: tuple[Path, Path] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.connack: ReasonCode | None = None
        self.error: Exception | None = None
        self.pubacks: dict[int, ReasonCode] = {}
        self.done = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=protocol)
        certfile, keyfile = (str(path) for path in client_cert) if client_cert else (None, None)
        self.client.tls_set(ca_certs=str(ca), certfile=certfile, keyfile=keyfile)
        if user is not None:
            self.client.username_pw_set(user, password)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        try:
            self.client.connect(host, broker.tls_port, keepalive=10)
        except (OSError, ssl.SSLError) as exc:  # a failed handshake raises here (ssl.SSLError is an OSError)
            self.error = exc
            return
        self.client.loop_start()
        with self.done:
            self.done.wait_for(lambda: self.connack is not None or self.error is not None, timeout=TIMEOUT_S)

    @property
    def connected(self) -> bool:
        return self.connack is not None and not self.connack.is_failure

    def publish(self, topic: str, payload: bytes) -> ReasonCode:
        """Publish at QoS 1 and return the PUBACK's reason code."""
        mid = self.client.publish(topic, payload, qos=1).mid
        with self.done:
            assert self.done.wait_for(lambda: mid in self.pubacks, timeout=TIMEOUT_S), f"no PUBACK for {topic}"
            return self.pubacks[mid]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, code: ReasonCode, *_: object) -> None:
        with self.done:
            self.connack = code
            self.done.notify_all()

    def _on_disconnect(
        self, client: mqtt.Client, userdata: object, flags: object, code: ReasonCode, *_: object
    ) -> None:
        with self.done:
            if self.connack is None:
                self.error = ConnectionError(f"disconnected before CONNACK: {code}")
            self.done.notify_all()

    def _on_publish(self, client: mqtt.Client, userdata: object, mid: int, code: ReasonCode, *_: object) -> None:
        with self.done:
            self.pubacks[mid] = code
            self.done.notify_all()


@pytest.fixture
def secure_broker(broker_factory: BrokerFactory, pki: Pki) -> Broker:
    return broker_factory(tls=pki.broker_tls, users=USERS, acl=ACL)


@pytest.fixture
def attempts() -> Iterator[list[Attempt]]:
    made: list[Attempt] = []
    yield made
    for attempt in made:
        attempt.close()


def test_tls_with_the_right_password_publishes_where_the_acl_allows(
    secure_broker: Broker, pki: Pki, attempts: list[Attempt]
) -> None:
    observer = Collector(secure_broker, "#")  # on the plain, anonymous listener: an observer without an ACL
    try:
        for host in ("127.0.0.1", "localhost"):  # the server certificate names both
            attempt = Attempt(secure_broker, ca=pki.ca_cert, host=host)
            attempts.append(attempt)
            assert attempt.connected, (attempt.connack, attempt.error)
            assert not attempt.publish(f"sensors/{host}", b"reading").is_failure
        assert observer.wait_for(2, TIMEOUT_S)
        assert sorted(topic for topic, _, _ in observer.messages) == ["sensors/127.0.0.1", "sensors/localhost"]
    finally:
        observer.close()
    config = secure_broker.config_path.read_text(encoding="utf-8")
    assert config.startswith("per_listener_settings true\n")
    assert secure_broker.password_path.is_file() and secure_broker.acl_path.read_text(encoding="utf-8") == ACL


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_wrong_password_is_refused_in_the_connack(
    secure_broker: Broker, pki: Pki, attempts: list[Attempt], protocol: mqtt.MQTTProtocolVersion
) -> None:
    attempt = Attempt(secure_broker, ca=pki.ca_cert, password="wrong", protocol=protocol)
    attempts.append(attempt)
    # MQTT 3.1.1 CONNACK return code 5 and MQTT 5 reason 135: paho 2.x reports both as ReasonCode 135.
    assert attempt.connack is not None and attempt.connack.value == 135, (attempt.connack, attempt.error)
    assert not attempt.connected
    anonymous = Attempt(secure_broker, ca=pki.ca_cert, user=None, protocol=protocol)
    attempts.append(anonymous)
    assert not anonymous.connected and anonymous.connack is not None and anonymous.connack.value == 135


def test_a_client_trusting_another_ca_fails_the_handshake(
    secure_broker: Broker, pki: Pki, attempts: list[Attempt]
) -> None:
    attempt = Attempt(secure_broker, ca=pki.other_ca_cert)
    attempts.append(attempt)
    assert isinstance(attempt.error, ssl.SSLCertVerificationError), attempt.error
    assert attempt.connack is None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_publish_the_acl_denies_is_dropped(
    secure_broker: Broker, pki: Pki, attempts: list[Attempt], protocol: mqtt.MQTTProtocolVersion
) -> None:
    """mosquitto 2.0.11 answers a denied QoS 1 PUBLISH with a PUBACK, and keeps the connection: under MQTT 5 its
    reason is 135 Not authorized; MQTT 3.1.1's PUBACK has no reason code, so it reads as a success there. Either
    way the message goes nowhere."""
    observer = Collector(secure_broker, "#")
    try:
        attempt = Attempt(secure_broker, ca=pki.ca_cert, protocol=protocol)
        attempts.append(attempt)
        assert attempt.connected, (attempt.connack, attempt.error)
        denied = attempt.publish("answers/forged", b"denied")
        assert denied.value == (135 if protocol == mqtt.MQTTv5 else 0), denied
        assert not attempt.publish("sensors/after", b"allowed").is_failure  # same connection, still open
        # No pause needed: the broker handles a client's packets in order and forwards them to the observer in
        # that order, so the denied one would have come before this one.
        assert observer.wait_for(1, TIMEOUT_S)
        assert [topic for topic, _, _ in observer.messages] == ["sensors/after"]
    finally:
        observer.close()
