"""Repeated conditions logged when they start, summarised at most every ``every_s``, and when they end.

A daemon left alone for months meets the same condition many times a second (an outbox at its cap, a broker
away, a full disk): one line per occurrence would fill an SD card. ``Repeated`` says when the condition starts,
a summary with counts at most once per ``every_s`` while it lasts, and when it has not happened for ``every_s``,
that it ended (``tick`` notices that; the daemon's status thread calls it).
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["SUMMARY_EVERY_S", "Repeated"]

SUMMARY_EVERY_S = 60.0


class Repeated:
    def __init__(
        self, logger: logging.Logger, what: str, *, level: int = logging.WARNING, every_s: float = SUMMARY_EVERY_S
    ):
        self.logger = logger
        self.what = what
        self.level = level
        self.every_s = every_s
        self.total = 0
        """Occurrences (summed counts) since the start of the process."""
        self.lines = 0
        """Log lines written: what a month of this condition costs the journal."""
        self._lock = threading.Lock()
        self._active = False
        self._since = 0.0
        self._last_event = 0.0
        self._last_line = 0.0
        self._unsaid = 0
        self._episode = 0

    @property
    def active(self) -> bool:
        return self._active

    def happened(self, count: int, detail: str) -> None:
        """``count`` occurrences now; ``detail`` says what, in the first line of an episode."""
        now = time.monotonic()
        with self._lock:
            self.total += count
            self._episode += count
            self._last_event = now
            if not self._active:
                self._active, self._since, self._last_line = True, now, now
                self._unsaid = 0
                self._say("%s: %s", self.what, detail)
                return
            self._unsaid += count
            if now - self._last_line >= self.every_s:
                self._summary(now)

    def tick(self) -> None:
        """Periodic: a summary that is due, or the end of an episode that has been quiet for ``every_s``."""
        now = time.monotonic()
        with self._lock:
            if not self._active:
                return
            if now - self._last_event >= self.every_s:
                self._active = False
                self._say(
                    "%s: over (%d in %.0f s; %d since the process started)", self.what, self._episode,
                    self._last_event - self._since, self.total,
                )  # fmt: skip
                self._episode = 0
            elif self._unsaid and now - self._last_line >= self.every_s:
                self._summary(now)

    def _summary(self, now: float) -> None:
        self._say("%s: %d more in the last %.0f s (%d since it started)", self.what, self._unsaid,
                  now - self._last_line, self._episode)  # fmt: skip
        self._unsaid = 0
        self._last_line = now

    def _say(self, text: str, *args: object) -> None:
        self.lines += 1
        self.logger.log(self.level, text, *args)
