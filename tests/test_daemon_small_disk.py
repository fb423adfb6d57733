"""A small disk is a budget, not a surprise (issue 35): the outbox takes at most a share of the state directory's
file system (``edgeline.disk``), its WAL included, and a daemon whose disk was full goes on once there is
room, with or without a restart.

The case of the issue, as a device meets it: a state directory of 3 MB (and 1 MB) that is full while 5,000 QoS 1
inputs arrive for the daemon's persistent session; then it is freed. Before the budget, the outbox's WAL grew to
2.2 MB on the freed 3 MB disk, filled it again, and the daemon took nothing more (a checkpoint needs room to copy the
log into the database before the log can shrink): 1,034 of 5,000 inputs were still unanswered after 5 minutes.
Each test counts distinct answers, waits for them bounded, and checks that nothing was dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.service import Daemon
from edgeline.disk import DISK_SHARE, files_bytes
from tests import waiting
from tests.faults import can_mount, ext4, fill, tmpfs
from tests.mqtt_broker import Broker, Collector
from tests.test_daemon_backpressure import answered, config_for, publish_all

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

COUNT = 5000
TIMEOUT_S = 120.0
"""A guard on each wait (on 2 busy cores 5,000 answers take a few seconds)."""
WARM_UP = range(COUNT, COUNT + 20)
"""Inputs answered before the disk fills: the daemon is subscribed and its outbox exists (ids past the 5,000)."""


@pytest.fixture(params=["ext4-3M", "tmpfs-1m"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """3 MB of ext4 (an SD card's file system, in a loop device: 1.6 MB of it free once made) or 1 MB of tmpfs."""
    kind, size = request.param.split("-")
    if not can_mount(kind):
        pytest.skip(f"mounting {kind} needs root, mount(8) (and for ext4 mkfs.ext4 and loop devices): CI has them")
    where = tmp_path / "disk"
    with ext4(where, size, tmp_path / "disk.img") if kind == "ext4" else tmpfs(where, size) as mounted:
        yield mounted


class DiskWatch:
    """Samples the outbox's files on the disk (database and WAL) in the background: the largest they took."""

    def __init__(self, outbox_path: Path) -> None:
        self.paths = (outbox_path, Path(f"{outbox_path}-wal"))
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, files_bytes(*self.paths))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def started(bundle: Path, config: DaemonConfig) -> Daemon:
    daemon = Daemon(bundle, config)
    daemon.start()
    return daemon


def full_while_inputs_arrive(broker: Broker, topic: str, daemon: Daemon, filler: Path, results: Collector) -> None:
    """Answer the warm-up, fill the disk, publish the 5,000 (the broker acknowledges them to the publisher: they
    wait in the daemon's session), and wait until the daemon's commits met the full disk."""
    publish_all(broker, topic, WARM_UP)
    assert len(answered(results, len(WARM_UP), timeout=TIMEOUT_S)) == len(WARM_UP)
    fill(filler)
    publish_all(broker, topic, range(COUNT))
    assert daemon.delivery is not None
    delivery = daemon.delivery
    assert waiting.wait_until(lambda: delivery.disk_full, timeout=TIMEOUT_S), "the commits never met the full disk"
    assert not daemon.supervisor.failed.is_set(), daemon.supervisor.failure


def all_answered(results: Collector) -> dict[str, dict[str, object]]:
    answers = answered(results, COUNT + len(WARM_UP), timeout=TIMEOUT_S)
    missing = {f"m{i}" for i in range(COUNT)} - set(answers)
    assert not missing, f"{len(missing)} of {COUNT} inputs never answered, e.g. {sorted(missing)[:5]}"
    assert not [a for a in answers.values() if "error" in a]
    return answers


def test_a_small_disk_full_while_5000_inputs_arrive_answers_every_one_after_a_restart(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, disk: Path
) -> None:
    """The issue's case at 3 MB and at 1 MB, with the default ``max_bytes`` (64 MiB, far more than the disk): full
    while the inputs arrive, then freed and the daemon started again: every input is answered, none dropped, and
    the outbox's files never take more than its share of the disk."""
    config = config_for(broker, unique_topic, disk / "state", daemon={"drain_timeout_s": 1.0})
    filler = disk / "filler"
    filler.touch()
    results = Collector(broker, f"{unique_topic}/out/#", timeout=TIMEOUT_S)
    first = started(built_litert_bundle, config)
    try:
        full_while_inputs_arrive(broker, unique_topic, first, filler, results)
    finally:
        first.stop()
    filler.unlink()
    daemon = started(built_litert_bundle, config)
    assert daemon.outbox is not None and daemon.outbox.path is not None
    budget = daemon.outbox.budget
    watch = DiskWatch(daemon.outbox.path)
    try:
        all_answered(results)
    finally:
        peak = watch.stop()
        status = daemon.status()
        daemon.stop()
        results.close()
    assert status["counts"]["outbox_overflowed"] == 0
    total = _disk_bytes(disk)
    assert budget <= DISK_SHARE * total + 1, f"a budget of {budget} bytes on a disk of {total}"
    assert peak <= budget, f"the outbox's files took {peak} bytes, past its budget of {budget}"
    assert status["outbox_budget_bytes"] <= DISK_SHARE * total + 1  # the budget in effect, in the status


def test_room_that_comes_back_is_taken_without_a_restart(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, disk: Path
) -> None:
    """The same, and the disk is freed under the running daemon: it takes the inputs the broker held and answers
    every one, without a restart (the committer measures the disk again before every retry)."""
    config = config_for(broker, unique_topic, disk / "state")
    filler = disk / "filler"
    filler.touch()
    results = Collector(broker, f"{unique_topic}/out/#", timeout=TIMEOUT_S)
    daemon = started(built_litert_bundle, config)
    try:
        full_while_inputs_arrive(broker, unique_topic, daemon, filler, results)
        filler.unlink()
        all_answered(results)
        assert daemon.delivery is not None
        delivery = daemon.delivery
        assert waiting.wait_until(lambda: not delivery.disk_full, timeout=TIMEOUT_S)
        status = daemon.status()
    finally:
        daemon.stop()
        results.close()
    assert status["counts"]["outbox_overflowed"] == 0 and status["counts"]["disk_full"] >= 1
    assert not daemon.supervisor.failed.is_set(), daemon.supervisor.failure


def _disk_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_blocks * info.f_frsize
