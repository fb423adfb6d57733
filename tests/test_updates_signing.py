"""Signed updates (``edgeline.updates``): keys, publishing, and every check a device makes before a byte of a new
bundle reaches a model parser.

    keys generate    four ed25519 keys (owner-only) and the root metadata; never overwritten without --force;
                     encrypted with EDGELINE_KEY_PASSPHRASE, and read back only with that passphrase
    publish          the target's signed facts describe the bundle; packing is deterministic; versions only grow
    device refusals  tampered archive, wrong keys, unsigned or forged metadata, a replayed repository, expired
                     metadata, an incompatible bundle: each an ``UpdateRefused`` with its reason, nothing unpacked
    expiry           an expired repository is refused and ``publish --refresh`` makes it usable again; a device whose
                     own copy of the timestamp lapsed while it was offline still takes what was published meanwhile
    choice           never a version at or below the running one, never a refused one, only what is offered to it
    archive          a hand-made tar with a path out of the bundle, a link, an unlisted, repeated or resized member,
                     another manifest: refused, and nothing left behind
    transports       a directory, a ``file://`` URL and HTTP on 127.0.0.1 all deliver the same bundle; a repository
                     out of reach is an ``UpdateError``, not a refusal

Bundles are copies of the committed tiny bundle (tests/data/tiny-int8) with other versions: no torch here.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import shutil
import socket
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from edgeline.bundle import Bundle, read_bundle
from edgeline.cli import main
from edgeline.errors import UpdateError, UpdateRefused
from edgeline.updates import archive
from edgeline.updates.client import UpdateClient
from edgeline.updates.policy import Gates, Runtime, TargetFacts, choose, precheck, target_path
from tests.faults import Pki
from tests.tiny_bundle import COMMITTED_BUNDLE
from tests.update_repo import UpdateRepo, refused, versioned

pytestmark = [pytest.mark.quick, pytest.mark.device]

NAME = "tiny"
PROFILE = "rpi5"
KEY_FILES = ("root.key", "targets.key", "snapshot.key", "timestamp.key")
PASSPHRASE_ENV = "EDGELINE_KEY_PASSPHRASE"


# ---------------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True)
def no_passphrase(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys are plain unless a test sets the passphrase itself (a developer's shell may have it set)."""
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)


@pytest.fixture
def repo(tmp_path: Path) -> UpdateRepo:
    return UpdateRepo(tmp_path / "publisher")


RunCli = Callable[..., "tuple[int, str, str]"]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    """Run ``edgeline ARGV`` in this process; return (exit code, stdout, stderr). Never a traceback."""

    def run(*argv: str | Path) -> tuple[int, str, str]:
        code = main([str(arg) for arg in argv])
        captured = capsys.readouterr()
        assert "Traceback" not in captured.out + captured.err
        return code, captured.out, captured.err

    return run


def user_error(result: tuple[int, str, str], prog: str) -> str:
    """The one error line of a command that failed as a user's mistake (exit code 2), without its prefix."""
    code, _, err = result
    assert code == 2, f"exit code {code}; stderr:\n{err}"
    prefix = f"{prog}: error: "
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0].removeprefix(prefix)


def device(repository: str | Path, trusted_root: Path, work: Path) -> UpdateClient:
    return UpdateClient(str(repository), trusted_root, work)


def take(client: UpdateClient, destination: Path, *, running: int = 1, dev: str = "dev-1") -> Bundle:
    """The device's whole flow: check, offer, fetch, unpack; the choice must be a version."""
    choice, updater = client.check(name=NAME, device=dev, running=running, refused=set())
    assert choice.take is not None, f"nothing offered to {dev} running v{running}: {choice}"
    offer = client.offer(updater, choice.take)
    fetched = client.fetch(updater, offer)
    return client.unpack(fetched, offer, destination)


def target_archive(repo_dir: Path, version: int) -> Path:
    found = sorted((repo_dir / "targets" / NAME).glob(f"*.{NAME}-v{version}.tar"))
    assert len(found) == 1, found
    return found[0]


def newest_targets_metadata(repo_dir: Path) -> Path:
    stamp = json.loads((repo_dir / "metadata" / "timestamp.json").read_text())
    snapshot_version = stamp["signed"]["meta"]["snapshot.json"]["version"]
    snapshot = json.loads((repo_dir / "metadata" / f"{snapshot_version}.snapshot.json").read_text())
    return repo_dir / "metadata" / f"{snapshot['signed']['meta']['targets.json']['version']}.targets.json"


