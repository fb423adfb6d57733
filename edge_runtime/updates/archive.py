"""A bundle packed as one archive for shipping, and its careful unpacking.

The archive is a plain tar (no compression: nothing to inflate, and its length is the length TUF signs). Packing is
deterministic: ``manifest.json`` first, then the manifest's files in its order, with zeroed owners and times, so the
same bundle always packs to the same bytes (and the same sha256).

Unpacking trusts nothing but the signed sha256 of the manifest: the first member must be ``manifest.json`` with
that hash; every later member must be a regular file the manifest lists, once, of the listed size, inside the
destination. Links, devices, directories given as members, absolute or ``..`` paths and anything unlisted are
refused before a byte of it is written. The model's bytes are then checked against the manifest's sha256 by
``edgeline.bundle.verify_files``; no runtime has parsed anything yet.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from edgeline.bundle import MANIFEST_FILE, MAX_MANIFEST_BYTES, Bundle, read_bundle, read_manifest
from edgeline.errors import BundleError, UpdateError, UpdateRefused

__all__ = ["ARCHIVE_SUFFIX", "manifest_sha256", "pack", "unpack"]

ARCHIVE_SUFFIX = ".tar"
_CHUNK = 1 << 20


def manifest_sha256(bundle_dir: Path) -> str:
    return hashlib.sha256((bundle_dir / MANIFEST_FILE).read_bytes()).hexdigest()


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(bundle: Bundle, destination: Path) -> Path:
    """Write ``bundle`` (already read and verified) as one tar at ``destination``, atomically."""
    tmp = destination.with_name(destination.name + ".tmp")
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        manifest = (bundle.path / MANIFEST_FILE).read_bytes()
        tar.addfile(_info(MANIFEST_FILE, len(manifest)), io.BytesIO(manifest))
        for entry in bundle.manifest.files:
            with (bundle.path / entry.path).open("rb") as handle:
                tar.addfile(_info(entry.path, entry.size), handle)
    os.replace(tmp, destination)
    return destination


def _member_path(name: str, archive: Path) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in name:
        raise UpdateRefused(f"{archive}: member {name[:200]!r} is not a plain relative path", reason="malformed")
    return path


def unpack(archive: Path, destination: Path, *, manifest_sha: str) -> Bundle:
    """Unpack ``archive`` into ``destination`` (which must not exist; it is created whole or not at all) and
    return the verified bundle. ``manifest_sha`` is the manifest's sha256 from the signed metadata."""
    if destination.exists():
        raise BundleError(f"{destination} already exists")
    work = destination.with_name(destination.name + ".partial")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        _unpack_into(archive, work, manifest_sha)
        bundle = read_bundle(work)  # sizes and sha256 of every listed file
        os.replace(work, destination)
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
        raise UpdateError(f"{archive}: cannot be unpacked into {destination.parent}: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Bundle(path=destination, manifest=bundle.manifest)


def _unpack_into(archive: Path, work: Path, manifest_sha: str) -> None:
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


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise UpdateRefused(f"member {member.name!r} cannot be read", reason="malformed")
    with handle:
        return handle.read()
