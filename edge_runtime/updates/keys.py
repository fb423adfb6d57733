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

The private keys are PKCS#8 PEM files, readable by their owner only, in a directory only its owner can write: a key
that group or others may read or write, or a keys directory they may write (unless it is sticky and ours), is
refused before it is used, naming the file and the ``chmod`` that mends it (as ssh does). They are ed25519 keys:
another type (Ed448, X25519, DSA, RSA, ...) is one line naming the file. Everything written here goes through
``edgeline.durable`` (a fresh temporary, never through a link); ``DIR/signed.json`` records what the keys signed
(``edgeline.updates.highwater``), and ``DIR/.edgeline.lock`` keeps two writers of the directory apart. When
``EDGELINE_KEY_PASSPHRASE`` is set the keys are written encrypted with it (and read with it): the passphrase never
appears on a command line. A hardware token (a YubiKey or another PKCS#11 device) fits the same roles later:
securesystemslib's ``HSMSigner`` signs with a key that never leaves it, and only the loading in ``signer`` would
change (docs/updates.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.durable import check_destination, remove_file, rename_into_place, write_atomically
from edgeline.errors import EdgelineError
from edgeline.updates.lock import locked

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata, Root

__all__ = [
    "PASSPHRASE_ENV",
    "ROLES",
    "ROOT_EXPIRY_DAYS",
    "SUPPORTED_KEY_TYPES",
    "KeyFiles",
    "KeysError",
    "NewRoot",
    "RootChain",
    "check_directory",
    "generate",
    "load_root",
    "new_root",
    "read_private_key",
    "root_chain",
    "root_files",
    "signer",
    "writing",
]

ROLES = ("root", "targets", "snapshot", "timestamp")
PASSPHRASE_ENV = "EDGELINE_KEY_PASSPHRASE"
ROOT_EXPIRY_DAYS = 365
"""The root metadata's life: renewed yearly with the offline root key (docs/updates.md, "Expiry")."""
SUPPORTED_KEY_TYPES = ("ed25519",)
"""What the keys may be: what ``generate`` and ``new_root`` write, the only type edgeline signs with."""
MAX_KEY_BYTES = 64 << 10
MAX_ROOT_BYTES = 16 << 20


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

    def staged(self, role: str) -> Path:
        """A rotation's new key, until the root that trusts it is written."""
        return self.directory / f"{role}.key.new"

    @property
    def root(self) -> Path:
        return self.directory / "root.json"

    @property
    def record(self) -> Path:
        """What these keys signed, by repository (``edgeline.updates.highwater``)."""
        return self.directory / "signed.json"


def _real(directory: Path) -> Path:
    """The keys directory the user named, as it resolves: inside it nothing is followed."""
    return Path(os.path.realpath(directory))


@contextlib.contextmanager
def writing(directory: Path) -> Iterator[None]:
    """Hold the keys directory's lock (one writer at a time; reentrant) once it is found safe to keep keys in."""
    check_directory(directory)
    with locked(directory, what="the keys directory"):
        yield


def check_directory(directory: Path) -> None:
    """Refuse a keys directory that group or others may write (unless it is sticky and ours, as /tmp is root's):
    whoever can write it can replace a key, or plant a link where a key is written."""
    try:
        status = os.stat(directory)
    except FileNotFoundError:
        raise KeysError(f"{directory}: no such directory (create the keys with `edgeline keys generate`)") from None
    except OSError as exc:
        raise KeysError(f"{directory}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(status.st_mode):
        raise KeysError(f"{directory}: not a directory")
    sticky_and_ours = status.st_mode & stat.S_ISVTX and status.st_uid == os.geteuid()
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_and_ours:
        who = _who(status.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        raise KeysError(
            f"{directory}: writable by {who} (mode {stat.S_IMODE(status.st_mode):04o}): whoever can write a keys "
            f"directory can replace its keys; fix it with `chmod go-w {directory}`"
        )


def _who(bits: int) -> str:
    group = bits & (stat.S_IRGRP | stat.S_IWGRP | stat.S_IXGRP)
    others = bits & (stat.S_IROTH | stat.S_IWOTH | stat.S_IXOTH)
    return "group and others" if group and others else "its group" if group else "others"


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

    directory = _real(directory)
    files = KeyFiles(directory)
    present = [files.key(role) for role in ROLES] + [files.root]
    existing = [path for path in present if os.path.lexists(path)]
    if existing and not force:
        raise KeysError(
            f"{directory} already holds {', '.join(p.name for p in existing)}: keys are never overwritten "
            "(devices trust them); choose another directory, or --force to replace them and re-provision every device"
        )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with writing(directory):
        for path in [*present, directory / "1.root.json"]:  # refused before anything is written
            check_destination(path)
        root = Root(expires=utc_in(ROOT_EXPIRY_DAYS), consistent_snapshot=True)
        signers = {}
        for role in ROLES:
            private, public = _new_key(files.key(role))
            root.add_key(public, role)
            signers[role] = CryptoSigner(private, public)
        metadata = Metadata(root)
        metadata.sign(signers["root"])
        _write_root(directory, metadata)
        remove_file(files.record)  # what the replaced keys signed is no record of what these keys sign
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
    directory = _real(directory)
    files = KeyFiles(directory)
    load_root(directory)  # a directory without keys is said as such, before its lock is taken
    with writing(directory):
        current = load_root(directory)
        old_root_signer = signer(directory, "root")  # refused here if root.key is not the key root.json trusts
        root: Root = current.signed
        root.version += 1
        root.expires = utc_in(expires_days)
        planned = [directory / f"{root.version}.root.json", files.root]
        if rotate is not None:
            planned += [files.key(rotate), files.staged(rotate)]
        for path in planned:  # refused before anything is written: a rotation is never left half done by a plant
            check_destination(path)
        signers = [old_root_signer]
        if rotate is not None:
            private, public = _new_key(files.staged(rotate))
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
            rename_into_place(files.staged(rotate), files.key(rotate))
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

    from edgeline.updates.fetchers import NotRegularFile, open_regular

    try:
        with open_regular(path) as handle:  # a FIFO planted among the roots is refused, never waited on
            data = handle.read(MAX_ROOT_BYTES + 1)
        if len(data) > MAX_ROOT_BYTES:
            raise KeysError(f"{path}: over {MAX_ROOT_BYTES} bytes: not a root edgeline wrote")
        metadata = Metadata.from_bytes(data)
    except NotRegularFile as exc:
        raise KeysError(f"{exc}: not a root edgeline wrote (remove it once you know how it got there)") from exc
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
    from securesystemslib.signer import CryptoSigner, SSlibKey

    path = KeyFiles(directory).key(role)
    if not os.path.lexists(path):
        raise KeysError(f"{directory}: no {role}.key (the {role} role's key signs this step)")
    private = read_private_key(path)
    public = SSlibKey.from_crypto(private.public_key())
    root = load_root(directory).signed
    if public.keyid not in root.roles[role].keyids:
        staged = KeyFiles(directory).staged(role)
        hint = (
            f" (a rotation was cut short after writing the new root: {staged.name} holds the new key; rename it to "
            f"{path.name})"
            if staged.is_file()
            else ""
        )
        raise KeysError(f"{path}: this key is not the {role} key that {directory}/root.json trusts{hint}")
    return CryptoSigner(private, public)


def read_private_key(path: Path) -> Ed25519PrivateKey:
    """The ed25519 private key of ``path``: a regular file (never waited on) that only its owner may read or write,
    in a keys directory only its owner may write; decrypted with ``$EDGELINE_KEY_PASSPHRASE`` when it is set."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from edgeline.updates.fetchers import NotRegularFile, open_regular

    check_directory(path.parent)
    try:
        with open_regular(path) as handle:
            status = os.fstat(handle.fileno())
            if status.st_mode & 0o077:
                who = _who(status.st_mode & 0o077)
                raise KeysError(
                    f"{path}: a private key that {who} may {_access(status.st_mode & 0o077)} (mode "
                    f"{stat.S_IMODE(status.st_mode):04o}): it must be its owner's alone; fix it with `chmod 600 {path}`"
                )
            data = handle.read(MAX_KEY_BYTES + 1)
    except NotRegularFile as exc:
        raise KeysError(f"{exc}: not a key edgeline wrote") from exc
    except OSError as exc:
        raise KeysError(f"{path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_KEY_BYTES:
        raise KeysError(f"{path}: over {MAX_KEY_BYTES} bytes: not a key edgeline wrote")
    try:
        private = load_pem_private_key(data, password=_passphrase())
    except TypeError as exc:  # encrypted without a passphrase, or a passphrase for a plain key
        raise KeysError(f"{path}: {exc} (the passphrase is read from ${PASSPHRASE_ENV})") from exc
    except ValueError as exc:
        raise KeysError(f"{path}: cannot read the key ({exc}; a wrong ${PASSPHRASE_ENV}?)") from exc
    except UnsupportedAlgorithm as exc:
        raise KeysError(f"{path}: a key of a type this machine cannot read ({exc}); {_SUPPORTED}") from exc
    if not isinstance(private, Ed25519PrivateKey):
        raise KeysError(f"{path}: {_key_type(private)}; {_SUPPORTED}")
    return private


_SUPPORTED = (
    f"edgeline signs with {', '.join(SUPPORTED_KEY_TYPES)} keys only (what `edgeline keys generate` and `keys rotate` "
    "write)"
)


def _access(bits: int) -> str:
    readable = bits & (stat.S_IRGRP | stat.S_IROTH)
    writable = bits & (stat.S_IWGRP | stat.S_IWOTH)
    return "read and write" if readable and writable else "read" if readable else "write" if writable else "use"


def _key_type(private: object) -> str:
    """``an Ed448 key``, ``an RSA key (2048 bits)``, ...: what a key that is not ed25519 is."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa, x448, x25519

    kinds: tuple[tuple[type, str], ...] = (
        (ed448.Ed448PrivateKey, "an Ed448 key"),
        (x25519.X25519PrivateKey, "an X25519 key (for key exchange, not signing)"),
        (x448.X448PrivateKey, "an X448 key (for key exchange, not signing)"),
        (dsa.DSAPrivateKey, "a DSA key"),
        (rsa.RSAPrivateKey, "an RSA key"),
        (ec.EllipticCurvePrivateKey, "an ECDSA key"),
    )
    return next((name for kind, name in kinds if isinstance(private, kind)), f"a {type(private).__name__}")
