"""What the update agent keeps in the state directory, written so that a power cut at any moment leaves one
working version, and read so that no content of it stops a device.

    STATE/NAME/updates/state.json     committed and previous versions, refused versions, the version on trial
    STATE/NAME/updates/refused.jsonl  every refusal that belongs to the version, one JSON line each, appended
    STATE/NAME/updates/bundles/vN/    unpacked bundles (the committed one, the previous one, the one on trial)
    STATE/NAME/updates/tuf/           python-tuf's trusted metadata (rollback protection survives restarts)
    STATE/NAME/updates/downloads/     archives as fetched

``state.json`` is replaced whole: written to a temporary file, flushed to the disk, renamed over the old one, and
the directory flushed; a reader sees the old state or the new one, never a mix. It is validated when read
(``StateFile``): a file that is not one (any JSON, a truncated file, a committed bundle outside ``bundles/``, a
directory, a file that cannot be read) is renamed aside as ``state.json.bad-<UTC time>``, said in one line, and the
daemon starts from the bundle on its command line. The refused versions are also appended to ``refused.jsonl``
(flushed to the disk before ``state.json`` is written): the refused set is the union of both, so one bad file never
lets a refused version in again. A bundle is unpacked into a ``.partial`` directory and renamed when whole, and
verified again (sizes and sha256) whenever it is opened.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from edgeline.durable import flush_directory, write_atomically

__all__ = [
    "KEPT_REFUSALS",
    "MAX_TRIAL_ATTEMPTS",
    "RECORD_MAX_LINES",
    "Installed",
    "State",
    "StateFile",
    "Store",
    "write_atomically",
]

log = logging.getLogger("edgeline.updates")
MAX_TRIAL_ATTEMPTS = 2
"""A version whose trial was cut short by the process dying this many times is refused: it may be the cause."""
KEPT_REFUSALS = 256
"""Refused versions remembered (the highest: versions only grow, and a device only looks above the one it runs)."""
RECORD_MAX_LINES = 1024
"""``refused.jsonl`` is rewritten (one line per version, the newest ``KEPT_REFUSALS``) when it grows past this."""
KEPT_SET_ASIDE = 3
"""Bad state files kept for a look (``state.json.bad-*``); older ones are removed."""
MAX_FILE_BYTES = 4 << 20
"""A state file or record larger than this is not one edgeline wrote (the refusals it keeps are bounded)."""
MESSAGE_CHARS = 500


class _Checked(BaseModel):
    # strict: a version is a JSON integer, never "2" nor 2.0 nor true; a field a newer edgeline adds is ignored
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


class Installed(_Checked):
    """A version kept on the device: ``bundle`` is ``bundles/vN`` in the updates directory, or (``given``) the
    absolute path of the bundle the daemon was started with, which edgeline never copies."""

    version: int = Field(ge=1)
    bundle: str = Field(min_length=1, max_length=4096)
    given: bool = False

    def as_dict(self) -> dict[str, Any]:
        kept: dict[str, Any] = {"version": self.version, "bundle": self.bundle}
        if self.given:
            kept["given"] = True
        return kept


class Refusal(_Checked):
    reason: str = Field(min_length=1, max_length=64)
    message: str = Field(max_length=2 * MESSAGE_CHARS)


class Trying(_Checked):
    version: int = Field(ge=1)
    attempts: int = Field(ge=0, le=1000)


VersionKey = Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,9}$")]


class StateFile(_Checked):
    """``state.json``, as read: every field typed, missing ones empty."""

    committed: Installed | None = None
    previous: Installed | None = None
    refused: dict[VersionKey, Refusal] = Field(default_factory=dict)
    trying: Trying | None = None


class RecordLine(_Checked):
    """One line of ``refused.jsonl``."""

    version: int = Field(ge=1)
    reason: str = Field(min_length=1, max_length=64)
    message: str = Field(max_length=2 * MESSAGE_CHARS)
    at: float = Field(default=0.0, ge=0)


@dataclass
class State:
    committed: Installed | None = None
    """None: the bundle the daemon was started with."""
    previous: Installed | None = None
    refused: dict[int, dict[str, str]] = field(default_factory=dict)
    trying: dict[str, int] | None = None
    """``{"version": N, "attempts": K}`` while a version is on trial."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "committed": self.committed.as_dict() if self.committed else None,
            "previous": self.previous.as_dict() if self.previous else None,
            "refused": {str(k): v for k, v in sorted(self.refused.items())},
            "trying": self.trying,
        }

    @classmethod
    def from_file(cls, data: StateFile) -> State:
        return cls(
            committed=data.committed,
            previous=data.previous,
            refused={int(k): v.model_dump() for k, v in data.refused.items()},
            trying=data.trying.model_dump() if data.trying else None,
        )


