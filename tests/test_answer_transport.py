"""The answer path over its transport interface (``edgeline.daemon.transport``), without a broker.

``MemoryTransport`` below is a broker in memory, written here as the interface means it to be: tasks posted with
``call_soon`` run when the test turns the network thread's loop (``turn``), publishes wait in an in-flight window
until the test acknowledges or refuses them. The sinks, the delivery path and ``MqttSink`` run as the daemon runs
them, with a real outbox in memory; the real-broker tests (``test_daemon``, ``test_daemon_unattended``) test the
connection itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from edgeline.daemon.assembly import ANSWER_FORMATS
from edgeline.daemon.delivery import Delivery
from edgeline.daemon.health import Metrics
from edgeline.daemon.intake import Intake
from edgeline.daemon.messages import Answer, Message, Reply
from edgeline.daemon.mqtt import MqttSink
from edgeline.daemon.outbox import MemoryOutbox
from edgeline.daemon.queueing import BoundedQueue, DropPolicy
from edgeline.daemon.sinks import Sinks
from edgeline.daemon.transport import AnswerFormat, PublishDone, Transport

pytestmark = pytest.mark.quick

TURNS = 100
"""Turns of the network thread's loop a test takes at most to let everything it expects happen."""


@dataclass
class Sent:
    topic: str
    payload: bytes
    qos: int
    form: AnswerFormat | None
    correlation: bytes | None
    expiry_at: float | None
    done: PublishDone | None


class MemoryTransport:
    """A broker connection in memory, as ``Transport`` says one is (see the module)."""

    def __init__(self, window: int = 4) -> None:
        self.connected = threading.Event()
        self.connected.set()
        self.window = window
        self.full = False
        """The client's queue is full: ``publish`` takes nothing (try later)."""
        self.posted: list[Callable[[], None]] = []
        self.in_flight: list[Sent] = []
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self.tick: Callable[[], None] | None = None

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int,
        retain: bool = False,
        expiry_at: float | None = None,
        form: AnswerFormat | None = None,
        correlation: bytes | None = None,
        done: PublishDone | None = None,
    ) -> bool:
        if self.full:
            return False
        sent = Sent(topic, payload, qos, form, correlation, expiry_at, done)
        self.sent.append(sent)
        if qos == 0:
            if done is not None:
                done(True, None)
        else:
            self.in_flight.append(sent)
        return True

    def call_soon(self, task: Callable[[], None]) -> None:
        with self._lock:
            self.posted.append(task)

    @property
    def room(self) -> int:
        return self.window - len(self.in_flight)

    # -- the test's side -------------------------------------------------------------------------------------
    def turn(self) -> None:
        """One turn of the network thread's loop: the posted tasks, in order, then the tick."""
        with self._lock:
            tasks, self.posted = self.posted, []
        for task in tasks:
            task()
        if self.tick is not None:
            self.tick()

    def acknowledge(self, count: int, *, ok: bool = True, reason: str | None = None) -> None:
        """The broker's PUBACK (or refusal) of the ``count`` oldest publishes in flight."""
        for _ in range(count):
            sent = self.in_flight.pop(0)
            if sent.done is not None:
                sent.done(ok, reason)


@dataclass
class AnswerPath:
    transport: MemoryTransport
    outbox: MemoryOutbox
    delivery: Delivery
    sinks: Sinks
    metrics: Metrics
    acked: list[str]
    echoed: list[Answer]


def answer_path(*, window: int = 4, max_queued: int = 8, echo: bool = False) -> AnswerPath:
    """The daemon's answer path (sinks → delivery → MqttSink) over a ``MemoryTransport``, with a memory outbox."""
    transport = MemoryTransport(window)
    metrics = Metrics(model="m", version=1)
    stopping = threading.Event()
    outbox = MemoryOutbox(max_answers=100)
    sink = MqttSink(transport, 1, ANSWER_FORMATS["json"])
    delivery = Delivery(
        outbox, transport, sink, metrics, max_queued=max_queued, commit_interval_s=0.0, stopping=stopping
    )
    transport.tick = delivery.tick
    intake = Intake(BoundedQueue(16, DropPolicy.BLOCK), refuse=lambda m, code, text: [], metrics=metrics,
                    stopping=stopping)  # fmt: skip
    echoed: list[Answer] = []
    sinks = Sinks(
        echo=echoed.append if echo else None, intake=intake, metrics=metrics, connection=transport,
        stopping=stopping, delivery=delivery,
    )  # fmt: skip
    return AnswerPath(transport, outbox, delivery, sinks, metrics, [], echoed)


def inputs(
    path: AnswerPath, first: int, count: int, *, reply: Reply | None = None
) -> list[tuple[Message, list[Answer]]]:
    """``count`` inputs, each answered once; an input's ack records its name in ``path.acked``."""
    pairs = []
    for i in range(first, first + count):
        name = f"m{i}"
        message = Message(topic=f"in/{name}", payload=b"{}", device=name, ack=lambda n=name: path.acked.append(n),
                          reply=reply)  # fmt: skip
        answer = Answer(topic=f"out/{name}", payload=f'{{"id":"{name}"}}'.encode(), record={"id": name},
                        is_error=False)  # fmt: skip
        pairs.append((message, [answer]))
    return pairs


def counted(metrics: Metrics, name: str) -> int:
    return int(metrics.snapshot()["counts"].get(name, 0))


