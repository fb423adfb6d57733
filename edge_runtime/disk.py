"""The state directory's file system, and the budget the outbox takes of it.

    budget = min([outbox] max_bytes, DISK_SHARE x (free bytes + what the outbox's files already take)), at least
             MIN_BUDGET; measured when the outbox opens and again at every check (``Outbox.check``: at most once a
             second while the daemon runs, and on every retry of a full disk)

The budget bounds the outbox's files on the disk, the SQLite write-ahead log included. ``DISK_SHARE`` is a half:

- the other half is what the rest of the device needs on that file system: an update (``edgeline.updates``) keeps
  the committed and the previous bundles, downloads an archive and unpacks it beside them (its room check leaves
  the outbox's budget free), and the state directory often sits on the root file system, where the journal and
  the logs grow too;
- SQLite needs room beside the outbox to work its way out of a full disk: a checkpoint copies the log into the
  database file before the log can be truncated, so an outbox that filled the disk with its log could never shrink
  again (the issue: a 3 MB disk, a 2.2 MB log, a daemon that took nothing more).

What the outbox already takes is counted back in, so the budget does not shrink because the outbox used it; free
space that others take (a log, a download) shrinks it at the next check, and room that comes back grows it.

``file_system`` says which file system a path is on (``edgeline doctor``): its mount point and type come from
``/proc/self/mountinfo`` where there is one (Linux), its sizes from ``statvfs``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DISK_SHARE", "MAX_WAL", "MIN_BUDGET", "FileSystem", "budget", "file_system", "files_bytes", "free_bytes",
    "wal_share",
]  # fmt: skip

DISK_SHARE = 0.5
"""The share of the state directory's file system (its free bytes and the outbox's own) the outbox may take."""
MIN_BUDGET = 256 << 10
"""A budget is never smaller (unless ``max_bytes`` is): room for a WAL of 16 pages and some answers. A disk with less
free meets the full-disk state instead (intake paused, retried)."""


MAX_WAL = 4 << 20
"""The WAL's share of the budget is a quarter, and never more than this."""


def wal_share(total: int) -> int:
    """What the outbox's write-ahead log may take of a budget of ``total`` bytes."""
    return min(MAX_WAL, total // 4)


def budget(max_bytes: int, free: int | None, held: int, *, share: float = DISK_SHARE) -> int:
    """The outbox's budget in bytes: the smaller of ``max_bytes`` and ``share`` of ``free`` plus ``held`` (what its
    files take now), at least ``MIN_BUDGET`` (or ``max_bytes``, when that is smaller). ``free`` None: not known
    (no ``statvfs``), ``max_bytes``."""
    if free is None:
        return max_bytes
    return min(max_bytes, max(MIN_BUDGET, int(share * (max(free, 0) + max(held, 0)))))


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the state directory is made at the daemon's start)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged process may still write on ``path``'s file system (``statvfs``'s ``f_bavail``); None
    where it cannot be measured."""
    try:
        info = os.statvfs(_existing(path))
    except (OSError, AttributeError):  # AttributeError: no statvfs on this platform
        return None
    return info.f_bavail * info.f_frsize


def files_bytes(*paths: Path) -> int:
    """What these files take on the disk (allocated blocks; 0 for one that does not exist)."""
    total = 0
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            continue
        total += max(info.st_blocks * 512, 0) if hasattr(info, "st_blocks") else info.st_size
    return total


@dataclass(frozen=True)
class FileSystem:
    """The file system a path is on."""

    path: str
    """The path asked about (it may not exist yet: then its nearest ancestor was measured)."""
    mount_point: str | None
    fs_type: str | None
    """``ext4``, ``tmpfs``, ``f2fs``...; None where the mount table cannot be read."""
    device: str | None
    """What is mounted: ``/dev/mmcblk0p2``, ``tmpfs``..."""
    total_bytes: int | None
    free_bytes: int | None
    """What an unprivileged process may still write (``f_bavail``)."""


def _unescape(field: str) -> str:
    """Mount table fields escape space, tab, newline and backslash as octal (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_of(path: str, mountinfo: str) -> tuple[str, str, str] | None:
    """(mount point, type, source) of the mount ``path`` (resolved, absolute) lies on, from the text of
    ``/proc/self/mountinfo``: the longest mount point above it, the last one mounted there when there are several."""
    found: tuple[str, str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        after = line.split(" - ", 1)[1].split()
        if len(after) < 2:
            continue
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found[0])):
            found = (point, after[0], _unescape(after[1]))
    return found


def file_system(path: Path, *, mountinfo: str | None = None) -> FileSystem:
    """Which file system ``path`` is on, its type and mount point, its size and free bytes (what is unknown is
    None)."""
    existing = _existing(path)
    resolved = os.path.realpath(existing)
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            mountinfo = ""
    mount = mount_of(resolved, mountinfo)
    total = free = None
    try:
        info = os.statvfs(existing)
        total, free = info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize
    except (OSError, AttributeError):
        pass
    return FileSystem(
        path=str(path),
        mount_point=mount[0] if mount else None,
        fs_type=mount[1] if mount else None,
        device=mount[2] if mount else None,
        total_bytes=total,
        free_bytes=free,
    )
