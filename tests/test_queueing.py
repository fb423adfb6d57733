"""The bounded queue: real threads, no timing assertions; every wait is bounded, so a bug fails instead of hanging."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeline.daemon.queueing import BoundedQueue, DropPolicy, QueueClosed, QueueEmpty, QueueFull, QueueStats

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

LIMIT = 30.0  # seconds: only ever reached when something is broken
# A blocked thread waits longer than the test waits for it: a wake-up that never comes fails the test.
BLOCKED = 2 * LIMIT


def conserved(stats: QueueStats) -> bool:
    return stats.enqueued == stats.dequeued + stats.dropped + stats.depth


def run(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def finish(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(LIMIT)
        assert not thread.is_alive(), "a thread is stuck"


def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) until ``condition`` holds, e.g. until another thread is really blocked."""
    pause = threading.Event()
    for _ in range(int(LIMIT / 0.001)):
        if condition():
            return
        pause.wait(0.001)
    raise AssertionError("condition never held")


# ---------------------------------------------------------------------------------------------------------------------
# single thread


@settings(deadline=None, max_examples=200)
@given(capacity=st.integers(1, 8), items=st.lists(st.integers(), max_size=40))
def test_drop_oldest_keeps_the_newest_capacity_items_in_order_and_returns_the_evicted(
    capacity: int, items: list[int]
) -> None:
    q: BoundedQueue[int] = BoundedQueue(capacity, DropPolicy.DROP_OLDEST)
    evicted = [e for item in items if (e := q.put(item)) is not None]
    kept = [q.get(timeout=0) for _ in range(len(q))]
    assert kept == items[-capacity:]
    assert evicted == items[: max(0, len(items) - capacity)]
    stats = q.stats()
    assert stats == QueueStats(
        enqueued=len(items),
        dequeued=len(kept),
        dropped=len(evicted),
        rejected=0,
        depth=0,
        capacity=capacity,
        policy=DropPolicy.DROP_OLDEST,
    )


@settings(deadline=None, max_examples=200)
@given(
    capacity=st.integers(1, 6),
    policy=st.sampled_from(DropPolicy),
    operations=st.lists(st.one_of(st.integers(0, 99), st.integers(1, 4).map(lambda n: -n))),
)
def test_any_sequence_of_puts_and_batch_gets_behaves_like_a_plain_fifo_and_conserves_counts(
    capacity: int, policy: DropPolicy, operations: list[int]
) -> None:
    """Positive numbers are puts, -n is get_batch(n); a plain list is the reference."""
    q: BoundedQueue[int] = BoundedQueue(capacity, policy)
    reference: list[int] = []
    for operation in operations:
        if operation < 0:
            if reference:
                expected, reference = reference[:-operation], reference[-operation:]
                assert q.get_batch(-operation, timeout=0) == expected
            else:
                with pytest.raises(QueueEmpty):
                    q.get_batch(-operation, timeout=0)
        elif len(reference) < capacity:
            assert q.put(operation, timeout=0) is None
            reference.append(operation)
        elif policy is DropPolicy.DROP_OLDEST:
            assert q.put(operation, timeout=0) == reference.pop(0)
            reference.append(operation)
        else:
            with pytest.raises(QueueFull):
                q.put(operation, timeout=0)
        stats = q.stats()
        assert conserved(stats)
        assert stats.depth == len(q) == len(reference) <= capacity
        assert policy is DropPolicy.DROP_OLDEST or stats.dropped == 0


def test_a_full_block_queue_refuses_after_the_timeout_and_keeps_what_it_has() -> None:
    q: BoundedQueue[str] = BoundedQueue(2, DropPolicy.BLOCK)
    assert q.put("a") is None and q.put("b") is None
    with pytest.raises(QueueFull) as info:
        q.put("c", timeout=0.01)
    assert isinstance(info.value, queue.Full)
    assert [q.get(timeout=0), q.get(timeout=0)] == ["a", "b"]
    assert q.stats().rejected == 1 and q.stats().dropped == 0


def test_an_empty_queue_raises_queue_empty_after_the_timeout() -> None:
    q: BoundedQueue[int] = BoundedQueue(1, DropPolicy.BLOCK)
    with pytest.raises(QueueEmpty) as info:
        q.get(timeout=0.01)
    assert isinstance(info.value, queue.Empty)
    with pytest.raises(QueueEmpty):
        q.get_batch(4, timeout=0)


def test_get_batch_takes_what_is_queued_up_to_the_limit_oldest_first() -> None:
    q: BoundedQueue[int] = BoundedQueue(10, DropPolicy.BLOCK)
    for item in range(7):
        q.put(item)
    assert q.get_batch(4, timeout=0) == [0, 1, 2, 3]
    assert q.get_batch(4, timeout=0) == [4, 5, 6]
    with pytest.raises(ValueError, match="max_items"):
        q.get_batch(0)


