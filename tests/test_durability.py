"""The durability rules of ``docs/durability.md``, where the audit of issue 35 found them missing: each file that is
renamed into place is on the disk before its name is, and its directory is flushed after (``edgeline.durable``).

A power cut cannot be made in-process; what these tests hold is the order of the system calls that makes a cut
harmless, seen by wrapping ``os.fsync`` and ``os.replace``: every byte of an unpacked bundle is flushed before
``vN.partial`` becomes ``vN`` (which ``state.json`` may name right after), an archive before its name, python-tuf's
trusted metadata (the versions a device has seen: its protection against rollback) before and after its rename.
Before the audit none of the three flushed anything.
"""

from __future__ import annotations

import contextlib
import os
import threading
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

    def named(path: str | os.PathLike[str], directory_fd: int | None) -> str:
        if directory_fd is None:
            return os.path.realpath(path)
        return os.path.join(os.readlink(f"/proc/self/fd/{directory_fd}"), os.fspath(path))

    def spied_replace(
        source: str | os.PathLike[str],
        target: str | os.PathLike[str],
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
    ) -> None:
        events.append(("replace", f"{named(source, src_dir_fd)} -> {named(target, dst_dir_fd)}"))
        replace(source, target, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "fsync", spied_fsync)
    monkeypatch.setattr(os, "replace", spied_replace)
    return events


def flushed(events: list[Event]) -> list[str]:
    return [path for kind, path in events if kind == "fsync"]


def renamed_from(events: list[Event], target: str) -> str:
    """The temporary file that was renamed to ``target`` (a fresh name each time: ``edgeline.durable``)."""
    for kind, subject in events:
        if kind == "replace" and subject.split(" -> ")[1] == target:
            return subject.split(" -> ")[0]
    raise AssertionError(f"nothing was renamed to {target} in {events}")


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
    temporary = renamed_from(syscalls, str(destination))
    assert Path(temporary).parent == destination.parent and temporary != f"{destination}.tmp"
    assert at(syscalls, "fsync", temporary) < renamed
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
        assert at(syscalls, "fsync", renamed_from(syscalls, path)) < renamed, f"{path} was renamed into place unflushed"
        assert str(Path(path).parent) in flushed(syscalls[renamed:]), f"{Path(path).parent} not flushed after"
    assert archive_of(repo, 2).exists()


# ---------------------------------------------------------------------------------------------------------------------
# the one writer never follows what was planted (issue 48)


@pytest.mark.parametrize(
    "planted", ["link-at-destination", "fifo-at-destination", "directory-at-destination", "linked-directory"]
)
def test_the_writer_refuses_a_destination_it_did_not_make(tmp_path: Path, planted: str) -> None:
    from edgeline.durable import WriteRefused, write_atomically

    sentinel = tmp_path / "outside" / "sentinel"
    sentinel.parent.mkdir()
    sentinel.write_bytes(b"precious")
    directory = tmp_path / "repo" / "metadata"
    directory.parent.mkdir()
    if planted == "linked-directory":
        directory.symlink_to(sentinel.parent, target_is_directory=True)
        refused = directory
    else:
        directory.mkdir()
        refused = directory / "timestamp.json"
        if planted == "link-at-destination":
            refused.symlink_to(sentinel)
        elif planted == "fifo-at-destination":
            os.mkfifo(refused)
        else:
            refused.mkdir()
    with pytest.raises(WriteRefused) as caught:
        write_atomically(directory / "timestamp.json", b"new")
    assert str(refused) in str(caught.value), caught.value
    assert sentinel.read_bytes() == b"precious" and sorted(sentinel.parent.iterdir()) == [sentinel]
    if planted != "linked-directory":
        assert sorted(p.name for p in directory.iterdir()) == ["timestamp.json"], "a temporary was left behind"


@pytest.mark.parametrize("stale", ["link", "fifo", "file"])
def test_a_stale_temporary_is_never_opened_and_never_blocks(tmp_path: Path, stale: str) -> None:
    from edgeline.durable import write_atomically

    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"precious")
    destination = tmp_path / "root.json"
    old = tmp_path / "root.json.tmp"  # the name the writer opened with O_TRUNC before issue 48
    if stale == "link":
        old.symlink_to(sentinel)
    elif stale == "fifo":
        os.mkfifo(old)
    else:
        old.write_bytes(b"cut short")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (write_atomically(destination, b"new"), done.set()), daemon=True)
    worker.start()
    worker.join(20)
    if not done.is_set():
        with contextlib.suppress(OSError):
            os.close(os.open(old, os.O_RDWR | os.O_NONBLOCK))
        pytest.fail(f"write_atomically waited on the FIFO {old}")
    assert destination.read_bytes() == b"new" and sentinel.read_bytes() == b"precious"
    assert os.path.lexists(old)
