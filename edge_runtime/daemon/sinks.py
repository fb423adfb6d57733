"""Where the worker's answers go, and when their inputs are acknowledged.

    worker: deliver(inputs with their answers)
      ├─► broker: Delivery (outbox, then the network thread); the inputs' acks wait until the answers are stored
      ├─► the source's way back (a board's ANSWER frames), when the message carries one
      ├─► stdout (``echo``): one JSON line per answer
      └─► the inputs' acks: on the network thread (MQTT's PUBACKs), or at once

Every input is answered exactly once: ``deliver`` takes each input with all its answers, the inputs the queue gave
up (drop-oldest) included (``answer_evicted``). An input is acknowledged only after its answers are in the outbox,
so a crash leaves it unacknowledged at the broker, which sends it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from edgeline.daemon.delivery import Delivery
from edgeline.daemon.health import Metrics
from edgeline.daemon.intake import Intake
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.transport import Transport
from edgeline.lograte import Repeated

__all__ = ["Sinks"]

log = logging.getLogger("edgeline.daemon")


class Sinks:
    """The worker's side of the answers (see the module). ``delivery``: the broker's side, with a broker; its
    ``connection`` (a ``Transport``: ``edgeline.daemon.transport``) runs the inputs' acknowledgements on its
    thread."""

    def __init__(
        self,
        *,
        echo: Callable[[Answer], None] | None,
        intake: Intake,
        metrics: Metrics,
        connection: Transport | None,
        stopping: threading.Event,
        delivery: Delivery | None = None,
    ):
        self.echo = echo
        """Answers to stdout; set to None when the reader of stdout goes away."""
        self.intake = intake
        self.metrics = metrics
        self.connection = connection
        self.stopping = stopping
        self.delivery = delivery
        self.unpublishable_log = Repeated(log, "answers without a topic (their device cannot form one), not sent")
        self._echo_lock = threading.Lock()

    @property
    def answer_size(self) -> int:
        """Bytes of a recent answer as the outbox counts it (``Delivery.answer_size``; 256 without a broker)."""
        return self.delivery.answer_size if self.delivery is not None else 256

    def answer_evicted(self) -> None:
        """The inputs drop-oldest gave up, answered "dropped" (worker thread)."""
        evicted = self.intake.take_evicted()
        if evicted:
            self.deliver(evicted)

    def deliver(self, pairs: Sequence[tuple[Message, list[Answer]]]) -> None:
        """Hand the answers of these inputs to the sinks; then, and only then, acknowledge the inputs."""
        now = time.time()
        to_broker: list[tuple[str, bytes, float, bytes | None]] = []
        for m, answers in pairs:
            for a in answers:
                if a.topic is not None:
                    to_broker.append((a.topic, a.payload, m.received, None))
                if m.reply is not None:  # an MQTT 5 request: answered on its response topic too
                    to_broker.append((m.reply.topic, a.payload, m.received, m.reply.correlation))
        acks = [m.ack for m, _ in pairs if m.ack is not None]
        if self.delivery is not None and to_broker:
            self.delivery.add(to_broker, acks)  # the inputs are acknowledged once their answers are stored
            acks = []
        for message, answers in pairs:
            if message.on_answers is not None:
                try:  # the source's way back (a board's ANSWER frame): its failure must not cost the sinks
                    message.on_answers(answers)
                except Exception:
                    log.exception("sending the answers of a message from %s back to its source failed", message.device)
            for answer in answers:
                if answer.topic is None and self.echo is None:
                    self.metrics.count("unpublishable")
                    self.unpublishable_log.happened(1, f"e.g. {answer.payload[:300]!r}")
                self._echo(answer)
            if self.echo is not None and self.delivery is None:
                self.metrics.observe("publish", max(0.0, time.time() - now))
                self.metrics.observe("total", max(0.0, time.time() - message.received))
        self.intake.answered(len(pairs))
        if acks and self.connection is not None:
            self.connection.call_soon(lambda: _call_each(acks))
        else:
            _call_each(acks)

    def _echo(self, answer: Answer) -> None:
        if self.echo is None:
            return
        with self._echo_lock:
            try:
                self.echo(answer)
            except BrokenPipeError:  # the reader of stdout went away (| head): nobody to answer, so stop
                self.echo = None
                if self.connection is None:
                    log.warning("stdout was closed; stopping")
                    self.stopping.set()


def _call_each(calls: Sequence[Callable[[], None]]) -> None:
    for call in calls:
        call()
