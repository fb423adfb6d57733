"""Hot swap, trial, commit and roll back: `edgeline run --updates` as its own process against a real Mosquitto, with
a signed repository in a temporary directory (``tests.update_repo``).

Inputs come from a persistent QoS 1 publisher, answers go to a persistent subscriber (``tests.faults``); every
input's id must come back exactly once, naming the version that answered it.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edgeline.updates.policy import Gates
from tests.conftest import needs_torch
from tests.faults import DurableCollector, DurablePublisher
from tests.mqtt_broker import Broker, Collector, free_port
from tests.test_daemon_backpressure import small_disk
from tests.test_daemon_durability import DaemonProcess, inputs, missing_answers, publish_in_background, wait_until
from tests.tiny_bundle import TINY_MODEL_SOURCE, export_tiny
from tests.update_repo import UpdateRepo, versioned

pytestmark = [pytest.mark.integration, pytest.mark.device]
__all__ = ["small_disk"]  # the 4 MB tmpfs fixture (root only)

TIMEOUT_S = 60.0
HAVE_PROMETHEUS = importlib.util.find_spec("prometheus_client") is not None


@pytest.fixture
def repo(tmp_path: Path) -> UpdateRepo:
    return UpdateRepo(tmp_path / "updates")


class UpdatingDaemon(DaemonProcess):
    """``DaemonProcess`` with ``[updates]`` on ``repo``, checked every 0.3 s (``updates``: more of its lines), and a
    Prometheus port."""

    def __init__(
        self, repo: UpdateRepo, broker: Broker, topic: str, state_dir: Path, version: int = 1, config: str = "",
        repository: str | None = None, updates: str = "",
    ) -> None:  # fmt: skip
        # /metrics needs prometheus-client (the metrics extra): the whole suite has it and checks the counters;
        # the device tier (scripts/test_device.sh) runs the base install, where the daemon serves none.
        self.metrics_port = free_port() if HAVE_PROMETHEUS else 0
        self.state = state_dir
        config = (  # what the test adds comes last
            f'[updates]\nrepository = "{repository or repo.directory}"\ntrusted_root = "{repo.trusted_root}"\n'
            f"check_interval_s = 0.3\n{updates}"
            f"[health]\nstatus_interval_s = 1.0\nprometheus_port = {self.metrics_port}\n{config}"
        )
        super().__init__(repo.bundle(version), broker.address, topic, state_dir, config)

    def wait_logged(self, needle: str, *, count: int = 1, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.log_text().count(needle) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{needle!r} never logged {count} time(s):\n{self.log_text()[-4000:]}")
            if self.process is not None and self.process.poll() is not None:
                pytest.fail(f"the daemon exited ({self.process.returncode}):\n{self.log_text()[-4000:]}")
            time.sleep(0.05)

    def update_state(self) -> dict[str, object]:
        path = self.state / "tiny" / "updates" / "state.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def metrics(self) -> str | None:
        """The daemon's /metrics, or None without prometheus-client here."""
        if not self.metrics_port:
            return None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return str(response.read().decode())


@pytest.fixture
def daemon(repo: UpdateRepo, durable_broker: Broker, unique_topic: str, tmp_path: Path) -> Iterator[UpdatingDaemon]:
    process = UpdatingDaemon(repo, durable_broker, unique_topic, tmp_path / "state")
    yield process
    process.kill()


def versions_by_id(collector: DurableCollector) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for payload in collector.payloads:
        answer = json.loads(payload)
        found.setdefault(str(answer["id"]), []).append(int(answer["version"]))
    return found


def ten_more_answered_by(publisher: DurablePublisher, answers: DurableCollector, topic: str, prefix: str) -> set[int]:
    """The versions that answered ten more inputs published now (each must be answered)."""
    more = inputs(f"{topic}/sensors/cam1/image", 10, prefix=prefix)
    publisher.publish_all(more)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in more})
    return {versions_by_id(answers)[f"{prefix}{i}"][0] for i in range(10)}


