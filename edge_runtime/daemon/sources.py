"""Where sensor messages come from, besides MQTT: a serial port, a recorded file or stdin, simulated sensors.

A source runs on its own thread and hands every message to ``submit``; the daemon queues it like an MQTT message,
so windowing, the queue policy, error answers and sinks are the same whatever the source.

    serial   JSON lines from a pyserial URL (/dev/ttyUSB0, /dev/pts/3, socket://host:port, rfc2217://...).
             Reopened with back-off when the port goes away (a USB sensor unplugged and plugged back).
             With ``protocol = "frames"``: the firmware bridge's framed protocol instead (``edgeline.firmware_bridge
             .source``, named here by a string and imported only when asked for): boards named by their HELLO,
             answers sent back down.
    replay   recorded messages from a file, or ``-`` for stdin, one per line, in any of these forms:
               {"topic": "sensors/pump/accel", "device": "pump", "t": 0.25, "payload": {...}}   (edgeline sim --out)
               {"topic": ..., "payload_base64": "..."}                                          (binary codecs)
               sensors/pump/accel {"id": 1, "data": [...]}                                      (mosquitto_sub -v)
               {"id": 1, "data": [...]}                                                         (a bare payload)
             Ends at the end of the file; ``speed`` > 0 replays at the recorded times (``t``) divided by it.
    sim      simulated sensors in-process (``edgeline.sim.source``).
    mqtt     the daemon's subscriptions (``edgeline.daemon.mqtt``); camera: cameras and video
             (``edgeline.daemon.camera``). Both are made by the daemon from parts of its own (``assembly``).

Every source is a ``Source``; ``SourceBase`` gives the parts most sources do not have (counters, a status, topics
subscribed to) their defaults, so the daemon asks every source the same questions instead of probing for them. A
kind of source is one class, registered in one place (``edgeline.daemon.config.SOURCES``: kind -> "module:Class"),
that declares what it needs (``needs``, ``json_only``, ``lossless``) and how it is made (``from_config``): the
configuration and ``make_source`` ask the class, never a table of kinds (docs/adding-an-input-source.md).

Lines are bounded: a line longer than the payload limit is skipped to its end and answered ``oversized``, never
buffered whole.
"""

from __future__ import annotations

import base64
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Protocol

import orjson

from edgeline.daemon.config import SOURCES, SourceConfig, source_class
from edgeline.daemon.health import Metrics
from edgeline.daemon.messages import Message
from edgeline.daemon.reconnect import Retry
from edgeline.daemon.topics import TopicFilter
from edgeline.errors import EdgelineError
from edgeline.registry import resolve

__all__ = [
    "SOURCES",
    "LineFramer",
    "ReplaySource",
    "SerialSource",
    "Source",
    "SourceBase",
    "make_source",
    "parse_record",
    "source_class",
]

log = logging.getLogger("edgeline.source")

Submit = Callable[[Message], None]
SERIAL_PROTOCOLS = {"frames": "edgeline.firmware_bridge.source:FramesSource"}
"""The serial source's ``protocol`` other than JSON lines -> the class that reads it (from ``edgeline.firmware_bridge``,
imported only when a configuration asks for it)."""
READ_CHUNK = 65536
SERIAL_RETRY_FIRST_S = 1.0
SERIAL_RETRY_MAX_S = 30.0
"""A serial port that went away is tried again after 1 s, then 2, 4, ... at most every 30 s (no jitter: only
this process opens it)."""


