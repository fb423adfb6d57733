"""No download hangs the update thread and no archive fills the disk (``edgeline.updates.fetchers``, the signed
unpacked size, ``archive.unpack``'s budget).

    deadline      a real HTTP server on 127.0.0.1 that trickles a byte every 0.5 s (the archive's body, or the
                  response's headers) is given up at ``download_timeout_s``: refusal ``timeout``, said once, the
                  checks go on, and the update is taken once the server serves
    byte limit    a target longer than signed (announced, or streamed without end) is refused at once and not
                  downloaded again for the same signed target; new signed metadata for the version is tried
    local files   a FIFO or a link to /dev/zero in a repository directory is refused unread (a link to a regular
                  file is followed)
    spooling      python-tuf's temporary files land in the state directory (``$TMPDIR`` is never used); a full disk
                  while downloading or unpacking is ``no-room``
    unpacking     a signed archive with a sparse member (GNU's or pax's), or more bytes, files or directories than its
                  signed unpacked size, is refused before anything is written
    room          10,000 one-byte files: the room check counts the signed unpacked size and a block for each file
    settings      ``[updates] download_timeout_s`` and ``run --download-timeout-s``
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edgeline.bundle import read_bundle
from edgeline.daemon.config import DaemonConfig, load_config
from edgeline.errors import EdgelineError, UpdateError, UpdateRefused
from edgeline.model import Model, load
from edgeline.updates import archive
from edgeline.updates.agent import UpdateAgent
from edgeline.updates.client import UpdateClient
from edgeline.updates.policy import ENTRY_BYTES, Room, disk_needed, room_refusal, target_path
from edgeline.updates.store import Store
from edgeline.updates.swap import Swap
from tests.test_daemon_backpressure import fill, small_disk
from tests.update_repo import UpdateRepo, refused

pytestmark = [pytest.mark.quick, pytest.mark.device]
__all__ = ["small_disk"]  # the 4 MB tmpfs fixture (root only)

NAME = "tiny"
MB = 1 << 20
DEADLINE_S = 2.0
BYTE_EVERY_S = 0.5


@pytest.fixture
def repo(tmp_path: Path) -> UpdateRepo:
    return UpdateRepo(tmp_path / "publisher")


def offered(client: UpdateClient, running: int = 1) -> tuple[Any, Any]:
    """(updater, offer) of the version the repository offers a device running ``running``."""
    choice, updater = client.check(name=NAME, device="dev-1", running=running, refused=set())
    assert choice.take is not None, choice
    return updater, client.offer(updater, choice.take)


def archive_of(repo: UpdateRepo, version: int) -> Path:
    found = sorted((repo.directory / "targets" / NAME).glob(f"*.{NAME}-v{version}.tar"))
    assert len(found) == 1, found
    return found[0]


def sign_archive(repo: UpdateRepo, version: int, tar: Path, **facts: Any) -> None:
    """Sign ``tar`` as ``version``'s target, with the facts already published (``facts``: some changed): what a
    holder of the targets key can ship (``edgeline publish`` packs its own archives). Uses the repository's own
    signing step."""
    from tuf.api.metadata import TargetFile

    path = target_path(NAME, version)
    info = TargetFile.from_file(path, str(tar), ["sha256"])
    published = repo.repository.versions(NAME)[version]
    info.unrecognized_fields["custom"] = published.model_copy(update=facts).as_custom()
    shutil.copyfile(tar, repo.directory / "targets" / NAME / f"{info.hashes['sha256']}.{NAME}-v{version}.tar")

    def replace(targets: Any) -> None:
        targets.targets[path] = info

    repo.repository._sign(repo.repository._current(), replace, None)


# ---------------------------------------------------------------------------------------------------------------------
# a repository served over HTTP on 127.0.0.1, well or badly


class _Server(http.server.ThreadingHTTPServer):
    mode = "serve"
    slow = "/targets/"  # the paths the mode applies to
    stopping: threading.Event
    gets: Counter[str]


class _Handler(http.server.SimpleHTTPRequestHandler):
    """HTTP/1.1, connections kept alive (as a gateway's nginx serves; ``test_updates_signing`` serves HTTP/1.0)."""

    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        server.gets[self.path] += 1
        if server.mode == "serve" or not self.path.startswith(server.slow):
            super().do_GET()
            return
        with contextlib.suppress(OSError):  # the device gave up and closed the connection
            getattr(self, f"_{server.mode.replace('-', '_')}")(server.stopping)

    def _trickle(self, stopping: threading.Event) -> None:
        """The file's bytes, its length announced, one every ``BYTE_EVERY_S``."""
        data = Path(self.translate_path(self.path)).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        for byte in data:
            if stopping.wait(BYTE_EVERY_S):
                return
            self.wfile.write(bytes([byte]))

    def _trickle_headers(self, stopping: threading.Event) -> None:
        """A status line, then a header that never ends, a byte every ``BYTE_EVERY_S``."""
        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stopping.wait(BYTE_EVERY_S):
            self.wfile.write(b"a")

    def _endless(self, stopping: threading.Event) -> None:
        """Zeros without end, no length announced."""
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        while not stopping.is_set():
            self.wfile.write(bytes(1 << 16))

    def _announced_huge(self, stopping: threading.Event) -> None:
        """A terabyte announced, zeros sent."""
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 40))
        self.end_headers()
        while not stopping.is_set():
            self.wfile.write(bytes(1 << 16))


