"""The outbox's contract, on disk (SQLite) and in memory (``[outbox] enabled = false``): oldest first, bounded by
count and bytes (the oldest go, counted), a time to live (expired answers are dropped and counted, never handed
out), removal on PUBACK, batched with the next commit, reading back from any seq; and on disk, what was committed
survives a new process."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from edgeline.daemon.outbox import MemoryOutbox, Outbox, row_size

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

Box = Outbox | MemoryOutbox
MakeBox = Callable[..., Box]


@pytest.fixture(params=["sqlite", "memory"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> MakeBox:
    def factory(*, max_answers: int = 100_000, max_bytes: int = 64 << 20, ttl_s: float = 86400.0) -> Box:
        if request.param == "sqlite":
            return Outbox(tmp_path / "outbox.sqlite", max_answers=max_answers, max_bytes=max_bytes, ttl_s=ttl_s)
        return MemoryOutbox(max_answers=max_answers, max_bytes=max_bytes, ttl_s=ttl_s)

    return factory


def answers(count: int, start: int = 0, size: int = 10) -> list[tuple[str, bytes, float]]:
    return [(f"results/d{i}", bytes([i % 256]) * size, time.time()) for i in range(start, start + count)]


def test_answers_come_out_oldest_first_and_leave_on_removal(make: MakeBox) -> None:
    box = make()
    added = box.add(answers(5))
    assert [p.topic for p in added] == [f"results/d{i}" for i in range(5)]
    assert [p.seq for p in added] == sorted({p.seq for p in added})  # committed seqs, handed back in order
    first = box.take(3)
    assert first == added[:3]
    assert [p.topic for p in box.take(10, after=first[-1].seq)] == ["results/d3", "results/d4"]
    assert box.take(10, after=added[-1].seq) == []
    box.remove([p.seq for p in first])
    assert box.depth == 2
    assert [p.topic for p in box.take(10)] == ["results/d3", "results/d4"]  # what is left, from the start
    stats = box.stats()
    assert (stats.added, stats.removed, stats.depth) == (5, 3, 2)
    assert stats.bytes == sum(row_size(p.topic, p.payload) for p in added[3:])


def test_acknowledged_answers_leave_in_the_next_commit(make: MakeBox) -> None:
    box = make()
    first = box.add(answers(600))  # past one DELETE statement's worth of seqs
    second = box.add(answers(2, start=600), remove=[p.seq for p in first])
    assert box.depth == 2 and box.take(10) == second
    stats = box.stats()
    assert (stats.added, stats.removed) == (602, 600)
    assert stats.bytes == sum(row_size(p.topic, p.payload) for p in second)
    assert box.add([], remove=[second[0].seq]) == [] and [p.topic for p in box.take(10)] == ["results/d601"]


def test_past_the_count_cap_the_oldest_are_dropped_and_counted(make: MakeBox) -> None:
    box = make(max_answers=4)
    box.add(answers(3))
    box.add(answers(3, start=3))
    assert [p.topic for p in box.take(10)] == ["results/d2", "results/d3", "results/d4", "results/d5"]
    assert box.stats().overflowed == 2
    assert [p.topic for p in box.add(answers(6, start=6))] == ["results/d8", "results/d9", "results/d10", "results/d11"]


def test_past_the_byte_cap_the_oldest_are_dropped_and_counted(make: MakeBox) -> None:
    box = make(max_bytes=8192)
    size = box.answer_bytes // 2 - 60  # two fit (the WAL's share of max_bytes left out, on disk), three do not
    added = box.add(answers(3, size=size))
    assert box.depth == 2 and box.stats().overflowed == 1
    assert box.stats().bytes == sum(row_size(p.topic, p.payload) for p in added) <= box.answer_bytes


class FakeClock:
    """Stands in for the ``time`` module inside ``edgeline.daemon.outbox``: its wall clock moves only when told, so
    an answer's age is what the test says, however slow the machine (an fsync, a busy CPU) between two calls."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:  # strftime, gmtime...: the real ones
        return getattr(time, name)


