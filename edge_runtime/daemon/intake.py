"""The intake gate: a source that can wait is read no faster than the broker accepts the answers.

    level = inputs taken and not answered yet (queue, worker) + answers not accepted by the broker yet
            (on their way to the outbox, in it, in flight)
    open ──level ≥ high (or bytes ≥ high_bytes, or the disk is full)──► shut ──level ≤ low (and bytes)──► open

While the gate is shut the daemon takes no new input from a source that can wait (MQTT at QoS 1, a replay, a
simulation): MQTT inputs that still arrive (at most the broker's in-flight window for us: our Receive Maximum)
are held unacknowledged and taken, in order, once it opens; the broker keeps the rest of the backlog. A source on
its own thread waits in ``submit``. Sources that cannot wait (QoS 0, plain serial lines) do not pass through it:
for them the outbox's cap and its drop policy remain, every drop counted.

The marks: ``high`` is 90% of ``[outbox] max_answers`` (and of ``max_bytes``), so that what is already in the
pipeline when the gate shuts still fits under the cap; ``low`` is half of ``high``, so that the gate does not
flap (each shut lets the broker's window of answers drain before taking more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from edgeline.daemon.health import Metrics
from edgeline.daemon.lograte import Repeated

__all__ = ["IntakeGate"]

log = logging.getLogger("edgeline.daemon")


class IntakeGate:
    def __init__(
        self,
        level: Callable[[], tuple[int, int]],
        *,
        max_answers: int,
        max_bytes: int,
        disk_full: Callable[[], bool],
        metrics: Metrics,
    ):
        self._level = level
        self._disk_full = disk_full
        self.high = max(1, max_answers * 9 // 10)
        self.low = self.high // 2
        self.high_bytes = max(1, max_bytes * 9 // 10)
        self.low_bytes = self.high_bytes // 2
        self.metrics = metrics
        self._open = True
        self._lock = threading.Lock()
        self._shut_at = 0.0
        self.paused_s = 0.0
        """Seconds the gate has been shut, over the process's life (the current pause excluded)."""
        self.pauses = Repeated(log, "intake paused (flow control)", level=logging.INFO)

    @property
    def is_shut(self) -> bool:
        return not self._open

    def open(self) -> bool:
        """Whether an input may be taken now (any thread; cheap: a few counters are read)."""
        answers, size = self._level()
        full = self._disk_full()
        if self._open:
            if full or answers >= self.high or size >= self.high_bytes:
                with self._lock:
                    if self._open:
                        self._open = False
                        self._shut_at = time.monotonic()
                        self.metrics.count("intake_pauses")
                        why = (
                            "the disk is full"
                            if full
                            else (
                                f"{answers} answers ({size} bytes) wait for the broker; high-water mark {self.high} "
                                f"answers or {self.high_bytes} bytes; resuming at {self.low} / {self.low_bytes}"
                            )
                        )
                        self.pauses.happened(1, why + "; the backlog waits at the broker")
            return self._open
        if not full and answers <= self.low and size <= self.low_bytes:
            with self._lock:
                if not self._open:
                    self._open = True
                    self.paused_s += time.monotonic() - self._shut_at
        return self._open

    def paused_seconds(self) -> float:
        return self.paused_s + (0.0 if self._open else time.monotonic() - self._shut_at)
