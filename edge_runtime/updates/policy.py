"""What a signed target says about its bundle, and what a device decides from it before fetching a byte.

Each bundle in the repository is one TUF target, ``NAME/NAME-vVERSION.tar``, whose ``custom`` metadata holds one
object under ``"edgeline"`` (signed with the targets metadata, so it can be believed before the archive is fetched):

    name, version, profile, backend, precision, runtime {package, min_version}, manifest_sha256, postprocess
    trial      the gates its trial must meet on the device (``Gates``; set at ``edgeline publish``)
    audience   the devices (instance ids) it is offered to, or null for every device (``edgeline rollout``)
    revoked    null, or why the publisher withdrew it (a halted rollout): devices running it go back
    unpacked_bytes, unpacked_entries
               what the archive unpacks to: its files' bytes (the manifest's included), and its files and
               directories; null for a target published before they were signed

``choose`` picks the newest version offered to this device that it has not refused; ``precheck`` refuses what the
metadata alone shows cannot run here (another name or profile, a runtime missing or too old: the check
``edgeline doctor`` makes) before the archive is downloaded; ``room_refusal`` says when the device lacks, for now,
the disk to download and unpack it or the memory to hold it beside the running version during its trial.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeline.errors import UpdateRefused

__all__ = [
    "CUSTOM_KEY",
    "DOWNLOAD_TIMEOUT_S",
    "ENTRY_BYTES",
    "MEMORY_MARGIN",
    "Choice",
    "Gates",
    "Room",
    "TargetFacts",
    "choose",
    "disk_needed",
    "precheck",
    "room_refusal",
    "target_path",
]

CUSTOM_KEY = "edgeline"
MEMORY_MARGIN = 1.5
"""The memory a device must have available for a new version: its measured ``resident_mb`` times this (the figure
was taken on the export machine; the device's allocator and runtime build differ)."""
ENTRY_BYTES = 4096
"""The disk one unpacked file or directory may take beyond its bytes: a file of one byte takes a whole block, and
4 KiB is the block of ext4 and f2fs, the file systems a state directory lives on (a FAT card's clusters are larger:
a state directory does not belong there)."""
DOWNLOAD_TIMEOUT_S = 600.0
"""The default deadline of one whole download (``[updates] download_timeout_s``): a metadata file or an archive."""
MB = 1 << 20


def target_path(name: str, version: int) -> str:
    return f"{name}/{name}-v{version}.tar"


class _Frozen(BaseModel):
    # A field a newer publisher adds is ignored, not refused: the signature already vouches for it, and a device
    # that refused it would remember every later version as "malformed".
    model_config = ConfigDict(frozen=True, extra="ignore")


class Gates(_Frozen):
    """The trial a new version passes beside the previous one before it is committed.

    The defaults suit a classifier: 200 inputs (or 10 minutes, whichever comes first, with at least
    ``min_inputs``), at most 1% of inputs failing where the previous version answered, top-1 agreement with the
    previous version on at least 90% of inputs (a retrained model may rightly change some answers; a broken one
    changes most), and a p95 model latency within the profile's budget measured on the device (without a budget:
    a median, or a lower quartile, at most twice the previous version's, measured beside it). Non-classifiers agree
    when every output is within ``tolerance`` of the previous one, relative to its largest magnitude; anomaly
    detectors when both flag the same inputs.
    """

    inputs: int = Field(default=200, ge=1, le=1_000_000)
    seconds: float = Field(default=600.0, gt=0, le=30 * 86400)
    min_inputs: int = Field(default=20, ge=1)
    max_error_rate: float = Field(default=0.01, ge=0, le=1)
    min_agreement: float = Field(default=0.90, ge=0, le=1)
    tolerance: float = Field(default=0.1, ge=0)
    max_latency_ms: float | None = Field(default=None, gt=0)
    """None: the bundle's ``budgets.max_latency_ms``; without one (or off its device), twice the previous median."""


class Runtime(_Frozen):
    package: str
    min_version: str


class TargetFacts(_Frozen):
    name: str
    version: int = Field(ge=1)
    profile: str
    backend: str
    precision: str
    runtime: Runtime
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    postprocess: Literal["classify", "regress", "anomaly", "raw"] = "raw"
    trial: Gates = Gates()
    audience: tuple[str, ...] | None = None
    revoked: str | None = None
    resident_mb: float | None = Field(default=None, ge=0)
    """The manifest's ``memory.resident_mb``: what loading and running the model adds to a process, measured at
    export (on the export machine, with the bundle's runtime); None where it was not measured."""
    unpacked_bytes: int | None = Field(default=None, ge=0)
    """The bytes of the files the archive unpacks to, ``manifest.json`` included (``archive.unpacked_size``); the
    unpacker refuses an archive that holds more. None for a target published before this was signed."""
    unpacked_entries: int | None = Field(default=None, ge=1)
    """The files and directories the archive unpacks to (each takes a block of the disk at least)."""

    def offered_to(self, device: str) -> bool:
        return self.audience is None or device in self.audience

    @classmethod
    def from_custom(cls, path: str, custom: Any) -> TargetFacts:
        data = custom.get(CUSTOM_KEY) if isinstance(custom, dict) else None
        if data is None:
            raise UpdateRefused(
                f"target {path}: no {CUSTOM_KEY!r} custom metadata: not an edgeline bundle", reason="malformed"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UpdateRefused(f"target {path}: custom metadata {where}: {first['msg']}", reason="malformed") from exc

    def as_custom(self) -> dict[str, Any]:
        """The facts as TUF custom metadata. Canonical JSON (what is signed) has no floats: numbers with a
        fraction are written as decimal strings, which validation reads back as numbers."""
        return {CUSTOM_KEY: _no_floats(self.model_dump(mode="json"))}


def _no_floats(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return {k: _no_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_floats(v) for v in value]
    return value


@dataclass(frozen=True)
class Choice:
    """What the signed metadata offers this device: the version to take (or None), and what else it saw."""

    take: TargetFacts | None
    newest_offered: int | None
    """The newest version offered to this device that is not revoked (refused or not)."""
    running_revoked: str | None
    """Why the version that runs here was revoked; None when it was not."""


def choose(targets: Iterable[TargetFacts], *, name: str, device: str, running: int, refused: Collection[int]) -> Choice:
    offered = [t for t in targets if t.name == name and t.offered_to(device)]
    revoked_running = next((t.revoked for t in offered if t.version == running and t.revoked), None)
    live = [t for t in offered if not t.revoked]
    newest = max((t.version for t in live), default=None)
    candidates = [t for t in live if t.version > running and t.version not in refused]
    take = max(candidates, key=lambda t: t.version, default=None)
    return Choice(take=take, newest_offered=newest, running_revoked=revoked_running)


def precheck(facts: TargetFacts, *, name: str, profile: str, inputs_of_running: str | None = None) -> None:
    """Refuse (``incompatible``) what the signed metadata alone shows cannot replace the running bundle here."""
    if facts.name != name:
        raise UpdateRefused(
            f"v{facts.version} is bundle {facts.name!r}, not {name!r}", reason="incompatible", version=facts.version
        )
    if facts.profile != profile:
        raise UpdateRefused(
            f"v{facts.version} was exported for profile {facts.profile!r}; this device runs {profile!r}",
            reason="incompatible",
            version=facts.version,
        )
    from edgeline.verdicts import runtime_refusal

    problem = runtime_refusal(facts.backend, facts.runtime.package, facts.runtime.min_version)
    if problem is not None:
        raise UpdateRefused(
            f"v{facts.version} cannot run here: {problem}", reason="incompatible", version=facts.version
        )


@dataclass(frozen=True)
class Room:
    """What a device has for an update, measured just before it downloads one."""

    free_bytes: int | None  # on the state directory's filesystem; None where unknown
    reserve_bytes: int  # kept free for others there: the room the durable outbox may still grow into
    available_mb: float | None  # memory this process may still take (MemAvailable, a cgroup limit); None: unknown


def disk_needed(facts: TargetFacts, length: int) -> int:
    """The most disk the update of ``facts`` (an archive of ``length`` bytes, signed) takes at once: while it
    downloads, python-tuf's temporary copy and the archive it is copied to (twice the length); while it unpacks,
    the archive and the unpacked bundle, each file and directory counted a block more than its bytes. A target
    published before its unpacked size was signed counts as unpacking to its own length."""
    if facts.unpacked_bytes is None or facts.unpacked_entries is None:
        unpacked = length
    else:
        unpacked = facts.unpacked_bytes + facts.unpacked_entries * ENTRY_BYTES
    return length + max(length, unpacked)


def room_refusal(facts: TargetFacts, length: int, room: Room) -> str | None:
    """Why this device cannot take ``facts``'s version now (None: it can): the disk it takes at once
    (``disk_needed``) beside what the outbox may still need; during the trial both versions are loaded. A figure
    that is unknown does not refuse."""
    version = facts.version
    if room.free_bytes is not None:
        disk = disk_needed(facts, length)
        if room.free_bytes < disk + room.reserve_bytes:
            unpacked = (
                f"{facts.unpacked_bytes / MB:.1f} MB in {facts.unpacked_entries} files and directories"
                if facts.unpacked_bytes is not None and facts.unpacked_entries is not None
                else "unpacked size not signed: counted as its length"
            )
            return (
                f"v{version} needs {disk / MB:.1f} MB of disk to download and unpack (a {length / MB:.1f} MB "
                f"archive, {unpacked}), and {room.reserve_bytes / MB:.1f} MB stay free for the outbox; the state "
                f"directory has {room.free_bytes / MB:.1f} MB free"
            )
    if facts.resident_mb is not None and room.available_mb is not None:
        needed_mb = facts.resident_mb * MEMORY_MARGIN
        if room.available_mb < needed_mb:
            return (
                f"v{version} adds {facts.resident_mb:.1f} MB when loaded (measured at export) and runs its trial "
                f"beside the running version; {room.available_mb:.0f} MB of memory are available to this process "
                "(the machine's, or its service's memory limit), "
                f"{needed_mb:.1f} MB needed"
            )
    return None
