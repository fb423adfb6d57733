"""A block write log in the dm-log-writes format, as QEMU's ``blklogwrites`` driver writes it: read, and replayed
onto a copy of the disk image it was recorded against.

The format (all integers little-endian), from Linux's ``drivers/md/dm-log-writes.c`` and QEMU's
``block/blklogwrites.c``::

    sector 0     super: magic u64 (0x6a736677736872), version u64 (1), nr_entries u64, sectorsize u32
    sector 1...  nr_entries times: one sector of entry header: sector u64, nr_sectors u64, flags u64, data_len u64
                 (the rest of the sector zero, or a MARK's text), then the data: nr_sectors sectors, none for a
                 DISCARD or a MARK

``sector`` and ``nr_sectors`` count in units of ``sectorsize`` (QEMU's ``log-sector-size``, 512 by default). Flags:
FLUSH 1, FUA 2, DISCARD 4, MARK 8, METADATA 16. QEMU logs a write once the image has it, a flush as an entry of its
own (sector 0, no data, FLUSH) once the image's flush returned, a "write zeroes" as a write whose data is zeros;
``data_len`` is always 0. It rewrites the super (``nr_entries``) on every flush and every
``log-super-update-interval`` entries (4096), so a QEMU that was killed leaves whole entries past the super's count:
``Tail.READ`` reads them. QEMU never truncates the log file: record into a new, empty file, or stale entries of an
older recording follow the new ones.

A log that ends inside an entry, or holds something that is not an entry where one should be, is a ``WriteLogError``
naming the byte offset. Nothing here needs QEMU: ``parse_log`` reads any buffer (bytes, mmap); ``read_log`` maps a
file; ``ImageWriter`` applies entries to a raw image.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgeline.errors import EdgelineError

__all__ = [
    "LOG_MAGIC",
    "Entry",
    "Flag",
    "ImageWriter",
    "Tail",
    "WriteLog",
    "WriteLogError",
    "parse_log",
    "read_log",
]

LOG_MAGIC = 0x6A736677736872
LOG_VERSION = 1
SUPER = struct.Struct("<QQQI")
ENTRY = struct.Struct("<QQQQ")
MAX_SECTOR_SIZE = 1 << 24
"""QEMU refuses a log sector size of 16 MiB or more (and one that is not a power of two)."""

Buffer = bytes | bytearray | memoryview | mmap.mmap


class WriteLogError(EdgelineError):
    """A write log that cannot be read: cut short, or not a dm-log-writes log; ``offset`` is where, in bytes."""

    def __init__(self, message: str, *, offset: int):
        super().__init__(message)
        self.offset = offset


class Flag(enum.IntFlag):
    FLUSH = 1
    FUA = 2
    DISCARD = 4
    MARK = 8
    METADATA = 16


KNOWN_FLAGS = int(Flag.FLUSH | Flag.FUA | Flag.DISCARD | Flag.MARK | Flag.METADATA)


class Tail(enum.Enum):
    """What to do with the bytes past the super's ``nr_entries``."""

    IGNORE = "ignore"
    """Only the entries the super counts: what a QEMU that closed its log cleanly (it flushes at exit) wrote."""
    READ = "read"
    """Go on while whole, valid entries follow, stopping quietly at the first that is not (zeros, the end, half an
    entry): the entries a killed QEMU wrote after its last super update. Only sound on a log recorded into an empty
    file (stale entries of an older recording would be read too)."""


@dataclass(frozen=True)
class Entry:
    """One logged request. ``data_offset``: where its data starts in the log; ``length``: its bytes there (0 for a
    flush, a discard or a mark)."""

    index: int
    offset: int
    sector: int
    nr_sectors: int
    flags: Flag
    data_len: int
    data_offset: int
    length: int
    mark: str | None = None

    @property
    def is_flush(self) -> bool:
        return bool(self.flags & Flag.FLUSH)

    @property
    def is_write(self) -> bool:
        """Carries data for the image (a write, or a write of zeroes)."""
        return self.length > 0


@dataclass(frozen=True)
class WriteLog:
    """A parsed log: its entries (headers and where their data is, not the data) and its flush points."""

    sector_size: int
    counted: int
    """``nr_entries`` of the super; ``len(entries)`` is larger when the tail was read."""
    entries: tuple[Entry, ...]
    size: int
    """Bytes of the log."""
    path: Path | None = None

    @property
    def flushes(self) -> tuple[int, ...]:
        """Indices (into ``entries``) of the flush entries, in order: the cut points."""
        return tuple(entry.index for entry in self.entries if entry.is_flush)

    @property
    def written_bytes(self) -> int:
        return sum(entry.length for entry in self.entries)


def _error(where: str, offset: int, message: str) -> WriteLogError:
    return WriteLogError(f"{where}: offset {offset}: {message}", offset=offset)


def _super(buffer: Buffer, where: str) -> tuple[int, int]:
    size = len(buffer)
    if size < SUPER.size:
        raise _error(where, 0, f"the log ends after {size} bytes, inside its {SUPER.size}-byte super block (cut short)")
    magic, version, nr_entries, sector_size = SUPER.unpack_from(buffer, 0)
    if magic != LOG_MAGIC:
        raise _error(where, 0, f"magic {magic:#x} is not dm-log-writes' {LOG_MAGIC:#x}: not a write log")
    if version != LOG_VERSION:
        raise _error(where, 8, f"version {version}: only version {LOG_VERSION} is known")
    if sector_size < SUPER.size or sector_size >= MAX_SECTOR_SIZE or sector_size & (sector_size - 1):
        raise _error(where, 24, f"sector size {sector_size} is not a power of two from 32 bytes to 8 MiB")
    if size < sector_size:
        raise _error(where, 0, f"the log ends after {size} bytes, inside its {sector_size}-byte super sector")
    return nr_entries, sector_size


