"""The durable outbox: answers wait here, on disk, until the broker has acknowledged them.

    committer ──add(answers, remove=acknowledged) + commit──► outbox.sqlite (WAL)
        └─► only then: the committed answers go to the MQTT client (QoS 1), the inputs' PUBACKs to the broker
    MQTT client ──PUBACK──► acknowledged, removed by the next commit
    after an outage or a restart: take(after=seq) reads back what the client was not handed

So at every instant an input is either unacknowledged at the broker (which redelivers it to the next run) or its
answer is committed here: a SIGKILL, a power cut (``synchronous = "full"``: every commit is fsync'ed) or a broker
crash loses nothing. An answer can be delivered twice (published, then the process dies before its PUBACK is
recorded): results carry the input's id so that duplicates can be removed downstream.

Bounded: at most ``max_answers`` rows and ``max_bytes`` of payload. When a commit would go past either, the oldest
answers are dropped to make room (counted as ``outbox_full``, logged): fresh sensor answers matter more than old
ones, and the alternative, refusing new answers, would stall the stream behind a broker that may never come back.
An answer older than ``ttl_s`` is dropped without being sent (counted as ``ttl_expired``), never delivered late;
at the broker, MQTT 5's message expiry carries the rest of its time to live.

``add`` returns what it committed, seqs included, so the answers go to the client straight from memory; the table
is read back only for what the client could not take at once (it was disconnected, or its queue was full), and
after a restart. Removals are batched: the acknowledged answers of a whole stretch go in the next commit.

One SQLite connection, used under a lock from the committer (add, remove, expire), the network thread (take, on
refills) and the status thread (stats): every operation is a short transaction.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgeline.errors import EdgelineError

__all__ = ["MemoryOutbox", "Outbox", "OutboxStats", "Pending"]

log = logging.getLogger("edgeline.outbox")

SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    created REAL NOT NULL,
    received REAL NOT NULL
)
"""


DELETE_CHUNK = 500
"""Seqs per DELETE statement (SQLite's oldest limit on parameters is 999)."""


@dataclass(frozen=True)
class Pending:
    """One answer waiting for the broker."""

    seq: int
    topic: str
    payload: bytes
    created: float
    """Wall-clock time it was committed (its time to live counts from here)."""
    received: float
    """Wall-clock time its input arrived (for the whole-path latency)."""


@dataclass(frozen=True)
class OutboxStats:
    depth: int
    bytes: int
    oldest_age_s: float | None
    added: int
    removed: int
    expired: int
    overflowed: int