def test_a_closed_queue_refuses_puts_but_hands_out_what_it_holds() -> None:
    q: BoundedQueue[int] = BoundedQueue(4, DropPolicy.DROP_OLDEST)
    q.put(1)
    q.put(2)
    q.close()
    assert q.closed
    with pytest.raises(QueueClosed):
        q.put(3)
    assert q.get_batch(1) == [1]
    assert q.get() == 2
    with pytest.raises(QueueClosed):
        q.get()  # no timeout: a closed, drained queue answers at once
    with pytest.raises(QueueClosed):
        q.get_batch(3)
    assert conserved(q.stats()) and q.stats().rejected == 1


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_queue_holds_at_least_one_item(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        BoundedQueue(capacity, DropPolicy.BLOCK)


def test_the_policy_reads_as_its_configuration_value() -> None:
    assert DropPolicy("drop-oldest") is DropPolicy.DROP_OLDEST and DropPolicy("block") is DropPolicy.BLOCK
    assert BoundedQueue(1, DropPolicy("block")).stats().policy == "block"


# ---------------------------------------------------------------------------------------------------------------------
# threads


@pytest.mark.parametrize("policy", list(DropPolicy))
def test_producers_and_consumers_conserve_every_item(policy: DropPolicy) -> None:
    q: BoundedQueue[tuple[int, int]] = BoundedQueue(8, policy)
    producers, per_producer = 4, 2000
    received: list[list[tuple[int, int]]] = [[] for _ in range(3)]
    evicted: list[tuple[int, int]] = []
    evicted_lock = threading.Lock()

    def produce(producer: int) -> Callable[[], None]:
        def body() -> None:
            for index in range(per_producer):
                old = q.put((producer, index), timeout=LIMIT)
                if old is not None:
                    with evicted_lock:
                        evicted.append(old)

        return body

    def consume(into: list[tuple[int, int]]) -> Callable[[], None]:
        def body() -> None:
            while True:
                try:
                    into.extend(q.get_batch(3, timeout=LIMIT))
                except QueueClosed:
                    return

        return body

    consumers = [run(consume(into)) for into in received]
    finish(*[run(produce(p)) for p in range(producers)])
    q.close()
    finish(*consumers)

    stats = q.stats()
    taken = [item for into in received for item in into]
    assert conserved(stats) and stats.depth == 0
    assert stats.enqueued == producers * per_producer
    assert stats.dequeued == len(taken) and stats.dropped == len(evicted)
    # Every item was either handed to a consumer or returned to its producer as evicted: once, never both.
    assert sorted(taken + evicted) == [(p, i) for p in range(producers) for i in range(per_producer)]
    if policy is DropPolicy.BLOCK:
        assert evicted == [] and stats.dropped == 0
    for into in received:  # one producer's items reach any one consumer in the order they were put
        for producer in range(producers):
            indices = [index for p, index in into if p == producer]
            assert indices == sorted(indices)


def test_close_wakes_a_consumer_blocked_on_an_empty_queue() -> None:
    q: BoundedQueue[int] = BoundedQueue(1, DropPolicy.BLOCK)
    outcome: list[BaseException] = []

    def consumer() -> None:
        try:
            q.get(timeout=BLOCKED)
        except (QueueClosed, QueueEmpty) as exc:
            outcome.append(exc)

    thread = run(consumer)
    until(lambda: q.waiting_gets == 1)
    q.close()
    finish(thread)
    assert len(outcome) == 1 and isinstance(outcome[0], QueueClosed)


def test_close_wakes_a_producer_blocked_on_a_full_queue_without_enqueueing() -> None:
    q: BoundedQueue[int] = BoundedQueue(1, DropPolicy.BLOCK)
    q.put(1)
    outcome: list[BaseException] = []

    def producer() -> None:
        try:
            q.put(2, timeout=BLOCKED)
        except (QueueClosed, QueueFull) as exc:
            outcome.append(exc)

    thread = run(producer)
    until(lambda: q.waiting_puts == 1)
    q.close()
    finish(thread)
    assert len(outcome) == 1 and isinstance(outcome[0], QueueClosed)
    assert q.get_batch(5, timeout=0) == [1]
    assert q.stats().enqueued == 1


def test_a_blocked_producer_resumes_when_a_consumer_makes_room() -> None:
    q: BoundedQueue[int] = BoundedQueue(1, DropPolicy.BLOCK)
    q.put(1)
    thread = run(lambda: q.put(2, timeout=BLOCKED))
    until(lambda: q.waiting_puts == 1)
    assert q.get(timeout=LIMIT) == 1
    finish(thread)
    assert q.get(timeout=LIMIT) == 2
    assert q.stats().dropped == 0 and q.stats().rejected == 0