def _entry(buffer: Buffer, index: int, offset: int, sector_size: int, device_bytes: int | None, where: str) -> Entry:
    """The entry at ``offset``; ``WriteLogError`` when it is cut short or not an entry."""
    size = len(buffer)
    if offset + sector_size > size:
        raise _error(where, offset, f"entry {index}: the log ends at {size}, inside the entry's header (cut short)")
    sector, nr_sectors, flags, data_len = ENTRY.unpack_from(buffer, offset)
    if flags & ~KNOWN_FLAGS:
        raise _error(where, offset, f"entry {index}: unknown flags {flags:#x} (known: {KNOWN_FLAGS:#x}): not an entry")
    flag = Flag(flags)
    if nr_sectors == 0 and not flag & (Flag.FLUSH | Flag.MARK):
        raise _error(where, offset, f"entry {index}: a request of no sectors (zeros where an entry should be)")
    mark = None
    length = 0
    if flag & Flag.MARK:
        if data_len > sector_size - ENTRY.size:
            raise _error(where, offset, f"entry {index}: a mark of {data_len} bytes does not fit its sector")
        raw = bytes(buffer[offset + ENTRY.size : offset + ENTRY.size + data_len])
        mark = raw.decode("utf-8", "replace")
    elif not flag & Flag.DISCARD:
        length = nr_sectors * sector_size
    end_sector = sector + nr_sectors
    if device_bytes is not None and end_sector * sector_size > device_bytes and not flag & Flag.MARK:
        raise _error(
            where, offset, f"entry {index}: sectors {sector}..{end_sector} go past the device's {device_bytes} bytes"
        )
    data_offset = offset + sector_size
    if data_offset + length > size:
        raise _error(
            where,
            offset,
            f"entry {index}: its {length} bytes of data would end at {data_offset + length}, the log at {size} "
            "(cut short)",
        )
    return Entry(index, offset, sector, nr_sectors, flag, data_len, data_offset, length, mark)


def parse_log(
    buffer: Buffer, *, tail: Tail = Tail.IGNORE, device_bytes: int | None = None, path: Path | None = None
) -> WriteLog:
    """The log in ``buffer``. ``device_bytes``: the recorded disk's size, when known (a write past it is refused).
    Raises ``WriteLogError`` naming the offset of the first thing that is not what the format says."""
    where = str(path) if path is not None else "write log"
    counted, sector_size = _super(buffer, where)
    entries: list[Entry] = []
    offset = sector_size
    for index in range(counted):
        entry = _entry(buffer, index, offset, sector_size, device_bytes, where)
        entries.append(entry)
        offset = entry.data_offset + entry.length
    if tail is Tail.READ:
        while offset + sector_size <= len(buffer):
            try:
                entry = _entry(buffer, len(entries), offset, sector_size, device_bytes, where)
            except WriteLogError:  # zeros (the file's unwritten end), half an entry, or stale bytes
                break
            entries.append(entry)
            offset = entry.data_offset + entry.length
    return WriteLog(sector_size, counted, tuple(entries), len(buffer), path)


def read_log(path: Path, *, tail: Tail = Tail.IGNORE, device_bytes: int | None = None) -> WriteLog:
    """``parse_log`` of a file, mapped rather than read (a log of a busy minute is hundreds of MB)."""
    try:
        with path.open("rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                raise _error(str(path), 0, "the log is empty: no super block (cut short)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return parse_log(mapped, tail=tail, device_bytes=device_bytes, path=path)
    except OSError as exc:
        raise WriteLogError(f"{path}: cannot be read: {exc.strerror or exc}", offset=0) from exc


class ImageWriter:
    """Applies a log's entries to a raw disk image, opened for writing: whole, or only some of their sectors (a
    write the power cut tore). A discard leaves the image as it was: what a discarded sector reads back is not
    defined, and the old contents are one of the answers a card may give."""

    def __init__(self, log_path: Path, sector_size: int, image: Path):
        self.sector_size = sector_size
        self._log = os.open(log_path, os.O_RDONLY)
        try:
            self._image = os.open(image, os.O_WRONLY)
        except OSError:
            os.close(self._log)
            raise

    def __enter__(self) -> ImageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self._log, self._image):
            with contextlib.suppress(OSError):
                os.close(fd)

    def apply(self, entries: Iterable[Entry]) -> int:
        """Each write whole, in order; returns the bytes written."""
        written = 0
        for entry in entries:
            if entry.is_write:
                written += self._copy(entry.data_offset, entry.sector * self.sector_size, entry.length)
        return written

    def apply_sectors(self, entry: Entry, sectors: Sequence[int]) -> int:
        """Only ``sectors`` of ``entry`` (offsets from its first sector, each below ``entry.nr_sectors``)."""
        written = 0
        for relative in sectors:
            if not 0 <= relative < entry.nr_sectors:
                raise ValueError(f"sector {relative} is not one of entry {entry.index}'s {entry.nr_sectors}")
            start = relative * self.sector_size
            written += self._copy(entry.data_offset + start, entry.sector * self.sector_size + start, self.sector_size)
        return written

    def _copy(self, source: int, target: int, length: int) -> int:
        chunk = 1 << 20
        done = 0
        while done < length:
            data = os.pread(self._log, min(chunk, length - done), source + done)
            if not data:
                raise WriteLogError(f"the log ends at {source + done} while data was read", offset=source + done)
            os.pwrite(self._image, data, target + done)
            done += len(data)
        return done
