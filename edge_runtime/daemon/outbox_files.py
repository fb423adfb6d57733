"""Are the outbox's files at its path still the ones its SQLite connection writes?

An operator's ``rm``, a cleaning script's ``truncate``, a restored copy moved over the file, a card that lost the
end of a file: SQLite notices none of them. It keeps writing into the unlinked inode (or past the hole a truncation
left), its commits succeed, the inputs are acknowledged, and the next start opens what is at the path: an empty
file, or a log whose frames stop at the hole (the issue: 859 and 768 of 3,000 acknowledged inputs never answered).

``FilesWatch`` is made right after SQLite opened the database and its write-ahead log, and remembers them; its
``changed`` says, in words, what happened since (or None), comparing:

- the identity (``st_dev``, ``st_ino``) of the file at each path with the one it holds open: deleted, or replaced;
- the database file's size, which never shrinks under SQLite in our use (no auto-vacuum: a checkpoint only grows
  it): a smaller one was truncated; and its first 16 bytes, which must stay SQLite's;
- the log: it keeps SQLite's magic number once a look saw it (a log whose header a power cut tore before this start
  is ignored, by SQLite and by the look, until SQLite starts it over); within one generation of the log (the salt
  in its header, new each time SQLite starts it over) it never shrinks; and the last frame of that generation seen
  at the previous look must still carry the salt: a log truncated and then written past by the next commit (its
  size is back, the frames in between are zeros that a restart stops at) fails this.

Only SQLite's own ``wal_checkpoint(TRUNCATE)`` empties the log: the outbox calls ``emptied`` after it.

Each look is two ``stat`` and two or three ``pread`` of a few bytes on descriptors held open: 11 µs on the
development machine, where a commit of 20 answers with its fsync takes 530 µs (``docs/durability.md``). The
descriptors are closed only once SQLite's connection is closed: closing any descriptor of a file drops every POSIX
lock this process holds on it, SQLite's exclusive lock on the database included.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["FilesWatch"]

DATABASE_HEADER = b"SQLite format 3\x00"
WAL_MAGIC = (0x377F0682, 0x377F0683)
WAL_HEADER = 32
FRAME_HEADER = 24
SALT = slice(16, 24)
"""Where the salt is in the log's header; a frame's is at bytes 8 to 16 of its own header."""


class FilesWatch:
    """The database ``path`` and its log ``wal`` as SQLite opened them (see the module)."""

    def __init__(self, path: Path, wal: Path) -> None:
        self.path = path
        self.wal = wal
        self._where = (os.fspath(path), os.fspath(wal))  # (``stat`` takes a str faster than a Path)
        self._fds: list[int] = []
        self._database = self._hold(path)
        self._log = self._hold(wal)
        self._identity = (os.fstat(self._database), os.fstat(self._log))
        self._database_size = 0
        self._salt = b""
        self._log_size = 0
        self._last_frame = 0
        """The last frame of the current generation seen (1-based; 0: none)."""
        problem = self.changed()
        if problem is not None:  # a file changed between SQLite's open and ours
            self.close()
            raise OSError(f"{problem} while it was opened")

    def _hold(self, path: Path) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        self._fds.append(fd)
        return fd

    def ours(self, path: Path) -> bool:
        """Whether the file at ``path`` is the database or log held open (a truncated one is still ours)."""
        try:
            found = os.lstat(path)
        except OSError:
            return False
        return any((found.st_dev, found.st_ino) == (held.st_dev, held.st_ino) for held in self._identity)

    def changed(self) -> str | None:
        """What happened to the files since the last look, in words ("its write-ahead log ... was deleted"), or
        None."""
        return self._database_changed() or self._log_changed()

    def emptied(self) -> None:
        """The outbox checkpointed the log with TRUNCATE: an empty log is its doing."""
        self._salt, self._log_size, self._last_frame = b"", 0, 0

    def close(self) -> None:
        """After SQLite's connection is closed (see the module)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _database_changed(self) -> str | None:
        found = _stat(self._where[0])
        if isinstance(found, str):
            return f"its database file {found}"
        held = self._identity[0]
        if (found.st_dev, found.st_ino) != (held.st_dev, held.st_ino):
            return "its database file was replaced by another file"
        if found.st_size < self._database_size:
            return f"its database file was truncated ({self._database_size} bytes before, {found.st_size} now)"
        if found.st_size and os.pread(self._database, len(DATABASE_HEADER), 0) != DATABASE_HEADER:
            return "its database file does not start with SQLite's header any more (overwritten, or truncated)"
        self._database_size = found.st_size
        return None

    def _log_changed(self) -> str | None:
        found = _stat(self._where[1])
        if isinstance(found, str):
            return self._log_said(found)
        held = self._identity[1]
        if (found.st_dev, found.st_ino) != (held.st_dev, held.st_ino):
            return self._log_said("was replaced by another file")
        size = found.st_size
        if size == 0:
            return self._log_said(f"was truncated ({self._log_size} bytes before, 0 now)") if self._log_size else None
        header = os.pread(self._log, WAL_HEADER, 0)
        if len(header) < WAL_HEADER or int.from_bytes(header[:4], "big") not in WAL_MAGIC:
            if self._salt:  # SQLite never spoils a header it wrote: it starts the log over with a new one
                return self._log_said("does not start with SQLite's header any more (truncated, and written past)")
            # a log a power cut tore before the last start: SQLite ignores it and starts it over at its first write
            self._log_size, self._last_frame = size, 0
            return None
        salt, frame = header[SALT], FRAME_HEADER + int.from_bytes(header[8:12], "big")
        last = 0
        if salt == self._salt:
            if size < self._log_size:
                return self._log_said(f"was truncated ({self._log_size} bytes before, {size} now)")
            if self._last_frame and not self._frame_has(self._last_frame, frame, salt):
                return self._log_said("lost frames it held (truncated, and written past)")
            last = self._last_frame
        self._salt, self._log_size = salt, size
        self._last_frame = self._last_frame_of(salt, frame, size, known=last)
        return None

    def _log_said(self, what: str) -> str:
        return f"its write-ahead log {self.wal.name} {what}"

    def _frame_has(self, index: int, frame: int, salt: bytes) -> bool:
        at = WAL_HEADER + (index - 1) * frame + 8
        return os.pread(self._log, 8, at) == salt

    def _last_frame_of(self, salt: bytes, frame: int, size: int, *, known: int) -> int:
        """The last frame carrying ``salt``: the generation's frames come first in the file, older ones after
        (SQLite reuses the file in place). Above ``known`` (a frame that has it, or 0): the file's last frame
        first (the log grows at its end), else steps that double from ``known`` (a commit adds a few frames), then
        halving; a few reads, at most about 2 log2 of the frames in the file."""
        low, high = known, (size - WAL_HEADER) // frame
        if high > low and self._frame_has(high, frame, salt):
            return high
        high -= 1  # invariant from here: frame ``low`` has it (or is 0), frame ``high + 1`` does not
        step = 1
        while low + step <= high:
            if not self._frame_has(low + step, frame, salt):
                high = low + step - 1
                break
            low += step
            step *= 2
        while low < high:
            middle = (low + high + 1) // 2
            if self._frame_has(middle, frame, salt):
                low = middle
            else:
                high = middle - 1
        return low


def _stat(path: str) -> os.stat_result | str:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return "was deleted"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
