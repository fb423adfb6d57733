"""The signing keys of a repository: one ed25519 key per TUF role, and the root metadata that devices pin.

    DIR/root.json        the signed root metadata: copy it to every device (``--trusted-root``)
    DIR/1.root.json      the same, by version (a new root is signed by the old one: devices follow the chain)
    DIR/root.key         the root key: keep it offline; only a new root (key rotation, renewal) needs it
    DIR/targets.key      signs what bundles exist (``edgeline publish``, ``edgeline rollout``)
    DIR/snapshot.key     signs which targets metadata is current
    DIR/timestamp.key    signs that the snapshot is fresh: the key a gateway that re-signs often holds

A new root (``new_root``: ``edgeline keys renew`` and ``edgeline keys rotate``) is the next version of the root
metadata, signed by the root key the previous version trusts (and, when the root key itself is replaced, by the new
one too): a device walks the chain ``1.root.json``, ``2.root.json``, ... from the root it pins, so no device is
re-provisioned. The repository picks the new root up at its next signing (``edgeline publish --refresh``).

Every root file of the directory is verified as a device walking the chain verifies it before anything uses it
(``root_chain``): ``N.root.json`` signed by the root keys of ``N-1.root.json`` and by its own, numbered as its name
says, and ``root.json`` the same as the numbered file of its version. A root someone else put there is refused by
name, never renewed, copied into a repository or announced.

The private keys are PKCS#8 PEM files, readable by their owner only. When ``EDGELINE_KEY_PASSPHRASE`` is set they
are written encrypted with it (and read with it): the passphrase never appears on a command line. A hardware token
(a YubiKey or another PKCS#11 device) fits the same roles later: securesystemslib's ``HSMSigner`` signs with a key
that never leaves it, and only the loading in ``signer`` would change (docs/updates.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.durable import flush_directory, write_atomically
from edgeline.errors import EdgelineError

if TYPE_CHECKING:
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata, Root

__all__ = [
    "PASSPHRASE_ENV",
    "ROLES",
    "ROOT_EXPIRY_DAYS",
    "KeysError",
    "NewRoot",
    "RootChain",
    "generate",
    "load_root",
    "new_root",
    "root_chain",
    "root_files",
    "signer",
]

ROLES = ("root", "targets", "snapshot", "timestamp")
PASSPHRASE_ENV = "EDGELINE_KEY_PASSPHRASE"
ROOT_EXPIRY_DAYS = 365
"""The root metadata's life: renewed yearly with the offline root key (docs/updates.md, "Expiry")."""


class KeysError(EdgelineError):
    """A keys directory that is missing, incomplete, or holds keys its root does not trust."""


def utc_in(days: float) -> datetime:
    """``days`` from now, in UTC, to the second (TUF's expiry format has no fraction)."""
    return (datetime.now(timezone.utc) + timedelta(days=days)).replace(microsecond=0)


@dataclass(frozen=True)
class KeyFiles:
    directory: Path

    def key(self, role: str) -> Path:
        return self.directory / f"{role}.key"

    @property
    def root(self) -> Path:
        return self.directory / "root.json"


def _passphrase() -> bytes | None:
    value = os.environ.get(PASSPHRASE_ENV)
    return value.encode() if value else None


