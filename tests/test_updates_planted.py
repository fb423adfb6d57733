"""Issue 48, the publisher's half: nothing the publisher and the keys write follows what someone else planted, no
command waits on a FIFO, private keys are their owner's alone, two writers never lose each other's change, and a
repository put back to an older state is never signed on from.

    planted     a link (to a sentinel outside) and, separately, a FIFO at every path each command writes, the list
                made by watching a clean run of that command (every name renamed into place, made, changed or removed,
                and the directories they are in), and the ``PATH.tmp`` beside each (the name the old writer opened):
                nothing outside is touched, no command waits, a plant where a file is written is refused by name,
                a stale temporary never blocks
    keys        a private key group or others may read or write, a keys directory they may write: refused, naming the
                file and the chmod that mends it (which then does); the issue's leaking rotation; Ed448, X25519,
                X448 and DSA keys: one line, no traceback
    lock        a publish and a rollout's revocation at once, in two processes: both are in the final metadata; a
                writer that cannot take the lock in time says who holds it
    high water  the issue's replay (an older ``timestamp.json`` put back, then routine refreshes) is refused, and
                taken up again once the newest metadata is restored
    remove      a target whose archive is lost blocks every write with a refusal that names ``publish --remove``,
                which removes it; a removed version is never published again

The directories the commands are given (the repository, the keys directory) are the operator's and are taken as
they resolve: plants go everywhere inside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edgeline.errors import EdgelineError, UpdateError
from edgeline.updates.policy import TargetFacts, target_path
from edgeline.updates.repository import Repository
from tests import test_updates_signing as signing
from tests.test_updates_publisher import device_view
from tests.test_updates_signing import NAME, RunCli, target_archive, user_error
from tests.update_repo import UpdateRepo, versioned

pytestmark = pytest.mark.device

repo = signing.repo
cli = signing.cli
no_passphrase = signing.no_passphrase

RUN_TIMEOUT_S = 20.0
FRESH_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")
"""The writer's own temporary names (``edgeline.durable.new_file``): random, so nothing can be planted there."""
SENTINEL = b"the operator's precious file\n"


def halt(facts: TargetFacts) -> TargetFacts:
    """What a rollout's halt signs (``Rollout._halt``)."""
    return facts.model_copy(update={"revoked": "wave 1: 1 of 1 devices failed"})


def error_lines(err: str, prog: str) -> str:
    return "\n".join(line.removeprefix(f"{prog}: error: ") for line in err.splitlines() if "error: " in line)


# ---------------------------------------------------------------------------------------------------------------------
# a world: keys, a repository with v2 offered and v3 held, a v4 bundle; restored before each run


@dataclass
class World:
    root: Path
    keys: Path
    repo: Path
    new_keys: Path
    v4: Path
    pristine: Path

    def restore(self) -> None:
        shutil.rmtree(self.root)
        shutil.copytree(self.pristine, self.root, symlinks=True)

    @property
    def roots(self) -> tuple[Path, ...]:
        """The directories the commands are given: the operator's."""
        return (self.root, self.keys, self.repo, self.new_keys)


@pytest.fixture
def world(tmp_path: Path) -> World:
    made = UpdateRepo(tmp_path / "world")
    made.publish(2)
    made.publish(3, audience=())
    v4 = versioned(tmp_path / "bundle-v4", 4)
    pristine = tmp_path / "pristine"
    shutil.copytree(made.root, pristine, symlinks=True)
    return World(made.root, made.keys, made.directory, made.root / "new-keys", v4, pristine)


Command = Callable[[World, RunCli], "tuple[int, str]"]
"""Runs one command that writes; returns its exit code and its error line(s) (empty when it succeeded)."""


def _cli(prog: str, argv: Callable[[World], list[str | Path]]) -> Command:
    def run(world: World, cli: RunCli) -> tuple[int, str]:
        code, _, err = cli(*argv(world))
        return code, error_lines(err, prog) if code else ""

    return run


