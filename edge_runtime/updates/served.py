"""What a repository serves, read as a device reads it: the publisher signs only what it wrote.

Every command that writes a repository (``edgeline publish``, ``publish --refresh``, ``rollout``, ``keys renew`` and
``keys rotate`` with ``--repo``) reads the repository's state through ``verified_state`` first and carries over
nothing else. Whatever is not as the keys directory's root chain (``keys.root_chain``) says is refused, naming the
file and what differs:

    metadata/N.root.json       each the same bytes as KEYS/N.root.json; a version the keys directory lacks is refused
    metadata/root.json         one of those
    metadata/timestamp.json    signed by the timestamp key of the repository's newest root
    metadata/V.snapshot.json   the version the timestamp names, signed by the snapshot key
    metadata/T.targets.json    the version the snapshot names, signed by the targets key
    targets/NAME/<sha256>.NAME-vV.tar   each signed target's archive: there, of its signed length and sha256

A repository without ``timestamp.json`` is new: it may hold the keys directory's roots, and the snapshot and targets
metadata of a first publish cut short (signed by their keys); anything else a device would read is refused. Files
under ``targets/`` that no signed target names are said and left alone: only signed entries are carried over, so
they are never signed.

Unlike a device, the publisher does not refuse expired metadata (re-signing it is what ``publish --refresh`` and
``keys renew`` are for). A replay of an older state these keys did sign reads as valid here; it is caught against
what the keys recorded they signed (``edgeline.updates.highwater``). A signature covers the whole file, so an added
entry, a changed hash or a removed entry all read as "not signed by the ... key". A signed target whose archive is
lost is refused until it is restored or the target removed (``edgeline publish --remove NAME VERSION``: its
archive is then left unchecked, ``unchecked``).
"""

from __future__ import annotations

import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.errors import UpdateError, UpdateRefused
from edgeline.updates.fetchers import open_regular
from edgeline.updates.keys import RootChain, root_files
from edgeline.updates.policy import TargetFacts

if TYPE_CHECKING:
    from tuf.api.metadata import Metadata, MetaFile, Root, Snapshot, Targets, Timestamp

__all__ = ["SignedState", "verified_state"]

log = logging.getLogger("edgeline.updates")

ROLE_FILE = re.compile(r"([1-9][0-9]*)\.(snapshot|targets)\.json")

_RESTORE = "restore the repository from a copy you trust; nothing is signed until then"


@dataclass(frozen=True)
class SignedState:
    """A repository's current metadata, each file verified."""

    timestamp: Metadata[Timestamp]
    snapshot: Metadata[Snapshot]
    targets: Metadata[Targets]


@dataclass(frozen=True)
class _Trusted:
    """The root the repository's metadata is checked with: its newest, the keys directory's ``file``."""

    file: Path
    root: Root


MAX_METADATA_BYTES = 16 << 20
"""Larger than any metadata this publisher writes (python-tuf's devices take a targets file of 5 MB at most)."""