def _new_key(path: Path) -> tuple[Any, Any]:
    """A new ed25519 key written to ``path`` (owner-only; encrypted with the passphrase when one is set): its
    (private key, public SSlibKey)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import (
        BestAvailableEncryption,
        Encoding,
        NoEncryption,
        PrivateFormat,
    )
    from securesystemslib.signer import SSlibKey

    passphrase = _passphrase()
    encryption = BestAvailableEncryption(passphrase) if passphrase else NoEncryption()
    private = Ed25519PrivateKey.generate()
    write_atomically(path, private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, encryption), mode=0o600)
    return private, SSlibKey.from_crypto(private.public_key())


def generate(directory: Path, *, force: bool = False) -> Path:
    """Write the four keys and the signed root metadata (version 1) into ``directory``; return root.json's path.
    An existing key is never overwritten unless ``force``: losing the root key means re-provisioning every device."""
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata, Root

    files = KeyFiles(directory)
    existing = [files.key(role) for role in ROLES if files.key(role).exists()] + [files.root] * files.root.exists()
    if existing and not force:
        raise KeysError(
            f"{directory} already holds {', '.join(p.name for p in existing)}: keys are never overwritten "
            "(devices trust them); choose another directory, or --force to replace them and re-provision every device"
        )
    directory.mkdir(parents=True, exist_ok=True)
    root = Root(expires=utc_in(ROOT_EXPIRY_DAYS), consistent_snapshot=True)
    signers = {}
    for role in ROLES:
        private, public = _new_key(files.key(role))
        root.add_key(public, role)
        signers[role] = CryptoSigner(private, public)
    metadata = Metadata(root)
    metadata.sign(signers["root"])
    _write_root(directory, metadata)
    return files.root


def _write_root(directory: Path, metadata: Metadata[Root]) -> None:
    """``N.root.json`` first, then ``root.json``: the chain never misses the version root.json names."""
    from tuf.api.serialization.json import JSONSerializer

    data = metadata.to_bytes(JSONSerializer(compact=False))
    write_atomically(directory / f"{metadata.signed.version}.root.json", data)
    write_atomically(KeyFiles(directory).root, data)


@dataclass(frozen=True)
class NewRoot:
    path: Path
    version: int
    expires: datetime
    rotated: str | None


def new_root(directory: Path, *, rotate: str | None = None, expires_days: float = ROOT_EXPIRY_DAYS) -> NewRoot:
    """The next version of ``directory``'s root metadata, valid for ``expires_days``, signed with the root key the
    current version trusts; with ``rotate``, that role's key is replaced by a new one first (the root role's new
    root is signed by both the old and the new root key, as TUF asks). The old key of a rotated role is deleted:
    nothing it signs is trusted any more once devices have the new root."""
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata

    if rotate is not None and rotate not in ROLES:
        raise KeysError(f"unknown role {rotate!r}; valid: {', '.join(ROLES)}")
    if not expires_days > 0:
        raise KeysError(f"expires_days must be above 0, not {expires_days}")
    files = KeyFiles(directory)
    current = load_root(directory)
    old_root_signer = signer(directory, "root")  # refused here if root.key is not the key root.json trusts
    root: Root = current.signed
    root.version += 1
    root.expires = utc_in(expires_days)
    signers = [old_root_signer]
    if rotate is not None:
        private, public = _new_key(files.key(rotate).with_suffix(".key.new"))
        for keyid in list(root.roles[rotate].keyids):
            root.revoke_key(keyid, rotate)
        root.add_key(public, rotate)
        if rotate == "root":
            signers.append(CryptoSigner(private, public))
    metadata = Metadata(root)
    for each in signers:
        metadata.sign(each, append=True)
    _write_root(directory, metadata)
    if rotate is not None:  # after the root that trusts it: a cut here leaves ROLE.key.new (``signer`` says so)
        os.replace(files.key(rotate).with_suffix(".key.new"), files.key(rotate))
        flush_directory(directory)
    return NewRoot(path=files.root, version=root.version, expires=root.expires, rotated=rotate)


ROOT_FILE = re.compile(r"([1-9][0-9]*)\.root\.json")
"""A root version's file, ``N.root.json``: the name a device asks a repository for."""


def root_files(directory: Path) -> dict[int, Path]:
    """Every ``N.root.json`` in ``directory``, by version, lowest first (none when it does not exist)."""
    if not directory.is_dir():
        return {}
    found = {int(m[1]): path for path in directory.iterdir() if (m := ROOT_FILE.fullmatch(path.name))}
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class RootChain:
    """A keys directory's root versions, from 1 to ``root.json``'s, each verified as a device walking the chain
    verifies it."""

    directory: Path
    files: dict[int, Path]
    """``N.root.json`` by version (``root.json`` for the current version of a directory written before the numbered
    files were)."""
    roots: dict[int, Metadata[Root]]

    @property
    def current(self) -> Metadata[Root]:
        """What ``root.json`` says: the newest root, the one a repository gets at its next signing."""
        return self.roots[max(self.roots)]