def _rollout_halt(world: World, cli: RunCli) -> tuple[int, str]:
    """A rollout's revocation (its waves sign the same way): the rollout itself needs a broker to get there."""
    try:
        Repository(world.repo, world.keys).update_target(target_path(NAME, 3), halt)
    except EdgelineError as exc:
        return exc.exit_code, str(exc)
    return 0, ""


COMMANDS: dict[str, Command] = {
    "keys generate": _cli("edgeline keys generate", lambda w: ["keys", "generate", w.new_keys]),
    "keys generate --force": _cli("edgeline keys generate", lambda w: ["keys", "generate", w.keys, "--force"]),
    "keys renew --repo": _cli("edgeline keys renew", lambda w: ["keys", "renew", w.keys, "--repo", w.repo]),
    "keys rotate --repo": _cli(
        "edgeline keys rotate", lambda w: ["keys", "rotate", w.keys, "targets", "--repo", w.repo]
    ),
    "keys rotate root": _cli("edgeline keys rotate", lambda w: ["keys", "rotate", w.keys, "root"]),
    "publish": _cli("edgeline publish", lambda w: ["publish", w.v4, "--repo", w.repo, "--keys", w.keys]),
    "publish --refresh": _cli(
        "edgeline publish", lambda w: ["publish", "--refresh", "--repo", w.repo, "--keys", w.keys]
    ),
    "publish --remove": _cli(
        "edgeline publish", lambda w: ["publish", "--remove", NAME, "3", "--repo", w.repo, "--keys", w.keys]
    ),
    "rollout's halt": _rollout_halt,
}


def run_bounded(command: Command, world: World, cli: RunCli, fifos: list[Path]) -> tuple[int, str]:
    """``command`` in a thread, given ``RUN_TIMEOUT_S``: one that waits (on a FIFO) fails the test, once the FIFOs
    are opened from this side so that it can end."""
    result: list[tuple[int, str]] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(command(world, cli))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(RUN_TIMEOUT_S)
    if thread.is_alive():
        for fifo in fifos:  # a reader or a writer blocked in open() is let go
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"the command waited more than {RUN_TIMEOUT_S:g} s with FIFOs planted at {fifos}")
    if failure:
        raise failure[0]
    return result[0]


# ---------------------------------------------------------------------------------------------------------------------
# what a command writes, watched in a clean run


Tree = dict[str, tuple[int, int, int, int]]


def tree(root: Path) -> Tree:
    """Every name under ``root`` (links not followed): (inode, mtime, size, mode)."""
    found: Tree = {}
    if not root.exists():
        return found
    for directory, directories, files in os.walk(root):
        for name in [*directories, *files]:
            path = Path(directory, name)
            status = os.lstat(path)
            found[str(path)] = (status.st_ino, status.st_mtime_ns, status.st_size, status.st_mode)
    return found


@dataclass(frozen=True)
class Written:
    files: frozenset[Path]  # made, replaced or changed
    removed: frozenset[Path]  # only removed
    directories: frozenset[Path]  # the directories these are in, below the operator's


