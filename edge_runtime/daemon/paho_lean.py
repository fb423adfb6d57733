"""paho-mqtt's ``Client`` with a cheaper path for the daemon's stream, and the check that it may be used.

``lean_client()`` subclasses paho 2.2's ``Client`` and overrides some of its private methods (``_sock_recv``,
``_packet_read``, ``_packet_write``, ``_packet_queue``, ``_handle_publish``, ``_handle_pubackcomp``), calls others
(``_packet_handle``, ``_sock_send``, ``_do_on_publish``, ``_mid_generate``...) and reads and writes its private
fields by name (``_in_packet``, ``_out_packet``, ``_out_messages``, the keepalive clock ``_last_bytes_received`` and
``_last_msg_out``...): under load paho's network thread spent as much of the one core as the model (see
``lean_client``'s docstring for what it does instead). A rename inside paho would not raise: a write to a renamed
field only creates a new one, and paho's keepalive would then drop a busy link. So nothing uses the lean client
before ``check()`` has found, once, that the installed paho is the one it was written for:

    - paho's version is in ``PAHO_VERSIONS`` (2.2.x; ``pyproject.toml`` pins it);
    - every private method it overrides or calls exists with the parameters in ``METHODS``;
    - every private field it touches exists on a fresh client with the type in ``FIELDS`` (``_in_packet`` with the
      keys of ``IN_PACKET_KEYS``, a queued packet with those of ``OUT_PACKET_KEYS``);
    - paho's own methods still read and write those fields under those names (``USES``, in their source): above
      all the keepalive clock, which ``_check_keepalive`` reads and the lean reader and writer advance;
    - the module-level names it uses exist (``MODULE_NAMES``), and the names it adds are not paho's (``OURS``);
    - the source of every paho method it overrides or re-implements is, byte for byte, the one it was written
      against (``PINNED_SOURCES``: a sha256 of ``inspect.getsource``): a patch release that changes a body without
      renaming anything (a fix in ``_packet_write``, a new branch in ``_handle_publish``) would otherwise be
      overridden unseen. ``tests/test_paho_lean.py`` holds the pins equal to the installed paho's, so upgrading paho
      fails a test naming the methods to re-review.

``lean_client_or_stock()`` is what ``MqttConnection`` asks for: the lean client when the check passes; otherwise
paho's own ``Client`` (``stock_client()``), after ONE warning naming what differed and what the stock path loses
(``STOCK_LOSES``). Setting ``EDGELINE_PAHO_STOCK=1`` in the environment forces the stock client (the tests run the
connection both ways).

``MqttConnection`` itself reads three private names of paho, on either client: a message's raw ``_topic`` (to show
a topic that is not UTF-8) and the client's ``_out_messages`` under ``_out_message_mutex`` (to drop the answers in
flight whose time to live ran out before paho sends them again). It reads them through ``raw_topic`` and
``in_flight``, which answer None, the public path's answer, unless the same check passed.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import logging
import os
import re
import struct
import threading
from collections.abc import Callable
from typing import Any, Literal

from edgeline.errors import EdgelineError

__all__ = [
    "PINNED_SOURCES",
    "STOCK_ENV",
    "STOCK_LOSES",
    "check",
    "in_flight",
    "internals_usable",
    "lean_client",
    "lean_client_or_stock",
    "raw_topic",
    "source_sha256",
    "stock_client",
]

log = logging.getLogger("edgeline.mqtt")

STOCK_ENV = "EDGELINE_PAHO_STOCK"
"""``1``: use paho's stock client even where the lean one would pass its check; ``0`` or unset: choose by the check."""
RECV_CHUNK = 65536
"""Bytes asked of the socket per read: paho's packets are served from them."""


