"""The TUF repository a workstation (``edgeline publish``) or a gateway (``edgeline rollout``) writes.

    REPO/metadata/N.root.json       every root version (devices walk the chain from the one they pin)
    REPO/metadata/root.json         the newest, for people
    REPO/metadata/N.snapshot.json   consistent snapshots: a device reading while a publish writes sees one state
    REPO/metadata/N.targets.json
    REPO/metadata/timestamp.json    written last, atomically: the switch from one state to the next
    REPO/targets/NAME/<sha256>.NAME-vV.tar

A directory like this is the whole repository: serve it over HTTP(S), rsync it, or copy it to a USB stick.
Writes go to new file names first and ``timestamp.json`` is replaced last, so a reader never sees half a publish.

Every write (``publish``, ``refresh``, ``update_target``: a rollout's wave or halt, ``remove``) holds the
repository's lock and the keys directory's (``edgeline.updates.lock``) from the moment it reads what is there to the
moment it has recorded what it signed: two writers never sign from the same state, so neither's change is lost.
What is there is read as a device reads it before anything is written (``served.verified_state``): a repository
whose files are not as these keys signed them is refused, naming the file, and only signed entries are carried over
into what is signed next; a state below what these keys signed for it (a replay) is refused too
(``edgeline.updates.highwater``). Every file is written by ``edgeline.durable`` (a fresh temporary, never through a
link, never into a directory that is a link): the repository directory is taken as it resolves, and nothing inside
it is followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from edgeline.bundle import read_bundle
from edgeline.durable import (
    check_destination,
    check_directory,
    ensure_directory,
    new_file,
    remove_file,
    write_atomically,
)
from edgeline.errors import UpdateError
from edgeline.updates import keys as keyring
from edgeline.updates.archive import manifest_sha256, pack_into, unpacked_size
from edgeline.updates.highwater import SignedRecord
from edgeline.updates.lock import LOCK_WAIT_S, locked
from edgeline.updates.policy import Gates, Runtime, TargetFacts, target_path
from edgeline.updates.served import SignedState, verified_state

__all__ = ["EXPIRY_DAYS", "Published", "Removed", "Repository"]

EXPIRY_DAYS = {"targets": 365, "snapshot": 365, "timestamp": 30}
"""Default life of each role's metadata (root: ``keys.ROOT_EXPIRY_DAYS``); docs/updates.md, "Expiry", says why."""


@dataclass(frozen=True)
class Published:
    facts: TargetFacts
    path: str
    archive: Path
    length: int
    targets_version: int


@dataclass(frozen=True)
class Removed:
    facts: TargetFacts
    path: str
    archive: Path
    archive_was_there: bool
    targets_version: int


