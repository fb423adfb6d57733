"""The publisher's rule (issue 33): every command that writes a repository first reads it as a device would, against
the keys it holds, and refuses, naming the file, whatever those keys did not sign. It never signs what it did not
write.

    forgeries       an unsigned entry added to the served targets metadata (a real v9 archive where a device would
                    fetch it), a hash changed in the signed metadata, a signed target's archive deleted, a
                    2.root.json planted (signed by another root key)
    every command   publish, publish --refresh, rollout (refused before it offers anything; its waves and its halt
                    sign through ``update_target``, refused too), keys renew --repo, keys rotate --repo: one error
                    line naming the file, exit 2, not a byte of the repository or the keys changed, and a device's
                    view the same as before (never the forged v9)
    root files      a root planted in the keys directory is refused by name, never renewed or copied
    new             a metadata directory of someone else's files is refused; a first publish cut short is carried on
    reproduction    the report's own steps: a forged v9 entry, the routine ``publish --refresh``, the device

Forgeries are made for real: JSON edited on disk, archives packed, an attacker's keys made by ``edgeline.updates.keys``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from edgeline.bundle import read_bundle
from edgeline.errors import UpdateError, UpdateRefused
from edgeline.updates import archive
from edgeline.updates.client import UpdateClient
from edgeline.updates.keys import generate, new_root
from edgeline.updates.lock import LOCK_FILE
from edgeline.updates.policy import TargetFacts, target_path
from tests import test_updates_signing as signing
from tests.test_updates_signing import NAME, RunCli, newest_targets_metadata, target_archive, user_error
from tests.update_repo import UpdateRepo

pytestmark = [pytest.mark.quick, pytest.mark.device]

# the fixtures of tests/test_updates_signing.py: the keys and repository, the command line, no passphrase
repo = signing.repo
cli = signing.cli
no_passphrase = signing.no_passphrase

Forgery = Callable[[UpdateRepo, Path], Path]
"""Forges something in the repository (``work`` for scratch files); returns the file the refusal must name."""


def _packed(repo: UpdateRepo, version: int, work: Path) -> Path:
    """A real archive of a bundle of ``version``, packed as ``edgeline publish`` packs one."""
    return archive.pack(read_bundle(repo.bundle(version)), work / f"v{version}.tar")


def _edit_targets(repo: UpdateRepo, edit: Callable[[dict[str, dict[str, object]]], None]) -> Path:
    """Edit the served targets metadata's entries in place, its signatures left as they were."""
    path = newest_targets_metadata(repo.directory)
    metadata = json.loads(path.read_text())
    edit(metadata["signed"]["targets"])
    path.write_text(json.dumps(metadata, indent=1))
    return path


def forge_entry(repo: UpdateRepo, work: Path) -> Path:
    """The attack of the report: an unsigned tiny-v9 entry, offered to every device, its archive where one fetches
    it."""
    from tuf.api.metadata import TargetFile

    packed = _packed(repo, 9, work)
    info = TargetFile.from_file(target_path(NAME, 9), str(packed), ["sha256"])
    v2 = repo.repository.versions(NAME)[2]
    manifest_sha = hashlib.sha256((repo.root / "bundles" / "v9" / "manifest.json").read_bytes()).hexdigest()
    facts = v2.model_copy(update={"version": 9, "manifest_sha256": manifest_sha})
    info.unrecognized_fields["custom"] = facts.as_custom()
    shutil.move(packed, repo.directory / "targets" / info.get_prefixed_paths()[0])
    return _edit_targets(repo, lambda targets: targets.update({info.path: info.to_dict()}))


def forge_hash(repo: UpdateRepo, work: Path) -> Path:
    """The signed v2 entry made to name another archive (a v9 bundle's) by its length and sha256."""
    data = _packed(repo, 9, work).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    (repo.directory / "targets" / NAME / f"{sha256}.{NAME}-v2.tar").write_bytes(data)

    def swap(targets: dict[str, dict[str, object]]) -> None:
        targets[target_path(NAME, 2)].update(length=len(data), hashes={"sha256": sha256})

    return _edit_targets(repo, swap)