@functools.cache
def lean_client() -> type:
    """paho's ``Client`` with a cheaper path for the packets of the stream, and the same behaviour.

    Measured under load (``benchmarks/daemon_throughput.py``), paho spent more of the daemon's one core than the
    model: each packet was read with three or four ``recv`` calls (one byte, the length byte by byte, the rest),
    and every PUBLISH and PUBACK built MQTT 5 ``Properties`` and a ``ReasonCode`` (17-23 µs to decode a few bytes).
    This subclass reads the socket in chunks of ``RECV_CHUNK`` and serves paho's small reads from them, writes
    the packets queued in one turn of the loop with one ``send``, and takes the packets of the stream without
    building objects nobody reads:

    - a QoS 0 or 1 PUBLISH without properties goes straight to ``on_input_fast(topic, payload, mid, qos)``
      (manual acknowledgement only: paho would not send its PUBACK either);
    - a PUBACK of two bytes (success, no reason code, no properties) is paho's own ``_do_on_publish`` with one
      shared success reason;
    - an answer (``publish_at_least_once``: QoS 1, not retained) is paho's message, kept where paho keeps it for
      a resend after a reconnection, with its packet built in one go (paho's ``publish`` took 18 µs);
    - a packet already read whole is taken in one go (paho reads the type byte, then each byte of the length,
      then the rest, one call each);
    - a packet queued only joins the queue: paho also pokes the socket pair its own loop reads (ours never does),
      a system call per packet.

    Anything else (properties, a topic alias, QoS 2, a refusal) goes to paho's own code. The overridden methods are
    paho 2.2 internals (pinned in ``pyproject.toml``): use it through ``lean_client_or_stock()``, which checks them
    first; ``tests/test_mqtt_connection.py`` runs both paths against Mosquitto.
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import MQTTErrorCode
    from paho.mqtt.exception import MalformedPacket
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.reasoncodes import ReasonCode

    success, queue_full = MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_QUEUE_SIZE
    DISCONNECT, PUBLISH = mqtt.DISCONNECT, mqtt.PUBLISH
    Message, waiting_for_puback, clock = mqtt.MQTTMessage, mqtt.mqtt_ms_wait_for_puback, mqtt.time_func
    uint16 = struct.Struct("!H")
    accepted, no_properties = ReasonCode(PacketTypes.PUBACK), Properties(PacketTypes.PUBACK)

    class LeanClient(mqtt.Client):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.on_input_fast: Callable[[str, bytes, int, int], None] | None = None
            self._chunk, self._chunk_at = b"", 0

        @property
        def buffered(self) -> int:
            """Bytes read from the socket that paho has not taken yet (select cannot see them)."""
            return len(self._chunk) - self._chunk_at

        def reconnect(self) -> Any:
            self._chunk, self._chunk_at = b"", 0  # what the old socket left is not part of the new session
            return super().reconnect()

        def _sock_recv(self, bufsize: int) -> bytes:
            chunk, at = self._chunk, self._chunk_at
            if at >= len(chunk):
                data: bytes = super()._sock_recv(RECV_CHUNK)  # BlockingIOError, OSError, b"" at EOF: as paho's
                if len(data) <= bufsize:
                    self._chunk, self._chunk_at = b"", 0
                    return data
                chunk, at = data, 0
                self._chunk = chunk
            data = chunk[at : at + bufsize]
            self._chunk_at = at + len(data)
            return data

        def _packet_read(self) -> Any:
            """A packet that the chunk read already holds whole is taken in one go; anything else (a packet cut
            by the end of the chunk, one paho is part-way through) is read by paho, from the chunk."""
            chunk, at, in_packet = self._chunk, self._chunk_at, self._in_packet
            end = len(chunk)
            if in_packet["command"] or end - at < 2:
                return super()._packet_read()
            length, shift, index = 0, 0, at + 1
            while True:  # the remaining length: at most 4 bytes (paho refuses more)
                if index >= end or shift > 21:
                    return super()._packet_read()
                digit = chunk[index]
                index += 1
                length |= (digit & 127) << shift
                shift += 7
                if digit < 128:
                    break
            if index + length > end:
                return super()._packet_read()
            self._chunk_at = index + length
            in_packet["command"] = chunk[at]
            in_packet["packet"] = chunk[index : index + length]  # type: ignore[typeddict-item]  # read only: bytes do
            in_packet["have_remaining"], in_packet["remaining_length"] = 1, length
            try:
                rc = self._packet_handle()
            except MalformedPacket as exc:
                self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
                rc = MQTTErrorCode.MQTT_ERR_PROTOCOL
            self._in_packet = {
                "command": 0, "have_remaining": 0, "remaining_count": [], "remaining_mult": 1, "remaining_length": 0,
                "packet": bytearray(), "to_process": 0, "pos": 0,
            }  # fmt: skip
            with self._msgtime_mutex:
                self._last_bytes_received = clock()  # paho's keepalive clock
            return rc

        def _packet_write(self) -> Any:
            """Whole packets that need nothing once written (acknowledgements, QoS 1 publishes...) leave together
            in one ``send``; paho writes the rest (a partly written packet, QoS 0 publishes, DISCONNECT)."""
            out = self._out_packet
            if len(out) > 1:
                batch, size = [], 0
                for packet in out:
                    kind = packet["command"] & 0xF0
                    if packet["pos"] or kind == DISCONNECT or (kind == PUBLISH and packet["qos"] == 0):
                        break
                    batch.append(packet)
                    size += packet["to_process"]
                    if size >= RECV_CHUNK:
                        break
                if len(batch) > 1:
                    try:
                        sent = self._sock_send(b"".join(packet["packet"] for packet in batch))
                    except (AttributeError, ValueError):  # as paho: no socket any more
                        return success
                    except BlockingIOError:
                        return MQTTErrorCode.MQTT_ERR_AGAIN
                    except OSError as err:
                        self._easy_log(mqtt.MQTT_LOG_ERR, "failed to send on socket: %s", err)
                        return MQTTErrorCode.MQTT_ERR_CONN_LOST
                    for packet in batch:
                        if sent >= packet["to_process"]:
                            sent -= packet["to_process"]
                            out.popleft()
                            continue
                        packet["pos"], packet["to_process"] = sent, packet["to_process"] - sent
                        break
                    with self._msgtime_mutex:
                        self._last_msg_out = clock()  # paho's keepalive clock
            return super()._packet_write()

        def _packet_queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int, info: Any = None) -> Any:
            self._out_packet.append(
                {"command": command, "mid": mid, "qos": qos, "pos": 0, "to_process": len(packet), "packet": packet,
                 "info": info}
            )  # fmt: skip
            return success

        def publish_at_least_once(self, topic: str, payload: bytes, properties: Any = None) -> Any:
            """paho's ``publish(topic, payload, qos=1, properties=properties)``, the same message kept the same
            way (a reconnection sends it again), for less."""
            encoded = topic.encode()
            if self._sock is None or not encoded:  # paho keeps it for the next connection; or a topic alias
                return super().publish(topic, payload, qos=1, properties=properties)
            self._raise_for_invalid_topic(encoded)
            packed = b"" if self._protocol != mqtt.MQTTv5 else b"\x00" if properties is None else properties.pack()
            header = self._pack_remaining_length(bytearray(b"\x32"), 4 + len(encoded) + len(packed) + len(payload))
            mid = self._mid_generate()  # a packet too large has raised above, before paho keeps anything
            packet = b"".join((header, uint16.pack(len(encoded)), encoded, uint16.pack(mid), packed, payload))
            message = Message(mid, encoded)
            message.timestamp, message.payload, message.qos = clock(), payload, 1
            message.properties, message.state = properties, waiting_for_puback
            with self._out_message_mutex:
                if 0 < self._max_queued_messages <= len(self._out_messages) or mid in self._out_messages:
                    message.info.rc = queue_full
                    return message.info
                self._out_messages[mid] = message
                self._inflight_messages += 1
            self._packet_queue(PUBLISH, packet, mid, 1, message.info)
            message.info.rc = success
            return message.info

        def _handle_publish(self) -> Any:
            header, packet, hook = self._in_packet["command"], self._in_packet["packet"], self.on_input_fast
            qos = (header >> 1) & 3
            if hook is None or qos > 1 or not self._manual_ack or len(packet) < 3:
                return super()._handle_publish()
            topic_end = 2 + (packet[0] << 8 | packet[1])
            start = topic_end + 2 * qos  # the packet id
            if self._protocol == mqtt.MQTTv5:
                if start >= len(packet) or packet[start] != 0:
                    return super()._handle_publish()  # properties (or a topic alias): paho decodes them
                start += 1
            if topic_end == 2 or start > len(packet):
                return super()._handle_publish()
            try:
                topic = packet[2:topic_end].decode()
            except UnicodeDecodeError:
                return super()._handle_publish()
            mid = packet[topic_end] << 8 | packet[topic_end + 1] if qos else 0
            hook(topic, bytes(packet[start:]), mid, qos)
            return success

        def _handle_pubackcomp(self, cmd: Literal["PUBACK", "PUBCOMP"]) -> Any:
            packet = self._in_packet["packet"]
            if cmd != "PUBACK" or len(packet) != 2:
                return super()._handle_pubackcomp(cmd)
            mid = packet[0] << 8 | packet[1]
            with self._out_message_mutex:
                if mid in self._out_messages:
                    return self._do_on_publish(mid, accepted, no_properties)
            return success

    return LeanClient


@functools.cache
def stock_client() -> type:
    """paho's own ``Client``, with the three names ``MqttConnection`` uses of the lean one, each on paho's public
    path: ``publish_at_least_once`` is ``publish(qos=1)``, ``buffered`` is 0 (paho holds no bytes select cannot see),
    and ``on_input_fast`` is never called (every input goes through ``on_message``)."""
    import paho.mqtt.client as mqtt

    class StockClient(mqtt.Client):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.on_input_fast: Callable[[str, bytes, int, int], None] | None = None

        @property
        def buffered(self) -> int:
            return 0

        def publish_at_least_once(self, topic: str, payload: bytes, properties: Any = None) -> Any:
            return self.publish(topic, payload, qos=1, properties=properties)

    return StockClient


# -- what the lean client expects of paho ------------------------------------------------------------------------
PAHO_VERSIONS = ((2, 2), (2, 3))
"""The paho-mqtt versions the lean client was written for: from the first, up to (not including) the second."""
METHODS: dict[str, tuple[str, ...]] = {
    # overridden
    "reconnect": (),
    "_sock_recv": ("bufsize",),
    "_packet_read": (),
    "_packet_write": (),
    "_packet_queue": ("command", "packet", "mid", "qos", "info"),
    "_handle_publish": (),
    "_handle_pubackcomp": ("cmd",),
    # called
    "publish": ("topic", "payload", "qos", "retain", "properties"),
    "_sock_send": ("buf",),
    "_packet_handle": (),
    "_easy_log": ("level", "fmt", "args"),
    "_raise_for_invalid_topic": ("topic",),
    "_pack_remaining_length": ("packet", "remaining_length"),
    "_mid_generate": (),
    "_do_on_publish": ("mid", "reason_code", "properties"),
}
"""paho's methods that the lean client overrides or calls, with their parameters (bound: without ``self``)."""
IN_PACKET_KEYS = frozenset(
    ("command", "have_remaining", "remaining_count", "remaining_mult", "remaining_length", "packet", "to_process",
     "pos")
)  # fmt: skip
OUT_PACKET_KEYS = frozenset(("command", "mid", "qos", "pos", "to_process", "packet", "info"))
FIELDS: dict[str, str] = {
    "_in_packet": "dict",
    "_out_packet": "deque",
    "_out_messages": "dict",
    "_out_message_mutex": "rlock",
    "_msgtime_mutex": "lock",
    "_last_bytes_received": "float",
    "_last_msg_out": "float",
    "_max_queued_messages": "int",
    "_inflight_messages": "int",
    "_manual_ack": "bool",
    "_protocol": "int",
    "_sock": "none",
}
"""paho's fields that the lean client reads or writes, with what a fresh client holds there."""
USES: dict[str, tuple[str, ...]] = {
    "_packet_read": ("_in_packet", "_sock_recv", "_packet_handle", "_msgtime_mutex", "_last_bytes_received"),
    "_packet_write": ("_out_packet", "_sock_send", "_msgtime_mutex", "_last_msg_out"),
    "_check_keepalive": ("_msgtime_mutex", "_last_msg_out", "_last_bytes_received"),
    "reconnect": ("_in_packet", "_out_packet", "_msgtime_mutex", "_last_bytes_received", "_last_msg_out"),
    "loop_read": ("_packet_read",),
    "loop_write": ("_packet_write",),
    "_packet_handle": ("_in_packet", "_handle_publish", "_handle_pubackcomp"),
    "_handle_publish": ("_in_packet", "_protocol", "_manual_ack"),
    "_handle_pubackcomp": ("_in_packet", "_out_message_mutex", "_out_messages", "_do_on_publish"),
    "_do_on_publish": ("_out_messages", "_inflight_messages"),
    "publish": (
        "_protocol", "_raise_for_invalid_topic", "_mid_generate", "_out_message_mutex", "_max_queued_messages",
        "_out_messages", "_inflight_messages",
    ),
    "_send_publish": ("_sock", "_protocol", "_pack_remaining_length", "_packet_queue"),
}  # fmt: skip
"""paho's methods whose source must still use these fields and methods (``self.<name>``): what the lean client
writes is what paho reads, the keepalive clock above all."""
USES_CLOCK = ("_packet_read", "_packet_write", "_check_keepalive", "publish")
"""paho's methods that must still take their time from ``time_func`` (the lean client's clock)."""
MODULE_NAMES = (
    "DISCONNECT", "PUBLISH", "MQTTMessage", "MQTTv5", "MQTT_LOG_DEBUG", "MQTT_LOG_ERR", "mqtt_ms_wait_for_puback",
    "time_func",
)  # fmt: skip
MESSAGE_FIELDS = ("timestamp", "payload", "qos", "retain", "dup", "properties", "state", "info", "_topic")
"""Fields of paho's ``MQTTMessage`` the lean client sets, and ``_topic``, which ``raw_topic`` reads."""
OURS = ("_chunk", "_chunk_at", "buffered", "on_input_fast", "publish_at_least_once")
"""Names the lean client adds: paho must not have them."""
PINNED_SOURCES: dict[str, str] = {
    # overridden
    "reconnect": "3ecdf1a8299e8c8ae12b7055a3e47e7dee1b97d257863da5ec43237ef753001a",
    "_sock_recv": "c3b9043a46dd81b79a601a321a2479154ec158c75243f4f4ad7431474efa1d62",
    "_packet_read": "bbe32d8af1e37955175d7835c8b0a16a61435dbc40e563f447f08b102c776347",
    "_packet_write": "d097b7b51bed128df99bf5e6ba0bc2f502bffbd38cbe136f9d0b1280057ef02b",
    "_packet_queue": "e298fa9ab31e5f79c1c6d08d303b049db9a2bcf681dcac1cd510b2fb519d3a26",
    "_handle_publish": "1bbaa3ef0e3afc6dea0423a41e67170930c024827e2e8dbf69b5d61c304b675d",
    "_handle_pubackcomp": "04d39ba283b1f3bee9aa99f5b27b112eca549f889a58a8a5720d7f7873b09428",
    # re-implemented by publish_at_least_once (with _packet_queue, above)
    "publish": "5c00cd3dcebceaae0eeac2e40402cd18fb64664c78343a6673ce0776a1608ec4",
    "_send_publish": "4edd21dd50f58a287ce343e596d53de053ed97b2596a3dd2f6f75e61fd7cafd4",
}
"""paho 2.2.0's ``Client`` methods that the lean client replaces, by the sha256 of their source (``source_sha256``).
A body that changed is a paho the lean client was not reviewed against, even where every name is still there: the
check fails, and the stock client runs. After upgrading paho, re-read each method whose pin fails beside its
override, then pin the new digests."""
STOCK_LOSES = (
    "speed: paho's network thread takes about as much CPU as the model under load (three or four recv calls and "
    "MQTT 5 objects per packet); answers whose time to live ran out while in flight are no longer dropped before a "
    "reconnection sends them again (they arrive late); a message on a topic that is not UTF-8 is logged without "
    "its topic"
)
"""What the stock path gives up, said in its one warning."""


