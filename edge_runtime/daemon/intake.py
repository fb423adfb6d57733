"""The intake gate: a source that can wait is read no faster than the broker accepts the answers.

    level = inputs taken and not answered yet (queue, worker) + answers not accepted by the broker yet
            (on their way to the outbox, in it, in flight)
    open ──level ≥ high (or bytes ≥ high_bytes, or the disk is full)──► shut ──level ≤ low (and bytes)──► open

While the gate is shut the daemon takes no new input from a source that can wait (MQTT at QoS 1, a replay, a
simulation): MQTT inputs that still arrive (at most the broker's in-flight window for us: our Receive Maximum)
are held unacknowledged and taken, in order, once it opens; the broker keeps the rest of the backlog. A source on
its own thread waits in ``submit``. Sources that cannot wait (QoS 0, plain serial lines) do not pass through it:
for them the outbox's cap and its drop policy remain, every drop counted.

Held inputs are bounded (``MAX_HELD``): Mosquitto 2.0.11 does not keep to our Receive Maximum for a session
that comes back to queued messages (after the first PUBACK it sends hundreds at once: 48,749 of a backlog of
50,000 were seen held). An input past the bound is left unacknowledged and not kept (``shed``); once what was
held is answered, the daemon reconnects (``MqttConnection.redeliver``) and the broker sends the unacknowledged
inputs again, as MQTT requires of a resumed session. Nothing is lost, memory stays bounded.

The marks: ``high`` is 90% of ``[outbox] max_answers`` (and of the outbox's byte cap, which follows its budget on
the disk: ``edgeline.disk``, read at every look), so that what is already in the pipeline when the gate shuts
still fits under the cap; ``low`` is half of ``high``, so that the gate does not flap (each shut lets the broker's
window of answers drain before taking more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from edgeline.daemon.health import Metrics
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.queueing import BoundedQueue, DropPolicy, QueueClosed, QueueFull
from edgeline.lograte import Repeated

__all__ = ["MAX_HELD", "Intake", "IntakeGate"]

log = logging.getLogger("edgeline.daemon")

MAX_HELD = 2048
"""MQTT inputs held at most while the gate is shut; the broker keeps any more (see the module)."""


class IntakeGate:
    def __init__(
        self,
        level: Callable[[], tuple[int, int]],
        *,
        max_answers: int,
        max_bytes: int | Callable[[], int],
        disk_full: Callable[[], bool],
        metrics: Metrics,
    ):
        self._level = level
        self._disk_full = disk_full
        self.high = max(1, max_answers * 9 // 10)
        self.low = self.high // 2
        self._max_bytes = max_bytes
        """The byte level at which answers would be dropped: a number, or read at every look (the outbox's
        ``bytes_cap``, which follows its budget on the disk)."""
        self.metrics = metrics
        self._open = True
        self._lock = threading.Lock()
        self._shut_at = 0.0
        self.paused_s = 0.0
        """Seconds the gate has been shut, over the process's life (the current pause excluded)."""
        self.pauses = Repeated(log, "intake paused (flow control)", level=logging.INFO)

    @property
    def high_bytes(self) -> int:
        cap = self._max_bytes() if callable(self._max_bytes) else self._max_bytes
        return max(1, cap * 9 // 10)

    @property
    def low_bytes(self) -> int:
        return self.high_bytes // 2

    @property
    def is_shut(self) -> bool:
        return not self._open

    def open(self) -> bool:
        """Whether an input may be taken now (any thread; cheap: a few counters are read)."""
        answers, size = self._level()
        full = self._disk_full()
        high_bytes = self.high_bytes
        if self._open:
            if full or answers >= self.high or size >= high_bytes:
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
                                f"answers or {high_bytes} bytes; resuming at {self.low} / {high_bytes // 2}"
                            )
                        )
                        self.pauses.happened(1, why + "; the backlog waits at the broker")
            return self._open
        if not full and answers <= self.low and size <= high_bytes // 2:
            with self._lock:
                if not self._open:
                    self._open = True
                    self.paused_s += time.monotonic() - self._shut_at
        return self._open

    def paused_seconds(self) -> float:
        return self.paused_s + (0.0 if self._open else time.monotonic() - self._shut_at)


