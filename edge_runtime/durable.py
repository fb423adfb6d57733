"""Writing files so that a power cut leaves the old content or the new, never a mix: the one rule for every file
edgeline replaces or installs outside SQLite (``docs/durability.md`` lists each file and its rule).

    write_atomically(path, data)  a temporary file beside it, written, fsync'ed, renamed over ``path``, and the
                                  directory fsync'ed: the rename itself survives the cut
    sync_file(path)               fsync a file written another way (a tar, a copy), before it is renamed into place
    sync_tree(root)               fsync every file and directory under ``root``, deepest first: an unpacked bundle,
                                  before its directory is renamed into place
    flush_directory(directory)    fsync a directory: the names created, renamed or removed in it survive the cut

Why each step: a rename is atomic for readers, but after a power cut a file system may keep the new name and lose
the data written under it (ext4 with ``delalloc`` keeps it only for a rename over an existing file, f2fs and others
not at all), or keep the data and lose the rename. A file renamed into place is fsync'ed first; the directory is
fsync'ed after, before anything that names the file is written (``state.json`` names a bundle's directory).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["flush_directory", "sync_file", "sync_tree", "write_atomically"]


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: written to a temporary file (created with ``mode``), flushed to the disk,
    renamed over ``path``, and the directory flushed. A reader (or a power cut) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    flush_directory(path.parent)


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
