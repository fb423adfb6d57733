"""The update state on disk (``edgeline.updates.store``): ``state.json`` is validated when read, and one that is not a
state file (any JSON, a truncated file, a committed bundle outside the state directory, a directory, a file that
cannot be read) is set aside, said once, and the daemon starts on the bundle of its command line, never exits;
refused versions are also kept in the append-only ``refused.jsonl``, so one bad file never lets a refused version in
again. And the agent's bookkeeping of refusals: a version the process died in twice is counted like every other,
and a refusal stops being reported once a check goes through.

A daemon started on a corrupt state file is ``tests/test_updates_daemon.py``'s."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeline.daemon.codecs import get_codec
from edgeline.daemon.health import Metrics
from edgeline.daemon.processor import Processor
from edgeline.model import load
from edgeline.updates.agent import UpdateAgent, starting_bundle
from edgeline.updates.client import UpdateClient
from edgeline.updates.store import KEPT_REFUSALS, RECORD_MAX_LINES, Installed, State, Store
from edgeline.updates.swap import Swap
from tests.tiny_bundle import COMMITTED_BUNDLE
from tests.update_repo import UpdateRepo, versioned

pytestmark = [pytest.mark.quick, pytest.mark.device]

GIVEN = COMMITTED_BUNDLE
"""The bundle on the command line: v1."""


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "state" / "tiny" / "updates", given=GIVEN)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


@pytest.fixture
def errors() -> Iterator[list[str]]:
    """The ERROR lines edgeline logs during the test, as they come."""
    handler = _Errors()
    logger = logging.getLogger("edgeline")
    logger.addHandler(handler)
    yield handler.said
    logger.removeHandler(handler)


def with_committed_v2(store: Store) -> State:
    """A state directory whose committed v2 is unpacked and whole, as an update leaves it."""
    versioned(store.bundle_dir(2), 2)
    state = State(committed=Installed(version=2, bundle="bundles/v2"))
    store.save(state)
    return state


def set_aside(store: Store) -> list[Path]:
    return sorted(store.directory.glob("state.json.bad-*"))


def test_a_good_state_file_starts_the_committed_version(store: Store, errors: list[str]) -> None:
    with_committed_v2(store)
    path, state = starting_bundle(store, GIVEN, 1)
    assert path == store.bundle_dir(2) and state.committed == Installed(version=2, bundle="bundles/v2")
    assert not errors and not set_aside(store)


GOOD = json.dumps({"committed": {"version": 2, "bundle": "bundles/v2"}, "previous": None, "refused": {}}, indent=2)
BAD = {
    "a list": ("[]", "Input should be an object"),
    "null": ("null", "Input should be an object"),
    "a trial without its version": ('{"trying": {}}', "trying.version: Field required"),
    "a version that is not a number": (
        '{"committed": {"version": "x", "bundle": "bundles/vx"}}',
        "committed.version: Input should be a valid integer",
    ),
    "a truncated file": (GOOD[: len(GOOD) // 2], "Invalid JSON: EOF while parsing"),
    "bytes that are not text": ("\x00\ufffd garbage", "Invalid JSON"),
    "a refused version that is not a number": (
        '{"refused": {"two": {"reason": "trial", "message": "m"}}}',
        "refused.two.[key]",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_state_file_is_set_aside_and_the_given_bundle_starts(store: Store, errors: list[str], case: str) -> None:
    content, why = BAD[case]
    with_committed_v2(store)
    store.path.write_text(content, encoding="utf-8")
    path, state = starting_bundle(store, GIVEN, 1)  # never raises
    assert path == GIVEN and state.committed is None and state.trying is None
    (aside,) = set_aside(store)
    assert aside.read_text(encoding="utf-8") == content, "kept as it was, for a look"
    assert len(errors) == 1 and str(store.path) in errors[0] and why in errors[0], errors
    assert aside.name in errors[0] and "starting from the bundle on the command line" in errors[0]
    store.save(state)  # the next write and read are clean
    assert store.load().committed is None and len(errors) == 1


@pytest.mark.parametrize("how", ["dot-dot", "absolute", "a link out"])
def test_a_committed_bundle_outside_the_state_directory_is_refused(
    store: Store, errors: list[str], tmp_path: Path, how: str
) -> None:
    """``../../../../../bundles/v8`` was accepted and run: a bundle outside the state directory, whole and verified,
    whatever put it there."""
    outside = versioned(tmp_path / "bundles" / "v8", 8)
    store.directory.mkdir(parents=True)
    bundle = {"dot-dot": os.path.relpath(outside, store.directory), "absolute": str(outside)}.get(how, "bundles/v8")
    if how == "a link out":
        store.bundles.mkdir()
        store.bundle_dir(8).symlink_to(outside, target_is_directory=True)
    store.path.write_text(json.dumps({"committed": {"version": 8, "bundle": bundle}}))
    assert (store.directory / bundle).resolve() == outside.resolve(), "the state file names the bundle outside"
    path, state = starting_bundle(store, GIVEN, 1)
    assert path == GIVEN and state.committed is None
    assert len(errors) == 1 and f"committed.bundle {bundle!r}" in errors[0], errors
    assert set_aside(store)


def test_a_directory_in_place_of_the_state_file_is_set_aside(store: Store, errors: list[str]) -> None:
    store.path.mkdir(parents=True)
    (store.path / "junk").write_text("x")
    path, state = starting_bundle(store, GIVEN, 1)
    assert path == GIVEN and state == State()
    assert len(errors) == 1 and "not a regular file" in errors[0], errors
    (aside,) = set_aside(store)
    assert (aside / "junk").read_text() == "x"
    store.save(state)
    assert store.path.is_file()


def test_an_unreadable_state_file_never_stops_the_start() -> None:
    """Read by a user who may not (``nobody``, when the tests run as root: root reads any file)."""
    directory = Path(tempfile.mkdtemp(prefix="edgeline-state-"))
    try:
        directory.chmod(0o755)
        store = Store(directory, given=GIVEN)
        store.save(State(committed=Installed(version=2, bundle="bundles/v2")))
        store.path.chmod(0)
        code = (
            "import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO)\n"
            "from edgeline.updates.agent import starting_bundle; from edgeline.updates.store import Store\n"
            f"given = Path({str(GIVEN)!r})\n"
            f"path, state = starting_bundle(Store(Path({str(directory)!r}), given=given), given, 1)\n"
            "print(path, state.committed)\n"
        )
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        if as_nobody and shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv(1): no user here who cannot read a file")
        result = subprocess.run([*as_nobody, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [str(GIVEN), "None"], result.stdout
        assert "cannot be read: Permission denied" in result.stderr and str(store.path) in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_state_file_of_an_older_edgeline_keeps_the_given_bundle_as_previous(store: Store, errors: list[str]) -> None:
    """Before the ``given`` mark, the bundle of the command line was kept as ``previous`` by its absolute path."""
    with_committed_v2(store)
    state = json.loads(store.path.read_text())
    state["previous"] = {"version": 1, "bundle": str(GIVEN.resolve())}
    store.path.write_text(json.dumps(state))
    loaded = store.load()
    assert loaded.previous == Installed(version=1, bundle=str(GIVEN.resolve()), given=True) and not errors
    assert store.resolve(loaded.previous) == GIVEN.resolve()


def test_only_the_command_lines_bundle_may_be_given_in_a_state_file(store: Store, tmp_path: Path) -> None:
    """A committed or previous entry marked ``given`` that names any other bundle (one planted outside the state
    directory) is not kept: the daemon starts on the bundle it was given."""
    elsewhere = versioned(tmp_path / "elsewhere", 5)
    with_committed_v2(store)
    state = json.loads(store.path.read_text())
    state["committed"] = {"version": 5, "bundle": str(elsewhere.resolve()), "given": True}
    state["previous"] = {"version": 1, "bundle": str(GIVEN.resolve()), "given": True}
    store.path.write_text(json.dumps(state))
    from edgeline.updates.agent import starting_bundle

    path, loaded = starting_bundle(store, GIVEN, 1)
    assert path == GIVEN and loaded.committed is None
    assert loaded.previous == Installed(version=1, bundle=str(GIVEN.resolve()), given=True)


def test_bad_state_files_set_aside_are_kept_three_at_most(store: Store, errors: list[str]) -> None:
    store.directory.mkdir(parents=True)
    for attempt in range(5):
        store.path.write_text(f"[{attempt}]")
        store.load()
    kept = set_aside(store)
    assert [path.read_text() for path in kept] == ["[2]", "[3]", "[4]"] and len(errors) == 5


WHY = "agreed with v1 (top-1 class) on 3.3% of inputs (< 90%)"


def test_a_refused_version_outlives_a_truncated_state_file(store: Store, errors: list[str]) -> None:
    """A truncated state.json forgot the refused versions: a version rolled back at 3.3% accuracy was tried again."""
    state = store.load()
    store.refuse(state, 5, "trial", WHY)
    store.save(state)
    text = store.path.read_text()
    store.path.write_text(text[: len(text) // 2])  # a disk that lied
    path, started = starting_bundle(store, GIVEN, 1)
    assert path == GIVEN and len(errors) == 1 and set_aside(store)
    assert started.refused == {5: {"reason": "trial", "message": WHY}}
    store.save(started)
    assert store.load().refused == started.refused


def test_the_refusal_record_skips_what_is_not_a_refusal_and_ends_a_cut_line(store: Store, errors: list[str]) -> None:
    store.directory.mkdir(parents=True)
    good = json.dumps({"version": 3, "reason": "self-test", "message": "golden outputs differ"})
    store.record.write_text(f"{good}\nnot json\n" + '{"version": 4, "reason": "tri')  # a power cut mid-line
    assert store.load().refused == {3: {"reason": "self-test", "message": "golden outputs differ"}}
    assert len(errors) == 1 and "2 line(s) are not refusals" in errors[0] and "line 2" in errors[0], errors
    assert store.record.read_text().splitlines() == [good], "written anew without them"

    store.record.write_text(good + '\n{"version": 4, "reason": "tri')  # cut again, then a refusal is appended
    store.refuse(State(), 6, "malformed", "not a bundle")
    lines = store.record.read_text().splitlines()
    assert lines[1] == '{"version": 4, "reason": "tri' and json.loads(lines[2])["version"] == 6, lines
    assert set(store.load().refused) == {3, 6}


def test_the_refusal_record_stays_bounded(store: Store) -> None:
    store.directory.mkdir(parents=True)
    line = '{{"version": {}, "reason": "trial", "message": "m"}}\n'
    store.record.write_text("".join(line.format(v) for v in range(1, RECORD_MAX_LINES + 1)))
    state = store.load()
    assert len(store.record.read_text().splitlines()) == RECORD_MAX_LINES, "within its bound: appended to"
    store.refuse(state, RECORD_MAX_LINES + 1, "trial", "m")
    kept = [json.loads(line)["version"] for line in store.record.read_text().splitlines()]
    assert kept == list(range(RECORD_MAX_LINES + 2 - KEPT_REFUSALS, RECORD_MAX_LINES + 2)), "the newest versions"
    assert sorted(state.refused) == kept and sorted(store.load().refused) == kept


# -- the agent's bookkeeping ----------------------------------------------------------------------------------------


def agent_on(store: Store, repo: UpdateRepo, state: State) -> UpdateAgent:
    running = load(GIVEN)
    agent = UpdateAgent(
        client=UpdateClient(str(repo.directory), repo.trusted_root, store.directory), store=store, state=state,
        running=running, running_bundle=GIVEN, device="dev-1", interval_s=3600.0, backend=None, max_batch=1,
    )  # fmt: skip
    processor = Processor(running, get_codec("json"), Metrics(model="tiny", version=1), publish="out/{name}/{device}")
    agent.swap = Swap(agent, processor)
    return agent


def test_a_version_the_process_died_in_twice_is_counted_like_every_refusal(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edgeline")
    store.save(State(trying={"version": 2, "attempts": 2}))  # the process ended twice during v2's trial
    path, state = starting_bundle(store, GIVEN, 1)
    assert path == GIVEN
    agent = agent_on(store, UpdateRepo(tmp_path / "updates"), state)
    stopped = threading.Event()
    stopped.set()
    agent.run(stopped)  # what the update thread does first, then it stops
    assert agent.refusal_counts()["trial"] == 1, "edgeline_update_refused_total{reason=trial}"
    status = agent.status()
    assert status["refusals"] == {"trial": 1} and status["refused"]["2"]["reason"] == "trial"
    assert status["last_refusal"]["version"] == 2 and status["state"] == "refused"
    assert "the process ended 2 times during its trial" in status["refused"]["2"]["message"]
    assert json.loads(store.record.read_text())["version"] == 2, "in the append-only record too"
    assert store.load().trying is None
    assert caplog.text.count("the process ended 2 times during its trial") == 1


def test_once_the_repository_is_fixed_the_status_no_longer_says_refused(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edgeline")
    repo = UpdateRepo(tmp_path / "updates")
    archive = repo.publish(2).archive
    whole = archive.read_bytes()
    archive.write_bytes(whole[:-1] + bytes([whole[-1] ^ 0xFF]))
    agent = agent_on(store, repo, store.load())
    agent.check_once()
    status = agent.status()
    assert status["state"] == "refused" and status["last_refusal"]["reason"] == "tampered", status

    hidden = repo.directory.rename(tmp_path / "away")  # out of reach: says nothing of the refusal
    agent.check_once()
    assert agent.status()["last_refusal"]["reason"] == "tampered" and agent.counts["unreachable"] == 1
    hidden.rename(repo.directory)

    archive.write_bytes(whole)  # the repository is fixed, and re-signed (`edgeline publish --refresh`)
    repo.repository.refresh()
    agent.check_once()
    status = agent.status()
    assert status["last_refusal"] is None and status["state"] == "self-test", status
    assert status["refusals"] == {"tampered": 1} and status["refused"] == {}, "counted, never held against v2"
    assert "the refusal of v2 (tampered) no longer applies" in caplog.text


def test_a_version_whose_runtime_fails_on_its_golden_inputs_is_refused_for_its_self_test_once(
    store: Store, tmp_path: Path
) -> None:
    """Its model raises at every call (LiteRT: a gather index out of range): the self-test refuses it, remembered, as
    a trial would count the failures; not an error of the update thread, downloaded again at every check."""
    repo = UpdateRepo(tmp_path / "updates")
    repo.publish(2, fail_every_input=True)
    agent = agent_on(store, repo, store.load())
    agent.check_once()
    assert agent.counts["check_errors"] == 0
    refusal = agent.status()["last_refusal"]
    assert refusal["reason"] == "self-test" and "gather index out of bounds" in refusal["message"], refusal
    assert store.load().refused[2]["reason"] == "self-test"
    agent.check_once()
    assert agent.counts["check_errors"] == 0 and agent.refusals["self-test"] == 1, "not fetched or tested again"


@pytest.mark.parametrize("name", ["state.json", "refused.jsonl"])
def test_a_link_planted_in_the_state_directory_is_never_written_through(
    store: Store, tmp_path: Path, name: str, errors: list[str]
) -> None:
    from edgeline.durable import WriteRefused

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    store.directory.mkdir(parents=True)
    (store.directory / name).symlink_to(outside)
    state = State()
    if name == "state.json":
        with pytest.raises(WriteRefused, match=r"state\.json"):
            store.save(state)
    else:
        store.refuse(state, 2, "trial", "a test")
        assert any("refused.jsonl cannot be written" in e for e in errors), errors
    assert outside.read_bytes() == b"keep me"
