"""A relay that breaks a board's serial link on purpose, frame by frame, and counts what it did.

``FrameRelay`` sits between a board's UART (a ``socket://127.0.0.1:PORT`` URL: QEMU's serial server or a
``PythonBoard``) and a host (``edgeline run --serial``, ``edgeline bridge``), on a loopback port of its own. It cuts
the board's byte stream at the ``0x00`` delimiters and, on request, damages the next ``SAMPLES`` frames:

    garbage(n)   n runs of random bytes, each ending with a delimiter: n refused frames
    flip(n)      one bit of each of the next n SAMPLES frames' payload flipped, the frame re-encoded: n CRC errors
    drop(n)      the next n SAMPLES frames left out: n sequence gaps
    split(n)     the next n SAMPLES frames written a few bytes at a time: nothing to count, nothing lost
    merge(n)     the next n SAMPLES frames written in one piece: nothing to count, nothing lost
    unplug(s)    the host's connection closed and refused for s seconds; the board's frames meanwhile are lost

``injected`` counts each fault done, ``lost_unplugged`` the frames lost while unplugged. Everything is bounded: each
thread ends at ``close()``, every wait has a timeout.

Boards written out by hand, for what no honest emulated board does:

    GoBackBoard   a reliable go-back-N board without I/O whose HELLO may leave out "seq", and whose first sending of
                  chosen frames is damaged (a CRC error) or out of order
    PtyPeer       any such board object on a pseudo-terminal, reading and writing independently (as a UART's two
                  lines), its reading paced like a UART's if asked
    damaged       a frame as the wire would carry it with a bit flipped: a CRC error
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import socket
import struct
import threading
import time
import tty
import zlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
from cobs import cobs

from edgeline.firmware_bridge.protocol import (
    CRC_SIZE,
    FLAG_ACK_REQUESTED,
    HEADER,
    SEQ_MODULO,
    Decoder,
    Frame,
    FrameType,
    encode,
    unpack_ack,
)

__all__ = ["FrameRelay", "GoBackBoard", "PtyPeer", "damaged"]

HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 10.0


def _is_samples(packet: bytes) -> bool:
    try:
        body = cobs.decode(packet)
    except cobs.DecodeError:
        return False
    return len(body) >= HEADER.size and body[1] == FrameType.SAMPLES


def _header(packet: bytes) -> tuple[int, int, int]:
    body = cobs.decode(packet)
    _, kind, _, stream, seq, _ = HEADER.unpack_from(body)
    return kind, stream, seq


class FrameRelay:
    def __init__(self, board_url: str, *, seed: int = 0):
        host, _, port = board_url.removeprefix("socket://").rpartition(":")
        self.board_address = (host, int(port))
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.lost_unplugged = 0
        self.lost_frames: list[tuple[int, int, int]] = []
        """(type, stream, seq) of each frame lost while unplugged."""
        self.frames_passed = 0
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._plugged = threading.Event()
        self._plugged.set()
        self._host: socket.socket | None = None
        self._board: socket.socket | None = None
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.url = f"socket://{HOST}:{self.port}"
        self._threads: list[threading.Thread] = []

    # -- faults ------------------------------------------------------------------------------------------------
    def garbage(self, n: int = 1) -> None:
        with self._lock:
            self._pending["garbage"] += n

    def flip(self, n: int = 1) -> None:
        with self._lock:
            self._pending["flip"] += n

    def drop(self, n: int = 1) -> None:
        with self._lock:
            self._pending["drop"] += n

    def split(self, n: int = 1) -> None:
        with self._lock:
            self._pending["split"] += n

    def merge(self, n: int = 2) -> None:
        with self._lock:
            self._pending["merge"] += n

    def unplug(self, seconds: float) -> None:
        """Close the host's side now and refuse it for ``seconds`` (blocks that long)."""
        # counted first: from here on, a frame ``_write`` finds no host for is one the unplug lost (counted after
        # closing the host, a frame dropped in between went uncounted: a sequence gap the test did not expect)
        self.injected["unplug"] += 1
        self._plugged.clear()
        with self._lock:  # the port is gone: connecting is refused, as opening a missing tty fails
            self._listener.close()
        host, self._host = self._host, None
        if host is not None:
            with contextlib.suppress(OSError):
                host.shutdown(socket.SHUT_RDWR)
            host.close()
        time.sleep(seconds)
        with self._lock:
            self._listener = socket.create_server((HOST, self.port))
            self._listener.settimeout(0.1)
        self._plugged.set()

    def pending(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> str:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                self._board = socket.create_connection(self.board_address, timeout=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._board.settimeout(0.1)
        for target in (self._accept, self._from_board):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self.url

    def close(self) -> None:
        self._closing.set()
        for thread in self._threads:
            thread.join(5.0)
        for sock in (self._host, self._board, self._listener):
            if sock is not None:
                sock.close()

    def __enter__(self) -> FrameRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- threads -----------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                listener = self._listener
            try:
                conn, _ = listener.accept()
            except OSError:  # a timeout, or unplugged (the listener closed under us)
                if not self._plugged.is_set():
                    time.sleep(0.05)
                continue
            if not self._plugged.is_set() or self._host is not None:
                conn.close()  # unplugged: the port is not there
                continue
            conn.settimeout(0.1)
            self._host = conn
            thread = threading.Thread(target=self._from_host, args=(conn,), daemon=True)
            thread.start()

    def _from_host(self, conn: socket.socket) -> None:
        assert self._board is not None
        while not self._closing.is_set() and self._host is conn:
            try:
                data = conn.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset by the host (killed): the port is free for the next one
                data = b""
            if not data:
                if self._host is conn:
                    self._host = None
                return
            with contextlib.suppress(OSError):
                self._board.sendall(data)

    def _from_board(self) -> None:
        assert self._board is not None
        buffer = bytearray()
        merged: list[bytes] = []
        while not self._closing.is_set():
            try:
                data = self._board.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buffer += data
            while (end := buffer.find(b"\x00")) >= 0:
                packet = bytes(buffer[:end])
                del buffer[: end + 1]
                if packet:
                    self._forward(packet, merged)

    def _forward(self, packet: bytes, merged: list[bytes]) -> None:
        with self._lock:
            fault = None
            if _is_samples(packet):
                fault = next((f for f in ("garbage", "drop", "flip", "split", "merge") if self._pending[f] > 0), None)
                if fault is not None:
                    self._pending[fault] -= 1
        if fault == "drop":
            self.injected["drop"] += 1
            return
        if fault == "garbage":  # a run of junk before this frame, then the frame itself, whole
            # 0xFF announces 254 bytes before the next zero and fewer follow: never a valid COBS frame
            junk = b"\xff" + bytes(self.rng.randrange(1, 256) for _ in range(self.rng.randrange(3, 40)))
            self._write(junk + b"\x00")
            self.injected["garbage"] += 1
        if fault == "flip":
            body = bytearray(cobs.decode(packet))
            at = HEADER.size + self.rng.randrange(len(body) - HEADER.size - CRC_SIZE)  # in the payload
            body[at] ^= 1 << self.rng.randrange(8)
            packet = cobs.encode(bytes(body))
            self.injected["flip"] += 1
        wire = packet + b"\x00"
        if fault == "split":
            self.injected["split"] += 1
            for start in range(0, len(wire), 7):
                self._write(wire[start : start + 7])
                time.sleep(0.002)
            return
        if fault == "merge":
            merged.append(wire)
            with self._lock:
                more = self._pending["merge"] > 0
            if more:
                return
            self.injected["merge"] += len(merged)
            wire = b"".join(merged)
            merged.clear()
        self._write(wire)

    def _write(self, data: bytes) -> None:
        host = self._host
        if host is None or not self._plugged.is_set():
            if self.injected["unplug"]:  # before the host's first connection nothing is lost: it had not started
                self.lost_unplugged += data.count(b"\x00")
                self.lost_frames.extend(_header(p) for p in data.split(b"\x00")[:-1])
            return
        try:
            host.sendall(data)
            self.frames_passed += data.count(b"\x00")
        except OSError:
            self.lost_unplugged += data.count(b"\x00")


# -- boards written out by hand ------------------------------------------------------------------------------------


def damaged(frame: Frame) -> bytes:
    """``frame`` on the wire with a CRC that does not match its bytes: what a bit flipped on the wire makes."""
    body = HEADER.pack(1, frame.type, frame.flags, frame.stream, frame.seq, frame.t_us) + frame.payload
    return cobs.encode(body + struct.pack("<I", zlib.crc32(body) ^ 1)) + b"\x00"


class GoBackBoard:
    """A reliable board without I/O, to the letter of docs/firmware-protocol.md's Sessions section: one data stream
    (1, ``digits``, f32 ``[1, 8, 8]``), a window of ``window`` frames kept until acknowledged, the whole window sent
    again, in order, right after a HELLO it was asked for and when the caller says its resend timeout passed
    (``resend``). It says nothing until the host's first HELLO_REQUEST (it booted before the host opened the port).

    What an unlucky or odd board does, on the *first* sending of a frame only: ``damaged`` seqs go out with a CRC
    error, and the first window goes out in ``order`` (seqs listed first, in that order). ``say_seq`` puts the
    optional ``"seq"`` in its HELLO; ``boot`` its ``"boot"``. ``acked`` is what the host acknowledged, ``answered``
    the ANSWER frames per seq."""

    def __init__(
        self, count: int, *, say_seq: bool, damaged: Iterable[int] = (), order: Iterable[int] = (), window: int = 8,
        device: str = "gb-1",
    ) -> None:  # fmt: skip
        self.count, self.say_seq, self.window_size, self.device = count, say_seq, window, device
        self.damaged, self.order = set(damaged), list(order)
        self.payload = np.arange(64, dtype="<f4").tobytes()
        self.acked: set[int] = set()
        self.answered: Counter[int] = Counter()
        self.hello_requests = 0
        self.started = False
        self._window: list[Frame] = []
        self._next = 0
        self._control_seq = 0
        self.clock_us = 1000

    @property
    def done(self) -> bool:
        return self._next >= self.count and not self._window

    def take(self, frames: Iterable[Frame]) -> bytes:
        """The host's frames in, the board's bytes out."""
        out = []
        for frame in frames:
            if frame.type == FrameType.HELLO_REQUEST:
                self.hello_requests += 1
                self.started = True
                out.append(self._hello())
                out += [encode(held) for held in self._window]
            elif frame.type == FrameType.ACK and len(frame.payload) == 3:
                stream, seq = unpack_ack(frame.payload)
                while stream == 1 and self._window and (seq - self._window[0].seq) % SEQ_MODULO < SEQ_MODULO // 2:
                    self.acked.add(self._window.pop(0).seq)
            elif frame.type == FrameType.ANSWER:
                self.answered[frame.seq] += 1
        if self.started:
            out += self._fill()
        return b"".join(out)

    def resend(self) -> bytes:
        """The resend timeout: the whole window again, in order (go-back-N)."""
        return b"".join(encode(held) for held in self._window)

    def _fill(self) -> list[bytes]:
        new = []
        while self._next < self.count and len(self._window) + len(new) < self.window_size:
            self.clock_us += 1000
            new.append(Frame(FrameType.SAMPLES, 1, self._next, self.clock_us, self.payload, FLAG_ACK_REQUESTED))
            self._next += 1
        self._window += new
        first = {seq: rank for rank, seq in enumerate(self.order)}
        new.sort(key=lambda f: first.get(f.seq, len(first) + f.seq))
        out = [damaged(f) if f.seq in self.damaged else encode(f) for f in new]
        self.damaged -= {f.seq for f in new}
        return out

    def _hello(self) -> bytes:
        stream: dict[str, object] = {"id": 1, "name": "digits", "dtype": "f32", "shape": [1, 8, 8], "rate_hz": 100}
        if self.say_seq:
            stream["seq"] = self._window[0].seq if self._window else self._next
        hello = {"device": self.device, "firmware": "go-back", "protocol": 1, "streams": [stream]}
        self.clock_us += 1000
        frame = Frame(FrameType.HELLO, 0, self._control_seq, self.clock_us, json.dumps(hello).encode())
        self._control_seq = (self._control_seq + 1) % SEQ_MODULO
        return encode(frame)


class PtyPeer:
    """A board object (``take(frames) -> bytes``, optionally ``resend() -> bytes``) on the master side of a
    pseudo-terminal, served by a thread that reads and writes independently, as a UART's two lines are; the host
    opens ``url`` (the slave's path). ``read_bytes_per_s`` bounds how fast the board reads its port (a UART's pace:
    what the host writes faster waits in the pty's buffer, then in the host's queue); ``resend_s`` is the board's
    resend timeout, counted from the last byte it sent or read. ``send`` queues bytes of the test's own. Every wait
    is bounded; ``close`` ends the thread."""

    def __init__(
        self, board: Any, *, read_bytes_per_s: float | None = None, resend_s: float | None = None
    ) -> None:  # fmt: skip
        self.board = board
        self.read_bytes_per_s = read_bytes_per_s
        self.resend_s = resend_s
        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)
        os.set_blocking(self.master, False)
        self.url = os.ttyname(self.slave)
        self.received: list[Frame] = []
        self.bytes_read = 0
        self.lock = threading.Lock()
        """Held while the board object is used: a test that looks at it takes it too."""
        self._out = bytearray()
        self._decoder = Decoder()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, data: bytes) -> None:
        with self.lock:
            self._out += data

    def unsent(self) -> int:
        with self.lock:
            return len(self._out)

    def _serve(self) -> None:
        quiet_since = next_read = time.monotonic()
        rate = self.read_bytes_per_s
        chunk = 4096 if rate is None else max(1, min(4096, int(rate * 0.01)))
        while not self._closing.is_set():
            now = time.monotonic()
            with self.lock:
                writing = bool(self._out)
            readable, writable, _ = select.select(
                [self.master] if now >= next_read else [], [self.master] if writing else [], [], 0.01
            )
            data = b""
            if readable:
                try:
                    data = os.read(self.master, chunk)
                except OSError:  # no host has the pty open right now
                    self._closing.wait(0.01)
                if data and rate is not None:
                    next_read = now + len(data) / rate
            frames = self._decoder.feed(data)
            with self.lock:
                if writable:
                    with contextlib.suppress(OSError):  # (BlockingIOError: no room after all)
                        del self._out[: os.write(self.master, self._out)]
                self.bytes_read += len(data)
                self.received += frames
                out = self.board.take(frames)
                if not out and self.resend_s is not None and time.monotonic() - quiet_since > self.resend_s:
                    out = self.board.resend()
                if out or data:
                    quiet_since = time.monotonic()
                self._out += out

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5.0)
        os.close(self.master)
        os.close(self.slave)

    def __enter__(self) -> PtyPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
