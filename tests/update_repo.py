"""Signed update repositories for the tests: keys, bundles of any version made from a committed bundle (no torch),
and a bundle whose golden self-test fails."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.updates.keys import generate
from edgeline.updates.policy import Gates
from edgeline.updates.repository import Published, Repository
from tests.tiny_bundle import COMMITTED_BUNDLE

__all__ = ["UpdateRepo", "versioned"]


def _rewrite_manifest(bundle: Path, change: dict[str, Any]) -> None:
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(change)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def versioned(
    destination: Path,
    version: int,
    *,
    source: Path = COMMITTED_BUNDLE,
    break_golden: bool = False,
    manifest: dict[str, Any] | None = None,
) -> Path:
    """A copy of ``source`` as ``version``; ``break_golden``: its golden outputs moved by 1.0, so the bundle is
    intact and signed but fails its self-test on any machine; ``manifest``: other fields to set."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination)
    change: dict[str, Any] = {"version": version, **(manifest or {})}
    if break_golden:
        golden = destination / "golden.npz"
        with np.load(golden, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        for key in arrays:
            if key.startswith("output"):
                arrays[key] = arrays[key] + 1.0
        with golden.open("wb") as handle:
            np.savez(handle, **arrays)
        files = json.loads((destination / "manifest.json").read_text())["files"]
        for entry in files:
            if entry["path"] == "golden.npz":
                entry["size"] = golden.stat().st_size
                entry["sha256"] = hashlib.sha256(golden.read_bytes()).hexdigest()
        change["files"] = files
    _rewrite_manifest(destination, change)
    return destination


class UpdateRepo:
    """Keys and a repository in ``root``; bundles are made under ``root/bundles``."""

    def __init__(self, root: Path):
        self.root = root
        self.keys = root / "keys"
        self.directory = root / "repo"
        self.trusted_root = generate(self.keys)
        self.repository = Repository(self.directory, self.keys)

    def bundle(self, version: int, **kwargs: Any) -> Path:
        return versioned(self.root / "bundles" / f"v{version}", version, **kwargs)

    def publish(self, version: int, *, gates: Gates | None = None, audience: tuple[str, ...] | None = None,
                expires_days: float | None = None, **kwargs: Any) -> Published:  # fmt: skip
        return self.repository.publish(
            self.bundle(version, **kwargs), gates=gates, audience=audience, expires_days=expires_days
        )