@pytest.fixture
def served(repo: UpdateRepo) -> Iterator[tuple[str, _Server]]:
    server = _Server(("127.0.0.1", 0), functools.partial(_Handler, directory=str(repo.directory)))
    server.stopping = threading.Event()
    server.gets = Counter()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.stopping.set()  # every trickle ends within BYTE_EVERY_S
        server.shutdown()
        server.server_close()
        thread.join(10)


class Processor:
    """The worker's side of a swap (``edgeline.updates.swap.Worker``): the model that answers and its shadow."""

    def __init__(self, model: Model):
        self.model = model
        self.shadow: object = None


def agent_for(repo: UpdateRepo, client: UpdateClient, store: Store, **kwargs: Any) -> tuple[UpdateAgent, Processor]:
    running = load(repo.bundle(1))
    agent = UpdateAgent(
        client=client, store=store, state=store.load(), running=running, running_bundle=repo.root / "bundles" / "v1",
        device="dev-1", interval_s=3600.0, backend=None, max_batch=1, **kwargs,
    )  # fmt: skip
    processor = Processor(running)
    agent.swap = Swap(agent, processor)
    return agent, processor


# ---------------------------------------------------------------------------------------------------------------------
# the deadline


def test_a_trickling_server_is_given_up_at_the_deadline_and_the_update_taken_once_it_serves(
    repo: UpdateRepo, served: tuple[str, _Server], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's server: the archive a byte at a time (here every 0.5 s, 40 hours for its 20 KB). Each check ends
    at the deadline with one ``timeout`` refusal, said once and counted each time; the running version is not
    touched; once the server serves, the next check takes the update."""
    url, server = served
    repo.publish(2)
    server.mode = "trickle"
    store = Store(tmp_path / "state" / "updates")
    client = UpdateClient(url, repo.trusted_root, store.directory, download_timeout_s=DEADLINE_S)
    agent, processor = agent_for(repo, client, store)
    caplog.set_level(logging.INFO, logger="edgeline.updates")

    for check in (1, 2):
        agent.check_once()  # bounded by the test's timeout (its tier's), not timed here
        assert agent.counts["checks"] == check
        assert agent.refusals["timeout"] == check
        refusal = agent.last_refusal
        assert refusal is not None and refusal.reason == "timeout" and refusal.version == 2, refusal
        assert f"within {DEADLINE_S:g} s (download_timeout_s)" in refusal.message, refusal.message
    said = [r.getMessage() for r in caplog.records if "update refused (timeout)" in r.getMessage()]
    assert len(said) == 1, said
    assert agent.state.refused == {}, "a timeout is no verdict on the version"
    assert processor.model.version == 1 and not agent.swap.busy.is_set()
    assert not [p for p in client.downloads.iterdir() if p.is_file()], "a given-up download was kept"

    server.mode = "serve"
    agent.check_once()
    assert agent.counts["checks"] == 3 and agent.swap.busy.is_set(), agent.last
    agent.swap.poll()  # the worker, between two batches: the new version answers from now on
    assert processor.model.version == 2


def test_a_server_that_trickles_its_headers_is_given_up_at_the_deadline_too(
    repo: UpdateRepo, served: tuple[str, _Server], tmp_path: Path
) -> None:
    """The deadline bounds every read of the socket, the response's headers as much as its body."""
    url, server = served
    repo.publish(2)
    server.mode, server.slow = "trickle-headers", "/metadata/timestamp.json"
    client = UpdateClient(url, repo.trusted_root, tmp_path / "device", download_timeout_s=DEADLINE_S)
    error = refused("timeout", client.check, name=NAME, device="dev-1", running=1)
    assert "timestamp.json: not downloaded whole within 2 s" in str(error), error
    assert error.version is None


# ---------------------------------------------------------------------------------------------------------------------
# the byte limit


def test_a_target_announced_longer_than_signed_is_not_read_and_not_held_against_the_target(
    repo: UpdateRepo, served: tuple[str, _Server], tmp_path: Path
) -> None:
    """A server (or proxy) announcing a terabyte: not a byte read, and no verdict on the signed target (a transport
    fault): the same target served right at the next check is taken."""
    url, server = served
    repo.publish(2)
    server.mode = "announced-huge"
    client = UpdateClient(url, repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    with pytest.raises(UpdateError) as caught:
        client.fetch(updater, offer)
    assert not isinstance(caught.value, UpdateRefused), caught.value
    assert f"announces {1 << 40} bytes, more than the {offer.info.length} signed" in str(caught.value)
    server.mode = "serve"
    updater, offer = offered(client)
    bundle = client.unpack(client.fetch(updater, offer), offer, tmp_path / "unpacked")
    assert bundle.manifest.version == 2


def test_a_signed_archive_whose_manifest_names_another_version_is_refused_against_that_version(
    repo: UpdateRepo, tmp_path: Path
) -> None:
    """Intact and signed, yet not the version its metadata says: ``malformed``, which the agent remembers (it was
    ``tampered``, unpacked again at every check)."""
    other = UpdateRepo(tmp_path / "other")
    other.publish(3)
    v3 = archive_of(other, 3)
    repo.publish(2)  # v3's archive signed as v2, its facts naming v3's manifest: a consistent lie
    sign_archive(repo, 2, v3, manifest_sha256=other.repository.versions(NAME)[3].manifest_sha256)
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    error = refused("malformed", client.unpack, client.fetch(updater, offer), offer, tmp_path / "unpacked")
    assert error.version == 2 and "its manifest says tiny v3" in str(error), error
    from edgeline.updates.agent import PERSISTED_REASONS

    assert error.reason in PERSISTED_REASONS


def test_a_target_longer_than_signed_is_refused_at_once_and_not_downloaded_again(
    repo: UpdateRepo, served: tuple[str, _Server], tmp_path: Path
) -> None:
    """A server streaming without end: refused ``tampered`` after at most a chunk past the signed length, and not
    asked again while the signed target stays the same (the issue: 5-9 MB at every check). New signed metadata for
    the version (another archive) is tried."""
    url, server = served
    repo.publish(2)
    server.mode = "endless"
    client = UpdateClient(url, repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    first = refused("tampered", client.fetch, updater, offer)
    assert first.version == 2 and f"more than {offer.info.length} bytes" in str(first), first
    target_gets = lambda: sum(n for path, n in server.gets.items() if path.startswith("/targets/"))  # noqa: E731
    assert target_gets() == 1

    server.mode = "serve"  # the same signed target, served: still not fetched again (the refusal is remembered)
    updater, offer = offered(client)
    again = refused("tampered", client.fetch, updater, offer)
    assert str(again) == str(first) and target_gets() == 1

    padded = tmp_path / "padded.tar"  # the same bundle, another archive: a valid tar with a block more at its end
    padded.write_bytes(archive_of(repo, 2).read_bytes() + bytes(512))
    sign_archive(repo, 2, padded)
    updater, offer = offered(client)
    bundle = client.unpack(client.fetch(updater, offer), offer, tmp_path / "unpacked")
    assert bundle.manifest.version == 2 and target_gets() == 2


def test_a_target_cut_short_is_tried_again_at_the_next_check(repo: UpdateRepo, tmp_path: Path) -> None:
    """A copy still under way (shorter than signed) is not remembered: the next check downloads it again."""
    repo.publish(2)
    path = archive_of(repo, 2)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    refused("tampered", client.fetch, *offered(client))
    path.write_bytes(whole)
    updater, offer = offered(client)
    assert client.unpack(client.fetch(updater, offer), offer, tmp_path / "unpacked").manifest.version == 2


# ---------------------------------------------------------------------------------------------------------------------
# local repositories: regular files only


def _ends(call: Callable[[], Any], seconds: float = 30.0) -> BaseException | None:
    """Run ``call`` in a thread; fail unless it ends within ``seconds``; return what it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the check did not end within {seconds:g} s"
    return outcome[0]


@pytest.mark.parametrize(("make", "kind"), [("fifo", "a FIFO"), ("dev-zero", "a character device")])
def test_a_fifo_or_a_device_in_a_local_repository_is_refused_unread(
    repo: UpdateRepo, tmp_path: Path, make: str, kind: str
) -> None:
    """The issue: a FIFO ``timestamp.json`` blocked ``open()`` for ever; a link to /dev/zero was read, then said to
    be "nothing published there yet"."""
    repo.publish(2)
    stamp = repo.directory / "metadata" / "timestamp.json"
    stamp.unlink()
    if make == "fifo":
        os.mkfifo(stamp)
    else:
        stamp.symlink_to("/dev/zero")
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    try:
        error = _ends(lambda: client.check(name=NAME, device="dev-1", running=1))
    finally:
        if make == "fifo":  # a reader stuck in open() (the unfixed code) is let go: a writer opens and closes
            with contextlib.suppress(OSError):  # ENXIO: no reader waits
                os.close(os.open(stamp, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(error, UpdateError) and not isinstance(error, UpdateRefused), repr(error)
    assert f"timestamp.json is {kind}, not a regular file" in str(error), error
    assert "nothing published" not in str(error)


def test_a_link_to_a_regular_file_is_followed(repo: UpdateRepo, tmp_path: Path) -> None:
    """A repository assembled with symbolic links (say, targets kept elsewhere on the stick) reads as any other:
    what a link gives is checked against the signed metadata all the same."""
    repo.publish(2)
    path = archive_of(repo, 2)
    kept = tmp_path / "elsewhere.tar"
    path.rename(kept)
    path.symlink_to(kept)
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    assert client.unpack(client.fetch(updater, offer), offer, tmp_path / "unpacked").manifest.version == 2


# ---------------------------------------------------------------------------------------------------------------------
# where downloads land, and a full disk


@pytest.mark.parametrize("transport", ["http", "directory"])
def test_python_tufs_temporary_files_are_in_the_state_directory_not_tmpdir(
    repo: UpdateRepo, served: tuple[str, _Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """``$TMPDIR`` (``tempfile.tempdir``) points nowhere: the downloads work all the same, so they spool in the state
    directory, on the disk the room check measures, and leave nothing behind there."""
    repo.publish(2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmpdir"))
    where = served[0] if transport == "http" else str(repo.directory)
    client = UpdateClient(where, repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    archive_path = client.fetch(updater, offer)
    assert client.unpack(archive_path, offer, tmp_path / "unpacked").manifest.version == 2
    assert sorted(p.name for p in client.downloads.iterdir()) == [archive_path.name]


def test_a_full_disk_while_downloading_or_unpacking_is_no_room(
    repo: UpdateRepo, small_disk: Path, tmp_path: Path
) -> None:
    """A disk that fills between the room check and the download (the outbox grew meanwhile): ``no-room``, tried
    again at the next check, not "the repository cannot be read"."""
    repo.publish(2)
    client = UpdateClient(str(repo.directory), repo.trusted_root, small_disk / "updates")
    updater, offer = offered(client)
    (small_disk / "filler").touch()
    fill(small_disk / "filler")
    error = refused("no-room", client.fetch, updater, offer)
    assert error.version == 2 and "No space left on device" in str(error), error

    error = refused("no-room", client.unpack, archive_of(repo, 2), offer, small_disk / "bundles" / "v2")
    assert error.version == 2 and "tried again at the next check" in str(error), error
    assert not (small_disk / "bundles" / "v2.partial").exists()


# ---------------------------------------------------------------------------------------------------------------------
# unpacking within the signed size


def _octal(value: int) -> bytes:
    return b"%011o\0" % value


def _block(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def sparse_archive(path: Path, parts: dict[str, bytes], sparse: str, size: int, kind: str) -> Path:
    """A tar of ``parts`` (manifest first) in which member ``sparse`` is a sparse file of ``size`` zeros stored in
    512 bytes: GNU's old format (type ``S``, which ``tarfile`` reads but cannot write) or pax's (0.1)."""
    stored = bytes(512)
    if kind == "pax":
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in parts.items():
                info = tarfile.TarInfo(name)
                info.size = len(stored if name == sparse else data)
                if name == sparse:
                    info.pax_headers = {"GNU.sparse.map": f"0,{len(stored)}", "GNU.sparse.size": str(size)}
                tar.addfile(info, io.BytesIO(stored if name == sparse else data))
        return path
    blocks = []
    for name, data in parts.items():
        info = tarfile.TarInfo(name)
        info.size = len(stored if name == sparse else data)
        info.mode = 0o644
        if name != sparse:
            blocks += [info.tobuf(tarfile.GNU_FORMAT), _block(data)]
            continue
        info.type = tarfile.GNUTYPE_SPARSE
        header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
        header[386:398], header[398:410] = _octal(0), _octal(len(stored))  # one map entry: (offset, numbytes)
        header[483:495] = _octal(size)  # the real size
        header[148:156] = b" " * 8
        header[148:155] = b"%06o\0" % sum(header)
        blocks += [bytes(header), stored]
    path.write_bytes(b"".join(blocks) + bytes(1024))
    return path


def sparse_bundle(repo: UpdateRepo, size: int) -> tuple[Path, dict[str, bytes]]:
    """v2 whose model is ``size`` zeros (a sparse file here: nothing big is written), and its parts."""
    bundle = repo.bundle(2)
    with (bundle / "model.tflite").open("wb") as model:
        model.truncate(size)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "model.tflite":
            entry["size"], entry["sha256"] = size, hashlib.sha256(bytes(size)).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    parts = {name: (bundle / name).read_bytes() for name in ("manifest.json", "golden.npz")}
    return bundle, {"manifest.json": parts["manifest.json"], "model.tflite": b"", "golden.npz": parts["golden.npz"]}


@pytest.mark.parametrize("kind", ["gnu", "pax"])
def test_a_sparse_member_is_refused_before_it_is_written(repo: UpdateRepo, tmp_path: Path, kind: str) -> None:
    """tarfile expands a sparse member to its full size on reading: 512 stored bytes became 8 MiB here (the issue:
    30 KB became 257 MiB). Every size matches the manifest, so only the kind of member tells."""
    size = 8 * MB
    bundle, parts = sparse_bundle(repo, size)
    tar = sparse_archive(tmp_path / f"{kind}.tar", parts, "model.tflite", size, kind)
    with tarfile.open(tar) as opened:  # the archive is what it claims: a sparse member of the full size
        member = opened.getmember("model.tflite")
        assert member.issparse() and member.size == size and tar.stat().st_size < 64 * 1024
    destination = tmp_path / "out" / "v2"
    error = refused("malformed", archive.unpack, tar, destination, manifest_sha=archive.manifest_sha256(bundle))
    assert "'model.tflite' is sparse" in str(error), error
    assert not destination.exists() and not destination.with_name("v2.partial").exists()


def test_a_signed_archive_with_a_sparse_member_writes_nothing(
    repo: UpdateRepo, small_disk: Path, tmp_path: Path
) -> None:
    """The issue's archive, signed in a repository: fetched (a few KB, its signature good), refused ``malformed``
    as it is unpacked, before a byte of its 16 MiB is written: it would not fit the 4 MB disk it unpacks to."""
    size = 16 * MB
    _, parts = sparse_bundle(repo, size)
    repo.repository.publish(repo.root / "bundles" / "v2")
    sign_archive(repo, 2, sparse_archive(tmp_path / "sparse.tar", parts, "model.tflite", size, "gnu"))
    client = UpdateClient(str(repo.directory), repo.trusted_root, tmp_path / "device")
    updater, offer = offered(client)
    assert offer.facts.unpacked_bytes is not None and offer.facts.unpacked_bytes > size
    fetched = client.fetch(updater, offer)
    assert fetched.stat().st_size < 64 * 1024
    error = refused("malformed", client.unpack, fetched, offer, small_disk / "v2")
    assert error.version == 2 and "is sparse" in str(error), error
    assert shutil.disk_usage(small_disk).used < 64 * 1024, "bytes were written before the refusal"


@pytest.mark.parametrize("beyond", ["bytes", "entries"])
def test_an_archive_holding_more_than_its_signed_unpacked_size_is_refused(
    repo: UpdateRepo, tmp_path: Path, beyond: str
) -> None:
    published = repo.publish(2)
    unpacked_bytes, unpacked_entries = published.facts.unpacked_bytes, published.facts.unpacked_entries
    assert (unpacked_bytes, unpacked_entries) == archive.unpacked_size(read_bundle(repo.root / "bundles" / "v2"))
    assert unpacked_bytes is not None and unpacked_entries is not None
    signed = {"bytes": (unpacked_bytes - 1, unpacked_entries), "entries": (unpacked_bytes, unpacked_entries - 1)}
    destination = tmp_path / "out" / "v2"
    error = refused(
        "malformed", archive.unpack, published.archive, destination, manifest_sha=published.facts.manifest_sha256,
        unpacked_bytes=signed[beyond][0], unpacked_entries=signed[beyond][1],
    )  # fmt: skip
    assert "its signed metadata says it unpacks to" in str(error), error
    assert not destination.exists() and not destination.with_name("v2.partial").exists()
    bundle = archive.unpack(published.archive, destination, manifest_sha=published.facts.manifest_sha256,
                            unpacked_bytes=unpacked_bytes, unpacked_entries=unpacked_entries)  # fmt: skip
    assert bundle.manifest.version == 2


# ---------------------------------------------------------------------------------------------------------------------
# the room: 10,000 one-byte files

FILES = 10_000


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[UpdateRepo, Any]:
    """A repository with v2: 10,000 listed one-byte files besides its model (the issue: an 11.3 MB archive, 41 MB
    unpacked). Made once for the module: the tests only read it."""
    repo = UpdateRepo(tmp_path_factory.mktemp("many-files"))
    bundle = repo.bundle(2)
    entry = {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    names = [f"{n:04d}" for n in range(FILES)]
    for name in names:
        (bundle / name).write_bytes(b"x")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"] += [{"path": name, **entry} for name in names]
    (bundle / "manifest.json").write_text(json.dumps(manifest, separators=(",", ":")))
    return repo, repo.repository.publish(bundle)


def test_the_room_check_counts_the_signed_unpacked_size_and_a_block_a_file(
    many_files: tuple[UpdateRepo, Any],
) -> None:
    facts, length = many_files[1].facts, many_files[1].length
    assert facts.unpacked_entries == FILES + 3  # and the manifest, the model, the golden samples
    assert 10 * MB < length < 12 * MB and facts.unpacked_bytes < 2 * MB
    needed = disk_needed(facts, length)
    assert needed == length + facts.unpacked_bytes + facts.unpacked_entries * ENTRY_BYTES
    assert needed > 2 * (2 * length), needed  # 50.8 MiB; twice the length (the budget before) is 21.5 MiB
    reserve = 64 * MB
    assert (
        room_refusal(facts, length, Room(free_bytes=needed + reserve, reserve_bytes=reserve, available_mb=None)) is None
    )
    problem = room_refusal(
        facts, length, Room(free_bytes=needed + reserve - 1, reserve_bytes=reserve, available_mb=None)
    )
    assert problem is not None and f"in {FILES + 3} files and directories" in problem, problem

    unsigned = facts.model_copy(update={"unpacked_bytes": None, "unpacked_entries": None})
    assert disk_needed(unsigned, length) == 2 * length  # published before: the budget it had
    problem = room_refusal(unsigned, length, Room(free_bytes=2 * length - 1, reserve_bytes=0, available_mb=None))
    assert problem is not None and "unpacked size not signed" in problem, problem


def test_the_device_refuses_the_many_files_for_room_before_downloading(
    many_files: tuple[UpdateRepo, Any], tmp_path: Path
) -> None:
    """The disk keeps 35 MiB free beside the outbox's room: twice the archive (21.5 MiB) would fit, the unpacked
    files (a block each: 50.8 MiB in all) do not: ``no-room``, and nothing downloaded."""
    repo, published = many_files
    store = Store(tmp_path / "state" / "updates")
    store.directory.mkdir(parents=True)
    client = UpdateClient(str(repo.directory), repo.trusted_root, store.directory)
    assert 2 * published.length < 35 * MB < disk_needed(published.facts, published.length)
    agent, _ = agent_for(repo, client, store, reserve_bytes=lambda: shutil.disk_usage(store.directory).free - 35 * MB)
    agent.check_once()
    refusal = agent.last_refusal
    assert refusal is not None and refusal.reason == "no-room" and refusal.version == 2, refusal
    assert "files and directories" in refusal.message, refusal.message
    assert not [p for p in client.downloads.iterdir() if p.is_file()]


# ---------------------------------------------------------------------------------------------------------------------
# settings


def test_download_timeout_s_is_set_by_the_file_or_the_flag_and_must_be_positive(tmp_path: Path) -> None:
    from edgeline.daemon.assembly import _update_plan

    assert DaemonConfig().updates.download_timeout_s == 600.0
    path = tmp_path / "daemon.toml"
    path.write_text('[updates]\nrepository = "/media/usb/repo"\ntrusted_root = "root.json"\ndownload_timeout_s = 90\n')
    config = load_config(path)
    assert config.updates.download_timeout_s == 90.0
    flagged = config.with_overrides(download_timeout_s=5)
    assert flagged.updates.download_timeout_s == 5.0
    for bad in (0, -1):
        with pytest.raises(EdgelineError, match=r"updates\.download_timeout_s"):
            config.with_overrides(download_timeout_s=bad)
    repo = UpdateRepo(tmp_path / "publisher")
    config = flagged.with_overrides(updates=str(repo.directory), trusted_root=repo.trusted_root)
    store = Store(tmp_path / "state")
    plan = _update_plan(config, store, store.load(), repo.bundle(1), None)
    assert plan.client.fetcher.timeout_s == 5.0


def test_the_run_flag_is_refused_when_not_positive(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from edgeline.cli import main

    repo = UpdateRepo(tmp_path / "publisher")
    argv = ["run", repo.bundle(1), "--updates", repo.directory, "--trusted-root", repo.trusted_root]
    code = main([str(arg) for arg in [*argv, "--download-timeout-s", "0", "--state-dir", tmp_path / "state"]])
    err = capsys.readouterr().err
    assert code == 2 and "updates.download_timeout_s: input should be greater than 0" in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------------------
# proxies (as python-tuf's own fetcher honoured them)


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A forwarding HTTP proxy: it is asked for whole URLs and fetches them (never through a proxy itself)."""

    seen: list[str]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.seen.append(self.path)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.path, timeout=10) as response:
                status, body = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("bypass", [False, True])
def test_an_http_proxy_from_the_environment_is_used_unless_no_proxy_names_the_host(
    repo: UpdateRepo, served: tuple[str, _Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bypass: bool
) -> None:
    repo.publish(2)
    seen: list[str] = []
    handler = type("Proxy", (_Proxy,), {"seen": seen})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    for variable in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.server_address[1]}")
    if bypass:
        monkeypatch.setenv("no_proxy", "127.0.0.1")
    try:
        client = UpdateClient(served[0], repo.trusted_root, tmp_path / "device")
        updater, offer = offered(client)
        assert client.unpack(client.fetch(updater, offer), offer, tmp_path / "unpacked").manifest.version == 2
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(10)
    if bypass:
        assert seen == []
    else:
        assert f"{served[0]}/metadata/timestamp.json" in seen and any("/targets/tiny/" in url for url in seen), seen


@pytest.mark.parametrize("plant", ["link-to-directory", "dangling-link", "fifo"])
def test_a_link_planted_where_a_bundle_unpacks_is_removed_never_followed(
    repo: UpdateRepo, tmp_path: Path, plant: str
) -> None:
    published = repo.publish(2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep me")
    destination = tmp_path / "state" / "bundles" / "v2"
    destination.parent.mkdir(parents=True)
    partial = destination.with_name("v2.partial")
    if plant == "link-to-directory":
        partial.symlink_to(outside)
    elif plant == "dangling-link":
        partial.symlink_to(tmp_path / "nowhere")
    else:
        os.mkfifo(partial)
    bundle = archive.unpack(published.archive, destination, manifest_sha=published.facts.manifest_sha256)
    assert bundle.manifest.version == 2 and not partial.exists() and not partial.is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"] and not (tmp_path / "nowhere").exists()
