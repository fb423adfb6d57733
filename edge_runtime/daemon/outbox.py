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

Two outboxes, one interface (``OutboxInterface``): ``Outbox`` on disk and ``MemoryOutbox`` (``[outbox] enabled =
false``). The delivery path and the daemon hold an ``OutboxInterface``; ``durable`` tells them whether a commit
is worth a thread of its own.

One SQLite connection, used under a lock from the committer (add, remove, expire), the network thread (take, on
refills) and the status thread (stats): every operation is a short transaction.

On disk, the outbox's files (the database and its write-ahead log together) stay within its ``budget``: the
smaller of ``max_bytes`` and a half of the state directory's file system (its free bytes and the outbox's own),
measured at open and again at every ``check`` (``edgeline.disk`` says why a half), except while the disk is
full: then it does not shrink (the answers held for the next commit were taken within it). The WAL may take
``wal_limit`` of it (a quarter, at most 4 MiB): SQLite checkpoints it at half that, and once its file passes
``wal_limit`` it is checkpointed with TRUNCATE (SQLite's default lets it grow to about 4 MB whatever the outbox
holds: on a 3 MB disk, that filled the disk and a checkpoint could never run again). The answers' counted bytes
(payload, topic and a row's overhead) may take half of the rest (``PAGE_SLACK``): SQLite's pages hold rows with up to
a half of them lost (a row a little over half a page takes a page alone), so the database file stays within its
share whatever the answers' size. A budget that shrinks below what the outbox holds drops nothing, nor any answer
to an input received before it shrank (taken within the budget before it, on its way here): the outbox stops growing,
past its budget by at most what was on its way. A write that fails for lack of space raises ``DiskFull``: the
transaction is rolled back, the bounds' drops in it too, nothing is half-stored, and the caller keeps what it wanted
to write and tries again (``edgeline.daemon.delivery``). An
outbox that is not a database any more (a corrupted file) is set aside at open (renamed ``*.corrupt-<time>``,
said in an error) and a new one started, so that a restart does not fail on it for ever.

Files deleted, truncated or replaced under the running outbox (``edgeline.daemon.outbox_files``) are looked for
before and after every commit that acknowledges inputs, around every other write, and at every ``check``. Found,
they are said once (an error naming the path and what happened), every answer the open connection still reads (the
unlinked inode, SQLite's page cache) is written into a new outbox made at the path, with its seq, and only then does
``add`` return: an input is acknowledged only once its answer is in the file a restart opens. A new outbox that
cannot be made there (the directory gone for good, read-only, full) is ``OutboxLost``: every later call raises it,
and the daemon ends (exit 1) rather than acknowledge what it cannot keep.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edgeline.daemon.outbox_files import FilesWatch
from edgeline.disk import budget, files_bytes, free_bytes, wal_share
from edgeline.durable import check_destination, flush_directory
from edgeline.errors import EdgelineError
from edgeline.lograte import Repeated

__all__ = [
    "DiskFull", "MemoryOutbox", "Outbox", "OutboxClosed", "OutboxInterface", "OutboxLost", "OutboxStats", "Pending",
    "row_size",
]  # fmt: skip

log = logging.getLogger("edgeline.outbox")

SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    created REAL NOT NULL,
    received REAL NOT NULL,
    correlation BLOB
)
"""
ANSWER_ROW = tuple[str, bytes, float] | tuple[str, bytes, float, bytes | None]
"""What ``add`` takes: ``(topic, payload, received)``, or with an MQTT 5 request's correlation data."""


DELETE_CHUNK = 500
"""Seqs per DELETE statement (SQLite's oldest limit on parameters is 999)."""
ROW_OVERHEAD = 40
"""Bytes a row takes beyond its payload and topic (seq, two times, SQLite's cell header): counted in the bound."""
PAGE_SLACK = 2
"""The answers' counted bytes take at most 1/PAGE_SLACK of what the budget leaves the database file (see the module:
measured, 1.06-1.1 for rows of 20 to 700 bytes, 1.4 for 3,000-byte rows, near 2 for rows just over half a page)."""
CHECK_EVERY_S = 1.0
"""The delivery path's committer calls ``check`` this often (and on every retry of a full disk)."""
SIZE_OF = "LENGTH(payload) + LENGTH(CAST(topic AS BLOB)) + 40"
"""A row's size as counted against ``max_bytes`` (``ROW_OVERHEAD`` included)."""


class DiskFull(EdgelineError):
    """A write of the outbox failed for lack of space; nothing of it was stored."""


class OutboxClosed(EdgelineError):
    """A call after ``close``: a thread that outlived the drain time (the committer retrying a full disk)."""


class OutboxLost(OutboxClosed):
    """The outbox's files were deleted, truncated or replaced under it and no new outbox could be made at its path:
    what it held is lost with the process, and every later call raises this (the message says where and why)."""


def row_size(topic: str, payload: bytes) -> int:
    """What one answer counts against ``max_bytes``."""
    return _row_size(topic, payload)


def _row_size(topic: str, payload: bytes) -> int:
    return len(payload) + len(topic.encode()) + ROW_OVERHEAD


# SQLite's result codes, by number: the sqlite3 module names them only from Python 3.11 on, when its exceptions also
# start carrying ``sqlite_errorcode``; on 3.10 the message alone decides.
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_NOTADB = 26


def _answer_share(total: int) -> int:
    """What the answers' counted bytes may take of a budget of ``total`` bytes: a half (``PAGE_SLACK``) of what the
    WAL leaves."""
    return max(1, (total - wal_share(total)) // PAGE_SLACK)


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _corrupt(exc: sqlite3.Error) -> bool:
    """An error that says the file is not a usable database (as opposed to locked, read-only or full)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in str(exc)


def _set_aside(path: Path, exc: BaseException) -> Path:
    """Move a corrupted outbox (and its WAL and shared memory) out of the way; say so once, as an error."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    try:
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{path}{suffix}")
            if source.exists():
                source.rename(Path(f"{target}{suffix}"))
    except OSError as move:
        raise EdgelineError(f"outbox {path} is corrupted ({exc}) and could not be set aside: {move}") from exc
    log.error(
        "outbox %s is corrupted (%s): set aside as %s and a new one started; the answers it held are not "
        "delivered (their inputs were acknowledged)", path, exc, target,
    )  # fmt: skip
    return target


def _last_seq(db: sqlite3.Connection) -> int:
    """The highest seq the answers table ever gave (SQLite's AUTOINCREMENT keeps it in ``sqlite_sequence``)."""
    row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'answers'").fetchone()
    return 0 if row is None else int(row[0])


def _whole(row: tuple[object, ...]) -> bool:
    """A row read back as the answers table holds it: a row read from pages a truncation zeroed has NULLs or zeros
    in its place (``created``, the outbox's own wall-clock time, is never 0)."""
    seq, topic, payload, created, received, correlation = row
    return (
        isinstance(seq, int) and seq > 0 and isinstance(topic, str) and bool(topic) and isinstance(payload, bytes)
        and isinstance(created, float) and created > 0 and isinstance(received, float)
        and isinstance(correlation, (bytes, type(None)))
    )  # fmt: skip


OnDrop = Callable[[list[int]], None]
"""Told the seqs of the answers the bounds dropped, once that is committed (``add``), still under the outbox's lock:
before any ``take`` can read what the commit left (a caller that counts the dropped answers it never handed out
must see the drop before a read-back moves past those seqs). It must be quick and must not call the outbox."""


def _overflow_detail(box: OutboxInterface, count: int, bounds: bool) -> str:
    if bounds:
        return f"{count} dropped ({box.max_answers} answers, a budget of {box.budget} bytes at most)"
    return f"{count} dropped while the disk was full"


def _overflow_log() -> Repeated:
    return Repeated(log, "outbox full: the oldest answers are dropped, never delivered")


def _expiry_log() -> Repeated:
    return Repeated(log, "answers older than the outbox's time to live dropped without being sent")


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
    correlation: bytes | None = None
    """An answer to an MQTT 5 request, on its response topic: the request's Correlation Data."""


def _rows(answers: Sequence[ANSWER_ROW], now: float) -> list[tuple[str, bytes, float, float, bytes | None]]:
    return [(a[0], a[1], now, a[2], a[3] if len(a) > 3 else None) for a in answers]


@dataclass(frozen=True)
class OutboxStats:
    depth: int
    bytes: int
    oldest_age_s: float | None
    added: int
    removed: int
    expired: int
    overflowed: int
    corrupt: int = 0
    """Corrupted outbox files set aside at open (0 or 1)."""
    replaced: int = 0
    """Times its files were found deleted, truncated or replaced under it, and a new outbox made at the path."""
    budget_bytes: int = 0
    """The budget in effect (see the module): what the outbox's files may take on the disk."""
    disk_bytes: int = 0
    """What the outbox's files (database and WAL) took on the disk at the last check (0 in memory)."""
    free_bytes: int | None = None
    """Free on the state directory's file system at the last check (None: in memory, or not measurable)."""


class OutboxInterface(Protocol):
    """What the delivery path and the daemon use of an outbox: ``Outbox`` (SQLite) and ``MemoryOutbox`` both are one."""

    @property
    def path(self) -> Path | None:
        """The database file; None for an outbox in memory."""

    @property
    def durable(self) -> bool:
        """True when ``add`` returns only once the answers are on disk (slow: the delivery path gives it a committer
        thread); False when it returns at once (memory)."""

    max_answers: int
    max_bytes: int
    budget: int
    """The bytes its files may take on the disk: ``max_bytes`` or less (``Outbox``); ``max_bytes`` in memory."""
    disk_bytes: int
    """What its files take on the disk (0 in memory)."""
    ttl_s: float
    overflow_log: Repeated
    expiry_log: Repeated

    def add(
        self, answers: Sequence[ANSWER_ROW], *, remove: Sequence[int] = (), on_drop: OnDrop | None = None
    ) -> list[Pending]: ...
    def take(self, limit: int, *, after: int = 0) -> list[Pending]: ...
    def remove(self, seqs: Sequence[int]) -> None: ...
    def expire(self) -> int: ...
    def drop(self, seq: int) -> None: ...
    def count_expired(self, count: int) -> None: ...
    def count_overflow(self, count: int, *, bounds: bool = True) -> None: ...
    def check(self, *, truncate: bool = False) -> int: ...
    @property
    def depth(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def bytes_cap(self) -> int: ...
    def stats(self) -> OutboxStats: ...
    def close(self) -> None: ...


class Outbox:
    durable = True

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
        self._wal = Path(f"{path}-wal")
        self._bytes = 0
        self.budget = self.wal_limit = self.answer_bytes = self.disk_bytes = 0
        self._shrunk_at = 0.0
        """When a check last lowered ``answer_bytes`` (``time.time()``): answers to inputs received before it were
        taken within the budget before it (``_make_room``)."""
        self.free_bytes: int | None = None
        """Free on the state directory's file system at the last check (None: not measurable here)."""
        self._set_budget(self._measure())
        self._full = False
        """A write failed for lack of space, and no add has been committed since: the budget does not shrink."""
        self._synchronous = "FULL" if synchronous == "full" else "NORMAL"
        self._lock = threading.Lock()
        self._closed = False
        self._lost: str | None = None
        """Why the outbox is lost (``OutboxLost``), once it is."""
        self.replaced = 0
        self.set_aside: Path | None = None
        """Where a corrupted outbox found at open was moved (None: none was)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EdgelineError(f"outbox {path}: {exc.strerror or exc}") from exc
        for name in (path.name, f"{path.name}-wal", f"{path.name}-journal", f"{path.name}-shm"):
            check_destination(path.with_name(name))  # SQLite would write through a planted link: refused, named
        try:
            self._db, depth, size = self._open()
        except sqlite3.DatabaseError as exc:
            if _is_full(exc) or (isinstance(exc, sqlite3.OperationalError) and not _corrupt(exc)):
                raise EdgelineError(f"outbox {path}: {exc}") from exc
            self.set_aside = _set_aside(path, exc)
            try:
                self._db, depth, size = self._open()
            except sqlite3.Error as again:
                raise EdgelineError(f"outbox {path}: {again}") from again
        try:
            self._watch = FilesWatch(path, self._wal)
        except OSError as exc:
            self._db.close()
            raise EdgelineError(f"outbox {path}: {exc.strerror or exc}") from exc
        self._last_seq = _last_seq(self._db)
        """The highest seq ever given: a new outbox made at the path goes on from it (the delivery path reads back
        above the seqs it handed out)."""
        self._depth, self._bytes = int(depth), int(size)
        self._set_budget(self.budget)  # what it holds is not dropped for a budget that shrank
        self._added = self._removed = self._expired = self._overflowed = 0
        self._floor = 0
        """The highest seq the bounds dropped."""
        self.overflow_log = _overflow_log()
        self.expiry_log = _expiry_log()

    def _open(self) -> tuple[sqlite3.Connection, int, int]:
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        try:
            # One connection, in one process (the state directory is locked): exclusive locking keeps the WAL's
            # index in our memory instead of a -shm file, which a restart on a full disk could not create
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self._synchronous}")
            self._limit_wal(db)
            if db.execute("SELECT name FROM sqlite_master WHERE name = 'answers'").fetchone() is None:
                db.execute(SCHEMA)
            elif "correlation" not in {row[1] for row in db.execute("PRAGMA table_info(answers)")}:
                db.execute("ALTER TABLE answers ADD COLUMN correlation BLOB")  # an outbox of an earlier version
            ok = db.execute("PRAGMA quick_check(1)").fetchone()
            if ok is None or ok[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {ok[0] if ok else 'no answer'}")
            depth, size = db.execute(f"SELECT COUNT(*), COALESCE(SUM({SIZE_OF}), 0) FROM answers").fetchone()
        except BaseException:
            db.close()
            raise
        return db, depth, size

    # -- the budget ----------------------------------------------------------------------------------------------
    def _measure(self) -> int:
        """The budget now: the file system's free bytes and what the outbox's files take (``edgeline.disk``)."""
        self.disk_bytes = files_bytes(self.path, self._wal)
        self.free_bytes = free_bytes(self.path.parent)
        return budget(self.max_bytes, self.free_bytes, self.disk_bytes)

    def _set_budget(self, total: int) -> None:
        self.budget = total
        self.wal_limit = wal_share(total)
        answer_bytes = max(_answer_share(total), self._bytes)
        if answer_bytes < self.answer_bytes:
            self._shrunk_at = time.time()  # (the clock of a ``Message``'s ``received``)
        self.answer_bytes = answer_bytes
        """What the answers' rows may take (counted: ``row_size``); never less than they take now."""

    def _limit_wal(self, db: sqlite3.Connection) -> None:
        # the WAL: checkpointed at half its bound (a commit group may add the other half), truncated to it after
        db.execute(f"PRAGMA wal_autocheckpoint={max(16, self.wal_limit // 2 // 4096)}")
        db.execute(f"PRAGMA journal_size_limit={self.wal_limit}")

    def _truncate_wal(self, *, always: bool = False) -> None:
        """Under the lock, outside a transaction: checkpoint the WAL and truncate it to nothing when its file is past
        ``wal_limit`` (or ``always``: room is short). On a full disk the checkpoint may fail (the database file
        cannot grow): tried again at the next check."""
        try:
            size = os.stat(self._wal).st_size
        except OSError:
            return
        if size and (always or size > self.wal_limit):
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._watch.emptied()
            self._keep_files()  # the database file grew: what a truncation is measured against

    def check(self, *, truncate: bool = False) -> int:
        """Measure the budget again (the file system's free bytes change under us) and checkpoint the WAL when it is
        past its share (``truncate``: in any case, to give room back on a full disk). The committer calls it every
        ``CHECK_EVERY_S`` and on every retry of a full disk. Returns the budget in effect."""
        with self._using():
            self._keep_files()
            wal_limit = self.wal_limit
            measured = self._measure()
            # a full disk measures nothing useful (no free bytes): the answers the committer holds meanwhile were
            # taken within the budget before it, and must fit in it once there is room, whenever the next check runs
            self._set_budget(max(measured, self.budget) if self._full else measured)
            if self.wal_limit != wal_limit:
                with contextlib.suppress(sqlite3.Error):
                    self._limit_wal(self._db)
            self._truncate_wal(always=truncate)
            if truncate:
                self.disk_bytes = files_bytes(self.path, self._wal)
        return self.budget

    # -- worker ----------------------------------------------------------------------------------------------
    def add(
        self, answers: Sequence[ANSWER_ROW], *, remove: Sequence[int] = (), on_drop: OnDrop | None = None
    ) -> list[Pending]:
        """Commit ``(topic, payload, received)`` answers, and forget the acknowledged ``remove``, in one
        transaction; return once they are on disk, with what was committed (oldest first; without those the
        bounds dropped at once). The answers the bounds dropped are counted as overflowed, or, with ``on_drop``,
        handed to it once committed (their seqs, oldest first): the caller knows which of them the MQTT client
        holds already, and counts only the others. Raises ``DiskFull`` (nothing stored) when out of space."""
        if not answers:
            self.remove(remove)
            return []
        now = time.time()
        rows = _rows(answers, now)
        size = sum(_row_size(row[0], row[1]) for row in rows)
        with self._using():
            self._keep_files()
            floor = self._floor
            try:
                self._db.execute("BEGIN IMMEDIATE")
                gone = self._delete_seqs(remove)
                self._db.executemany(
                    "INSERT INTO answers (topic, payload, created, received, correlation) VALUES (?, ?, ?, ?, ?)", rows
                )
                (last,) = self._db.execute("SELECT last_insert_rowid()").fetchone()
                self._depth += len(rows)
                self._bytes += size
                shrunk = self._shrunk_at  # (0 until a check shrinks the budget: nothing to count per commit)
                allowance = sum(_row_size(r[0], r[1]) for r in rows if r[3] < shrunk) if shrunk else 0
                dropped = self._make_room(allowance)
                self._db.execute("COMMIT")
            except BaseException as exc:
                # nothing of the transaction happened, the bounds' drops included: a retry gets the same seqs, and
                # those it keeps must not be taken for dropped
                self._floor = floor
                self._rollback()
                if _is_full(exc):
                    self._full = True
                    raise DiskFull(f"outbox {self.path}: the disk is full ({exc})") from exc
                raise
            self._last_seq = int(last)
            self._keep_files()  # what was committed is in the file a restart opens before ``add`` returns
            self._full = False
            self.answer_bytes = max(self.answer_bytes, self._bytes)  # what it kept past a shrunk budget stays
            self._added += len(rows)
            self._removed += gone
            self._truncate_wal()
            if dropped and on_drop is not None:
                on_drop(dropped)  # under the lock: before any ``take`` can read what this commit left
        if dropped and on_drop is None:
            self.count_overflow(len(dropped), bounds=True)
        first = int(last) - len(rows) + 1  # one writer, inside one transaction: consecutive seqs
        return [
            Pending(first + i, topic, payload, now, received, correlation)
            for i, (topic, payload, _, received, correlation) in enumerate(rows)
            if first + i > self._floor
        ]

    def _make_room(self, allowance: int) -> list[int]:
        """Inside a transaction: drop the oldest answers until both bounds hold again; their seqs. ``allowance``:
        bytes of this commit's answers whose inputs came before the budget last shrank (taken within the budget
        before it), let past the budget on the disk (never past the answers' share of ``max_bytes``): dropping them,
        or older answers in their place, would acknowledge inputs whose answers are lost. The outbox is then past
        its budget by at most what was on its way, the intake gate is shut, and a disk that refuses even that is the
        full-disk state (``DiskFull``: nothing acknowledged, retried)."""
        dropped: list[int] = []
        cap = max(self.answer_bytes, min(self.answer_bytes + allowance, _answer_share(self.max_bytes)))
        while self._depth > self.max_answers or self._bytes > cap:
            excess = max(self._depth - self.max_answers, 1)
            victims = self._db.execute(f"SELECT seq, {SIZE_OF} FROM answers ORDER BY seq LIMIT ?", (excess,)).fetchall()
            if not victims:
                break
            self._db.execute("DELETE FROM answers WHERE seq <= ?", (victims[-1][0],))
            self._floor = max(self._floor, int(victims[-1][0]))
            self._depth -= len(victims)
            self._bytes -= sum(length for _, length in victims)
            dropped += (int(seq) for seq, _ in victims)
        return dropped

    def _rollback(self) -> None:
        """After a failed statement: SQLite may have rolled the transaction back itself (SQLITE_FULL does)."""
        with contextlib.suppress(sqlite3.Error):
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        with contextlib.suppress(sqlite3.Error):
            self._depth, self._bytes = self._count()

    # -- the network thread, on refills ------------------------------------------------------------------------
    def take(self, limit: int, *, after: int = 0) -> list[Pending]:
        """Up to ``limit`` answers with a seq above ``after``, oldest first, leaving out those past their time to
        live (``expire`` drops and counts them)."""
        with self._using():
            rows = self._db.execute(
                "SELECT seq, topic, payload, created, received, correlation FROM answers "
                "WHERE seq > ? AND created >= ? ORDER BY seq LIMIT ?",
                (after, time.time() - self.ttl_s, limit),
            ).fetchall()
        return [
            Pending(int(seq), topic, bytes(payload), created, received, None if corr is None else bytes(corr))
            for seq, topic, payload, created, received, corr in rows
        ]

    # -- the committer -----------------------------------------------------------------------------------------
    def remove(self, seqs: Sequence[int]) -> None:
        """The broker has these: forget them (when no answer is waiting to be added along).

        Not fsync'ed (``synchronous=NORMAL`` for this commit only; the next ``add`` syncs it along): a power cut
        can undo a removal, which delivers that answer twice, never loses one, and a commit costs no fsync.
        """
        if not seqs:
            return
        with self._using():
            self._keep_files()
            with self._writing():
                self._db.execute("PRAGMA synchronous=NORMAL")
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                    gone = self._delete_seqs(seqs)
                    self._db.execute("COMMIT")
                finally:
                    self._db.execute(f"PRAGMA synchronous={self._synchronous}")
                self._removed += gone
            self._keep_files()  # (a commit may checkpoint: the database file grows)

    def expire(self) -> int:
        """Drop the answers older than the time to live; how many."""
        with self._using():
            with self._writing():
                gone = self._delete("created < ?", [(time.time() - self.ttl_s,)])
                self._expired += gone
            self._keep_files()
        if gone:
            self.expiry_log.happened(gone, f"{gone} dropped (time to live {self.ttl_s:g} s)")
        return gone

    def drop(self, seq: int) -> None:
        """An answer taken but found expired before it was sent: gone, counted as expired."""
        with self._using():
            with self._writing():
                self._expired += self._delete("seq = ?", [(seq,)])
            self._keep_files()

    def count_expired(self, count: int) -> None:
        """Answers that expired outside the table (in the MQTT client, waiting for a resend)."""
        with self._lock:
            self._expired += count
        self.expiry_log.happened(count, f"{count} dropped (time to live {self.ttl_s:g} s)")

    def count_overflow(self, count: int, *, bounds: bool = True) -> None:
        """Answers lost to the bounds (``bounds``), or that never reached the table and never will (held while
        the disk was full, then dropped)."""
        if count <= 0:
            return
        with self._lock:
            self._overflowed += count
        self.overflow_log.happened(count, _overflow_detail(self, count, bounds))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Under the lock: a write that fails for lack of space is rolled back and raised as ``DiskFull``."""
        try:
            yield
        except (sqlite3.Error, OSError) as exc:
            self._rollback()
            if _is_full(exc):
                self._full = True
                raise DiskFull(f"outbox {self.path}: the disk is full ({exc})") from exc
            raise

    # -- anyone ------------------------------------------------------------------------------------------------
    def _delete_seqs(self, seqs: Sequence[int]) -> int:
        """Under the lock, in a transaction: delete these rows, many per statement; how many went."""
        gone = size = 0
        for start in range(0, len(seqs), DELETE_CHUNK):
            chunk = seqs[start : start + DELETE_CHUNK]
            marks = ",".join("?" * len(chunk))
            for (length,) in self._db.execute(
                f"DELETE FROM answers WHERE seq IN ({marks}) RETURNING {SIZE_OF}", tuple(chunk)
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
            for (length,) in self._db.execute(f"DELETE FROM answers WHERE {where} RETURNING {SIZE_OF}", values):
                gone += 1
                size += length
        self._depth -= gone
        self._bytes -= size
        return gone

    def _count(self) -> tuple[int, int]:
        depth, size = self._db.execute(f"SELECT COUNT(*), COALESCE(SUM({SIZE_OF}), 0) FROM answers").fetchone()
        return int(depth), int(size)

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def used_bytes(self) -> int:
        """What the answers take, counted (``row_size``), and the WAL's bound: what the intake gate holds against
        ``bytes_cap``."""
        return self._bytes + self.wal_limit

    @property
    def bytes_cap(self) -> int:
        """``used_bytes`` at which the oldest answers are dropped: the answers' share of the budget and the WAL's."""
        return self.answer_bytes + self.wal_limit

    def stats(self) -> OutboxStats:
        with self._lock:
            row = (
                None
                if self._closed
                else self._db.execute("SELECT created FROM answers ORDER BY seq LIMIT 1").fetchone()
            )
            oldest = None if row is None else row[0]
            return OutboxStats(
                depth=self._depth,
                bytes=self._bytes,
                oldest_age_s=None if oldest is None else max(0.0, time.time() - oldest),
                added=self._added,
                removed=self._removed,
                expired=self._expired,
                overflowed=self._overflowed,
                corrupt=int(self.set_aside is not None),
                replaced=self.replaced,
                budget_bytes=self.budget,
                disk_bytes=self.disk_bytes,
                free_bytes=self.free_bytes,
            )

    def close(self) -> None:
        """Close the database; any later call raises ``OutboxClosed`` (``stats`` keeps answering from memory)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(sqlite3.Error):  # a checkpoint only tidies up; the WAL is replayed at open
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
            self._watch.close()  # after SQLite's connection (``edgeline.daemon.outbox_files``)

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """The lock, on an outbox that is still open."""
        with self._lock:
            if self._lost is not None:
                raise OutboxLost(self._lost)
            if self._closed:
                raise OutboxClosed(f"outbox {self.path} is closed")
            yield

    # -- its files changed under it ------------------------------------------------------------------------------
    def _keep_files(self) -> None:
        """Under the lock, outside a transaction: when the files at the path are not the ones SQLite writes any
        more, say so and write what the outbox holds into a new one there (``_remake``)."""
        try:
            problem = self._watch.changed()
        except OSError as exc:  # a card that fails reading its files fails writing the new one too: said there
            problem = f"its files cannot be read ({exc.strerror or exc})"
        if problem is not None:
            self._remake(problem)

    def _remake(self, problem: str) -> None:
        """Said once; every answer the open connection still reads, into a new outbox at the path with its seq (the
        old one is closed first: SQLite's close removes ``-wal`` by name). Raises ``OutboxLost`` when it cannot."""
        self.replaced += 1
        log.error(
            "outbox %s: %s while the daemon ran: SQLite went on writing where a restart does not look. No input is "
            "acknowledged until what it holds (%d answers) is in a new outbox at that path",
            self.path, problem, self._depth,
        )  # fmt: skip
        rows, unreadable = self._read_all()
        lost_rows = max(0, self._depth - len(rows))
        last = max(self._last_seq, rows[-1][0] if rows else 0)
        try:
            try:
                self._clear_path()
            finally:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
                self._watch.close()
            self._db, self._watch = self._made_again(rows, last)
        except (sqlite3.Error, OSError, EdgelineError) as exc:
            self._closed = True
            self._depth = self._bytes = 0
            self._lost = (
                f"outbox {self.path}: {problem}, and no new outbox could be made there "
                f"({getattr(exc, 'strerror', None) or exc}): the {len(rows)} answers it held are lost with the process"
            )
            raise OutboxLost(self._lost) from exc
        self._depth, self._bytes = self._count()
        self.disk_bytes = files_bytes(self.path, self._wal)
        if unreadable is not None:
            log.error(
                "outbox %s: %d answers written into a new outbox; %d more could not be read back (%s) and are lost "
                "(their inputs were acknowledged)", self.path, len(rows), lost_rows, unreadable,
            )  # fmt: skip
        else:
            log.info("outbox %s: the %d answers it held are in a new outbox at that path", self.path, len(rows))

    def _read_all(self) -> tuple[list[tuple[int, str, bytes, float, float, bytes | None]], str | None]:
        """Every answer the open connection reads, oldest first, and why it stopped short (None: it did not)."""
        rows: list[tuple[int, str, bytes, float, float, bytes | None]] = []
        spoiled = 0
        try:  # one statement: as many rows as the table holds
            for row in self._db.execute(
                "SELECT seq, topic, payload, created, received, correlation FROM answers ORDER BY seq"
            ):
                if _whole(row):
                    rows.append(row)
                else:  # read from pages a truncation zeroed, which SQLite's cache did not hold
                    spoiled += 1
        except sqlite3.Error as exc:  # the same, found by SQLite
            return rows, str(exc)
        return rows, f"{spoiled} rows read back spoiled" if spoiled else None

    def _clear_path(self) -> None:
        """What is at the path: ours (truncated, overwritten) is removed, its answers read back; another's (a file
        moved over it) is renamed ``*.replaced-<time>-N`` and kept."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        for suffix in ("", "-wal", "-journal", "-shm"):
            found = Path(f"{self.path}{suffix}")
            if not os.path.lexists(found):
                continue
            if self._watch.ours(found):
                found.unlink()
            else:
                found.rename(self.path.with_name(f"{self.path.name}.replaced-{stamp}-{self.replaced}{suffix}"))

    def _made_again(
        self, rows: list[tuple[int, str, bytes, float, float, bytes | None]], last: int
    ) -> tuple[sqlite3.Connection, FilesWatch]:
        """A new outbox at the path holding ``rows`` with their seqs, the next seq above ``last``, on the disk."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for name in (self.path.name, f"{self.path.name}-wal", f"{self.path.name}-journal", f"{self.path.name}-shm"):
            check_destination(self.path.with_name(name))
        db, _, _ = self._open()
        try:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO answers (seq, topic, payload, created, received, correlation) VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            if db.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'answers'", (last,)).rowcount < 1:
                db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('answers', ?)", (last,))
            db.execute("COMMIT")
            flush_directory(self.path.parent)  # the new file's name, before anything is acknowledged on it
            return db, FilesWatch(self.path, self._wal)
        except BaseException:
            db.close()
            raise


class MemoryOutbox:
    """The outbox without the disk (``[outbox] enabled = false``): the same bounds, time to live, counters and
    calls, in memory. A crash loses what it holds. It keeps one rule of the durable outbox: the worker hands
    answers over and goes on, it never waits for the MQTT client (whose queue only paho's network thread drains,
    and that thread may itself be waiting for the worker's queue)."""

    path = None
    durable = False

    def __init__(self, *, max_answers: int = 100_000, max_bytes: int = 64 << 20, ttl_s: float = 86400.0):
        self.max_answers = max_answers
        self.max_bytes = max_bytes
        self.answer_bytes = self.budget = max_bytes
        self.disk_bytes = 0
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._rows: OrderedDict[int, Pending] = OrderedDict()
        self._seq = self._bytes = self._floor = 0
        self._added = self._removed = self._expired = self._overflowed = 0
        self.overflow_log = _overflow_log()
        self.expiry_log = _expiry_log()

    def add(
        self, answers: Sequence[ANSWER_ROW], *, remove: Sequence[int] = (), on_drop: OnDrop | None = None
    ) -> list[Pending]:
        self.remove(remove)
        now = time.time()
        added: list[Pending] = []
        with self._lock:
            for topic, payload, _, received, correlation in _rows(answers, now):
                self._seq += 1
                pending = Pending(self._seq, topic, payload, now, received, correlation)
                self._rows[self._seq] = pending
                added.append(pending)
                self._bytes += _row_size(topic, payload)
            self._added += len(answers)
            dropped: list[int] = []
            while self._rows and (len(self._rows) > self.max_answers or self._bytes > self.max_bytes):
                _, oldest = self._rows.popitem(last=False)
                self._bytes -= _row_size(oldest.topic, oldest.payload)
                dropped.append(oldest.seq)
                self._floor = oldest.seq
            if dropped and on_drop is not None:
                on_drop(dropped)  # under the lock: before any ``take`` can read what this add left
        if dropped and on_drop is None:
            self.count_overflow(len(dropped))
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
                    self._bytes -= _row_size(pending.topic, pending.payload)
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
                self._bytes -= _row_size(oldest.topic, oldest.payload)
                gone += 1
            self._expired += gone
        if gone:
            self.expiry_log.happened(gone, f"{gone} dropped (time to live {self.ttl_s:g} s)")
        return gone

    def drop(self, seq: int) -> None:
        with self._lock:
            pending = self._rows.pop(seq, None)
            if pending is not None:
                self._bytes -= _row_size(pending.topic, pending.payload)
                self._expired += 1

    def count_expired(self, count: int) -> None:
        with self._lock:
            self._expired += count
        self.expiry_log.happened(count, f"{count} dropped (time to live {self.ttl_s:g} s)")

    def count_overflow(self, count: int, *, bounds: bool = True) -> None:
        if count <= 0:
            return
        with self._lock:
            self._overflowed += count
        self.overflow_log.happened(count, _overflow_detail(self, count, bounds))

    @property
    def depth(self) -> int:
        return len(self._rows)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def bytes_cap(self) -> int:
        return self.max_bytes

    def check(self, *, truncate: bool = False) -> int:
        """Nothing to measure: no disk."""
        return self.budget

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
                budget_bytes=self.budget,
            )

    def close(self) -> None:
        """Nothing to close: what it still holds is lost with the process (said in the log by the daemon)."""
