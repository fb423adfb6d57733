"""Reading and verifying bundles: sizes and hashes are checked before any model byte reaches a parser."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from edgeline.device_profiles.validation import describe_validation_error
from edgeline.errors import BundleError, IntegrityError
from edgeline.manifest import FileEntry, Manifest

__all__ = [
    "MANIFEST_FILE",
    "Bundle",
    "file_entries",
    "file_entry",
    "read_bundle",
    "write_manifest",
]

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Bundle:
    """A bundle directory whose manifest validated and whose files matched it when it was read."""

    path: Path
    manifest: Manifest

    @property
    def model_path(self) -> Path:
        return self.path / self.manifest.model

    def file(self, relative: str) -> Path:
        return self.path / relative


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(bundle_dir: Path, relative: str) -> FileEntry:
    """Describe one file of a bundle (used by export when it writes the manifest)."""
    path = bundle_dir / relative
    if path.is_dir():
        raise BundleError(f"{path}: a bundle file entry must be a file; list a directory's files one by one")
    return FileEntry(path=relative, size=path.stat().st_size, sha256=sha256_of(path))


def file_entries(bundle_dir: Path, relative: str) -> list[FileEntry]:
    """One entry for a file, or one per file inside a directory model (a Core ML ``.mlpackage``), in a stable order:
    the hashes then cover every byte a runtime will parse."""
    path = bundle_dir / relative
    if not path.is_dir():
        return [file_entry(bundle_dir, relative)]
    inside = sorted(p.relative_to(bundle_dir).as_posix() for p in path.rglob("*") if not p.is_dir())
    if not inside:
        raise BundleError(f"{path}: an empty directory cannot be a bundle's model")
    return [file_entry(bundle_dir, p) for p in inside]


def write_manifest(bundle_dir: Path, manifest: Manifest) -> Path:
    path = bundle_dir / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_manifest(bundle_dir: Path) -> Manifest:
    path = bundle_dir / MANIFEST_FILE
    if not path.is_file():
        raise BundleError(f"{bundle_dir}: not a bundle (no {MANIFEST_FILE})")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an integer of 4300+ digits, deep nesting
        raise BundleError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{path}: the manifest must be a JSON object")
    version = data.get("schema_version")
    if version != 1:
        raise BundleError(f"{path}: schema_version {version!r} is not supported by this runtime (supported: 1)")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise BundleError(describe_validation_error(exc, Manifest, f"{path}: invalid manifest")) from exc


def verify_files(bundle_dir: Path, manifest: Manifest) -> None:
    root = bundle_dir.resolve()
    for entry in manifest.files:
        try:
            _verify_file(bundle_dir, root, entry)
        except (OSError, ValueError, RuntimeError) as exc:  # a NUL or lone surrogate, a name too long, a symlink loop
            raise IntegrityError(f"{bundle_dir}: file {entry.path!r} cannot be checked: {exc}") from exc
    _verify_model_directory(bundle_dir, manifest)


def _verify_model_directory(bundle_dir: Path, manifest: Manifest) -> None:
    """A directory model (``.mlpackage``) must hold exactly the files the manifest lists: a file added to it would
    reach the runtime's parser unchecked."""
    model_dir = bundle_dir / manifest.model
    if not model_dir.is_dir() or model_dir.is_symlink():
        return
    listed = {entry.path for entry in manifest.files}
    for path in sorted(model_dir.rglob("*")):
        relative = path.relative_to(bundle_dir).as_posix()
        if path.is_symlink() or (not path.is_dir() and relative not in listed):
            raise IntegrityError(
                f"{bundle_dir}: {relative!r} is inside the model {manifest.model} but not listed in the manifest"
            )


def _verify_file(bundle_dir: Path, root: Path, entry: FileEntry) -> None:
    """Size and sha256 of one listed file, which must be inside the bundle (``root``, resolved)."""
    path = (bundle_dir / entry.path).resolve()
    if not path.is_relative_to(root):
        raise IntegrityError(f"{bundle_dir}: file {entry.path!r} points outside the bundle")
    if not path.is_file():
        raise IntegrityError(f"{bundle_dir}: file {entry.path!r} listed in the manifest is missing")
    size = path.stat().st_size
    if size != entry.size:
        raise IntegrityError(f"{bundle_dir}: file {entry.path!r} has {size} bytes, the manifest says {entry.size}")
    if sha256_of(path) != entry.sha256:
        raise IntegrityError(f"{bundle_dir}: file {entry.path!r} does not match its sha256 in the manifest")


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read a bundle directory, validate its manifest and verify every file it lists."""
    bundle_dir = Path(path)
    if not bundle_dir.exists():
        raise BundleError(f"{bundle_dir}: no such bundle")
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir}: a bundle is a directory holding {MANIFEST_FILE}")
    manifest = read_manifest(bundle_dir)
    verify_files(bundle_dir, manifest)
    return Bundle(path=bundle_dir, manifest=manifest)