def _read_root(path: Path) -> Metadata[Root]:
    from tuf.api.metadata import Metadata, Root
    from tuf.api.serialization import DeserializationError

    try:
        metadata = Metadata.from_bytes(path.read_bytes())
    except OSError as exc:
        raise KeysError(f"{path}: {exc.strerror or exc}") from exc
    except DeserializationError as exc:
        raise KeysError(f"{path}: not a TUF root metadata file ({exc})") from exc
    if not isinstance(metadata.signed, Root):
        raise KeysError(f"{path}: {metadata.signed.type} metadata, not a root")
    return metadata


def _signed_by(signer_root: Root, metadata: Metadata[Root], path: Path, by: str) -> None:
    from tuf.api.exceptions import UnsignedMetadataError

    try:
        signer_root.verify_delegate("root", metadata.signed_bytes, metadata.signatures)
    except UnsignedMetadataError as exc:
        raise KeysError(
            f"{path}: not signed by {by} ({exc}): devices walking the chain refuse it, and `edgeline keys` did not "
            "write it (remove it once you know how it got there)"
        ) from exc


def root_chain(directory: Path) -> RootChain:
    """The root versions of the keys directory ``directory``, verified: every ``N.root.json`` (those above
    ``root.json``'s version too: a new root cut short before ``root.json`` was replaced) is signed by the root keys
    of the version before and by its own, and ``root.json`` is the numbered file of its version. Expiry is not
    checked: renewing a lapsed root is what the chain is for."""
    path = KeyFiles(directory).root
    if not path.is_file():
        raise KeysError(f"{directory}: no root.json (create the keys with `edgeline keys generate {directory}`)")
    current = _read_root(path)
    version = current.signed.version
    files = dict(sorted({version: path, **root_files(directory)}.items()))
    verified: dict[int, Metadata[Root]] = {}
    for number, file in files.items():
        if number > 1 and number - 1 not in verified:
            missing = min(n for n in range(1, number) if n not in files)
            if number <= version:
                raise KeysError(f"{directory}/{missing}.root.json is missing (devices need every root version)")
            raise KeysError(
                f"{file}: root version {number} follows no {missing}.root.json: `edgeline keys` did not write it "
                "(remove it once you know how it got there)"
            )
        metadata = _read_root(file)
        if metadata.signed.version != number:
            raise KeysError(f"{file}: says root version {metadata.signed.version}, not {number}")
        if number > 1:
            _signed_by(verified[number - 1].signed, metadata, file, f"the root key that {number - 1}.root.json trusts")
        _signed_by(metadata.signed, metadata, file, "the root key it names itself")
        verified[number] = metadata
    if files[version] != path and files[version].read_bytes() != path.read_bytes():
        raise KeysError(f"{path}: differs from {files[version].name}, the root version it says it is")
    return RootChain(
        directory=directory,
        files={n: f for n, f in files.items() if n <= version},
        roots={n: r for n, r in verified.items() if n <= version},
    )


def load_root(directory: Path) -> Metadata[Root]:
    """The current signed root metadata of the keys directory (``Metadata[Root]``), its chain verified."""
    return root_chain(directory).current


def signer(directory: Path, role: str) -> CryptoSigner:
    """The signer of ``role`` from ``directory``, checked against the keys the root trusts for that role."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner, SSlibKey

    path = KeyFiles(directory).key(role)
    if not path.is_file():
        raise KeysError(f"{directory}: no {role}.key (the {role} role's key signs this step)")
    try:
        private = load_pem_private_key(path.read_bytes(), password=_passphrase())
    except TypeError as exc:  # encrypted without a passphrase, or a passphrase for a plain key
        raise KeysError(f"{path}: {exc} (the passphrase is read from ${PASSPHRASE_ENV})") from exc
    except ValueError as exc:
        raise KeysError(f"{path}: cannot read the key ({exc}; a wrong ${PASSPHRASE_ENV}?)") from exc
    public = SSlibKey.from_crypto(private.public_key())
    root = load_root(directory).signed
    if public.keyid not in root.roles[role].keyids:
        staged = path.with_suffix(".key.new")
        hint = (
            f" (a rotation was cut short after writing the new root: {staged.name} holds the new key; rename it to "
            f"{path.name})"
            if staged.is_file()
            else ""
        )
        raise KeysError(f"{path}: this key is not the {role} key that {directory}/root.json trusts{hint}")
    return CryptoSigner(private, public)
