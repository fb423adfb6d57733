"""A board's serial port, the I/O side of ``BoardLink``: opened by one program at a time, read and written without
ever waiting long.

``open_port`` opens a pyserial URL (``/dev/ttyACM0``, ``/dev/pts/3``, ``socket://``, ``rfc2217://``, ``loop://``)
exclusively: a device file is locked with ``flock`` (pyserial's ``exclusive=True``, as picocom and pyserial's
miniterm do) before anything about it changes, so a second program that opens the same port (a second bridge, a
daemon beside a bridge, a terminal program) is refused (an ``EdgelineError`` naming the holder when ``/proc/locks``
tells) instead of splitting the board's frames with the first. Network URLs have one client by nature and open as
before. Locks are advisory: a program that does not ask for one (``cat /dev/ttyACM0``) is not kept out.

``reader`` and ``writer`` read and write an open port in bounded time (see each)."""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Callable
from typing import Any

from edgeline.errors import EdgelineError
from edgeline.firmware_bridge.protocol import MAX_ENCODED
from edgeline.lograte import shown

__all__ = ["FRAME_WRITE_TURNS", "holder", "open_port", "reader", "write_timeout_s", "writer"]

READ_TIMEOUT_S = 0.05
READ_CHUNK = 65536
FRAME_WRITE_TURNS = 8
"""A board that reads, however slowly, has one frame at most this many write timeouts to take it."""
_BUSY = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES}
"""What ``flock(LOCK_EX | LOCK_NB)`` fails with when another open file holds the lock."""


class _PortBusy(EdgelineError):
    """The port is open in another program (or another link of this one), which holds its lock. (Private: the link
    takes it, waits and tries again; anyone else sees an ``EdgelineError`` that says who holds the port.)"""

    def __init__(self, url: str, held_by: str | None) -> None:
        self.url = url
        self.held_by = held_by
        who = held_by if held_by is not None else "another program (it holds the port's lock)"
        super().__init__(f"serial {url} is held by {who}: a port is read by one program at a time")


def write_timeout_s(baudrate: int) -> float:
    """How long a port may take no byte of a frame: twice the largest frame's time on the wire, at least 1 s. A board
    whose port takes nothing for that long does not read it (one that reads, however slowly, is given
    ``FRAME_WRITE_TURNS`` times this for the whole frame)."""
    return max(1.0, 2 * MAX_ENCODED * 10 / baudrate)


def open_port(url: str, *, baudrate: int, write_timeout: float) -> Any:
    """The open port (a pyserial object); ``_PortBusy`` when another program holds it, ``EdgelineError`` naming the URL
    for anything else."""
    import serial

    try:
        return serial.serial_for_url(url, baudrate=baudrate, timeout=0, write_timeout=write_timeout, exclusive=True)
    except serial.SerialException as exc:
        if exc.errno in _BUSY and "lock" in str(exc):  # pyserial: "Could not exclusively lock port ..."
            raise _PortBusy(url, holder(url)) from exc
        raise EdgelineError(f"serial {url}: {exc}") from exc
    except (ValueError, OSError) as exc:
        raise EdgelineError(f"serial {url}: {exc}") from exc


def holder(path: str, locks: str = "/proc/locks") -> str | None:
    """Who holds the ``flock`` of the device file ``path``, as ``pid N (its command line)``, from ``/proc/locks``; None
    where that cannot be told (no such file, not Linux, a holder in another PID namespace)."""
    try:
        status = os.stat(path)
        with open(locks, encoding="ascii", errors="replace") as file:
            table = file.read(1 << 20)  # bounded: one line per lock on the machine
    except OSError:
        return None
    wanted = (os.major(status.st_dev), os.minor(status.st_dev), status.st_ino)
    for line in table.splitlines():
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:3 0 EOF"; a waiter's line has "->" first
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            where, pid = (int(major, 16), int(minor, 16), int(inode)), int(fields[4])
        except ValueError:
            continue
        if where == wanted:
            return f"pid {pid} ({'this process' if pid == os.getpid() else _program(pid)})"
    return None


def _program(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            words = file.read(4096).rstrip(b"\x00").split(b"\x00")
    except OSError:
        return "its program not known"
    return shown(b" ".join(words), 160) or "its program not known"


def reader(port: Any) -> Callable[[], bytes]:
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


def writer(port: Any, timeout_s: float) -> Callable[[bytes], bool]:
    """A function that writes bytes to the port; False when the port took no byte for ``timeout_s`` (a board that
    does not read: its buffer, or the pty's, is full), or not all of them in ``FRAME_WRITE_TURNS`` times that (a
    trickle). A board that reads slowly, or an emulated one a busy machine runs late, is not taken for a deaf one.

    With a file descriptor, a ``select`` for room then a non-blocking write, as ``reader``: pyserial's own write
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


def closed(data: bytes) -> bool:
    """The writer of a port that is not open: nothing written."""
    raise OSError("the port is not open")


def _fileno(port: Any) -> int | None:
    try:
        fd = port.fileno()
    except Exception:  # a URL handler without one (pyserial raises NotImplementedError or AttributeError)
        return None
    return fd if isinstance(fd, int) else None