def turn_until(path: AnswerPath, done: Callable[[], bool]) -> bool:
    for _ in range(TURNS):
        if done():
            return True
        path.transport.turn()
    return done()


def test_the_mqtt_connection_and_an_in_memory_transport_are_both_transports() -> None:
    from edgeline.daemon.config import BrokerConfig
    from edgeline.daemon.mqtt import MqttConnection

    connection = MqttConnection(BrokerConfig(), client_id="edgeline-test-transport")
    try:
        assert isinstance(connection, Transport)
        assert isinstance(MemoryTransport(), Transport)
        assert not isinstance(object(), Transport)
    finally:
        connection.close(0)


def test_an_answer_is_published_once_stored_and_leaves_the_outbox_on_the_brokers_acknowledgement() -> None:
    path = answer_path()
    path.sinks.deliver(inputs(path, 0, 1))
    assert path.transport.sent == [] and path.acked == []  # nothing leaves before the network thread's turn
    path.transport.turn()
    assert path.acked == ["m0"]  # the input's PUBACK: its answer is stored
    [sent] = path.transport.sent
    assert (sent.topic, sent.payload, sent.qos) == ("out/m0", b'{"id":"m0"}', 1)
    assert sent.form == AnswerFormat("application/json", utf8=True) and sent.expiry_at is not None
    assert path.outbox.depth == 1 and counted(path.metrics, "published") == 0
    path.transport.acknowledge(1)
    assert path.outbox.depth == 0 and counted(path.metrics, "published") == 1
    assert path.delivery.level() == (0, 0)


def test_an_mqtt5_request_is_answered_on_its_response_topic_with_its_correlation_data() -> None:
    path = answer_path()
    path.sinks.deliver(inputs(path, 0, 1, reply=Reply("replies/here", b"corr-1")))
    path.transport.turn()
    assert [(s.topic, s.correlation) for s in path.transport.sent] == [("out/m0", None), ("replies/here", b"corr-1")]


def test_answers_wait_while_the_transport_is_disconnected_then_go_in_order_within_the_window() -> None:
    path = answer_path(window=4, max_queued=8)
    path.transport.connected.clear()
    path.sinks.deliver(inputs(path, 0, 10))
    for _ in range(3):
        path.transport.turn()
    assert path.transport.sent == [] and path.outbox.depth == 10
    assert path.acked == [f"m{i}" for i in range(10)]  # stored: acknowledged, whatever the link does
    path.transport.connected.set()
    path.transport.turn()
    assert [s.topic for s in path.transport.sent] == [f"out/m{i}" for i in range(4)]  # the window: 4 in flight
    for _ in range(TURNS):
        if not path.transport.in_flight:
            break
        path.transport.acknowledge(len(path.transport.in_flight))
        path.transport.turn()
    assert [s.topic for s in path.transport.sent] == [f"out/m{i}" for i in range(10)]  # each once, in order
    assert path.outbox.depth == 0 and counted(path.metrics, "published") == 10


def test_an_answer_the_transport_cannot_take_now_is_offered_again_at_the_next_turn() -> None:
    path = answer_path()
    path.transport.full = True
    path.sinks.deliver(inputs(path, 0, 2))
    path.transport.turn()
    assert path.transport.sent == [] and path.outbox.depth == 2
    path.transport.full = False
    assert turn_until(path, lambda: len(path.transport.sent) == 2)
    assert [s.topic for s in path.transport.sent] == ["out/m0", "out/m1"]


def test_an_answer_the_broker_refuses_is_counted_removed_and_not_sent_again() -> None:
    path = answer_path()
    path.sinks.deliver(inputs(path, 0, 1))
    path.transport.turn()
    path.transport.acknowledge(1, ok=False, reason="quota exceeded")
    for _ in range(3):
        path.transport.turn()
    assert len(path.transport.sent) == 1 and path.outbox.depth == 0
    assert counted(path.metrics, "publish_refused") == 1 and counted(path.metrics, "published") == 0


def test_an_answer_that_expired_waiting_for_a_resend_is_counted_expired_once() -> None:
    path = answer_path()
    path.sinks.deliver(inputs(path, 0, 1))
    path.transport.turn()
    path.transport.acknowledge(1, ok=False, reason="expired")
    assert path.outbox.depth == 0 and path.outbox.stats().expired == 1
    assert counted(path.metrics, "publish_refused") == 0 and counted(path.metrics, "published") == 0


def test_without_a_delivery_path_the_inputs_are_acknowledged_on_the_transports_thread() -> None:
    """Answers to stdout only while the input came from the broker (``--stdout``): the PUBACKs still go on the
    transport's own thread, posted, never from the worker."""
    path = answer_path(echo=True)
    sinks = Sinks(echo=path.echoed.append, intake=path.sinks.intake, metrics=path.metrics, connection=path.transport,
                  stopping=threading.Event())  # fmt: skip
    sinks.deliver(inputs(path, 0, 2))
    assert [a.record["id"] for a in path.echoed] == ["m0", "m1"] and path.acked == []
    path.transport.turn()
    assert path.acked == ["m0", "m1"] and path.transport.sent == []


def test_the_intake_gate_estimate_follows_the_size_of_the_answers_stored() -> None:
    from edgeline.daemon.outbox import row_size

    path = answer_path()
    assert path.sinks.answer_size == 256  # before any answer: the estimate
    path.sinks.deliver(inputs(path, 0, 1))
    assert path.sinks.answer_size == path.delivery.answer_size == row_size("out/m0", b'{"id":"m0"}')
