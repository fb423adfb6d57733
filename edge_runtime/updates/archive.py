"""A bundle packed as one archive for shipping, and its careful unpacking.

The archive is a plain tar (no compression: nothing to inflate, and its length is the length TUF signs). Packing is
deterministic: ``manifest.json`` first, then the manifest's files in its order, with zeroed owners and times, so the
same bundle always packs to the same bytes (and the same sha256).

Unpacking trusts nothing but the signed metadata: the first member must be ``manifest.json`` with the signed
sha256; every later member must be a regular file the manifest lists, once, of the listed size, inside the
destination, and all of them together no more bytes, files and directories than the signed unpacked size
(``unpacked_size``, which the device's room check counted on). Links, devices, sparse members (a few bytes of
archive that unpack to any number of zeros), directories given as members, absolute or ``..`` paths and anything
unlisted are refused before a byte of it is written. The model's bytes are then checked against the manifest's
sha256 by ``edgeline.bundle.verify_files``; no runtime has parsed anything yet.

Both write durably (``edgeline.durable``): an archive is fsync'ed before it is renamed into place; an unpacked
bundle's files and directories are fsync'ed before ``NAME.partial`` is renamed to ``NAME``, and the parent after,
so that a power cut never leaves a name (which ``state.json`` may already hold) over data that did not reach the disk.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from edgeline.bundle import MANIFEST_FILE, MAX_MANIFEST_BYTES, Bundle, read_bundle, read_manifest
from edgeline.durable import atomic_writer, flush_directory, sync_tree
from edgeline.errors import BundleError, UpdateError, UpdateRefused

__all__ = ["ARCHIVE_SUFFIX", "manifest_sha256", "pack", "pack_into", "unpack", "unpacked_size"]

ARCHIVE_SUFFIX = ".tar"
_CHUNK = 1 << 20


def manifest_sha256(bundle_dir: Path) -> str:
    return hashlib.sha256((bundle_dir / MANIFEST_FILE).read_bytes()).hexdigest()


def unpacked_size(bundle: Bundle) -> tuple[int, int]:
    """What ``bundle``'s archive unpacks to: (bytes of its files, ``manifest.json`` included; its files and the
    directories they are in). Signed with the target, so a device can count the room before it downloads."""
    paths = [MANIFEST_FILE, *(entry.path for entry in bundle.manifest.files)]
    directories = {parent for path in paths for parent in PurePosixPath(path).parents if parent.parts}
    size = (bundle.path / MANIFEST_FILE).stat().st_size + sum(entry.size for entry in bundle.manifest.files)
    return size, len(paths) + len(directories)


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(bundle: Bundle, destination: Path) -> Path:
    """Write ``bundle`` (already read and verified) as one tar at ``destination``, atomically (``atomic_writer``)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(destination) as handle:
        pack_into(bundle, handle)
    return destination


def pack_into(bundle: Bundle, handle: BinaryIO) -> None:
    """Write ``bundle`` as one tar into ``handle`` (a file open for writing, at its start): deterministic, the
    manifest first."""
    with tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT) as tar:
        manifest = (bundle.path / MANIFEST_FILE).read_bytes()
        tar.addfile(_info(MANIFEST_FILE, len(manifest)), io.BytesIO(manifest))
        for entry in bundle.manifest.files:
            with (bundle.path / entry.path).open("rb") as source:
                tar.addfile(_info(entry.path, entry.size), source)


def _member_path(name: str, archive: Path) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in name:
        raise UpdateRefused(f"{archive}: member {name[:200]!r} is not a plain relative path", reason="malformed")
    return path


@dataclass
class _Budget:
    """What the signed metadata says the archive unpacks to, and what was taken of it so far (None: not signed, for
    a target published before it was; the manifest's sizes still bound every file)."""

    archive: Path
    max_bytes: int | None
    max_entries: int | None
    taken_bytes: int = 0
    taken_entries: int = 0
    directories: set[PurePosixPath] = field(default_factory=set)

    def take(self, path: PurePosixPath, size: int) -> None:
        """Count ``path`` (``size`` bytes) and the directories it makes; refuse it, before it is written, beyond the
        signed figures."""
        new = {parent for parent in path.parents if parent.parts} - self.directories
        taken_bytes, taken_entries = self.taken_bytes + size, self.taken_entries + 1 + len(new)
        if self.max_bytes is not None and taken_bytes > self.max_bytes:
            raise UpdateRefused(
                f"{self.archive}: member {path.as_posix()!r} takes it past the {self.max_bytes} bytes its signed "
                "metadata says it unpacks to",
                reason="malformed",
            )
        if self.max_entries is not None and taken_entries > self.max_entries:
            raise UpdateRefused(
                f"{self.archive}: member {path.as_posix()!r} takes it past the {self.max_entries} files and "
                "directories its signed metadata says it unpacks to",
                reason="malformed",
            )
        self.taken_bytes, self.taken_entries = taken_bytes, taken_entries
        self.directories |= new


