"""The worker thread: batches from the queue, through the processor, to the sinks.

    queue ──get_batch──► [swap.poll: between two batches] ──► Processor.process_batch ──► Sinks.deliver

Inference runs here and nowhere else (never on the MQTT network thread). The supervisor's progress brackets each
batch, so the watchdog stops while a batch is stuck and the service manager restarts the process. The update swap
is polled between two batches, as late as can be: a version proposed while this thread waited for input answers
from the next batch on; on an idle timeout too, so a trial still ends by its time.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from edgeline.daemon.health import Metrics
from edgeline.daemon.messages import Message
from edgeline.daemon.processor import Processor
from edgeline.daemon.queueing import BoundedQueue, QueueClosed, QueueEmpty
from edgeline.daemon.sinks import Sinks
from edgeline.daemon.supervisor import Progress

if TYPE_CHECKING:
    from edgeline.updates.swap import Swap

__all__ = ["Worker"]

log = logging.getLogger("edgeline.daemon")


class Worker:
    def __init__(
        self,
        queue: BoundedQueue[Message],
        processor: Processor,
        sinks: Sinks,
        metrics: Metrics,
        *,
        max_batch: int,
        progress: Progress,
        swap: Swap | None,
    ):
        self.queue = queue
        self.processor = processor
        self.sinks = sinks
        self.metrics = metrics
        self.max_batch = max_batch
        self.progress = progress
        self.swap = swap

    def run(self) -> None:
        """Until the queue is closed and empty: every input queued is answered."""
        while True:
            self.sinks.answer_evicted()
            try:
                batch = self.queue.get_batch(self.max_batch, timeout=0.5)
            except QueueEmpty:
                if self.swap is not None:  # a quiet stream: a trial that ends by its time, a revert, still happen
                    self._poll_swap(self.swap)
                continue
            except QueueClosed:
                self.sinks.answer_evicted()
                return
            if self.swap is not None:  # between two batches, as late as can be: a proposal made while this worker
                self._poll_swap(self.swap)  # waited for input answers from this batch on
            self.progress.begin()
            now = time.monotonic()
            for message in batch:
                self.metrics.observe("queued", max(0.0, now - message.queued))
            try:
                answers = self.processor.process_batch(batch)
            except Exception as exc:  # the processor answers every failure itself: this is a bug of ours
                log.error("processing failed: %s: %s", type(exc).__name__, exc, exc_info=True)
                answers = [self.processor.refuse(m, "inference-failed", f"{type(exc).__name__}: {exc}") for m in batch]
            self.sinks.deliver(list(zip(batch, answers, strict=True)))
            self.progress.done()

    def _poll_swap(self, swap: Swap) -> None:
        """Between two batches: where a new version starts answering, and where a trial ends."""
        model = self.processor.model
        try:
            swap.poll()
        except Exception as exc:  # a bug of ours must not cost the worker: the running version keeps answering
            log.error("the update swap failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        if self.processor.model is not model:
            self.metrics.version = self.processor.model.version
