"""Power cuts with torn writes, from a block write log: which states a card may be left in, and whether edgeline's
state directory survives each of them.

    record   QEMU's blklogwrites driver logs every write and flush of a guest (``edgeline.sim.writelog``)
    plan     ``plan_cuts``: N cut points drawn from a seed: a flush k, and what the card's cache kept of the writes
             after it (``CacheModel``: each write kept or lost, a kept one possibly torn, sector by sector); or,
             ``in_order`` of them, a point inside the writes after flush k, in the log's order (below)
    replay   ``replay_cuts``: for each cut, a copy of the base image with every write before flush k, and the kept
             writes (and sectors) of those between flush k and flush k+1
    check    ``check_image`` (``edgeline.sim.imagecheck``): journal replay, e2fsck, the state directory taken out
             with debugfs, ``PRAGMA integrity_check`` on the outbox, ``state.json``, the committed bundle

The model of a cut: a card acknowledges writes into a volatile cache and makes them durable at the latest when a
flush returns. So at a cut between flush k and flush k+1, everything logged before flush k is on the card; of the
writes logged after it, any subset may be, each one whole or (it was being programmed when the power went) only
some of its sectors; a FUA write, which bypasses the cache, is always there. Writes that overlap are applied in the
log's order, so a lost later write shows the earlier one. A write logged just before flush k but still in flight
when the guest issued it counts as durable (the log cannot tell them apart): the model errs towards fewer lost
writes there, never invents one. Torn at the log's sector (512 bytes): a card's page is larger, so any tear it can
make is among these, and so are some it cannot.

A cut in order falls inside a commit's own writes: between two of them, or between two sectors of one, the writes
before it whole and none after (a card that writes its cache out in order, or none: the power went while it was
programming that sector). Every commit fsyncs, so a window holds only a commit's writes before its flush (on ext4:
a SQLite commit's WAL frames and the journal's blocks, then, after a flush, the journal's commit block): drawn
among the windows holding two writes or more, such cuts replay the torn commits (the WAL's last frames, its commit
frame among them, not written; the frames written and the journal's not begun) that the cache's even odds reach
only now and then. Each is one of the states the cache model allows; they are drawn on purpose, not by chance.

``python -m edgeline.sim.powercut LOG --base IMAGE --cuts N`` replays and checks offline, one JSON line per cut, then
a summary line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from edgeline.errors import EdgelineError
from edgeline.sim.imagecheck import DEFAULT_STATE_DIR, ImageCheck, check_image
from edgeline.sim.writelog import Entry, Flag, ImageWriter, Tail, WriteLog, WriteLogError, read_log

__all__ = ["CacheModel", "Cut", "CutResult", "KeptWrite", "plan_cuts", "replay_cuts", "run_cuts", "window"]


@dataclass(frozen=True)
class CacheModel:
    """What a card's cache does with the writes after the last flush when the power goes."""

    keep: float = 0.5
    """Chance that one write reached the card."""
    tear: float = 0.25
    """Chance that a write of several sectors that reached the card reached it only in part: each sector then
    reached it or not, at even odds."""

    def __post_init__(self) -> None:
        for name in ("keep", "tear"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"CacheModel.{name} = {value}: a probability, from 0 to 1")


@dataclass(frozen=True)
class KeptWrite:
    """A write after the cut's flush that reached the card: whole (``sectors`` None), or only those sectors (offsets
    from its first one)."""

    entry: int
    sectors: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Cut:
    """One power cut: after the log's flush number ``flush`` (0 is the first), with ``durable`` entries on the card
    whole and ``kept`` of the ``window`` writes that followed; ``in_order``: a cut inside those writes in the log's
    order (a prefix of them kept), not a cache's choice."""

    number: int
    flush: int
    durable: int
    window: int
    kept: tuple[KeptWrite, ...]
    in_order: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "cut": self.number,
            "flush": self.flush,
            "durable_entries": self.durable,
            "window_writes": self.window,
            "kept_whole": sum(k.sectors is None for k in self.kept),
            "kept_torn": sum(k.sectors is not None for k in self.kept),
            "in_order": self.in_order,
        }


def window(log: WriteLog, flush: int) -> list[Entry]:
    """The writes a cut after flush number ``flush`` may lose: those logged between it and the next flush (or the
    end of the log); a flush that carries data (Linux's pre-flush) has it written after the flush."""
    flushes = log.flushes
    start = flushes[flush]
    end = flushes[flush + 1] if flush + 1 < len(flushes) else len(log.entries)
    return [entry for entry in log.entries[start:end] if entry.is_write]


