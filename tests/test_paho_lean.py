"""The lean paho client is used only when paho is what it was written for, and paho's stock client does the same
job: ``paho_lean.check()`` against the installed paho and against paho with one name changed, the lean client's
own use of paho's names, and the connection tests against a real Mosquitto on the stock client."""

from __future__ import annotations

import ast
import inspect
import logging
import socket
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgeline.daemon import paho_lean
from edgeline.daemon.config import BrokerConfig
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.topics import TopicFilter
from edgeline.errors import EdgelineError
from tests import test_mqtt_connection as connection_tests
from tests.mqtt_broker import Broker, BrokerFactory

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 20.0


@pytest.fixture(autouse=True)
def fresh_verdict(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees the check made afresh, and leaves no verdict behind (a patched paho's above all)."""
    monkeypatch.delenv(paho_lean.STOCK_ENV, raising=False)
    paho_lean._checked.cache_clear()
    yield
    paho_lean._checked.cache_clear()


@pytest.fixture
def stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``MqttConnection`` made in the test uses paho's stock client."""
    monkeypatch.setenv(paho_lean.STOCK_ENV, "1")
    assert paho_lean.lean_client_or_stock() is paho_lean.stock_client()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "edgeline.mqtt" and r.levelno == logging.WARNING]


# -- the check -----------------------------------------------------------------------------------------------------
@pytest.mark.quick
def test_the_check_passes_on_the_installed_paho_and_the_lean_client_is_chosen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert paho_lean.check() == []
    assert paho_lean.lean_client_or_stock() is paho_lean.lean_client()
    assert warnings_of(caplog) == []


def _names_the_lean_client_uses() -> tuple[set[str], set[str]]:
    """The attributes the lean client reaches on itself or on paho (``self.x``, ``super().x``) or defines, and the
    string keys it reads or writes in paho's packet dicts."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(paho_lean.lean_client)))
    lean = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "LeanClient")
    names, keys = set(), set()
    for node in ast.walk(lean):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "self") or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            ):
                names.add(node.attr)
        elif isinstance(node, ast.FunctionDef) and node in lean.body:  # an override, or a name it adds
            names.add(node.name)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if isinstance(node.slice.value, str):
                keys.add(node.slice.value)
        elif isinstance(node, ast.Dict):
            keys |= {key.value for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
    return {name for name in names if not name.startswith("__")}, keys


@pytest.mark.quick
def test_the_check_covers_every_name_the_lean_client_uses_and_no_other() -> None:
    """Renaming a field in the lean client (say both writes of paho's keepalive clock) names a field the check does
    not cover, and leaves one it covers unused: either fails here."""
    used, keys = _names_the_lean_client_uses()
    expected = set(paho_lean.METHODS) | set(paho_lean.FIELDS) | set(paho_lean.OURS)
    assert used - expected == set(), "the lean client uses names that paho_lean.check() does not check"
    assert expected - used == set(), "paho_lean.check() expects names that the lean client no longer uses"
    assert keys <= paho_lean.IN_PACKET_KEYS | paho_lean.OUT_PACKET_KEYS


@pytest.mark.quick
def test_the_lean_reader_and_writer_advance_pahos_keepalive_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packet the lean reader takes whole, and packets the lean writer sends together, never pass through paho's
    own reader and writer: only the lean client's writes move the clock paho's ``_check_keepalive`` reads. Were they
    renamed, a link busy with the stream would look idle to paho, which would ping it and then drop it."""
    client = paho_lean.lean_client()(mqtt.CallbackAPIVersion.VERSION2, client_id="c", manual_ack=True)
    client.on_socket_register_write = lambda *_: None
    completed: list[int] = []
    client.on_publish = lambda client, userdata, mid, reason, properties: completed.append(mid)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    client._sock = ours
    client._state = mqtt._ConnectionState.MQTT_CS_CONNECTED
    try:
        for mid in (1, 2):
            client._out_messages[mid] = mqtt.MQTTMessage(mid, b"t")  # answers waiting for their PUBACK
            client._out_messages[mid].qos = 1
        theirs.sendall(b"\x40\x02\x00\x01\x40\x02\x00\x02")  # two PUBACKs: one read takes both into the chunk
        assert client._packet_read() == mqtt.MQTT_ERR_SUCCESS and completed == [1]
        monkeypatch.setattr(mqtt.Client, "_packet_read", lambda self: pytest.fail("paho's reader took the packet"))
        client._last_bytes_received = 0.0
        assert client._packet_read() == mqtt.MQTT_ERR_SUCCESS and completed == [1, 2]
        assert client._last_bytes_received > 0.0, "the lean reader no longer moves paho's keepalive clock"

        client.ack(7, 1)
        client.ack(8, 1)
        client._last_msg_out = 0.0
        assert client._packet_write() == mqtt.MQTT_ERR_SUCCESS and not client._out_packet
        assert theirs.recv(64) == b"\x40\x02\x00\x07\x40\x02\x00\x08"  # one send
        assert client._last_msg_out > 0.0, "the lean writer no longer moves paho's keepalive clock"
    finally:
        ours.close()
        theirs.close()


# What each change to paho would look like, made with monkeypatch (undone after the test).
def _check_keepalive_with_a_renamed_clock(self: Any) -> None:
    """paho's ``_check_keepalive`` had paho renamed ``_last_bytes_received`` (and kept the old field elsewhere)."""
    with self._msgtime_mutex:
        last_out, last_in = self._last_msg_out, self._last_bytes_in
    if mqtt.time_func() - min(last_out, last_in) >= self._keepalive:
        self._send_pingreq()


def _packet_write_with_a_renamed_clock(self: Any) -> Any:
    """paho's ``_packet_write`` had it written its side of the clock under another name."""
    while self._out_packet:
        packet = self._out_packet.popleft()
        self._sock_send(packet["packet"])
    with self._msgtime_mutex:
        self._last_msg_sent = mqtt.time_func()
    return mqtt.MQTT_ERR_SUCCESS


def _packet_queue_with_other_parameters(
    self: Any, command: int, packet: bytes, mid: int, qos: int, message_info: Any = None
) -> Any:
    return mqtt.MQTT_ERR_SUCCESS


def _handle_pubackcomp_with_another_body(self: Any, cmd: str) -> Any:
    """paho's ``_handle_pubackcomp`` after a patch release: the same name, the same parameters and the same fields,
    and another body (say, a new check of the reason code) that the lean override would skip unseen."""
    packet = self._in_packet["packet"]
    if len(packet) < 2:
        return mqtt.MQTT_ERR_PROTOCOL
    mid = packet[0] << 8 | packet[1]
    with self._out_message_mutex:
        if mid in self._out_messages:
            return self._do_on_publish(mid, None, None)
    return mqtt.MQTT_ERR_SUCCESS


def _fresh_clients(change: Callable[[mqtt.Client], None]) -> Callable[[pytest.MonkeyPatch], None]:
    """A change to what paho's ``Client.__init__`` leaves on a new client."""

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        init = mqtt.Client.__init__

        def changed_init(self: mqtt.Client, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            change(self)

        monkeypatch.setattr(mqtt.Client, "__init__", changed_init)

    return patch


def _messages_keeping_their_topic_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    init = mqtt.MQTTMessage.__init__

    def changed_init(self: mqtt.MQTTMessage, mid: int = 0, topic: bytes = b"") -> None:
        init(self, mid, topic)
        self._topic = topic.decode(errors="replace")  # type: ignore[assignment]

    monkeypatch.setattr(mqtt.MQTTMessage, "__init__", changed_init)


def _rename(client: mqtt.Client, old: str, new: str) -> None:
    vars(client)[new] = vars(client).pop(old)


PAHO_CHANGES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "a newer paho": (
        lambda mp: mp.setattr(paho.mqtt, "__version__", "2.3.0"),
        "paho-mqtt 2.3.0 is not 2.2.x",
    ),
    "the keepalive clock renamed where paho reads it": (
        lambda mp: mp.setattr(mqtt.Client, "_check_keepalive", _check_keepalive_with_a_renamed_clock),
        "Client._check_keepalive no longer uses _last_bytes_received",
    ),
    "the keepalive clock renamed where paho writes it": (
        lambda mp: mp.setattr(mqtt.Client, "_packet_write", _packet_write_with_a_renamed_clock),
        "Client._packet_write no longer uses _last_msg_out",
    ),
    "the keepalive clock renamed everywhere": (
        _fresh_clients(lambda client: _rename(client, "_last_bytes_received", "_last_bytes_in")),
        "Client._last_bytes_received is gone",
    ),
    "a field of another type": (
        _fresh_clients(lambda client: setattr(client, "_out_packet", [])),
        "Client._out_packet is a list, not a deque",
    ),
    "a packet field added": (
        _fresh_clients(lambda client: client._in_packet.update(header=b"")),
        "Client._in_packet has the keys",
    ),
    "a method gone": (
        lambda mp: mp.delattr(mqtt.Client, "_sock_recv"),
        "Client._sock_recv is gone",
    ),
    "a method's parameters renamed": (
        lambda mp: mp.setattr(mqtt.Client, "_packet_queue", _packet_queue_with_other_parameters),
        "Client._packet_queue('command', 'packet', 'mid', 'qos', 'message_info')",
    ),
    "a method's body changed (a patch release)": (
        lambda mp: mp.setattr(mqtt.Client, "_handle_pubackcomp", _handle_pubackcomp_with_another_body),
        "Client._handle_pubackcomp is not the body the lean client was reviewed against",
    ),
    "a message's raw topic kept as text": (
        _messages_keeping_their_topic_as_text,
        "MQTTMessage._topic does not hold the topic's bytes",
    ),
    "a module name gone": (
        lambda mp: mp.delattr(mqtt, "mqtt_ms_wait_for_puback"),
        "paho.mqtt.client.mqtt_ms_wait_for_puback is gone",
    ),
    "a name the lean client adds taken by paho": (
        lambda mp: mp.setattr(mqtt.Client, "buffered", property(lambda self: 0), raising=False),
        "Client.buffered exists in paho",
    ),
}


@pytest.mark.quick
@pytest.mark.parametrize("change", PAHO_CHANGES, ids=list(PAHO_CHANGES))
def test_a_change_in_pahos_internals_falls_back_to_the_stock_client_with_one_warning(
    change: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    patch, expected = PAHO_CHANGES[change]
    patch(monkeypatch)
    found = paho_lean.check()
    assert any(expected in line for line in found), found
    assert paho_lean.lean_client_or_stock() is paho_lean.stock_client()
    assert paho_lean.lean_client_or_stock() is paho_lean.stock_client()
    (warning,) = warnings_of(caplog)
    assert expected in warning and "stock client" in warning
    assert f"it loses {paho_lean.STOCK_LOSES}" in warning  # what running on it costs, said with the fallback
    # MqttConnection's own reads of paho's internals take the public path too
    assert paho_lean.raw_topic(mqtt.MQTTMessage(1, b"\xff")) is None
    assert paho_lean.in_flight(mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)) is None
    assert len(warnings_of(caplog)) == 1


@pytest.mark.quick
def test_the_pinned_sources_are_the_installed_pahos() -> None:
    """Upgrading paho (even a patch release) fails here, naming each method whose body changed: re-read it beside
    its override in ``paho_lean.lean_client``, then pin the new digest in ``PINNED_SOURCES``."""
    changed = {
        name: paho_lean.source_sha256(getattr(mqtt.Client, name))
        for name, pinned in paho_lean.PINNED_SOURCES.items()
        if paho_lean.source_sha256(getattr(mqtt.Client, name)) != pinned
    }
    assert changed == {}, f"paho-mqtt {paho.mqtt.__version__} changed these methods; re-review, then pin: {changed}"


@pytest.mark.quick
def test_the_pins_cover_every_method_the_lean_client_overrides() -> None:
    """A new override of a paho method needs its pin: otherwise a change to its body would go unseen."""
    overridden = {name for name in vars(paho_lean.lean_client()) if hasattr(mqtt.Client, name)} - {
        "__init__", "__doc__", "__module__", "__qualname__", "__firstlineno__", "__static_attributes__",
    }  # fmt: skip
    assert overridden <= set(paho_lean.PINNED_SOURCES), overridden - set(paho_lean.PINNED_SOURCES)


@pytest.mark.quick
@pytest.mark.parametrize("checked", [True, False], ids=["checked paho", "another paho"])
def test_a_topic_that_is_not_utf8_is_shown_only_where_paho_is_the_checked_one(
    checked: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not checked:
        monkeypatch.setattr(paho_lean, "internals_usable", lambda: False)  # as after a refused check
    connection = MqttConnection(BrokerConfig(), client_id="no-connection")  # never connected: no broker needed
    connection._on_message(connection._client, None, mqtt.MQTTMessage(1, b"bad\xfftopic"))
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "not UTF-8" in r.getMessage()]
    assert ("bad\\xfftopic" in line) is checked, line


@pytest.mark.quick
def test_the_private_reads_of_the_connection_pass_through_the_check() -> None:
    """On the checked paho, ``MqttConnection`` reads a message's raw topic and the messages in flight."""
    assert paho_lean.raw_topic(mqtt.MQTTMessage(1, b"\xff")) == b"\xff"
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    assert paho_lean.in_flight(client) == (client._out_messages, client._out_message_mutex)


@pytest.mark.quick
def test_the_environment_forces_the_stock_client_and_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paho_lean.STOCK_ENV, "1")
    assert paho_lean.lean_client_or_stock() is paho_lean.stock_client()
    monkeypatch.setenv(paho_lean.STOCK_ENV, "0")
    assert paho_lean.lean_client_or_stock() is paho_lean.lean_client()
    monkeypatch.setenv(paho_lean.STOCK_ENV, "yes")
    with pytest.raises(EdgelineError, match=r"EDGELINE_PAHO_STOCK='yes': expected 1 .* or 0"):
        paho_lean.lean_client_or_stock()


@pytest.mark.integration
def test_the_connect_timeout_is_set_through_pahos_public_property(stock: None, broker: Broker) -> None:
    assert isinstance(mqtt.Client.connect_timeout, property) and mqtt.Client.connect_timeout.fset is not None
    connection = connection_tests.connected(broker, connect_timeout_s=3)
    try:
        assert type(connection._client) is paho_lean.stock_client()
        assert connection._client.connect_timeout == 3.0
    finally:
        connection.close()


# -- the stock client against Mosquitto -----------------------------------------------------------------------------
SAME_TESTS = [
    connection_tests.test_qos0_publishes_never_hold_the_window_and_qos1_ones_leave_it_on_their_puback,
    connection_tests.test_the_window_honours_the_brokers_receive_maximum,
    connection_tests.test_publishes_from_other_threads_reach_the_broker_in_order,
    connection_tests.test_a_broker_that_stops_acknowledging_is_reconnected_and_what_was_in_flight_is_sent_again,
    connection_tests.test_pubacks_with_and_without_a_reason_code_complete_their_publishes,
    connection_tests.test_packets_written_together_arrive_whole_and_in_order_even_when_a_send_is_partial,
]


@pytest.mark.integration
@pytest.mark.parametrize("test", SAME_TESTS, ids=[test.__name__.removeprefix("test_")[:48] for test in SAME_TESTS])
def test_the_connection_tests_pass_on_pahos_stock_client(
    test: Callable[..., None], stock: None, broker: Broker, unique_topic: str
) -> None:
    """``tests/test_mqtt_connection.py``'s tests of publishing (QoS 0 and 1, PUBACK callbacks, the window, a broker
    that stops acknowledging and the reconnection that follows), run again with paho's own client."""
    given = {"broker": broker, "unique_topic": unique_topic}
    test(**{name: given[name] for name in inspect.signature(test).parameters})


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.parametrize("path", ["lean", "stock"])
def test_inputs_arrive_once_and_the_unacknowledged_ones_again_after_a_reconnect(
    path: str, protocol: str, broker_factory: BrokerFactory, unique_topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs with manual acknowledgement, on both clients: each arrives once, whole; the broker restarts (it keeps
    the session), the connection reconnects, and the broker sends again exactly those not acknowledged."""
    if path == "stock":
        monkeypatch.setenv(paho_lean.STOCK_ENV, "1")
    broker = broker_factory(persistence=True)
    config = BrokerConfig.model_validate(
        {"host": broker.host, "port": broker.port, "protocol": protocol, "reconnect_max_s": 1}
    )
    connection = MqttConnection(config, client_id=f"inputs-{time.monotonic_ns()}")
    client_class = paho_lean.stock_client() if path == "stock" else paho_lean.lean_client()
    assert type(connection._client) is client_class
    first: list[bytes] = []
    again: list[bytes] = []
    lock = threading.Condition()
    subscribed = threading.Event()

    def on_input(topic: str, payload: bytes, ack: Callable[[], None] | None, reply: object = None) -> None:
        if topic.endswith("/probe"):
            subscribed.set()
            return
        assert ack is not None
        with lock:
            reconnected = connection.reconnects > 0
            (again if reconnected else first).append(payload)
            lock.notify_all()
        if reconnected or int(payload.split(b":")[0]) % 2 == 0:
            ack()

    connection.subscribe([TopicFilter(f"{unique_topic}/in/+")], 1, on_input)
    connection.start(lambda target: connection_tests._thread(target))
    publisher = connection_tests._publisher(broker)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not subscribed.is_set() and time.monotonic() < deadline:
            publisher.publish(f"{unique_topic}/in/probe", b"", qos=0)
            subscribed.wait(0.1)
        sent = []
        for index in range(12):
            payload = b"%d:" % index + bytes([index]) * (10 + 997 * index)
            properties = None
            if index % 3 == 0:  # a user property: paho decodes the packet on the lean client too
                properties = Properties(PacketTypes.PUBLISH)
                properties.UserProperty = ("k", str(index))
            publisher.publish(
                f"{unique_topic}/in/d{index % 3}", payload, qos=1, properties=properties
            ).wait_for_publish(TIMEOUT_S)
            sent.append(payload)
        with lock:
            assert lock.wait_for(lambda: len(first) == len(sent), TIMEOUT_S), f"{len(first)} of {len(sent)}"
        # The broker has taken the acknowledgements before it restarts: it handles a client's packets in order,
        # so once it acknowledges a publish sent after them, it has handled them (instead of a pause).
        taken = threading.Event()
        connection.publish(f"{unique_topic}/barrier", b"", qos=1, done=lambda ok, text: taken.set())
        assert taken.wait(TIMEOUT_S), "the broker never acknowledged the barrier"
        broker.restart()
        unacknowledged = [payload for index, payload in enumerate(sent) if index % 2]
        with lock:
            assert lock.wait_for(lambda: len(again) >= len(unacknowledged), TIMEOUT_S), f"{len(again)} again"
        # Nothing more may come: one more input after them; anything sent again would have come before it.
        after = connection_tests._publisher(broker)  # the first one lost the broker at the restart
        try:
            after.publish(f"{unique_topic}/in/d0", b"sentinel", qos=1).wait_for_publish(TIMEOUT_S)
        finally:
            after.loop_stop()
            after.disconnect()
        with lock:
            assert lock.wait_for(lambda: len(again) > len(unacknowledged), TIMEOUT_S), "the sentinel never came"
        assert again[-1] == b"sentinel" and len(again) == len(unacknowledged) + 1, [p[:8] for p in again]
        assert first == sent and sorted(again[:-1]) == sorted(unacknowledged)
        assert connection.reconnects == 1
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        connection.close()
