"""One writer at a time: the lock every command that writes a repository (or a keys directory) holds while it reads
what is there and writes what comes next.

    REPO/.edgeline.lock    held by publish, publish --refresh, publish --remove, each step of a rollout that signs
                           (a wave, a halt), keys renew --repo and keys rotate --repo
    KEYS/.edgeline.lock    held by whatever writes the keys directory: keys generate, renew, rotate, and every
                           signing (it records what it signed there: ``edgeline.updates.highwater``)

An exclusive ``flock`` on the file, taken without waiting first; when another process holds it, tried again for
``wait_s`` (60 s by default), then refused with one line that says who holds it: the holder writes its pid, host,
command and start time into the file when it takes the lock. The lock goes with the process (a kill -9 leaves the
text, not the lock). Locks are held in a fixed order, the repository's before the keys', and are reentrant within a
thread (a rotation with ``--repo`` holds both while it writes the root and re-signs); another thread of the same
process waits like another process.

The file is opened ``O_NOFOLLOW|O_NONBLOCK`` and must be a regular file: a link or a FIFO planted there is refused
by name (``WriteRefused``), never followed or waited on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from edgeline.durable import WriteRefused, kind_of
from edgeline.errors import UpdateError

__all__ = ["LOCK_FILE", "LOCK_WAIT_S", "locked"]

LOCK_FILE = ".edgeline.lock"
LOCK_WAIT_S = 60.0
"""How long a writer waits for another to finish: longer than a publish of a large bundle takes."""
_POLL_S = 0.1
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_MAX_HOLDER_BYTES = 4096


class _Held:
    """A lock this thread holds, and how many ``locked`` blocks of it are open (reentrance)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.depth = 1


_held: dict[tuple[Path, int], _Held] = {}
_guard = threading.Lock()


def _refuse(path: Path, mode: int) -> WriteRefused:
    return WriteRefused(
        f"{path} is {kind_of(mode)}, not the lock file edgeline makes: remove it once you know how it got there (it "
        "may have been planted)"
    )


def _open(path: Path) -> int:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(mode):  # never opened: opening a device may act on it
            raise _refuse(path, mode)
    try:
        fd = os.open(path, _OPEN_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, stat.S_IFLNK) from exc
        raise UpdateError(f"{path}: cannot be opened to lock it ({exc.strerror or exc})") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(path, mode)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, as the holder wrote it."""
    try:
        data = os.pread(fd, _MAX_HOLDER_BYTES, 0)
        said = json.loads(data)
        return (
            f"pid {int(said['pid'])} on {str(said['host'])[:64]} ({str(said['command'])[:300]}), since "
            f"{str(said['since'])[:32]}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not say who it is"


def _say_who(fd: int) -> None:
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["python"]
    said = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": shlex.join(argv)[:300],
        "since": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(said) + "\n").encode(), 0)


def _same_file(fd: int, path: Path) -> bool:
    """The file locked is still the one at ``path`` (not removed and made again by another writer meanwhile)."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _acquire(path: Path, wait_s: float, what: str) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise UpdateError(
                    f"{path}: {what} is being written by {holder}; waited {wait_s:g} s: run this again once it is "
                    "done (a lock is released when its process ends)"
                ) from None
            time.sleep(_POLL_S)
            continue
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            _say_who(fd)
            return fd
        os.close(fd)  # locked a file that was replaced meanwhile: lock the one there now
        if time.monotonic() >= deadline:
            raise UpdateError(f"{path}: replaced again and again while {what} was being locked; waited {wait_s:g} s")


@contextlib.contextmanager
def locked(directory: Path, *, what: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold ``directory``'s lock (``directory/.edgeline.lock``) for the block; ``what`` names the directory in the
    refusal ("the repository", "the keys directory"). Reentrant within a thread; another thread of this process
    waits for it as another process does (``flock`` locks an open file, not a process)."""
    path = directory / LOCK_FILE
    key = (path, threading.get_ident())
    with _guard:
        held = _held.get(key)
        if held is not None:
            held.depth += 1
    if held is None:
        fd = _acquire(path, wait_s, what)
        with _guard:
            held = _held[key] = _Held(fd)
    try:
        yield
    finally:
        with _guard:
            held.depth -= 1
            done = held.depth == 0
            if done:
                del _held[key]
        if done:
            os.close(held.fd)  # the lock goes with the descriptor; its text stays, said again by the next holder
