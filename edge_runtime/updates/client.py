"""The device's side of a signed update: TUF's ``Updater`` with the pinned root, over a local directory, a
``file://`` URL (a USB stick, an rsync target) or HTTP(S).

``UpdateClient.check`` refreshes the metadata (root chain, timestamp, snapshot, targets: every signature, version
and expiry checked by python-tuf) and says which version this device should take. ``fetch`` downloads that
target (its length and sha256 checked against the signed metadata while it arrives) and ``unpack`` opens it into a
bundle whose manifest and files match. Every failure is an ``UpdateRefused`` with a reason: nothing of a refused
update reaches a model parser. Every file is downloaded by edgeline's fetchers (``edgeline.updates.fetchers``): whole
within ``download_timeout_s`` or given up (``timeout``, tried again at the next check), never longer than python-tuf
allows, into the state directory.

Only python-tuf's own exceptions (``RepositoryError``: what the metadata or a target says is wrong; ``DownloadError``:
what a fetcher could not get) and the OS's (``OSError``: a file, the disk downloads land on) are translated; anything
else (an ``AttributeError``, a ``RuntimeError`` from python-tuf's state machine) is a bug, and reaches the update
thread's top as one, never a refusal that would be remembered against a good version.

python-tuf stores the trusted metadata with a temporary file and a rename and never flushes either; ``DurableUpdater``
stores it the way edgeline stores its own state (``edgeline.durable.write_atomically``), so that a power cut right
after a refresh cannot take back the versions a device has seen (its protection against rollback).

The list of targets is read from the targets metadata python-tuf has just verified and stored (``targets.json`` in
its metadata directory, its documented cache); the chosen target is then asked of the ``Updater`` itself
(``get_targetinfo``), so what is fetched is always what the trusted metadata says.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from edgeline.bundle import Bundle
from edgeline.durable import write_atomically
from edgeline.errors import UpdateError, UpdateRefused
from edgeline.updates.archive import unpack
from edgeline.updates.fetchers import HttpFetcher, LocalFetcher
from edgeline.updates.policy import DOWNLOAD_TIMEOUT_S, Choice, TargetFacts, choose, target_path

__all__ = ["UpdateClient", "durable_updater", "refusal_from", "repository_urls", "tuf_errors"]

log = logging.getLogger("edgeline.updates")


@functools.cache
def durable_updater() -> type[Any]:
    """python-tuf's ``Updater`` with its metadata stored durably (see the module). ``_persist_file`` is where
    python-tuf 7.0 (pinned) writes every metadata file, root versions included; a test holds that true."""
    from tuf.ngclient import Updater

    class DurableUpdater(Updater):
        def _persist_file(self, filename: str, data: bytes) -> None:
            write_atomically(Path(filename), data)

    return DurableUpdater


def repository_urls(repository: str) -> tuple[str, str, bool]:
    """(metadata base URL, targets base URL, local) for a directory, a ``file://`` URL or an HTTP(S) URL."""
    parsed = urlparse(repository)
    if parsed.scheme in ("http", "https"):
        base = repository.rstrip("/")
        return f"{base}/metadata/", f"{base}/targets/", False
    if parsed.scheme == "file":
        directory = Path(unquote(parsed.path))
    elif parsed.scheme in ("",) or (len(parsed.scheme) == 1 and repository[1:3] == ":\\"):
        directory = Path(repository)
    else:
        raise UpdateError(f"updates repository {repository!r}: use a directory, a file:// URL or an http(s):// URL")
    base = directory.resolve().as_uri()
    return f"{base}/metadata/", f"{base}/targets/", True


@functools.cache
def tuf_errors() -> tuple[type[Exception], ...]:
    """What python-tuf and its transport raise for a repository that cannot be trusted or read: python-tuf's two
    roots (edgeline's fetchers raise ``DownloadError`` for what they could not get) and the OS's (a local file, a
    socket, the disk downloads land on). Imported on first use, as python-tuf is."""
    from tuf.api.exceptions import DownloadError, RepositoryError

    return (RepositoryError, DownloadError, OSError)


@dataclass(frozen=True)
class Offer:
    facts: TargetFacts
    path: str
    info: Any  # tuf.api.metadata.TargetFile, from the trusted metadata


