"""The offline check of an ext4 disk image left by a power cut: what a booting device would find in edgeline's state.

    e2fsck -E journal_only -y   the journal replayed, as the kernel does at mount
    e2fsck -fn                  then the whole file system checked, changing nothing: any error is a finding
    debugfs -R "rdump ..."      the state directory taken out of the image (no mount, no root needed)
    per daemon instance         outbox.sqlite (with its -wal): PRAGMA integrity_check, its answers and last seq;
                                updates/state.json: parses as a ``StateFile``; its committed bundle: files verified
                                (sizes, sha256) and, when this machine has its runtime, the golden self-test

The state directory is the unit's ``StateDirectory`` (``/var/lib/edgeline/INSTANCE``, a link to
``/var/lib/private/edgeline/INSTANCE`` under ``DynamicUser=yes``), holding one directory per bundle name: an
instance is a directory holding ``outbox.sqlite`` or ``updates/``, found up to three levels down; it is named by
its path from the state directory's name (``edgeline/sensor/sqrt``). An outbox or a
``state.json`` not there yet is no finding (a cut before the daemon first wrote one); one that is there and broken is.
e2fsprogs (Debian's ``e2fsprogs``) is needed, root is not.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from edgeline.errors import EdgelineError

__all__ = ["DEFAULT_STATE_DIR", "ImageCheck", "InstanceCheck", "OutboxState", "check_image", "outbox_state"]

DEFAULT_STATE_DIR = PurePosixPath("/var/lib/edgeline")
TOOL_DIRS = ("/usr/sbin", "/sbin")
"""Where e2fsprogs lives when it is not on a normal user's PATH."""
FINDINGS_KEPT = 8
"""Lines of a tool's complaint kept per finding."""


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=":".join(TOOL_DIRS))
    if found is None:
        raise EdgelineError(f"{name} is not installed: it comes with Debian's e2fsprogs (apt-get install e2fsprogs)")
    return found


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def _complaint(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("Pass ", "e2fsck "))]
    return "; ".join(lines[:FINDINGS_KEPT])


@dataclass(frozen=True)
class OutboxState:
    """An outbox as the next start would find it: ``answers`` (seq, topic, payload) wait to be published; every seq
    up to ``last_seq`` not among them was acknowledged by the broker (or dropped, and counted, by a bound)."""

    integrity: str
    answers: tuple[tuple[int, str, bytes], ...]
    last_seq: int

    def as_dict(self) -> dict[str, Any]:
        return {"integrity": self.integrity, "pending": len(self.answers), "last_seq": self.last_seq}


def outbox_state(path: Path) -> OutboxState:
    """Open the outbox (its WAL beside it is recovered, as the daemon's open would) and read it; ``sqlite3.Error``
    when it is not a database."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        rows = db.execute("PRAGMA integrity_check").fetchall()
        integrity = "ok" if rows == [("ok",)] else "; ".join(str(row[0]) for row in rows[:FINDINGS_KEPT])
        answers = tuple(db.execute("SELECT seq, topic, payload FROM answers ORDER BY seq"))
        last = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'answers'").fetchone()
        return OutboxState(integrity, answers, int(last[0]) if last else 0)
    finally:
        db.close()


@dataclass(frozen=True)
class InstanceCheck:
    name: str
    outbox: OutboxState | None = None
    committed: int | None = None
    """The committed version ``state.json`` names (None: none, or the bundle of the command line)."""
    self_test: bool | None = None
    """None: not run (no committed bundle, not asked, or this machine lacks its runtime)."""
    problems: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "outbox": self.outbox.as_dict() if self.outbox else None,
            "committed": self.committed,
            "self_test": self.self_test,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class ImageCheck:
    journal_replayed: bool
    fsck_clean: bool
    instances: tuple[InstanceCheck, ...] = ()
    problems: tuple[str, ...] = field(default=())
    """Every finding, the instances' included: empty when the image passed."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "journal_replayed": self.journal_replayed,
            "fsck_clean": self.fsck_clean,
            "instances": [instance.as_dict() for instance in self.instances],
            "problems": list(self.problems),
            "check_s": round(self.seconds, 3),
        }