class Intake:
    """Inputs from the source into the queue, through the gate (see the module).

    ``submit`` is what the source calls for every message, on its own thread or on the MQTT network thread. On
    the network thread it never blocks: that thread also sends the answers and reads their PUBACKs. An input it
    cannot queue now (the gate is shut, the queue is full) is held, unacknowledged, and ``release_held`` (the
    network thread's tick) queues the held inputs in order once it can. With drop-oldest, a full queue gives up its
    oldest input, answered "dropped" by the worker (``take_evicted``).
    """

    def __init__(
        self,
        queue: BoundedQueue[Message],
        *,
        refuse: Callable[[Message, str, str], list[Answer]],
        metrics: Metrics,
        stopping: threading.Event,
        on_network_thread: Callable[[], bool] = lambda: False,
        heard: Callable[[str], None] | None = None,
        gate: Callable[[Intake], IntakeGate] | None = None,
    ):
        """``gate`` makes the intake gate from this intake (its level counts the inputs taken here and not answered
        yet): given for a source that can wait, publishing to the broker; None: no gate."""
        self.queue = queue
        self.refuse = refuse
        self.metrics = metrics
        self.stopping = stopping
        self.on_network_thread = on_network_thread
        self.heard = heard
        self.held: deque[Message] = deque()
        """Network thread: MQTT inputs held unacknowledged while the gate is shut or the queue is full."""
        self.max_held = MAX_HELD
        self.shed = 0
        """Network thread: inputs past ``max_held`` since the last redelivery: unacknowledged, not kept."""
        self.shed_total = 0
        self.taken = 0
        """Inputs queued (the submitting thread)."""
        self.finished = 0
        """Inputs answered (the worker, through ``answered``)."""
        self._evicted: list[tuple[Message, list[Answer]]] = []
        self._evicted_lock = threading.Lock()
        self.gate: IntakeGate | None = gate(self) if gate is not None else None
        """For a source that can wait (block policy) publishing to the broker; None otherwise."""

    @property
    def pending(self) -> int:
        """Inputs taken and not answered yet."""
        return max(self.taken - self.finished, 0)

    def answered(self, count: int) -> None:
        self.finished += count

    def submit(self, message: Message) -> None:
        """Take one message from the source. Raises ``QueueClosed`` when stopping (a source on its own thread)."""
        if self.heard is not None:
            self.heard(message.topic)
        gate = self.gate
        if self.on_network_thread():
            if self.stopping.is_set():
                return  # not acknowledged: the broker sends it to the next run
            if self.held or (gate is not None and not gate.open()) or not self._put_now(message):
                if len(self.held) < self.max_held:
                    self.held.append(message)
                else:  # the broker sent more than our Receive Maximum: it sends this one again after a reconnect
                    self.shed += 1
                    self.shed_total += 1
            return
        while not self.stopping.is_set():  # a source that can wait: wait for the gate, then for room
            if gate is not None and not gate.open():
                self.stopping.wait(0.05)
                continue
            try:
                self._put(message, timeout=0.5)
                return
            except QueueFull:
                continue
        raise QueueClosed

    def release_held(self) -> None:
        """Network thread: the inputs held while the gate was shut (or the queue full), oldest first."""
        held, gate = self.held, self.gate
        while held and not self.stopping.is_set() and (gate is None or gate.open()):
            if not self._put_now(held[0]):
                return
            held.popleft()
        if self.stopping.is_set():
            held.clear()  # never acknowledged: the broker sends them to the next run

    def take_evicted(self) -> list[tuple[Message, list[Answer]]]:
        """The inputs drop-oldest gave up, with their "dropped" answers, for the worker to deliver."""
        with self._evicted_lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def _put(self, message: Message, timeout: float | None) -> None:
        evicted = self.queue.put(message, timeout=timeout)
        self.taken += 1
        if evicted is not None:
            # answered now, delivered by the worker (this may be the MQTT client's network thread)
            self.metrics.count("dropped")
            answers = self.refuse(evicted, "dropped", f"queue full ({self.queue.capacity}): dropped unprocessed")
            with self._evicted_lock:
                self._evicted.append((evicted, answers))

    def _put_now(self, message: Message) -> bool:
        if self.queue.policy is DropPolicy.BLOCK and len(self.queue) >= self.queue.capacity:
            return False
        try:
            self._put(message, timeout=0)
        except QueueFull:
            return False
        return True