class Source(Protocol):
    description: str
    """For the start-up line and logs, e.g. ``serial /dev/ttyUSB0 at 115200 baud``."""

    @property
    def finite(self) -> bool:
        """True when the source ends by itself (a file, a bounded simulation): the daemon then drains and exits."""

    @property
    def subscribed(self) -> bool:
        """True when messages come from the daemon's topic subscriptions (MQTT): the daemon names those topics in
        what it expects and warns when one falls silent. A source it reads (a port, a file) is never "silent"."""

    def open(self) -> None:
        """Fail fast, with an ``EdgelineError`` naming what is wrong, before the daemon says it is ready."""

    def run(self, submit: Submit, stopping: threading.Event) -> None:
        """Submit messages until the source ends or ``stopping`` is set."""

    def counters(self) -> dict[str, int]:
        """What the source's own link counted (the framed serial source's ``serial_*``), added to the daemon's
        counters (status message, ``/metrics``); empty for most sources."""

    def status(self) -> dict[str, Any] | None:
        """The status message's ``source`` field (the framed serial source: its board, what the wire did); None:
        no such field."""

    def report(self) -> dict[str, Any]:
        """Fields the source adds to the status message's top level (the cameras: ``cameras``); empty for most."""

    def register_metrics(self, metrics: Metrics) -> None:
        """Register the source's own labelled metrics (``/metrics``: a camera's frames, drops by reason, age)."""

    def attach_gate(self, is_open: Callable[[], bool]) -> None:
        """Whether answers can leave now (the intake gate), for a source that drops rather than waits (a live
        camera drops a frame as ``backpressure``); set by the daemon when it has a gate."""


class SourceBase:
    """A kind of source: what it declares (asked when a configuration is read, before anything is made), how it is
    made, and the defaults of ``Source``'s optional parts: a live source, not subscribed, nothing counted, no status.
    """

    needs: ClassVar[tuple[str, str] | None] = None
    """The ``[source]`` key this kind cannot do without and an example of its value, e.g. ``("path", "a file, or -
    for stdin")``: a configuration without it is refused ("the replay source needs source.path: a file, ..."). None:
    nothing."""
    json_only: ClassVar[str | None] = None
    """Why this source hands the daemon JSON whatever arrives (``[input] codec`` must then be json), e.g. ``"its
    lines, or the samples of its frames"``; None: any codec."""

    finite = False
    subscribed = False

    @classmethod
    def lossless(cls, settings: SourceConfig) -> bool:
        """Whether this source, so configured, waits rather than loses (a recording, a bounded simulation, a board
        that resends): the queue's default policy is then ``block``, else ``drop-oldest``."""
        return False

    @classmethod
    def from_config(
        cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int
    ) -> Source | None:
        """This source made from its settings (checked: what ``needs`` names is there), nothing opened yet (``open``
        does that); ``filters``: the ``[input] subscribe`` filters, ``max_payload_bytes``: the longest input. None:
        the daemon makes it from parts of its own (``edgeline.daemon.assembly``: MQTT, the cameras)."""
        raise EdgelineError(
            f"the {settings.kind} source ({cls.__module__}:{cls.__qualname__}) does not say how it is made: it needs "
            "a from_config (docs/adding-an-input-source.md)"
        )

    def counters(self) -> dict[str, int]:
        return {}

    def status(self) -> dict[str, Any] | None:
        return None

    def report(self) -> dict[str, Any]:
        return {}

    def register_metrics(self, metrics: Metrics) -> None:
        return None

    def attach_gate(self, is_open: Callable[[], bool]) -> None:
        return None


