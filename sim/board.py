"""An emulated sensor board in Python: the same session as the C firmware (firmware_bridge/c/sensor_board.c) on a pty
or a loopback TCP port, for machines without QEMU and for demos.

Both boards follow docs/firmware-protocol.md, "Sessions": a HELLO at boot and for every HELLO_REQUEST; SAMPLES on
stream 1 at a rate, a bounded count of them, looping over the data; a HEARTBEAT every second followed by a LOG
``stats {json}``; ACK releases the reliable window, ANSWER is counted, CONFIG sets the rate and the stream on or off.
Reliable mode keeps ``WINDOW`` frames as sent, waits when the window is full and resends all of it (go-back-N) when
the oldest has waited ``RESEND_S``. The HELLO and the stats line are byte for byte the firmware's, so a host cannot
tell the boards apart but by timing.

``BoardSession`` is the board without I/O or clock (times are passed in): frames in, wire bytes out.
``PythonBoard`` runs one on a thread behind a transport. ``edgeline.sim.mcu.EmulatedBoard`` is the QEMU board.
"""

from __future__ import annotations

import enum
import json
import os
import re
import select
import socket
import termios
import threading
import time
import tty
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

from edgeline.errors import EdgelineError
from edgeline.firmware_bridge.protocol import (
    FLAG_ACK_REQUESTED,
    MAX_PAYLOAD,
    SEQ_MODULO,
    Decoder,
    Frame,
    FrameType,
    encode,
    pack_ack,
    unpack_ack,
)

__all__ = [
    "FIRMWARE",
    "HEARTBEAT_S",
    "RESEND_S",
    "WINDOW",
    "Board",
    "BoardOptions",
    "BoardSamples",
    "BoardSession",
    "PythonBoard",
    "Uart",
    "load_board_samples",
]

FIRMWARE = "edgeline-sensor-board 1"
DATA_STREAM = 1
WINDOW = 8
RESEND_S = 0.5
HEARTBEAT_S = 1.0
MAX_RATE_HZ = 100_000.0
SAMPLE_BUDGET = 512 * 1024
"""Bytes of samples a board carries (the firmware compiles them into flash): the first that fit are replayed."""
_DEVICE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_POLL_S = 0.05
_WRITE_TIMEOUT_S = 2.0
_PTY_FULL_S = 0.2
_STOP_TIMEOUT_S = 5.0


class Uart(str, enum.Enum):
    """Where a board's UART is: a loopback TCP port (``socket://127.0.0.1:PORT``) or a pseudo-terminal."""

    SOCKET = "socket"
    PTY = "pty"


@dataclass(frozen=True)
class BoardOptions:
    """What a board is and sends: its id, samples per second (three decimals: the firmware counts milli-hertz), how
    many, whether each asks to be acknowledged (reliable mode), and whether it never reads its RX line (``deaf``, as
    many sensor firmwares: what the host writes fills the port's buffer)."""

    device: str = "mcu-1"
    rate_hz: float = 10.0
    count: int = 100
    reliable: bool = False
    deaf: bool = False

    def __post_init__(self) -> None:
        if not _DEVICE_ID.fullmatch(self.device):
            raise EdgelineError(
                f"board device id {self.device!r}: 1 to 64 of letters, digits, '.', '_' and '-' (it is compiled into "
                "the firmware's HELLO)"
            )
        if not 0.001 <= self.rate_hz <= MAX_RATE_HZ:
            raise EdgelineError(f"--rate {self.rate_hz:g}: a board sends between 0.001 and {MAX_RATE_HZ:g} Hz")
        if abs(self.rate_hz * 1000 - round(self.rate_hz * 1000)) > 1e-6:
            raise EdgelineError(f"--rate {self.rate_hz!r}: a board's rate has at most three decimals (milli-hertz)")
        if not 1 <= self.count < 2**32:
            raise EdgelineError(f"--count {self.count}: between 1 and {2**32 - 1} samples")

    @property
    def rate_mhz(self) -> int:
        return round(self.rate_hz * 1000)


@dataclass(frozen=True)
class BoardSamples:
    """The samples a board replays, each as little-endian float32 bytes, and their shape."""

    samples: tuple[bytes, ...]
    shape: tuple[int, ...]
    source: str
    name: str = "digits"