class Outbox:
    def __init__(
        self,
        path: Path,
        *,
        max_answers: int = 100_000,
        max_bytes: int = 64 << 20,
        ttl_s: float = 86400.0,
        synchronous: str = "full",
    ):
        self.path = path
        self.max_answers = max_answers
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._synchronous = "FULL" if synchronous == "full" else "NORMAL"
            self._db.execute(f"PRAGMA synchronous={self._synchronous}")
            self._db.execute(SCHEMA)
            depth, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM answers").fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise EdgelineError(f"outbox {path}: {exc}") from exc
        self._depth, self._bytes = int(depth), int(size)
        self._added = self._removed = self._expired = self._overflowed = 0
        self._floor = 0
        """The highest seq the bounds dropped."""

    # -- worker ----------------------------------------------------------------------------------------------
    def add(self, answers: Sequence[tuple[str, bytes, float]], *, remove: Sequence[int] = ()) -> list[Pending]:
        """Commit ``(topic, payload, received)`` answers, and forget the acknowledged ``remove``, in one
        transaction; return once they are on disk, with what was committed (oldest first; without those the
        bounds dropped at once)."""
        if not answers:
            self.remove(remove)
            return []
        now = time.time()
        rows = [(topic, payload, now, received) for topic, payload, received in answers]
        size = sum(len(payload) for _, payload, _ in answers)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = self._delete_seqs(remove)
                self._db.executemany(
                    "INSERT INTO answers (topic, payload, created, received) VALUES (?, ?, ?, ?)", rows
                )
                (last,) = self._db.execute("SELECT last_insert_rowid()").fetchone()
                self._depth += len(rows)
                self._bytes += size
                self._make_room()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._depth, self._bytes = self._count()
                raise
            self._added += len(rows)
            self._removed += gone
        first = int(last) - len(rows) + 1  # one writer, inside one transaction: consecutive seqs
        return [
            Pending(first + i, topic, payload, now, received)
            for i, (topic, payload, _, received) in enumerate(rows)
            if first + i > self._floor
        ]

    def _make_room(self) -> None:
        """Inside a transaction: drop the oldest answers until both bounds hold again."""
        while self._depth > self.max_answers or self._bytes > self.max_bytes:
            excess = max(self._depth - self.max_answers, 1)
            victims = self._db.execute(
                "SELECT seq, LENGTH(payload) FROM answers ORDER BY seq LIMIT ?", (excess,)
            ).fetchall()
            if not victims:
                return
            self._db.execute("DELETE FROM answers WHERE seq <= ?", (victims[-1][0],))
            self._floor = max(self._floor, int(victims[-1][0]))
            self._depth -= len(victims)
            self._bytes -= sum(length for _, length in victims)
            self._overflowed += len(victims)
            log.warning(
                "outbox full (%d answers, %d bytes at most): dropped the %d oldest", self.max_answers,
                self.max_bytes, len(victims),
            )  # fmt: skip

    # -- the network thread, on refills ------------------------------------------------------------------------
    def take(self, limit: int, *, after: int = 0) -> list[Pending]:
        """Up to ``limit`` answers with a seq above ``after``, oldest first, leaving out those past their time to
        live (``expire`` drops and counts them)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, topic, payload, created, received FROM answers WHERE seq > ? AND created >= ? "
                "ORDER BY seq LIMIT ?",
                (after, time.time() - self.ttl_s, limit),
            ).fetchall()
        return [
            Pending(int(seq), topic, bytes(payload), created, received)
            for seq, topic, payload, created, received in rows
        ]

    # -- the committer -----------------------------------------------------------------------------------------
    def remove(self, seqs: Sequence[int]) -> None:
        """The broker has these: forget them (when no answer is waiting to be added along).

        Not fsync'ed (``synchronous=NORMAL`` for this commit only; the next ``add`` syncs it along): a power cut
        can undo a removal, which delivers that answer twice, never loses one, and a commit costs no fsync.
        """
        if not seqs:
            return
        with self._lock:
            self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                gone = self._delete_seqs(seqs)
                self._db.execute("COMMIT")
            finally:
                self._db.execute(f"PRAGMA synchronous={self._synchronous}")
            self._removed += gone

    def expire(self) -> int:
        """Drop the answers older than the time to live; how many."""
        with self._lock:
            gone = self._delete("created < ?", [(time.time() - self.ttl_s,)])
            self._expired += gone
        if gone:
            log.warning("dropped %d answers older than the outbox's time to live (%g s) without sending them", gone,
                        self.ttl_s)  # fmt: skip
        return gone

    def drop(self, seq: int) -> None:
        """An answer taken but found expired before it was sent: gone, counted as expired."""
        with self._lock:
            self._expired += self._delete("seq = ?", [(seq,)])

    # -- anyone ------------------------------------------------------------------------------------------------
    def _delete_seqs(self, seqs: Sequence[int]) -> int:
        """Under the lock, in a transaction: delete these rows, many per statement; how many went."""
        gone = size = 0
        for start in range(0, len(seqs), DELETE_CHUNK):
            chunk = seqs[start : start + DELETE_CHUNK]
            marks = ",".join("?" * len(chunk))
            for (length,) in self._db.execute(
                f"DELETE FROM answers WHERE seq IN ({marks}) RETURNING LENGTH(payload)", tuple(chunk)
            ):
                gone += 1
                size += length
        self._depth -= gone
        self._bytes -= size
        return gone

    def _delete(self, where: str, parameters: list[tuple[float | int]]) -> int:
        """Under the lock: delete the matching rows, keep the depth and byte counts; how many rows went."""
        gone = size = 0
        for values in parameters:
            for (length,) in self._db.execute(f"DELETE FROM answers WHERE {where} RETURNING LENGTH(payload)", values):
                gone += 1
                size += length
        self._depth -= gone
        self._bytes -= size
        return gone

    def _count(self) -> tuple[int, int]:
        depth, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM answers").fetchone()
        return int(depth), int(size)

    @property
    def depth(self) -> int:
        return self._depth

    def stats(self) -> OutboxStats:
        with self._lock:
            row = self._db.execute("SELECT created FROM answers ORDER BY seq LIMIT 1").fetchone()
            oldest = None if row is None else row[0]
            return OutboxStats(
                depth=self._depth,
                bytes=self._bytes,
                oldest_age_s=None if oldest is None else max(0.0, time.time() - oldest),
                added=self._added,
                removed=self._removed,
                expired=self._expired,
                overflowed=self._overflowed,
            )

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(sqlite3.Error):  # a checkpoint only tidies up; the WAL is replayed at open
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()


class MemoryOutbox:
    """The outbox without the disk (``[outbox] enabled = false``): the same bounds, time to live, counters and
    calls, in memory. A crash loses what it holds. It keeps one rule of the durable outbox: the worker hands
    answers over and goes on, it never waits for the MQTT client (whose queue only paho's network thread drains,
    and that thread may itself be waiting for the worker's queue)."""

    path = None

    def __init__(self, *, max_answers: int = 100_000, max_bytes: int = 64 << 20, ttl_s: float = 86400.0):
        self.max_answers = max_answers
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._rows: OrderedDict[int, Pending] = OrderedDict()
        self._seq = self._bytes = self._floor = 0
        self._added = self._removed = self._expired = self._overflowed = 0

    def add(self, answers: Sequence[tuple[str, bytes, float]], *, remove: Sequence[int] = ()) -> list[Pending]:
        self.remove(remove)
        now = time.time()
        added: list[Pending] = []
        with self._lock:
            for topic, payload, received in answers:
                self._seq += 1
                pending = Pending(self._seq, topic, payload, now, received)
                self._rows[self._seq] = pending
                added.append(pending)
                self._bytes += len(payload)
            self._added += len(answers)
            dropped = 0
            while self._rows and (len(self._rows) > self.max_answers or self._bytes > self.max_bytes):
                _, oldest = self._rows.popitem(last=False)
                self._bytes -= len(oldest.payload)
                dropped += 1
                self._floor = oldest.seq
            self._overflowed += dropped
        if dropped:
            log.warning("outbox full (%d answers, %d bytes at most): dropped the %d oldest", self.max_answers,
                        self.max_bytes, dropped)  # fmt: skip
        return [p for p in added if p.seq > self._floor]

    def take(self, limit: int, *, after: int = 0) -> list[Pending]:
        alive = time.time() - self.ttl_s
        taken: list[Pending] = []
        with self._lock:
            for pending in self._rows.values():  # oldest first; those before ``after`` are the client's, unacknowledged
                if pending.seq > after and pending.created >= alive:
                    taken.append(pending)
                    if len(taken) >= limit:
                        break
        return taken

    def remove(self, seqs: Sequence[int]) -> None:
        with self._lock:
            for seq in seqs:
                pending = self._rows.pop(seq, None)
                if pending is not None:
                    self._bytes -= len(pending.payload)
                    self._removed += 1

    def expire(self) -> int:
        limit = time.time() - self.ttl_s
        gone = 0
        with self._lock:
            while self._rows:
                seq, oldest = next(iter(self._rows.items()))
                if oldest.created >= limit:
                    break
                del self._rows[seq]
                self._bytes -= len(oldest.payload)
                gone += 1
            self._expired += gone
        if gone:
            log.warning("dropped %d answers older than the outbox's time to live (%g s) without sending them", gone,
                        self.ttl_s)  # fmt: skip
        return gone

    def drop(self, seq: int) -> None:
        with self._lock:
            pending = self._rows.pop(seq, None)
            if pending is not None:
                self._bytes -= len(pending.payload)
                self._expired += 1

    @property
    def depth(self) -> int:
        return len(self._rows)

    def stats(self) -> OutboxStats:
        with self._lock:
            oldest = next(iter(self._rows.values()), None)
            return OutboxStats(
                depth=len(self._rows),
                bytes=self._bytes,
                oldest_age_s=None if oldest is None else max(0.0, time.time() - oldest.created),
                added=self._added,
                removed=self._removed,
                expired=self._expired,
                overflowed=self._overflowed,
            )

    def close(self) -> None:
        """Nothing to close: what it still holds is lost with the process (said in the log by the daemon)."""