def delete_target(repo: UpdateRepo, work: Path) -> Path:
    path = target_archive(repo.directory, 2)
    path.unlink()
    return path


def plant_root(repo: UpdateRepo, work: Path) -> Path:
    """A 2.root.json signed by an attacker's root key, made by the same tools."""
    attacker = work / "attacker-keys"
    generate(attacker)
    new_root(attacker)
    planted = repo.directory / "metadata" / "2.root.json"
    shutil.copyfile(attacker / "2.root.json", planted)
    return planted


FORGERIES: dict[str, Forgery] = {
    "forged-entry": forge_entry,
    "forged-hash": forge_hash,
    "deleted-target": delete_target,
    "planted-root": plant_root,
}


def contents(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes; not the lock file, which every writer takes
    (and says who it is in) before it reads anything."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def device_view(repo: UpdateRepo, work: Path, trusted_root: Path | None = None) -> int | str | None:
    """What a fresh device running v1 makes of the repository: the version it would take, or its refusal."""
    client = UpdateClient(str(repo.directory), trusted_root or repo.trusted_root, work)
    try:
        choice, _ = client.check(name=NAME, device="dev-1", running=1, refused=set())
    except UpdateRefused as exc:
        return exc.reason
    return choice.take.version if choice.take is not None else None


def published(repo: UpdateRepo) -> None:
    """v2 offered to every device, v3 held for a rollout."""
    repo.publish(2)
    repo.publish(3, audience=())


def command(name: str, repo: UpdateRepo, work: Path) -> tuple[str, list[str | Path]]:
    """The program name and the command line of each command that writes the repository."""
    where: list[str | Path] = ["--repo", repo.directory]
    if name == "publish":
        return "edgeline publish", ["publish", repo.bundle(4), *where, "--keys", repo.keys]
    if name == "publish --refresh":
        return "edgeline publish", ["publish", "--refresh", *where, "--keys", repo.keys]
    if name == "rollout":
        fleet = work / "fleet.toml"  # a broker nobody listens for: the refusal comes before any connection
        fleet.write_text('name = "tiny"\n[broker]\nhost = "127.0.0.1"\nport = 9\n[[device]]\nid = "dev-1"\n')
        return "edgeline rollout", ["rollout", NAME, "3", *where, "--keys", repo.keys, "--fleet", fleet]
    if name == "keys renew --repo":
        return "edgeline keys renew", ["keys", "renew", repo.keys, *where]
    assert name == "keys rotate --repo"
    return "edgeline keys rotate", ["keys", "rotate", repo.keys, "targets", *where]


COMMANDS = ["publish", "publish --refresh", "rollout", "keys renew --repo", "keys rotate --repo"]


# ---------------------------------------------------------------------------------------------------------------------
# every command that writes, every forgery


@pytest.mark.parametrize("forgery", list(FORGERIES))
@pytest.mark.parametrize("name", COMMANDS)
def test_a_command_that_writes_refuses_what_its_keys_did_not_sign(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path, name: str, forgery: str
) -> None:
    published(repo)
    work = tmp_path / "work"
    work.mkdir()
    named = FORGERIES[forgery](repo, work)
    prog, argv = command(name, repo, work)
    view = device_view(repo, tmp_path / "device-before")
    assert view != 9
    repository, keys = contents(repo.directory), contents(repo.keys)

    message = user_error(cli(*argv), prog)
    assert str(named) in message, message
    assert contents(repo.directory) == repository, "a refused command changed the repository"
    assert contents(repo.keys) == keys, "a refused command changed the keys"
    assert device_view(repo, tmp_path / "device-after") == view, "a device sees another repository"


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_the_rollouts_waves_and_halt_refuse_to_sign_a_forged_repository(
    repo: UpdateRepo, tmp_path: Path, forgery: str
) -> None:
    """What each wave (a wider audience) and a halt (a revocation) sign goes through ``update_target``: a repository
    forged while a rollout runs is refused at its next step."""
    published(repo)
    named = FORGERIES[forgery](repo, tmp_path)
    before = contents(repo.directory)

    def widen(facts: TargetFacts) -> TargetFacts:
        return facts.model_copy(update={"audience": ("dev-1",)})

    def halt(facts: TargetFacts) -> TargetFacts:
        return facts.model_copy(update={"revoked": "wave 1: 1 of 1 devices failed"})

    for step in (widen, halt):
        with pytest.raises(UpdateError) as caught:
            repo.repository.update_target(target_path(NAME, 3), step)
        assert str(named) in str(caught.value), caught.value
    assert contents(repo.directory) == before


def test_the_reproduction_a_forged_entry_is_never_signed_by_a_routine_refresh(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    """Issue 33's steps: a v9 entry added to the served targets metadata is ignored by devices, until the operator's
    routine ``publish --refresh`` signed it and devices took v9. Now the refresh refuses; the operator restores the
    signed file, the refresh signs what it wrote, and v9 is never offered."""
    code, _, err = cli("publish", repo.bundle(2), "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    signed = newest_targets_metadata(repo.directory)
    trusted_copy = signed.read_bytes()
    assert device_view(repo, tmp_path / "device-0") == 2
    forged = forge_entry(repo, tmp_path)
    assert forged == signed and target_path(NAME, 9) in json.loads(forged.read_text())["signed"]["targets"]
    assert device_view(repo, tmp_path / "device-1") == "bad-signature", "devices ignore the forged metadata"

    message = user_error(cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys), "edgeline publish")
    assert str(forged) in message and "not signed by the targets key" in message, message
    assert device_view(repo, tmp_path / "device-2") == "bad-signature", "the device was offered what was forged"

    forged.write_bytes(trusted_copy)  # the operator restores the file it signed
    code, _, err = cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    assert "left alone and never signed" in err and f"{NAME}-v9.tar" in err, err  # the stray archive is said
    assert (
        target_path(NAME, 9) not in json.loads(newest_targets_metadata(repo.directory).read_text())["signed"]["targets"]
    )
    assert device_view(repo, tmp_path / "device-3") == 2, "the device takes what was published, and only that"


# ---------------------------------------------------------------------------------------------------------------------
# root files on disk are verified before they are kept or copied


@pytest.mark.parametrize("where", ["beside-root.json", "over-root.json"])
def test_a_root_planted_in_the_keys_directory_is_refused_by_name(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path, where: str
) -> None:
    repo.publish(2)
    pinned = tmp_path / "pinned-root.json"  # what devices were provisioned with
    shutil.copyfile(repo.trusted_root, pinned)
    attacker = tmp_path / "attacker-keys"
    generate(attacker)
    new_root(attacker)
    planted = repo.keys / "2.root.json"
    shutil.copyfile(attacker / "2.root.json", planted)
    if where == "over-root.json":
        shutil.copyfile(attacker / "2.root.json", repo.keys / "root.json")
    keys, repository = contents(repo.keys), contents(repo.directory)

    for prog, argv in (
        ("edgeline keys renew", ["keys", "renew", repo.keys]),
        ("edgeline keys renew", ["keys", "renew", repo.keys, "--repo", repo.directory]),
        ("edgeline publish", ["publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys]),
        ("edgeline publish", ["publish", repo.bundle(3), "--repo", repo.directory, "--keys", repo.keys]),
    ):
        message = user_error(cli(*argv), prog)
        assert str(planted) in message and "1.root.json" in message, message
    assert contents(repo.keys) == keys and contents(repo.directory) == repository
    assert device_view(repo, tmp_path / "device", pinned) == 2


def test_a_root_the_repository_has_and_the_keys_do_not_is_named(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    """A keys directory older than the repository (a gateway's copy from before a renewal) does not sign over the
    newer root: it would sign with keys devices may no longer trust."""
    stale = tmp_path / "stale-keys"
    shutil.copytree(repo.keys, stale)
    repo.publish(2)
    code, _, err = cli("keys", "renew", repo.keys, "--repo", repo.directory)
    assert code == 0, err
    message = user_error(cli("publish", "--refresh", "--repo", repo.directory, "--keys", stale), "edgeline publish")
    assert str(repo.directory / "metadata" / "2.root.json") in message and "older than the repository" in message


# ---------------------------------------------------------------------------------------------------------------------
# a new repository


@pytest.mark.parametrize("planted", ["all-of-it", "without-its-roots", "a-lone-targets-file", "beside-our-roots"])
def test_a_new_repository_holding_someone_elses_metadata_is_refused(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path, planted: str
) -> None:
    other = UpdateRepo(tmp_path / "other")
    other.publish(9)
    metadata = repo.directory / "metadata"
    shutil.copytree(other.directory / "metadata", metadata)
    kept = {
        "all-of-it": lambda name: True,
        "without-its-roots": lambda name: "root" not in name,
        "a-lone-targets-file": lambda name: name == "1.targets.json",
        "beside-our-roots": lambda name: name == "1.targets.json",
    }[planted]
    for path in list(metadata.iterdir()):
        if not kept(path.name):
            path.unlink()
    if planted == "beside-our-roots":  # as a first publish cut short after the roots would leave it
        shutil.copyfile(repo.keys / "1.root.json", metadata / "1.root.json")
    named = {"all-of-it": "1.root.json", "without-its-roots": "timestamp.json"}.get(planted, "1.targets.json")
    before = contents(repo.directory)
    message = user_error(
        cli("publish", repo.bundle(2), "--repo", repo.directory, "--keys", repo.keys), "edgeline publish"
    )
    assert str(metadata / named) in message, message
    assert contents(repo.directory) == before


def test_a_first_publish_cut_short_before_its_timestamp_is_published_over(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    repo.publish(2)
    (repo.directory / "metadata" / "timestamp.json").unlink()  # cut after the targets and snapshot metadata
    (repo.keys / "signed.json").unlink()  # and so before what was signed is recorded, after the timestamp
    code, _, err = cli("publish", repo.bundle(2), "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    assert device_view(repo, tmp_path / "device") == 2


def test_an_unsigned_file_under_targets_is_said_and_never_signed(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    stray = repo.directory / "targets" / NAME / f"{'0' * 64}.{NAME}-v9.tar"
    stray.write_bytes(_packed(repo, 9, tmp_path).read_bytes())
    code, _, err = cli("publish", repo.bundle(3), "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    assert "1 file(s) that no signed target names" in err and stray.name in err, err
    assert sorted(repo.repository.versions(NAME)) == [2, 3] and stray.is_file()


@pytest.mark.parametrize("planted", ["metadata/timestamp.json", "archive"])
def test_a_fifo_planted_in_the_repository_is_refused_not_waited_on(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path, planted: str
) -> None:
    """Whoever can write the repository can put a FIFO where a file belongs: reading it would block the publisher's
    command for ever. It is refused by name, without being opened."""
    import os
    import threading

    repo.publish(2)
    path = target_archive(repo.directory, 2) if planted == "archive" else repo.directory / planted
    path.unlink()
    os.mkfifo(path)
    result: list[tuple[int, str, str]] = []
    command = threading.Thread(target=lambda: result.append(cli("publish", "--refresh", "--repo", repo.directory,
                                                                "--keys", repo.keys)), daemon=True)  # fmt: skip
    command.start()
    command.join(60)
    if not result:  # the command waits in open(): let it go (a writer opening the FIFO ends its read)
        with open(path, "wb"):
            pass
        command.join(10)
        pytest.fail(f"publish --refresh blocked on the FIFO {path}")
    code, _, err = result[0]
    assert code == 2 and f"{path} is a FIFO, not a regular file" in err, err
    assert "Traceback" not in err