def latest_status(broker: Broker, daemon: UpdatingDaemon) -> dict[str, object]:
    """The retained status message of the daemon."""
    import subprocess

    topic = "edgeline/tiny/durable/status"
    out = subprocess.run(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", topic, "-C", "1", "-W", "5"],
        capture_output=True, text=True, timeout=10, check=False,
    )  # fmt: skip
    assert out.stdout, f"no retained status on {topic}: {out.stderr}"
    return dict(json.loads(out.stdout.splitlines()[0]))


def status_when(broker: Broker, daemon: UpdatingDaemon, done: Callable[[dict[str, Any]], bool], what: str) -> dict:
    """The daemon's retained status once ``done(status)`` holds (it is published every second): the event a test
    waits for, where it once paused for what should have been time enough for several update checks."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        status = latest_status(broker, daemon)
        if done(status):
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"no status with {what} in {TIMEOUT_S:g} s: {status}\n{daemon.log_text()[-3000:]}")
        time.sleep(0.2)


def checked_three_more_times(broker: Broker, daemon: UpdatingDaemon) -> None:
    """Until the daemon has checked the repository three more times than it had now: a barrier after which a
    version it should not fetch again would have been fetched (counted, not timed)."""
    checks = int(latest_status(broker, daemon)["counts"]["update_checks"])
    status_when(broker, daemon, lambda s: int(s["counts"]["update_checks"]) >= checks + 3, "three more checks")


def test_a_swap_under_a_steady_qos1_stream_loses_and_duplicates_nothing(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    statuses = Collector(durable_broker, "edgeline/tiny/durable/status")
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 400)
    sender = publish_in_background(publisher, messages, rate=50.0)
    assert wait_until(lambda: len(answers.id_counts()) >= 20)  # v1 answers first: the swap comes mid-stream
    repo.publish(2, gates=Gates(inputs=40, seconds=120))
    sender.join(TIMEOUT_S)
    ids = {json.loads(payload)["id"] for _, payload in messages}
    assert not missing_answers(answers, ids), daemon.log_text()[-3000:]
    daemon.wait_logged("v2 committed")

    versions = versions_by_id(answers)
    assert all(len(v) == 1 for v in versions.values()), "an input was answered twice"
    in_order = [versions[json.loads(payload)["id"]][0] for _, payload in messages]
    first_v2 = in_order.index(2)
    assert in_order[:first_v2] == [1] * first_v2 and first_v2 > 0, "v1 answered first"
    assert set(in_order[first_v2:]) == {2}, "after the swap, only v2 answered (the same model: no fallback needed)"
    errors = [json.loads(p) for p in answers.payloads if "error" in json.loads(p)]
    assert not errors, errors[:3]

    state = daemon.update_state()
    assert state["committed"] == {"version": 2, "bundle": "bundles/v2"}
    assert state["previous"]["version"] == 1 and state["trying"] is None
    status = latest_status(durable_broker, daemon)
    update = status["update"]
    assert status["version"] == 2 and update["running"] == 2 and update["committed"]["version"] == 2
    assert update["last_trial"]["inputs"] == 40 and update["last_trial"]["agreement"] == 1.0
    metrics = daemon.metrics()
    if metrics is not None:
        assert 'edgeline_update_committed_total{daemon="durable",model="tiny",version="2"} 1.0' in metrics
        assert re.search(r'edgeline_update_refused_total\{[^}]*reason="tampered"[^}]*\} 0\.0', metrics)
    for step in ("found", "verified", "passed its golden self-test", "answers from now on", "committed"):
        assert step in daemon.log_text(), step
    steps = [((json.loads(p).get("update") or {}).get("last") or {}).get("step") for p in statuses.payloads]
    statuses.close()
    seen = [step for i, step in enumerate(steps) if step and step != (steps[i - 1] if i else None)]
    assert seen == ["found", "verified", "self-test", "trial", "committed"], "each step on the status topic, in order"

    assert daemon.terminate() == 0
    daemon.start(durable_broker)
    daemon.wait_logged("starting on the committed v2")
    assert ten_more_answered_by(publisher, answers, unique_topic, "after") == {2}


def test_a_signed_bundle_failing_its_self_test_is_refused_and_never_answers(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    repo.publish(2, break_golden=True)
    daemon.wait_logged("update refused (self-test)")
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 30)
    publisher.publish_all(messages)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages})
    assert {v[0] for v in versions_by_id(answers).values()} == {1}
    state = daemon.update_state()
    assert state["refused"]["2"]["reason"] == "self-test" and state["committed"] is None
    assert not (daemon.state / "tiny" / "updates" / "bundles" / "v2").exists(), "the refused bundle is removed"
    checked_three_more_times(durable_broker, daemon)  # a refused version is not fetched again
    assert daemon.log_text().count("v2 found") == 1
    metrics = daemon.metrics()
    assert metrics is None or re.search(r'edgeline_update_refused_total\{[^}]*reason="self-test"[^}]*\} 1\.0', metrics)


def test_a_tampered_archive_is_refused_with_one_log_line_however_often_it_is_checked_and_forgotten_once_fixed(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker
) -> None:
    published = repo.publish(2)
    whole = published.archive.read_bytes()
    data = bytearray(whole)
    data[len(data) // 2] ^= 0xFF
    published.archive.write_bytes(bytes(data))
    daemon.start(durable_broker)
    daemon.wait_logged("update refused (tampered)")
    status = status_when(
        durable_broker, daemon, lambda s: s["update"]["refusals"].get("tampered", 0) >= 3, "three refusals"
    )
    log = daemon.log_text()
    assert log.count("update refused (tampered)") == 1, log[-3000:]
    assert status["update"]["refused"] == {}, "a repository's fault is not held against the version"
    assert status["update"]["state"] == "refused" and status["update"]["last_refusal"]["reason"] == "tampered"
    assert not (daemon.state / "tiny" / "updates" / "bundles" / "v2").exists()

    published.archive.write_bytes(whole)  # the repository is fixed and re-signed: the next check takes v2 to its trial
    repo.repository.refresh()
    update = status_when(durable_broker, daemon, lambda s: s["update"]["state"] == "trial", "v2 on trial")["update"]
    assert update["last_refusal"] is None, "the status no longer says refused"
    assert "the refusal of v2 (tampered) no longer applies" in daemon.log_text()


STEP_LOGS = {
    "found": "v2 found",
    "verified": "signature, hashes and manifest verified",
    "self-test": "passed its golden self-test",
    "trial": "answers from now on",
    "committed": "v2 committed",
}


def started_on(daemon: UpdatingDaemon, start: int) -> int:
    """The version the ``start``-th start (1-based) of the daemon announced."""
    daemon.wait_logged("edgeline run: tiny v", count=start)
    versions = re.findall(r"edgeline run: tiny v(\d+)", daemon.log_text())
    return int(versions[start - 1])


def fed_until_logged(
    daemon: UpdatingDaemon, publisher: DurablePublisher, topic: str, needle: str
) -> list[tuple[str, bytes]]:
    """Inputs published 30 at a time until ``needle`` is logged (at most 40 batches, a second's wait after each): a
    trial that ends on a count of inputs gets them however late a restart under load took up the swap, rather than
    only the stream the test started before it."""
    sent: list[tuple[str, bytes]] = []
    for batch in range(40):
        if needle in daemon.log_text():
            return sent
        more = inputs(topic, 30, prefix=f"fed{batch}-")
        publisher.publish_all(more, 60.0)
        sent += more
        deadline = time.monotonic() + 1.0
        while needle not in daemon.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    daemon.wait_logged(needle)  # fails naming the log
    return sent


@pytest.mark.parametrize("step", list(STEP_LOGS))
def test_sigkill_after_each_step_of_a_swap_restarts_on_one_committed_version(
    step: str, daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 600)
    sender = publish_in_background(publisher, messages, rate=60.0)
    repo.publish(2, gates=Gates(inputs=30, seconds=120))
    daemon.wait_logged(STEP_LOGS[step])
    daemon.kill()  # as soon as the step is logged (the steps before the trial take milliseconds: a kill lands in
    # the step named or a later one)
    committed = daemon.update_state().get("committed")
    expected = committed["version"] if committed else 1
    daemon.start(durable_broker)
    assert started_on(daemon, 2) == expected, f"killed at {step}: committed {committed}"
    # the swap is taken up again and completes; every input is answered (at least once: a kill may redeliver)
    if step != "committed":
        messages += fed_until_logged(daemon, publisher, f"{unique_topic}/sensors/cam0/image", "v2 committed")
    sender.join(TIMEOUT_S)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages}), daemon.log_text()[-3000:]
    assert daemon.update_state()["committed"]["version"] == 2
    assert ten_more_answered_by(publisher, answers, unique_topic, "late") == {2}


class StallingServer:
    """The repository over HTTP on 127.0.0.1 that sends the first half of each archive, then holds the rest until
    ``release()`` (at most 60 s): a download the test can kill the daemon in the middle of."""

    def __init__(self, directory: Path) -> None:
        self.stalled = threading.Event()
        self.released = threading.Event()
        server_self = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(directory), **kwargs)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if not self.path.startswith("/targets/"):
                    super().do_GET()
                    return
                path = Path(self.translate_path(self.path))
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                server_self.stalled.set()
                server_self.released.wait(60.0)
                with contextlib.suppress(OSError):  # the killed daemon's socket is gone
                    self.wfile.write(data[len(data) // 2 :])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_sigkill_in_the_middle_of_a_download_restarts_on_the_running_version_and_takes_the_update_whole(
    repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher, answers: DurableCollector,
    unique_topic: str, tmp_path: Path,
) -> None:  # fmt: skip
    server = StallingServer(repo.directory)
    daemon = UpdatingDaemon(repo, durable_broker, unique_topic, tmp_path / "state", repository=server.url)
    try:
        daemon.start(durable_broker)
        repo.publish(2, gates=Gates(inputs=10, seconds=120))
        assert server.stalled.wait(TIMEOUT_S), f"the archive was never asked for:\n{daemon.log_text()[-3000:]}"
        daemon.kill()  # half the archive has been sent, the rest is held: the process dies inside the download
        assert "signature, hashes and manifest verified" not in daemon.log_text()
        updates_dir = daemon.state / "tiny" / "updates"
        assert not (updates_dir / "bundles" / "v2").exists()
        assert not (updates_dir / "downloads" / "tiny-v2.tar").exists(), "a half archive never takes the final name"

        server.release()
        daemon.start(durable_broker)
        assert started_on(daemon, 2) == 1, "nothing was committed: the running version comes back"
        daemon.wait_logged("passed its golden self-test")  # downloaded again, whole, and verified
        daemon.wait_logged("answers from now on")  # the trial has begun: the inputs below are its inputs
        messages = inputs(f"{unique_topic}/sensors/cam0/image", 20)
        publisher.publish_all(messages)
        assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages}), daemon.log_text()[-3000:]
        daemon.wait_logged("v2 committed")
        assert daemon.update_state()["committed"]["version"] == 2
    finally:
        daemon.kill()
        server.close()


def test_a_version_whose_trial_the_process_never_survives_is_refused(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 400)
    sender = publish_in_background(publisher, messages, rate=40.0)
    repo.publish(2, gates=Gates(inputs=100_000, seconds=3600))
    for start in (1, 2):
        daemon.wait_logged("answers from now on", count=start)
        daemon.kill()
        daemon.start(durable_broker)
        assert started_on(daemon, start + 1) == 1
    daemon.wait_logged("the process ended 2 times during its trial")
    sender.join(TIMEOUT_S)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages})
    state = daemon.update_state()
    assert state["refused"]["2"]["reason"] == "trial" and state["trying"] is None and state["committed"] is None
    assert ten_more_answered_by(publisher, answers, unique_topic, "late") == {1}
    update = status_when(durable_broker, daemon, lambda s: "trial" in s["update"]["refusals"], "the refusal")["update"]
    assert update["refusals"] == {"trial": 1}, "counted like every other refusal"
    metrics = daemon.metrics()
    assert metrics is None or re.search(r'edgeline_update_refused_total\{[^}]*reason="trial"[^}]*\} 1\.0', metrics)


RETRAINED_SOURCE = TINY_MODEL_SOURCE.replace(
    "def model():\n    return Tiny()",
    "def model():\n    torch.manual_seed(7)  # other weights: another training run\n    return Tiny()",
)


@pytest.mark.workstation
def test_a_version_with_random_weights_is_rolled_back_after_a_few_dozen_answers_and_never_answers_after_it(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str, sample_files: dict[str, Path], tmp_path: Path,
) -> None:  # fmt: skip
    """Random weights (another initialisation of the tiny model, agreeing with v1 on about 1 input in 6) once answered
    all 200 inputs of the default trial, though its rollback was certain from about the 25th."""
    needs_torch("exporting a retrained model")
    source = tmp_path / "retrained.py"
    source.write_text(RETRAINED_SOURCE)
    assert RETRAINED_SOURCE != TINY_MODEL_SOURCE
    exported = tmp_path / "retrained"
    assert export_tiny(source, sample_files, exported) == 0
    repo.repository.publish(versioned(tmp_path / "v2", 2, source=exported, manifest={"name": "tiny"}), gates=Gates())

    daemon.start(durable_broker)
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 300)
    sender = publish_in_background(publisher, messages, rate=50.0)
    daemon.wait_logged("v2 rolled back to v1")
    sender.join(TIMEOUT_S)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages})
    versions = versions_by_id(answers)
    assert all(len(v) == 1 for v in versions.values()), "an input was answered twice"
    in_order = [versions[json.loads(p)["id"]][0] for _, p in messages]
    first, last = in_order.index(2), len(in_order) - 1 - in_order[::-1].index(2)
    by_v2 = last - first + 1
    assert set(in_order[first : last + 1]) == {2} and by_v2 <= 40, f"v2 answered {by_v2} inputs, not a few dozen"
    assert set(in_order[last + 1 :]) == {1} and len(in_order) - last > 100, "only v1 after the trial"

    state = daemon.update_state()
    assert state["refused"]["2"]["reason"] == "trial" and state["committed"] is None
    assert "agreed with v1" in state["refused"]["2"]["message"] and "stopped early" in state["refused"]["2"]["message"]
    update = latest_status(durable_broker, daemon)["update"]
    assert update["last"]["step"] == "rolled-back" and "agreed with v1" in update["last"]["message"]
    assert update["last_trial"]["inputs"] == by_v2 and update["last_trial"]["of"] == 200
    assert update["last_trial"]["agreement"] < 0.5
    checked_three_more_times(durable_broker, daemon)
    assert daemon.log_text().count("v2 found") == 1, "a rolled-back version is not tried again"


def test_a_daemon_started_on_a_corrupt_state_file_answers_and_keeps_refusing_what_it_refused(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    """``[]`` in state.json ended the daemon with an AttributeError at every start: under systemd, a crash loop that
    answers nothing. v2 was refused before the file went bad: ``refused.jsonl`` still says so."""
    repo.publish(2)
    updates_dir = daemon.state / "tiny" / "updates"
    updates_dir.mkdir(parents=True)
    (updates_dir / "state.json").write_text("[]")
    refusal = {"version": 2, "reason": "trial", "message": "agreed with v1 (top-1 class) on 3.3% of inputs (< 90%)"}
    (updates_dir / "refused.jsonl").write_text(json.dumps(refusal) + "\n")
    daemon.start(durable_broker)
    assert ten_more_answered_by(publisher, answers, unique_topic, "after") == {1}
    checked_three_more_times(durable_broker, daemon)
    log = daemon.log_text()
    assert log.count("cannot be used (Input should be an object): set aside as state.json.bad-") == 1, log[-3000:]
    assert "v2 found" not in log, "refused before: never fetched again"
    (aside,) = updates_dir.glob("state.json.bad-*")
    assert aside.read_text() == "[]"
    assert latest_status(durable_broker, daemon)["update"]["refused"]["2"]["reason"] == "trial"


def test_a_revoked_version_sends_the_devices_that_committed_it_back_to_their_previous_one(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 200)
    sender = publish_in_background(publisher, messages, rate=50.0)
    published = repo.publish(2, gates=Gates(inputs=20, seconds=60))
    daemon.wait_logged("v2 committed")
    repo.repository.update_target(published.path, lambda f: f.model_copy(update={"revoked": "halted by a rollout"}))
    daemon.wait_logged("v2 revoked (halted by a rollout): back to v1")
    sender.join(TIMEOUT_S)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages})
    state = daemon.update_state()
    assert state["committed"]["version"] == 1 and state["refused"]["2"]["reason"] == "revoked"
    assert ten_more_answered_by(publisher, answers, unique_topic, "late") == {1}
    assert daemon.terminate() == 0
    daemon.start(durable_broker)
    assert started_on(daemon, 2) == 1, "the revert is what is committed"


def test_an_older_version_is_never_taken(
    repo: UpdateRepo, durable_broker: Broker, unique_topic: str, tmp_path: Path
) -> None:
    repo.publish(1)
    repo.publish(2)
    daemon = UpdatingDaemon(repo, durable_broker, unique_topic, tmp_path / "state", version=3)
    try:
        daemon.start(durable_broker)
        daemon.wait_logged("update refused (downgrade)")
        checked_three_more_times(durable_broker, daemon)
        assert daemon.log_text().count("update refused (downgrade)") == 1
        metrics = daemon.metrics()
        assert metrics is None or re.search(
            r'edgeline_update_refused_total\{[^}]*reason="downgrade"[^}]*\} [1-9]', metrics
        )
        assert "found" not in daemon.log_text() and started_on(daemon, 1) == 3
        assert daemon.update_state().get("refused", {}) == {}
    finally:
        daemon.kill()


def test_an_update_the_disk_has_no_room_for_waits_and_is_taken_once_there_is(
    small_disk: Path, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon = UpdatingDaemon(
        repo, durable_broker, unique_topic, small_disk / "state", config=f"[outbox]\nmax_bytes = {1 << 20}\n"
    )
    try:
        daemon.start(durable_broker)
        bundle = repo.bundle(2)
        bundle_bytes = sum(f.stat().st_size for f in bundle.iterdir())  # the archive is longer (tar headers)
        # leave room for the archive and its unpacked bundle and 64 KiB more: the update alone would fit, but the
        # outbox's budget (half of the disk's free bytes and its own, 256 KiB at least) would not be left free
        ballast = small_disk / "ballast"
        ballast.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 2 * bundle_bytes - (64 << 10)))
        repo.publish(2, gates=Gates(inputs=10, seconds=120))
        daemon.wait_logged("update refused (no-room)")
        status = status_when(  # three checks, each refused: said once
            durable_broker, daemon, lambda s: s["update"]["refusals"].get("no-room", 0) >= 3, "three refusals"
        )
        log = daemon.log_text()
        assert log.count("update refused (no-room)") == 1, log[-3000:]
        assert "stay free for the outbox" in log
        update = status["update"]
        assert update["last_refusal"]["reason"] == "no-room" and update["last_refusal"]["version"] == 2
        assert update["refusals"]["no-room"] >= 3 and update["refused"] == {}, "not held against the version"
        updates_dir = small_disk / "state" / "tiny" / "updates"
        assert not (updates_dir / "bundles" / "v2").exists()
        assert not any((updates_dir / "downloads").iterdir()), "nothing was downloaded"

        ballast.unlink()  # room again: the next check takes it, and the trial runs on the next inputs
        daemon.wait_logged("answers from now on")
        messages = inputs(f"{unique_topic}/sensors/cam0/image", 20)
        publisher.publish_all(messages)
        assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages}), daemon.log_text()[-3000:]
        daemon.wait_logged("v2 committed")
        assert not any((updates_dir / "downloads").iterdir()), "the archive is gone once unpacked"
    finally:
        daemon.kill()


def test_a_version_that_needs_more_memory_than_the_device_has_is_not_downloaded(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker
) -> None:
    source = json.loads((repo.bundle(1) / "manifest.json").read_text())
    heavy = {**source["memory"], "resident_mb": 64 * 1024 * 1024}  # 64 TB: more than any machine has available
    published = repo.publish(2, manifest={"memory": heavy})
    assert published.facts.resident_mb == heavy["resident_mb"], "the measured memory is signed with the target"
    daemon.start(durable_broker)
    daemon.wait_logged("update refused (no-room)")
    log = daemon.log_text()
    assert "of memory are available to this process" in log, log[-2000:]
    assert "runs its trial beside the running version" in log
    updates_dir = daemon.state / "tiny" / "updates"
    assert not any((updates_dir / "downloads").iterdir()) and not (updates_dir / "bundles" / "v2").exists()
    assert daemon.update_state().get("refused", {}) == {}, "memory may be freed: tried again at the next check"
    assert os.path.exists(updates_dir / "tuf"), "the metadata was read"
