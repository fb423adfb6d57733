"""``MqttConnection`` against a real Mosquitto: only its network thread touches paho, other threads hand it work
with ``call_soon``, and its in-flight window counts what waits for a PUBACK, nothing else."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import pytest

from edgeline.daemon.config import BrokerConfig
from edgeline.daemon.mqtt import MqttConnection
from tests.mqtt_broker import Broker, Collector

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 20.0


def connected(broker: Broker | PubackDropper, **settings: object) -> MqttConnection:
    config = BrokerConfig.model_validate({"host": broker.host, "port": broker.port, **settings})
    connection = MqttConnection(config, client_id=f"conn-{time.monotonic_ns()}")
    connection.start(lambda target: _thread(target))
    return connection


def _thread(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def on_network_thread(connection: MqttConnection, task: object) -> None:
    """Run ``task`` there and wait for it."""
    done = threading.Event()

    def run() -> None:
        try:
            task()  # type: ignore[operator]
        finally:
            done.set()

    connection.call_soon(run)
    assert done.wait(TIMEOUT_S)


def test_qos0_publishes_never_hold_the_window_and_qos1_ones_leave_it_on_their_puback(
    broker: Broker, unique_topic: str
) -> None:
    """A QoS 0 packet still in the client when the link drops is gone without a word from paho: if it held a
    place in the window, a few outages would close the window for good (answers would wait in the outbox for
    ever). So QoS 0 is done when handed over, and only QoS 1 waits."""
    results = Collector(broker, f"{unique_topic}/#")
    connection = connected(broker, max_inflight=8)
    try:
        done: list[tuple[bool, str | None]] = []
        seen: dict[str, int] = {}

        def publish_both() -> None:
            for index in range(100):
                assert connection.publish(f"{unique_topic}/q0", b"%d" % index, qos=0, done=lambda *r: done.append(r))
            seen["after qos 0"] = connection.in_flight
            for index in range(5):
                assert connection.publish(f"{unique_topic}/q1", b"%d" % index, qos=1, done=lambda *r: done.append(r))
            seen["after qos 1"] = connection.in_flight

        on_network_thread(connection, publish_both)
        assert seen == {"after qos 0": 0, "after qos 1": 5}
        assert connection.room == connection.window - 5
        results.wait_for(105)
        deadline = time.monotonic() + TIMEOUT_S
        while connection.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert connection.in_flight == 0 and len(done) == 105 and all(ok for ok, _ in done)
    finally:
        connection.close()
        results.close()


def test_the_window_honours_the_brokers_receive_maximum(broker: Broker) -> None:
    """Mosquitto announces Receive Maximum 20 (its max_inflight_messages) in its CONNACK: asking for more gets 20."""
    connection = connected(broker, max_inflight=500)
    try:
        assert connection.window == 20
    finally:
        connection.close()
    smaller = connected(broker, max_inflight=4)
    try:
        assert smaller.window == 4
    finally:
        smaller.close()


def test_publishes_from_other_threads_reach_the_broker_in_order(broker: Broker, unique_topic: str) -> None:
    results = Collector(broker, f"{unique_topic}/#")
    connection = connected(broker)
    try:
        for index in range(50):
            connection.publish(f"{unique_topic}/x", b"%d" % index, qos=1)
        assert [payload for _, payload, _ in results.wait_for(50)] == [b"%d" % i for i in range(50)]
    finally:
        connection.close()
        results.close()


class PubackDropper:
    """A loopback TCP proxy to a broker that forwards MQTT both ways, except that while ``dropping`` is set it
    swallows the broker's PUBACKs (fixed-header type 4): a broker that takes publishes and never acknowledges
    them, on a link that still answers its pings."""

    host = "127.0.0.1"

    def __init__(self, broker: Broker) -> None:
        self.target = (broker.host, broker.port)
        self.dropping = False
        self.dropped = 0
        self._listener = socket.create_server((self.host, 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> PubackDropper:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._closed.set()
        self._listener.close()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(self.target, timeout=10)
            client.settimeout(None)
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            threading.Thread(target=self._forward, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._forward, args=(upstream, client, True), daemon=True).start()

    def _forward(self, source: socket.socket, sink: socket.socket, from_broker: bool) -> None:
        try:
            while True:
                first = self._exactly(source, 1)
                length, multiplier, header = 0, 1, first
                while True:
                    byte = self._exactly(source, 1)
                    header += byte
                    length += (byte[0] & 0x7F) * multiplier
                    multiplier *= 128
                    if not byte[0] & 0x80:
                        break
                packet = header + self._exactly(source, length)
                if from_broker and self.dropping and first[0] >> 4 == 4:
                    self.dropped += 1
                    continue
                sink.sendall(packet)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    @staticmethod
    def _exactly(sock: socket.socket, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = sock.recv(count - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data


def test_a_broker_that_stops_acknowledging_is_reconnected_and_what_was_in_flight_is_sent_again(
    broker: Broker, unique_topic: str
) -> None:
    """Five publishes whose PUBACKs never come, on a link whose pings do: after ``stall_after_s`` (3 keepalives, at
    least 5 s) the connection says so and reconnects; paho sends them again and they complete."""
    with PubackDropper(broker) as proxy:
        connection = connected(proxy, keepalive_s=2)
        try:
            assert connection.stall_after_s == 6.0
            done: list[bool] = []
            proxy.dropping = True

            def publish() -> None:
                for index in range(5):
                    connection.publish(f"{unique_topic}/x", b"%d" % index, qos=1, done=lambda ok, _: done.append(ok))

            on_network_thread(connection, publish)
            deadline = time.monotonic() + TIMEOUT_S
            while not connection.stalls and time.monotonic() < deadline:
                time.sleep(0.02)
            proxy.dropping = False
            assert connection.stalls == 1 and proxy.dropped == 5 and done == []
            while connection.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            assert connection.in_flight == 0 and done == [True] * 5
            assert connection.reconnects == 1
        finally:
            connection.close()
