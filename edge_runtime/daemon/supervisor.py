"""The supervisor: owns the daemon's threads and says whether the pipeline is alive.

A failure while handling one message is that message's coded answer (``Processor``); nothing that reaches a
thread's top is expected. If something does (a bug of ours), the supervisor logs it once with its traceback and
marks the process failed: the daemon then stops and exits non-zero, so systemd (``Restart=on-failure``) starts a
fresh one instead of leaving a process that looks alive but is deaf.

The systemd watchdog is fed only while the pipeline works: no thread has died, and the worker either finished
something since the last tick or had nothing to do. A worker stuck in a model call stops the pings, and systemd
restarts the service after ``WatchdogSec``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["Progress", "Supervisor"]

log = logging.getLogger("edgeline.supervisor")


class Progress:
    """What the worker is doing: ``begin`` when it takes work, ``done`` when that work is answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._completed = 0
        self._busy_since: float | None = None

    def begin(self) -> None:
        with self._lock:
            self._busy_since = time.monotonic()

    def done(self) -> None:
        with self._lock:
            self._completed += 1
            self._busy_since = None

    def snapshot(self) -> tuple[int, float | None]:
        """(work items completed so far, monotonic time the current item started or None when idle)."""
        with self._lock:
            return self._completed, self._busy_since


class Supervisor:
    def __init__(self) -> None:
        self.failed = threading.Event()
        self.failure: str | None = None
        self.progress = Progress()
        self._threads: list[threading.Thread] = []
        self._last_completed = -1

    def spawn(self, name: str, target: Callable[[], None]) -> threading.Thread:
        """Start ``target`` on a daemon thread named ``name``; an exception escaping it fails the process."""

        def guarded() -> None:
            _name_os_thread(name)
            try:
                target()
            except BaseException as exc:  # a bug of ours: say so once, with the traceback, and stop
                log.critical("thread %s died: %s: %s", name, type(exc).__name__, exc, exc_info=True)
                self.fail(f"thread {name} died ({type(exc).__name__}: {exc})")

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.failed.set()

    def healthy(self) -> bool:
        """For the watchdog tick: no failure, and the worker progressed since the last call or is idle."""
        if self.failed.is_set():
            return False
        completed, busy_since = self.progress.snapshot()
        moved = completed != self._last_completed
        self._last_completed = completed
        return moved or busy_since is None


_PR_SET_NAME = 15


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the kernel too (Linux: 15 bytes), so ``top -H`` and ``ps -L`` show
    which of the daemon's threads uses the CPU. Python 3.11 names only its own thread objects."""
    if not sys.platform.startswith("linux"):
        return
    # The process's own symbols, libc's among them (ctypes.util.find_library would run ldconfig per thread).
    # No prctl to call: the name is a convenience only.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