class Repository:
    """A repository directory and the keys that sign it (both taken as they resolve)."""

    def __init__(self, directory: Path, keys: Path, *, lock_wait_s: float = LOCK_WAIT_S):
        self.directory = Path(os.path.realpath(directory))
        self.keys = Path(os.path.realpath(keys))
        self.metadata_dir = self.directory / "metadata"
        self.targets_dir = self.directory / "targets"
        self.lock_wait_s = lock_wait_s
        self.record = SignedRecord(self.keys)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the repository's lock, then the keys directory's: one writer at a time (reentrant)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        keyring.check_directory(self.keys)
        with (
            locked(self.directory, what="the repository", wait_s=self.lock_wait_s),
            locked(self.keys, what="the keys directory", wait_s=self.lock_wait_s),
        ):
            yield

    # -- reading -----------------------------------------------------------------------------------------------
    def _current(self, unchecked: frozenset[str] = frozenset()) -> SignedState | None:
        """The state the repository serves, verified against the keys directory's root chain; None for a new
        repository. Whatever is not as these keys signed it is refused (an ``UpdateError`` naming the file)."""
        return verified_state(self.directory, keyring.root_chain(self.keys), unchecked=unchecked)

    def _current_to_write(self, unchecked: frozenset[str] = frozenset()) -> SignedState | None:
        """``_current``, and not below what these keys signed for this repository (a replay is refused)."""
        current = self._current(unchecked)
        self.record.check(self.directory, current)
        return current

    def check(self) -> None:
        """Refuse a repository whose state these keys did not sign, or that is below what they signed for it, as
        every write does before it writes."""
        with self.writing():
            self._check_signing(self._current_to_write())

    def targets(self) -> dict[str, TargetFacts]:
        """Every target's facts by target path (empty for a new repository)."""
        return _facts(self._current())

    def versions(self, name: str) -> dict[int, TargetFacts]:
        return _versions(self._current(), name)

    # -- writing -----------------------------------------------------------------------------------------------
    def publish(
        self,
        bundle_dir: Path,
        *,
        gates: Gates | None = None,
        audience: tuple[str, ...] | None = None,
        expires_days: float | None = None,
    ) -> Published:
        """Add a bundle (read and verified first) as a new target, and sign the new state."""
        with self.writing():
            return self._publish(bundle_dir, gates, audience, expires_days)

    def _publish(
        self, bundle_dir: Path, gates: Gates | None, audience: tuple[str, ...] | None, expires_days: float | None
    ) -> Published:
        from tuf.api.metadata import TargetFile

        bundle = read_bundle(bundle_dir)
        manifest = bundle.manifest
        current = self._current_to_write()
        existing = _versions(current, manifest.name)
        if existing and manifest.version <= max(existing):
            raise UpdateError(
                f"{bundle_dir}: {manifest.name} v{manifest.version} cannot be published: the repository already has "
                f"v{max(existing)} (versions of one name only grow; export it again with --version {max(existing) + 1})"
            )
        record = self.record.of(self.directory)
        signed_before = record.versions.get(manifest.name, 0) if record is not None else 0
        if manifest.version <= signed_before:
            raise UpdateError(
                f"{bundle_dir}: {manifest.name} v{manifest.version} cannot be published: these keys signed "
                f"v{signed_before} for this repository before (removed since; {self.record.path}): versions of one "
                f"name only grow, so that no device takes two bundles as one version; export it again with "
                f"--version {signed_before + 1}"
            )
        unpacked_bytes, unpacked_entries = unpacked_size(bundle)
        facts = TargetFacts(
            name=manifest.name,
            version=manifest.version,
            profile=manifest.profile,
            backend=manifest.backend,
            precision=manifest.precision,
            runtime=Runtime(package=manifest.runtime.package, min_version=manifest.runtime.min_version),
            manifest_sha256=manifest_sha256(bundle_dir),
            postprocess=manifest.postprocess.kind,
            trial=gates or Gates(),
            audience=audience,
            resident_mb=manifest.memory.resident_mb if manifest.memory is not None else None,
            unpacked_bytes=unpacked_bytes,
            unpacked_entries=unpacked_entries,
        )
        signers = self._signers()  # a wrong passphrase or key is said before anything is written
        path = target_path(manifest.name, manifest.version)
        directory = ensure_directory(self.targets_dir / manifest.name, within=self.directory)
        with new_file(directory, stem=Path(path).name, within=self.directory) as staged:
            counted = _Counted(staged.handle)
            pack_into(bundle, counted)  # type: ignore[arg-type]  # a writer is all tarfile needs
            info = TargetFile(counted.length, {"sha256": counted.sha256.hexdigest()}, path)
            info.unrecognized_fields["custom"] = facts.as_custom()
            final = directory / f"{info.hashes['sha256']}.{Path(path).name}"
            self._check_signing(current, extra=[final])  # before the archive is in place
            staged.commit(final)

        def add(targets: Any) -> None:
            targets.targets[path] = info

        version = self._sign(current, add, expires_days, signers)
        return Published(facts=facts, path=path, archive=final, length=info.length, targets_version=version)

    def update_target(
        self, path: str, change: Callable[[TargetFacts], TargetFacts], *, expires_days: float | None = None
    ) -> TargetFacts:
        """Re-sign ``path`` with new facts (a rollout's audience, a revocation); the archive stays as it is."""
        updated: list[TargetFacts] = []

        def edit(targets: Any) -> None:
            info = targets.targets.get(path)
            if info is None:
                raise UpdateError(f"{self.directory}: no target {path}")
            facts = change(TargetFacts.from_custom(path, info.custom))
            info.unrecognized_fields["custom"] = facts.as_custom()
            updated.append(facts)

        with self.writing():
            self._sign(self._current_to_write(), edit, expires_days)
        return updated[0]

    def refresh(self, *, expires_days: float | None = None) -> int:
        """Re-sign the current state with new expiry dates (what an operator runs before metadata lapses)."""
        with self.writing():
            return self._sign(self._current_to_write(), lambda targets: None, expires_days)

    def remove(self, name: str, version: int, *, expires_days: float | None = None) -> Removed:
        """Remove the target ``name`` ``version`` from the signed metadata (its archive lost, or never to be offered
        again), then its archive, if it is there. A device that runs it keeps it: this is not a revocation."""
        path = target_path(name, version)
        with self.writing():
            current = self._current_to_write(unchecked=frozenset({path}))
            info = current.targets.signed.targets.get(path) if current is not None else None
            if info is None:
                versions = sorted(_versions(current, name))
                listed = ", ".join(f"v{v}" for v in versions) if versions else "none"
                raise UpdateError(f"{self.directory}: {name} v{version} is not published (of {name}: {listed})")
            facts = TargetFacts.from_custom(path, info.custom)
            archive = self.targets_dir / info.get_prefixed_paths()[0]
            check_directory(archive.parent, within=self.directory)  # a link on the way: refused before signing

            def drop(targets: Any) -> None:
                del targets.targets[path]

            targets_version = self._sign(current, drop, expires_days)
            # after the new timestamp: a device that read the metadata before may still ask for it meanwhile
            there = remove_file(archive, within=self.directory)
        return Removed(
            facts=facts, path=path, archive=archive, archive_was_there=there, targets_version=targets_version
        )

    def _signers(self) -> dict[str, Any]:
        return {role: keyring.signer(self.keys, role) for role in ("targets", "snapshot", "timestamp")}

    def _planned(self, current: SignedState | None) -> dict[str, Path]:
        """The metadata files the next signing writes, by role."""
        versions = {"targets": 1, "snapshot": 1} if current is None else {
            "targets": current.targets.signed.version + 1, "snapshot": current.snapshot.signed.version + 1,
        }  # fmt: skip
        return {
            "targets": self.metadata_dir / f"{versions['targets']}.targets.json",
            "snapshot": self.metadata_dir / f"{versions['snapshot']}.snapshot.json",
            "timestamp": self.metadata_dir / "timestamp.json",
        }

    def _check_signing(self, current: SignedState | None, extra: list[Path] | None = None) -> None:
        """Refuse now, naming it, a file the next signing would refuse to write (a link or a FIFO planted where it
        goes), so that a refused command leaves nothing half done."""
        chain = keyring.root_chain(self.keys)
        roots = [self.metadata_dir / f"{version}.root.json" for version in chain.files]
        for path in [*(extra or []), *roots, self.metadata_dir / "root.json", *self._planned(current).values()]:
            check_destination(path, within=self.directory)
        check_destination(self.record.path)

    def _sign(
        self,
        current: SignedState | None,
        change: Callable[[Any], None],
        expires_days: float | None,
        signers: dict[str, Any] | None = None,
    ) -> int:
        """Apply ``change`` to the targets metadata of ``current`` (verified, not below the record) and sign new
        targets, snapshot and timestamp; record what was signed; return the new targets version. The caller holds
        the locks (``writing``)."""
        from tuf.api.metadata import Metadata, MetaFile, Snapshot, Targets, Timestamp

        signers = signers or self._signers()
        self._check_signing(current)
        if current is None:
            timestamp, snapshot, targets = Metadata(Timestamp()), Metadata(Snapshot()), Metadata(Targets())
            first = True
        else:
            timestamp, snapshot, targets = current.timestamp, current.snapshot, current.targets
            first = False
        change(targets.signed)
        stamp_days = expires_days if expires_days is not None else EXPIRY_DAYS["timestamp"]
        long_days = max(stamp_days, EXPIRY_DAYS["targets"])
        for metadata in (targets, snapshot, timestamp):
            if not first:
                metadata.signed.version += 1
        targets.signed.expires = keyring.utc_in(long_days)
        snapshot.signed.meta["targets.json"] = MetaFile(version=targets.signed.version)
        snapshot.signed.expires = keyring.utc_in(long_days)
        timestamp.signed.snapshot_meta = MetaFile(version=snapshot.signed.version)
        timestamp.signed.expires = keyring.utc_in(stamp_days)
        signing: dict[str, Any] = {"targets": targets, "snapshot": snapshot, "timestamp": timestamp}
        self.record.below(self.directory, signing)  # never a version these keys signed for it already
        for role, signed in signing.items():
            signed.signatures.clear()
            signed.sign(signers[role])
        self._install_roots()
        self._write(f"{targets.signed.version}.targets.json", targets)
        self._write(f"{snapshot.signed.version}.snapshot.json", snapshot)
        self._write("timestamp.json", timestamp)  # last: the new state becomes visible at once
        names: dict[str, int] = {}
        for facts in _facts(SignedState(timestamp=timestamp, snapshot=snapshot, targets=targets)).values():
            names[facts.name] = max(facts.version, names.get(facts.name, 0))
        self.record.record(self.directory, signing, names)  # after the timestamp: a cut between leaves it behind
        return int(targets.signed.version)

    def _install_roots(self) -> None:
        """Copy the keys directory's root versions (its chain verified) that the repository does not have yet; those
        it has were found to be the same when its state was read."""
        ensure_directory(self.metadata_dir, within=self.directory)
        chain = keyring.root_chain(self.keys)
        for version, source in chain.files.items():
            target = self.metadata_dir / f"{version}.root.json"
            data = source.read_bytes()
            if not target.is_file() or target.read_bytes() != data:
                write_atomically(target, data, within=self.directory)
        newest = chain.files[max(chain.files)].read_bytes()
        write_atomically(self.metadata_dir / "root.json", newest, within=self.directory)

    def _write(self, name: str, metadata: Any) -> None:
        from tuf.api.serialization.json import JSONSerializer

        data = metadata.to_bytes(JSONSerializer(compact=False))
        write_atomically(self.metadata_dir / name, data, within=self.directory)


class _Counted:
    """A writer that counts the bytes written through it and hashes them: an archive's length and sha256, taken as
    it is packed (never read back from a file someone could swap)."""

    def __init__(self, handle: BinaryIO):
        self.handle = handle
        self.length = 0
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.length += len(data)
        return self.handle.write(data)

    def tell(self) -> int:
        return self.length


def _facts(state: SignedState | None) -> dict[str, TargetFacts]:
    if state is None:
        return {}
    return {path: TargetFacts.from_custom(path, info.custom) for path, info in state.targets.signed.targets.items()}


def _versions(state: SignedState | None, name: str) -> dict[int, TargetFacts]:
    return {facts.version: facts for facts in _facts(state).values() if facts.name == name}
