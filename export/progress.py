"""Progress of the long workstation steps: converting, the float reference, the fidelity check, training.

A step is one line. On a terminal the line stays live: its elapsed time ticks, and a counted step shows how far it
got (``320/450``), rewritten in place. When stderr is not a terminal (CI, a log file), each step prints one plain
line and counts are left out, so logs stay readable. The device side never uses this.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress", "Silent"]

TICK_S = 0.5


class Progress:
    """``progress("converting")`` starts a step; ``progress.count(done, total)`` reports inside it."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        # -q (or --log-level warning) silences progress like the info lines it stands beside
        self.enabled = stream is not None or logging.getLogger("edgeline").isEnabledFor(logging.INFO)
        self.started = time.perf_counter()
        self._line = ""
        self._count = ""
        self._step_started = self.started
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def __call__(self, line: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._finish_line()
            self._line, self._count, self._step_started = line, "", time.perf_counter()
            if self.live:
                self._draw()
                self._start_ticker()
            else:
                self.stream.write(f"[{self._elapsed():6.1f}s] {line}\n")
                self.stream.flush()

    def count(self, done: int, total: int) -> None:
        if not self.live or not self.enabled:
            return
        with self._lock:
            self._count = f"{done}/{total}"
            self._draw()

    def close(self) -> None:
        """End the live line (the next output starts on a fresh line). Safe to call twice."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2 * TICK_S)
        with self._lock:
            self._finish_line()
            self._line = ""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _elapsed(self) -> float:
        return time.perf_counter() - self.started

    def _draw(self) -> None:
        step = time.perf_counter() - self._step_started
        detail = f"  {self._count}" if self._count else ""
        self.stream.write(f"\r\033[K[{self._elapsed():6.1f}s] {self._line}{detail}  ({step:.0f} s)")
        self.stream.flush()

    def _finish_line(self) -> None:
        if self.live and self._line:
            self.stream.write("\n")
            self.stream.flush()

    def _start_ticker(self) -> None:
        if self._ticker is not None:
            return

        def tick() -> None:
            while not self._stop.wait(TICK_S):
                with self._lock:
                    if self._line:
                        self._draw()

        self._ticker = threading.Thread(target=tick, name="edgeline-progress", daemon=True)
        self._ticker.start()


class Silent(Progress):
    """Reports nothing (library use, tests)."""

    def __init__(self) -> None:
        super().__init__(stream=sys.stderr, live=False)
        self.enabled = False