def plan_cuts(
    log: WriteLog,
    count: int,
    seed: int,
    *,
    model: CacheModel = CacheModel(),
    among: range | None = None,
    in_order: int = 0,
) -> tuple[Cut, ...]:
    """``count`` cuts, a pure function of (the log's entries, count, seed, model, among, in_order): the flushes drawn
    without repeats while there are enough (``among``: the flush numbers to draw from, all by default), then again
    with repeats (another cache each time); each cut's cache from a generator of its own (seed and number).
    ``in_order`` of them (the odd numbers first, then the even) are cuts in order (the module's docstring), their
    windows drawn the same way among those holding two writes or more (else writes of two sectors or more)."""
    if count < 1:
        raise ValueError(f"count = {count}: at least one cut")
    if not 0 <= in_order <= count:
        raise ValueError(f"in_order = {in_order}: at most the {count} cuts, and not below 0")
    flushes = len(log.flushes)
    shown = among if among is not None else range(flushes)
    candidates = list(shown)
    where = log.path or "write log"
    if not candidates or not all(0 <= k < flushes for k in candidates):
        raise WriteLogError(
            f"{where}: cuts among flushes {among!r}, but the log has {flushes} (numbered from 0)", offset=0
        )
    ordered = set([*range(1, count, 2), *range(0, count, 2)][:in_order])
    chosen = _draw(random.Random(f"edgeline-powercut:{seed}"), candidates, count - in_order)
    inside: list[int] = []
    if in_order:
        windows = {k: window(log, k) for k in candidates}
        several = [k for k in candidates if len(windows[k]) >= 2]
        sectors = [k for k in candidates if sum(entry.nr_sectors for entry in windows[k]) >= 2]
        if not sectors:
            raise WriteLogError(
                f"{where}: no window among flushes {shown!r} holds writes of two sectors or more: no cut can fall "
                "inside a commit's writes",
                offset=0,
            )
        inside = _draw(random.Random(f"edgeline-powercut:{seed}:in-order"), several or sectors, in_order)
    cuts = []
    for number in range(count):
        rng = random.Random(f"edgeline-powercut:{seed}:{number}")
        flush = inside.pop(0) if number in ordered else chosen.pop(0)
        writes = window(log, flush)
        kept = _in_order(writes, rng) if number in ordered else _cached(writes, rng, model)
        cuts.append(Cut(number, flush, log.flushes[flush], len(writes), kept, number in ordered))
    return tuple(cuts)


def _draw(chooser: random.Random, candidates: list[int], count: int) -> list[int]:
    """``count`` of ``candidates``: without repeats while there are enough, then with."""
    chosen = chooser.sample(candidates, min(count, len(candidates)))
    return chosen + chooser.choices(candidates, k=count - len(chosen))


def _cached(writes: list[Entry], rng: random.Random, model: CacheModel) -> tuple[KeptWrite, ...]:
    """What a cache kept of ``writes``: each at the model's odds, some torn; FUA writes always."""
    kept = []
    for entry in writes:
        if entry.flags & Flag.FUA:  # written through the cache: on the card once it completed
            kept.append(KeptWrite(entry.index))
            continue
        if rng.random() >= model.keep:
            continue
        if entry.nr_sectors > 1 and rng.random() < model.tear:
            kept.append(KeptWrite(entry.index, tuple(s for s in range(entry.nr_sectors) if rng.random() < 0.5)))
        else:
            kept.append(KeptWrite(entry.index))
    return tuple(kept)


def _in_order(writes: list[Entry], rng: random.Random) -> tuple[KeptWrite, ...]:
    """A point inside ``writes``, each as likely: between two of them, or inside one of several sectors (then how
    many of its first sectors were written, each count as likely). The writes before it whole, none after but
    FUA writes (on the card once they completed)."""
    points = [(i, False) for i in range(1, len(writes))] + [(i, True) for i, w in enumerate(writes) if w.nr_sectors > 1]
    at, inside = points[rng.randrange(len(points))]
    kept = [KeptWrite(entry.index) for entry in writes[:at]]
    if inside:
        kept.append(KeptWrite(writes[at].index, tuple(range(rng.randrange(1, writes[at].nr_sectors)))))
    kept += [KeptWrite(entry.index) for entry in writes[at + 1 if inside else at :] if entry.flags & Flag.FUA]
    return tuple(kept)