def source_sha256(function: Any) -> str:
    """The sha256 of a function's source, as ``inspect.getsource`` reads it (what ``PINNED_SOURCES`` holds)."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def _version(mqtt_package: Any) -> tuple[int, ...] | None:
    match = re.match(r"(\d+)\.(\d+)", str(getattr(mqtt_package, "__version__", "")))
    return None if match is None else (int(match[1]), int(match[2]))


def check() -> list[str]:
    """What differs between the installed paho and what the lean client expects of it: empty when it may be used.
    Never raises (an unexpected error is one more difference)."""
    try:
        return _check()
    except Exception as exc:  # a paho so different that even looking fails: the same verdict
        return [f"checking paho failed: {type(exc).__name__}: {exc}"]


def _check() -> list[str]:
    import paho.mqtt
    import paho.mqtt.client as mqtt

    found: list[str] = []
    version = _version(paho.mqtt)
    low, high = PAHO_VERSIONS
    if version is None or not low <= version < high:
        installed = getattr(paho.mqtt, "__version__", "?")
        found.append(f"paho-mqtt {installed} is not {low[0]}.{low[1]}.x (the version it was written for)")
    try:
        from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
        from paho.mqtt.exception import MalformedPacket  # noqa: F401  # the lean reader catches it
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties  # noqa: F401
        from paho.mqtt.reasoncodes import ReasonCode  # noqa: F401
    except ImportError as exc:
        return [*found, f"paho's modules moved: {exc}"]
    codes = ("MQTT_ERR_SUCCESS", "MQTT_ERR_QUEUE_SIZE", "MQTT_ERR_AGAIN", "MQTT_ERR_CONN_LOST", "MQTT_ERR_PROTOCOL")
    found += [f"MQTTErrorCode.{code} is gone" for code in codes if not hasattr(MQTTErrorCode, code)]
    found += [f"PacketTypes.{kind} is gone" for kind in ("PUBACK", "PUBLISH") if not hasattr(PacketTypes, kind)]
    found += [f"paho.mqtt.client.{name} is gone" for name in MODULE_NAMES if not hasattr(mqtt, name)]
    if getattr(mqtt, "PUBLISH", None) != 0x30 or getattr(mqtt, "DISCONNECT", None) != 0xE0:
        found.append("paho's PUBLISH or DISCONNECT is not the MQTT packet type")
    found += [
        f"Client.{name} exists in paho: the lean client's hides it" for name in OURS if hasattr(mqtt.Client, name)
    ]

    client = mqtt.Client(CallbackAPIVersion.VERSION2)  # no socket until it connects
    for name, expected in METHODS.items():
        method = getattr(client, name, None)
        if not callable(method):
            found.append(f"Client.{name} is gone")
            continue
        parameters = tuple(inspect.signature(method).parameters)
        if parameters != expected:
            found.append(f"Client.{name}{parameters} is not Client.{name}{expected}")
    kinds: dict[str, Callable[[object], bool]] = {
        "dict": lambda value: isinstance(value, dict),
        "deque": lambda value: isinstance(value, collections.deque),
        "lock": lambda value: isinstance(value, type(threading.Lock())),
        "rlock": lambda value: isinstance(value, type(threading.RLock())),
        "float": lambda value: isinstance(value, float),
        "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
        "bool": lambda value: isinstance(value, bool),
        "none": lambda value: value is None,
    }
    for name, kind in FIELDS.items():
        if not hasattr(client, name):
            found.append(f"Client.{name} is gone")
        elif not kinds[kind](getattr(client, name)):
            found.append(f"Client.{name} is a {type(getattr(client, name)).__name__}, not a {kind}")
    in_packet = getattr(client, "_in_packet", None)
    if isinstance(in_packet, dict) and set(in_packet) != IN_PACKET_KEYS:
        found.append(f"Client._in_packet has the keys {sorted(in_packet)}, not {sorted(IN_PACKET_KEYS)}")
    if not found:  # paho's own _packet_queue, on a client with no socket: it only queues
        client.on_socket_register_write = lambda *_: None
        client._packet_queue(mqtt.PUBLISH, b"\x30\x00", 0, 0)
        queued = set(client._out_packet.pop()) if client._out_packet else set()
        if queued != OUT_PACKET_KEYS:
            found.append(f"paho queues packets with the keys {sorted(queued)}, not {sorted(OUT_PACKET_KEYS)}")
    message = mqtt.MQTTMessage(1, b"t")
    found += [f"MQTTMessage.{name} is gone" for name in MESSAGE_FIELDS if not hasattr(message, name)]
    found += [f"MQTTMessageInfo.{name} is gone" for name in ("rc", "mid") if not hasattr(message.info, name)]
    if getattr(message, "_topic", None) != b"t":
        found.append("MQTTMessage._topic does not hold the topic's bytes")
    for method, pinned in PINNED_SOURCES.items():
        try:
            digest = source_sha256(getattr(mqtt.Client, method))
        except (AttributeError, OSError, TypeError) as exc:
            found.append(f"the source of paho's Client.{method} cannot be read ({exc})")
            continue
        if digest != pinned:
            found.append(f"paho's Client.{method} is not the body the lean client was reviewed against (sha256 "
                         f"{digest[:12]}..., pinned {pinned[:12]}...)")  # fmt: skip
    for method, names in USES.items():
        try:
            source = inspect.getsource(getattr(mqtt.Client, method))
        except (AttributeError, OSError, TypeError) as exc:
            found.append(f"the source of paho's Client.{method} cannot be read ({exc})")
            continue
        missing = [name for name in names if not re.search(rf"\bself\.{name}\b", source)]
        if method in USES_CLOCK and not re.search(r"\btime_func\(", source):
            missing.append("time_func()")
        if missing:
            found.append(f"paho's Client.{method} no longer uses {', '.join(missing)}")
    return found


def _forced_stock() -> bool:
    value = os.environ.get(STOCK_ENV, "")
    if value not in ("", "0", "1"):
        raise EdgelineError(f"{STOCK_ENV}={value!r}: expected 1 (paho's stock client) or 0 (chosen by the check)")
    return value == "1"


@functools.cache
def _checked() -> tuple[str, ...]:
    """``check()``, made once per process; what differs is said once, with what the stock path loses."""
    found = tuple(check())
    if found:
        log.warning(
            "paho-mqtt is not what edgeline's lean MQTT client was written for (%s): using paho's stock client, "
            "correct, but it loses %s",
            "; ".join(found), STOCK_LOSES,
        )  # fmt: skip
    return found


def internals_usable() -> bool:
    """Whether paho's internals are those this module and ``MqttConnection`` were written against (checked once)."""
    return not _checked()


def lean_client_or_stock() -> type:
    """The client class for ``MqttConnection``: the lean client when ``check()`` passes (checked once), paho's stock
    client (``stock_client()``) otherwise, after one warning naming what differed, or when ``EDGELINE_PAHO_STOCK=1``."""
    if _forced_stock():
        return stock_client()
    return lean_client() if internals_usable() else stock_client()


def raw_topic(message: Any) -> bytes | None:
    """The bytes of a paho message's topic (paho's ``MQTTMessage._topic``: its ``topic`` raises for one that is not
    UTF-8), or None where paho's internals are not the checked ones."""
    if not internals_usable():
        return None
    topic: bytes = message._topic
    return topic


def in_flight(client: Any) -> tuple[dict[int, Any], Any] | None:
    """paho's messages in flight by mid and the lock paho holds over them (``_out_messages``,
    ``_out_message_mutex``), or None where paho's internals are not the checked ones."""
    if not internals_usable():
        return None
    return client._out_messages, client._out_message_mutex
