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
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections import Counter

from cobs import cobs

from edgeline.firmware_bridge.protocol import CRC_SIZE, HEADER, FrameType

__all__ = ["FrameRelay"]

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
        self._plugged.clear()
        with self._lock:  # the port is gone: connecting is refused, as opening a missing tty fails
            self._listener.close()
        host, self._host = self._host, None
        if host is not None:
            with contextlib.suppress(OSError):
                host.shutdown(socket.SHUT_RDWR)
            host.close()
        self.injected["unplug"] += 1
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
