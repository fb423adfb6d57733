"""What these keys signed, kept beside them: the high-water mark that refuses a replayed repository.

A repository's metadata is all signed by the keys, so a state they signed earlier, put back in place of the current
one (an older ``timestamp.json``, which names an older snapshot and targets metadata, all still in the directory),
reads as valid, and a publisher that signed on from it would take back whatever was signed since: a revocation, a
removal. So every signing records, in ``KEYS/signed.json``, for the repository it signed (by its absolute path):

    timestamp, snapshot, targets   the version and the sha256 of the signed part of each role's metadata, newest
    versions                       the newest version of each bundle name ever signed (removed ones included)
    signed_at                      when

and every command that writes a repository first compares what it serves with that record: a role's version below
the one these keys signed last, or the same version with other content, or no ``timestamp.json`` where these keys
signed one, is refused, naming the file and the record, before anything is written. A state above the record is
taken (another copy of the keys signed it, or a command stopped between its last write and the record's), and
recorded at the next signing. What is published next is then above the record: versions never go back, and a
version of a name that was removed is never signed again with other content.

The record is written with ``edgeline.durable.write_atomically`` after ``timestamp.json``, under the keys
directory's lock (``edgeline.updates.lock``). A repository started anew at the same path on purpose: remove its
entry (or the file; the protection then starts again from what the repository serves).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeline.durable import kind_of, write_atomically
from edgeline.errors import UpdateError
from edgeline.updates.keys import KeyFiles, KeysError

if TYPE_CHECKING:
    from edgeline.updates.served import SignedState

__all__ = ["RECORD_FORMAT", "Mark", "RepositoryRecord", "SignedRecord", "mark_of"]

RECORD_FORMAT = 1
ROLES = ("timestamp", "snapshot", "targets")
MAX_RECORD_BYTES = 4 << 20
_RESTORE = "restore the repository's newest metadata from a copy you trust; nothing is signed until then"
_MEND = (
    "restore it from a copy, or remove it (what these keys signed is then recorded again from what each repository "
    "serves at its next signing)"
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Mark(_Frozen):
    version: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RepositoryRecord(_Frozen):
    timestamp: Mark
    snapshot: Mark
    targets: Mark
    versions: dict[str, int] = Field(default_factory=dict)
    signed_at: str = ""


class _RecordFile(_Frozen):
    format: int = Field(ge=RECORD_FORMAT, le=RECORD_FORMAT)
    repositories: dict[str, RepositoryRecord] = Field(default_factory=dict)


def mark_of(metadata: Any) -> Mark:
    """A role's mark: its version and the sha256 of its signed part (canonical JSON: what the signature covers)."""
    return Mark(version=metadata.signed.version, sha256=hashlib.sha256(metadata.signed_bytes).hexdigest())


def _role_file(metadata_dir: Path, role: str, version: int) -> Path:
    return metadata_dir / ("timestamp.json" if role == "timestamp" else f"{version}.{role}.json")


class SignedRecord:
    """``KEYS/signed.json``: what the keys of ``keys`` signed, by repository."""

    def __init__(self, keys: Path):
        self.path = KeyFiles(keys).record

    def _read(self) -> _RecordFile:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return _RecordFile(format=RECORD_FORMAT)
        except OSError as exc:
            raise KeysError(f"{self.path}: {exc.strerror or exc}") from exc
        if not stat.S_ISREG(mode):  # never opened: a FIFO would hang the command, a link lead anywhere
            raise KeysError(f"{self.path} is {kind_of(mode)}, not the record edgeline writes; {_MEND}")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise KeysError(f"{self.path} is not a regular file; {_MEND}")
                data = handle.read(MAX_RECORD_BYTES + 1)
        except OSError as exc:
            raise KeysError(f"{self.path}: {exc.strerror or exc}; {_MEND}") from exc
        if len(data) > MAX_RECORD_BYTES:
            raise KeysError(f"{self.path}: over {MAX_RECORD_BYTES} bytes: not the record edgeline writes; {_MEND}")
        try:
            return _RecordFile.model_validate_json(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the file"
            raise KeysError(f"{self.path}: {where}: {first['msg']}: not the record edgeline writes; {_MEND}") from exc

    def of(self, repository: Path) -> RepositoryRecord | None:
        return self._read().repositories.get(str(repository))

    def check(self, repository: Path, state: SignedState | None) -> RepositoryRecord | None:
        """Refuse (an ``UpdateError`` naming the file) a state of ``repository`` below what these keys signed for it;
        return the record (None: nothing recorded for it)."""
        record = self.of(repository)
        if record is None:
            return None
        metadata_dir = repository / "metadata"
        said = f"({self.path}, signed {record.signed_at})" if record.signed_at else f"({self.path})"
        if state is None:
            raise UpdateError(
                f"{metadata_dir / 'timestamp.json'}: missing, but these keys signed its version "
                f"{record.timestamp.version} for this repository {said}: the repository was emptied or replaced; "
                f"{_RESTORE} (a repository started anew here on purpose: remove its entry from {self.path.name})"
            )
        for role in ROLES:
            found = mark_of(getattr(state, role))
            signed: Mark = getattr(record, role)
            where = _role_file(metadata_dir, role, found.version)
            if found.version < signed.version:
                raise UpdateError(
                    f"{where}: {role} version {found.version}, below version {signed.version} that these keys signed "
                    f"last for this repository {said}: an older state was put back (signing on from it would take "
                    f"back what was signed since, a revocation or a removal); {_RESTORE}"
                )
            if found.version == signed.version and found.sha256 != signed.sha256:
                raise UpdateError(
                    f"{where}: not the {role} metadata these keys signed as version {signed.version} for this "
                    f"repository {said}: signed by another copy of the keys, or put back from another repository; "
                    f"{_RESTORE}"
                )
        return record

    def below(self, repository: Path, signing: dict[str, Any]) -> None:
        """Refuse to sign ``signing`` (role -> metadata about to be written) at or below a recorded version."""
        record = self.of(repository)
        if record is None:
            return
        for role, metadata in signing.items():
            signed: Mark = getattr(record, role)
            if metadata.signed.version <= signed.version:
                raise UpdateError(
                    f"{repository}: {role} version {metadata.signed.version} would not be above version "
                    f"{signed.version} that these keys signed for it ({self.path}); nothing was signed"
                )

    def record(self, repository: Path, signed: dict[str, Any], names: dict[str, int]) -> None:
        """Record what was just signed for ``repository`` (role -> metadata) and the newest version of each name."""
        current = self._read()
        before = current.repositories.get(str(repository))
        versions = dict(before.versions) if before is not None else {}
        for name, version in names.items():
            versions[name] = max(version, versions.get(name, 0))
        entry = RepositoryRecord(
            **{role: mark_of(signed[role]) for role in ROLES},
            versions=versions,
            signed_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        )
        repositories = {**current.repositories, str(repository): entry}
        document = {"format": RECORD_FORMAT, "repositories": {k: v.model_dump() for k, v in repositories.items()}}
        write_atomically(self.path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())