class _Bad(Exception):
    """Why ``state.json`` (or ``refused.jsonl``) cannot be used."""


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else str(first["msg"])


class Store:
    """The updates directory. ``given``: the bundle on the daemon's command line, the only one outside it a state
    file may name (``Installed.given``)."""

    def __init__(self, directory: Path, given: Path | None = None):
        self.directory = directory
        self.given = None if given is None else str(given.resolve())
        self.path = directory / "state.json"
        self.record = directory / "refused.jsonl"
        self.bundles = directory / "bundles"
        self._record_lines = 0

    # -- reading: never raises -----------------------------------------------------------------------------------
    def load(self) -> State:
        """The state to start from: ``state.json`` when it is one (else it is set aside and the state is empty),
        its refused versions joined by those of ``refused.jsonl``."""
        try:
            state = State.from_file(self._read())
        except FileNotFoundError:
            state = State()
        except _Bad as exc:
            self._set_aside(self.path, str(exc), f"starting from the bundle on the command line, {self.record.name} "
                            "keeping the refused versions")  # fmt: skip
            state = State()
        recorded, whole = self._read_record()
        missing = any(recorded.get(v) != r for v, r in state.refused.items())
        joined = {**recorded, **state.refused}
        state.refused = {v: joined[v] for v in sorted(joined)[-KEPT_REFUSALS:]}
        if not whole or missing or self._record_lines > RECORD_MAX_LINES:
            self._rewrite_record(state.refused)
        return state

    @staticmethod
    def _read_bytes(path: Path) -> bytes:
        """A regular file's bytes (FileNotFoundError when there is none); ``_Bad`` says why it cannot be used."""
        try:
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                raise _Bad("not a regular file")
            if info.st_size > MAX_FILE_BYTES:
                raise _Bad(f"{info.st_size} bytes, more than edgeline writes")
            return path.read_bytes()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _Bad(f"cannot be read: {exc.strerror or exc}") from exc

    def _read(self) -> StateFile:
        try:
            parsed = StateFile.model_validate_json(self._read_bytes(self.path))
        except ValidationError as exc:
            raise _Bad(_first_error(exc)) from exc
        previous = parsed.previous
        if previous is not None and not previous.given and PurePosixPath(previous.bundle).is_absolute():
            # edgeline before the "given" mark wrote the command line's bundle as an absolute path, unmarked
            parsed = parsed.model_copy(update={"previous": previous.model_copy(update={"given": True})})
        for name in ("committed", "previous"):
            installed = getattr(parsed, name)
            if installed is None:
                continue
            self._check_place(name, installed)
            if installed.given and installed.bundle != self.given:
                # another bundle than the command line's, marked as it: never run from outside the directory
                log.warning(
                    "%s: %s v%d names %s as the command line's bundle; the daemon was started with %s: not kept",
                    self.path, name, installed.version, installed.bundle, self.given,
                )  # fmt: skip
                parsed = parsed.model_copy(update={name: None})
        return parsed

    def _check_place(self, name: str, installed: Installed) -> None:
        """A kept bundle is ``bundles/vN`` of its version, and no link leads it out of ``bundles/``; only the
        command line's bundle (``given``) lies elsewhere, named by its absolute path."""
        if installed.given:
            if not PurePosixPath(installed.bundle).is_absolute():
                raise _Bad(f"{name}.bundle {installed.bundle!r}: the command line's bundle is an absolute path")
            return
        expected = self.relative(self.bundle_dir(installed.version))
        if installed.bundle != expected:
            raise _Bad(f"{name}.bundle {installed.bundle!r} is not {expected!r}, where v{installed.version} is kept")
        resolved = (self.directory / installed.bundle).resolve()
        if not resolved.is_relative_to(self.bundles.resolve()):
            raise _Bad(f"{name}.bundle {installed.bundle!r} leads out of {self.bundles} (to {resolved})")

    def _set_aside(self, path: Path, why: str, meanwhile: str) -> None:
        """Rename ``path`` to ``NAME.bad-<UTC time>`` (the newest ``KEPT_SET_ASIDE`` are kept), said in one line."""
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        aside = path.with_name(f"{path.name}.bad-{stamp}")
        try:
            os.rename(path, aside)
        except OSError as exc:
            log.error("%s cannot be used (%s) nor set aside (%s): %s", path, why, exc.strerror or exc, meanwhile)
            return
        log.error("%s cannot be used (%s): set aside as %s; %s", path, why, aside.name, meanwhile)
        for old in sorted(path.parent.glob(f"{path.name}.bad-*"))[:-KEPT_SET_ASIDE]:
            with contextlib.suppress(OSError):
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()

    def _read_record(self) -> tuple[dict[int, dict[str, str]], bool]:
        """The refusals of ``refused.jsonl`` (a version's last line wins), and whether every line was one (a line
        a power cut left unfinished, or garbage, is skipped and said)."""
        refused: dict[int, dict[str, str]] = {}
        self._record_lines = 0
        try:
            lines = self._read_bytes(self.record).splitlines()
        except FileNotFoundError:
            return refused, True
        except _Bad as exc:
            self._set_aside(self.record, str(exc), f"the refused versions are those of {self.path.name}")
            return refused, False
        skipped, first = 0, ""
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            self._record_lines += 1
            try:
                entry = RecordLine.model_validate_json(line)
            except ValidationError as exc:
                skipped += 1
                first = first or f"line {number}: {_first_error(exc)}"
                continue
            refused[entry.version] = {"reason": entry.reason, "message": entry.message}
        if skipped:
            log.error("%s: %d line(s) are not refusals, skipped (%s); the file is written anew without them",
                      self.record, skipped, first)  # fmt: skip
        return refused, not skipped

    # -- writing -------------------------------------------------------------------------------------------------
    def save(self, state: State) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, (json.dumps(state.as_dict(), indent=2) + "\n").encode())

    def refuse(self, state: State, version: int, reason: str, message: str) -> None:
        """Remember in ``state`` (saved by the caller) that ``version`` is refused, and first in ``refused.jsonl``:
        a power cut between the two leaves it there. Only the newest ``KEPT_REFUSALS`` versions are kept."""
        entry = {"reason": reason, "message": message[:MESSAGE_CHARS]}
        state.refused[version] = entry
        for old in sorted(state.refused)[:-KEPT_REFUSALS]:
            del state.refused[old]
        line = json.dumps({"version": version, **entry, "at": round(time.time(), 3)}) + "\n"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            created = not self.record.exists()
            # appended in place: never through a planted link (O_NOFOLLOW), never waiting on a FIFO (O_NONBLOCK)
            fd = os.open(self.record, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                size = info.st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a line a power cut left unfinished is ended
                    line = "\n" + line
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                flush_directory(self.directory)
        except OSError as exc:
            log.error("v%d refused (%s), but %s cannot be written (%s): only %s keeps it", version, reason,
                      self.record, exc.strerror or exc, self.path.name)  # fmt: skip
            return
        self._record_lines += 1
        if self._record_lines > RECORD_MAX_LINES:
            self._rewrite_record(state.refused)

    def _rewrite_record(self, refused: dict[int, dict[str, str]]) -> None:
        """``refused.jsonl`` anew, atomically: one line per version, the newest ``KEPT_REFUSALS``."""
        kept = sorted(refused)[-KEPT_REFUSALS:]
        lines = [json.dumps({"version": v, **refused[v]}) + "\n" for v in kept]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(self.record, "".join(lines).encode())
        except OSError as exc:
            log.error("%s cannot be written (%s): only %s keeps the refused versions", self.record,
                      exc.strerror or exc, self.path.name)  # fmt: skip
            return
        self._record_lines = len(lines)

    # -- bundles -------------------------------------------------------------------------------------------------
    def bundle_dir(self, version: int) -> Path:
        return self.bundles / f"v{version}"

    def relative(self, path: Path) -> str:
        return path.relative_to(self.directory).as_posix()

    def resolve(self, installed: Installed) -> Path:
        return Path(installed.bundle) if installed.given else self.directory / installed.bundle

    def prune(self, state: State) -> None:
        """Remove unpacked bundles and downloads no version of ``state`` needs (and leftovers of a cut unpack)."""
        keep = {i.bundle for i in (state.committed, state.previous) if i is not None and not i.given}
        if state.trying:
            keep.add(self.relative(self.bundle_dir(state.trying["version"])))
        if self.bundles.is_dir():
            for child in self.bundles.iterdir():
                if self.relative(child) not in keep:
                    shutil.rmtree(child, ignore_errors=True)
        downloads = self.directory / "downloads"
        if downloads.is_dir():
            for child in downloads.iterdir():
                with contextlib.suppress(OSError):
                    child.unlink()
