"""The TUF repository a workstation (``edgeline publish``) or a gateway (``edgeline rollout``) writes.

    REPO/metadata/N.root.json       every root version (devices walk the chain from the one they pin)
    REPO/metadata/root.json         the newest, for people
    REPO/metadata/N.snapshot.json   consistent snapshots: a device reading while a publish writes sees one state
    REPO/metadata/N.targets.json
    REPO/metadata/timestamp.json    written last, atomically: the switch from one state to the next
    REPO/targets/NAME/<sha256>.NAME-vV.tar

A directory like this is the whole repository: serve it over HTTP(S), rsync it, or copy it to a USB stick.
Writes go to new file names first and ``timestamp.json`` is replaced last, so a reader never sees half a publish.

What is there is read as a device reads it before anything is written (``served.verified_state``): a repository
whose files are not as these keys signed them is refused, naming the file, and only signed entries are carried over
into what is signed next.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeline.bundle import read_bundle
from edgeline.durable import flush_directory, write_atomically
from edgeline.errors import UpdateError
from edgeline.updates import keys as keyring
from edgeline.updates.archive import manifest_sha256, pack, unpacked_size
from edgeline.updates.policy import Gates, Runtime, TargetFacts, target_path
from edgeline.updates.served import SignedState, verified_state

__all__ = ["EXPIRY_DAYS", "Published", "Repository"]

EXPIRY_DAYS = {"targets": 365, "snapshot": 365, "timestamp": 30}
"""Default life of each role's metadata (root: ``keys.ROOT_EXPIRY_DAYS``); docs/updates.md, "Expiry", says why."""


@dataclass(frozen=True)
class Published:
    facts: TargetFacts
    path: str
    archive: Path
    length: int
    targets_version: int


class Repository:
    """A repository directory and the keys that sign it."""

    def __init__(self, directory: Path, keys: Path):
        self.directory = directory
        self.keys = keys
        self.metadata_dir = directory / "metadata"
        self.targets_dir = directory / "targets"

    # -- reading -----------------------------------------------------------------------------------------------
    def _current(self) -> SignedState | None:
        """The state the repository serves, verified against the keys directory's root chain; None for a new
        repository. Whatever is not as these keys signed it is refused (an ``UpdateError`` naming the file)."""
        return verified_state(self.directory, keyring.root_chain(self.keys))

    def check(self) -> None:
        """Refuse a repository whose state these keys did not sign, as every write does before it writes."""
        self._current()

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
        from tuf.api.metadata import TargetFile

        bundle = read_bundle(bundle_dir)
        manifest = bundle.manifest
        current = self._current()
        existing = _versions(current, manifest.name)
        if existing and manifest.version <= max(existing):
            raise UpdateError(
                f"{bundle_dir}: {manifest.name} v{manifest.version} cannot be published: the repository already has "
                f"v{max(existing)} (versions of one name only grow; export it again with --version {max(existing) + 1})"
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
        staged = pack(bundle, self.targets_dir / manifest.name / f".staging-{os.getpid()}.tar")
        info = TargetFile.from_file(path, str(staged), ["sha256"])
        info.unrecognized_fields["custom"] = facts.as_custom()
        final = self.targets_dir / manifest.name / f"{info.hashes['sha256']}.{Path(path).name}"
        os.replace(staged, final)
        flush_directory(final.parent)

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

        self._sign(self._current(), edit, expires_days)
        return updated[0]

    def refresh(self, *, expires_days: float | None = None) -> int:
        """Re-sign the current state with new expiry dates (what an operator runs before metadata lapses)."""
        return self._sign(self._current(), lambda targets: None, expires_days)

    def _signers(self) -> dict[str, Any]:
        return {role: keyring.signer(self.keys, role) for role in ("targets", "snapshot", "timestamp")}

    def _sign(
        self,
        current: SignedState | None,
        change: Callable[[Any], None],
        expires_days: float | None,
        signers: dict[str, Any] | None = None,
    ) -> int:
        """Apply ``change`` to the targets metadata of ``current`` (verified) and sign new targets, snapshot and
        timestamp; return the new targets version."""
        from tuf.api.metadata import Metadata, MetaFile, Snapshot, Targets, Timestamp

        signers = signers or self._signers()

        self._install_roots()
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
        for role, metadata in (("targets", targets), ("snapshot", snapshot), ("timestamp", timestamp)):
            metadata.signatures.clear()
            metadata.sign(signers[role])
        self._write(f"{targets.signed.version}.targets.json", targets)
        self._write(f"{snapshot.signed.version}.snapshot.json", snapshot)
        self._write("timestamp.json", timestamp)  # last: the new state becomes visible at once
        return int(targets.signed.version)

    def _install_roots(self) -> None:
        """Copy the keys directory's root versions (its chain verified) that the repository does not have yet; those
        it has were found to be the same when its state was read."""
        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        chain = keyring.root_chain(self.keys)
        for version, source in chain.files.items():
            target = self.metadata_dir / f"{version}.root.json"
            data = source.read_bytes()
            if not target.is_file() or target.read_bytes() != data:
                write_atomically(target, data)
        write_atomically(self.metadata_dir / "root.json", chain.files[max(chain.files)].read_bytes())

    def _write(self, name: str, metadata: Any) -> None:
        from tuf.api.serialization.json import JSONSerializer

        write_atomically(self.metadata_dir / name, metadata.to_bytes(JSONSerializer(compact=False)))


def _facts(state: SignedState | None) -> dict[str, TargetFacts]:
    if state is None:
        return {}
    return {path: TargetFacts.from_custom(path, info.custom) for path, info in state.targets.signed.targets.items()}


def _versions(state: SignedState | None, name: str) -> dict[int, TargetFacts]:
    return {facts.version: facts for facts in _facts(state).values() if facts.name == name}
