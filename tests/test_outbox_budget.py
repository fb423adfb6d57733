"""The outbox's budget on the disk (``edgeline.disk``): the smaller of ``max_bytes`` and a share of the
state directory's file system, its WAL included, measured again at every check; what the outbox holds is never
dropped because the budget shrank. On small tmpfs mounts of the test's own (root only), without a daemon."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeline.daemon.outbox import DiskFull, Outbox, row_size
from edgeline.disk import DISK_SHARE, MIN_BUDGET, budget, file_system, files_bytes, mount_of
from tests.faults import can_mount, fill, tmpfs

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

MB = 1 << 20


@pytest.fixture
def one_mb(tmp_path: Path) -> Iterator[Path]:
    if not can_mount():
        pytest.skip("mounting a tmpfs needs root and mount(8) (CI runs as root)")
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def rows(count: int, size: int = 200, start: int = 0) -> list[tuple[str, bytes, float]]:
    return [(f"edgeline/m/d{i}/result", bytes([i % 251]) * size, time.time()) for i in range(start, start + count)]


def test_the_budget_is_the_smaller_of_max_bytes_and_the_share_and_never_below_the_floor() -> None:
    assert budget(64 * MB, 3 * MB, 0) == int(DISK_SHARE * 3 * MB)
    assert budget(64 * MB, 2 * MB, 1 * MB) == int(DISK_SHARE * 3 * MB)  # what the outbox holds counts back in
    assert budget(1 * MB, 100 * MB, 0) == 1 * MB
    assert budget(64 * MB, 0, 0) == MIN_BUDGET  # a full disk: the full-disk state, not a budget of nothing
    assert budget(100 << 10, 0, 0) == 100 << 10  # ... unless max_bytes is smaller still
    assert budget(64 * MB, None, 0) == 64 * MB  # not measurable: what is configured


def test_the_mount_table_says_which_file_system_a_path_is_on() -> None:
    table = (
        "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
        "27 1 179:2 / / rw,noatime - ext4 /dev/mmcblk0p2 rw\n"
        "40 27 0:40 / /var/lib/edge\\040line rw - tmpfs tmpfs rw,size=3072k\n"
        "41 27 7:0 / /var/lib/edge\\040line rw - ext4 /dev/loop0 rw\n"
    )
    assert mount_of("/var/lib/edge line/state/m", table) == ("/var/lib/edge line", "ext4", "/dev/loop0")
    assert mount_of("/var/lib/edge linen", table) == ("/", "ext4", "/dev/mmcblk0p2")
    assert mount_of("/proc", table) == ("/proc", "proc", "proc")
    assert mount_of("/x", "") is None


def test_an_outbox_on_a_1_mb_disk_keeps_its_files_within_its_share(one_mb: Path) -> None:
    """Default ``max_bytes`` (64 MiB) on a 1 MB disk: the budget is half of it, and however many answers come and
    go (each commit removes what the broker acknowledged), database and WAL together stay within it."""
    path = one_mb / "state" / "outbox.sqlite"
    box = Outbox(path)
    try:
        total = file_system(one_mb).total_bytes
        assert total is not None
        assert box.budget <= DISK_SHARE * total and box.budget == box.check()
        peak, acknowledged = 0, []
        for turn in range(200):
            added = box.add(rows(25, start=turn * 25), remove=acknowledged)
            acknowledged = [p.seq for p in added[:20]]  # the broker lags: the outbox grows as it goes
            peak = max(peak, files_bytes(path, Path(f"{path}-wal")))
            if turn % 20 == 0:
                box.check()
        stats = box.stats()
        assert peak <= box.budget, f"{peak} bytes on the disk, past the budget of {box.budget}"
        assert stats.budget_bytes == box.budget and 0 < stats.disk_bytes <= box.budget
        assert stats.free_bytes is not None and stats.free_bytes > 0
    finally:
        box.close()


def test_a_wal_past_its_share_is_checkpointed_and_truncated(one_mb: Path) -> None:
    path = one_mb / "outbox.sqlite"
    box = Outbox(path, max_bytes=256 << 10)  # a WAL of 64 KiB at most
    try:
        for turn in range(40):  # each commit adds a few pages to the WAL
            box.add(rows(20, size=1000, start=turn * 20), remove=list(range(turn * 20 - 19, turn * 20 + 1)))
            assert Path(f"{path}-wal").stat().st_size <= box.wal_limit + 64 * 1024  # at most one commit past it
    finally:
        box.close()


def test_a_budget_that_shrinks_below_what_the_outbox_holds_drops_nothing(one_mb: Path) -> None:
    """Others fill the disk: the budget shrinks at the next check, the outbox stops growing, and the answers it
    holds (their inputs acknowledged) are all still there; room that comes back grows the budget again."""
    path = one_mb / "state" / "outbox.sqlite"
    box = Outbox(path)
    try:
        box.add(rows(600))
        before = box.check()
        filler = one_mb / "filler"
        filler.touch()
        fill(filler)
        shrunk = box.check(truncate=True)
        assert shrunk < before
        assert box.bytes_cap >= box.used_bytes  # nothing to drop: it stops growing
        with contextlib.suppress(DiskFull):  # the disk, not the budget, refuses it: nothing stored, nothing dropped
            box.add(rows(1, start=600))
        assert box.depth >= 600 and box.stats().overflowed == 0
        filler.unlink()
        assert box.check() > shrunk
    finally:
        box.close()


def test_a_full_disk_does_not_shrink_the_budget_the_held_answers_were_taken_within(one_mb: Path) -> None:
    """The committer holds what a full disk refused and commits it once there is room: measured on the full disk the
    budget would be a sliver and that commit would drop the oldest answers (their inputs then acknowledged, the
    answers lost). While the disk is full the budget only grows; the held answers are stored whole."""
    box = Outbox(one_mb / "state" / "outbox.sqlite")
    try:
        box.add(rows(10))
        before = box.check()
        filler = one_mb / "filler"
        filler.touch()
        fill(filler)
        held: list[tuple[str, bytes, float]] = []
        for turn in range(200):  # the WAL's room in place runs out within a few commits
            batch = rows(50, start=10 + turn * 50)
            try:
                box.add(batch)
            except DiskFull:
                held = batch
                break
        assert held, "the disk never refused a commit"
        assert box.check(truncate=True) >= before  # on the full disk: not shrunk
        filler.unlink()
        assert box.check() >= before
        added = box.add(held)
        assert len(added) == len(held) and box.stats().overflowed == 0
    finally:
        box.close()


def leave_free(disk: Path, free: int) -> Path:
    """Take all but about ``free`` bytes of the disk with one file (others writing to it)."""
    filler = disk / "filler"
    info = os.statvfs(disk)
    filler.write_bytes(b"\0" * max(0, info.f_bavail * info.f_frsize - free))
    return filler


def test_answers_on_their_way_when_the_budget_shrinks_are_all_stored(one_mb: Path) -> None:
    """Others fill the disk while answers are on their way to the outbox (their inputs came in within the budget
    before, and are acknowledged once these are stored): the commit that meets the shrunk budget first stores every
    one, and drops no older one in their place."""
    box = Outbox(one_mb / "state" / "outbox.sqlite")
    try:
        box.remove([p.seq for p in box.add(rows(10))])  # the warm-up, acknowledged
        kept = box.add(rows(5, start=10))  # unacknowledged, stored before
        batch = rows(700, start=15)  # received now, before the shrink
        before = box.answer_bytes
        leave_free(one_mb, 600 << 10)
        box.check()
        size = sum(row_size(topic, payload) for topic, payload, _ in batch)
        assert box.answer_bytes < before and box.answer_bytes < size, "the budget did not shrink below the batch"
        added = box.add(batch)
        assert len(added) == len(batch) and box.stats().overflowed == 0
        assert box.depth == len(kept) + len(batch)
        assert [p.seq for p in box.take(len(kept))] == [p.seq for p in kept]
    finally:
        box.close()


def test_a_commit_the_full_disk_refused_is_handed_over_whole_once_there_is_room(one_mb: Path) -> None:
    """A commit whose answers came after the budget shrank (the bounds drop the oldest of them in its transaction),
    refused by the full disk, then retried once there is room (the bounds drop nothing now): every answer it stored
    is handed over. The drops of the refused transaction must go with it: counted as dropped, 27 stored answers
    were never sent, their inputs acknowledged (a daemon without a restart answered 4,973 of 5,000)."""
    box = Outbox(one_mb / "state" / "outbox.sqlite")
    try:
        box.remove([p.seq for p in box.add(rows(10))])
        filler = one_mb / "filler"
        filler.touch()
        fill(filler)
        box.check(truncate=True)
        held = rows(700, start=10)  # received after the shrink
        assert sum(row_size(topic, payload) for topic, payload, _ in held) > box.answer_bytes
        with pytest.raises(DiskFull):
            box.add(held)
        filler.unlink()
        box.check()
        added = box.add(held)
        assert len(added) == len(held) and box.stats().overflowed == 0
        assert box.depth == len(held)
    finally:
        box.close()
