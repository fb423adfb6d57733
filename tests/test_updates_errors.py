"""Which exceptions the update client translates: python-tuf's and its transport's become refusals (or "out of
reach, try again"), and anything else (a bug of ours, or python-tuf's state machine) reaches the update thread's top
as what it is, counted as a check error, never remembered as a refusal of a good version."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from tuf.api import exceptions as tuf_exceptions
from tuf.api.metadata import TargetFile

from edgeline.errors import REFUSAL_REASONS, UpdateError, UpdateRefused
from edgeline.model import load
from edgeline.updates.agent import UpdateAgent
from edgeline.updates.client import Offer, UpdateClient, tuf_errors
from edgeline.updates.policy import Runtime, TargetFacts
from edgeline.updates.store import Store
from tests.tiny_bundle import COMMITTED_BUNDLE

pytestmark = [pytest.mark.quick, pytest.mark.device]


class FakeUpdater:
    """python-tuf's ``Updater`` as far as the client calls it, every call raising ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def refresh(self) -> None:
        raise self.error

    def get_targetinfo(self, path: str) -> Any:
        raise self.error

    def find_cached_target(self, info: Any, path: str) -> None:
        return None

    def download_target(self, info: Any, path: str) -> str:
        raise self.error


def client_raising(tmp_path: Path, error: BaseException) -> UpdateClient:
    repository = tmp_path / "repo"
    (repository / "metadata").mkdir(parents=True)
    (repository / "metadata" / "timestamp.json").write_text("{}")  # "published": the refusal is python-tuf's
    root = tmp_path / "root.json"
    root.write_text("{}")
    client = UpdateClient(str(repository), root, tmp_path / "work")
    client._updater = lambda: FakeUpdater(error)  # type: ignore[method-assign]
    return client


FACTS = TargetFacts(
    name="tiny", version=2, profile="rpi5", backend="litert", precision="int8-static",
    runtime=Runtime(package="ai-edge-litert", min_version="1.0"), manifest_sha256="0" * 64,
)  # fmt: skip


def every_call(client: UpdateClient) -> list[Any]:
    """check, offer and fetch: the three calls that talk to python-tuf."""
    updater = client._updater()
    info = TargetFile(length=10240, hashes={"sha256": "0" * 64}, path="tiny/tiny-v2.tar")
    offer = Offer(facts=FACTS, path="tiny/tiny-v2.tar", info=info)
    return [
        lambda: client.check(name="tiny", device="dev-1", running=1),
        lambda: client.offer(updater, FACTS),
        lambda: client.fetch(updater, offer),
    ]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (tuf_exceptions.UnsignedMetadataError("root: 0 of 1 signatures"), "bad-signature"),
        (tuf_exceptions.LengthOrHashMismatchError("hash differs"), "tampered"),
        (tuf_exceptions.BadVersionNumberError("older"), "rollback"),
        (tuf_exceptions.RepositoryError("no such role"), "malformed"),
        (tuf_exceptions.DownloadLengthMismatchError("too long"), "tampered"),
        (tuf_exceptions.SlowRetrievalError("not downloaded whole within 600 s"), "timeout"),
        (OSError(28, "No space left on device"), "no-room"),
    ],
)
def test_python_tufs_verdicts_are_refusals_by_reason(tmp_path: Path, error: Exception, reason: str) -> None:
    assert reason in REFUSAL_REASONS
    for call in every_call(client_raising(tmp_path, error)):
        with pytest.raises(UpdateRefused) as caught:
            call()
        assert caught.value.reason == reason
        assert caught.value.__cause__ is error


@pytest.mark.parametrize(
    "error",
    [
        tuf_exceptions.DownloadHTTPError("gone", 500),
        tuf_exceptions.DownloadError("http://repo/metadata/timestamp.json: IncompleteRead: 10 bytes read"),
        ConnectionResetError("reset by peer"),
    ],
)
def test_a_repository_out_of_reach_is_tried_again_not_refused(tmp_path: Path, error: Exception) -> None:
    assert isinstance(error, tuf_errors())
    for call in every_call(client_raising(tmp_path, error)):
        with pytest.raises(UpdateError) as caught:
            call()
        assert not isinstance(caught.value, UpdateRefused), caught.value
        assert "tried again at the next check" in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [AttributeError("'NoneType' object has no attribute 'length'"), RuntimeError("Cannot update root"), KeyError("x")],
)
def test_a_bug_is_not_translated(tmp_path: Path, error: Exception) -> None:
    for call in every_call(client_raising(tmp_path, error)):
        with pytest.raises(type(error)) as caught:
            call()
        assert caught.value is error


def test_a_bug_in_a_check_is_a_check_error_of_the_update_thread_never_a_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before python-tuf's exceptions were named, an ``AttributeError`` in a check became "the repository cannot be
    read now": a bug of ours hidden as the weather. Now it is said with its traceback and counted as such."""
    store = Store(tmp_path / "state")
    agent = UpdateAgent(
        client=client_raising(tmp_path, AttributeError("a bug of ours")),
        store=store,
        state=store.load(),
        running=load(COMMITTED_BUNDLE),
        running_bundle=COMMITTED_BUNDLE,
        device="dev-1",
        interval_s=3600.0,
        backend=None,
        max_batch=1,
    )
    agent.swap = object()  # type: ignore[assignment]  # check_once only asks that one is attached
    with pytest.raises(AttributeError, match="a bug of ours"):
        agent.check_once()

    stopping = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stopping,), daemon=True)
    agent.swap = type("IdleSwap", (), {"busy": threading.Event()})()  # type: ignore[assignment]
    thread.start()
    try:
        for _ in range(500):
            if agent.counts["check_errors"] >= 1:
                break
            stopping.wait(0.01)
    finally:
        stopping.set()
        thread.join(10)
    assert agent.counts["check_errors"] == 1
    assert agent.counts["unreachable"] == 0
    assert sum(agent.refusals.values()) == 0 and agent.last_refusal is None
    assert agent.state.refused == {}
    failed = [record for record in caplog.records if "update check failed: AttributeError" in record.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
