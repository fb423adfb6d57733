"""What the update agent keeps in the state directory, written so that a power cut at any moment leaves one
working version.

    STATE/NAME/updates/state.json   committed and previous versions, refused versions, the version on trial
    STATE/NAME/updates/bundles/vN/  unpacked bundles (the committed one, the previous one, the one on trial)
    STATE/NAME/updates/tuf/         python-tuf's trusted metadata (rollback protection survives restarts)
    STATE/NAME/updates/downloads/   archives as fetched

``state.json`` is replaced whole: written to a temporary file, flushed to the disk, renamed over the old one, and
the directory flushed; a reader sees the old state or the new one, never a mix. A bundle is unpacked into a
``.partial`` directory and renamed when whole, and verified again (sizes and sha256) whenever it is opened.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MAX_TRIAL_ATTEMPTS", "Installed", "State", "Store", "write_atomically"]

log = logging.getLogger("edgeline.updates")
MAX_TRIAL_ATTEMPTS = 2
"""A version whose trial was cut short by the process dying this many times is refused: it may be the cause."""


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: written to a temporary file (created with ``mode``), flushed to the disk,
    renamed over ``path``, and the directory flushed. A reader (or a power cut) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@dataclass(frozen=True)
class Installed:
    version: int
    bundle: str  # relative to the updates directory

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "bundle": self.bundle}


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
    def from_dict(cls, data: dict[str, Any]) -> State:
        def installed(value: Any) -> Installed | None:
            return Installed(int(value["version"]), str(value["bundle"])) if value else None

        return cls(
            committed=installed(data.get("committed")),
            previous=installed(data.get("previous")),
            refused={int(k): dict(v) for k, v in (data.get("refused") or {}).items()},
            trying=dict(data["trying"]) if data.get("trying") else None,
        )


class Store:
    def __init__(self, directory: Path):
        self.directory = directory
        self.path = directory / "state.json"
        self.bundles = directory / "bundles"

    def load(self) -> State:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            return State.from_dict(data)
        except FileNotFoundError:
            return State()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Only a disk that lies could leave this (the file is replaced atomically): start from the bundle given
            log.error("%s cannot be read (%s): starting from the bundle on the command line", self.path, exc)
            return State()

    def save(self, state: State) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, (json.dumps(state.as_dict(), indent=2) + "\n").encode())

    def bundle_dir(self, version: int) -> Path:
        return self.bundles / f"v{version}"

    def relative(self, path: Path) -> str:
        return path.relative_to(self.directory).as_posix()

    def resolve(self, installed: Installed) -> Path:
        return self.directory / installed.bundle

    def prune(self, state: State) -> None:
        """Remove unpacked bundles and downloads no version of ``state`` needs (and leftovers of a cut unpack)."""
        keep = {i.bundle for i in (state.committed, state.previous) if i is not None}
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
