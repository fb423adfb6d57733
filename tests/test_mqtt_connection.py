"""``MqttConnection`` against a real Mosquitto: only its network thread touches paho, other threads hand it work
with ``call_soon``, and its in-flight window counts what waits for a PUBACK, nothing else."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgeline.daemon.config import BrokerConfig
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.paho_lean import lean_client
from edgeline.daemon.topics import TopicFilter
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


def _publisher(broker: Broker) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect(broker.host, broker.port)
    client.loop_start()
    return client


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_every_input_arrives_once_whole_on_the_lean_path_and_on_pahos_own(
    broker: Broker, unique_topic: str, protocol: str
) -> None:
    """The lean client (``lean_client``) serves paho's reads from chunks of the socket and takes plain QoS 0/1
    PUBLISH packets without paho's decoding; anything with properties goes through paho's own code. Interleaved,
    at both QoS, and with payloads larger than a chunk, every message arrives once, whole, in order, and each
    path really took its share."""
    connection = MqttConnection(
        BrokerConfig.model_validate({"host": broker.host, "port": broker.port, "protocol": protocol}),
        client_id=f"conn-{time.monotonic_ns()}",
    )
    arrived: list[tuple[str, bytes, bool]] = []
    everything = threading.Event()
    expected = 300
    paths = {"lean": 0, "paho": 0}
    lean, paho_path = connection._client.on_input_fast, connection._client.on_message

    def count(path: str, call: Callable[..., None]) -> Callable[..., None]:
        def counted(*args: Any) -> None:
            topic = args[0] if path == "lean" else args[2].topic
            if not topic.endswith(("/probe", "/sentinel")):
                paths[path] += 1
            call(*args)

        return counted

    connection._client.on_input_fast = count("lean", lean)
    connection._client.on_message = count("paho", paho_path)

    subscribed, sentinel_in = threading.Event(), threading.Event()

    def on_input(topic: str, payload: bytes, ack: Callable[[], None] | None, reply: object = None) -> None:
        if topic.endswith("/probe"):  # the subscription is in place (its SUBACK comes after the CONNACK)
            subscribed.set()
            return
        arrived.append((topic, payload, ack is not None))
        if ack is not None:
            ack()
        if len(arrived) == expected:
            everything.set()
        if topic.endswith("/sentinel"):
            sentinel_in.set()

    connection.subscribe([TopicFilter(f"{unique_topic}/in/+")], 1, on_input)
    connection.start(lambda target: _thread(target))
    publisher = _publisher(broker)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not subscribed.is_set() and time.monotonic() < deadline:
            publisher.publish(f"{unique_topic}/in/probe", b"", qos=0)
            subscribed.wait(0.1)
        sent = []
        for index in range(expected):
            size = 200_000 if index % 50 == 7 else 10 + index  # a few payloads span several chunks
            payload = bytes([index % 256]) * size
            qos = index % 2
            properties = None
            if index % 3 == 0:  # a user property: the broker forwards it, so paho decodes the packet
                properties = Properties(PacketTypes.PUBLISH)
                properties.UserProperty = ("k", str(index))
            topic = f"{unique_topic}/in/d{index % 4}"
            publisher.publish(topic, payload, qos=qos, properties=properties).wait_for_publish(TIMEOUT_S)
            sent.append((topic, payload, qos == 1))
        assert everything.wait(TIMEOUT_S), f"{len(arrived)} of {expected} arrived"
        # A barrier instead of a pause: one more message on the same path; a duplicate would have come before it.
        sentinel = (f"{unique_topic}/in/sentinel", b"sentinel", True)
        publisher.publish(sentinel[0], sentinel[1], qos=1).wait_for_publish(TIMEOUT_S)
        assert sentinel_in.wait(TIMEOUT_S), "the sentinel never arrived"
        assert arrived[-1] == sentinel, "something arrived after the sentinel"
        assert arrived[:-1] == sent
        if protocol == "5":
            assert paths == {"lean": expected - expected // 3, "paho": expected // 3}
        else:  # MQTT 3.1.1 carries no properties: every packet takes the lean path
            assert paths == {"lean": expected, "paho": 0}
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        connection.close()


@pytest.mark.integration
def test_pubacks_with_and_without_a_reason_code_complete_their_publishes(broker: Broker, unique_topic: str) -> None:
    """Mosquitto acknowledges a QoS 1 publish nobody subscribed to with reason 16 (no matching subscribers: three
    bytes, paho's own decoding) and one with a subscriber with two bytes (the lean path). Both complete, as
    accepted, and the window empties."""
    results = Collector(broker, f"{unique_topic}/heard/#")
    connection = connected(broker)
    try:
        done: list[tuple[str, bool, str | None]] = []

        def publish() -> None:
            for index in range(40):
                where = "heard" if index % 2 else "nobody"
                connection.publish(
                    f"{unique_topic}/{where}/x",
                    b"%d" % index,
                    qos=1,
                    done=lambda ok, why, w=where: done.append((w, ok, why)),
                )

        on_network_thread(connection, publish)
        results.wait_for(20)
        deadline = time.monotonic() + TIMEOUT_S
        while connection.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert connection.in_flight == 0
        assert sorted(done) == sorted([("heard", True, None)] * 20 + [("nobody", True, None)] * 20)
        assert connection.publish_refused == 0
    finally:
        connection.close()
        results.close()


@pytest.mark.integration
def test_packets_written_together_arrive_whole_and_in_order_even_when_a_send_is_partial(
    broker: Broker, unique_topic: str
) -> None:
    """The lean client writes the packets queued in one turn with one ``send``: with a small socket buffer, sends
    end part-way through a packet, and the rest must follow from where they stopped."""
    results = Collector(broker, f"{unique_topic}/#", timeout=60)
    connection = connected(broker, max_queued=1000)
    try:
        payloads = [bytes([index % 256]) * (1 + (index * 7919) % 60_000) for index in range(400)]

        def publish_all() -> None:
            # a small send buffer: most sends stop part-way (the kernel doubles this, and keeps a floor)
            connection._client.socket().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            for payload in payloads:
                assert connection.publish(f"{unique_topic}/big", payload, qos=1)

        on_network_thread(connection, publish_all)
        assert [payload for _, payload, _ in results.wait_for(len(payloads))] == payloads
    finally:
        connection.close()
        results.close()


@pytest.mark.quick
@settings(deadline=None, max_examples=120)
@given(
    protocol=st.sampled_from([mqtt.MQTTv5, mqtt.MQTTv311]),
    topic=st.text(st.characters(blacklist_characters="+#", blacklist_categories=("Cs",)), min_size=1, max_size=80),
    size=st.sampled_from([0, 1, 100, 121, 122, 127, 128, 16_000, 16_376, 16_384, 70_000]),
    expiry=st.one_of(st.none(), st.integers(1, 2**31 - 1)),
    mid=st.integers(1, 65_535),
)
def test_a_lean_answer_is_the_packet_and_the_message_paho_would_make(
    protocol: int, topic: str, size: int, expiry: int | None, mid: int
) -> None:
    """``publish_at_least_once`` (the daemon's answers) against paho's own ``publish(qos=1)``: the same bytes on
    the wire and the same message kept for a resend, across the lengths where MQTT's length field grows."""
    client = lean_client()(mqtt.CallbackAPIVersion.VERSION2, client_id="c", protocol=protocol)
    client._sock = socket.socket()  # "connected": paho builds the packet instead of keeping it for later
    try:
        properties = None
        if expiry is not None and protocol == mqtt.MQTTv5:
            properties = Properties(PacketTypes.PUBLISH)
            properties.MessageExpiryInterval = expiry
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        made = []
        for publish in (
            client.publish_at_least_once,
            lambda *a: mqtt.Client.publish(client, a[0], a[1], 1, False, a[2]),
        ):
            client._last_mid = mid - 1
            info = publish(topic, payload, properties)
            assert info.rc == mqtt.MQTT_ERR_SUCCESS and info.mid == mid
            (packet,) = client._out_packet
            message = client._out_messages.pop(mid)
            made.append(
                (
                    dict(packet, info=None),
                    message.topic,
                    message.payload,
                    message.qos,
                    message.retain,
                    message.dup,
                    message.state,
                    message.properties,
                    client._inflight_messages,
                )
            )
            client._out_packet.clear()
            client._inflight_messages = 0
        assert made[0] == made[1]
    finally:
        client._sock.close()


def _packet(header: int, body: bytes) -> bytes:
    length, remaining = bytearray(), len(body)
    while True:
        remaining, digit = divmod(remaining, 128)
        length.append(digit | 0x80 if remaining else digit)
        if not remaining:
            return bytes([header, *length]) + body


@pytest.mark.quick
@settings(deadline=None, max_examples=60)
@given(
    protocol=st.sampled_from([mqtt.MQTTv5, mqtt.MQTTv311]),
    packets=st.lists(
        st.tuples(
            st.sampled_from(["publish", "puback"]), st.integers(0, 1), st.sampled_from([0, 1, 120, 20_000, 70_000])
        ),
        min_size=1,
        max_size=30,
    ),
    cuts=st.lists(st.integers(1, 90_000), max_size=40),
)
def test_the_lean_reader_takes_packets_whole_or_cut_anywhere(
    protocol: int, packets: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    """The lean client takes a packet that its chunk holds whole in one go and leaves any other to paho: a stream
    of PUBLISH and PUBACK packets, cut into reads at arbitrary points, comes out whole and in order."""
    client = lean_client()(mqtt.CallbackAPIVersion.VERSION2, client_id="c", protocol=protocol, manual_ack=True)
    client.on_socket_register_write = lambda *_: None
    arrived: list[tuple[str, object, int]] = []
    client.on_input_fast = lambda topic, payload, mid, qos: arrived.append(("publish", (topic, payload), mid))
    client.on_publish = lambda client, userdata, mid, reason, properties: arrived.append(("puback", None, mid))
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    client._sock = ours
    client._state = mqtt._ConnectionState.MQTT_CS_CONNECTED
    try:
        stream, expected = bytearray(), []
        for mid, (kind, qos, size) in enumerate(packets, start=1):
            if kind == "puback":
                client._out_messages[mid] = mqtt.MQTTMessage(mid, b"t")  # an answer waiting for its PUBACK
                client._out_messages[mid].qos = 1
                stream += _packet(0x40, mid.to_bytes(2, "big"))
                expected.append(("puback", None, mid))
                continue
            topic, payload = f"in/d{mid}", bytes([mid % 256]) * size
            body = len(topic).to_bytes(2, "big") + topic.encode() + (mid.to_bytes(2, "big") if qos else b"")
            stream += _packet(0x30 | qos << 1, body + (b"\x00" if protocol == mqtt.MQTTv5 else b"") + payload)
            expected.append(("publish", (topic, payload), mid if qos else 0))
        theirs.setblocking(False)
        at, reads = 0, 0
        for cut in [*cuts, len(stream)]:
            piece = memoryview(bytes(stream[at : at + cut]))
            at += len(piece)
            while piece:  # what the socket takes, then what the client reads of it: never blocks
                with contextlib.suppress(BlockingIOError):
                    piece = piece[theirs.send(piece) :]
                for _ in range(len(packets) + 2):  # loop_read takes at most as many packets as paho holds messages
                    client.loop_read()
                reads += 1
                assert reads < 10_000
            if at >= len(stream):
                break
        assert arrived == expected
        assert client.buffered == 0 and client._in_packet["command"] == 0
    finally:
        ours.close()
        theirs.close()


@pytest.mark.quick
def test_a_post_while_the_network_thread_drains_its_wake_up_is_never_left_asleep() -> None:
    """A task posted from another thread while the network thread empties its wake-up socket must still wake the
    next select. Before, the flag was cleared first: such a post's byte was swallowed by the same drain, the flag
    stayed set, and every later post waited for the loop's 0.2 s tick (seen in benchmarks/firmware_bridge.py)."""
    connection = MqttConnection(BrokerConfig(host="127.0.0.1", port=1), client_id="wake")
    real = connection._wake_r

    class PostingWhileRead:
        """The wake-up socket, with another thread's post landing between the network thread's reads."""

        posted = False

        def recv(self, size: int) -> bytes:
            data = real.recv(size)
            if not self.posted:
                self.posted = True
                connection.call_soon(lambda: None)
            return data

    connection.call_soon(lambda: None)  # the wake-up the network thread is draining
    connection._wake_r = PostingWhileRead()  # type: ignore[assignment]
    connection._drain_wake()
    connection._wake_r = real
    readable, _, _ = select.select([real], [], [], 0)
    # Either the flag is clear (the next post writes a byte) or a byte waits (the next select wakes): never neither.
    assert not connection._wake_pending or readable
    connection._posted.clear()
    connection.call_soon(lambda: None)
    readable, _, _ = select.select([real], [], [], 0)
    assert readable, "a post after the drain did not wake the network thread"
