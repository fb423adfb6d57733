"""Repeated conditions logged when they start, summarised at most every ``every_s``, and when they end: the one log
throttle of edgeline (the daemon, the update agent, the firmware bridge).

A daemon left alone for months meets the same condition many times a second (an outbox at its cap, a broker
away, a full disk): one line per occurrence would fill an SD card. ``Repeated`` says when the condition starts,
a summary with counts at most once per ``every_s`` while it lasts, and when it has not happened for ``every_s``,
that it ended (``tick`` notices that; the daemon's status thread calls it).

A condition may come in kinds, each its own episode, told apart by a ``key``: the update agent's check that keeps
ending the same way (a tampered archive on a USB stick, a repository out of reach) is one kind per message. With
``every_s=math.inf`` an episode never ends nor is summarised: said once, counted every time. ``remember`` bounds
the kinds kept (the oldest is forgotten first, and said again if it comes back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["SHOWN_MAX", "SUMMARY_EVERY_S", "Repeated", "shown"]

SUMMARY_EVERY_S = 60.0
SHOWN_MAX = 200
"""Characters of an outsider's text a log line quotes, at most."""


def shown(text: object, limit: int = SHOWN_MAX) -> str:
    """Text someone outside the process wrote (a board's LOG line, its HELLO's ``firmware``, a payload), as a log
    line may quote it: one line whatever it holds, every character that is not printable escaped as ``\\xNN`` (a
    newline cannot start a forged ``CRITICAL`` line, an escape sequence cannot repaint a terminal), at most ``limit``
    characters of it, and the number cut said. Bytes are read as UTF-8, undecodable bytes escaped too."""
    if isinstance(text, bytes | bytearray | memoryview):
        text = bytes(text).decode("utf-8", errors="backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    cut = len(text) - limit
    head = text[:limit] if cut > 0 else text
    out = "".join(c if c.isprintable() else _escaped(c) for c in head)
    return out + (f"... ({cut} more characters)" if cut > 0 else "")


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


@dataclass
class _Episode:
    label: str
    since: float
    last_event: float
    last_line: float
    count: int = 0
    unsaid: int = 0


class Repeated:
    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        level: int = logging.WARNING,
        every_s: float = SUMMARY_EVERY_S,
        remember: int = 1,
    ):
        self.logger = logger
        self.what = what
        self.level = level
        self.every_s = every_s
        self.remember = remember
        self.total = 0
        """Occurrences (summed counts) since the start of the process."""
        self.lines = 0
        """Log lines written: what a month of this condition costs the journal."""
        self._lock = threading.Lock()
        self._episodes: dict[Hashable, _Episode] = {}  # by key, oldest first

    @property
    def active(self) -> bool:
        return bool(self._episodes)

    def happened(
        self,
        count: int,
        detail: str,
        *,
        key: Hashable = None,
        level: int | None = None,
        exc_info: bool = False,
    ) -> bool:
        """``count`` occurrences now (of the kind ``key``); ``detail`` says what, in the first line of an episode,
        at ``level`` (the condition's, by default). Returns whether this started an episode (and was said)."""
        now = time.monotonic()
        with self._lock:
            self.total += count
            episode = self._episodes.get(key)
            if episode is None:
                label = self.what if key is None or not self.what else f"{self.what} ({key})"
                self._episodes[key] = _Episode(label or str(key), now, now, now, count)
                while len(self._episodes) > max(1, self.remember):
                    del self._episodes[next(iter(self._episodes))]
                self._say(self.level if level is None else level, "%s: %s" if self.what else "%s%s", self.what,
                          detail, exc_info=exc_info)  # fmt: skip
                return True
            episode.count += count
            episode.unsaid += count
            episode.last_event = now
            if now - episode.last_line >= self.every_s:
                self._summary(episode, now)
            return False

    def tick(self) -> None:
        """Periodic: a summary that is due, or the end of an episode that has been quiet for ``every_s``."""
        now = time.monotonic()
        with self._lock:
            for key, episode in list(self._episodes.items()):
                if now - episode.last_event >= self.every_s:
                    del self._episodes[key]
                    self._say(
                        self.level, "%s: over (%d in %.0f s; %d since the process started)", episode.label,
                        episode.count, episode.last_event - episode.since, self.total,
                    )  # fmt: skip
                elif episode.unsaid and now - episode.last_line >= self.every_s:
                    self._summary(episode, now)

    def _summary(self, episode: _Episode, now: float) -> None:
        self._say(self.level, "%s: %d more in the last %.0f s (%d since it started)", episode.label, episode.unsaid,
                  now - episode.last_line, episode.count)  # fmt: skip
        episode.unsaid = 0
        episode.last_line = now

    def _say(self, level: int, text: str, *args: object, exc_info: bool = False) -> None:
        self.lines += 1
        self.logger.log(level, text, *args, exc_info=exc_info)
