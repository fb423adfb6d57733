"""Power cuts from a block write log (issue 35), without a VM: the dm-log-writes parser against logs QEMU's own
blklogwrites driver wrote (through ``qemu-io``, Debian's qemu-utils), replay to each flush byte for byte, cut plans
that are a function of their seed, and the offline check of ext4 images made with ``mke2fs -d`` (a good one, and
ones broken where the check must look: the outbox's pages, ``state.json``, the file system's own metadata).

The parser and the planner are pure (quick: synthetic logs); whatever runs qemu-io or e2fsprogs is integration.
The same machinery on a booted guest's log is the ``vm`` tier's (``scripts/vm.sh power-cut``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import struct
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeline.errors import EdgelineError
from edgeline.sim.imagecheck import check_image, outbox_state
from edgeline.sim.powercut import CacheModel, KeptWrite, main, plan_cuts, replay_cuts, window
from edgeline.sim.writelog import LOG_MAGIC, Flag, ImageWriter, Tail, WriteLogError, parse_log, read_log

SECTOR = 512
SQRT_BUNDLE = Path(__file__).parent / "data" / "sqrt-fp32"
"""A committed bundle the host can run (LiteRT): the committed version of the image's state directory."""
QEMU_IO = shutil.which("qemu-io")
E2FS_DIRS = "/usr/sbin:/sbin:" + os.environ.get("PATH", "")

# -- synthetic logs (quick) ----------------------------------------------------------------------------------------


def synthetic_log(requests: list[tuple[int, int, int, bytes]], *, counted: int | None = None) -> bytes:
    """A log of (sector, nr_sectors, flags, data) requests, the way QEMU lays one out."""
    body = b""
    for sector, nr_sectors, flags, data in requests:
        body += struct.pack("<QQQQ", sector, nr_sectors, flags, 0).ljust(SECTOR, b"\0") + data
    count = len(requests) if counted is None else counted
    return struct.pack("<QQQI", LOG_MAGIC, 1, count, SECTOR).ljust(SECTOR, b"\0") + body


def sample_requests(seed: int = 1, flushes: int = 5) -> list[tuple[int, int, int, bytes]]:
    rng = random.Random(seed)
    requests: list[tuple[int, int, int, bytes]] = []
    for _ in range(flushes):
        for _ in range(rng.randrange(1, 6)):
            count = rng.randrange(1, 9)
            requests.append((rng.randrange(0, 120), count, 0, rng.randbytes(count * SECTOR)))
        requests.append((0, 0, int(Flag.FLUSH), b""))
    return requests


@pytest.mark.quick
def test_a_log_s_entries_flushes_and_data_are_where_the_format_puts_them() -> None:
    requests = sample_requests()
    data = synthetic_log(requests)
    log = parse_log(data)
    assert (log.sector_size, log.counted, log.size) == (SECTOR, len(requests), len(data))
    assert [(e.sector, e.nr_sectors, int(e.flags)) for e in log.entries] == [r[:3] for r in requests]
    assert [data[e.data_offset : e.data_offset + e.length] for e in log.entries] == [r[3] for r in requests]
    assert log.flushes == tuple(i for i, r in enumerate(requests) if r[2] & Flag.FLUSH)


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_log_cut_short_anywhere_is_an_error_naming_an_offset_inside_it(data: st.DataObject) -> None:
    whole = synthetic_log(sample_requests(data.draw(st.integers(0, 50))))
    cut = data.draw(st.integers(0, len(whole) - 1))
    with pytest.raises(WriteLogError, match=r"offset \d+") as caught:
        parse_log(whole[:cut])
    assert 0 <= caught.value.offset <= cut