def refusal_from(exc: Exception, what: str) -> UpdateError:
    """python-tuf's exceptions (one of ``tuf_errors()``) as edgeline's refusals (or, for a repository out of reach,
    an ``UpdateError``)."""
    from tuf.api import exceptions as tuf_exceptions

    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, tuf_exceptions.UnsignedMetadataError):
        return UpdateRefused(f"{text} (not signed by the keys the pinned root trusts)", reason="bad-signature")
    if isinstance(exc, tuf_exceptions.LengthOrHashMismatchError):
        return UpdateRefused(f"{text} (its bytes differ from the signed metadata)", reason="tampered")
    if isinstance(exc, tuf_exceptions.BadVersionNumberError):
        return UpdateRefused(f"{text} (older metadata than this device has seen: a replay)", reason="rollback")
    if isinstance(exc, tuf_exceptions.ExpiredMetadataError):
        fix = (
            "the publisher signs a new root with the offline root key: `edgeline keys renew KEYS --repo REPO`"
            if "root" in str(exc)
            else "the publisher re-signs it with `edgeline publish --refresh`"
        )
        return UpdateRefused(f"{text} ({fix}; the running version keeps serving)", reason="expired")
    if isinstance(exc, tuf_exceptions.DownloadLengthMismatchError):
        return UpdateRefused(f"{text} (longer than the signed metadata allows)", reason="tampered")
    if isinstance(exc, tuf_exceptions.SlowRetrievalError):
        return UpdateRefused(f"{text}; given up, tried again at the next check", reason="timeout")
    if isinstance(exc, tuf_exceptions.RepositoryError):
        return UpdateRefused(text, reason="malformed")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return UpdateRefused(f"{text} (the state directory's disk is full; tried again at the next check)",
                             reason="no-room")  # fmt: skip
    return UpdateError(f"{text} (the repository cannot be read now; tried again at the next check)")


