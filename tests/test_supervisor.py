"""The supervisor: named threads, a dying thread fails the process, the watchdog is fed only on progress."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from edgeline.daemon.supervisor import Supervisor

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_each_thread_carries_its_name_in_the_kernel_for_top_and_ps() -> None:
    supervisor = Supervisor()
    seen: list[str] = []
    release = threading.Event()

    def read_own_name() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
        release.wait(5)

    thread = supervisor.spawn("edgeline-committer", read_own_name)
    release.set()
    thread.join(5)
    assert seen == ["edgeline-commit"]  # the kernel keeps 15 bytes
    assert not supervisor.failed.is_set()


def test_an_exception_escaping_a_thread_fails_the_process_with_its_name() -> None:
    supervisor = Supervisor()

    def broken() -> None:
        raise RuntimeError("a bug of ours")

    supervisor.spawn("edgeline-worker", broken).join(5)
    assert supervisor.failed.is_set()
    assert supervisor.failure == "thread edgeline-worker died (RuntimeError: a bug of ours)"
    assert not supervisor.healthy()


def test_the_watchdog_is_fed_when_idle_or_moving_and_not_when_stuck() -> None:
    supervisor = Supervisor()
    progress = supervisor.progress
    assert supervisor.healthy()  # idle
    progress.begin()
    assert not supervisor.healthy()  # busy with one item since the last tick, nothing finished: stuck
    progress.done()
    assert supervisor.healthy()  # finished something
    progress.begin()
    progress.done()
    progress.begin()
    assert supervisor.healthy()  # busy again, but one item finished since the last tick
