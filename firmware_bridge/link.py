"""One serial port with one board behind it, speaking the framed protocol (``docs/firmware-protocol.md``).

``BoardLink`` is what ``edgeline run --serial-protocol frames`` and ``edgeline bridge`` share: it opens the port (and
reopens it with back-off when it goes away, one log line per change of state), asks the board who it is
(``HELLO_REQUEST``), decodes frames, checks each ``SAMPLES`` frame against the stream the ``HELLO`` declared, counts
what the wire did (frames, bytes, CRC errors, resyncs, sequence gaps, board restarts, refused frames), and hands every
sample to a ``LinkHandler`` with a ``safe`` callback. In reliable mode the ``ACK`` of a frame goes out only once every
sample of it, and of every frame before it, is safe (the caller says when: in the daemon's outbox, or acknowledged
by the broker). Answers go back down with ``answer``, from any thread, without ever waiting: frames to the board go
through a bounded queue that the link's writer thread drains, each write bounded by ``write_timeout_s``. A board that
does not read (many sensor firmwares never read their RX line, and a USB CDC device that does not read fills the
host's buffer) has what does not fit dropped, counted (``answers_unsent``) and said once per change of state.

Nothing a board sends stops a link: an exception while serving it is said once (with the board and the traceback),
counted (``link_errors``), and the port is reopened with back-off.

Each board is named by the ``device`` of its ``HELLO``, never by its port: a board that comes back on another port
keeps its streams.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import select
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

from edgeline.daemon.reconnect import Retry
from edgeline.daemon.topics import topic_problem
from edgeline.errors import EdgelineError
from edgeline.firmware_bridge.protocol import (
    MAX_ENCODED,
    MAX_PAYLOAD,
    SEQ_MODULO,
    Decoder,
    Frame,
    FrameError,
    FrameType,
    SequenceGaps,
    encode,
    pack_ack,
)
from edgeline.lograte import Repeated

__all__ = [
    "DTYPES",
    "Board",
    "BoardLink",
    "LinkCounters",
    "LinkHandler",
    "StreamSpec",
    "input_id",
    "name_problem",
    "parse_hello",
    "parse_input_id",
]

log = logging.getLogger("edgeline.bridge")

DTYPES: Mapping[str, np.dtype[Any]] = {
    "f32": np.dtype("<f4"),
    "i16": np.dtype("<i2"),
    "i8": np.dtype("i1"),
    "u8": np.dtype("u1"),
    "i32": np.dtype("<i4"),
}
"""The sample types of version 1, as little-endian numpy dtypes."""

CONTROL_STREAM = 0
HELLO_RETRY_S = 2.0
"""A board that has not said HELLO this long after we asked is asked again (it may have been busy, or the request
was lost on the wire)."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
READ_TIMEOUT_S = 0.05
READ_CHUNK = 65536
MAX_STREAMS = 255
MAX_HELLO_DEVICE = 128
DOWNLINK_FRAMES = 256
"""Frames waiting to be written to one board, at most, by default: past it a new one is dropped (the board does not
read, or reads slower than its answers come). ``edgeline bridge`` sizes it from its window (``--max-unanswered``):
every answer a daemon may owe fits behind a board that reads."""
FRAME_WRITE_TURNS = 8
"""A board that reads, however slowly, has one frame at most this many write timeouts to take it."""
WRITER_IDLE_S = 0.25
LOG_EVERY_S = 10.0
"""A board's LOG lines: the first of a burst is said, the rest counted and summarised at most this often."""


def write_timeout_s(baudrate: int) -> float:
    """How long a port may take no byte of a frame: twice the largest frame's time on the wire, at least 1 s. A board
    whose port takes nothing for that long does not read it (one that reads, however slowly, is given
    ``FRAME_WRITE_TURNS`` times this for the whole frame)."""
    return max(1.0, 2 * MAX_ENCODED * 10 / baudrate)


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a board's device or stream name, or None: each becomes one MQTT topic level (the same
    rule as ``topic_problem``, and no ``/``), so a name the broker would refuse never reaches it."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if len(name) > MAX_HELLO_DEVICE:
        return f"longer than {MAX_HELLO_DEVICE} characters"
    if "/" in name:
        return "it holds a /, which would make it two topic levels"
    return topic_problem(name)