def watched(command: Command, world: World, cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> Written:
    """What ``command`` writes in a clean run: every name it changes, makes or removes (the tree before and after)
    and every name it renames to or from (a staged key renamed away leaves no trace in the tree)."""
    renamed: set[Path] = set()
    replace = os.replace

    def spied(source: Any, target: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        for name, fd in ((source, src_dir_fd), (target, dst_dir_fd)):
            base = os.readlink(f"/proc/self/fd/{fd}") if fd is not None else os.getcwd()
            renamed.add(Path(base, os.fspath(name)))
        replace(source, target, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    before = tree(world.root)
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", spied)
        code, message = command(world, cli)
    after = tree(world.root)
    assert code == 0, f"the clean run failed: {message}"
    changed = {Path(p) for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    changed |= {p for p in renamed if world.root in p.parents}
    changed = {p for p in changed if not FRESH_TEMPORARY.fullmatch(p.name) and p not in world.roots}
    was_directory = {Path(p) for p, status in {**before, **after}.items() if stat.S_ISDIR(status[3])}
    removed = {p for p in changed if p not in was_directory and str(p) in before and str(p) not in after}
    files = {p for p in changed if p not in was_directory} - removed
    directories = {
        parent
        for path in changed
        for parent in [path, *path.parents]
        if world.root in parent.parents and parent not in world.roots and (parent in was_directory or parent != path)
    }
    world.restore()
    return Written(frozenset(files), frozenset(removed), frozenset(directories))


# ---------------------------------------------------------------------------------------------------------------------
# planting


def outside_state(outside: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """Every name under ``outside`` (the sentinel, the copies of directories): bytes, mode, mtime."""
    state = {}
    for path in sorted(outside.rglob("*")):
        status = os.lstat(path)
        data = path.read_bytes() if stat.S_ISREG(status.st_mode) else None
        state[str(path)] = (data, status.st_mode, status.st_mtime_ns)
    return state


def plant(path: Path, kind: str, outside: Path) -> None:
    """A link to something outside (the sentinel; for a directory, a copy of it) or a FIFO at ``path``."""
    copy = None
    if path.is_dir() and not path.is_symlink():
        if kind == "link":
            copy = outside / f"copy-of-{path.name}-{len(list(outside.iterdir()))}"
            shutil.copytree(path, copy, symlinks=True)
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(copy if copy is not None else outside / "sentinel")


def names(message: str, path: Path) -> bool:
    """The refusal names ``path`` (or a path inside it, or it by name in its directory)."""
    return str(path) in message or (str(path.parent) in message and path.name in message)


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_nothing_a_command_writes_follows_or_waits_on_what_was_planted(
    cli: RunCli, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    command = COMMANDS[name]
    written = watched(command, world, cli, monkeypatch)
    assert written.files, f"{name} wrote nothing in its clean run"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_bytes(SENTINEL)
    (outside / "sentinel").chmod(0o644)

    def attempt(paths: list[Path]) -> tuple[int, str]:
        world.restore()
        if world.new_keys in {p.parent for p in paths}:
            world.new_keys.mkdir(mode=0o700, exist_ok=True)
        for path in paths:
            plant(path, kind, outside)
        before = outside_state(outside)
        fifos = [p for p in paths if kind == "fifo"]
        code, message = run_bounded(command, world, cli, fifos)
        assert outside_state(outside) == before, f"{name} changed what {paths} led to outside: {message}"
        assert (outside / "sentinel").read_bytes() == SENTINEL
        assert code in (0, 2), f"{name} with {kind}s at {paths}: exit {code}: {message}"
        return code, message

    for path in sorted(written.files | written.directories):
        code, message = attempt([path])
        assert code == 2, f"{name} wrote where a {kind} was planted, {path}"
        assert "\n" not in message and names(message, path), f"{name} with a {kind} at {path}: {message}"
    for path in sorted(written.removed):  # a name removed: a link or a FIFO there is removed, never followed
        code, message = attempt([path])
        assert code == 0 or names(message, path), message
    stale = sorted(p.with_name(p.name + ".tmp") for p in written.files | written.removed)
    code, message = attempt(stale)
    assert code == 0, f"{name} was stopped by stale temporaries ({kind}s at {stale}): {message}"
    assert all(os.path.lexists(p) for p in stale), "a stale temporary was opened or removed"


@pytest.mark.quick
def test_the_paths_planted_are_those_the_commands_write(
    cli: RunCli, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list the planting test works from, for the commands whose files the issue names: generated, and complete."""
    publish = watched(COMMANDS["publish"], world, cli, monkeypatch)
    metadata, keys = world.repo / "metadata", world.keys
    assert {
        metadata / "timestamp.json", metadata / "3.targets.json", metadata / "3.snapshot.json", metadata / "root.json",
        keys / "signed.json", keys / ".edgeline.lock", world.repo / ".edgeline.lock",
    } <= publish.files  # fmt: skip
    assert any(p.name.endswith(f".{NAME}-v4.tar") for p in publish.files), publish.files
    assert {metadata, world.repo / "targets", world.repo / "targets" / NAME} <= publish.directories
    rotate = watched(COMMANDS["keys rotate --repo"], world, cli, monkeypatch)
    assert {keys / "targets.key", keys / "targets.key.new", keys / "2.root.json", keys / "root.json"} <= rotate.files
    removal = watched(COMMANDS["publish --remove"], world, cli, monkeypatch)
    assert [p.name.endswith(f".{NAME}-v3.tar") for p in removal.removed] == [True], removal.removed


# ---------------------------------------------------------------------------------------------------------------------
# private keys are their owner's alone


@pytest.mark.quick
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o660, 0o602])
def test_a_private_key_others_may_read_or_write_is_refused_naming_the_chmod(
    cli: RunCli, repo: UpdateRepo, mode: int
) -> None:
    repo.publish(2)
    key = repo.keys / "targets.key"
    key.chmod(mode)
    before = (repo.directory / "metadata" / "timestamp.json").read_bytes()
    message = user_error(cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys), "edgeline publish")
    assert str(key) in message and f"`chmod 600 {key}`" in message, message
    assert (repo.directory / "metadata" / "timestamp.json").read_bytes() == before, "signed with an exposed key"
    chmod = re.search(r"`(chmod [^`]+)`", message)
    assert chmod is not None
    subprocess.run(shlex.split(chmod[1]), check=True, timeout=30)
    code, _, err = cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err


@pytest.mark.quick
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_keys_directory_others_may_write_is_refused_naming_the_chmod(
    cli: RunCli, repo: UpdateRepo, mode: int
) -> None:
    repo.publish(2)
    repo.keys.chmod(mode)
    for prog, argv in (
        ("edgeline publish", ["publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys]),
        ("edgeline keys rotate", ["keys", "rotate", repo.keys, "timestamp"]),
        ("edgeline keys renew", ["keys", "renew", repo.keys]),
    ):
        message = user_error(cli(*argv), prog)
        assert str(repo.keys) in message and f"`chmod go-w {repo.keys}`" in message, message
    chmod = re.search(r"`(chmod [^`]+)`", message)
    assert chmod is not None
    subprocess.run(shlex.split(chmod[1]), check=True, timeout=30)
    code, _, err = cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    repo.keys.chmod(0o1777)  # sticky and ours (as /tmp is root's): others cannot replace what is in it
    code, _, err = cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err


@pytest.mark.quick
def test_the_issues_rotation_never_leaks_the_new_key(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    """The report: ``keys rotate`` in a keys directory others can write wrote the new private key through a link
    planted at the temporary name, into a file anyone could read, and ``targets.key`` became a link to it."""
    leak = tmp_path / "leak"
    leak.write_bytes(b"")
    leak.chmod(0o666)
    (repo.keys / "targets.key.new.tmp").symlink_to(leak)
    repo.keys.chmod(0o777)
    message = user_error(cli("keys", "rotate", repo.keys, "targets"), "edgeline keys rotate")
    assert f"chmod go-w {repo.keys}" in message, message
    repo.keys.chmod(0o700)
    code, _, err = cli("keys", "rotate", repo.keys, "targets")
    assert code == 0, err
    key = repo.keys / "targets.key"
    assert leak.read_bytes() == b"", "the new private key was written through the planted link"
    assert not key.is_symlink() and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def _private_key(kind: str) -> Any:
    from cryptography.hazmat.primitives.asymmetric import dsa, ed448, x448, x25519

    return {
        "Ed448": ed448.Ed448PrivateKey.generate,
        "X25519": x25519.X25519PrivateKey.generate,
        "X448": x448.X448PrivateKey.generate,
        "DSA": lambda: dsa.generate_private_key(key_size=1024),
    }[kind]()


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["Ed448", "X25519", "X448", "DSA"])
def test_a_key_of_another_type_is_one_line_naming_the_file(cli: RunCli, repo: UpdateRepo, kind: str) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    repo.publish(2)
    key = repo.keys / "targets.key"
    key.write_bytes(_private_key(kind).private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    key.chmod(0o600)
    message = user_error(cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys), "edgeline publish")
    assert str(key) in message and kind in message and "ed25519" in message, message


# ---------------------------------------------------------------------------------------------------------------------
# one writer at a time

REVOKER = """
import sys, time
from pathlib import Path
from edgeline.updates.repository import Repository

repo, keys, inside = (Path(a) for a in sys.argv[1:4])
stamp = repo / "metadata" / "timestamp.json"
seen = stamp.read_bytes()

def halt(facts):
    inside.write_text("read")
    deadline = time.monotonic() + float(sys.argv[4])
    while time.monotonic() < deadline and stamp.read_bytes() == seen:  # until the other writer signed, or a while
        time.sleep(0.05)
    return facts.model_copy(update={"revoked": "wave 1: 1 of 1 devices failed"})

Repository(repo, keys).update_target("tiny/tiny-v3.tar", halt)
"""


def _process(argv: list[str | Path]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.integration
def test_a_publish_and_a_revocation_at_once_are_both_signed(repo: UpdateRepo, tmp_path: Path) -> None:
    """The report: a publish and a rollout's revocation running at the same time both wrote ``N.targets.json``, and
    the revocation was lost while the rollout said it was done. Here the revocation (a process of its own) holds its
    read state open until the publish (another process) signed, or 8 s passed: without the lock the publish signs
    in between and one of the two is lost; with it the publish waits, and both are signed."""
    repo.publish(2)
    repo.publish(3, audience=())
    inside = tmp_path / "revoker-has-read"
    revoker = _process(["-c", REVOKER, repo.directory, repo.keys, inside, "8"])
    publisher = None
    try:
        deadline = time.monotonic() + 60
        while not inside.exists():
            assert revoker.poll() is None, revoker.communicate()
            assert time.monotonic() < deadline, "the revocation never read the repository"
            time.sleep(0.05)
        v4 = versioned(tmp_path / "v4", 4)
        publisher = _process(["-m", "edgeline.cli", "publish", v4, "--repo", repo.directory, "--keys", repo.keys])
        published = publisher.communicate(timeout=120)
        revoked = revoker.communicate(timeout=120)
    finally:
        for process in (revoker, publisher):
            if process is not None and process.poll() is None:
                process.kill()
                process.communicate()
    assert revoker.returncode == 0, revoked
    assert publisher is not None and publisher.returncode == 0, published
    versions = Repository(repo.directory, repo.keys).versions(NAME)
    assert sorted(versions) == [2, 3, 4], "the publish was lost"
    assert versions[3].revoked is not None, "the revocation was lost"


HOLDER = """
import sys, time
from pathlib import Path
from edgeline.updates.lock import locked

with locked(Path(sys.argv[1]), what="the repository"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.quick
def test_a_writer_that_cannot_take_the_lock_says_who_holds_it(repo: UpdateRepo) -> None:
    repo.publish(2)
    holder = _process(["-c", HOLDER, repo.directory])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n", holder.stderr
        before = (repo.directory / "metadata" / "timestamp.json").read_bytes()
        started = time.monotonic()
        with pytest.raises(UpdateError) as caught:
            Repository(repo.directory, repo.keys, lock_wait_s=1.0).refresh()
        assert 1.0 <= time.monotonic() - started < 30
    finally:
        holder.kill()
        holder.communicate()
    message = str(caught.value)
    assert str(repo.directory / ".edgeline.lock") in message and f"pid {holder.pid}" in message, message
    assert socket.gethostname() in message and "waited 1 s" in message, message
    assert (repo.directory / "metadata" / "timestamp.json").read_bytes() == before
    Repository(repo.directory, repo.keys, lock_wait_s=1.0).refresh()  # the lock went with its process


# ---------------------------------------------------------------------------------------------------------------------
# the high-water mark


@pytest.mark.quick
def test_the_issues_replay_is_refused_and_signed_on_from_once_restored(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    """The report: an older ``timestamp.json`` put back, then two routine ``publish --refresh``, un-revoked a
    version. Every refresh is refused, naming the file and the record; restored, the repository is signed on."""
    repo.publish(2)
    repo.publish(3, audience=("dev-1",))
    stamp = repo.directory / "metadata" / "timestamp.json"
    older = stamp.read_bytes()
    repo.repository.update_target(target_path(NAME, 3), halt)  # the rollout halted: v3 revoked
    newest = stamp.read_bytes()
    assert device_view(repo, tmp_path / "device-0") == 2, "a device is not offered the revoked v3"

    stamp.write_bytes(older)  # put back: every file it names is still there, and signed
    for attempt in range(2):
        message = user_error(
            cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys), "edgeline publish"
        )
        assert str(stamp) in message and str(repo.keys / "signed.json") in message, message
        assert "older state was put back" in message, message
        assert stamp.read_bytes() == older, f"refresh {attempt + 1} signed"
    message = user_error(cli("publish", "--remove", NAME, "2", "--repo", repo.directory, "--keys", repo.keys),
                         "edgeline publish")  # fmt: skip
    assert str(stamp) in message, message

    stamp.write_bytes(newest)  # the operator restores the newest metadata
    code, _, err = cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    assert repo.repository.versions(NAME)[3].revoked is not None, "the revocation was taken back"
    assert device_view(repo, tmp_path / "device-1") == 2


@pytest.mark.quick
def test_a_repository_emptied_where_these_keys_signed_is_refused(cli: RunCli, repo: UpdateRepo) -> None:
    """Its ``timestamp.json`` removed, a repository reads as new: a publisher would start it again at version 1 and
    drop every target signed so far."""
    repo.publish(2)
    stamp = repo.directory / "metadata" / "timestamp.json"
    stamp.unlink()
    message = user_error(
        cli("publish", repo.bundle(3), "--repo", repo.directory, "--keys", repo.keys), "edgeline publish"
    )
    assert str(stamp) in message and "missing" in message and "signed.json" in message, message
    assert not stamp.exists()


# ---------------------------------------------------------------------------------------------------------------------
# removing a target


@pytest.mark.quick
def test_a_target_whose_archive_is_lost_is_removed_by_the_command_its_refusal_names(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    repo.publish(2)
    repo.publish(3)
    lost = target_archive(repo.directory, 2)
    lost.unlink()
    message = user_error(
        cli("publish", repo.bundle(4), "--repo", repo.directory, "--keys", repo.keys), "edgeline publish"
    )
    assert str(lost) in message, message
    named = re.search(r"`(edgeline publish --remove [^`]+)`", message)
    assert named is not None, message
    assert shlex.split(named[1])[3:5] == [NAME, "2"], named[1]

    code, out, err = cli(*shlex.split(named[1])[1:])
    assert code == 0, err
    assert f"removed {NAME} v2" in out and "already missing" in out, out
    assert sorted(repo.repository.versions(NAME)) == [3]
    code, _, err = cli("publish", repo.bundle(4), "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    assert device_view(repo, tmp_path / "device") == 4

    kept = target_archive(repo.directory, 4)
    code, out, err = cli("publish", "--remove", NAME, "4", "--repo", repo.directory, "--keys", repo.keys, "--json")
    assert code == 0, err
    assert json.loads(out)["archive_was_there"] is True and not kept.exists()
    message = user_error(
        cli("publish", repo.bundle(4), "--repo", repo.directory, "--keys", repo.keys), "edgeline publish"
    )
    assert "v4" in message and "removed since" in message and "--version 5" in message, message

    for argv, said in (
        (["--remove", NAME, "9"], "tiny v9 is not published (of tiny: v3)"),
        (["--remove", NAME, "two"], "VERSION is a whole number"),
        (["--remove", NAME, "3", "--refresh"], "--refresh cannot go with it"),
        ([repo.bundle(5), "--remove", NAME, "3"], "BUNDLE cannot go with it"),
    ):
        message = user_error(cli("publish", *argv, "--repo", repo.directory, "--keys", repo.keys), "edgeline publish")
        assert said in message, message
    assert sorted(repo.repository.versions(NAME)) == [3]