def timestamp_expiry(metadata_dir: Path) -> datetime:
    stamp = json.loads((metadata_dir / "timestamp.json").read_text())
    return datetime.strptime(stamp["signed"]["expires"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def wait_until_expired(metadata_dir: Path) -> None:
    expires = timestamp_expiry(metadata_dir)
    delay = (expires - datetime.now(timezone.utc)).total_seconds()
    assert delay < 5, f"the timestamp expires in {delay:.1f} s: the test meant a short expiry"
    time.sleep(max(0.0, delay) + 0.2)
    assert datetime.now(timezone.utc) > expires


def manifest_sha(bundle_dir: Path) -> str:
    return hashlib.sha256((bundle_dir / "manifest.json").read_bytes()).hexdigest()


def nothing_at(destination: Path) -> None:
    assert not destination.exists(), f"{destination} was left behind"
    assert not destination.with_name(destination.name + ".partial").exists(), "a .partial directory was left behind"


# ---------------------------------------------------------------------------------------------------------------------
# edgeline keys generate


def test_keys_generate_writes_four_private_keys_and_the_root(cli: RunCli, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    code, out, err = cli("keys", "generate", keys)
    assert code == 0, err
    assert str(keys / "root.json") in out
    for name in KEY_FILES:
        path = keys / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{name} is readable by others"
        text = path.read_text()
        assert text.startswith("-----BEGIN PRIVATE KEY-----"), text[:40]
    assert (keys / "root.json").read_bytes() == (keys / "1.root.json").read_bytes()
    root = json.loads((keys / "root.json").read_text())
    assert root["signed"]["_type"] == "root" and root["signed"]["version"] == 1
    assert root["signed"]["consistent_snapshot"] is True
    key_ids = {role: tuple(info["keyids"]) for role, info in root["signed"]["roles"].items()}
    assert set(key_ids) == {"root", "targets", "snapshot", "timestamp"}
    assert len({ids for ids in key_ids.values()}) == 4, "each role has a key of its own"
    assert all(len(ids) == 1 for ids in key_ids.values())
    assert {key["keytype"] for key in root["signed"]["keys"].values()} == {"ed25519"}
    assert [sig["keyid"] for sig in root["signatures"]] == list(key_ids["root"]), "root.json is signed by root.key"
    assert not list(keys.glob("*.tmp"))


def test_keys_generate_never_overwrites_without_force(cli: RunCli, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert cli("keys", "generate", keys)[0] == 0
    before = {path.name: path.read_bytes() for path in keys.iterdir()}

    message = user_error(cli("keys", "generate", keys), "edgeline keys generate")
    for name in (*KEY_FILES, "root.json"):
        assert name in message, message
    assert "--force" in message
    assert {path.name: path.read_bytes() for path in keys.iterdir()} == before, "a refused generate changed the keys"

    code, _, err = cli("keys", "generate", keys, "--force")
    assert code == 0, err
    for name in (*KEY_FILES, "root.json", "1.root.json"):
        assert (keys / name).read_bytes() != before[name], f"--force did not replace {name}"


def test_keys_generate_refuses_a_directory_holding_any_one_key(cli: RunCli, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "targets.key").write_text("precious\n")
    message = user_error(cli("keys", "generate", keys), "edgeline keys generate")
    assert "targets.key" in message and "root.key" not in message, message
    assert (keys / "targets.key").read_text() == "precious\n"
    assert not (keys / "root.json").exists()


def test_keys_with_a_passphrase_are_encrypted_and_need_it_to_publish(
    cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, repo_dir = tmp_path / "keys", tmp_path / "repo"
    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse battery staple")
    assert cli("keys", "generate", keys)[0] == 0
    for name in KEY_FILES:
        header = (keys / name).read_text().splitlines()[0]
        assert "ENCRYPTED" in header, f"{name}: {header}"
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    assert b"correct horse" not in b"".join((keys / name).read_bytes() for name in KEY_FILES)

    v2 = versioned(tmp_path / "bundles" / "v2", 2)
    code, _, err = cli("publish", v2, "--repo", repo_dir, "--keys", keys)
    assert code == 0, err
    published_state = (repo_dir / "metadata" / "timestamp.json").read_bytes()

    v3 = versioned(tmp_path / "bundles" / "v3", 3)
    monkeypatch.delenv(PASSPHRASE_ENV)
    message = user_error(cli("publish", v3, "--repo", repo_dir, "--keys", keys), "edgeline publish")
    assert PASSPHRASE_ENV in message and "targets.key" in message, message

    monkeypatch.setenv(PASSPHRASE_ENV, "wrong horse")
    message = user_error(cli("publish", v3, "--repo", repo_dir, "--keys", keys), "edgeline publish")
    assert PASSPHRASE_ENV in message and "targets.key" in message, message
    assert "wrong" in message.lower(), message
    assert (repo_dir / "metadata" / "timestamp.json").read_bytes() == published_state, "a failed publish signed"

    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse battery staple")
    assert cli("publish", v3, "--repo", repo_dir, "--keys", keys)[0] == 0
    bundle = take(device(repo_dir, keys / "root.json", tmp_path / "device"), tmp_path / "unpacked", running=2)
    assert bundle.manifest.version == 3


def test_a_plain_key_with_a_passphrase_set_is_a_clear_error(
    cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    assert cli("keys", "generate", keys)[0] == 0
    monkeypatch.setenv(PASSPHRASE_ENV, "a passphrase")
    v2 = versioned(tmp_path / "bundles" / "v2", 2)
    message = user_error(cli("publish", v2, "--repo", tmp_path / "repo", "--keys", keys), "edgeline publish")
    assert PASSPHRASE_ENV in message and "targets.key" in message, message


def test_publishing_with_keys_the_root_does_not_trust_is_refused(cli: RunCli, tmp_path: Path) -> None:
    keys, others = tmp_path / "keys", tmp_path / "others"
    assert cli("keys", "generate", keys)[0] == 0
    assert cli("keys", "generate", others)[0] == 0
    shutil.copyfile(others / "targets.key", keys / "targets.key")
    v2 = versioned(tmp_path / "bundles" / "v2", 2)
    message = user_error(cli("publish", v2, "--repo", tmp_path / "repo", "--keys", keys), "edgeline publish")
    assert "targets.key" in message and "not the targets key" in message, message
    assert not (tmp_path / "repo" / "metadata" / "timestamp.json").exists()


# ---------------------------------------------------------------------------------------------------------------------
# publishing, and the device taking it


def test_publish_signs_the_facts_and_the_device_takes_the_new_version(cli: RunCli, tmp_path: Path) -> None:
    keys, repo_dir = tmp_path / "keys", tmp_path / "repo"
    assert cli("keys", "generate", keys)[0] == 0
    v2 = versioned(tmp_path / "bundles" / "v2", 2)
    code, out, err = cli(
        "publish", v2, "--repo", repo_dir, "--keys", keys, "--trial-inputs", "50", "--min-agreement", "0.8",
        "--max-latency-ms", "12.5", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["path"] == target_path(NAME, 2) == "tiny/tiny-v2.tar"
    published = target_archive(repo_dir, 2)
    assert report["archive"] == str(published) and report["length"] == published.stat().st_size
    assert published.name == f"{hashlib.sha256(published.read_bytes()).hexdigest()}.tiny-v2.tar"

    # What is signed: the targets metadata names the archive by length and sha256 and carries the facts.
    signed = json.loads(newest_targets_metadata(repo_dir).read_text())
    entry = signed["signed"]["targets"]["tiny/tiny-v2.tar"]
    assert entry["length"] == published.stat().st_size
    assert entry["hashes"] == {"sha256": hashlib.sha256(published.read_bytes()).hexdigest()}
    custom = entry["custom"]["edgeline"]
    source = json.loads((v2 / "manifest.json").read_text())
    assert (custom["name"], custom["version"], custom["profile"], custom["backend"], custom["precision"]) == (
        "tiny", 2, "rpi5", "litert", source["precision"],
    )  # fmt: skip
    assert custom["runtime"] == {"package": "ai-edge-litert", "min_version": source["runtime"]["min_version"]}
    assert custom["manifest_sha256"] == manifest_sha(v2)
    assert custom["postprocess"] == "classify"
    assert custom["audience"] is None and custom["revoked"] is None
    facts = TargetFacts.from_custom("tiny/tiny-v2.tar", entry["custom"])
    assert facts.trial == Gates(inputs=50, min_agreement=0.8, max_latency_ms=12.5)
    assert facts.trial != Gates(), "the gates given on the command line were not signed"

    # The device running v1 takes v2: its offer is the signed metadata, and the unpacked bundle verifies.
    client = device(repo_dir, keys / "root.json", tmp_path / "device")
    choice, updater = client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert choice.take == facts and choice.newest_offered == 2 and choice.running_revoked is None
    offer = client.offer(updater, choice.take)
    assert offer.info.length == entry["length"] and offer.info.hashes == entry["hashes"]
    fetched = client.fetch(updater, offer)
    assert fetched.read_bytes() == published.read_bytes()
    destination = tmp_path / "bundles-on-device" / "tiny-v2"
    bundle = client.unpack(fetched, offer, destination)
    assert bundle.path == destination
    again = read_bundle(destination)
    assert again.manifest.version == 2 and again.manifest.name == NAME and again.manifest.profile == PROFILE
    assert manifest_sha(destination) == manifest_sha(v2)
    assert sorted(p.name for p in destination.iterdir()) == sorted(p.name for p in v2.iterdir())
    for path in v2.iterdir():
        assert (destination / path.name).read_bytes() == path.read_bytes(), path.name

    # Running v2 already: nothing to take, though v2 is still the newest offered.
    choice, _ = client.check(name=NAME, device="dev-1", running=2, refused=set())
    assert choice.take is None and choice.newest_offered == 2


def test_packing_is_deterministic(tmp_path: Path) -> None:
    first = versioned(tmp_path / "a" / "tiny", 2)
    second = versioned(tmp_path / "b" / "tiny", 2)
    os.utime(second / "model.tflite", (1_000_000, 1_000_000))
    one = archive.pack(read_bundle(first), tmp_path / "one.tar")
    two = archive.pack(read_bundle(first), tmp_path / "two.tar")
    three = archive.pack(read_bundle(second), tmp_path / "three.tar")
    assert one.read_bytes() == two.read_bytes() == three.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))
    with tarfile.open(one) as tar:
        members = tar.getmembers()
    manifest = json.loads((first / "manifest.json").read_text())
    assert [m.name for m in members] == ["manifest.json", *(f["path"] for f in manifest["files"])]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    # Another version packs to other bytes: the determinism is not a constant.
    other = archive.pack(read_bundle(versioned(tmp_path / "c" / "tiny", 3)), tmp_path / "other.tar")
    assert other.read_bytes() != one.read_bytes()


def test_publish_refuses_a_version_not_above_the_newest(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(3)
    state = (repo.directory / "metadata" / "timestamp.json").read_bytes()
    for version in (3, 2):
        bundle = versioned(tmp_path / "bundles" / f"again-v{version}", version)
        message = user_error(cli("publish", bundle, "--repo", repo.directory, "--keys", repo.keys), "edgeline publish")
        assert "only grow" in message and "v3" in message, message
    assert (repo.directory / "metadata" / "timestamp.json").read_bytes() == state
    assert sorted(repo.repository.versions(NAME)) == [3]
    v4 = versioned(tmp_path / "bundles" / "v4", 4)
    assert cli("publish", v4, "--repo", repo.directory, "--keys", repo.keys)[0] == 0
    assert sorted(repo.repository.versions(NAME)) == [3, 4]


def test_publish_command_line_mistakes(cli: RunCli, repo: UpdateRepo) -> None:
    repo.publish(2)
    bundle = repo.bundle(3)
    message = user_error(cli("publish", "--repo", repo.directory, "--keys", repo.keys), "edgeline publish")
    assert "--refresh" in message, message
    message = user_error(
        cli("publish", bundle, "--refresh", "--repo", repo.directory, "--keys", repo.keys), "edgeline publish"
    )
    assert "--refresh" in message, message
    assert sorted(repo.repository.versions(NAME)) == [2]


# ---------------------------------------------------------------------------------------------------------------------
# refusals: tampered archives, wrong keys, unsigned and forged metadata, replays


@pytest.mark.parametrize("change", ["flip-one-byte", "longer", "shorter"])
def test_a_tampered_archive_is_refused_at_fetch(repo: UpdateRepo, tmp_path: Path, change: str) -> None:
    repo.publish(2)
    path = target_archive(repo.directory, 2)
    data = bytearray(path.read_bytes())
    if change == "flip-one-byte":
        data[len(data) // 2] ^= 0x01
    elif change == "longer":
        data += b"\0" * 512
    else:
        del data[-512:]
    path.write_bytes(bytes(data))

    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    choice, updater = client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert choice.take is not None and choice.take.version == 2
    offer = client.offer(updater, choice.take)
    error = refused("tampered", client.fetch, updater, offer)
    assert error.version == 2
    assert not [p for p in client.downloads.iterdir() if p.is_file()], "the refused download was kept"
    nothing_at(tmp_path / "unpacked")


def test_a_repository_signed_by_other_keys_is_refused(repo: UpdateRepo, tmp_path: Path) -> None:
    other = UpdateRepo(tmp_path / "impostor")
    other.publish(2)
    error = refused("bad-signature", device(other.directory, repo.trusted_root, tmp_path / "device").check,
                    name=NAME, device="dev-1", running=1)  # fmt: skip
    assert "timestamp" in str(error), error
    # The same repository is taken by a device that pins its own root: the refusal is the key's.
    its_device = device(other.directory, other.trusted_root, tmp_path / "its-device")
    assert take(its_device, tmp_path / "x").manifest.version == 2


def test_unsigned_metadata_is_refused(repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    path = repo.directory / "metadata" / "timestamp.json"
    stamp = json.loads(path.read_text())
    assert stamp["signatures"], "the published timestamp is signed"
    stamp["signatures"] = []
    path.write_text(json.dumps(stamp, indent=1))
    refused("bad-signature", device(repo.directory, repo.trusted_root, tmp_path / "device").check,
            name=NAME, device="dev-1", running=1)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("version", 7), ("manifest_sha256", "0" * 64), ("audience", ["dev-1"]), ("profile", "jetson-orin-nano")],
)
def test_forged_target_facts_are_refused(repo: UpdateRepo, tmp_path: Path, field: str, value: Any) -> None:
    repo.publish(2)
    path = newest_targets_metadata(repo.directory)
    assert path.name == "1.targets.json"
    metadata = json.loads(path.read_text())
    custom = metadata["signed"]["targets"]["tiny/tiny-v2.tar"]["custom"]["edgeline"]
    assert custom[field] != value
    custom[field] = value
    path.write_text(json.dumps(metadata, indent=1))
    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    error = refused("bad-signature", client.check, name=NAME, device="dev-1", running=1)
    assert "targets" in str(error), error
    assert not (client.metadata_dir / "targets.json").exists(), "the forged targets metadata was stored as trusted"


def test_a_replayed_older_repository_is_refused(repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    saved_s1 = tmp_path / "saved-metadata"
    shutil.copytree(repo.directory / "metadata", saved_s1)
    repo.publish(3)
    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    choice, _ = client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert choice.take is not None and choice.take.version == 3  # the device has seen S2

    shutil.rmtree(repo.directory / "metadata")
    shutil.copytree(saved_s1, repo.directory / "metadata")
    error = refused("rollback", client.check, name=NAME, device="dev-1", running=1)
    assert "timestamp" in str(error), error
    # S1 on its own is a valid repository: a device that never saw S2 takes v2 from it.
    fresh = device(repo.directory, repo.trusted_root, tmp_path / "fresh-device")
    assert take(fresh, tmp_path / "fresh-unpacked").manifest.version == 2


# ---------------------------------------------------------------------------------------------------------------------
# expiry


def test_expired_metadata_is_refused_until_the_publisher_refreshes_it(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    repo.publish(2, expires_days=1 / 86400)
    wait_until_expired(repo.directory / "metadata")
    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    error = refused("expired", client.check, name=NAME, device="dev-1", running=1)
    assert "--refresh" in str(error), error

    code, out, err = cli("publish", "--refresh", "--repo", repo.directory, "--keys", repo.keys)
    assert code == 0, err
    assert "targets version 2" in out, out
    assert timestamp_expiry(repo.directory / "metadata") > datetime.now(timezone.utc)
    assert take(client, tmp_path / "unpacked").manifest.version == 2


def test_a_device_offline_past_its_timestamps_expiry_takes_what_was_published_meanwhile(
    repo: UpdateRepo, tmp_path: Path
) -> None:
    repo.publish(2, expires_days=3 / 86400)
    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    choice, _ = client.check(name=NAME, device="dev-1", running=2, refused=set())
    assert choice.take is None and choice.newest_offered == 2  # checked while the timestamp was valid

    wait_until_expired(client.metadata_dir)  # offline: its own copy of the timestamp lapses
    repo.publish(3)  # meanwhile, the publisher publishes with the normal expiry
    assert timestamp_expiry(client.metadata_dir) < datetime.now(timezone.utc), "the device's timestamp has expired"
    bundle = take(client, tmp_path / "unpacked", running=2)
    assert bundle.manifest.version == 3
    assert timestamp_expiry(client.metadata_dir) > datetime.now(timezone.utc)


# ---------------------------------------------------------------------------------------------------------------------
# a new root: renewal and key rotation, followed by devices pinned to the first root


def root_version(path: Path) -> int:
    return int(json.loads(path.read_text())["signed"]["version"])


def test_rotating_the_online_keys_leaves_pinned_devices_trusting_only_the_new_ones(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    repo.publish(2)
    pinned = tmp_path / "pinned-root.json"  # what every device was provisioned with
    shutil.copyfile(repo.trusted_root, pinned)
    old_device = device(repo.directory, pinned, tmp_path / "old-device")
    assert take(old_device, tmp_path / "v2").manifest.version == 2
    stolen = tmp_path / "stolen"  # a copy of the gateway's keys, taken before the rotation
    shutil.copytree(repo.keys, stolen)

    before = {role: (repo.keys / f"{role}.key").read_bytes() for role in ("root", "targets", "snapshot", "timestamp")}
    for role in ("targets", "snapshot"):
        code, out, err = cli("keys", "rotate", repo.keys, role)
        assert code == 0, err
        assert "publish --refresh" in out, out
    code, out, err = cli("keys", "rotate", repo.keys, "timestamp", "--repo", repo.directory)
    assert code == 0, err
    assert "wrote root version 4 (a new timestamp key" in out and f"re-signed {repo.directory}" in out, out
    assert root_version(repo.keys / "root.json") == 4
    assert [root_version(repo.directory / "metadata" / f"{v}.root.json") for v in (1, 2, 3, 4)] == [1, 2, 3, 4]
    after = {role: (repo.keys / f"{role}.key").read_bytes() for role in before}
    assert after["root"] == before["root"], "the root key stays"
    assert all(after[r] != before[r] for r in ("targets", "snapshot", "timestamp")), "each rotated key is new"
    assert stat.S_IMODE((repo.keys / "targets.key").stat().st_mode) == 0o600
    assert not list(repo.keys.glob("*.new")), "no staged key is left"

    repo.publish(3)
    fresh = device(repo.directory, pinned, tmp_path / "fresh-device")  # provisioned before the rotation
    assert take(fresh, tmp_path / "v3-fresh", running=2).manifest.version == 3
    assert take(old_device, tmp_path / "v3-old", running=2).manifest.version == 3

    # whoever holds the old keys can sign no more. edgeline's publisher will not sign over roots they lack:
    evil = versioned(tmp_path / "evil", 4)
    message = user_error(cli("publish", evil, "--repo", repo.directory, "--keys", stolen), "edgeline publish")
    assert "2.root.json" in message and "older than the repository" in message, message
    # and what they sign by other means (here: into a repository of their own, copied over) every device refuses
    code, _, err = cli("publish", evil, "--repo", tmp_path / "evil-repo", "--keys", stolen)
    assert code == 0, err  # the old keys still sign (they are only keys), but devices no longer trust them
    shutil.copyfile(
        tmp_path / "evil-repo" / "metadata" / "timestamp.json", repo.directory / "metadata" / "timestamp.json"
    )
    for client in (old_device, fresh):
        refused("bad-signature", client.check, name=NAME, device="dev-1", running=3)


def test_rotating_the_root_key_is_signed_by_both_roots_and_followed_by_devices(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    pinned = tmp_path / "pinned-root.json"
    shutil.copyfile(repo.trusted_root, pinned)
    old_root_key = (repo.keys / "root.key").read_bytes()
    code, out, err = cli("keys", "rotate", repo.keys, "root", "--repo", repo.directory)
    assert code == 0, err
    second = json.loads((repo.keys / "2.root.json").read_text())
    assert len(second["signatures"]) == 2, "signed by the old and the new root key"
    assert (
        second["signed"]["roles"]["root"]["keyids"]
        != json.loads(pinned.read_text())["signed"]["roles"]["root"]["keyids"]
    )
    assert (repo.keys / "root.key").read_bytes() != old_root_key
    repo.publish(2)
    assert take(device(repo.directory, pinned, tmp_path / "device"), tmp_path / "v2").manifest.version == 2
    code, out, err = cli("keys", "renew", repo.keys)  # the new root key signs the next root
    assert code == 0 and "wrote root version 3 (the same keys" in out, err


def test_renewing_a_lapsed_root_lets_devices_pinned_to_the_first_take_updates_again(
    cli: RunCli, repo: UpdateRepo, tmp_path: Path
) -> None:
    from edgeline.updates.keys import new_root

    pinned = tmp_path / "pinned-root.json"
    shutil.copyfile(repo.trusted_root, pinned)
    short = new_root(repo.keys, expires_days=2 / 86400)  # a root left to lapse
    assert short.version == 2
    repo.publish(2)
    delay = (short.expires - datetime.now(timezone.utc)).total_seconds()
    time.sleep(max(0.0, delay) + 0.2)
    client = device(repo.directory, pinned, tmp_path / "device")
    error = refused("expired", client.check, name=NAME, device="dev-1", running=1)
    assert "root" in str(error) and "edgeline keys renew" in str(error), error

    code, out, err = cli("keys", "renew", repo.keys, "--repo", repo.directory)
    assert code == 0, err
    assert "wrote root version 3 (the same keys" in out, out
    renewed = json.loads((repo.keys / "root.json").read_text())["signed"]["expires"]
    assert datetime.strptime(renewed, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) > datetime.now(
        timezone.utc
    ) + timedelta(days=300)
    assert take(client, tmp_path / "v2").manifest.version == 2  # walked 1 -> 2 (lapsed) -> 3


def test_a_rotation_cut_short_says_which_file_holds_the_new_key(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    old_key = (repo.keys / "targets.key").read_bytes()
    assert cli("keys", "rotate", repo.keys, "targets")[0] == 0
    # as if the process stopped between writing the new root and moving the new key into place
    (repo.keys / "targets.key").rename(repo.keys / "targets.key.new")
    (repo.keys / "targets.key").write_bytes(old_key)
    (repo.keys / "targets.key").chmod(0o600)  # as edgeline wrote it
    message = user_error(
        cli("publish", versioned(tmp_path / "v2", 2), "--repo", repo.directory, "--keys", repo.keys),
        "edgeline publish",
    )
    assert "rotation was cut short" in message and "targets.key.new" in message, message


def test_keys_renew_and_rotate_mistakes(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    code, _, err = cli("keys", "rotate", repo.keys, "gateway")
    assert code == 2 and "invalid choice: 'gateway'" in err, err
    message = user_error(cli("keys", "renew", tmp_path / "nowhere"), "edgeline keys renew")
    assert "no root.json" in message, message
    others = tmp_path / "others"
    assert cli("keys", "generate", others)[0] == 0
    shutil.copyfile(others / "root.key", repo.keys / "root.key")
    message = user_error(cli("keys", "rotate", repo.keys, "timestamp"), "edgeline keys rotate")
    assert "not the root key" in message, message
    assert root_version(repo.keys / "root.json") == 1 and not list(repo.keys.glob("*.new")), "nothing was written"
    code, _, err = cli("keys", "renew", repo.keys, "--expires-days", "0")
    assert code == 2 and "not a positive number" in err, err


# ---------------------------------------------------------------------------------------------------------------------
# what the device takes: compatibility before the download, and the choice


def test_precheck_refuses_another_profile_before_any_download(repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2, manifest={"profile": "jetson-orin-nano"})
    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    choice, _ = client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert choice.take is not None and choice.take.profile == "jetson-orin-nano"
    error = refused("incompatible", precheck, choice.take, name=NAME, profile=PROFILE)
    assert error.version == 2 and "jetson-orin-nano" in str(error), error
    assert not list(client.downloads.iterdir()), "something was downloaded before the precheck"


def test_precheck_refuses_a_runtime_this_device_lacks_before_any_download(repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    repo.publish(3, manifest={"runtime": {"package": "ai-edge-litert", "min_version": "99.0"}})
    client = device(repo.directory, repo.trusted_root, tmp_path / "device")
    choice, _ = client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert choice.take is not None and choice.take.version == 3
    error = refused("incompatible", precheck, choice.take, name=NAME, profile=PROFILE)
    assert error.version == 3 and "99.0" in str(error), error
    assert not list(client.downloads.iterdir()), "something was downloaded before the precheck"

    # v2, whose runtime this machine has, passes the same check; v3 refused, the device takes v2.
    choice, updater = client.check(name=NAME, device="dev-1", running=1, refused={3})
    assert choice.take is not None and choice.take.version == 2
    precheck(choice.take, name=NAME, profile=PROFILE)
    refused("incompatible", precheck, choice.take, name="other", profile=PROFILE)
    offer = client.offer(updater, choice.take)
    assert client.unpack(client.fetch(updater, offer), offer, tmp_path / "unpacked").manifest.version == 2


def facts(version: int, **changes: Any) -> TargetFacts:
    base: dict[str, Any] = {
        "name": NAME, "version": version, "profile": PROFILE, "backend": "litert", "precision": "int8-static",
        "runtime": Runtime(package="ai-edge-litert", min_version="2.0"), "manifest_sha256": "a" * 64,
    }  # fmt: skip
    return TargetFacts(**{**base, **changes})


def test_choose_takes_the_newest_version_above_the_running_one() -> None:
    offered = [facts(1), facts(3), facts(2)]
    assert choose(offered, name=NAME, device="dev-1", running=1, refused=()).take == facts(3)
    choice = choose(offered, name=NAME, device="dev-1", running=3, refused=())
    assert choice.take is None and choice.newest_offered == 3, "v3 runs: nothing newer"
    choice = choose(offered, name=NAME, device="dev-1", running=5, refused=())
    assert choice.take is None and choice.newest_offered == 3, "never a downgrade"
    assert choose([facts(2, name="other")], name=NAME, device="dev-1", running=1, refused=()).take is None


def test_choose_skips_refused_versions() -> None:
    offered = [facts(2), facts(3)]
    assert choose(offered, name=NAME, device="dev-1", running=1, refused={3}).take == facts(2)
    choice = choose(offered, name=NAME, device="dev-1", running=1, refused={2, 3})
    assert choice.take is None and choice.newest_offered == 3


def test_choose_respects_the_audience() -> None:
    offered = [facts(2), facts(3, audience=("dev-2",))]
    assert choose(offered, name=NAME, device="dev-1", running=1, refused=()).take == facts(2)
    assert choose(offered, name=NAME, device="dev-2", running=1, refused=()).take == facts(3, audience=("dev-2",))
    choice = choose([facts(3, audience=("dev-2", "dev-3"))], name=NAME, device="dev-1", running=1, refused=())
    assert choice.take is None and choice.newest_offered is None


def test_choose_reports_a_revoked_running_version() -> None:
    offered = [facts(1), facts(2, revoked="halted rollout: agreement 40%")]
    choice = choose(offered, name=NAME, device="dev-1", running=2, refused=())
    assert choice.running_revoked == "halted rollout: agreement 40%"
    assert choice.take is None and choice.newest_offered == 1
    assert choose(offered, name=NAME, device="dev-1", running=1, refused=()).take is None, "revoked is never taken"
    assert choose(offered, name=NAME, device="dev-1", running=1, refused=()).running_revoked is None


def test_the_audience_is_signed_and_respected_by_the_device(cli: RunCli, repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    code, _, err = cli(
        "publish", repo.bundle(3), "--repo", repo.directory, "--keys", repo.keys, "--devices", "dev-2, dev-3"
    )
    assert code == 0, err
    one = device(repo.directory, repo.trusted_root, tmp_path / "dev-1")
    two = device(repo.directory, repo.trusted_root, tmp_path / "dev-2")
    assert take(one, tmp_path / "one", dev="dev-1").manifest.version == 2
    assert take(two, tmp_path / "two", dev="dev-2").manifest.version == 3


# ---------------------------------------------------------------------------------------------------------------------
# archive safety


Member = tuple[tarfile.TarInfo, bytes]


def _member(name: str, data: bytes = b"", **fields: Any) -> Member:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data


def _write_tar(path: Path, members: list[Member]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


@pytest.fixture
def parts() -> dict[str, bytes]:
    return {name: (COMMITTED_BUNDLE / name).read_bytes() for name in ("manifest.json", "model.tflite", "golden.npz")}


def manifest_sha_of(parts: dict[str, bytes]) -> str:
    return hashlib.sha256(parts["manifest.json"]).hexdigest()


def _honest(parts: dict[str, bytes]) -> list[Member]:
    return [_member(name, parts[name]) for name in ("manifest.json", "model.tflite", "golden.npz")]


def test_a_hand_made_archive_of_the_bundle_unpacks(parts: dict[str, bytes], tmp_path: Path) -> None:
    tar = _write_tar(tmp_path / "honest.tar", _honest(parts))
    destination = tmp_path / "out" / "tiny"
    bundle = archive.unpack(tar, destination, manifest_sha=manifest_sha_of(parts))
    assert bundle.path == destination and read_bundle(destination).manifest.version == 1
    assert not destination.with_name("tiny.partial").exists()


def _hostile(parts: dict[str, bytes]) -> dict[str, list[Member]]:
    model, golden = parts["model.tflite"], parts["golden.npz"]
    honest = _honest(parts)
    manifest = honest[0]
    return {
        "parent-path": [manifest, _member("../escaped.tflite", model), *honest[1:]],
        "parent-path-inside": [manifest, _member("sub/../../escaped", model), *honest[1:]],
        "absolute-path": [manifest, _member("/tmp/escaped-edgeline-test", model), *honest[1:]],
        "symlink": [manifest, _member("model.tflite", type=tarfile.SYMTYPE, linkname="/etc/passwd"), honest[2]],
        "hardlink": [manifest, _member("model.tflite", type=tarfile.LNKTYPE, linkname="golden.npz"), honest[2]],
        "directory": [manifest, _member("model.tflite", type=tarfile.DIRTYPE), honest[2]],
        "unlisted": [*honest, _member("extra.bin", b"hello")],
        "repeated": [*honest, _member("golden.npz", golden)],
        "wrong-size": [manifest, _member("model.tflite", model[:-1]), honest[2]],
        "missing": [manifest, honest[1]],
        "wrong-bytes": [manifest, _member("model.tflite", bytes(len(model))), honest[2]],
        "manifest-not-first": [honest[1], manifest, honest[2]],
        "backslash": [manifest, _member("..\\escaped", model), *honest[1:]],
    }


HOSTILE = list(_hostile({"manifest.json": b"{}", "model.tflite": b"x", "golden.npz": b"y"}))


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_archive_is_refused_and_leaves_nothing(parts: dict[str, bytes], tmp_path: Path, case: str) -> None:
    tar = _write_tar(tmp_path / f"{case}.tar", _hostile(parts)[case])
    where = tmp_path / "device" / "bundles"
    destination = where / "tiny-v1"
    error = refused("malformed", archive.unpack, tar, destination, manifest_sha=manifest_sha_of(parts))
    assert str(tar) in str(error), error
    nothing_at(destination)
    assert not where.exists() or not list(where.iterdir()), list(where.iterdir())
    assert not (tmp_path / "device" / "escaped.tflite").exists() and not (where / "escaped.tflite").exists()
    assert not Path("/tmp/escaped-edgeline-test").exists()


def test_an_archive_with_another_manifest_is_tampered(parts: dict[str, bytes], tmp_path: Path) -> None:
    other = json.loads(parts["manifest.json"])
    other["version"] = 2
    forged = dict(parts, **{"manifest.json": json.dumps(other).encode()})
    tar = _write_tar(tmp_path / "forged.tar", _honest(forged))
    destination = tmp_path / "out" / "tiny"
    refused("tampered", archive.unpack, tar, destination, manifest_sha=manifest_sha_of(parts))
    nothing_at(destination)


@pytest.mark.parametrize("layout", ["lists-itself", "file-and-directory"])
def test_a_signed_manifest_whose_files_collide_is_refused_not_crashed(
    parts: dict[str, bytes], tmp_path: Path, layout: str
) -> None:
    """The manifest's sha256 is signed, so only a holder of the targets key can ship such a list (``edgeline publish``
    cannot: its bundle would not verify). The device must still refuse it as ``malformed`` (recorded as refused, not
    fetched again at every check) rather than fail with an ``OSError`` (the agent's "bug of ours" path)."""
    manifest = json.loads(parts["manifest.json"])
    extra = {
        "lists-itself": [("manifest.json", b"{}")],
        "file-and-directory": [("extra", b"x"), ("extra/x", b"y")],  # "extra" a file, then a file under it
    }[layout]
    manifest["files"] += [{"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in extra]
    manifest_bytes = json.dumps(manifest).encode()
    members = [_member("manifest.json", manifest_bytes), *_honest(parts)[1:], *(_member(n, d) for n, d in extra)]
    tar = _write_tar(tmp_path / f"{layout}.tar", members)
    destination = tmp_path / "out" / "tiny"
    try:
        archive.unpack(tar, destination, manifest_sha=hashlib.sha256(manifest_bytes).hexdigest())
    except UpdateRefused as exc:
        assert exc.reason == "malformed", exc
    except OSError as exc:
        pytest.fail(
            f"PRODUCT BUG (edgeline/updates/archive.py, _unpack_into): a signed manifest listing "
            f"{[n for n, _ in extra]} makes unpack raise {type(exc).__name__}: {exc} "
            "instead of UpdateRefused(reason='malformed')"
        )
    else:
        pytest.fail("an archive whose files collide was unpacked")
    nothing_at(destination)


@pytest.mark.parametrize("content", [b"", b"not a tar at all" * 64, b"\x1f\x8b\x08\x00" + bytes(600)])
def test_what_is_not_a_plain_tar_is_malformed(parts: dict[str, bytes], tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.tar"
    path.write_bytes(content)
    destination = tmp_path / "out" / "tiny"
    refused("malformed", archive.unpack, path, destination, manifest_sha=manifest_sha_of(parts))
    nothing_at(destination)


# ---------------------------------------------------------------------------------------------------------------------
# transports: file:// and HTTP


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def served(repo: UpdateRepo) -> Iterator[str]:
    """The repository directory served over HTTP on 127.0.0.1, as a gateway would."""
    handler = functools.partial(_QuietHandler, directory=str(repo.directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_device_takes_the_update_over_http(repo: UpdateRepo, served: str, tmp_path: Path) -> None:
    repo.publish(2)
    client = device(served, repo.trusted_root, tmp_path / "device")
    assert not client.local
    bundle = take(client, tmp_path / "unpacked")
    assert bundle.manifest.version == 2 and manifest_sha(bundle.path) == manifest_sha(repo.root / "bundles" / "v2")
    repo.publish(3)
    assert take(client, tmp_path / "unpacked-v3", running=2).manifest.version == 3


def test_http_refuses_a_tampered_archive(repo: UpdateRepo, served: str, tmp_path: Path) -> None:
    repo.publish(2)
    path = target_archive(repo.directory, 2)
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0xFF
    path.write_bytes(bytes(data))
    client = device(served, repo.trusted_root, tmp_path / "device")
    choice, updater = client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert choice.take is not None
    refused("tampered", client.fetch, updater, client.offer(updater, choice.take))


def test_the_device_takes_the_update_from_a_file_url(repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    url = repo.directory.resolve().as_uri()
    assert url.startswith("file://")
    client = device(url, repo.trusted_root, tmp_path / "device")
    assert client.local
    assert take(client, tmp_path / "unpacked").manifest.version == 2


def test_a_repository_on_a_medium_with_spaces_and_percent_signs_in_its_path(tmp_path: Path) -> None:
    repo = UpdateRepo(tmp_path / "USB DISK #1 100% ü")
    repo.publish(2)
    for n, where in enumerate((str(repo.directory), repo.directory.as_uri())):
        client = device(where, repo.trusted_root, tmp_path / f"device-{n}")
        assert take(client, tmp_path / f"unpacked-{n}").manifest.version == 2, where


def test_an_unreachable_repository_is_an_error_not_a_refusal(repo: UpdateRepo, tmp_path: Path) -> None:
    repo.publish(2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # the port is closed now: nothing listens on it
    client = device(f"http://127.0.0.1:{port}", repo.trusted_root, tmp_path / "device")
    with pytest.raises(UpdateError) as caught:  # bounded by the test's timeout (its tier's), not timed here
        client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert not isinstance(caught.value, UpdateRefused), f"a repository out of reach refused as {caught.value}"
    assert f"127.0.0.1:{port}" in str(caught.value), caught.value


def test_a_missing_repository_directory_is_an_error_not_a_refusal(repo: UpdateRepo, tmp_path: Path) -> None:
    client = device(tmp_path / "no-such-repository", repo.trusted_root, tmp_path / "device")
    with pytest.raises(UpdateError) as caught:
        client.check(name=NAME, device="dev-1", running=1, refused=set())
    assert not isinstance(caught.value, UpdateRefused), caught.value


def test_a_missing_trusted_root_is_a_clear_error(repo: UpdateRepo, tmp_path: Path) -> None:
    with pytest.raises(UpdateError, match="trusted root"):
        UpdateClient(str(repo.directory), tmp_path / "nowhere" / "root.json", tmp_path / "device")


@pytest.fixture
def served_tls(repo: UpdateRepo, pki: Pki) -> Iterator[str]:
    """The repository over HTTPS on 127.0.0.1, with a certificate of the tests' own CA."""
    import ssl

    handler = functools.partial(_QuietHandler, directory=str(repo.directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_https_with_a_private_ca_named_by_ssl_cert_file(
    repo: UpdateRepo, served_tls: str, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's own CA is trusted the way OpenSSL is told (docs/updates.md): SSL_CERT_FILE; without it the
    certificate is not trusted and the check is an error, not a refusal."""
    repo.publish(2)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.other_ca_cert))
    with pytest.raises(UpdateError) as untrusted:
        device(served_tls, repo.trusted_root, tmp_path / "untrusted").check(name=NAME, device="d", running=1)
    assert not isinstance(untrusted.value, UpdateRefused)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_cert))
    assert take(device(served_tls, repo.trusted_root, tmp_path / "device"), tmp_path / "unpacked").manifest.version == 2
