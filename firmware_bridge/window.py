"""The bridge's end-to-end window: samples published and not yet answered, per answering daemon.

A broker's PUBACK says that it received a publish, not that it will deliver it. It keeps it for a slow subscriber
only up to a limit (Mosquitto's default ``max_queued_messages``: 1,000 per client) and drops the rest without
telling the publisher; and a persistent Mosquitto writes what it received to disk only at its next save, so one
killed in between has acknowledged what it then loses (``tests.mqtt_broker.Broker``). "Safe" is therefore the
answer, not the PUBACK: the daemon answers an input once its answer is in its outbox, durable.

``AnswerWindow`` counts, per key (the daemon that answers; one shared key for boards whose daemon is not known yet),
the samples published and not yet answered. A reliable sample (``take`` with ``safe`` and ``retake``) is
acknowledged to its board at its answer (``answer`` hands back its ``safe``); until then the board holds it.
A reliable sample not answered within the timeout is not counted lost: its frame is taken again (``retake``) from
the board's resend and published again, and so is every sample in the window when the bridge reconnects to the
broker (``retake_all``: the broker may have lost what it had acknowledged). The daemon answers a sample as often as
it gets it; the window remembers the samples answered lately (two generations of ``remember``), so that an answer
that comes again (a QoS 1 redelivery, a sample published twice) is known as a ``DUPLICATE`` and a resend of a
sample answered already is acknowledged at once (``Taken.ANSWERED``), not published again.

Samples nobody answers (``high_water`` 0, the bridge's ``--max-unanswered 0``) keep the older rule, the only one
they can have: ``when_room`` (the PUBACK) makes them safe. Above its high water mark the window drops unreliable
samples (``full``: counted). Each taking of a sample leaves the window once: answered, refused by the broker, taken
again, or not answered within the timeout (the broker or the daemon lost it: counted, never silent).

Pure bookkeeping, thread-safe; the callbacks it releases are called outside its lock.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Answer", "AnswerWindow", "Left", "Taken"]

REMEMBER = 16384
"""Samples whose answer is remembered, by default (two generations of half): a second answer of one is a duplicate."""


class Taken(enum.Enum):
    NEW = "new"
    """Publish it."""
    AGAIN = "again"
    """Its frame was taken again while it was in the window: publish it again; its earlier taking ends (retaken)."""
    ANSWERED = "answered"
    """Answered already (a resend of a frame taken again for an earlier one): acknowledge it, publish nothing."""


class Answer(enum.Enum):
    FIRST = "first"
    """The answer of a sample in the window."""
    LATE = "late"
    """The first answer of a sample not in the window (an earlier run's, or one that left it): send it down."""
    DUPLICATE = "duplicate"
    """A sample answered already: do not send it down again."""


@dataclass(frozen=True)
class Left:
    """Samples that left the window without an answer."""

    unanswered: int = 0
    """Lost: unreliable samples, or reliable ones whose board cannot send them again (it restarted)."""
    retaken: int = 0
    """Reliable samples whose frame is taken again from the board's resend."""

    def __add__(self, other: Left) -> Left:
        return Left(self.unanswered + other.unanswered, self.retaken + other.retaken)


@dataclass
class _Entry:
    key: str
    arrived: float
    safe: Callable[[], None] | None = None
    """A reliable sample's acknowledgement: given at its answer."""
    retake: Callable[[], bool] | None = None
    """Takes its frame again from the board's resend; False when the board can no longer resend it."""
    published: bool = False
    token: object = None
    """This taking of the sample (a resend taken again is another): what its PUBACK is matched with."""


class _Remembered:
    """The keys seen last, at most ``2 * half``: two generations of sets, the older dropped whole."""

    def __init__(self, size: int):
        self.half = max(1, size // 2)
        self._new: set[str] = set()
        self._old: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self._new or key in self._old

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def add(self, key: str) -> None:
        if len(self._new) >= self.half:
            self._old, self._new = self._new, set()
        self._new.add(key)


class AnswerWindow:
    def __init__(self, high_water: int, timeout_s: float, max_tracked: int, remember: int = REMEMBER):
        """``high_water`` 0: no limit (samples are still counted until answered or timed out)."""
        self.high_water = high_water
        self.timeout_s = timeout_s
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        """Each sample in the window, oldest first, by its id."""
        self._open: Counter[str] = Counter()
        self._held: dict[str, deque[Callable[[], None]]] = {}
        self._waiting = 0
        """Reliable samples the broker acknowledged, whose ACK waits for their answer."""
        self._answered = _Remembered(remember)

    @property
    def in_flight(self) -> int:
        return len(self._entries)

    @property
    def held(self) -> int:
        """Samples the broker has, whose ACK to the board waits: for their answer, or for room."""
        with self._lock:
            return self._waiting + sum(len(waiting) for waiting in self._held.values())

    @property
    def remembered(self) -> int:
        """Answers remembered (bounded: ``remember``)."""
        return len(self._answered)

    def full(self, key: str) -> bool:
        """Whether the window of ``key`` is at its high water mark: an unreliable sample is dropped."""
        with self._lock:
            return 0 < self.high_water <= self._open[key]

    # -- a sample taken from a board -------------------------------------------------------------------------
    def take(
        self, ident: str, key: str, arrived: float, *, safe: Callable[[], None] | None = None,
        retake: Callable[[], bool] | None = None, token: object = None,
    ) -> tuple[Taken, Left]:  # fmt: skip
        """A sample about to be published (``safe``: a reliable sample's ACK, called at its answer; ``retake``: how
        its frame is taken again; ``token``: this taking, for ``published`` and ``forget``). Whether to publish it,
        and the samples pushed out past ``max_tracked``."""
        with self._lock:
            if ident in self._answered:
                return Taken.ANSWERED, Left()
            entry = self._entries.get(ident)
            if entry is not None:  # its frame was taken again: this taking replaces the one before
                self._waiting -= entry.published and entry.safe is not None
                entry.arrived, entry.safe, entry.retake, entry.token = arrived, safe, retake, token
                entry.published = False
                self._entries.move_to_end(ident)
                return Taken.AGAIN, Left()
            self._entries[ident] = _Entry(key, arrived, safe, retake, token=token)
            self._open[key] += 1
            pushed = []
            while len(self._entries) > self.max_tracked:
                pushed.append(self._pop_oldest())
        return Taken.NEW, self._left(pushed)

    def enter(self, ident: str, key: str, arrived: float) -> int:
        """``take`` without an acknowledgement to give (a sample made safe by ``when_room``); the number pushed out
        (counted as not answered). A resend of a sample still in the window (the same id) is not counted twice."""
        return self.take(ident, key, arrived)[1].unanswered

    def published(self, ident: str, token: object = None) -> None:
        """The broker acknowledged the sample (this taking of it): a reliable one's ACK waits for its answer alone."""
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None and entry.token is token and not entry.published:
                entry.published = True
                self._waiting += entry.safe is not None

    def when_room(self, ident: str, safe: Callable[[], None]) -> None:
        """Call ``safe`` (the sample's ACK may go to its board) now if the window the sample is in is at or below its
        high water mark (or the sample has left it), else once answers have brought it there."""
        with self._lock:
            entry = self._entries.get(ident)
            key = entry.key if entry is not None else None
            if key is not None and 0 < self.high_water < self._open[key]:
                self._held.setdefault(key, deque()).append(safe)
                return
        safe()

    # -- its answer ------------------------------------------------------------------------------------------
    def answer(self, ident: str) -> tuple[Answer, float | None, Callable[[], None] | None]:
        """An answer came: which kind, when the sample's frame arrived (``FIRST``), and the sample's ACK to give
        (``FIRST`` of a reliable sample)."""
        with self._lock:
            if ident in self._answered:
                return Answer.DUPLICATE, None, None
            self._answered.add(ident)
            entry = self._entries.pop(ident, None)
            if entry is not None:
                self._waiting -= entry.published and entry.safe is not None
        if entry is None:
            return Answer.LATE, None, None
        self._leave([entry.key])
        return Answer.FIRST, entry.arrived, entry.safe

    def answered(self, ident: str) -> float | None:
        """The sample's answer came: when its frame arrived, or None for a sample not in the window (a second
        answer, or one to a sample of an earlier run). Its ACK, if it waits, is given."""
        kind, arrived, safe = self.answer(ident)
        if safe is not None:
            safe()
        return arrived if kind is Answer.FIRST else None

    # -- samples that leave without one ----------------------------------------------------------------------
    def forget(self, ident: str, token: object = None) -> bool:
        """The broker refused the sample (this taking of it, when ``token`` is given): it leaves the window (the
        caller counts it, and takes its frame again). False when it is not there (it left, or was taken again)."""
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None or (token is not None and entry.token is not token):
                return False
            del self._entries[ident]
            self._waiting -= entry.published and entry.safe is not None
        self._leave([entry.key])
        return True

    def expire(self, now: float) -> int:
        """Samples whose frames arrived more than ``timeout_s`` ago and are still not answered: they leave the
        window, and their number is returned (``expire_left`` tells the lost from those taken again)."""
        left = self.expire_left(now)
        return left.unanswered + left.retaken

    def expire_left(self, now: float) -> Left:
        """``expire``: the samples lost (the broker dropped them, or the daemon did), and the reliable ones whose
        frames are taken again from their boards' resends (published again)."""
        gone = []
        with self._lock:
            while self._entries:
                entry = next(iter(self._entries.values()))
                if now - entry.arrived < self.timeout_s:
                    break
                gone.append(self._pop_oldest())
        return self._left(gone)

    def retake_all(self) -> int:
        """Take the frame of every reliable sample in the window again (the broker may have lost what it had
        acknowledged: the bridge reconnected); the samples stay until the resends replace them. How many."""
        with self._lock:
            retakes = [entry.retake for entry in self._entries.values() if entry.retake is not None]
        return sum(bool(retake()) for retake in retakes)

    def rekey(self, old: str, new: str) -> None:
        """The samples of ``old`` count for ``new`` from now on (the daemon that answers them is known now)."""
        with self._lock:
            if old == new or old not in self._open:
                return
            for entry in self._entries.values():
                if entry.key == old:
                    entry.key = new
            self._open[new] += self._open.pop(old)
            waiting = self._held.pop(old, None)
            if waiting:
                self._held.setdefault(new, deque()).extend(waiting)
        self._leave([])

    # -- inside ----------------------------------------------------------------------------------------------
    def _pop_oldest(self) -> _Entry:
        entry = self._entries.popitem(last=False)[1]
        self._waiting -= entry.published and entry.safe is not None
        return entry

    def _left(self, gone: list[_Entry]) -> Left:
        """Entries popped under the lock: their keys leave, their frames are taken again where they can be."""
        self._leave([entry.key for entry in gone])
        retaken = sum(entry.retake is not None and bool(entry.retake()) for entry in gone)
        return Left(len(gone) - retaken, retaken)

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
