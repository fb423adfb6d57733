"""One serial port with one board behind it, speaking the framed protocol (``docs/firmware-protocol.md``).

``BoardLink`` is what ``edgeline run --serial-protocol frames`` and ``edgeline bridge`` share: it opens the port (and
reopens it with back-off when it goes away, one log line per change of state), asks the board who it is
(``HELLO_REQUEST``), decodes frames, checks each ``SAMPLES`` frame against the stream the ``HELLO`` declared, counts
what the wire did (frames, bytes, CRC errors, resyncs, sequence gaps, board restarts, refused frames), and hands every
sample to a ``LinkHandler`` with a ``safe`` callback. In reliable mode the ``ACK`` of a frame goes out only once every
sample of it, and of every frame before it, is safe (the caller says when: in the daemon's outbox, or acknowledged
by the broker); a stream's start is the ``seq`` of the HELLO or, without one, learned from the board's go-back, never
assumed (``edgeline.firmware_bridge.reliable``). Answers go back down with ``answer``, from any thread, without ever
waiting: frames to the board go through a bounded queue that the link's writer thread drains, each write bounded by
``write_timeout_s``. A board that does not read (many sensor firmwares never read their RX line, and a USB CDC device
that does not read fills the host's buffer) has what does not fit dropped, counted (``answers_unsent``) and said once
per change of state. An answer carries the ``session`` of its input: one to a board that restarted since (or to
another board) is dropped, counted (``answers_stale``).

The port is opened exclusively (``edgeline.firmware_bridge.port``): a second program that opens it is refused,
the holder named, and retries with back-off until the port is free.

Nothing a board sends stops a link, grows it without bound, or writes what it likes into the host's log: an exception
while serving it is said once (with the board and the traceback), counted (``link_errors``), and the port is reopened
with back-off; a port takes at most ``MAX_DEVICE_NAMES`` device names over its life; every log line a board's frames
cause goes through ``edgeline.lograte.Repeated`` (a flood costs a few lines; the counters stay exact), its text
quoted by ``edgeline.lograte.shown`` (one line, escaped, bounded).

Each board is named by the ``device`` of its ``HELLO``, never by its port: a board that comes back on another port
keeps its streams.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

from edgeline.daemon.reconnect import Retry
from edgeline.daemon.topics import topic_problem
from edgeline.errors import EdgelineError
from edgeline.firmware_bridge.port import FRAME_WRITE_TURNS, _PortBusy, closed, open_port, write_timeout_s
from edgeline.firmware_bridge.port import reader as _reader
from edgeline.firmware_bridge.port import writer as _writer
from edgeline.firmware_bridge.protocol import (
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
from edgeline.firmware_bridge.reliable import ReliableStream, Verdict, not_after
from edgeline.lograte import Repeated, shown

__all__ = [
    "DTYPES",
    "FRAME_WRITE_TURNS",
    "LEARN_ROUNDS",
    "MAX_DEVICE_NAMES",
    "Board",
    "BoardLink",
    "LinkCounters",
    "LinkHandler",
    "StreamSpec",
    "input_id",
    "name_problem",
    "parse_hello",
    "parse_input_id",
    "write_timeout_s",
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
LEARN_ROUNDS = 8
"""HELLO_REQUESTs a link sends at once, per session, to learn where the reliable frames of a stream whose HELLO gives
no ``seq`` start (``edgeline.firmware_bridge.reliable``: one or two do, on a sound wire); past them, one every
``HELLO_RETRY_S``, for as long as it does not settle (nothing of the stream is taken meanwhile: the board waits)."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
MAX_STREAMS = 255
MAX_HELLO_DEVICE = 128
MAX_DEVICE_NAMES = 32
"""Distinct device names one port takes over its life (the process's): a board's id is fixed, and a real port sees
a few boards swapped over years, never this many. A HELLO with a new name past it is refused (``names``): a board that
names itself anew in every HELLO grows neither the link nor what a bridge keeps (subscriptions, claims) per name."""
DOWNLINK_FRAMES = 256
"""Frames waiting to be written to one board, at most, by default: past it a new one is dropped (the board does not
read, or reads slower than its answers come). ``edgeline run`` sizes it, and the inputs it hands the daemon, so that
every answer the daemon may owe fits (``edgeline.firmware_bridge.source``); ``edgeline bridge`` from its window
(``--max-unanswered``)."""
WRITER_IDLE_S = 0.25
LOG_EVERY_S = 10.0
"""A board's LOG lines: the first of a burst is said, the rest counted and summarised at most this often."""
SHOWN_LOG = 500
"""Characters of a board's LOG line the host's log quotes, at most."""


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
    ``hello`` (a HELLO that does not parse), ``names`` (a HELLO with a new device name, past the port's
    ``MAX_DEVICE_NAMES``), ``stream`` (SAMPLES of a stream no HELLO declared), ``samples`` (a payload that is not a
    whole number of samples), ``direction`` (a host-to-board type from the board), ``result`` (a RESULT that is not a
    JSON object)."""
    sequence_gaps: int = 0
    repeats: int = 0
    board_restarts: int = 0
    samples: int = 0
    results: int = 0
    answers_sent: int = 0
    answers_unsent: int = 0
    """Answers not written to the board: it does not read (its port took nothing for ``write_timeout_s``, or the
    queue to it was full), its port was closed, or the answer does not fit a frame."""
    answers_stale: int = 0
    """Answers not written to the board because they answer an input of another session: the board restarted since
    the input came (or another board took the port), so their stream and ``seq`` now name another input."""
    start_unknown: int = 0
    """Reliable frames not taken (nor acknowledged) because their stream's start was not learned yet: a HELLO
    without ``seq`` (the board resends them)."""
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
            "answers_stale": self.answers_stale,
            "start_unknown": self.start_unknown,
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
        self.held_by: str | None = None
        """Who holds the port while another program has it open (``pid N (program)``, or ``another program``)."""
        self._port: Any = None
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._session = int.from_bytes(os.urandom(4), "little")
        """Changes at every new session; starts at a random number, so that another process's sessions (a bridge
        restarted, answering the ids its previous run made) are not taken for this one's."""
        self._reliable: dict[int, ReliableStream] = {}
        self._device_names: set[str] = set()
        """The device names this port took, at most ``MAX_DEVICE_NAMES``."""
        self._learn_rounds = 0
        """HELLO_REQUESTs sent in this session to learn a stream's start (``LEARN_ROUNDS`` at once, then paced)."""
        self._hello_due: float | None = None
        """When the next paced HELLO_REQUEST goes out (a start still not learned after ``LEARN_ROUNDS``)."""
        self._gaps = SequenceGaps()
        self._host_seq = 0
        self._hello_wanted_since: float | None = None
        self._decoder = Decoder()
        self._decoder_seen: Counter[str] = Counter()
        self._decoder_resyncs = 0
        self._refused_with = False
        """The decoder refused something in the bytes whose frames are being handled."""
        self._port_for_writes: Any = None
        self._write_port: Callable[[bytes], bool] = closed
        self._open_failure: str | None = None
        """The last failure to open the port, said once (one line per change of state, not one per attempt)."""
        self.write_timeout_s = write_timeout_s(baudrate)
        self.downlink_frames = max(1, downlink_frames)
        self._downlink: queue.Queue[tuple[int, bytes, int]] = queue.Queue(self.downlink_frames)
        """Frames to the board (their type, their bytes, the session they were queued in), drained by the writer."""
        self._cut = False
        """The last write timed out part way through a frame: the next one starts with a delimiter."""
        self._board_clock_us = 0
        """The ``t_us`` of the board's last frame: a HELLO with an earlier one is from a board that restarted."""
        where = f"serial {shown(url)}"
        self._refused_log = Repeated(log, f"{where}: frames refused", remember=16)
        self._unsent_log = Repeated(log, f"{where}: frames to the board dropped, not written")
        self._restart_log = Repeated(log, f"{where}: board restarts")
        self._named_log = Repeated(
            log, f"{where}: boards named", level=logging.INFO, every_s=math.inf, remember=MAX_DEVICE_NAMES
        )  # fmt: skip  (each name said once: at most 32 lines)
        self._learn_log = Repeated(log, f"{where}: reliable streams whose start is not learned", every_s=math.inf,
                                   remember=MAX_STREAMS)  # fmt: skip
        self._board_log = Repeated(log, "board LOG lines", level=logging.INFO, every_s=LOG_EVERY_S)
        self._stats_log = Repeated(log, f"{where}: board stats lines", level=logging.DEBUG, every_s=LOG_EVERY_S)
        self._errors_log = Repeated(log, f"{where}: the link failed", level=logging.ERROR, every_s=math.inf,
                                    remember=16)  # fmt: skip
        self._said = (self._unsent_log, self._board_log, self._refused_log, self._restart_log, self._stats_log)

    @property
    def session(self) -> int:
        """The board's session: a number that changes at every new one (the board restarted, or another board took
        the port). An answer bound to the session of its input (``answer(..., session=)``) is not written to another.
        """
        return self._session

    @property
    def downlink_queued(self) -> int:
        """Frames waiting in the queue to the board."""
        return self._downlink.qsize()

    # -- the port ----------------------------------------------------------------------------------------------
    def _open(self) -> Any:
        try:
            port = open_port(self.url, baudrate=self.baudrate, write_timeout=self.write_timeout_s)
        except _PortBusy as exc:
            self.held_by = exc.held_by or "another program"
            raise
        except EdgelineError:
            self.held_by = None
            raise
        self.held_by = None
        return port

    def open(self) -> None:
        """Open the port now: a wrong URL fails before the caller says it is ready. A port another program holds is
        not an error: it is said, and ``run`` takes it once it is free (a service restarted while its previous
        process still holds the port)."""
        try:
            self._port = self._open()
        except _PortBusy as exc:
            self._said_open_failure(exc)

    def _said_open_failure(self, exc: EdgelineError) -> None:
        if self._open_failure != str(exc):  # one line per change of state, not one per attempt
            self._open_failure = str(exc)
            log.warning("%s; retrying with back-off up to %g s", exc, BACKOFF_MAX_S)

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
        flapping = False  # the port opens and fails at once, again and again: said once
        first = True
        while not stopping.is_set():
            port, self._port = self._port, None
            if port is None:
                try:
                    port = self._open()
                except EdgelineError as exc:
                    self._said_open_failure(exc)
                    stopping.wait(retry.next_delay())
                    continue
            if not first:
                self.counters.reopens += 1
                if not flapping:
                    log.info("serial %s open again", self.url)
            elif self._open_failure is not None:  # it waited for the port from the start
                log.info("serial %s open", self.url)
            first, self._open_failure, frames = False, None, self.counters.frames
            try:
                self._serve(port, stopping)
            except (serial.SerialException, OSError) as exc:
                if self.counters.frames > frames:  # it worked, then went away: a change of state worth a line
                    log.warning("serial %s lost: %s; reopening", self.url, exc)
                    flapping = False
                    retry.reset()
                else:  # it opens and fails at once: back off, say it once
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
                    self._port_for_writes, self._write_port = None, closed
                    # what was queued for this port goes with it, as what comes while it is closed: the next port
                    # starts with its HELLO_REQUEST, not behind a backlog for a board that may have restarted since
                    self.counters.answers_unsent += self._drop_queued().count(FrameType.ANSWER)
                with contextlib.suppress(serial.SerialException, OSError):
                    port.close()

    def _failed(self, exc: Exception, then: str) -> None:
        self.counters.link_errors += 1
        board = shown(self.board.device) if self.board is not None else "not named yet"
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        key = (type(exc).__name__, *((where[0].filename, where[0].lineno) if where else ()))
        self._errors_log.happened(
            1, f"board {board}: {type(exc).__name__}: {shown(exc)}; {then} (said once per place; counted as "
            "link_errors)", key=key, exc_info=True,
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
            now = time.monotonic()
            wanted, due = self._hello_wanted_since, self._hello_due
            if wanted is not None and now - wanted > HELLO_RETRY_S:
                self.request_hello()
            elif due is not None and now >= due and wanted is None:
                self._hello_due = None
                self._learn_rounds += 1
                self.request_hello()

    def _take(self, chunk: bytes) -> None:
        """Bytes from the port. While a stream waits for the go-back that tells its start, fed to the decoder one
        delimited piece at a time, so that what it refuses is counted in its place among the frames (a start is
        learned only from a go-back nothing was refused in); otherwise at once (about a third less CPU per frame)."""
        self.counters.bytes += len(chunk)
        decoder = self._decoder
        if not any(state.listening for state in self._reliable.values()):
            self._decoded(decoder.feed(chunk))
            return
        start, size = 0, len(chunk)
        while start < size:
            end = chunk.find(b"\x00", start)
            stop = size if end < 0 else end + 1
            self._decoded(decoder.feed(chunk[start:stop]))
            start = stop

    def _decoded(self, frames: list[Frame]) -> None:
        decoder, counters = self._decoder, self.counters
        counters.frames += len(frames)
        refused = decoder.resyncs != self._decoder_resyncs or decoder.refused != self._decoder_seen
        self._refused_with = refused  # a HELLO among these frames cannot tell whether the refusal came after it
        if refused:
            counters.resyncs += decoder.resyncs - self._decoder_resyncs
            self._decoder_resyncs = decoder.resyncs
            counters.refused.update(decoder.refused - self._decoder_seen)
            self._decoder_seen = Counter(decoder.refused)
            with self._state_lock:
                for state in self._reliable.values():
                    state.clean_since_hello = False
        for frame in frames:
            self._frame(frame)

    # -- writing -----------------------------------------------------------------------------------------------
    def send(self, frame: Frame) -> bool:
        """Queue one frame for the board, never waiting; False when it is dropped instead: the port is not open (the
        board is away), or the queue is full (the board does not read)."""
        return self._queue(frame, self._session)

    def _queue(self, frame: Frame, session: int) -> bool:
        if self._port_for_writes is None:
            return False
        try:
            self._downlink.put_nowait((frame.type, encode(frame), session))
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
                kind, data, session = self._downlink.get(timeout=WRITER_IDLE_S)
            except queue.Empty:
                for said in self._said:
                    said.tick()
                continue
            try:
                self._write(kind, data, session)
            except Exception as exc:  # never: _write takes what a port raises; still, the writer never dies
                self._failed(exc, "the frame is dropped")

    def _write(self, kind: int, data: bytes, session: int) -> None:
        if session != self._session and kind in (FrameType.ANSWER, FrameType.ACK):
            # the board restarted (or another took the port) since it was queued: its stream and seq name another
            # frame now; an ACK would tell the new boot that frames nobody took are safe
            if kind == FrameType.ANSWER:
                self.counters.answers_stale += 1
            return
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

    def _control(self, kind: FrameType, payload: bytes = b"", session: int | None = None) -> bool:
        with self._state_lock:
            seq = self._host_seq
            self._host_seq = (seq + 1) % SEQ_MODULO
        frame = Frame(int(kind), CONTROL_STREAM, seq, _now_us(), payload)
        return self._queue(frame, self._session if session is None else session)

    def request_hello(self) -> None:
        self._hello_wanted_since = time.monotonic()
        self._control(FrameType.HELLO_REQUEST)

    def configure(self, settings: Mapping[str, Any]) -> bool:
        """Send a CONFIG frame (``{"rate_hz": ..., "streams": {"1": false}}``)."""
        return self._control(FrameType.CONFIG, orjson.dumps(dict(settings)))

    def answer(self, stream: int, seq: int, payload: bytes, session: int | None = None) -> bool:
        """Queue an answer for the board, as the ANSWER of its input ``stream``/``seq``, never waiting; False when it
        is dropped at once (counted in ``answers_unsent``; ``answers_sent`` counts those written).

        ``session``: the ``session`` the input came in (read in ``on_samples``). An answer of another session is
        dropped, counted in ``answers_stale`` (the board restarted since, or another took the port: the stream and
        ``seq`` name another input now); so is one queued before such a change and not yet written. None: the
        session now (the caller cannot tell; the second check still applies)."""
        current = self._session
        if session is not None and session != current:
            self.counters.answers_stale += 1
            return False
        queued = len(payload) <= MAX_PAYLOAD and self._queue(
            Frame(int(FrameType.ANSWER), stream, seq, _now_us(), payload), current
        )
        if not queued:
            self.counters.answers_unsent += 1
        return queued

    # -- reading -----------------------------------------------------------------------------------------------
    def _refuse(self, reason: str, text: str) -> None:
        self.counters.refused[reason] += 1
        self._refused_log.happened(1, shown(text, 400), key=reason)

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
        if board.device not in self._device_names:
            if len(self._device_names) >= MAX_DEVICE_NAMES:
                self._refuse(
                    "names", f"HELLO refused: device {board.device!r} is a new name, and this port took "
                    f"{MAX_DEVICE_NAMES} device names already, the most it takes over its life (a board's id is "
                    "fixed: one that renames itself in every HELLO is not one to follow); restart the process to "
                    "take more",
                )  # fmt: skip
                return
            self._device_names.add(board.device)
        asked = self._hello_wanted_since is not None
        self._hello_wanted_since = None
        previous = self.board
        device = shown(board.device)
        if restarted:
            self.counters.board_restarts += 1
            self._restart_log.happened(1, f"board {device} restarted (a HELLO not asked for, or its clock went back)")
        if previous is None or previous.device != board.device:
            streams = ", ".join(
                f"{s.id} {shown(s.name)} {s.dtype.str}{list(s.shape)}" + (f" at {s.rate_hz:g} Hz" if s.rate_hz else "")
                for s in board.streams.values()
            )
            self._named_log.happened(
                1, f"board {device} ({shown(board.firmware) or '?'}), streams {shown(streams, 600)}", key=device
            )
        with self._state_lock:
            same = not restarted and previous == board
            self.board = board
            if not same:  # a new session: what the last one took and has not acknowledged means nothing now
                self._session = (self._session + 1) % (1 << 32)
                self._reliable = {sid: ReliableStream(spec.seq) for sid, spec in board.streams.items()}
                self._learn_rounds, self._hello_due = 0, None
            if asked:  # the board's go-back follows: where a stream without "seq" starts
                for state in self._reliable.values():
                    state.heard_hello(clean=not self._refused_with)
        self.handler.on_hello(self, board, restarted)

    def _restarted(self, hello: Frame) -> bool:
        """Whether a HELLO means the board restarted: it was not asked for, or the board's clock went back (a HELLO
        asked for, from a board that restarted while its first one was lost, or while the port was away)."""
        return self.board is not None and (self._hello_wanted_since is None or hello.t_us < self._board_clock_us)

    def _log(self, frame: Frame) -> None:
        text = frame.payload.decode("utf-8", errors="replace")
        device = shown(self.board.device) if self.board is not None else self.url
        if text.startswith("stats "):
            try:
                stats = orjson.loads(text[6:])
            except orjson.JSONDecodeError:
                stats = None
            if isinstance(stats, dict):
                self.stats = stats
                self._stats_log.happened(1, f"board {device}: {shown(text, SHOWN_LOG)}")
                return
        self._board_log.happened(1, f"{device}: {shown(text, SHOWN_LOG)}")

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
                verdict = state.admit(frame.seq)
            if verdict != "take" and self._not_taken(verdict, state, frame):
                return
        elif state.listening:  # its frames after the HELLO are not reliable: no go-back to wait for
            state.listening = False
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

    def _not_taken(self, verdict: Verdict, state: ReliableStream, frame: Frame) -> bool:
        """A reliable frame not taken: a resend of one taken (acknowledged again when safe), one ahead of a lost one
        (the board goes back to it), or one of a stream whose start is not learned yet. True: not taken."""
        if verdict == "resend":
            self.counters.repeats += 1
            if state.safe_through is not None and not_after(frame.seq, state.safe_through):
                self._send_ack(frame.stream, state.safe_through)
        elif verdict in ("unknown", "ask"):
            self.counters.start_unknown += 1
            if verdict == "ask":
                self._ask_for_start(frame.stream)
        return verdict != "take"

    def _ask_for_start(self, stream: int) -> None:
        """A HELLO_REQUEST to learn where a stream starts: at once for ``LEARN_ROUNDS`` rounds per session, then one
        every ``HELLO_RETRY_S`` (``_serve`` sends it); never a second one while one is waiting for its HELLO."""
        if self._hello_wanted_since is not None or self._hello_due is not None:
            return
        if self._learn_rounds < LEARN_ROUNDS:
            self._learn_rounds += 1
            self.request_hello()
            return
        self._hello_due = time.monotonic() + HELLO_RETRY_S
        device = shown(self.board.device) if self.board is not None else "?"
        self._learn_log.happened(
            1, f"board {device} stream {stream}: its HELLO gives no \"seq\", and {LEARN_ROUNDS} go-backs did not "
            "agree on where its reliable frames start (frames refused on the wire, or a board that does not resend "
            f"its window after a HELLO): nothing of it is taken or acknowledged; asking again every "
            f"{HELLO_RETRY_S:g} s (a board that says \"seq\" in its HELLO is never asked twice)", key=(device, stream),
        )  # fmt: skip

    def _track(
        self, state: ReliableStream, session: int, stream: int, seq: int, parts: int
    ) -> list[Callable[[], None]]:  # fmt: skip
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
                self._send_ack(stream, ack, session)

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

    def _send_ack(self, stream: int, seq: int, session: int | None = None) -> None:
        self._control(FrameType.ACK, pack_ack(stream, seq), session)  # counted in acks_sent once written

    def status(self) -> dict[str, Any]:
        """For the status message: the board, what the wire did, the board's own counters."""
        board = self.board
        return {
            "port": self.url,
            "connected": self.connected.is_set(),
            "held_by": self.held_by,
            "device": board.device if board is not None else None,
            "firmware": board.firmware if board is not None else None,
            "heard_s_ago": None if self.last_heard is None else round(time.monotonic() - self.last_heard, 3),
            "hello_pending": self._hello_wanted_since is not None,
            "streams_learning": sum(state.expected is None for state in self._reliable.values()),
            **self.counters.as_dict(),
            "refused_by_reason": dict(self.counters.refused),
            "board_stats": self.stats,
        }


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