@dataclass(frozen=True)
class StreamSpec:
    """One data stream a board declared in its HELLO."""

    id: int
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    rate_hz: float | None = field(compare=False)
    seq: int | None = field(compare=False)
    """Where reliable frames take up after this HELLO (the board's oldest unacknowledged frame), if it said. Neither
    this nor the rate (a CONFIG changes it) makes a stream another one."""

    def __post_init__(self) -> None:
        problem = name_problem(self.name)
        if problem is not None:
            raise FrameError("hello", f"stream name {self.name!r}: {problem}")

    @property
    def sample_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)  # Python integers: numpy's int64 would wrap


@dataclass(frozen=True)
class Board:
    device: str
    firmware: str
    streams: Mapping[int, StreamSpec]
    boot: int | None = None
    """The HELLO's ``boot``, a number that differs between the board's boots (a counter in flash, a random draw):
    part of its inputs' ids, which could otherwise repeat after a restart. None: the board does not say."""

    def __post_init__(self) -> None:
        problem = name_problem(self.device)
        if problem is not None:
            raise FrameError("hello", f"device {self.device!r}: {problem}")


def parse_hello(payload: bytes) -> Board:
    """A HELLO's JSON as a ``Board``; ``FrameError("hello", ...)`` naming the field that is wrong."""

    def refuse(why: str) -> FrameError:
        return FrameError("hello", f"HELLO refused: {why}")

    try:
        hello = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise refuse(f"not JSON ({exc})") from None
    if not isinstance(hello, dict):
        raise refuse("not a JSON object")
    device = hello.get("device")
    problem = name_problem(device)
    if problem is not None or not isinstance(device, str):
        raise refuse(f"device {device!r} is not a board's id: {problem}")
    if hello.get("protocol") != 1:
        raise refuse(f"protocol {hello.get('protocol')!r}; this host speaks 1")
    entries = hello.get("streams")
    if not isinstance(entries, list) or len(entries) > MAX_STREAMS:
        raise refuse("streams must be a list of at most 255 streams")
    streams: dict[int, StreamSpec] = {}
    for index, entry in enumerate(entries):
        where = f"streams[{index}]"
        if not isinstance(entry, dict):
            raise refuse(f"{where} is not an object")
        sid, name, dtype, shape = entry.get("id"), entry.get("name"), entry.get("dtype"), entry.get("shape")
        if not isinstance(sid, int) or isinstance(sid, bool) or not 1 <= sid <= MAX_STREAMS or sid in streams:
            raise refuse(f"{where}.id {sid!r} is not a new stream id of 1-255 (0 is the control stream)")
        problem = name_problem(name)
        if problem is not None or not isinstance(name, str):
            raise refuse(f"{where}.name {name!r} is not a stream's name: {problem}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise refuse(f"{where}.dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
            or math.prod(shape) * DTYPES[dtype].itemsize > MAX_PAYLOAD  # Python integers, never wrapping
        ):
            raise refuse(f"{where}.shape {shape!r} is not a list of positive sizes that fits in a frame")
        rate, seq = entry.get("rate_hz"), entry.get("seq")
        streams[sid] = StreamSpec(
            sid,
            name,
            DTYPES[dtype],
            tuple(shape),
            float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None,
            seq % SEQ_MODULO if isinstance(seq, int) and not isinstance(seq, bool) else None,
        )
    boot = hello.get("boot")
    if boot is not None and (not isinstance(boot, int) or isinstance(boot, bool) or not 0 <= boot < 1 << 64):
        raise refuse(f"boot {boot!r} is not a number from 0 to 2**64 - 1")
    return Board(device, str(hello.get("firmware", "")), streams, boot)


def input_id(stream: int, seq: int, index: int, t_us: int, boot: int | None = None, origin: str = "") -> str:
    """The id an input from a board carries through the daemon: ``stream.seq.index.t_us``, ``.boot`` when the
    board's HELLO gives one, and ``@origin`` when a bridge says whose input it is (its instance: a board of the same
    name on another bridge makes the same numbers); so that an answer on MQTT can be routed back down to the frame
    it answers (``parse_input_id``). A resend of a frame has the same id: duplicates are removed by it."""
    return f"{stream}.{seq}.{index}.{t_us}" + ("" if boot is None else f".{boot}") + (f"@{origin}" if origin else "")