def test_expired_answers_are_dropped_never_handed_out(make: MakeBox, monkeypatch: pytest.MonkeyPatch) -> None:
    import edgeline.daemon.outbox as outbox_module

    clock = FakeClock()
    monkeypatch.setattr(outbox_module, "time", clock)
    box = make(ttl_s=60.0)
    box.add(answers(3))
    clock.now += 60.5  # the first three are past their time to live...
    box.add(answers(1, start=3))  # ...and this one is new
    assert [p.topic for p in box.take(10)] == ["results/d3"]
    assert box.expire() == 3
    stats = box.stats()
    assert stats.expired == 3 and stats.depth == 1
    assert stats.oldest_age_s == 0.0  # the clock has not moved since the last add
    clock.now += 59.0  # still within its time to live: neither expired nor withheld
    assert box.expire() == 0 and [p.topic for p in box.take(10)] == ["results/d3"]


def test_committed_answers_survive_the_process(tmp_path: Path) -> None:
    """Another process adds and is killed without closing; this one finds every committed answer."""
    path = tmp_path / "outbox.sqlite"
    script = (
        "import os, signal, sys, time\n"
        "from edgeline.daemon.outbox import Outbox\n"
        f"box = Outbox(__import__('pathlib').Path({str(path)!r}))\n"
        "box.add([(f'results/d{i}', b'x', time.time()) for i in range(50)])\n"
        "box.remove([1, 2])\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -9, done.stderr.decode()
    box = Outbox(path)
    assert box.depth == 48
    assert [p.topic for p in box.take(2)] == ["results/d2", "results/d3"]
    box.close()


def test_an_outbox_of_the_earlier_schema_is_opened_and_keeps_its_answers(tmp_path: Path) -> None:
    """Before MQTT 5 replies, rows had no correlation column: such a file is upgraded in place, nothing lost."""
    import sqlite3

    path = tmp_path / "outbox.sqlite"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE answers (seq INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, payload BLOB NOT NULL, "
        "created REAL NOT NULL, received REAL NOT NULL)"
    )
    db.execute(
        "INSERT INTO answers (topic, payload, created, received) VALUES ('r/a', x'7b7d', ?, ?)", (time.time(),) * 2
    )
    db.commit()
    db.close()
    box = Outbox(path)
    try:
        assert [(p.topic, p.payload, p.correlation) for p in box.take(10)] == [("r/a", b"{}", None)]
        box.add([("r/b", b"[]", time.time(), b"corr")])
        assert [p.correlation for p in box.take(10)] == [None, b"corr"]
    finally:
        box.close()


def test_a_closed_outbox_refuses_calls_by_name_and_still_reports_its_counts(tmp_path: Path) -> None:
    """A thread that outlives the drain time (the committer retrying a full disk) meets ``OutboxClosed``, which it
    expects, never sqlite3's ProgrammingError; the status keeps its figures."""
    from edgeline.daemon.outbox import OutboxClosed

    box = Outbox(tmp_path / "outbox.sqlite")
    box.add(answers(3))
    box.close()
    for call in (lambda: box.add(answers(1)), lambda: box.take(1), lambda: box.remove([1]), box.expire):
        with pytest.raises(OutboxClosed):
            call()
    assert box.stats().depth == 3 and box.stats().added == 3
    box.close()  # twice: nothing


@pytest.mark.parametrize("suffix", ["", "-wal", "-journal", "-shm"])
@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_an_outbox_file_someone_planted_is_refused_by_name_and_nothing_outside_written(
    tmp_path: Path, suffix: str, plant: str
) -> None:
    import os

    from edgeline.errors import EdgelineError

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    state = tmp_path / "state"
    state.mkdir()
    planted = state / f"outbox.sqlite{suffix}"
    if plant == "link":
        planted.symlink_to(outside)
    else:
        os.mkfifo(planted)
    with pytest.raises(EdgelineError, match=re.escape(str(planted))):
        Outbox(state / "outbox.sqlite")
    assert outside.read_bytes() == b"keep me"
