"""Subscriptions that hear nothing: a daemon listening where nobody publishes says so, once per silent spell."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from edgeline.daemon.topics import TopicFilter

__all__ = ["SilenceWatch"]


class SilenceWatch:
    """When each subscription last heard a message. ``heard`` runs on the source's thread (once per message, no
    lock: it only stores a float), ``newly_silent`` on another; a message ends a silent spell."""

    def __init__(
        self, filters: Sequence[TopicFilter], after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.after_s = after_s
        self._filters = tuple(filters)
        self._clock = clock
        now = clock()
        self._last = {topic_filter.pattern: now for topic_filter in self._filters}
        self._warned: dict[str, float] = {}  # pattern -> the ``_last`` of the spell it was reported for

    def heard(self, topic: str) -> None:
        if len(self._filters) == 1:
            self._last[self._filters[0].pattern] = self._clock()
            return
        for topic_filter in self._filters:
            if topic_filter.device(topic) is not None:
                self._last[topic_filter.pattern] = self._clock()

    def newly_silent(self) -> list[str]:
        """The subscriptions silent for ``after_s`` seconds or more that were not reported in this spell yet."""
        now = self._clock()
        silent = []
        for pattern, last in list(self._last.items()):
            if now - last >= self.after_s and self._warned.get(pattern) != last:
                self._warned[pattern] = last
                silent.append(pattern)
        return silent