def parse_input_id(text: object) -> tuple[int, int] | None:
    """(stream, seq) of an id made by ``input_id``; None for any other id."""
    if not isinstance(text, str):
        return None
    parts = text.split("@", 1)[0].split(".")
    if len(parts) not in (4, 5) or not all(p.isdigit() and len(p) <= 20 for p in parts):
        return None
    stream, seq = int(parts[0]), int(parts[1])
    return (stream, seq) if 1 <= stream <= MAX_STREAMS and seq < SEQ_MODULO else None


@dataclass
class LinkCounters:
    """What one link saw, monotonic over its life (the port reopened or not)."""

    frames: int = 0
    bytes: int = 0
    resyncs: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    """By reason: the decoder's (``cobs``, ``short``, ``crc``, ``version``, ``flags``, ``type``, ``size``), and
    ``hello`` (a HELLO that does not parse), ``stream`` (SAMPLES of a stream no HELLO declared), ``samples`` (a
    payload that is not a whole number of samples), ``direction`` (a host-to-board type from the board)."""
    sequence_gaps: int = 0
    repeats: int = 0
    board_restarts: int = 0
    samples: int = 0
    results: int = 0
    answers_sent: int = 0
    answers_unsent: int = 0
    """Answers not written to the board: it does not read (its port took nothing for ``write_timeout_s``, or the
    queue to it was full), its port was closed, or the answer does not fit a frame."""
    acks_sent: int = 0
    reopens: int = 0
    link_errors: int = 0
    """Exceptions while serving the board (a bug its frames met): each reopened the port."""

    def as_dict(self) -> dict[str, int]:
        return {
            "frames": self.frames,
            "bytes": self.bytes,
            "crc_errors": self.refused["crc"],
            "resyncs": self.resyncs,
            "sequence_gaps": self.sequence_gaps,
            "board_restarts": self.board_restarts,
            "refused": sum(self.refused.values()),
            "repeats": self.repeats,
            "samples": self.samples,
            "results": self.results,
            "answers_sent": self.answers_sent,
            "answers_unsent": self.answers_unsent,
            "acks_sent": self.acks_sent,
            "reopens": self.reopens,
            "link_errors": self.link_errors,
        }


class LinkHandler(Protocol):
    """What a link hands its board's traffic to. Called on the link's thread; ``on_samples`` may block (the board
    waits, then resends: nothing is lost in reliable mode)."""

    def on_hello(self, link: BoardLink, board: Board, restarted: bool) -> None: ...

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        """``samples`` has shape ``(k, *stream.shape)``; call ``safe[i]`` once sample ``i`` cannot be lost."""

    def on_result(self, link: BoardLink, board: Board, frame: Frame, record: dict[str, Any]) -> None: ...


@dataclass
class _Reliable:
    """Reliable-mode state of one stream in one session: what is taken and not yet safe, and how far it is safe."""

    expected: int | None
    pending: deque[list[int]] = field(default_factory=deque)
    """[seq, samples not safe yet], oldest first."""
    safe_through: int | None = None


