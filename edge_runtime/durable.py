"""Writing files so that a power cut leaves the old content or the new, never a mix, and so that nothing someone else
planted is written through: the one writer of every file edgeline replaces or installs outside SQLite
(``docs/durability.md`` lists each file and its rule).

    write_atomically(path, data)  a fresh temporary file beside it, written, fsync'ed, renamed over ``path``, and
                                  the directory fsync'ed: the rename itself survives the cut
    atomic_writer(path)           the same for a file written as a stream (an archive): a context manager
    new_file(directory)           a fresh temporary file whose name is chosen once it is written (``commit``): an
                                  archive named by its own sha256
    rename_into_place(src, dst)   a file already written and flushed (a staged key) moved over ``dst``, the same checks
    check_destination(path)       refuse now what a later write of ``path`` would refuse (before anything is written)
    check_directory(path)         the same for a directory things are written into or removed from
    ensure_directory(path)        a directory made (or found) inside the directory given, no link followed on the way
    remove_file(path)             a name removed from its directory (a link is removed, never followed)
    sync_file(path)               fsync a file written another way (a tar, a copy), before it is renamed into place
    sync_tree(root)               fsync every file and directory under ``root``, deepest first: an unpacked bundle,
                                  before its directory is renamed into place
    flush_directory(directory)    fsync a directory: the names created, renamed or removed in it survive the cut

Why each step: a rename is atomic for readers, but after a power cut a file system may keep the new name and lose
the data written under it (ext4 with ``delalloc`` keeps it only for a rename over an existing file, f2fs and others
not at all), or keep the data and lose the rename. A file renamed into place is fsync'ed first; the directory is
fsync'ed after, before anything that names the file is written (``state.json`` names a bundle's directory).

What someone else may have planted (whoever can write a repository: a web server, a USB stick): the temporary file
is new, with a random name, created ``O_CREAT|O_EXCL|O_NOFOLLOW`` in the directory opened ``O_NOFOLLOW``, so a link
or a FIFO at ``PATH.tmp`` (or at any name) is neither followed nor waited on, and a stale temporary never blocks a
write. The destination must be a regular file or absent, and its directory a directory, not a link: otherwise the
write is refused (``WriteRefused``, naming the path) before a byte is written. Only the last component of the
directory is checked: the directories a user names on the command line (a repository, a keys directory) are taken
as they resolve, and what a command makes inside them is made with ``ensure_directory``, which follows no link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, NoReturn

from edgeline.errors import EdgelineError

__all__ = [
    "NewFile",
    "WriteRefused",
    "atomic_writer",
    "check_destination",
    "check_directory",
    "ensure_directory",
    "flush_directory",
    "kind_of",
    "new_file",
    "remove_file",
    "rename_into_place",
    "sync_file",
    "sync_tree",
    "write_atomically",
]


class WriteRefused(EdgelineError):
    """A write refused before a byte of it was written: its destination is a symbolic link or not a regular file (a
    FIFO, a device, a directory), or the directory it goes into is a link or not a directory."""


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 16


def kind_of(mode: int) -> str:
    """What a file of ``mode`` (an ``lstat``'s) is, in words: "a symbolic link", "a FIFO", ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refused(path: Path, what: str, how: str) -> WriteRefused:
    return WriteRefused(
        f"{path} is {what}, {how}: edgeline never writes through a link or into what it did not make (someone "
        "may have planted it: remove it once you know how it got there)"
    )


def _explain(path: Path, exc: OSError, mode_of: Callable[[], int]) -> NoReturn:
    """Why ``path`` could not be opened as a directory: a link or something else is refused, naming it."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        raise exc
    try:
        mode = mode_of()
    except OSError:
        raise exc from None  # an ancestor is not a directory: said as the system says it
    if stat.S_ISDIR(mode):
        raise exc
    raise _refused(path, kind_of(mode), "not a directory") from exc


def _open_directory(directory: Path, within: Path | None = None, *, make: int | None = None) -> int:
    """A descriptor of ``directory`` itself, never of a link to one, never of anything else (refused, naming it).
    With ``within`` (a directory the user named, taken as it resolves), every component below it is opened the
    same way, one at a time: no link on the way is followed; with ``make`` (a mode), missing ones are made."""
    if within is None:
        try:
            return os.open(directory, _DIRECTORY_FLAGS)
        except OSError as exc:
            _explain(directory, exc, lambda: os.lstat(directory).st_mode)
    fd = os.open(within, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    current = within
    try:
        for part in directory.relative_to(within).parts:
            current = current / part
            if make is not None:
                try:
                    os.mkdir(part, make, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    os.fsync(fd)
            try:
                inner = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
            except OSError as exc:
                _explain(current, exc, lambda: os.lstat(part, dir_fd=fd).st_mode)  # noqa: B023 - called at once
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_name(directory_fd: int, path: Path) -> None:
    """``path`` (in the directory ``directory_fd``) is a regular file or absent."""
    try:
        mode = os.lstat(path.name, dir_fd=directory_fd).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _refused(path, kind_of(mode), "not a regular file")


def check_destination(path: Path, *, within: Path | None = None) -> None:
    """Refuse, naming it, what a write of ``path`` would refuse (its directory a link or not one, ``path`` a link or
    not a regular file): called before a command writes anything, so that a refusal leaves nothing half done. A
    directory that does not exist yet is not refused (``ensure_directory`` makes it)."""
    try:
        directory = _open_directory(path.parent, within)
    except FileNotFoundError:
        return
    try:
        _check_name(directory, path)
    finally:
        os.close(directory)


def check_directory(path: Path, *, within: Path | None = None) -> None:
    """Refuse, naming it, a directory that is a link or not a directory (one that does not exist is not refused)."""
    try:
        os.close(_open_directory(path, within))
    except FileNotFoundError:
        return


def ensure_directory(path: Path, *, within: Path, mode: int = 0o755) -> Path:
    """``path`` as a directory, made where missing (its parent flushed), each component below ``within`` (a
    directory the user named) a real directory: a link or anything else on the way is refused, naming it."""
    os.close(_open_directory(path, within, make=mode))
    return path


class NewFile:
    """A fresh temporary file in ``directory``, open for writing (``handle``); ``commit(path)`` flushes it and
    renames it over ``path`` (in the same directory), ``discard`` removes it."""

    def __init__(self, directory: Path, directory_fd: int, name: str, handle: BinaryIO):
        self.directory = directory
        self.name = name
        self.handle = handle
        self._directory_fd = directory_fd
        self.committed: Path | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def check(self, path: Path) -> None:
        """Refuse ``path`` (in this file's directory) as ``commit`` would: a link or not a regular file."""
        if path.parent != self.directory:
            raise ValueError(f"{path} is not in {self.directory}")
        _check_name(self._directory_fd, path)

    def commit(self, path: Path) -> Path:
        """Flush the file, rename it over ``path`` (checked again first) and flush the directory."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.check(path)
        os.replace(self.name, path.name, src_dir_fd=self._directory_fd, dst_dir_fd=self._directory_fd)
        os.fsync(self._directory_fd)
        self.committed = path
        return path

    def discard(self) -> None:
        self.handle.close()
        if self.committed is None:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self._directory_fd)


@contextlib.contextmanager
def new_file(directory: Path, *, mode: int = 0o644, stem: str = "", within: Path | None = None) -> Iterator[NewFile]:
    """A ``NewFile`` in ``directory`` (created with ``mode``, less the umask), removed at the end unless committed.
    Its name is ``.STEM.RANDOM.tmp``, created ``O_EXCL|O_NOFOLLOW``: nothing already there is opened."""
    directory_fd = _open_directory(directory, within)
    try:
        for _ in range(_ATTEMPTS):
            name = f".{stem[:120]}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(name, _NEW_FILE_FLAGS, mode, dir_fd=directory_fd)
            except FileExistsError:
                continue
            break
        else:  # pragma: no cover - 16 collisions of 64 random bits
            raise FileExistsError(errno.EEXIST, f"no fresh temporary name in {directory}")
        staged = NewFile(directory, directory_fd, name, os.fdopen(fd, "w+b"))
        try:
            yield staged
        finally:
            staged.discard()
    finally:
        os.close(directory_fd)


@contextlib.contextmanager
def atomic_writer(path: Path, *, mode: int = 0o644, within: Path | None = None) -> Iterator[BinaryIO]:
    """Write ``path`` as a stream: what is written to the handle replaces ``path`` when the block ends without an
    exception (flushed, renamed, the directory flushed); ``path`` is left as it was otherwise."""
    with new_file(path.parent, mode=mode, stem=path.name, within=within) as staged:
        staged.check(path)  # refused before a byte is written, not after
        yield staged.handle
        staged.commit(path)


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644, within: Path | None = None) -> None:
    """Replace ``path`` with ``data``: written to a fresh temporary file (created with ``mode``), flushed to the
    disk, renamed over ``path``, and the directory flushed. A reader (or a power cut) sees the old file or the new
    one. A link or anything but a regular file at ``path``, or a directory that is a link or not one (with
    ``within``: any directory below it on the way), is refused (``WriteRefused``)."""
    with atomic_writer(path, mode=mode, within=within) as handle:
        handle.write(data)


def rename_into_place(source: Path, destination: Path) -> None:
    """Move ``source``, a regular file already flushed (never a link), over ``destination`` in the same directory
    (a regular file or absent), then flush the directory."""
    if source.parent != destination.parent:
        raise ValueError(f"{source} and {destination} are not in one directory")
    directory = _open_directory(destination.parent)
    try:
        mode = os.lstat(source.name, dir_fd=directory).st_mode
        if not stat.S_ISREG(mode):
            raise _refused(source, kind_of(mode), "not a regular file")
        _check_name(directory, destination)
        os.replace(source.name, destination.name, src_dir_fd=directory, dst_dir_fd=directory)
        os.fsync(directory)
    finally:
        os.close(directory)


def remove_file(path: Path, *, within: Path | None = None) -> bool:
    """Remove the name ``path`` (a link is removed, never followed; a directory is refused) and flush its directory;
    False when there was nothing to remove."""
    try:
        directory = _open_directory(path.parent, within)
    except FileNotFoundError:
        return False
    try:
        try:
            mode = os.lstat(path.name, dir_fd=directory).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(mode):
            raise _refused(path, kind_of(mode), "not a file")
        os.unlink(path.name, dir_fd=directory)
        os.fsync(directory)
        return True
    finally:
        os.close(directory)


def sync_file(path: Path) -> None:
    """Flush a file's data to the disk (it was written and closed by code that did not)."""
    _fsync(path)


def flush_directory(directory: Path) -> None:
    """Flush a directory: the names created, renamed or removed in it are on the disk."""
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """Flush every regular file and directory under ``root``, ``root`` last (links are not followed)."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                sync_file(path)
        flush_directory(Path(directory))