class LineFramer:
    """Splits a byte stream into lines of at most ``limit`` bytes without ever holding more than that.

    ``feed`` yields ``(line, size)``: ``size`` is the line's real length; when it exceeds ``limit`` the line was
    skipped and ``line`` is empty. A trailing ``\\r`` is removed; blank lines are skipped.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._buffer = bytearray()
        self._skipped = 0  # bytes of an over-long line dropped so far; 0 when not skipping

    def feed(self, chunk: bytes) -> Iterator[tuple[bytes, int]]:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if self._skipped:
                self._skipped += len(piece)
            elif len(self._buffer) + len(piece) > self.limit:
                self._skipped = len(self._buffer) + len(piece)
                self._buffer.clear()
            else:
                self._buffer += piece
            if end < 0:
                return
            yield from self._line()
            start = end + 1

    def flush(self) -> Iterator[tuple[bytes, int]]:
        """The last line of a stream that does not end with a newline."""
        yield from self._line()

    def _line(self) -> Iterator[tuple[bytes, int]]:
        if self._skipped:
            size, self._skipped = self._skipped, 0
            yield b"", size
            return
        line = bytes(self._buffer).rstrip(b"\r")
        self._buffer.clear()
        if line.strip():
            yield line, len(line)


def _device_of(topic: str, filters: Sequence[TopicFilter]) -> str | None:
    return next((device for f in filters if (device := f.device(topic)) is not None), None)


class SerialSource(SourceBase):
    """JSON lines from a serial port; the stream key is ``device`` (default: the port's name). With ``protocol =
    "frames"``, the firmware bridge's ``FramesSource`` reads the port instead."""

    needs = ("url", "a pyserial URL, e.g. /dev/ttyUSB0")
    json_only = "its lines, or the samples of its frames"

    @classmethod
    def lossless(cls, settings: SourceConfig) -> bool:
        """Framed: a board in reliable mode waits and resends, its backlog waits on the board. JSON lines: a port
        that is not read loses what it cannot hold anyway, so the newest lines are kept."""
        return settings.protocol == "frames"

    @classmethod
    def from_config(
        cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int
    ) -> Source | None:
        assert settings.url is not None  # ``needs``
        if settings.protocol != "json-lines":
            framed: type[SourceBase] = resolve(SERIAL_PROTOCOLS, settings.protocol, "source", EdgelineError)
            return framed.from_config(settings, filters=filters, max_payload_bytes=max_payload_bytes)
        return cls(
            settings.url, baudrate=settings.baudrate, device=settings.device, max_payload_bytes=max_payload_bytes
        )

    def __init__(self, url: str, *, baudrate: int, device: str | None, max_payload_bytes: int):
        self.url = url
        self.baudrate = baudrate
        self.device = device or Path(url.split("?")[0].rstrip("/")).name or "serial"
        self.max_payload_bytes = max_payload_bytes
        self.description = f"serial {url} at {baudrate} baud (device {self.device})"
        self._port: object | None = None

    def _open_port(self) -> object:
        try:
            import serial
        except ImportError as exc:  # pragma: no cover - pyserial is part of the base install
            raise EdgelineError("the serial source needs pyserial: pip install pyserial") from exc
        try:
            # exclusive: a second program on the port (a bridge, another daemon) is refused rather than splitting
            # its lines with this one (a flock on a device file; network URLs have one client by nature)
            return serial.serial_for_url(self.url, baudrate=self.baudrate, timeout=0.2, exclusive=True)
        except (serial.SerialException, ValueError, OSError) as exc:
            raise EdgelineError(f"--serial {self.url}: {exc}") from exc

    def open(self) -> None:
        self._port = self._open_port()

    def run(self, submit: Submit, stopping: threading.Event) -> None:
        import serial

        retry = Retry(SERIAL_RETRY_FIRST_S, SERIAL_RETRY_MAX_S, jitter=False)
        while not stopping.is_set():
            port = self._port
            self._port = None
            if port is None:
                try:
                    port = self._open_port()
                except EdgelineError as exc:
                    delay = retry.next_delay()
                    log.warning("%s; retrying in %g s", exc, delay)
                    stopping.wait(delay)
                    continue
                log.info("serial %s reopened", self.url)
            retry.reset()
            framer = LineFramer(self.max_payload_bytes)
            try:
                while not stopping.is_set():
                    chunk = port.read(max(1, port.in_waiting))  # type: ignore[attr-defined]
                    if not chunk:
                        continue
                    for line, size in framer.feed(chunk):
                        submit(Message(topic=self.url, payload=line, device=self.device, size=size))
            except (serial.SerialException, OSError) as exc:
                log.warning("serial %s lost: %s; reopening", self.url, exc)
            finally:
                port.close()  # type: ignore[attr-defined]


def parse_record(line: bytes, filters: Sequence[TopicFilter], default_device: str) -> tuple[Message, float | None]:
    """One recorded line as a message, and its recorded time ``t`` if it has one (see the module docstring)."""
    head = line.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None  # a broken payload: answered "malformed" by the codec, like on any other source
        if isinstance(record, dict) and "topic" in record and ("payload" in record or "payload_base64" in record):
            try:
                topic = str(record["topic"])
                device = record.get("device")
                device = str(device) if device is not None else _device_of(topic, filters) or topic
                if "payload_base64" in record:
                    try:
                        payload = base64.b64decode(str(record["payload_base64"]), validate=True)
                    except ValueError:
                        payload = line  # undecodable: answered "malformed"
                else:
                    payload = orjson.dumps(record["payload"])
            except (RecursionError, orjson.JSONEncodeError):  # lists nested too deep for str() or orjson.dumps
                return Message(topic="replay", payload=line, device=default_device), None
            t = record.get("t")
            when = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None
            return Message(topic=topic, payload=payload, device=device), when
        return Message(topic="replay", payload=line, device=default_device), None
    name, space, rest = line.partition(b" ")
    if space and name:  # mosquitto_sub -v: "TOPIC PAYLOAD"
        text = name.decode("utf-8", errors="replace")
        return Message(topic=text, payload=rest, device=_device_of(text, filters) or text), None
    return Message(topic="replay", payload=line, device=default_device), None


class ReplaySource(SourceBase):
    """Recorded messages from a file or stdin (``-``); see the module docstring for the line forms."""

    needs = ("path", "a file, or - for stdin")
    finite = True

    @classmethod
    def lossless(cls, settings: SourceConfig) -> bool:
        return True  # a recording waits for the model: every line is answered

    @classmethod
    def from_config(
        cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int
    ) -> Source | None:
        assert settings.path is not None  # ``needs``
        return cls(
            settings.path, filters=filters, device=settings.device, max_payload_bytes=max_payload_bytes,
            speed=settings.speed,
        )  # fmt: skip

    def __init__(
        self,
        path: str,
        *,
        filters: Sequence[TopicFilter],
        device: str | None,
        max_payload_bytes: int,
        speed: float = 0.0,
    ):
        self.path = path
        self.filters = filters
        self.device = device or "replay"
        self.max_payload_bytes = max_payload_bytes
        self.speed = speed
        where = "stdin" if path == "-" else path
        pace = f", {speed:g}x recorded time" if speed > 0 else ", as fast as the model takes them"
        self.description = f"replay of {where}{pace}"
        self._file: BinaryIO | None = None

    def open(self) -> None:
        if self.path == "-":
            self._file = sys.stdin.buffer
            return
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by run()
        except OSError as exc:
            raise EdgelineError(f"--replay {self.path}: {exc.strerror or exc}") from exc

    def _chunks(self, stream: BinaryIO, stopping: threading.Event) -> Iterable[bytes]:
        while not stopping.is_set():
            chunk = stream.read1(READ_CHUNK) if hasattr(stream, "read1") else stream.read(READ_CHUNK)
            if not chunk:
                return
            yield chunk

    def run(self, submit: Submit, stopping: threading.Event) -> None:
        stream = self._file
        if stream is None:
            raise EdgelineError("replay source used before open()")
        framer = LineFramer(self.max_payload_bytes)
        start = time.monotonic()
        try:
            for chunk in self._chunks(stream, stopping):
                for line, size in framer.feed(chunk):
                    self._submit(line, size, submit, start, stopping)
            for line, size in framer.flush():
                self._submit(line, size, submit, start, stopping)
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()

    def _submit(self, line: bytes, size: int, submit: Submit, start: float, stopping: threading.Event) -> None:
        if not line:  # over the limit: answered "oversized" without being read
            submit(Message(topic="replay", payload=b"", device=self.device, size=size))
            return
        message, when = parse_record(line, self.filters, self.device)
        if self.speed > 0 and when is not None:
            stopping.wait(max(0.0, start + when / self.speed - time.monotonic()))
        submit(message)


def make_source(settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int) -> Source | None:
    """The configured source, made by the class ``SOURCES`` registers for its kind; None when the daemon makes it
    from parts of its own (MQTT: its broker connection; the cameras: the bundle's pre-processing)."""
    registered: type[SourceBase] = source_class(settings.kind)
    return registered.from_config(settings, filters=filters, max_payload_bytes=max_payload_bytes)