def _copy_image(source: Path, target: Path) -> None:
    """A sparse copy (holes stay holes: a VM's image is mostly holes); a reflink where the file system has them."""
    done = subprocess.run(
        ["cp", "--sparse=always", "--reflink=auto", str(source), str(target)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise EdgelineError(f"cannot copy {source} to {target}: {done.stderr.strip()}")


def replay_cuts(log: WriteLog, base: Path, cuts: Sequence[Cut], work: Path) -> Iterator[tuple[Cut, Path]]:
    """Each cut's image, in the order of their flushes: ``work/cut-NNN.img``, the caller's to check and delete.
    One image holds the durable part, brought forward from cut to cut, so the log is read about once whatever N."""
    if log.path is None:
        raise ValueError("replay needs a log read from a file (read_log)")
    work.mkdir(parents=True, exist_ok=True)
    durable = work / "durable.img"
    _copy_image(base, durable)
    applied = 0
    try:
        for cut in sorted(cuts, key=lambda c: (c.durable, c.number)):
            with ImageWriter(log.path, log.sector_size, durable) as writer:
                writer.apply(log.entries[applied : cut.durable])
            applied = cut.durable
            image = work / f"cut-{cut.number:03d}.img"
            _copy_image(durable, image)
            with ImageWriter(log.path, log.sector_size, image) as writer:
                for kept in cut.kept:
                    entry = log.entries[kept.entry]
                    if kept.sectors is None:
                        writer.apply([entry])
                    else:
                        writer.apply_sectors(entry, kept.sectors)
            yield cut, image
    finally:
        durable.unlink(missing_ok=True)


@dataclass(frozen=True)
class CutResult:
    cut: Cut
    check: ImageCheck
    replay_s: float

    def as_dict(self) -> dict[str, Any]:
        return {**self.cut.as_dict(), **self.check.as_dict(), "replay_s": round(self.replay_s, 3)}


def run_cuts(
    log: WriteLog,
    base: Path,
    cuts: Sequence[Cut],
    work: Path,
    *,
    state_dir: PurePosixPath = DEFAULT_STATE_DIR,
    self_test: bool = True,
    keep_images: bool = False,
) -> Iterator[CutResult]:
    """Replay and check each cut offline; each image is deleted once checked unless ``keep_images``."""
    started = time.monotonic()
    for cut, image in replay_cuts(log, base, cuts, work):
        replayed = time.monotonic()
        try:
            check = check_image(image, state_dir, work / f"cut-{cut.number:03d}", self_test=self_test)
        finally:
            if not keep_images:
                image.unlink(missing_ok=True)
        yield CutResult(cut, check, replayed - started)
        started = time.monotonic()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edgeline.sim.powercut",
        description="Replay power cuts from a blklogwrites log onto a copy of the base image and check each offline.",
    )
    parser.add_argument("log", type=Path, help="the write log (dm-log-writes format, from QEMU's blklogwrites)")
    parser.add_argument("--base", type=Path, required=True, help="the raw image as it was when recording began")
    parser.add_argument("--cuts", type=int, default=20, help="how many cuts (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cut points and the caches (default 0)")
    parser.add_argument("--state-dir", type=PurePosixPath, default=DEFAULT_STATE_DIR,
                        help=f"edgeline's state directory inside the image (default {DEFAULT_STATE_DIR})")  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("build/powercut"), help="scratch directory")
    parser.add_argument("--from-flush", type=int, default=0, help="draw the cuts among flushes from this one on")
    parser.add_argument("--in-order", type=int, default=0,
                        help="how many of the cuts fall inside a commit's writes, in order (default 0)")  # fmt: skip
    parser.add_argument("--tail", action="store_true", help="read entries past the super's count (QEMU was killed)")
    parser.add_argument("--no-self-test", action="store_true", help="do not run the committed bundle's self-test")
    parser.add_argument("--keep-images", action="store_true", help="keep each cut's image in --work")
    args = parser.parse_args(argv)
    try:
        log = read_log(args.log, tail=Tail.READ if args.tail else Tail.IGNORE, device_bytes=args.base.stat().st_size)
        among = range(args.from_flush, len(log.flushes))
        cuts = plan_cuts(log, args.cuts, args.seed, among=among, in_order=args.in_order)
        failures = 0
        for result in run_cuts(log, args.base, cuts, args.work, state_dir=args.state_dir,
                               self_test=not args.no_self_test, keep_images=args.keep_images):  # fmt: skip
            failures += bool(result.check.problems)
            print(json.dumps(result.as_dict()), flush=True)
    except (EdgelineError, OSError, ValueError) as exc:
        print(f"powercut: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"cuts": len(cuts), "flushes": len(log.flushes), "log_bytes": log.size,
                      "integrity_failures": failures}))  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
