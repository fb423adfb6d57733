"""A loopback proxy in front of an MQTT broker that records every QoS 1 acknowledgement on the connections through
it, in the host's time: ``scripts/vm.sh power-cut`` sees when the daemon acknowledged each input (``edgeline.sim.
powercut_vm``), which a stock Mosquitto does not show.

    TapSession   sans-IO: one connection's bytes, each side's as they come, in; ``Acknowledged`` out, each QoS 1
                 PUBLISH matched with the PUBACK of the other side that took it (packet ids per sender, used again
                 once acknowledged), MQTT 3.1, 3.1.1 and 5 (the level read from the client's CONNECT)
    MqttTap      the I/O: a listener on 127.0.0.1 that opens a connection to the broker for each one it accepts,
                 forwards the bytes both ways unchanged, and stamps each acknowledgement (``Stamped``)

When a stamp is taken, for what it is used to prove: a PUBACK from the client is stamped once the tap has read it
(the client sent it before), one from the broker before the tap passes it on (the client cannot have seen it
before). Each side's bytes are read by the session before they are passed on, so the client's CONNECT is read
before the broker can answer it. A stream that is not MQTT (``MqttStreamError``, naming the side and the byte) is
recorded in ``MqttTap.problems`` and that connection is read no more, but still forwarded: the tap never changes
what the two sides see. Only loopback: the listener binds 127.0.0.1 and the broker is 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeline.errors import EdgelineError

__all__ = ["MAX_PACKET_BYTES", "Acknowledged", "MqttStreamError", "MqttTap", "Side", "Stamped", "TapSession"]

MAX_PACKET_BYTES = 1 << 20
"""The largest packet a session reads (the power-cut stream's are under a kilobyte); a larger one is refused."""
MAX_RECORDS = 1_000_000
"""Acknowledgements an ``MqttTap`` keeps; past them it records a problem and no more."""
MAX_CONNECTIONS = 16
"""Connections open through one tap at once; more are closed as they come, and said."""
CONNECT_TIMEOUT_S = 5.0
PUBLISH, PUBACK, CONNECT = 3, 4, 1
LEVELS = {3: "MQTT 3.1", 4: "MQTT 3.1.1", 5: "MQTT 5"}


class MqttStreamError(EdgelineError):
    """Bytes that are not an MQTT stream: the side that sent them, and the byte of its stream where, in the text."""


class Side(enum.Enum):
    CLIENT = "client"
    BROKER = "broker"

    @property
    def other(self) -> Side:
        return Side.BROKER if self is Side.CLIENT else Side.CLIENT


@dataclass(frozen=True)
class Acknowledged:
    """A QoS 1 PUBLISH that ``publisher`` sent and the other side acknowledged; ``reason``: the PUBACK's reason
    code (MQTT 5; 0, success, before it)."""

    publisher: Side
    packet_id: int
    topic: str
    payload: bytes
    reason: int = 0

    @property
    def accepted(self) -> bool:
        """Whether the acknowledging side took the message (a reason code below 0x80)."""
        return self.reason < 0x80


@dataclass(frozen=True)
class Stamped:
    """An acknowledgement, with when the tap stamped it (``time.time()``) and the connection (numbered from 0)."""

    at: float
    connection: int
    ack: Acknowledged


@dataclass
class _Reader:
    """One side's bytes into packets: (first byte, body, offset of the packet in the side's stream)."""

    side: Side
    buffer: bytearray = field(default_factory=bytearray)
    offset: int = 0
    """Of ``buffer``'s first byte, in the side's stream."""

    def packets(self, data: bytes) -> list[tuple[int, bytes, int]]:
        self.buffer += data
        found: list[tuple[int, bytes, int]] = []
        while len(self.buffer) >= 2:
            length, used = 0, 1
            while True:
                if used > 4:
                    raise self.error(1, "a remaining length of more than 4 bytes")
                if used >= len(self.buffer):
                    return found  # the length itself not all here yet
                digit = self.buffer[used]
                length |= (digit & 0x7F) << (7 * (used - 1))
                used += 1
                if not digit & 0x80:
                    break
            if length > MAX_PACKET_BYTES:
                raise self.error(0, f"a packet of {length} bytes, over the tap's {MAX_PACKET_BYTES}")
            if len(self.buffer) < used + length:
                return found
            found.append((self.buffer[0], bytes(self.buffer[used : used + length]), self.offset))
            del self.buffer[: used + length]
            self.offset += used + length
        return found

    def error(self, at: int, what: str, offset: int | None = None) -> MqttStreamError:
        where = (self.offset if offset is None else offset) + at
        return MqttStreamError(f"the {self.side.value}'s bytes, byte {where}: {what}")


class TapSession:
    """One connection, both sides: ``received(side, data)`` with each side's bytes as they come, in order per side;
    returns what they acknowledged. ``unmatched``: PUBACKs of no PUBLISH seen (none on a stream read from its
    start). After an ``MqttStreamError`` the session refuses more."""

    def __init__(self) -> None:
        self.protocol: int | None = None
        """The client's protocol level (3, 4 or 5) once its CONNECT was read."""
        self.unmatched = 0
        self._readers = {side: _Reader(side) for side in Side}
        self._waiting: dict[Side, dict[int, tuple[str, bytes]]] = {side: {} for side in Side}
        """Per publisher: packet id -> (topic, payload) of its QoS 1 PUBLISH not yet acknowledged (at most 65535)."""
        self._refused: str | None = None

    def received(self, side: Side, data: bytes) -> list[Acknowledged]:
        if self._refused is not None:
            raise MqttStreamError(f"the stream was already refused: {self._refused}")
        reader = self._readers[side]
        try:
            found = []
            for first, body, offset in reader.packets(data):
                ack = self._packet(reader, first >> 4, first & 0x0F, body, offset)
                if ack is not None:
                    found.append(ack)
            return found
        except MqttStreamError as exc:
            self._refused = str(exc)
            raise

    def _packet(self, reader: _Reader, kind: int, flags: int, body: bytes, offset: int) -> Acknowledged | None:
        side = reader.side
        if kind == CONNECT and side is Side.CLIENT:
            self.protocol = _connect_level(reader, body, offset)
        elif kind == PUBLISH and (flags >> 1) & 3 == 1:
            if self.protocol is None:
                raise reader.error(0, "a PUBLISH before the client's CONNECT", offset)
            packet_id, topic, payload = _publish(reader, body, offset, self.protocol)
            self._waiting[side][packet_id] = (topic, payload)
        elif kind == PUBACK:
            if len(body) < 2:
                raise reader.error(0, f"a PUBACK of {len(body)} bytes, not a packet id", offset)
            (packet_id,) = struct.unpack_from(">H", body)
            reason = body[2] if self.protocol == 5 and len(body) > 2 else 0
            publisher = side.other
            message = self._waiting[publisher].pop(packet_id, None)
            if message is None:
                self.unmatched += 1
                return None
            return Acknowledged(publisher, packet_id, message[0], message[1], reason)
        return None


def _string(reader: _Reader, body: bytes, at: int, offset: int, what: str) -> tuple[bytes, int]:
    """The length-prefixed string at ``at`` in a ``what`` packet's body, and where what follows it starts."""
    length = struct.unpack_from(">H", body, at)[0] if at + 2 <= len(body) else len(body)
    if at + 2 + length > len(body):
        raise reader.error(0, f"a {what} of {len(body)} bytes cut short", offset)
    return body[at + 2 : at + 2 + length], at + 2 + length


def _connect_level(reader: _Reader, body: bytes, offset: int) -> int:
    name, at = _string(reader, body, 0, offset, "CONNECT")
    if at >= len(body):
        raise reader.error(0, "a CONNECT cut short before its protocol level", offset)
    level = body[at]
    if level not in LEVELS or name not in (b"MQTT", b"MQIsdp"):
        raise reader.error(0, f"a CONNECT of protocol {name!r}, protocol level {level}: not " + ", ".join(
            f"{n} ({v})" for n, v in LEVELS.items()), offset)  # fmt: skip
    return level


def _publish(reader: _Reader, body: bytes, offset: int, level: int) -> tuple[int, str, bytes]:
    """A QoS 1 PUBLISH's packet id, topic and payload."""
    raw, at = _string(reader, body, 0, offset, "PUBLISH")
    if at + 2 > len(body):
        raise reader.error(0, f"a PUBLISH of {len(body)} bytes cut short", offset)
    (packet_id,) = struct.unpack_from(">H", body, at)
    at += 2
    if level == 5:
        length, used = 0, 0
        while True:
            if used == 4 or at + used >= len(body):
                raise reader.error(0, f"a PUBLISH of {len(body)} bytes cut short in its properties", offset)
            digit = body[at + used]
            length |= (digit & 0x7F) << (7 * used)
            used += 1
            if not digit & 0x80:
                break
        at += used + length
        if at > len(body):
            raise reader.error(0, f"a PUBLISH of {len(body)} bytes cut short in its properties", offset)
    return packet_id, raw.decode("utf-8", "replace"), body[at:]


class MqttTap:
    """``with MqttTap(broker_port) as tap:`` clients connect to ``127.0.0.1:tap.port``; ``tap.records()`` is what
    was acknowledged on their connections, in the order stamped. Two threads per connection (blocking sockets;
    ``close()`` shuts them down, which wakes them) and one that accepts, checking ten times a second for close."""

    def __init__(self, broker_port: int, *, clock: Callable[[], float] = time.time) -> None:
        self.broker = ("127.0.0.1", broker_port)
        self.problems: list[str] = []
        self._clock = clock
        self._lock = threading.Lock()
        self._records: list[Stamped] = []
        self._sessions: list[TapSession] = []
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._open = 0
        self._overflowed = False
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=16)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name=f"mqtt-tap-{self.port}", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> MqttTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def records(self) -> list[Stamped]:
        with self._lock:
            return list(self._records)

    @property
    def unmatched(self) -> int:
        with self._lock:
            return sum(session.unmatched for session in self._sessions)

    def close(self) -> None:
        self._closed.set()
        self._acceptor.join(5)
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):  # not connected, or already shut
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(5)

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)

    def _accept(self) -> None:
        number = 0
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener closed
            client.settimeout(None)
            with self._lock:
                full = self._open >= MAX_CONNECTIONS
            if full:
                self._problem(f"connection {number}: more than {MAX_CONNECTIONS} open at once: closed, not recorded")
                client.close()
            else:
                self._link(number, client)
            number += 1

    def _link(self, number: int, client: socket.socket) -> None:
        try:
            broker = socket.create_connection(self.broker, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            self._problem(f"connection {number}: the broker at {self.broker[0]}:{self.broker[1]} refused it: {exc}")
            client.close()
            return
        broker.settimeout(None)
        session = TapSession()
        with self._lock:
            self._open += 1
            self._sessions.append(session)
            self._sockets += [client, broker]
            ends = [2]
            for source, target, side in ((client, broker, Side.CLIENT), (broker, client, Side.BROKER)):
                thread = threading.Thread(target=self._pump, args=(number, session, source, target, side, ends),
                                          name=f"mqtt-tap-{self.port}-{number}-{side.value}", daemon=True)  # fmt: skip
                self._threads.append(thread)
                thread.start()

    def _pump(
        self,
        number: int,
        session: TapSession,
        source: socket.socket,
        target: socket.socket,
        side: Side,
        ends: list[int],
    ) -> None:
        """``side``'s bytes, read by the session and stamped, then passed on; until either end closes."""
        reading = True
        try:
            while not self._closed.is_set():
                data = source.recv(65536)
                if not data:
                    break
                if reading:
                    reading = self._read(number, session, side, data)
                target.sendall(data)
        except OSError:
            pass  # the other pump, or close(), shut the link: the same end as an EOF
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):  # already shut by the other pump
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                ends[0] -= 1
                if ends[0] == 0:
                    self._open -= 1

    def _read(self, number: int, session: TapSession, side: Side, data: bytes) -> bool:
        """Read ``data`` into the session and keep what it acknowledged, stamped now; False once the stream is
        refused. Under the tap's lock, so that the records are in the order of their stamps."""
        with self._lock:
            try:
                acks = session.received(side, data)
            except MqttStreamError as exc:
                self.problems.append(f"connection {number}: {exc}; not read any further")
                return False
            stamp = self._clock()
            if len(self._records) + len(acks) > MAX_RECORDS:
                if not self._overflowed:
                    self.problems.append(f"more than {MAX_RECORDS} acknowledgements: the rest are not recorded")
                self._overflowed = True
                return True
            self._records += [Stamped(stamp, number, ack) for ack in acks]
        return True