class BoardLink:
    """See the module. ``run`` blocks until ``stopping`` is set; everything else may be called from any thread."""

    def __init__(
        self, url: str, handler: LinkHandler, *, baudrate: int = 115200, label: str | None = None,
        downlink_frames: int = DOWNLINK_FRAMES,
    ):  # fmt: skip
        self.url = url
        self.baudrate = baudrate
        self.handler = handler
        self.label = label or url
        self.counters = LinkCounters()
        self.board: Board | None = None
        self.stats: dict[str, Any] | None = None
        """The board's last ``stats`` LOG line, as it sent it."""
        self.last_heard: float | None = None
        self.connected = threading.Event()
        self._port: Any = None
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._session = 0
        self._reliable: dict[int, _Reliable] = {}
        self._gaps = SequenceGaps()
        self._host_seq = 0
        self._hello_wanted_since: float | None = None
        self._decoder = Decoder()
        self._decoder_seen: Counter[str] = Counter()
        self._decoder_resyncs = 0
        self._port_for_writes: Any = None
        self._write_port: Callable[[bytes], bool] = _closed
        self.write_timeout_s = write_timeout_s(baudrate)
        self.downlink_frames = max(1, downlink_frames)
        self._downlink: queue.Queue[tuple[int, bytes]] = queue.Queue(self.downlink_frames)
        """Frames to the board (their type, their bytes), drained by the writer thread."""
        self._cut = False
        """The last write timed out part way through a frame: the next one starts with a delimiter."""
        self._board_clock_us = 0
        """The ``t_us`` of the board's last frame: a HELLO with an earlier one is from a board that restarted."""
        self._refused_log = Repeated(log, f"serial {url}: frames refused", remember=16)
        self._unsent_log = Repeated(log, f"serial {url}: frames to the board dropped, not written")
        self._board_log = Repeated(log, "board LOG lines", level=logging.INFO, every_s=LOG_EVERY_S)
        self._errors_log = Repeated(log, f"serial {url}: the link failed", level=logging.ERROR, every_s=math.inf,
                                    remember=16)  # fmt: skip

    # -- the port ----------------------------------------------------------------------------------------------
    def _open(self) -> Any:
        import serial

        try:
            return serial.serial_for_url(
                self.url, baudrate=self.baudrate, timeout=0, write_timeout=self.write_timeout_s
            )
        except (serial.SerialException, ValueError, OSError) as exc:
            raise EdgelineError(f"serial {self.url}: {exc}") from exc

    def open(self) -> None:
        """Open the port now: a wrong URL fails before the caller says it is ready."""
        self._port = self._open()

    def run(self, stopping: threading.Event) -> None:
        """Serve the board until ``stopping`` is set: this thread reads, a writer thread of its own writes."""
        ended = threading.Event()
        writer = threading.Thread(
            target=self._write_downlink, args=(stopping, ended), name=f"{threading.current_thread().name}-writer",
            daemon=True,
        )  # fmt: skip
        writer.start()
        try:
            self._read(stopping)
        finally:
            ended.set()
            writer.join(self.write_timeout_s + 1.0)
            self.counters.answers_unsent += self._drop_queued().count(FrameType.ANSWER)  # queued as it stopped

    def _read(self, stopping: threading.Event) -> None:
        import serial

        retry = Retry(BACKOFF_FIRST_S, BACKOFF_MAX_S, jitter=False)  # reset only once the port worked again
        failing: str | None = None  # the last failure to open, said once
        flapping = False  # the port opens and fails at once, again and again: said once
        first = True
        while not stopping.is_set():
            port, self._port = self._port, None
            if port is None:
                try:
                    port = self._open()
                except EdgelineError as exc:
                    if failing != str(exc):  # one line per change of state, not one per attempt
                        failing = str(exc)
                        log.warning("%s; retrying with back-off up to %g s", exc, BACKOFF_MAX_S)
                    stopping.wait(retry.next_delay())
                    continue
            if not first:
                self.counters.reopens += 1
                if not flapping:
                    log.info("serial %s open again", self.url)
            first, failing, frames = False, None, self.counters.frames
            try:
                self._serve(port, stopping)
            except (serial.SerialException, OSError) as exc:
                if self.counters.frames > frames:  # it worked, then went away: a change of state worth a line
                    log.warning("serial %s lost: %s; reopening", self.url, exc)
                    flapping = False
                    retry.reset()
                else:  # it opens and fails at once (a port another program holds): back off, say it once
                    if not flapping:
                        log.warning("serial %s opens but fails at once: %s; retrying with back-off", self.url, exc)
                    flapping = True
                    stopping.wait(retry.next_delay())
            except Exception as exc:  # a bug this board's frames met: said once per place, counted; the port reopened
                self._failed(exc, "reopening the port")
                stopping.wait(retry.next_delay())  # never reset here: a board that repeats it waits longer each time
            finally:
                self.connected.clear()
                with self._write_lock:
                    self._port_for_writes, self._write_port = None, _closed
                    # what was queued for this port goes with it, as what comes while it is closed: the next port
                    # starts with its HELLO_REQUEST, not behind a backlog for a board that may have restarted since
                    self.counters.answers_unsent += self._drop_queued().count(FrameType.ANSWER)
                with contextlib.suppress(serial.SerialException, OSError):
                    port.close()

    def _failed(self, exc: Exception, then: str) -> None:
        self.counters.link_errors += 1
        board = self.board.device if self.board is not None else "not named yet"
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        key = (type(exc).__name__, *((where[0].filename, where[0].lineno) if where else ()))
        self._errors_log.happened(
            1, f"board {board}: {type(exc).__name__}: {exc}; {then} (said once per place; counted as link_errors)",
            key=key, exc_info=True,
        )  # fmt: skip

    def _serve(self, port: Any, stopping: threading.Event) -> None:
        with self._write_lock:
            self._port_for_writes, self._write_port = port, _writer(port, self.write_timeout_s)
        self._decoder = Decoder()  # a frame cut by the unplug is not glued to the next port's bytes
        self._decoder_seen, self._decoder_resyncs = Counter(), 0
        self.connected.set()
        self.request_hello()
        read = _reader(port)
        while not stopping.is_set():
            chunk = read()
            if chunk:
                self._take(chunk)
            wanted = self._hello_wanted_since
            if wanted is not None and time.monotonic() - wanted > HELLO_RETRY_S:
                self.request_hello()

    def _take(self, chunk: bytes) -> None:
        decoder = self._decoder
        frames = decoder.feed(chunk)
        counters = self.counters
        counters.bytes += len(chunk)
        counters.frames += len(frames)
        counters.resyncs += decoder.resyncs - self._decoder_resyncs
        self._decoder_resyncs = decoder.resyncs
        if decoder.refused != self._decoder_seen:
            counters.refused.update(decoder.refused - self._decoder_seen)
            self._decoder_seen = Counter(decoder.refused)
        for frame in frames:
            self._frame(frame)

    # -- writing -----------------------------------------------------------------------------------------------
    def send(self, frame: Frame) -> bool:
        """Queue one frame for the board, never waiting; False when it is dropped instead: the port is not open (the
        board is away), or the queue is full (the board does not read)."""
        if self._port_for_writes is None:
            return False
        try:
            self._downlink.put_nowait((frame.type, encode(frame)))
        except queue.Full:
            self._unsent_log.happened(
                1, f"the queue to the board is full ({self.downlink_frames} frames): it does not read, or too slowly"
            )
            return False
        return True

    def _write_downlink(self, stopping: threading.Event, ended: threading.Event) -> None:
        """The writer thread: one frame at a time from the queue to the port, each within ``write_timeout_s``."""
        while not (stopping.is_set() or ended.is_set()):
            try:
                kind, data = self._downlink.get(timeout=WRITER_IDLE_S)
            except queue.Empty:
                for said in (self._unsent_log, self._board_log, self._refused_log):
                    said.tick()
                continue
            try:
                self._write(kind, data)
            except Exception as exc:  # never: _write takes what a port raises; still, the writer never dies
                self._failed(exc, "the frame is dropped")

    def _write(self, kind: int, data: bytes) -> None:
        with self._write_lock:
            try:
                written = self._write_port(b"\x00" + data if self._cut else data)
            except Exception as exc:  # a port that just went away: the reader reopens it
                log.debug("serial %s: write failed: %s", self.url, exc)
                written = None
            if written is False:
                self._cut = True
                lost = [kind, *self._drop_queued()]
                self._unsent_log.happened(
                    len(lost), f"the board took no byte of a frame for {self.write_timeout_s:g} s (or not the whole "
                    f"frame in {FRAME_WRITE_TURNS * self.write_timeout_s:g} s): it does not read its port "
                    f"(the {len(lost)} frames waiting for it dropped, answers counted as answers_unsent)",
                )  # fmt: skip
                self.counters.answers_unsent += lost.count(FrameType.ANSWER)
                return
        if not written:
            if kind == FrameType.ANSWER:
                self.counters.answers_unsent += 1
            return
        self._cut = False
        if kind == FrameType.ANSWER:
            self.counters.answers_sent += 1
        elif kind == FrameType.ACK:
            self.counters.acks_sent += 1

    def _drop_queued(self) -> list[int]:
        dropped = []
        with contextlib.suppress(queue.Empty):
            while True:
                dropped.append(self._downlink.get_nowait()[0])
        return dropped

    def _control(self, kind: FrameType, payload: bytes = b"") -> bool:
        with self._state_lock:
            seq = self._host_seq
            self._host_seq = (seq + 1) % SEQ_MODULO
        return self.send(Frame(int(kind), CONTROL_STREAM, seq, _now_us(), payload))

    def request_hello(self) -> None:
        self._hello_wanted_since = time.monotonic()
        self._control(FrameType.HELLO_REQUEST)

    def configure(self, settings: Mapping[str, Any]) -> bool:
        """Send a CONFIG frame (``{"rate_hz": ..., "streams": {"1": false}}``)."""
        return self._control(FrameType.CONFIG, orjson.dumps(dict(settings)))

    def answer(self, stream: int, seq: int, payload: bytes) -> bool:
        """Queue an answer for the board, as the ANSWER of its input ``stream``/``seq``, never waiting; False when it
        is dropped at once (counted in ``answers_unsent``; ``answers_sent`` counts those written)."""
        queued = len(payload) <= MAX_PAYLOAD and self.send(
            Frame(int(FrameType.ANSWER), stream, seq, _now_us(), payload)
        )
        if not queued:
            self.counters.answers_unsent += 1
        return queued

    # -- reading -----------------------------------------------------------------------------------------------
    def _refuse(self, reason: str, text: str) -> None:
        self.counters.refused[reason] += 1
        self._refused_log.happened(1, text, key=reason)

    def _frame(self, frame: Frame) -> None:
        self.last_heard = time.monotonic()
        kind = frame.type
        restarted = kind == FrameType.HELLO and self._restarted(frame)
        if restarted:  # it counts from 0 again: so does the gap count
            self._gaps.reset()
        repeats = self._gaps.repeats
        self.counters.sequence_gaps += self._gaps.observe(frame.stream, frame.seq)
        if self._gaps.repeats > repeats and not (kind == FrameType.SAMPLES and frame.ack_requested):
            self.counters.repeats += 1  # (a reliable frame's resend is counted by _samples, which tells it apart)
        self._board_clock_us = frame.t_us
        if kind == FrameType.SAMPLES:
            self._samples(frame)
        elif kind == FrameType.HELLO:
            self._hello(frame, restarted)
        elif kind == FrameType.HEARTBEAT:
            pass
        elif kind == FrameType.LOG:
            self._log(frame)
        elif kind == FrameType.RESULT:
            self._result(frame)
        elif kind == FrameType.ACK:
            pass  # the host sends nothing that asks for one
        else:
            self._refuse("direction", f"a {FrameType(kind).name} frame came from the board (a host-to-board type)")

    def _hello(self, frame: Frame, restarted: bool) -> None:
        try:
            board = parse_hello(frame.payload)
        except FrameError as exc:
            self._refuse(exc.reason, str(exc))
            return
        self._hello_wanted_since = None
        previous = self.board
        if restarted:
            self.counters.board_restarts += 1
            log.warning(
                "serial %s: board %s restarted (a HELLO not asked for, or its clock went back)", self.url, board.device
            )
        elif previous is None or previous.device != board.device:
            streams = ", ".join(
                f"{s.id} {s.name} {s.dtype.str}{list(s.shape)}" + (f" at {s.rate_hz:g} Hz" if s.rate_hz else "")
                for s in board.streams.values()
            )
            log.info("serial %s: board %s (%s), streams %s", self.url, board.device, board.firmware or "?", streams)
        with self._state_lock:
            same = not restarted and previous == board
            self.board = board
            if not same:  # a new session: what the last one took and has not acknowledged means nothing now
                self._session += 1
                self._reliable = {sid: _Reliable(spec.seq) for sid, spec in board.streams.items()}
        self.handler.on_hello(self, board, restarted)

    def _restarted(self, hello: Frame) -> bool:
        """Whether a HELLO means the board restarted: it was not asked for, or the board's clock went back (a HELLO
        asked for, from a board that restarted while its first one was lost, or while the port was away)."""
        return self.board is not None and (self._hello_wanted_since is None or hello.t_us < self._board_clock_us)

    def _log(self, frame: Frame) -> None:
        text = frame.payload.decode("utf-8", errors="replace")
        device = self.board.device if self.board is not None else self.url
        if text.startswith("stats "):
            try:
                stats = orjson.loads(text[6:])
            except orjson.JSONDecodeError:
                stats = None
            if isinstance(stats, dict):
                self.stats = stats
                log.debug("board %s: %s", device, text)
                return
        self._board_log.happened(1, f"{device}: {text[:500]}")

    def _result(self, frame: Frame) -> None:
        board = self.board
        if board is None:
            self._refuse("stream", "a RESULT came before the board's HELLO")
            self.request_hello()
            return
        try:
            record = orjson.loads(frame.payload)
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            self._refuse("result", f"a RESULT from {board.device} is not a JSON object")
            return
        self.counters.results += 1
        self.handler.on_result(self, board, frame, record)

    def _samples(self, frame: Frame) -> None:
        board = self.board
        if board is None:
            self._refuse("stream", "SAMPLES came before the board's HELLO; asking who it is")
            if self._hello_wanted_since is None:
                self.request_hello()
            return
        spec = board.streams.get(frame.stream)
        if spec is None:
            self._refuse("stream", f"SAMPLES on stream {frame.stream}, which {board.device}'s HELLO did not declare")
            return
        reliable = frame.ack_requested
        session = self._session
        state = self._reliable[frame.stream]
        if reliable:
            with self._state_lock:
                verdict = self._admit(state, frame.seq)
            if verdict == "resend":
                self.counters.repeats += 1
                if state.safe_through is not None and _not_after(frame.seq, state.safe_through):
                    self._send_ack(frame.stream, state.safe_through)
                return
            if verdict == "ahead":
                return  # one before it was lost: the board resends from there (go-back-N)
        size = len(frame.payload)
        if size == 0 or size % spec.sample_bytes:
            self._refuse(
                "samples",
                f"SAMPLES of {size} bytes on {board.device}/{spec.name}: not a whole number of "
                f"{spec.sample_bytes}-byte samples ({spec.dtype.str} {list(spec.shape)})",
            )
            if reliable:  # taken and refused: safe, or the board would resend it for ever
                self._track(state, session, frame.stream, frame.seq, 1)[0]()
            return
        samples = np.frombuffer(frame.payload, dtype=spec.dtype).reshape(-1, *spec.shape)
        self.counters.samples += len(samples)
        if reliable:
            safe = self._track(state, session, frame.stream, frame.seq, len(samples))
        else:
            safe = [_nothing] * len(samples)
        self.handler.on_samples(self, board, spec, frame, samples, safe)

    @staticmethod
    def _admit(state: _Reliable, seq: int) -> str:
        """Whether a reliable frame is the next one (``take``), a resend of one taken (``resend``), or ahead of a
        lost one (``ahead``)."""
        if state.expected is None:
            state.expected = seq
        ahead = (seq - state.expected) % SEQ_MODULO
        if ahead == 0:
            state.expected = (seq + 1) % SEQ_MODULO
            return "take"
        return "ahead" if ahead < SEQ_MODULO // 2 else "resend"

    def _track(self, state: _Reliable, session: int, stream: int, seq: int, parts: int) -> list[Callable[[], None]]:
        entry = [seq, parts]
        with self._state_lock:
            state.pending.append(entry)

        def safe() -> None:
            ack: int | None = None
            with self._state_lock:
                if self._session != session or entry[1] <= 0:
                    return  # the board restarted since: this session's ACKs mean nothing to it
                entry[1] -= 1
                while state.pending and state.pending[0][1] <= 0:
                    ack = state.pending.popleft()[0]
                if ack is not None:
                    state.safe_through = ack
            if ack is not None:
                self._send_ack(stream, ack)

        return [safe] * parts

    def retake(self, stream: int, seq: int) -> None:
        """A sample of reliable frame ``seq`` could not be made safe (the broker refused it): forget that frame and
        every later one of the stream, so that the board's resends of them are taken again."""
        with self._state_lock:
            state = self._reliable.get(stream)
            if state is None or not any(entry[0] == seq for entry in state.pending):
                return
            while state.pending and state.pending[-1][0] != seq:
                state.pending.pop()[1] = -1  # its late safe() calls are ignored
            state.pending.pop()[1] = -1
            state.expected = seq

    def _send_ack(self, stream: int, seq: int) -> None:
        self._control(FrameType.ACK, pack_ack(stream, seq))  # counted in acks_sent once written

    def status(self) -> dict[str, Any]:
        """For the status message: the board, what the wire did, the board's own counters."""
        board = self.board
        return {
            "port": self.url,
            "connected": self.connected.is_set(),
            "device": board.device if board is not None else None,
            "firmware": board.firmware if board is not None else None,
            "heard_s_ago": None if self.last_heard is None else round(time.monotonic() - self.last_heard, 3),
            "hello_pending": self._hello_wanted_since is not None,
            **self.counters.as_dict(),
            "refused_by_reason": dict(self.counters.refused),
            "board_stats": self.stats,
        }


