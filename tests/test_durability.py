"""The durability rules of ``docs/durability.md``, where the audit of issue 35 found them missing: each file that is
renamed into place is on the disk before its name is, and its directory is flushed after (``edgeline.durable``).

A power cut cannot be made in-process; what these tests hold is the order of the system calls that makes a cut
harmless, seen by wrapping ``os.fsync`` and ``os.replace``: every byte of an unpacked bundle is flushed before
``vN.partial`` becomes ``vN`` (which ``state.json`` may name right after), an archive before its name, python-tuf's
trusted metadata (the versions a device has seen: its protection against rollback) before and after its rename.
Before the audit none of the three flushed anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgeline.updates.archive import pack
from edgeline.updates.client import UpdateClient
from tests.test_updates_downloads import NAME, archive_of, offered
from tests.update_repo import UpdateRepo

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

Event = tuple[str, str]


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """("fsync", path) and ("replace", "source -> target"), in the order they happened, once the test asks."""
    events: list[Event] = []
    fsync, replace = os.fsync, os.replace

    def spied_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spied_replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        events.append(("replace", f"{os.path.realpath(source)} -> {os.path.realpath(target)}"))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", spied_fsync)
    monkeypatch.setattr(os, "replace", spied_replace)
    return events


def flushed(events: list[Event]) -> list[str]:
    return [path for kind, path in events if kind == "fsync"]


def at(events: list[Event], kind: str, path: str) -> int:
    """The index of the first event of ``kind`` on ``path`` (a replace: its source or its target)."""
    for index, (seen, subject) in enumerate(events):
        if seen == kind and (subject == path or path in subject.split(" -> ")):
            return index
    raise AssertionError(f"no {kind} of {path} in {events}")


@pytest.fixture
def repo(tmp_path: Path) -> UpdateRepo:
    made = UpdateRepo(tmp_path / "publisher")
    made.publish(2)
    return made


def test_an_unpacked_bundle_is_on_the_disk_before_its_name_is(
    repo: UpdateRepo, tmp_path: Path, syscalls: list[Event]
) -> None:
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    archive = client.fetch(updater, offer)
    bundles = (tmp_path / "device" / "bundles").resolve()
    bundles.mkdir()
    syscalls.clear()
    bundle = client.unpack(archive, offer, bundles / "v2")
    work, final = str(bundles / "v2.partial"), str(bundles / "v2")
    renamed = at(syscalls, "replace", final)
    files = [str(p).replace(final, work, 1) for p in sorted(bundle.path.rglob("*")) if p.is_file()]
    assert files and len(files) == len(bundle.manifest.files) + 1  # the listed files and manifest.json
    for path in [*files, work]:
        assert at(syscalls, "fsync", path) < renamed, f"{path} was not flushed before {work} became {final}"
    assert str(bundles) in flushed(syscalls[renamed:]), "the bundles directory was not flushed after the rename"


def test_a_packed_archive_is_on_the_disk_before_its_name_is(
    repo: UpdateRepo, tmp_path: Path, syscalls: list[Event]
) -> None:
    from edgeline import read_bundle

    destination = (tmp_path / "out").resolve() / "tiny-v2.tar"
    pack(read_bundle(repo.bundle(2)), destination)
    renamed = at(syscalls, "replace", str(destination))
    assert at(syscalls, "fsync", f"{destination}.tmp") < renamed
    assert str(destination.parent) in flushed(syscalls[renamed:])


def test_trusted_metadata_is_on_the_disk_before_and_after_its_rename(
    repo: UpdateRepo, tmp_path: Path, syscalls: list[Event]
) -> None:
    """Every metadata file python-tuf stores (the root chain, timestamp, snapshot, targets) goes through
    ``write_atomically``: python-tuf 7.0's ``_persist_file``, overridden by ``durable_updater``."""
    from tuf.ngclient import Updater

    assert callable(getattr(Updater, "_persist_file", None)), "python-tuf no longer stores metadata in _persist_file"
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    client.check(name=NAME, device="dev-1", running=1, refused=set())
    metadata = (tmp_path / "device" / "tuf").resolve()
    stored = sorted(str(p) for p in metadata.rglob("*.json") if p.is_file() and not p.is_symlink())
    names = {Path(p).relative_to(metadata).as_posix() for p in stored}
    assert {"timestamp.json", "snapshot.json", "targets.json", "root_history/1.root.json"} <= names, names
    for path in stored:
        renamed = at(syscalls, "replace", path)
        assert at(syscalls, "fsync", f"{path}.tmp") < renamed, f"{path} was renamed into place unflushed"
        assert str(Path(path).parent) in flushed(syscalls[renamed:]), f"{Path(path).parent} not flushed after"
    assert archive_of(repo, 2).exists()