def _extract(image: Path, inside: PurePosixPath, into: Path) -> Path | None:
    """``inside`` copied out of ``image`` into ``into``; None when the image has no such directory."""
    if any(c in str(inside) for c in '"\n\\'):
        raise ValueError(f"{inside!s}: a path debugfs can be given (no quotes, newlines or backslashes)")
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    done = _run([_tool("debugfs"), "-R", f'rdump "{inside}" "{into}"', str(image)])
    copied = into / inside.name
    if not copied.is_dir():
        if "not found" in done.stderr or "File not found" in done.stderr:
            return None
        raise EdgelineError(f"debugfs could not take {inside} out of {image}: {_complaint(done.stderr)}")
    return copied


def _self_test(bundle: Path) -> bool | None:
    from edgeline.bundle_checks import golden_check
    from edgeline.errors import BackendUnavailableError
    from edgeline.model import load

    try:
        model = load(bundle)
    except BackendUnavailableError:
        return None
    try:
        return golden_check(model)["ok"] is not False
    finally:
        close = getattr(model, "close", None)
        if callable(close):
            close()


def _check_instance(directory: Path, root: Path, self_test: bool) -> InstanceCheck:
    from pydantic import ValidationError

    from edgeline.bundle import read_bundle
    from edgeline.updates.store import StateFile

    name = directory.relative_to(root.parent).as_posix()
    problems: list[str] = []
    outbox = None
    db = directory / "outbox.sqlite"
    if db.exists():
        try:
            outbox = outbox_state(db)
            if outbox.integrity != "ok":
                problems.append(f"{name}/outbox.sqlite: integrity_check: {outbox.integrity}")
        except sqlite3.Error as exc:
            problems.append(f"{name}/outbox.sqlite: not a database any more: {exc}")
    elif (directory / "outbox.sqlite-wal").exists():
        problems.append(f"{name}/outbox.sqlite-wal is there, outbox.sqlite is not")
    committed = None
    tested = None
    state = directory / "updates" / "state.json"
    if state.exists():
        try:
            parsed = StateFile.model_validate_json(state.read_bytes())
        except (ValidationError, OSError) as exc:
            problems.append(f"{name}/updates/state.json does not parse: {str(exc).splitlines()[0]}")
        else:
            if parsed.committed is not None and not parsed.committed.given:
                committed = parsed.committed.version
                bundle = directory / "updates" / parsed.committed.bundle
                try:
                    read_bundle(bundle)
                    tested = _self_test(bundle) if self_test else None
                except EdgelineError as exc:
                    problems.append(f"{name}: committed v{committed} does not open: {exc}")
                if tested is False:
                    problems.append(f"{name}: committed v{committed} fails its golden self-test")
    return InstanceCheck(name, outbox, committed, tested, tuple(problems))


def _instances(root: Path, depth: int = 3) -> list[Path]:
    """The daemons' state directories under ``root`` (itself included), ``depth`` levels down at most: the unit's
    ``StateDirectory`` holds one per bundle name (``/var/lib/private/edgeline/INSTANCE/NAME``)."""
    if (root / "outbox.sqlite").exists() or (root / "updates").is_dir():
        return [root]
    if depth == 0:
        return []
    children = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    return [found for child in children for found in _instances(child, depth - 1)]


def check_image(
    image: Path, state_dir: PurePosixPath = DEFAULT_STATE_DIR, scratch: Path | None = None, *, self_test: bool = True
) -> ImageCheck:
    """Check ``image`` (changed: its journal is replayed into it) as a device booting on it would find it.
    ``scratch``: where the state directory is taken out to (emptied first; default: beside the image)."""
    started = time.monotonic()
    scratch = scratch if scratch is not None else image.with_suffix(".state")
    problems: list[str] = []
    journal = _run([_tool("e2fsck"), "-E", "journal_only", "-y", str(image)])
    replayed = "recovering journal" in journal.stdout.lower()
    if journal.returncode >= 4:
        problems.append(f"journal replay failed (e2fsck exit {journal.returncode}): {_complaint(journal.stdout)}")
    fsck = _run([_tool("e2fsck"), "-fn", str(image)])
    clean = fsck.returncode == 0
    if not clean:
        problems.append(f"e2fsck -fn found errors (exit {fsck.returncode}): {_complaint(fsck.stdout + fsck.stderr)}")
    instances: list[InstanceCheck] = []
    try:
        root = _extract(image, state_dir, scratch)
        if root is None:
            problems.append(f"{state_dir} is not in the image")
        else:
            instances = [_check_instance(path, root, self_test) for path in _instances(root)]
            problems += [p for instance in instances for p in instance.problems]
    except EdgelineError as exc:
        problems.append(str(exc))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ImageCheck(replayed, clean, tuple(instances), tuple(problems), time.monotonic() - started)