@pytest.mark.quick
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096), st.integers(0, 3000), st.binary(min_size=1, max_size=64))
def test_garbage_is_read_or_refused_by_offset_never_a_traceback(prefix: bytes, at: int, junk: bytes) -> None:
    """Random bytes, and a real log with bytes overwritten anywhere: a parsed log or a WriteLogError, nothing else."""
    for candidate in (prefix, synthetic_log(sample_requests(2)), struct.pack("<QQ", LOG_MAGIC, 1) + prefix):
        damaged = bytearray(candidate)
        damaged[at : at + len(junk)] = junk
        for tail in Tail:
            try:
                parse_log(bytes(damaged), tail=tail, device_bytes=1 << 20)
            except WriteLogError as exc:
                assert "offset" in str(exc)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda b: b"\0" * 8 + b[8:], "offset 0: magic 0x0 is not dm-log-writes'"),
        (lambda b: b[:8] + struct.pack("<Q", 2) + b[16:], "offset 8: version 2"),
        (lambda b: b[:24] + struct.pack("<I", 1000) + b[28:], "offset 24: sector size 1000"),
        (
            lambda b: b[: SECTOR + 16] + struct.pack("<Q", 1 << 7) + b[SECTOR + 24 :],
            "offset 512: entry 0: unknown flags",
        ),
        (lambda b: b[:SECTOR] + b"\0" * SECTOR + b[2 * SECTOR :], "offset 512: entry 0: a request of no sectors"),
        (lambda b: b[:-1], "cut short"),
    ],
)
def test_each_kind_of_damage_is_named_with_its_offset(damage: object, expected: str) -> None:
    whole = synthetic_log(sample_requests())
    with pytest.raises(WriteLogError, match=expected.replace("(", r"\(")):
        parse_log(damage(whole))  # type: ignore[operator]


@pytest.mark.quick
def test_a_write_past_the_device_s_end_is_refused_when_its_size_is_known() -> None:
    data = synthetic_log([(100, 4, 0, bytes(4 * SECTOR)), (0, 0, int(Flag.FLUSH), b"")])
    assert len(parse_log(data).entries) == 2
    with pytest.raises(WriteLogError, match="go past the device's 51200 bytes"):
        parse_log(data, device_bytes=100 * SECTOR)