class UpdateClient:
    """One device's view of one repository. ``work`` holds python-tuf's metadata (``work/tuf``) and downloads
    (``work/downloads``, python-tuf's temporary files included); every download is whole within
    ``download_timeout_s`` or given up."""

    def __init__(
        self, repository: str, trusted_root: Path, work: Path, *, download_timeout_s: float = DOWNLOAD_TIMEOUT_S
    ):
        try:
            self.bootstrap = trusted_root.read_bytes()
        except OSError as exc:
            raise UpdateError(f"trusted root {trusted_root}: {exc.strerror or exc}") from exc
        self.repository = repository
        self.metadata_url, self.targets_url, self.local = repository_urls(repository)
        self.directory = Path(unquote(urlparse(self.metadata_url).path)).parent if self.local else Path()
        self.work = work
        self.metadata_dir = work / "tuf"
        self.downloads = work / "downloads"
        fetcher = LocalFetcher if self.local else HttpFetcher
        self.fetcher = fetcher(spool=self.downloads, timeout_s=download_timeout_s)
        self._spoiled: dict[tuple[int, str, int, int], str] = {}
        """Targets refused whole as ``tampered`` (or longer than signed), by (version, signed sha256, signed length,
        targets metadata version), with the refusal: not downloaded again until the publisher signs the targets
        metadata again (a fixed repository is re-signed: ``edgeline publish --refresh``, which first checks every
        archive it signs, or any publish or rollout step; and a gateway refreshes at least as often as timestamps
        expire)."""
        self._targets_version = 0
        """The version of the targets metadata the last check verified."""

    def _updater(self) -> Any:
        self.metadata_dir.mkdir(parents=True, exist_ok=True)
        self.downloads.mkdir(parents=True, exist_ok=True)
        try:
            return durable_updater()(
                str(self.metadata_dir),
                self.metadata_url,
                str(self.downloads),
                self.targets_url,
                fetcher=self.fetcher,
                bootstrap=self.bootstrap,
            )
        except tuf_errors() as exc:
            raise refusal_from(exc, "the pinned trusted root") from exc

    def check(self, *, name: str, device: str, running: int, refused: Collection[int] = ()) -> tuple[Choice, Any]:
        """Refresh the signed metadata and choose; returns the choice and the refreshed ``Updater``."""
        from tuf.api.metadata import Metadata, Targets

        updater = self._updater()
        try:
            updater.refresh()
        except tuf_errors() as exc:
            if self.local and not os.path.lexists(self.directory / "metadata" / "timestamp.json"):
                raise UpdateError(
                    f"repository {self.repository}: nothing published there yet (no metadata/timestamp.json)"
                ) from exc
            raise refusal_from(exc, f"repository {self.repository}") from exc
        stored = Metadata[Targets].from_file(str(self.metadata_dir / "targets.json"))
        self._targets_version = int(stored.signed.version)
        facts = []
        for path, info in stored.signed.targets.items():
            if not path.startswith(f"{name}/"):
                continue
            try:
                facts.append(TargetFacts.from_custom(path, info.custom))
            except UpdateRefused as exc:
                log.warning("%s", exc)
        return choose(facts, name=name, device=device, running=running, refused=refused), updater

    def offer(self, updater: Any, facts: TargetFacts) -> Offer:
        path = target_path(facts.name, facts.version)
        try:
            info = updater.get_targetinfo(path)
        except tuf_errors() as exc:
            raise refusal_from(exc, f"target {path}") from exc
        if info is None:
            raise UpdateRefused(
                f"target {path} is not in the trusted metadata", reason="malformed", version=facts.version
            )
        trusted = TargetFacts.from_custom(path, info.custom)
        if trusted != facts:
            raise UpdateRefused(f"target {path}: its metadata changed while it was read", reason="malformed")
        return Offer(facts=trusted, path=path, info=info)

    def fetch(self, updater: Any, offer: Offer) -> Path:
        """The target's archive, downloaded and checked against its signed length and sha256."""
        from tuf.api.exceptions import DownloadLengthMismatchError

        destination = self.downloads / f"{offer.facts.name}-v{offer.facts.version}.tar"
        cached = updater.find_cached_target(offer.info, str(destination))
        if cached:
            return Path(cached)
        version, length = offer.facts.version, int(offer.info.length)
        signed = (version, str(offer.info.hashes.get("sha256", "")), length, self._targets_version)
        if signed in self._spoiled:
            raise UpdateRefused(self._spoiled[signed], reason="tampered", version=version)
        try:
            return Path(updater.download_target(offer.info, str(destination)))
        except tuf_errors() as exc:
            destination.unlink(missing_ok=True)
            error = refusal_from(exc, f"target {offer.path}")
            if isinstance(error, UpdateRefused):
                error.version = version
                # Longer than signed, or whole and other bytes: never a copy still under way (that is shorter, and
                # tried again at the next check): a server streaming without end is not downloaded at every check.
                if error.reason == "tampered" and (
                    isinstance(exc, DownloadLengthMismatchError) or self.fetcher.received >= length
                ):
                    message = f"{error} (not downloaded again until the publisher signs the repository again)"
                    self._spoiled[signed] = message
                    error = UpdateRefused(message, reason="tampered", version=version)
            raise error from exc

    def unpack(self, archive: Path, offer: Offer, destination: Path) -> Bundle:
        """The archive as a bundle directory at ``destination``; its manifest must be the signed one and agree with
        the signed facts."""
        if destination.exists():
            shutil.rmtree(destination)
        try:
            bundle = unpack(
                archive, destination, manifest_sha=offer.facts.manifest_sha256,
                unpacked_bytes=offer.facts.unpacked_bytes, unpacked_entries=offer.facts.unpacked_entries,
            )  # fmt: skip
        except UpdateRefused as exc:
            exc.version = offer.facts.version
            raise
        manifest, facts = bundle.manifest, offer.facts
        if (manifest.name, manifest.version, manifest.profile, manifest.backend) != (
            facts.name, facts.version, facts.profile, facts.backend,
        ):  # fmt: skip
            shutil.rmtree(destination, ignore_errors=True)
            raise UpdateRefused(  # intact and signed: the version itself is wrong, remembered against it
                f"{offer.path}: its manifest says {manifest.name} v{manifest.version} ({manifest.profile}, "
                f"{manifest.backend}), its signed metadata {facts.name} v{facts.version}",
                reason="malformed",
                version=facts.version,
            )
        return bundle