def _read(path: Path) -> bytes:
    """A metadata file's bytes: a regular file only (a FIFO planted in the repository would hang the command, a
    device would never end), of at most ``MAX_METADATA_BYTES``. ``FileNotFoundError`` is left to the caller."""
    try:
        with open_regular(path) as handle:
            chunks, size = [], 0
            while size <= MAX_METADATA_BYTES and (chunk := handle.read(1 << 20)):
                chunks.append(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UpdateError(f"{exc if exc.strerror is None else f'{path}: {exc.strerror}'}; {_RESTORE}") from exc
    if size > MAX_METADATA_BYTES:
        raise UpdateError(f"{path}: over {MAX_METADATA_BYTES} bytes: not metadata this publisher wrote; {_RESTORE}")
    return b"".join(chunks)


def verified_state(directory: Path, chain: RootChain, *, unchecked: frozenset[str] = frozenset()) -> SignedState | None:
    """The state the repository ``directory`` serves, verified against ``chain``; None for a new repository. The
    archives of the targets ``unchecked`` names (being removed) are not read."""
    metadata_dir = directory / "metadata"
    trusted = _repository_root(metadata_dir, chain)
    stamp_file = metadata_dir / "timestamp.json"
    if not stamp_file.exists():
        _first_publish_only(metadata_dir, trusted)
        return None
    if trusted is None:
        raise UpdateError(
            f"{stamp_file}: the repository holds no root metadata (1.root.json) to check it with: this publisher did "
            f"not write it; {_RESTORE}"
        )
    timestamp = _verified(stamp_file, "timestamp", trusted)
    snapshot_meta = timestamp.signed.snapshot_meta
    snapshot_file = metadata_dir / f"{snapshot_meta.version}.snapshot.json"
    snapshot = _verified(snapshot_file, "snapshot", trusted, snapshot_meta, stamp_file)
    targets_meta = snapshot.signed.meta.get("targets.json")
    if targets_meta is None:
        raise UpdateError(f"{snapshot_file}: names no targets.json")
    targets_file = metadata_dir / f"{targets_meta.version}.targets.json"
    targets = _verified(targets_file, "targets", trusted, targets_meta, snapshot_file)
    _check_archives(directory / "targets", targets, targets_file, unchecked, chain.directory)
    return SignedState(timestamp=timestamp, snapshot=snapshot, targets=targets)


def _repository_root(metadata_dir: Path, chain: RootChain) -> _Trusted | None:
    """The repository's newest root, once each of its root files is found to be the keys directory's."""
    roots = root_files(metadata_dir)
    for version, path in roots.items():
        source = chain.files.get(version)
        if source is None:
            raise UpdateError(
                f"{path}: the keys directory {chain.directory} has no root version {version}: these keys are older "
                "than the repository (publish with the keys directory that wrote it), or the file was planted (a "
                "device walking the chain refuses the whole repository while it is there: remove it once you know "
                "how it got there)"
            )
        if _read(path) != source.read_bytes():
            raise UpdateError(
                f"{path}: differs from {source}, the root version {version} of these keys (a device walking the "
                "chain refuses the whole repository while it is there: replace it with that file once you know how "
                "it got there)"
            )
    shown = metadata_dir / "root.json"
    if shown.is_file() and _read(shown) not in {path.read_bytes() for path in chain.files.values()}:
        raise UpdateError(f"{shown}: none of the root versions of {chain.directory}: this publisher did not write it")
    if not roots:
        return None
    newest = max(roots)
    return _Trusted(file=chain.files[newest], root=chain.roots[newest].signed)


def _first_publish_only(metadata_dir: Path, trusted: _Trusted | None) -> None:
    """A repository without a timestamp may hold what a first publish cut short wrote, and nothing else."""
    from tuf.api.metadata import MetaFile

    if not metadata_dir.is_dir():
        return
    for path in sorted(metadata_dir.iterdir()):
        match = ROLE_FILE.fullmatch(path.name)
        if match is None:
            continue
        if trusted is None:
            raise UpdateError(
                f"{path}: the repository has no timestamp.json and no root metadata: this publisher did not write "
                f"it; {_RESTORE}"
            )
        _verified(path, match[2], trusted, MetaFile(version=int(match[1])))


def _verified(
    path: Path, role: str, trusted: _Trusted, meta: MetaFile | None = None, named_by: Path | None = None
) -> Metadata[Any]:
    """``path`` read, checked against ``meta`` (what the file naming it says of it), of ``role``, signed by that
    role's key in ``trusted``'s root."""
    from tuf.api.exceptions import LengthOrHashMismatchError, UnsignedMetadataError
    from tuf.api.metadata import Metadata
    from tuf.api.serialization import DeserializationError

    named = f" ({named_by.name} names it)" if named_by is not None else ""
    try:
        data = _read(path)
    except FileNotFoundError as exc:
        raise UpdateError(f"{path}: missing{named}; {_RESTORE}") from exc
    except OSError as exc:
        raise UpdateError(f"{path}: {exc.strerror or exc}") from exc
    try:
        if meta is not None:
            meta.verify_length_and_hashes(data)
        metadata = Metadata.from_bytes(data)
    except LengthOrHashMismatchError as exc:
        raise UpdateError(f"{path}: not the file {named_by} signs ({exc}); {_RESTORE}") from exc
    except DeserializationError as exc:
        raise UpdateError(f"{path}: not TUF metadata ({exc}); {_RESTORE}") from exc
    if metadata.signed.type != role:
        raise UpdateError(f"{path}: {metadata.signed.type} metadata where {role} belongs; {_RESTORE}")
    try:
        trusted.root.verify_delegate(role, metadata.signed_bytes, metadata.signatures)
    except UnsignedMetadataError as exc:
        raise UpdateError(
            f"{path}: not signed by the {role} key that {trusted.file} trusts ({exc}): changed after it was signed, "
            f"and a publisher signs only what it wrote; {_RESTORE}"
        ) from exc
    if meta is not None and metadata.signed.version != meta.version:
        raise UpdateError(f"{path}: version {metadata.signed.version}, not the {meta.version} its name says{named}")
    return metadata


def _check_archives(
    targets_dir: Path, targets: Metadata[Targets], targets_file: Path, unchecked: frozenset[str], keys: Path
) -> None:
    """Each signed target's archive is on disk as signed; files no signed target names are said."""
    from tuf.api.exceptions import LengthOrHashMismatchError

    signed = set()
    for path, info in targets.signed.targets.items():
        prefixed = info.get_prefixed_paths()  # where a device fetches it: the first hash, then the name
        if not prefixed:
            raise UpdateError(f"{targets_file}: target {path} has no hash (this publisher always signs a sha256)")
        archive = targets_dir / prefixed[0]
        signed.add(archive)
        if path in unchecked:
            continue
        try:
            with open_regular(archive) as handle:
                info.verify_length_and_hashes(handle)
        except FileNotFoundError as exc:
            raise UpdateError(
                f"{archive}: missing: {targets_file} signs {path} ({info.length} bytes), so a device it is offered "
                f"to cannot fetch it; restore it from a copy you trust, or, if it is lost, remove the target: "
                f"{_remove_command(path, info, targets_dir.parent, keys)}"
            ) from exc
        except OSError as exc:
            raise UpdateError(f"{archive}: {exc.strerror or exc}") from exc
        except LengthOrHashMismatchError as exc:
            raise UpdateError(f"{archive}: not the archive {targets_file} signs as {path} ({exc}); {_RESTORE}") from exc
    unsigned = sorted(p for p in targets_dir.rglob("*") if p.is_file() and p not in signed)
    if unsigned:
        shown = ", ".join(str(p.relative_to(targets_dir)) for p in unsigned[:5]) + (", ..." if unsigned[5:] else "")
        log.warning(
            "%s: %d file(s) that no signed target names, left alone and never signed: %s",
            targets_dir,
            len(unsigned),
            shown,
        )


def _remove_command(path: str, info: Any, repository: Path, keys: Path) -> str:
    """The command that removes the target ``path`` from the signed metadata."""
    try:
        facts = TargetFacts.from_custom(path, info.custom)
        name, version = facts.name, str(facts.version)
    except UpdateRefused:  # facts this publisher cannot read: the target's path names it all the same
        name, _, version = path.rpartition("-v")
        name, version = name.partition("/")[0], version.removesuffix(".tar")
    argv = ["edgeline", "publish", "--remove", name, version, "--repo", str(repository), "--keys", str(keys)]
    return "`" + shlex.join(argv) + "`"
