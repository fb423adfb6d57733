"""The outbox deleted or truncated under a running daemon (an operator's ``rm``, a cleaning script, a failing card).

Before: SQLite went on writing into the unlinked inode (or into a file whose pages a truncation removed), its
commits "succeeded", the inputs were acknowledged to the broker, and after a crash the restarted daemon opened a new,
empty file: the answers were gone, and nothing had been logged. Now the outbox compares the files it has open with
the files at its path before and after every commit that acknowledges inputs, and once a second
(``edgeline.daemon.outbox_files``); when they differ it says so once, writes every answer it still holds into a new
outbox at the path, and only then acknowledges again.

The integration tests hold the answers in the outbox the way an unreachable broker would: the daemon talks to the
broker through ``AnswerWithholdingProxy``, which passes every packet but the PUBLISH of an answer (its inputs'
PUBACKs included, counted). Then the outbox is tampered with, more inputs come and are acknowledged, the daemon is
SIGKILLed, and a second daemon on the same state directory, straight to the broker, must deliver an answer to every
input the first one acknowledged. The quick tests hold the same on the ``Outbox`` class itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

import edgeline
from edgeline.daemon.outbox import Outbox, OutboxLost
from edgeline.daemon.outbox_files import FilesWatch
from tests import waiting
from tests.faults import DurableCollector, DurablePublisher, can_mount
from tests.mqtt_broker import HOST, Broker
from tests.test_daemon_durability import DaemonProcess, inputs, missing_answers, report

TIMEOUT_S = 120.0
HALF = 1500
"""Inputs before the tampering, and as many after it."""
KEEPALIVE_S = 600
"""The first daemon's keepalive: its stall detector (no PUBACK for 3 keepalives) must not reconnect during the test
(a reconnection would have the broker send unacknowledged inputs again, and the PUBACK count would mean less)."""

wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)


# -- a broker that never takes the answers ---------------------------------------------------------------------


class AnswerWithholdingProxy:
    """A loopback TCP proxy in front of ``broker`` that drops every PUBLISH from the client whose topic starts with
    ``withheld`` (the daemon's answers never reach the broker, never get a PUBACK, and stay in the outbox) and passes
    everything else both ways. It counts the PUBACKs the client sent (the inputs it acknowledged).

    One connection at a time is enough (the daemon's); two threads per connection, blocking sockets, ended by
    ``close()`` shutting the sockets down. Client-to-broker bytes are cut into MQTT packets (a fixed header and its
    remaining length); a stream that is not MQTT ends the link."""

    def __init__(self, broker: Broker, withheld: str) -> None:
        self.target = (broker.host, broker.port)
        self.withheld = withheld.encode()
        self.host = HOST
        self._lock = threading.Lock()
        self.pubacks = 0
        self.withheld_publishes = 0
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._listener = socket.create_server((self.host, 0), backlog=4)
        self._listener.settimeout(0.1)  # the accept loop looks at close() ten times a second
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def acknowledged(self) -> int:
        with self._lock:
            return self.pubacks

    def close(self) -> None:
        self._closed.set()
        self._acceptor.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pumps = [
                threading.Thread(target=self._from_client, args=(client, upstream), daemon=True),
                threading.Thread(target=self._copy, args=(upstream, client), daemon=True),
            ]
            with self._lock:
                self._sockets += [client, upstream]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _copy(self, source: socket.socket, sink: socket.socket) -> None:
        while data := _recv(source):
            try:
                sink.sendall(data)
            except OSError:
                break
        _hang_up(source, sink)

    def _from_client(self, source: socket.socket, sink: socket.socket) -> None:
        pending = bytearray()
        while data := _recv(source):
            pending += data
            try:
                packets = _cut_packets(pending)
            except ValueError:
                break
            out = bytearray()
            for packet, body_at in packets:
                kind = packet[0] >> 4
                if kind == 3:  # PUBLISH: topic length (2 bytes) and topic first in its variable header
                    length = int.from_bytes(packet[body_at : body_at + 2], "big")
                    if packet[body_at + 2 : body_at + 2 + length].startswith(self.withheld):
                        with self._lock:
                            self.withheld_publishes += 1
                        continue
                elif kind == 4:  # PUBACK: an input acknowledged
                    with self._lock:
                        self.pubacks += 1
                out += packet
            try:
                sink.sendall(out)
            except OSError:
                break
        _hang_up(source, sink)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _hang_up(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _cut_packets(pending: bytearray) -> list[tuple[bytes, int]]:
    """Take the whole MQTT packets off the front of ``pending``: (packet, where its variable header starts)."""
    packets = []
    while len(pending) >= 2:
        length, multiplier, at = 0, 1, 1
        while True:
            if at >= len(pending):
                return packets
            byte = pending[at]
            length += (byte & 0x7F) * multiplier
            at += 1
            if not byte & 0x80:
                break
            if at > 4:
                raise ValueError("not MQTT: a remaining length of more than four bytes")
            multiplier *= 128
        if len(pending) < at + length:
            return packets
        packets.append((bytes(pending[: at + length]), at))
        del pending[: at + length]
    return packets


# -- the daemon, its outbox tampered with ---------------------------------------------------------------------


def delete(outbox: Path) -> None:
    """What ``rm STATE/NAME/outbox.sqlite*`` does."""
    for suffix in ("", "-wal"):
        Path(f"{outbox}{suffix}").unlink()


def truncate(outbox: Path) -> None:
    """What ``truncate -s 0 outbox.sqlite`` and ``truncate -s 50% outbox.sqlite-wal`` do (a cleaning script; a card
    that lost the end of its files)."""
    os.truncate(outbox, 0)
    wal = Path(f"{outbox}-wal")
    os.truncate(wal, wal.stat().st_size // 2)


@contextlib.contextmanager
def stopped(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """The daemon frozen (SIGSTOP, every thread seen stopped) while the block runs, then SIGCONT: a tampering of two
    files is one change to it, however busy the machine (it would otherwise see the first file go and mend it, then
    see its new log go too)."""
    process.send_signal(signal.SIGSTOP)
    try:
        tasks = Path(f"/proc/{process.pid}/task")
        assert wait_until(lambda: all(_state(task) in ("T", "t", "") for task in tasks.iterdir())), "not stopped"
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def _state(task: Path) -> str:
    """A thread's state letter (``T``: stopped), or "" once it is gone."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def tamper_said(daemon: DaemonProcess, outbox: Path) -> list[str]:
    """The daemon's ERROR lines about its outbox's files."""
    return [line for line in daemon.log_text().splitlines() if " ERROR " in line and f"outbox {outbox}" in line]


@pytest.mark.integration
@pytest.mark.parametrize("tamper", [delete, truncate], ids=["deleted", "truncated"])
def test_an_outbox_tampered_with_under_the_daemon_loses_no_acknowledged_answer(
    tamper: Callable[[Path], None], built_litert_bundle: Path, durable_broker: Broker,
    answers: DurableCollector, publisher: DurablePublisher, unique_topic: str, tmp_path: Path,
) -> None:  # fmt: skip
    name = edgeline.read_bundle(built_litert_bundle).manifest.name
    state = tmp_path / "state"
    outbox = state / name / "outbox.sqlite"
    messages = inputs(f"{unique_topic}/sensors/cam/image", 2 * HALF)
    proxy = AnswerWithholdingProxy(durable_broker, withheld=f"{unique_topic}/results/")
    first = DaemonProcess(
        built_litert_bundle, proxy.address, unique_topic, state, f"[broker]\nkeepalive_s = {KEEPALIVE_S}\n"
    )
    second = DaemonProcess(built_litert_bundle, durable_broker.address, unique_topic, state)
    try:
        first.start(durable_broker)
        publisher.publish_all(messages[:HALF])
        assert wait_until(lambda: proxy.acknowledged() >= HALF), f"{proxy.acknowledged()}: {first.log_text()[-3000:]}"
        assert first.process is not None
        with stopped(first.process):
            tamper(outbox)
        publisher.publish_all(messages[HALF:])
        # every input the first daemon acknowledged is one whose answer it must still deliver
        assert wait_until(lambda: proxy.acknowledged() >= 2 * HALF), (
            f"{proxy.acknowledged()} acknowledged: {first.log_text()[-3000:]}"
        )
        assert proxy.acknowledged() == 2 * HALF, "an input was acknowledged twice: the PUBACKs count for less"
        assert answers.payloads == [], "an answer got through the proxy"
        first.kill()
        said = tamper_said(first, outbox)
        second.start(durable_broker)
        missing = missing_answers(answers, {f"m{i}" for i in range(2 * HALF)})
        assert not missing, (
            f"{len(missing)} acknowledged inputs never answered ({report(answers, 2 * HALF)}):\n"
            f"{first.log_text()[-3000:]}"
        )
        assert len(said) == 1, f"said {len(said)} times:\n{first.log_text()[-3000:]}"
        assert "Traceback" not in first.log_text() + second.log_text()
        print(f"{report(answers, 2 * HALF)}; the first daemon said: {said[0]}")
    finally:
        first.kill()
        second.kill()
        proxy.close()


@contextlib.contextmanager
def read_only_over(directory: Path) -> Iterator[None]:
    """An empty read-only file system mounted over ``directory`` at once (what a card that went read-only, or a
    state directory replaced under the daemon, leaves it): no answer can be written there any more. Root only."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=False, timeout=30)


@pytest.mark.integration
def test_an_outbox_that_cannot_be_made_again_ends_the_daemon_and_acknowledges_nothing_more(
    built_litert_bundle: Path, durable_broker: Broker, answers: DurableCollector, publisher: DurablePublisher,
    unique_topic: str, tmp_path: Path,
) -> None:  # fmt: skip
    """The outbox's files gone and the state directory unwritable: the daemon says so, exits 1 (systemd starts it
    again) without acknowledging the inputs it could not store, and the next start answers them."""
    if not can_mount("tmpfs"):
        pytest.skip("mounting a tmpfs needs root and mount(8): CI has them")
    name = edgeline.read_bundle(built_litert_bundle).manifest.name
    state = tmp_path / "state"
    messages = inputs(f"{unique_topic}/sensors/cam/image", 10)
    first = DaemonProcess(built_litert_bundle, durable_broker.address, unique_topic, state)
    second = DaemonProcess(built_litert_bundle, durable_broker.address, unique_topic, state)
    try:
        first.start(durable_broker)
        publisher.publish_all(messages[:5])
        assert not missing_answers(answers, {f"m{i}" for i in range(5)}), first.log_text()[-3000:]
        with read_only_over(state / name):
            publisher.publish_all(messages[5:])
            assert first.process is not None
            process = first.process
            assert wait_until(lambda: process.poll() is not None or len(answers.id_counts()) > 5)
            assert process.poll() == 1, f"{answers.id_counts()}\n{first.log_text()[-3000:]}"
        said = tamper_said(first, state / name / "outbox.sqlite")
        # what happened, then why the daemon stopped
        assert len(said) == 2 and "stopped: " in said[1], first.log_text()[-3000:]
        assert "no new outbox could be made there" in said[1], first.log_text()[-3000:]
        assert "Traceback" not in first.log_text(), first.log_text()[-3000:]
        second.start(durable_broker)
        missing = missing_answers(answers, {f"m{i}" for i in range(10)})
        assert not missing, f"{sorted(missing)} never answered:\n{second.log_text()[-3000:]}"
    finally:
        first.kill()
        second.kill()


# -- the Outbox class itself ------------------------------------------------------------------------------------


def rows(count: int, start: int = 0) -> list[tuple[str, bytes, float]]:
    return [(f"results/d{i}", f"answer {i}".encode() * 20, 0.0) for i in range(start, start + count)]


def stored(path: Path) -> list[bytes]:
    """The payloads a restart finds at ``path``: what a new process would open (this one's outbox closed first)."""
    box = Outbox(path)
    try:
        return [pending.payload for pending in box.take(100_000)]
    finally:
        box.close()


def replace(path: Path) -> None:
    """Another file moved over the outbox (a restored copy, an editor's save)."""
    other = path.with_name("other")
    other.write_bytes(b"not the outbox")
    other.replace(path)


def overwrite_start(path: Path) -> None:
    """Zeros over the first page, the file's size kept (a card that lost a block)."""
    with open(path, "r+b") as file:
        file.write(bytes(4096))


TAMPERINGS: dict[str, Callable[[Path], None]] = {
    "deleted": lambda path: Path(path).unlink(),
    "log deleted": lambda path: Path(f"{path}-wal").unlink(),
    "both deleted": delete,
    "truncated to nothing": lambda path: os.truncate(path, 0),
    "truncated to half": lambda path: os.truncate(path, os.stat(path).st_size // 2),
    "header overwritten": lambda path: overwrite_start(path),
    "log truncated to nothing": lambda path: os.truncate(f"{path}-wal", 0),
    "log truncated to half": lambda path: os.truncate(f"{path}-wal", os.stat(f"{path}-wal").st_size // 2),
    "replaced": replace,
}


@pytest.mark.quick
@pytest.mark.parametrize("how", sorted(TAMPERINGS))
def test_the_outbox_notices_its_files_changed_says_so_once_and_keeps_every_answer(
    how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state" / "outbox.sqlite"
    box = Outbox(path)
    try:
        kept = box.add(rows(300))
        box.remove([pending.seq for pending in kept[:100]])  # delivered: these must not come back
        box.check(truncate=True)  # the answers in the database file, the log empty: both kinds of truncation
        box.add(rows(100, start=300))  # ... and some in the log again
        with caplog.at_level(logging.INFO, logger="edgeline.outbox"):
            TAMPERINGS[how](path)
            added = box.add(rows(100, start=400))
            box.add(rows(50, start=500))
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and str(path) in errors[0], errors
        assert box.stats().replaced == 1
        assert [p.seq for p in added] == list(range(added[0].seq, added[0].seq + 100))
        assert added[0].seq == 401  # seqs go on from where they were: the delivery path's read-back relies on it
        assert box.depth == 450
    finally:
        box.close()
    assert stored(path) == [payload for _, payload, _ in rows(450, start=100)]


@pytest.mark.quick
def test_an_idle_outbox_notices_at_its_check(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No commit comes (the stream paused): the once-a-second ``check`` rewrites the answers at the path. The
    outbox opened over a log whose header a power cut tore (SQLite ignores it, and starts the log over at its first
    write): that is not taken for tampering, only the deletion is said."""
    path = tmp_path / "outbox.sqlite"
    box = Outbox(path)
    box.add(rows(10))
    box.close()
    Path(f"{path}-wal").write_bytes(bytes(range(256)) * 40)
    with caplog.at_level(logging.INFO, logger="edgeline.outbox"):
        box = Outbox(path)
        try:
            box.check()
            box.add(rows(10, start=10))
            box.check()
            delete(path)
            box.check()
            box.check()
            assert path.exists()
        finally:
            box.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "its database file was deleted" in errors[0], errors
    assert stored(path) == [payload for _, payload, _ in rows(20)]


@pytest.mark.quick
def test_a_truncation_past_what_sqlite_holds_in_memory_keeps_what_reads_back_whole_and_counts_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A backlog bigger than SQLite's page cache (2 MB by default; made small here) loses to a truncation the pages
    only the file held: the answers read back whole are kept, each exactly as it was, the others are said, counted."""
    path = tmp_path / "outbox.sqlite"
    box = Outbox(path)
    sent = [(f"results/d{i}", random.Random(i).randbytes(700), 1.0) for i in range(2000)]
    try:
        box._db.execute("PRAGMA cache_size=1")  # the backlog is past the cache
        box.add(sent)
        box.check(truncate=True)  # every answer in the database file, none in the log
        os.truncate(path, path.stat().st_size // 3)
        with caplog.at_level(logging.INFO, logger="edgeline.outbox"):
            box.add(rows(5, start=2000))
    finally:
        box.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and "could not be read back" in errors[1], errors
    kept = Outbox(path)
    try:
        back = kept.take(100_000)
    finally:
        kept.close()
    whole = [(p.topic, p.payload) for p in back if p.seq <= len(sent)]
    lost = int(re.search(r"; (\d+) more could not be read back", errors[1])[1])  # type: ignore[index]
    assert 0 < len(whole) < len(sent) and len(whole) + lost == len(sent), (len(whole), lost)
    assert all((p.topic, p.payload) == sent[p.seq - 1][:2] for p in back if p.seq <= len(sent))  # none spoiled
    assert [p.payload for p in back if p.seq > len(sent)] == [payload for _, payload, _ in rows(5, start=2000)]


@pytest.mark.quick
def test_an_outbox_that_cannot_be_made_again_is_lost_by_name(tmp_path: Path) -> None:
    """The state directory removed and a file in its place: no new outbox can be made there; the outbox refuses
    every call from then on, naming the path (the daemon exits non-zero on it: ``Delivery``)."""
    directory = tmp_path / "state"
    path = directory / "outbox.sqlite"
    box = Outbox(path)
    try:
        box.add(rows(5))
        delete(path)
        directory.rmdir()
        directory.write_text("a file where the state directory was")
        with pytest.raises(OutboxLost, match=str(path)) as lost:
            box.add(rows(5, start=5))
        assert "5 answers" in str(lost.value)
        with pytest.raises(OutboxLost):
            box.take(10)
    finally:
        box.close()


# -- the look itself (edgeline.daemon.outbox_files) ---------------------------------------------------------------


def connection(path: Path) -> sqlite3.Connection:
    """SQLite as the outbox opens it, with a log that SQLite checkpoints and starts over often."""
    db = sqlite3.connect(str(path), isolation_level=None)
    for pragma in ("locking_mode=EXCLUSIVE", "journal_mode=WAL", "wal_autocheckpoint=16", "journal_size_limit=65536"):
        db.execute(f"PRAGMA {pragma}")
    db.execute("CREATE TABLE IF NOT EXISTS answers (seq INTEGER PRIMARY KEY AUTOINCREMENT, payload BLOB)")
    return db


@pytest.mark.quick
def test_what_sqlite_does_to_its_own_files_is_never_taken_for_tampering(tmp_path: Path) -> None:
    """Commits of every size, automatic checkpoints (the log starts over in place, older frames behind the new),
    deletions, TRUNCATE checkpoints: the look after each says nothing (a false alarm would remake the outbox)."""
    path = tmp_path / "outbox.sqlite"
    db = connection(path)
    watch = FilesWatch(path, Path(f"{path}-wal"))
    rng = random.Random(7)
    try:
        for turn in range(400):
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO answers (payload) VALUES (?)", [(rng.randbytes(300),)] * rng.randint(1, 40))
            if turn % 3 == 0:
                db.execute("DELETE FROM answers WHERE seq IN (SELECT seq FROM answers ORDER BY seq LIMIT 30)")
            db.execute("COMMIT")
            if turn % 97 == 0:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                watch.emptied()
            assert watch.changed() is None, f"turn {turn}"
    finally:
        db.close()
        watch.close()


@pytest.mark.quick
def test_a_log_truncated_then_written_past_is_found_although_its_size_came_back(tmp_path: Path) -> None:
    """The race a look before the commit cannot see: the log cut in half while a commit runs, that commit writing
    its frames where the log ended (the file is as long as before; a restart would stop at the hole)."""
    path = tmp_path / "outbox.sqlite"
    db = connection(path)
    db.execute("PRAGMA wal_autocheckpoint=0")  # one generation of the log throughout
    wal = Path(f"{path}-wal")
    watch = FilesWatch(path, wal)
    try:
        for _ in range(10):
            db.execute("INSERT INTO answers (payload) VALUES (?)", (b"x" * 3000,))
        assert watch.changed() is None
        before = wal.stat().st_size
        os.truncate(wal, before // 2)
        db.execute("INSERT INTO answers (payload) VALUES (?)", (b"y" * 3000,))
        assert wal.stat().st_size >= before
        problem = watch.changed()
        assert problem is not None and "lost frames" in problem, problem
    finally:
        db.close()
        watch.close()