@pytest.mark.quick
def test_the_tail_past_the_super_s_count_is_read_only_when_asked() -> None:
    """A killed QEMU leaves whole entries past the count its last super update wrote, then zeros (or nothing)."""
    requests = sample_requests()
    data = synthetic_log(requests, counted=3) + bytes(4 * SECTOR)
    assert len(parse_log(data).entries) == 3
    assert len(parse_log(data, tail=Tail.READ).entries) == len(requests)
    half = synthetic_log(requests, counted=3)[: -(SECTOR + SECTOR // 2)]  # the last flush, half the write before
    assert len(parse_log(half, tail=Tail.READ).entries) == len(requests) - 2  # its flush, and it, left out


@pytest.mark.quick
def test_cut_plans_are_a_function_of_the_seed_and_keep_only_writes_of_their_window() -> None:
    log = parse_log(synthetic_log(sample_requests(flushes=12)))
    first, again, other = (plan_cuts(log, 8, seed) for seed in (7, 7, 8))
    assert first == again and first != other
    assert len({cut.flush for cut in first}) == 8, "no flush twice while there are enough"
    model = CacheModel(keep=0.5, tear=0.5)
    for cut in plan_cuts(log, 30, 3, model=model):
        writes = window(log, cut.flush)
        assert cut.window == len(writes) and cut.durable == log.flushes[cut.flush]
        indices = {entry.index for entry in writes}
        for kept in cut.kept:
            assert kept.entry in indices
            assert kept.sectors is None or all(0 <= s < log.entries[kept.entry].nr_sectors for s in kept.sectors)
    assert len(plan_cuts(log, 30, 3)) == 30, "more cuts than flushes: flushes again, with other caches"
    assert {c.flush for c in plan_cuts(log, 5, 1, among=range(10, 12))} == {10, 11}
    with pytest.raises(WriteLogError, match="has 12"):
        plan_cuts(log, 3, 1, among=range(10, 14))
    fua = parse_log(synthetic_log([(0, 0, int(Flag.FLUSH), b""), (8, 2, int(Flag.FUA), bytes(1024)),
                                   (16, 2, 0, bytes(1024))]))  # fmt: skip
    assert {cut.kept for cut in plan_cuts(fua, 20, 5, model=CacheModel(keep=0.0))} == {(KeptWrite(1),)}, "FUA stays"
    with pytest.raises(ValueError, match=r"CacheModel\.keep = 2"):
        CacheModel(keep=2)


def commit_log(commits: int) -> bytes:
    """A log the shape of a guest's SQLite commits on ext4 (tests/test_powercut_vm.py's recordings): the WAL's
    frames (24 sectors) and the journal's blocks (40), a flush, the journal's commit block (8), a flush; a last
    window of a single sector."""
    requests: list[tuple[int, int, int, bytes]] = [(0, 0, int(Flag.FLUSH), b"")]
    for n in range(commits):
        requests += [(1000 + 16 * n, 24, 0, bytes([n + 1]) * 24 * SECTOR), (4000 + 48 * n, 40, 0, bytes(40 * SECTOR)),
                     (0, 0, int(Flag.FLUSH), b""), (4040 + 48 * n, 8, 0, bytes(8 * SECTOR)),
                     (0, 0, int(Flag.FLUSH), b"")]  # fmt: skip
    return synthetic_log([*requests, (9000, 1, 0, bytes(SECTOR)), (0, 0, int(Flag.FLUSH), b"")])


@pytest.mark.quick
def test_cuts_inside_a_commit_s_writes_keep_what_came_before_the_cut_in_the_log_s_order() -> None:
    """A cut in order falls between two sectors of a window's writes, among windows holding a commit's writes
    before its flush (two writes or more): the writes before it whole, the one it falls in up to it, none after.
    Over the cuts, both a commit's WAL frames torn (its commit frame not written) and the frames whole with the
    journal's blocks not begun."""
    log = parse_log(synthetic_log(sample_requests(flushes=12)))
    assert plan_cuts(log, 8, 7) == plan_cuts(log, 8, 7, in_order=0), "none asked: the plan as it always was"
    log = parse_log(commit_log(30))
    cuts = plan_cuts(log, 40, 3, in_order=30)
    assert cuts == plan_cuts(log, 40, 3, in_order=30) and cuts != plan_cuts(log, 40, 4, in_order=30)
    assert {c.number for c in cuts if c.in_order} == {*range(1, 40, 2), *range(0, 20, 2)}, "odd numbers first"
    assert sum(c.in_order for c in cuts) == 30 and all(c.as_dict()["in_order"] == c.in_order for c in cuts)
    states = set()
    for cut in (c for c in cuts if c.in_order):
        writes = window(log, cut.flush)
        assert len(writes) == 2 and cut.window == 2, "a window with a commit's writes in it"
        kept = {k.entry: k.sectors for k in cut.kept}
        sectors = [w.nr_sectors if w.index in kept and kept[w.index] is None else len(kept.get(w.index) or ())
                   for w in writes]  # fmt: skip
        assert 0 < sum(sectors) < sum(w.nr_sectors for w in writes), "neither nothing nor everything"
        falls = next(i for i, w in enumerate(writes) if sectors[i] < w.nr_sectors)
        assert all(kept[w.index] is None for w in writes[:falls]) and all(
            w.index not in kept for w in writes[falls + 1 :]
        )
        assert kept.get(writes[falls].index, ()) == tuple(range(sectors[falls])), "the first sectors of the write"
        states.add("wal torn" if falls == 0 else "journal not begun" if sectors[1] == 0 else "journal torn")
    assert states == {"wal torn", "journal not begun", "journal torn"}
    one = parse_log(synthetic_log([(0, 0, 1, b""), (8, 2, 0, bytes(1024)), (0, 0, 1, b"")]))
    assert plan_cuts(one, 3, 1, in_order=3)[0].kept == (KeptWrite(1, (0,)),), "one write of two sectors: inside it"
    with pytest.raises(ValueError, match="in_order = 5: at most the 4 cuts"):
        plan_cuts(log, 4, 1, in_order=5)
    single = parse_log(synthetic_log([(0, 0, 1, b""), (8, 1, 0, bytes(SECTOR)), (0, 0, 1, b"")]))
    with pytest.raises(WriteLogError, match=r"no window among flushes range\(0, 2\) holds writes of two sectors"):
        plan_cuts(single, 2, 1, in_order=1)


# -- QEMU's own logs (integration) ---------------------------------------------------------------------------------

needs_qemu_io = pytest.mark.skipif(QEMU_IO is None, reason="qemu-io: scripts/setup.sh installs Debian's qemu-utils")


def record(disk: Path, log: Path, commands: list[str]) -> None:
    """Run qemu-io ``commands`` on ``disk`` through the blklogwrites driver, logging to ``log`` (made empty)."""
    log.write_bytes(b"")
    options = (f"driver=blklogwrites,file.driver=file,file.filename={disk},log.driver=file,log.filename={log},"
               f"log-sector-size={SECTOR}")  # fmt: skip
    args = [str(QEMU_IO), "--image-opts", options]
    for command in commands:
        args += ["-c", command]
    subprocess.run(args, check=True, capture_output=True, timeout=60)


def workload(seed: int, size: int) -> tuple[list[str], list[bytes]]:
    """qemu-io commands (writes of one-byte patterns and of zeroes, flushes between) and the disk after each write,
    starting from zeros (``disks[n]``: after the first n writes)."""
    rng = random.Random(seed)
    disk = bytearray(size)
    commands, disks = [], [bytes(disk)]
    for _ in range(6):
        for _ in range(rng.randrange(1, 8)):
            offset = rng.randrange(0, size // SECTOR - 16) * SECTOR
            length = rng.randrange(1, 16) * SECTOR
            if rng.random() < 0.2:
                commands.append(f"write -z {offset} {length}")
                disk[offset : offset + length] = bytes(length)
            else:
                pattern = rng.randrange(1, 256)
                commands.append(f"write -P {pattern:#x} {offset} {length}")
                disk[offset : offset + length] = bytes([pattern]) * length
            disks.append(bytes(disk))
        commands.append("flush")
    return commands, disks


@pytest.mark.integration
@needs_qemu_io
def test_replay_to_each_flush_is_the_disk_qemu_io_wrote_by_then(tmp_path: Path) -> None:
    """QEMU logs a flush of its own here and there (around a write of zeroes, at exit): each flush of the log, not
    each flush command, is a cut point, and the disk there is that of the writes logged before it."""
    size = 256 * 1024
    base, disk, log_path = tmp_path / "base.img", tmp_path / "disk.img", tmp_path / "log.bin"
    base.write_bytes(bytes(size))
    shutil.copy(base, disk)
    commands, disks = workload(11, size)
    record(disk, log_path, commands)
    log = read_log(log_path, device_bytes=size)
    writes = [c for c in commands if c.startswith("write")]
    assert [e.nr_sectors * SECTOR for e in log.entries if e.is_write] == [int(c.split()[-1]) for c in writes]
    assert [e.sector * SECTOR for e in log.entries if e.is_write] == [int(c.split()[-2]) for c in writes]
    assert len(log.flushes) >= commands.count("flush"), "every flush logged"
    assert log.counted == len(log.entries), "QEMU rewrote the super at its last flush"
    nothing_lost = CacheModel(keep=0.0)
    for number, flush in enumerate(log.flushes):
        (cut,) = plan_cuts(log, 1, number, model=nothing_lost, among=range(number, number + 1))
        assert cut.durable == flush and cut.kept == ()
        ((_, image),) = replay_cuts(log, base, [cut], tmp_path / "work")
        written = sum(entry.is_write for entry in log.entries[:flush])
        assert image.read_bytes() == disks[written], f"replayed to flush {number}"
        image.unlink()
    with ImageWriter(log_path, SECTOR, base) as writer:
        writer.apply(log.entries)
    assert base.read_bytes() == disk.read_bytes() == disks[-1]


@pytest.mark.integration
@needs_qemu_io
def test_a_cut_keeps_exactly_its_chosen_writes_and_sectors(tmp_path: Path) -> None:
    size = 128 * 1024
    base, disk, log_path = tmp_path / "base.img", tmp_path / "disk.img", tmp_path / "log.bin"
    base.write_bytes(random.Random(5).randbytes(size))
    shutil.copy(base, disk)
    record(disk, log_path, ["write -P 0x11 0 4k", "flush", "write -P 0x22 8k 4k", "write -P 0x33 16k 2k",
                            "write -P 0x44 8k 1k", "flush"])  # fmt: skip
    log = read_log(log_path, device_bytes=size)
    seen = set()
    for cut in plan_cuts(log, 40, 9, model=CacheModel(keep=0.6, tear=0.5), among=range(0, 1)):
        ((_, image),) = replay_cuts(log, base, [cut], tmp_path / "work")
        expected = bytearray(base.read_bytes())
        expected[0:4096] = b"\x11" * 4096
        for kept in cut.kept:
            entry = log.entries[kept.entry]
            pattern = log_path.read_bytes()[entry.data_offset]
            for s in range(entry.nr_sectors) if kept.sectors is None else kept.sectors:
                at = (entry.sector + s) * SECTOR
                expected[at : at + SECTOR] = bytes([pattern]) * SECTOR
        assert image.read_bytes() == expected
        seen.add(cut.kept)
        image.unlink()
    assert len(seen) > 3, "the caches differ from cut to cut"
    assert plan_cuts(log, 40, 9, model=CacheModel(keep=0.6, tear=0.5), among=range(0, 1)) == plan_cuts(
        log, 40, 9, model=CacheModel(keep=0.6, tear=0.5), among=range(0, 1)
    )


@pytest.mark.integration
@needs_qemu_io
def test_a_damaged_qemu_log_is_refused_by_offset(tmp_path: Path) -> None:
    disk, log_path = tmp_path / "disk.img", tmp_path / "log.bin"
    disk.write_bytes(bytes(64 * 1024))
    record(disk, log_path, ["write -P 0x5a 0 8k", "flush", "write -P 0x5b 8k 8k", "flush"])
    whole = log_path.read_bytes()
    log = read_log(log_path)
    second = next(e for e in log.entries if e.is_write and e.sector == 16)
    log_path.write_bytes(whole[: second.data_offset + 100])
    with pytest.raises(WriteLogError, match=f"offset {second.offset}: entry {second.index}: .* \\(cut short\\)"):
        read_log(log_path)
    log_path.write_bytes(whole[: second.offset] + b"\xff" * SECTOR + whole[second.offset + SECTOR :])
    with pytest.raises(WriteLogError, match=f"offset {second.offset}: entry {second.index}: unknown flags"):
        read_log(log_path)
    log_path.write_bytes(b"")
    with pytest.raises(WriteLogError, match="offset 0: the log is empty"):
        read_log(log_path)


# -- the offline check of an ext4 image (integration) --------------------------------------------------------------


def make_outbox(directory: Path, rows: int) -> None:
    """An outbox as the daemon leaves it: WAL mode, ``rows`` answers checkpointed into the database, three of them
    acknowledged (deleted) and five more answers since, in the WAL only."""
    db = sqlite3.connect(directory / "outbox.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE answers (seq INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, "
               "payload BLOB NOT NULL, created REAL NOT NULL, received REAL NOT NULL, correlation BLOB)")  # fmt: skip
    for i in range(rows):
        db.execute("INSERT INTO answers (topic, payload, created, received) VALUES (?, ?, 0, 0)",
                   ("out", json.dumps({"id": f"in-{i}"}).encode() * 20))  # fmt: skip
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("DELETE FROM answers WHERE seq <= 3")
    for i in range(rows, rows + 5):
        db.execute("INSERT INTO answers (topic, payload, created, received) VALUES (?, ?, 0, 0)",
                   ("out", json.dumps({"id": f"in-{i}"}).encode() * 20))  # fmt: skip
    copy = directory.parent / "copy"
    copy.mkdir(exist_ok=True)
    for name in ("outbox.sqlite", "outbox.sqlite-wal"):  # while open: the WAL is not checkpointed into the db
        shutil.copy(directory / name, copy / name)
    db.close()
    for name in ("outbox.sqlite", "outbox.sqlite-wal"):
        shutil.copy(copy / name, directory / name)
    (directory / "outbox.sqlite-shm").unlink(missing_ok=True)
    shutil.rmtree(copy)


def make_image(tmp_path: Path, bundle: Path, rows: int = 40) -> Path:
    root = tmp_path / "rootfs"
    instance = root / "var/lib/edgeline/sensor"
    (instance / "updates/bundles").mkdir(parents=True)
    shutil.copytree(bundle, instance / "updates/bundles/v2")
    (instance / "updates/state.json").write_text(
        json.dumps({"committed": {"version": 2, "bundle": "bundles/v2"}, "previous": None, "refused": {}})
    )
    make_outbox(instance, rows)
    (instance / "instance-id").write_text("3f1c0a\n")
    image = tmp_path / "disk.img"
    subprocess.run(["mke2fs", "-q", "-t", "ext4", "-b", "4096", "-d", str(root), str(image), "16M"], check=True,
                   env={**os.environ, "PATH": E2FS_DIRS}, capture_output=True)  # fmt: skip
    return image


def debugfs(image: Path, command: str) -> str:
    done = subprocess.run(["debugfs", "-R", command, str(image)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PATH": E2FS_DIRS})  # fmt: skip
    return done.stdout


def blocks_of(image: Path, path: str) -> list[int]:
    return [int(b) for b in debugfs(image, f"blocks {path}").split()]


STATE = PurePosixPath("/var/lib/edgeline")


@pytest.mark.integration
def test_a_good_image_passes_with_its_outbox_state_and_committed_bundle(tmp_path: Path) -> None:
    image = make_image(tmp_path, SQRT_BUNDLE)
    check = check_image(image, STATE, tmp_path / "scratch")
    assert check.problems == (), check.problems
    assert check.fsck_clean and not check.journal_replayed
    (instance,) = check.instances
    assert instance.name == "edgeline/sensor" and instance.committed == 2
    assert instance.self_test is True
    assert instance.outbox is not None and instance.outbox.integrity == "ok"
    assert instance.outbox.last_seq == 45 and [a[0] for a in instance.outbox.answers] == list(range(4, 46))
    assert json.loads(instance.outbox.answers[0][2][: len(b'{"id": "in-3"}')]) == {"id": "in-3"}
    assert not (tmp_path / "scratch").exists(), "what was taken out is removed"
    assert json.dumps(check.as_dict())


@pytest.mark.integration
def test_a_journal_left_to_replay_is_replayed_before_the_checks(tmp_path: Path) -> None:
    """A transaction left in the journal (debugfs writes one, as a kernel cut off before its checkpoint would): the
    check replays it, as a mount would, and the block it carries is in the image afterwards."""
    image = make_image(tmp_path, SQRT_BUNDLE)
    block = tmp_path / "block"
    block.write_bytes(random.Random(3).randbytes(4096))
    free = 3000  # past what the state directory takes in the 16 MiB image
    subprocess.run(["debugfs", "-w", "-f", "-", str(image)], input=f"jo\njw -b {free} {block}\njc\n", text=True,
                   check=True, capture_output=True, env={**os.environ, "PATH": E2FS_DIRS})  # fmt: skip
    assert "needs_recovery" in debugfs(image, "features")
    check = check_image(image, STATE, tmp_path / "scratch")
    assert check.journal_replayed and check.fsck_clean and check.problems == (), check.problems
    with image.open("rb") as disk:
        disk.seek(free * 4096)
        assert disk.read(4096) == block.read_bytes()


@pytest.mark.integration
def test_an_orphan_left_by_a_file_unlinked_while_open_is_released_as_a_mount_would(tmp_path: Path) -> None:
    """A cut while a process held a deleted file open (SQLite's, systemd's) leaves an inode on the orphan list: no
    finding, the kernel frees it at mount (and e2fsck -E journal_only likewise)."""
    image = make_image(tmp_path, SQRT_BUNDLE)
    doomed = STATE / "sensor/instance-id"
    inode = int(debugfs(image, f"stat {doomed}").split("Inode: ")[1].split()[0])
    subprocess.run(["debugfs", "-w", "-f", "-", str(image)], check=True, capture_output=True, text=True,
                   input=f"unlink {doomed}\nsif <{inode}> links_count 0\nssv last_orphan {inode}\n",
                   env={**os.environ, "PATH": E2FS_DIRS})  # fmt: skip
    check = check_image(image, STATE, tmp_path / "scratch")
    assert check.fsck_clean and check.problems == (), check.problems


@pytest.mark.integration
def test_a_torn_outbox_page_is_an_integrity_failure(tmp_path: Path) -> None:
    image = make_image(tmp_path, SQRT_BUNDLE, rows=400)
    instance = STATE / "sensor"
    db_blocks = blocks_of(image, str(instance / "outbox.sqlite"))
    assert len(db_blocks) > 10
    with image.open("r+b") as disk:  # a leaf page of the table, partly overwritten: what a torn write leaves
        disk.seek(db_blocks[len(db_blocks) // 2] * 4096 + 100)
        disk.write(random.Random(1).randbytes(1500))
    check = check_image(image, STATE, tmp_path / "scratch")
    assert check.fsck_clean, "the file system is fine; the database is not"
    assert any("outbox.sqlite" in p for p in check.problems), check.problems


@pytest.mark.integration
def test_a_truncated_state_json_is_a_finding(tmp_path: Path) -> None:
    image = make_image(tmp_path, SQRT_BUNDLE)
    (block,) = blocks_of(image, str(STATE / "sensor/updates/state.json"))
    with image.open("r+b") as disk:
        disk.seek(block * 4096 + 20)
        disk.write(b"\0" * 40)
    check = check_image(image, STATE, tmp_path / "scratch")
    assert any("state.json does not parse" in p for p in check.problems), check.problems


@pytest.mark.integration
def test_broken_file_system_metadata_is_found_by_e2fsck(tmp_path: Path) -> None:
    image = make_image(tmp_path, SQRT_BUNDLE)
    where = debugfs(image, "imap <2>").split("located at block ")[1].split(", offset ")
    with image.open("r+b") as disk:  # the root directory's inode, scribbled over
        disk.seek(int(where[0]) * 4096 + int(where[1].split()[0], 16))
        disk.write(random.Random(2).randbytes(256))
    check = check_image(image, STATE, tmp_path / "scratch")
    assert not check.fsck_clean
    assert any(p.startswith("e2fsck -fn found errors") for p in check.problems), check.problems


@pytest.mark.integration
def test_an_image_without_the_state_directory_or_not_ext4_says_so(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    image = tmp_path / "disk.img"
    subprocess.run(["mke2fs", "-q", "-t", "ext4", "-d", str(root), str(image), "8M"], check=True,
                   env={**os.environ, "PATH": E2FS_DIRS}, capture_output=True)  # fmt: skip
    assert check_image(image, STATE, tmp_path / "s").problems == (f"{STATE} is not in the image",)
    garbage = tmp_path / "garbage.img"
    garbage.write_bytes(bytes(1 << 20))
    problems = check_image(garbage, STATE, tmp_path / "s").problems
    assert problems and all(isinstance(p, str) for p in problems)


@pytest.mark.quick
def test_a_file_that_is_not_a_database_raises_sqlite_s_error(tmp_path: Path) -> None:
    path = tmp_path / "outbox.sqlite"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        outbox_state(path)
    assert issubclass(WriteLogError, EdgelineError)


@pytest.mark.integration
@needs_qemu_io
def test_the_command_replays_a_file_system_written_through_qemu_and_checks_each_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ext4 image (mke2fs -d) written onto a blank disk through blklogwrites, its chunks last to first with
    flushes between: a cut before the super block is written finds no file system, the cut at the last flush the
    whole state directory; ``python -m edgeline.sim.powercut`` prints a line per cut and a summary."""
    image = make_image(tmp_path, SQRT_BUNDLE)
    chunk = 256 * 1024
    data = image.read_bytes()
    blank, disk, log_path = tmp_path / "blank.img", tmp_path / "disk.img", tmp_path / "log.bin"
    blank.write_bytes(bytes(len(data)))
    shutil.copy(blank, disk)
    commands = []
    for number, offset in enumerate(reversed(range(0, len(data), chunk))):
        piece = data[offset : offset + chunk]
        if piece.count(0) == len(piece):
            continue
        source = tmp_path / f"chunk-{offset}"
        source.write_bytes(piece)
        commands += [f"write -s {source} {offset} {len(piece)}"] + (["flush"] if number % 4 == 3 else [])
    record(disk, log_path, [*commands, "flush"])
    assert disk.read_bytes() == data
    flushes = len(read_log(log_path).flushes)
    base = ["--base", str(blank), "--work", str(tmp_path / "work"), "--state-dir", str(STATE)]
    assert main([str(log_path), *base, "--cuts", "3", "--seed", "4"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 4 and lines[-1]["cuts"] == 3 and lines[-1]["integrity_failures"] >= 1
    assert all(line["problems"] for line in lines[:-1] if line["flush"] == 0), "the first flush: no file system"
    assert main([str(log_path), *base, "--cuts", "1", "--from-flush", str(flushes - 1)]) == 0
    (cut, summary) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert cut["problems"] == [] and cut["instances"][0]["outbox"]["last_seq"] == 45 and summary["flushes"] == flushes
    assert not list((tmp_path / "work").glob("*.img")), "no image left behind"
