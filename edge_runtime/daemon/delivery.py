"""The delivery path: answers from the worker to the broker, durably, oldest first, and no faster than the broker
takes them.

    worker ──add(answers, acks)──► committer thread ──outbox.add + COMMIT (one fsync per group)──┐
                                     (removes what the broker acknowledged, in the same commit)  │
    network thread ◄── hand-over: the committed answers, then the inputs' PUBACKs ◄──────────────┘
      _ready (≤ [broker] max_queued) ──pump──► in-flight window (≤ window) ──PUBACK──► acknowledged ──► removed
      outbox read back (``take``) when answers wait there that were never in ``_ready``: an outage, a restart

At every instant an input is unacknowledged at the broker (which redelivers it) or its answer is committed: see
``edgeline.daemon.outbox``. This module adds what keeps that true when the broker is slower than the inputs or
the disk is full:

- **Flow control** (``level``): the answers the broker has not accepted yet, plus what is on its way to the outbox.
  The daemon's intake gate (``edgeline.daemon.intake``) stops taking inputs from a source that can wait when it
  reaches a high-water mark and resumes below a low-water mark, so the backlog waits at the broker instead of
  being dropped at the outbox's cap.
- **A full disk** is a state: a commit that fails for lack of space is kept in memory and retried every
  ``DISK_RETRY_S``; nothing of it is acknowledged; the intake gate is shut meanwhile (``disk_full``); what is
  already stored is still delivered. Before each retry the outbox measures its budget again and checkpoints its WAL
  (``OutboxInterface.check``), so room that comes back is taken without a restart, and the inputs the broker held
  meanwhile are taken and answered. One line when it starts, one when it ends.
- **The budget** (``edgeline.disk``): the outbox measures the state directory's file system once a second
  (the committer calls ``check``); the intake gate's byte marks follow ``bytes_cap``, so a disk that others fill
  holds the inputs back at the broker before the outbox would have to drop an answer. Any other failure to write or
  read the outbox ends the committer, and the supervisor ends the process (exit 1).
- **Files deleted, truncated or replaced** under the outbox are the outbox's to notice, say and mend (a new outbox
  at the path holding every answer it still reads, before ``add`` returns: ``edgeline.daemon.outbox``), so the
  acknowledgements handed over after a commit are always for answers in the file a restart opens. When no new
  outbox can be made there (``OutboxLost``) the committer says so and ends the process (exit 1), as for any other
  outbox that cannot be written: a daemon that acknowledged inputs it cannot keep would look healthy and lose them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from edgeline.daemon.health import Metrics
from edgeline.daemon.mqtt import MqttSink
from edgeline.daemon.outbox import CHECK_EVERY_S, DiskFull, OutboxClosed, OutboxInterface, OutboxLost, Pending, row_size
from edgeline.daemon.transport import Transport
from edgeline.lograte import Repeated

__all__ = ["COMMIT_BACKLOG", "Delivery"]

log = logging.getLogger("edgeline.daemon")

COMMIT_BACKLOG = 32
"""Batches the worker may hand the committer ahead of the disk."""
REMOVE_EVERY_S = 0.1
"""With nothing to commit, the committer still removes what the broker acknowledged this often."""
REFILL = 256
"""Answers read back from the outbox at a time, when they could not be held in memory as they came."""
DISK_RETRY_S = 1.0
"""While the disk is full: how often the committer tries again."""
HELD_WHILE_FULL = 100_000
"""While the disk is full: answers held in memory at most, for sources that cannot wait (the intake gate holds
the others back); beyond it the oldest are dropped, counted as overflowed."""

Row = tuple[str, bytes, float, bytes | None]
"""An answer for the outbox: (topic, payload, received, an MQTT 5 request's correlation data or None)."""
Acks = list[Callable[[], None]]
T = TypeVar("T")


def _counted(rows: list[Row]) -> int:
    """The rows' bytes as the outbox counts them (``row_size``: payload, topic, a row's overhead), so that the
    intake gate's level and the outbox's cap speak of the same bytes (payloads alone fell 40% short of a small
    answer's share: on a 1 MB disk the gate shut too late and the outbox dropped answers)."""
    return sum(row_size(row[0], row[1]) for row in rows)


class Delivery:
    """Owns the outbox, the committer thread and the network thread's side of the answers (see the module).

    ``connection`` is any ``Transport`` (``edgeline.daemon.transport``): the broker's ``MqttConnection``, or an
    in-memory one in a test. The outbox is given open, or opened by ``open`` (``open_outbox``): the daemon builds
    its delivery path ready before it starts, and opens the outbox at start, under the state directory's lock."""

    outbox: OutboxInterface
    """Where answers wait for the broker: there once ``opened``."""

    def __init__(
        self,
        outbox: OutboxInterface | None,
        connection: Transport,
        sink: MqttSink,
        metrics: Metrics,
        *,
        max_queued: int,
        commit_interval_s: float,
        stopping: threading.Event,
        fail: Callable[[str], None] = lambda reason: None,
        open_outbox: Callable[[], OutboxInterface] | None = None,
    ):
        if (outbox is None) == (open_outbox is None):
            raise ValueError("Delivery takes an open outbox or open_outbox, one of them")
        self._open_outbox = open_outbox
        self.connection = connection
        self.sink = sink
        self.metrics = metrics
        self.max_queued = max_queued
        self.commit_interval_s = commit_interval_s
        self.stopping = stopping
        self.fail = fail
        """Ends the process (the supervisor's): an outbox that cannot be read any more."""
        self.refused_log = Repeated(log, "answers the broker refused (not retried)")
        self.opened = False
        self.durable = False
        self._commits: queue.Queue[tuple[list[Row], Acks] | None] = queue.Queue(COMMIT_BACKLOG)
        self._committer: threading.Thread | None = None
        self._acknowledged: deque[int] = deque()
        """Outbox seqs the broker has (their PUBACK came): the committer removes them with its next commit."""
        self._ready: deque[Pending] = deque()
        """Network thread: committed answers waiting for room in the in-flight window, oldest first."""
        self._handed = 0
        """Network thread: the highest outbox seq taken into ``_ready``."""
        self._spilled = False
        """Network thread: answers wait in the outbox that were never taken into ``_ready`` (it was full, or the
        last run left them): the tick reads them back, in order, as it empties."""
        self._drops_posted = 0
        """Committer (or worker): drops the bounds made, told to the network thread (``_dropped``)."""
        self._drops_counted = 0
        """Network thread: those it has counted (``_count_lost``). While some are not, the tick does not read back:
        a read-back moves ``_handed`` past the dropped seqs, and they would count as handed out, never as lost."""
        self._next_expiry = 0.0
        # flow control: each counter has one writer; readers add them up (a reading a moment old is fine)
        self._given = 0  # answers the worker handed over (worker)
        self._given_bytes = 0
        self._stored = 0  # answers the committer took out of ``_commits`` and stored, or dropped (committer)
        self._stored_bytes = 0
        self.disk_full_since: float | None = None
        """Monotonic time the disk became full, while it is."""
        self.disk_full_episodes = 0
        self.full_log = Repeated(log, "the disk is full", level=logging.ERROR)
        """A disk that fills and frees again and again (SQLite reuses its WAL in place) is said once, then summed."""
        self._drain_deadline = float("inf")
        self.answer_size = 256
        """Bytes of a recent answer as the outbox counts it (worker writes, any thread reads): the intake gate's
        estimate for the inputs not answered yet."""
        if outbox is not None:
            self._take(outbox)

    def open(self) -> None:
        """At start (under the state directory's lock): open the outbox, once."""
        if not self.opened:
            assert self._open_outbox is not None
            self._take(self._open_outbox())

    def _take(self, outbox: OutboxInterface) -> None:
        self.outbox = outbox
        self.durable = outbox.durable
        self._spilled = outbox.depth > 0  # answers the last run left: the tick reads them back
        self.opened = True

    # -- worker ------------------------------------------------------------------------------------------------
    def add(self, rows: list[Row], acks: Acks) -> None:
        """The answers of a batch of inputs; ``acks`` run on the network thread once the answers are stored."""
        self._given += len(rows)
        self._given_bytes += _counted(rows)
        if rows:
            self.answer_size = row_size(rows[-1][0], rows[-1][1])  # as the outbox counts it
        if self.durable:
            self._commits.put((rows, acks))  # blocks when COMMIT_BACKLOG batches wait: the disk holds us back
            return
        pending = self.outbox.add(rows, on_drop=self._dropped)
        self._hand_over(pending, acks)
        self._stored += len(rows)
        self._stored_bytes += _counted(rows)

    # -- flow control ------------------------------------------------------------------------------------------
    def level(self) -> tuple[int, int]:
        """(answers, bytes) not yet accepted by the broker: on their way to the outbox, or in it unacknowledged."""
        stats_bytes = self.outbox.used_bytes
        answers = self._given - self._stored + self.outbox.depth - len(self._acknowledged)
        return max(answers, 0), max(self._given_bytes - self._stored_bytes, 0) + stats_bytes

    @property
    def settled(self) -> bool:
        """Everything the worker handed over is stored (and its inputs' acknowledgements posted)."""
        return self._given == self._stored

    @property
    def disk_full(self) -> bool:
        return self.disk_full_since is not None

    # -- committer thread: group commit ------------------------------------------------------------------------
    def start(self, spawn: Callable[[str, Callable[[], None]], threading.Thread]) -> None:
        if self.durable:
            self._committer = spawn("edgeline-committer", self._commit_loop)

    def _commit_loop(self) -> None:
        try:
            self._commit_until_done()
        except OutboxLost as exc:  # said by the outbox; the daemon says it again as why it stopped (exit 1)
            self.fail(str(exc))
        except OutboxClosed:  # the drain time ran out while a full disk kept us retrying: the stop goes on
            log.error("the committer stopped with the drain time; what it held was not acknowledged")

    def _commit_until_done(self) -> None:
        """Commit what the worker handed over, as many batches as have queued up, together with the removal of
        what the broker acknowledged meanwhile, in one transaction (one fsync); then hand the answers and the
        inputs' acknowledgements to the network thread in one go. The worker goes on with the next batch
        meanwhile; it waits only when ``COMMIT_BACKLOG`` batches are queued."""
        commits, outbox = self._commits, self.outbox
        interval = self.commit_interval_s
        held: deque[tuple[list[Row], Acks]] = deque()  # taken, not stored yet (the disk was full)
        removing: list[int] = []  # acknowledged, not removed yet (the disk was full)
        finished = False
        last_commit = 0.0
        while not finished or held:
            items: list[tuple[list[Row], Acks] | None] = []
            if not finished:
                with contextlib.suppress(queue.Empty):
                    items.append(commits.get(timeout=DISK_RETRY_S if self.disk_full else REMOVE_EVERY_S))
                # group commit: let what comes gather until the interval since the last commit is over (fewer
                # fsyncs, less CPU and flash wear per answer, one wake-up per interval however fast the stream)
                if items and items[0] is not None and (left := last_commit + interval - time.monotonic()) > 0:
                    time.sleep(left)
                while True:
                    try:
                        items.append(commits.get_nowait())
                    except queue.Empty:
                        break
            elif self.disk_full:
                if time.monotonic() >= self._drain_deadline:
                    log.error(
                        "stopping on a full disk: %d answers could not be stored; their inputs were not "
                        "acknowledged and come again at the next start", sum(len(rows) for rows, _ in held),
                    )  # fmt: skip
                    return
                time.sleep(0.2)
            finished = finished or any(item is None for item in items)
            held.extend(item for item in items if item is not None)
            self._hold_within_bounds(held)
            self._expire()
            removing.extend(self._take_acknowledged())
            if not held:
                if removing and self._store(functools.partial(outbox.remove, removing))[0]:
                    removing = []
                continue
            rows = [row for batch_rows, _ in held for row in batch_rows]
            stored, added = self._store(functools.partial(outbox.add, rows, remove=removing, on_drop=self._dropped))
            if not stored or added is None:
                continue
            last_commit = time.monotonic()
            removing = []
            acks = [ack for _, batch_acks in held for ack in batch_acks]
            held.clear()
            self._hand_over(added, acks)
            self._stored += len(rows)  # after the hand-over: ``settled`` means the acknowledgements are posted
            self._stored_bytes += _counted(rows)

    def _store(self, write: Callable[[], T]) -> tuple[bool, T | None]:
        """One write of the outbox: (True, what it returns), or (False, None) when the disk is full (said once; the
        caller keeps what it wanted to write and tries again)."""
        try:
            result = write()
        except DiskFull as exc:
            if self.disk_full_since is None:
                self.disk_full_since = time.monotonic()
                self.disk_full_episodes += 1
                self.metrics.count("disk_full")
                self.full_log.happened(
                    1,
                    f"{exc}; intake paused (nothing is acknowledged that is not stored), answers already stored are "
                    f"still delivered; retrying every {DISK_RETRY_S:g} s",
                )
            return False, None
        if self.disk_full_since is not None:
            log.info(
                "outbox %s: room on the disk again after %.1f s (a budget of %d bytes): intake resumes",
                self.outbox.path, time.monotonic() - self.disk_full_since, self.outbox.budget,
            )  # fmt: skip
            self.disk_full_since = None
        return True, result

    def _hold_within_bounds(self, held: deque[tuple[list[Row], Acks]]) -> None:
        """While the disk is full, a source that cannot wait goes on: keep at most ``HELD_WHILE_FULL`` answers,
        dropping the oldest (their inputs are never acknowledged: QoS 0 has nothing to acknowledge)."""
        total = sum(len(rows) for rows, _ in held)
        while total > HELD_WHILE_FULL and len(held) > 1:
            rows, _ = held.popleft()
            total -= len(rows)
            self._stored += len(rows)
            self._stored_bytes += _counted(rows)
            self.outbox.count_overflow(len(rows), bounds=False)

    def _take_acknowledged(self) -> list[int]:
        acknowledged, taken = self._acknowledged, []
        while acknowledged:
            taken.append(acknowledged.popleft())
        return taken

    def _expire(self) -> None:
        """At most once a second: drop (and count) the answers past their time to live, and measure the outbox's
        budget again (``OutboxInterface.check``; on a full disk, with its WAL checkpointed and truncated, so that
        what SQLite can give back is given back before the next retry)."""
        if time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + CHECK_EVERY_S
            with contextlib.suppress(
                DiskFull, OutboxClosed
            ):  # the expired rows are never handed out all the same (``take``,
                self.outbox.expire()  # and ``_publish``, check their age)
            try:  # also where files changed under an idle outbox are found (and mended)
                self.outbox.check(truncate=self.disk_full)
            except OutboxLost:
                raise
            except (OutboxClosed, sqlite3.Error, OSError):  # measured again at the next turn
                pass

    # -- network thread: answers to the client -----------------------------------------------------------------
    def _dropped(self, seqs: list[int]) -> None:
        """The bounds dropped these answers (committed): posted before the hand-over of the commit that dropped
        them, so that every earlier hand-over has run when the network thread counts them; and under the outbox's
        lock, so that no read-back sees the commit before the count is posted."""
        self._drops_posted += 1
        self.connection.call_soon(lambda: self._count_lost(seqs))

    def _count_lost(self, seqs: list[int]) -> None:
        """Network thread: of the dropped answers, those never handed to the client are lost (the others are in
        ``_ready`` or in flight, from memory, and are delivered all the same)."""
        handed = self._handed
        try:
            self.outbox.count_overflow(sum(1 for seq in seqs if seq > handed))
        finally:  # counted or not, the read-back must not wait for it for ever
            self._drops_counted += 1

    def _hand_over(self, pending: list[Pending], acks: Acks) -> None:
        """Stored answers and their inputs' acknowledgements to the network thread: one task, one wake-up."""
        self.connection.call_soon(lambda: self._handed_over(pending, acks))

    def _handed_over(self, pending: list[Pending], acks: Acks) -> None:
        for ack in acks:
            ack()
        if not self._spilled:
            ready, limit = self._ready, self.max_queued
            for answer in pending:
                if len(ready) >= limit:
                    self._spilled = True  # the rest wait in the outbox: the tick reads them back, in order
                    break
                if answer.seq > self._handed:
                    ready.append(answer)
                    self._handed = answer.seq
        self.pump()

    def tick(self) -> None:
        """Every turn of the network loop: fill the in-flight window from the answers ready, and those from the
        outbox when some wait there that were never handed over (once every drop the bounds made is counted: see
        ``_drops_counted``). Cheap when there is nothing to do."""
        if not self.durable:
            self._expire()
        limit = self.max_queued
        room = limit - len(self._ready)
        if self._spilled and room >= max(1, min(REFILL, limit // 2)) and self._drops_counted == self._drops_posted:
            try:
                waiting = self.outbox.take(min(room, REFILL), after=self._handed)
            except OutboxClosed:
                return
            except (sqlite3.Error, OSError) as exc:  # deaf for ever otherwise: let systemd start a fresh one
                self._spilled = False
                self.fail(f"outbox {self.outbox.path} cannot be read: {exc}")
                return
            if waiting:
                self._ready.extend(waiting)
                self._handed = waiting[-1].seq
                self.metrics.count("outbox_read_back", len(waiting))
            else:
                self._spilled = False  # what is committed from now on is handed over as it comes
        self.pump()

    def pump(self) -> None:
        """Publish ready answers, oldest first, while the window has room (network thread)."""
        ready = self._ready
        if not ready or not self.sink.ready:
            return
        room = self.connection.room
        while ready and room > 0:
            answer = ready.popleft()
            if not self._publish(answer):
                ready.appendleft(answer)
                return
            room -= 1

    def _publish(self, pending: Pending) -> bool:
        """One answer to the client (or dropped, counted, past its time to live); False when it cannot take it."""
        age = time.time() - pending.created
        if age > self.outbox.ttl_s:
            self._drop_expired(pending.seq)
            return True
        done = self._done_callback(pending)
        expiry_at = pending.created + self.outbox.ttl_s
        return self.sink.publish(
            pending.topic, pending.payload, expiry_at=expiry_at, correlation=pending.correlation, done=done
        )

    def _drop_expired(self, seq: int) -> None:
        """Network thread: an answer past its time to live, never to be sent: gone, counted as expired once."""
        try:
            self.outbox.drop(seq)
        except DiskFull:
            self._acknowledged.append(seq)  # removed with the next commit that can be made
            self.outbox.count_expired(1)
        except OutboxClosed:
            pass

    def _done_callback(self, pending: Pending) -> Callable[[bool, str | None], None]:
        seq, created, received = pending.seq, pending.created, pending.received

        def done(ok: bool, reason: str | None) -> None:
            now = time.time()
            if ok:
                self.metrics.count("published")
                self.metrics.observe("publish", max(0.0, now - created))
                self.metrics.observe("total", max(0.0, now - received))
            elif reason == "expired":  # its time to live ran out while it waited for a resend: counted once, by the
                self._drop_expired(seq)  # outbox, unless the outbox's own expiry has already taken (and counted) it
                return
            else:
                self.metrics.count("publish_refused")
                self.refused_log.happened(1, f"{reason}")
            if self.durable:
                self._acknowledged.append(seq)
            else:
                self.outbox.remove([seq])

        return done

    # -- stopping ----------------------------------------------------------------------------------------------
    def stop(self, deadline: float) -> None:
        """After the worker's last batch: let the committer store it, then flush what the broker takes."""
        self._drain_deadline = deadline
        if self._committer is not None:
            try:
                self._commits.put(None, timeout=max(0.1, deadline - time.monotonic()))
            except queue.Full:
                log.error("the committer did not take the last batches before the drain time ran out")
            self._committer.join(max(0.1, deadline - time.monotonic()))
        self.flush(deadline)

    def flush(self, deadline: float) -> None:
        """Until the broker has every answer (the network thread sends them, reading back what waits), as long as
        it is connected and the drain time lasts."""
        committer_done = self._committer is None or not self._committer.is_alive()
        while self.connection.connected.is_set() and time.monotonic() < deadline:
            if committer_done:
                self._remove_acknowledged()
            if self.outbox.depth == 0:
                break
            time.sleep(0.02)
        if committer_done:
            self._remove_acknowledged()

    def _remove_acknowledged(self) -> None:
        taken = self._take_acknowledged()
        try:
            self.outbox.remove(taken)
        except DiskFull:
            self._acknowledged.extendleft(reversed(taken))  # sent again at the next start: a duplicate, no loss
        except OutboxLost:  # said when it was lost
            pass
        except (sqlite3.Error, OSError, OutboxClosed) as exc:
            log.error("outbox %s: could not remove %d delivered answers (%s): they are sent again at the next "
                      "start", self.outbox.path, len(taken), exc)  # fmt: skip

    def close(self) -> None:
        depth = self.outbox.depth
        if depth and self.durable:
            log.info("%d answers stay in the outbox for the next start", depth)
        elif depth:
            log.warning("%d answers in the memory outbox are lost ([outbox] enabled = false)", depth)
        self.outbox.close()
