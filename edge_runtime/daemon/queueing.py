"""The bounded queue between the network thread and inference, with a stated policy for when it is full.

    drop-oldest  ``put`` never blocks: a full queue gives up its oldest item, returned to the caller so that it
                 can answer it with an error (sensor streams, where the newest reading matters most)
    block        ``put`` waits for room, up to a timeout (lossless streams; the producer slows down instead)

Every item is counted: ``enqueued == dequeued + dropped + depth`` at all times.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

__all__ = ["BoundedQueue", "DropPolicy", "QueueClosed", "QueueEmpty", "QueueFull", "QueueStats"]

T = TypeVar("T")


class DropPolicy(str, Enum):
    DROP_OLDEST = "drop-oldest"
    BLOCK = "block"


class QueueFull(queue.Full):
    """A ``block`` queue stayed full for the whole timeout of a ``put``."""


class QueueEmpty(queue.Empty):
    """The queue stayed empty for the whole timeout of a ``get``."""


class QueueClosed(Exception):
    """``put`` on a closed queue, or ``get`` on a closed queue that has been drained."""


@dataclass(frozen=True)
class QueueStats:
    enqueued: int
    dequeued: int
    dropped: int  # the oldest items given up by drop-oldest
    rejected: int  # puts refused: timed out on a full block queue, or made after close
    depth: int
    capacity: int
    policy: DropPolicy


class BoundedQueue(Generic[T]):
    """A thread-safe FIFO of at most ``capacity`` items. ``timeout=None`` waits as long as it takes."""

    def __init__(self, capacity: int, policy: DropPolicy):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.policy = DropPolicy(policy)
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self._enqueued = self._dequeued = self._dropped = self._rejected = 0
        self._waiting_puts = self._waiting_gets = 0

    def put(self, item: T, timeout: float | None = None) -> T | None:
        """Append ``item``; with drop-oldest, return the item evicted to make room (or None).

        Raises ``QueueFull`` when a block queue stays full for ``timeout`` seconds, ``QueueClosed`` after ``close``.
        """
        with self._lock:
            self._refuse_if_closed()
            evicted = None
            if len(self._items) >= self.capacity:
                if self.policy is DropPolicy.DROP_OLDEST:
                    evicted = self._items.popleft()
                    self._dropped += 1
                else:
                    self._waiting_puts += 1
                    try:
                        room = self._not_full.wait_for(
                            lambda: self._closed or len(self._items) < self.capacity, timeout
                        )
                    finally:
                        self._waiting_puts -= 1
                    self._refuse_if_closed()
                    if not room:
                        self._rejected += 1
                        raise QueueFull(f"queue full ({self.capacity} items) for {timeout} s")
            self._items.append(item)
            self._enqueued += 1
            self._not_empty.notify()
            return evicted

    def get(self, timeout: float | None = None) -> T:
        """The oldest item. Raises ``QueueEmpty`` after ``timeout`` seconds, ``QueueClosed`` once closed and drained."""
        with self._lock:
            self._wait_for_items(timeout)
            item = self._items.popleft()
            self._dequeued += 1
            self._not_full.notify()
            return item

    def get_batch(self, max_items: int, timeout: float | None = None) -> list[T]:
        """Wait (like ``get``) for one item, then take up to ``max_items`` of those queued, without waiting more."""
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        with self._lock:
            self._wait_for_items(timeout)
            count = min(max_items, len(self._items))
            batch = [self._items.popleft() for _ in range(count)]
            self._dequeued += count
            self._not_full.notify(count)
            return batch

    def close(self) -> None:
        """Refuse further puts and wake every waiter; what is queued can still be taken."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting_puts(self) -> int:
        """Producers blocked on a full block queue right now (back-pressure on the network thread)."""
        return self._waiting_puts

    @property
    def waiting_gets(self) -> int:
        """Consumers waiting on an empty queue right now."""
        return self._waiting_gets

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> QueueStats:
        with self._lock:
            return QueueStats(
                enqueued=self._enqueued,
                dequeued=self._dequeued,
                dropped=self._dropped,
                rejected=self._rejected,
                depth=len(self._items),
                capacity=self.capacity,
                policy=self.policy,
            )

    def _refuse_if_closed(self) -> None:
        if self._closed:
            self._rejected += 1
            raise QueueClosed("the queue is closed")

    def _wait_for_items(self, timeout: float | None) -> None:
        self._waiting_gets += 1
        try:
            self._not_empty.wait_for(lambda: self._closed or bool(self._items), timeout)
        finally:
            self._waiting_gets -= 1
        if self._items:
            return
        if self._closed:
            raise QueueClosed("the queue is closed and drained")
        raise QueueEmpty(f"queue empty for {timeout} s")