def _reader(port: Any) -> Callable[[], bytes]:
    """What came on the port, waiting at most ``READ_TIMEOUT_S`` for it: whatever is there, in one call.

    ``port.read(port.in_waiting)`` is not that for every URL: pyserial's ``socket://`` says 0 or 1 for
    ``in_waiting`` (readable or not), which read a frame one byte per call (19 times the CPU of a pty, measured:
    ``benchmarks/results/firmware_bridge.md``). With a file descriptor the port is read without a timeout after a
    ``select`` on it (a POSIX port, a socket); otherwise (``rfc2217://``, ``loop://``) with the timeout, as before."""
    fd = _fileno(port)
    if fd is None:
        port.timeout = READ_TIMEOUT_S
        return lambda: bytes(port.read(max(1, port.in_waiting)))

    def read() -> bytes:
        ready, _, _ = select.select([fd], [], [], READ_TIMEOUT_S)
        return bytes(port.read(READ_CHUNK)) if ready else b""

    return read


def _writer(port: Any, timeout_s: float) -> Callable[[bytes], bool]:
    """A function that writes bytes to the port; False when the port took no byte for ``timeout_s`` (a board that
    does not read: its buffer, or the pty's, is full), or not all of them in ``FRAME_WRITE_TURNS`` times that (a
    trickle). A board that reads slowly, or an emulated one a busy machine runs late, is not taken for a deaf one.

    With a file descriptor, a ``select`` for room then a non-blocking write, as ``_reader``: pyserial's own write
    timeout spins on EAGAIN for the whole timeout (a core busy for each frame to a board that does not read).
    Otherwise (``rfc2217://``, ``loop://``) pyserial's ``write_timeout`` (set when the port was opened)."""
    import serial

    fd = _fileno(port)
    if fd is None:

        def write_with_pyserial(data: bytes) -> bool:
            try:
                port.write(data)
            except serial.SerialTimeoutException:
                return False
            return True

        return write_with_pyserial

    def write(data: bytes) -> bool:
        view = memoryview(data)
        start = time.monotonic()
        deadline, last = start + FRAME_WRITE_TURNS * timeout_s, start  # the whole frame; the last byte taken
        while view:
            now = time.monotonic()
            left = min(deadline, last + timeout_s) - now
            _, ready, _ = select.select([], [fd], [], max(0.0, left))
            if not ready:
                return False
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            last = time.monotonic()
        return True

    return write


def _closed(data: bytes) -> bool:
    """The writer of a port that is not open: nothing written."""
    raise OSError("the port is not open")


def _fileno(port: Any) -> int | None:
    try:
        fd = port.fileno()
    except Exception:  # a URL handler without one (pyserial raises NotImplementedError or AttributeError)
        return None
    return fd if isinstance(fd, int) else None


def _not_after(seq: int, reference: int) -> bool:
    return (reference - seq) % SEQ_MODULO < SEQ_MODULO // 2


def _nothing() -> None:
    """The ``safe`` of a sample sent without reliable mode: nobody waits for it."""


def _now_us() -> int:
    return time.monotonic_ns() // 1000


def sum_counters(links: list[BoardLink]) -> dict[str, int]:
    """Every link's counters added up, for the status message and ``/metrics``."""
    total: Counter[str] = Counter()
    for link in links:
        total.update(link.counters.as_dict())
    return dict(total)