def unpack(
    archive: Path,
    destination: Path,
    *,
    manifest_sha: str,
    unpacked_bytes: int | None = None,
    unpacked_entries: int | None = None,
) -> Bundle:
    """Unpack ``archive`` into ``destination`` (which must not exist; it is created whole or not at all) and
    return the verified bundle. ``manifest_sha`` is the manifest's sha256 from the signed metadata;
    ``unpacked_bytes`` and ``unpacked_entries`` the signed unpacked size (``unpacked_size``; None when not
    signed)."""
    if destination.exists():
        raise BundleError(f"{destination} already exists")
    work = destination.with_name(destination.name + ".partial")
    if work.is_symlink() or (work.exists() and not work.is_dir()):
        work.unlink()  # a link planted there is removed, never followed; a cut unpack's directory is removed whole
    elif work.exists():
        shutil.rmtree(work)
    try:
        work.mkdir(parents=True)
        _unpack_into(archive, work, manifest_sha, _Budget(archive, unpacked_bytes, unpacked_entries))
        bundle = read_bundle(work)  # sizes and sha256 of every listed file
        # every byte on the disk before the directory gets its name, and the name before ``state.json`` says it
        sync_tree(work)
        os.replace(work, destination)
        flush_directory(destination.parent)
    except BundleError as exc:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, UpdateRefused):
            raise
        raise UpdateRefused(f"{archive}: {exc}", reason="malformed") from exc
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:  # listed paths that collide
        shutil.rmtree(work, ignore_errors=True)
        raise UpdateRefused(
            f"{archive}: cannot be unpacked as its manifest lists it ({exc})", reason="malformed"
        ) from exc
    except OSError as exc:  # a full disk, a read-only state directory: this device's trouble, tried again later
        shutil.rmtree(work, ignore_errors=True)
        where = f"{archive}: cannot be unpacked into {destination.parent}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UpdateRefused(f"{where} (tried again at the next check)", reason="no-room") from exc
        raise UpdateError(where) from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Bundle(path=destination, manifest=bundle.manifest)


def _unpack_into(archive: Path, work: Path, manifest_sha: str, budget: _Budget) -> None:
    try:
        tar = tarfile.open(archive, "r:")  # noqa: SIM115 - closed by the with below; plain tar only: no decompression
    except (tarfile.TarError, OSError) as exc:
        raise UpdateRefused(f"{archive}: not a bundle archive ({exc})", reason="malformed") from exc
    with tar:
        members = iter(tar)
        try:
            first = next(members, None)
            if first is None or first.name != MANIFEST_FILE or not first.isreg() or first.size > MAX_MANIFEST_BYTES:
                raise UpdateRefused(f"{archive}: the first member must be {MANIFEST_FILE}", reason="malformed")
            _refuse_sparse(first, archive)
            budget.take(PurePosixPath(MANIFEST_FILE), first.size)
            data = _read_member(tar, first)
            if hashlib.sha256(data).hexdigest() != manifest_sha:
                raise UpdateRefused(
                    f"{archive}: its {MANIFEST_FILE} is not the one the signed metadata names (sha256 differs)",
                    reason="tampered",
                )
            (work / MANIFEST_FILE).write_bytes(data)
            manifest = read_manifest(work)
            sizes = {entry.path: entry.size for entry in manifest.files}
            seen: set[str] = set()
            for member in members:
                path = _member_path(member.name, archive)
                name = path.as_posix()
                if not member.isreg():
                    raise UpdateRefused(f"{archive}: member {name!r} is not a regular file", reason="malformed")
                _refuse_sparse(member, archive)
                if name not in sizes or name in seen or name == MANIFEST_FILE:
                    raise UpdateRefused(
                        f"{archive}: member {name!r} is {'repeated' if name in seen else 'not listed in the manifest'}",
                        reason="malformed",
                    )
                if member.size != sizes[name]:
                    raise UpdateRefused(
                        f"{archive}: member {name!r} has {member.size} bytes, the manifest says {sizes[name]}",
                        reason="malformed",
                    )
                budget.take(path, member.size)
                seen.add(name)
                target = work.joinpath(*path.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                with source, target.open("xb") as out:
                    shutil.copyfileobj(source, out, _CHUNK)
            missing = sorted(set(sizes) - seen)
            if missing:
                raise UpdateRefused(f"{archive}: missing {', '.join(missing[:5])}", reason="malformed")
        except tarfile.TarError as exc:
            raise UpdateRefused(f"{archive}: a broken archive ({exc})", reason="malformed") from exc


def _refuse_sparse(member: tarfile.TarInfo, archive: Path) -> None:
    """A sparse member (GNU's old format or pax's) unpacks to its full size from a few bytes of archive: ``pack``
    never writes one, and its zeros would be written before any size is checked."""
    if member.issparse():
        raise UpdateRefused(
            f"{archive}: member {member.name[:200]!r} is sparse ({member.size} bytes from a map of holes)",
            reason="malformed",
        )


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise UpdateRefused(f"member {member.name!r} cannot be read", reason="malformed")
    with handle:
        return handle.read()
