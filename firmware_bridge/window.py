"""The bridge's end-to-end window: samples published and not yet answered, per answering daemon.

A broker acknowledges a publish, then keeps it for a slow subscriber only up to a limit (Mosquitto's default
``max_queued_messages``: 1,000 per client), and drops the rest without telling the publisher. The broker's PUBACK is
therefore not "safe" with a daemon slower than the boards; an answer is. ``AnswerWindow`` counts, per key (the
daemon that answers; one shared key for boards whose daemon is not known yet), the samples published and not yet
answered; above its high
water mark the bridge holds the ACKs of reliable frames (``when_room``: the board's window holds the samples, and
it waits) and drops unreliable samples (``full``: counted). Each sample leaves the window once: answered, refused by
the broker, or not answered within the timeout (the broker or the daemon lost it: counted, never silent).

Pure bookkeeping, thread-safe; the callbacks it releases are called outside its lock.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

__all__ = ["AnswerWindow"]


class AnswerWindow:
    def __init__(self, high_water: int, timeout_s: float, max_tracked: int):
        """``high_water`` 0: no limit (samples are still counted until answered or timed out)."""
        self.high_water = high_water
        self.timeout_s = timeout_s
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """Each sample in the window, oldest first: its id, to its key and when its frame arrived."""
        self._open: Counter[str] = Counter()
        self._held: dict[str, deque[Callable[[], None]]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._entries)

    @property
    def held(self) -> int:
        """Samples the broker has, whose ACK to the board waits for room."""
        with self._lock:
            return sum(len(waiting) for waiting in self._held.values())

    def full(self, key: str) -> bool:
        """Whether the window of ``key`` is at its high water mark: an unreliable sample is dropped."""
        with self._lock:
            return 0 < self.high_water <= self._open[key]

    def enter(self, ident: str, key: str, arrived: float) -> int:
        """A sample about to be published; the number of the oldest pushed out (past ``max_tracked``: counted as
        not answered). A resend of a sample still in the window (the same id) is not counted twice."""
        with self._lock:
            if ident in self._entries:
                return 0
            self._entries[ident] = (key, arrived)
            self._open[key] += 1
            pushed = []
            while len(self._entries) > self.max_tracked:
                pushed.append(self._entries.popitem(last=False)[1][0])
        self._leave(pushed)
        return len(pushed)

    def when_room(self, ident: str, safe: Callable[[], None]) -> None:
        """Call ``safe`` (the sample's ACK may go to its board) now if the window the sample is in is at or below its
        high water mark (or the sample has left it), else once answers have brought it there."""
        with self._lock:
            entry = self._entries.get(ident)
            key = entry[0] if entry is not None else None
            if key is not None and 0 < self.high_water < self._open[key]:
                self._held.setdefault(key, deque()).append(safe)
                return
        safe()

    def answered(self, ident: str) -> float | None:
        """The sample's answer came: when its frame arrived, or None for a sample not in the window (a second
        answer, or one to a sample of an earlier run)."""
        with self._lock:
            entry = self._entries.pop(ident, None)
        if entry is None:
            return None
        self._leave([entry[0]])
        return entry[1]

    def forget(self, ident: str) -> None:
        """The broker refused the sample: it leaves the window (the caller counts it)."""
        with self._lock:
            entry = self._entries.pop(ident, None)
        if entry is not None:
            self._leave([entry[0]])

    def expire(self, now: float) -> int:
        """Samples whose frames arrived more than ``timeout_s`` ago and are still not answered: they leave the
        window, and their number is returned (the broker dropped them, or the daemon did)."""
        keys = []
        with self._lock:
            while self._entries:
                ident, (key, arrived) = next(iter(self._entries.items()))
                if now - arrived < self.timeout_s:
                    break
                del self._entries[ident]
                keys.append(key)
        self._leave(keys)
        return len(keys)

    def rekey(self, old: str, new: str) -> None:
        """The samples of ``old`` count for ``new`` from now on (the daemon that answers them is known now)."""
        with self._lock:
            if old == new or old not in self._open:
                return
            for ident, (key, arrived) in self._entries.items():
                if key == old:
                    self._entries[ident] = (new, arrived)
            self._open[new] += self._open.pop(old)
            waiting = self._held.pop(old, None)
            if waiting:
                self._held.setdefault(new, deque()).extend(waiting)
        self._leave([])

    def _leave(self, keys: list[str]) -> None:
        released: list[Callable[[], None]] = []
        with self._lock:
            for key in keys:
                self._open[key] -= 1
                if self._open[key] <= 0:
                    del self._open[key]
            for key in [key for key in self._held if self._open[key] <= self.high_water]:
                released.extend(self._held.pop(key))
        for safe in released:
            safe()
