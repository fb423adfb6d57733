"""The delivery path's bookkeeping, with the threads' interleavings chosen by the test.

The daemon's own tests (``test_daemon_unattended``: the overflow counter behind a black hole) meet these orders only
when a busy machine happens to make them; here the network thread's part is played by the test, one step at a time,
against a real outbox and the real committer thread, so that the order that once lost count is the one that runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import waiting

pytestmark = pytest.mark.quick


class Network:
    """The network thread's side, stepped by the test: tasks posted with ``call_soon`` run only when it says, and
    the client's in-flight window has the room it sets. Publishes are recorded and never acknowledged (a broker
    behind a black hole)."""

    def __init__(self) -> None:
        self.posted: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.room = 0
        self.connected = threading.Event()
        self.connected.set()
        self.published: list[str] = []

    # MqttConnection's part
    def call_soon(self, task: Callable[[], None]) -> None:
        with self.lock:
            self.posted.append(task)

    def run_posted(self) -> int:
        with self.lock:
            tasks, self.posted = self.posted, []
        for task in tasks:
            task()
        return len(tasks)

    # MqttSink's part
    @property
    def ready(self) -> bool:
        return True

    def publish(self, topic: str, payload: bytes, **_: Any) -> bool:
        if self.room <= 0:
            return False
        self.room -= 1
        self.published.append(payload.decode())
        return True


def rows(first: int, count: int) -> list[tuple[str, bytes, float, None]]:
    return [("out", f"a{i}".encode(), 0.0, None) for i in range(first, first + count)]


@pytest.fixture
def delivery(tmp_path: Path) -> Any:
    from edgeline.daemon.delivery import Delivery
    from edgeline.daemon.health import Metrics
    from edgeline.daemon.outbox import Outbox

    network = Network()
    stopping = threading.Event()
    box = Outbox(tmp_path / "outbox.sqlite", max_answers=20)
    delivery = Delivery(
        box, network, network, Metrics(model="m", version=1),  # type: ignore[arg-type]
        max_queued=4, commit_interval_s=0.0, stopping=stopping,
    )  # fmt: skip
    delivery.start(lambda name, target: _started(threading.Thread(target=target, name=name, daemon=True)))
    yield delivery, network
    delivery.stop(deadline=0.0)
    box.close()


def _started(thread: threading.Thread) -> threading.Thread:
    thread.start()
    return thread


def committed(delivery: Any, network: Network, first: int, count: int) -> None:
    """The worker hands ``count`` answers over; back once the committer has posted its hand-over."""
    given = delivery._stored + count
    delivery.add(rows(first, count), [])
    assert waiting.wait_until(lambda: delivery._stored == given, timeout=30), "the committer never stored them"


def test_a_read_back_that_runs_before_the_count_of_a_drop_does_not_hide_the_dropped_answers(delivery: Any) -> None:
    """The order a busy device met: a commit drops the oldest answers (the outbox holds 20) while the network thread
    is behind; its next turn reads back what that commit left before the posted count of the drop has run. The
    answers dropped there were never handed to the client, so each must be counted as overflowed."""
    delivery, network = delivery
    committed(delivery, network, 0, 10)  # a0..a9
    network.run_posted()  # handed over: a0..a3 ready (4 queued at most), the rest wait in the outbox
    network.room = 4
    delivery.tick()  # a0..a3 to the client
    assert network.published == ["a0", "a1", "a2", "a3"]
    committed(delivery, network, 10, 30)  # 36 in the outbox: the 16 oldest (a4..a19) dropped, never handed out
    delivery.tick()  # the network thread's next turn, before the posted tasks (the drop's count) have run
    for _ in range(100):  # the black hole heals: every answer goes, turn after turn (bounded)
        network.run_posted()
        network.room = 4
        delivery.tick()
        if delivery.outbox.depth == 0 or len(network.published) + delivery.outbox.stats().overflowed >= 40:
            break
    overflowed = delivery.outbox.stats().overflowed
    assert overflowed == 40 - len(network.published), (overflowed, network.published)
    assert network.published == [f"a{i}" for i in [0, 1, 2, 3, *range(20, 40)]]


def test_a_count_of_drops_that_fails_does_not_stop_the_read_back_for_ever(delivery: Any) -> None:
    """The tick waits for the posted counts of drops; one that raises (the network thread logs it and goes on) must
    still let it read back what waits in the outbox."""
    delivery, network = delivery
    committed(delivery, network, 0, 10)
    network.run_posted()
    network.room = 4
    delivery.tick()
    committed(delivery, network, 10, 30)  # drops a4..a19
    failing = delivery.outbox.count_overflow
    delivery.outbox.count_overflow = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("counting failed"))
    with pytest.raises(RuntimeError):
        network.run_posted()  # MqttConnection logs a task's exception and runs the next
    delivery.outbox.count_overflow = failing
    network.run_posted()
    for _ in range(100):
        network.room = 4
        delivery.tick()
        network.run_posted()
        if len(network.published) >= 24:
            break
    assert network.published[4:] == [f"a{i}" for i in range(20, 40)], network.published