def load_board_samples(data: Path | str | None, sensor: str = "digits") -> BoardSamples:
    """The samples at ``data`` (an .npz or a prepared directory, as ``edgeline sim``) as a board carries them."""
    import numpy as np

    from edgeline.sim.data import load_sensor_samples, resolve_model

    loaded = load_sensor_samples(data, resolve_model(sensor))
    x = np.ascontiguousarray(loaded.x, dtype="<f4")
    size = x[0].nbytes
    if size > MAX_PAYLOAD:
        raise EdgelineError(
            f"{loaded.source}: a sample of {size} bytes does not fit one frame ({MAX_PAYLOAD} bytes of payload)"
        )
    kept = x[: max(1, SAMPLE_BUDGET // size)]
    return BoardSamples(tuple(row.tobytes() for row in kept), tuple(x.shape[1:]), loaded.source, sensor)


@dataclass
class _Held:
    seq: int
    wire: bytes
    sent_at_us: int


@dataclass
class BoardSession:
    """One boot of a board: what it sends at boot, for each frame it receives and as time passes (``tick``). Pure:
    times are the board's clock in microseconds since boot, and everything it would send is returned as wire bytes."""

    options: BoardOptions
    data: BoardSamples
    sent: int = 0
    resent: int = 0
    acked: int = 0
    answers: int = 0
    hellos: int = 0
    refused: int = 0
    stream_on: bool = True
    boot_number: int = 0
    """This boot's number in the HELLO (``boot``): the firmware counts resets in RAM a reset leaves alone, so does
    ``PythonBoard``; a new board (a new emulator) starts at 0."""
    _rate_mhz: int = 0
    _control_seq: int = 0
    _data_seq: int = 0
    _next_sample_us: int = 0
    _last_heartbeat_us: int = 0
    _window: list[_Held] = field(default_factory=list)
    _answered: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._rate_mhz = self.options.rate_mhz

    @property
    def period_us(self) -> int:
        return 1_000_000_000 // self._rate_mhz

    @property
    def done(self) -> bool:
        return self.sent >= self.options.count and not self._window

    def boot(self, now_us: int) -> list[bytes]:
        """A delimiter, then the HELLO: a reset may have cut a frame short, and the host's decoder would take that
        half frame and the HELLO for one (broken) frame."""
        self._next_sample_us = self._last_heartbeat_us = now_us
        return [b"\x00", self._hello(now_us)]

    def stats(self) -> dict[str, int | bool]:
        """The counters of the stats LOG line, in its order."""
        return {
            "sent": self.sent,
            "resent": self.resent,
            "acked": self.acked,
            "answers": self.answers,
            "answered": len(self._answered),
            "hello": self.hellos,
            "refused": self.refused,
            "done": self.done,
        }

    def receive(self, frame: Frame, now_us: int) -> list[bytes]:
        out: list[bytes] = []
        if frame.type == FrameType.HELLO_REQUEST:
            out.append(self._hello(now_us))
            if self.options.reliable:
                out += self._resend(now_us)
        elif frame.type == FrameType.ACK:
            if len(frame.payload) == 3:
                stream, seq = unpack_ack(frame.payload)
                if stream == DATA_STREAM:
                    self._release(seq)
        elif frame.type == FrameType.ANSWER:
            self.answers += 1
            if frame.stream == DATA_STREAM:
                self._answered.add(frame.seq)
        elif frame.type == FrameType.CONFIG:
            out += self._configure(frame.payload, now_us)
        if frame.ack_requested and frame.type != FrameType.ACK:
            out.append(self._control(FrameType.ACK, now_us, pack_ack(frame.stream, frame.seq)))
        return out

    def tick(self, now_us: int) -> list[bytes]:
        out: list[bytes] = []
        if now_us - self._last_heartbeat_us >= HEARTBEAT_S * 1e6:
            self._last_heartbeat_us = now_us
            out.append(self._control(FrameType.HEARTBEAT, now_us))
            out.append(self._control(FrameType.LOG, now_us, b"stats " + json.dumps(self.stats()).encode()))
        if self.options.reliable and self._window and now_us - self._window[0].sent_at_us >= RESEND_S * 1e6:
            out += self._resend(now_us)
        window_open = not self.options.reliable or len(self._window) < WINDOW
        if self.sent < self.options.count and self.stream_on and now_us >= self._next_sample_us and window_open:
            out.append(self._sample(now_us))
            self._next_sample_us += self.period_us
            if self._next_sample_us + self.period_us < now_us:  # waited on a full window: no burst to catch up
                self._next_sample_us = now_us
        return out

    def next_due_us(self) -> int:
        """When ``tick`` next has something to do (a transport may sleep until then, or until a frame comes)."""
        due = self._last_heartbeat_us + int(HEARTBEAT_S * 1e6)
        if self.options.reliable and self._window:
            due = min(due, self._window[0].sent_at_us + int(RESEND_S * 1e6))
        window_open = not self.options.reliable or len(self._window) < WINDOW
        if self.sent < self.options.count and self.stream_on and window_open:  # a full window waits for an ACK
            due = min(due, self._next_sample_us)
        return due

    def _control(self, kind: FrameType, now_us: int, payload: bytes = b"") -> bytes:
        wire = encode(Frame(kind, 0, self._control_seq, now_us, payload))
        self._control_seq = (self._control_seq + 1) % SEQ_MODULO
        return wire

    def _hello(self, now_us: int) -> bytes:
        oldest = self._window[0].seq if self._window else self._data_seq
        stream = {"id": DATA_STREAM, "name": self.data.name, "dtype": "f32", "shape": list(self.data.shape),
                  "rate_hz": self._rate_mhz / 1000, "seq": oldest}  # fmt: skip
        hello = {"device": self.options.device, "firmware": FIRMWARE, "protocol": 1, "boot": self.boot_number,
                 "streams": [stream]}  # fmt: skip
        self.hellos += 1
        return self._control(FrameType.HELLO, now_us, json.dumps(hello).encode())

    def _sample(self, now_us: int) -> bytes:
        payload = self.data.samples[self.sent % len(self.data.samples)]
        flags = FLAG_ACK_REQUESTED if self.options.reliable else 0
        wire = encode(Frame(FrameType.SAMPLES, DATA_STREAM, self._data_seq, now_us, payload, flags))
        if self.options.reliable:
            self._window.append(_Held(self._data_seq, wire, now_us))
        self._data_seq = (self._data_seq + 1) % SEQ_MODULO
        self.sent += 1
        return wire

    def _resend(self, now_us: int) -> list[bytes]:
        for held in self._window:
            held.sent_at_us = now_us
        self.resent += len(self._window)
        return [held.wire for held in self._window]

    def _release(self, seq: int) -> None:
        while self._window and (seq - self._window[0].seq) % SEQ_MODULO < SEQ_MODULO // 2:
            self._window.pop(0)
            self.acked += 1

    def _configure(self, payload: bytes, now_us: int) -> list[bytes]:
        try:
            config = json.loads(payload)
        except ValueError:
            return []
        if not isinstance(config, dict):
            return []
        rate = config.get("rate_hz")
        if rate is not None:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.001 <= rate <= MAX_RATE_HZ:
                text = "config refused: rate_hz must be a number above 0 and at most 100000, with 3 decimals"
                return [self._control(FrameType.LOG, now_us, text.encode())]
            self._rate_mhz = int(rate * 1000 + 1e-6)
            self._next_sample_us = min(self._next_sample_us, now_us + self.period_us)  # a faster rate starts now
        streams = config.get("streams")
        if isinstance(streams, dict) and isinstance(streams.get(str(DATA_STREAM)), bool):
            self.stream_on = streams[str(DATA_STREAM)]
        return []


class Board(Protocol):
    """What the fault tests and ``edgeline sim mcu`` need of a board, emulated in QEMU or in Python."""

    description: str
    """What runs the board, for people: ``QEMU mps2-an386, Cortex-M4``, ``Python board``."""

    @property
    def url(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    def start(self) -> str:
        """Boot the board; its UART's pyserial URL (``socket://127.0.0.1:PORT`` or a pty's path)."""
        ...

    def reset(self) -> None:
        """Reboot the board: its session starts over (an unsolicited HELLO)."""
        ...

    def stop(self) -> None: ...


class PythonBoard:
    """A ``BoardSession`` on a thread behind a pty or a loopback TCP port (one host at a time, as QEMU's serial
    server; what the board sends with no host connected is lost, as on a UART with nothing attached)."""

    description = "Python board"

    def __init__(
        self, options: BoardOptions, data: Path | str | BoardSamples | None = None, uart: Uart = Uart.SOCKET
    ) -> None:
        self.options = options
        self.samples = data if isinstance(data, BoardSamples) else load_board_samples(data)
        self.uart = Uart(uart)
        self._url = ""
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._reset_asked = threading.Event()
        self._lock = threading.Lock()
        self._session: BoardSession | None = None
        self._listener: socket.socket | None = None
        self._client: socket.socket | None = None
        self._master = self._slave = -1
        self.error: BaseException | None = None
        """What stopped the board's thread, if anything but ``stop``."""

    @property
    def url(self) -> str:
        return self._url

    @property
    def session(self) -> BoardSession | None:
        """The current boot's session (its counters: ``stats()``)."""
        return self._session

    def listen(self) -> str:
        """Open the board's port without powering it: a host may open it (a TCP connection waits to be taken) before
        the board boots and streams (``start``). Its URL."""
        if self._listener is not None or self._master >= 0:
            return self._url
        if self.uart is Uart.PTY:
            self._master, self._slave = os.openpty()
            tty.setraw(self._slave)  # bytes as they are: no CR/LF translation, no echo
            os.set_blocking(self._master, False)
            self._url = os.ttyname(self._slave)
        else:
            self._listener = socket.create_server(("127.0.0.1", 0))
            self._url = f"socket://127.0.0.1:{self._listener.getsockname()[1]}"
        return self._url

    def start(self) -> str:
        if self._thread is not None:
            return self._url
        self.listen()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"board {self.options.device}", daemon=True)
        self._thread.start()
        return self._url

    def reset(self) -> None:
        self._reset_asked.set()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        thread.join(_STOP_TIMEOUT_S)
        for sock in (self._client, self._listener):
            if sock is not None:
                sock.close()
        self._client = self._listener = None
        for fd in (self._master, self._slave):
            if fd >= 0:
                os.close(fd)
        self._master = self._slave = -1

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> PythonBoard:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- the board's thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # kept for the caller (`alive` turns False): a thread has no one to raise to
            self.error = exc

    def _serve(self) -> None:
        boot = time.monotonic_ns()
        decoder = Decoder()
        boots = 0
        self._session = session = BoardSession(self.options, self.samples, boot_number=boots)
        self._write(session.boot(0))
        while not self._stopping.is_set():  # bounded by stop(): the board runs until its host stops it
            if self._reset_asked.is_set():
                self._reset_asked.clear()
                boot, decoder, boots = time.monotonic_ns(), Decoder(), boots + 1
                self._session = session = BoardSession(self.options, self.samples, boot_number=boots)
                self._write(session.boot(0))
            now = (time.monotonic_ns() - boot) // 1000
            wait_s = min(max(session.next_due_us() - now, 0) / 1e6, _POLL_S)
            if self.options.deaf and (self.uart is Uart.PTY or self._client is not None):
                self._stopping.wait(wait_s)  # it never reads: the host's bytes stay in the port's buffer, which fills
                data = b""
            else:
                data = self._read(wait_s)
            now = (time.monotonic_ns() - boot) // 1000
            for frame in decoder.feed(data):
                self._write(session.receive(frame, now))
            session.refused = sum(decoder.refused.values())
            self._write(session.tick(now))

    def _read(self, wait_s: float) -> bytes:
        if self.uart is Uart.PTY:
            ready, _, _ = select.select([self._master], [], [], wait_s)
            if not ready:
                return b""
            try:
                return os.read(self._master, 4096)
            except (BlockingIOError, OSError):
                return b""
        assert self._listener is not None
        waiting = self._client if self._client is not None else self._listener
        readable, _, _ = select.select([waiting], [], [], wait_s)
        if not readable:
            return b""
        if self._client is None:
            self._client, _ = self._listener.accept()
            self._client.settimeout(_WRITE_TIMEOUT_S)
            return b""
        try:
            data = self._client.recv(4096)
        except OSError:
            data = b""
        if not data:  # the host closed: wait for the next one
            self._client.close()
            self._client = None
        return data

    def _write(self, pieces: list[bytes]) -> None:
        if not pieces:
            return
        data = b"".join(pieces)
        if self.uart is Uart.PTY:
            self._write_pty(data)
        elif self._client is not None:
            try:
                self._client.sendall(data)
            except OSError:  # a host that stopped reading for seconds, or went: as if unplugged
                self._client.close()
                self._client = None

    def _write_pty(self, data: bytes) -> None:
        """Into the pty. A pty with no host holds a few kilobytes, then refuses more: after a short wait for room,
        what it holds is dropped (stale, as bytes a UART sends with nothing attached) to make room for ``data``."""
        view = memoryview(data)
        for _attempt in range(4 + len(data) // 512):  # bounded: a host reading slowly still gets it all
            _, ready, _ = select.select([], [self._master], [], _PTY_FULL_S)
            if not ready:
                termios.tcflush(self._slave, termios.TCIFLUSH)
                continue
            try:
                view = view[os.write(self._master, view) :]
            except BlockingIOError:
                continue
            if not view:
                return
