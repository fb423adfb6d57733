"""What the daemon says about itself: gauges and counters (the status message and ``/metrics``), the retained
status message, the systemd watchdog, the summaries of repeated log lines.

    status thread (``run``), every tick: WATCHDOG=1 while the supervisor says the pipeline moves
      ─► a summary of each repeated condition that is due ─► the status message every ``status_interval_s``
    any thread: ``status()`` (the status message's body), ``publish_status()`` (now: an update's step)

It reads the other parts and changes none of them: the gauges and counters are read when a snapshot or a scrape
asks, on the asking thread.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

from edgeline.daemon.config import HealthConfig
from edgeline.daemon.health import Metrics, SystemdNotifier
from edgeline.daemon.intake import Intake, IntakeGate
from edgeline.daemon.messages import Message
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.network import NetworkTick
from edgeline.daemon.processor import Processor
from edgeline.daemon.queueing import BoundedQueue
from edgeline.daemon.sinks import Sinks
from edgeline.daemon.sources import Source
from edgeline.daemon.supervisor import Supervisor
from edgeline.lograte import Repeated

if TYPE_CHECKING:
    from edgeline.updates.agent import UpdateAgent

__all__ = ["Reporter"]

Reading = dict[str, float | int | bool | None]


class Reporter:
    """The status thread and the readings behind the status message (see the module). ``network``: with a broker;
    the readings of the outbox and the gate appear once the daemon has started and opened its outbox."""

    def __init__(
        self,
        *,
        health: HealthConfig,
        metrics: Metrics,
        queue: BoundedQueue[Message],
        processor: Processor,
        intake: Intake,
        sinks: Sinks,
        source: Source,
        connection: MqttConnection | None,
        updater: UpdateAgent | None,
        client_id: str,
        status_topic: str,
        notifier: SystemdNotifier,
        supervisor: Supervisor,
        stopping: threading.Event,
        network: NetworkTick | None = None,
    ):
        self.health = health
        self.metrics = metrics
        self.queue = queue
        self.processor = processor
        self.intake = intake
        self.sinks = sinks
        self.source = source
        self.connection = connection
        self.updater = updater
        self.client_id = client_id
        self.status_topic = status_topic
        self.notifier = notifier
        self.supervisor = supervisor
        self.stopping = stopping
        self._network = network
        metrics.gauges(self.gauges)
        metrics.counters(self.counters)
        source.register_metrics(metrics)
        if updater is not None:
            metrics.counters(updater.counters)
            metrics.gauges(updater.gauges)
            metrics.labelled_counters("update_refused", "reason", "Updates refused, by reason.", updater.refusal_counts)

    @property
    def network(self) -> NetworkTick | None:
        """The network thread's side, once its outbox is open (at start); None before, or without a broker."""
        network = self._network
        return network if network is not None and network.delivery.opened else None

    def _gate(self) -> IntakeGate | None:
        """The intake gate, read from start on (it is made with the delivery path, whose outbox opens at start)."""
        return self.intake.gate if self.network is not None else None

    def gauges(self) -> Reading:
        stats = self.queue.stats()
        gauges: Reading = {
            "queue_depth": stats.depth,
            "queue_capacity": stats.capacity,
            "batch_size": self.processor.model.batch_size,
            # back-pressure: the source waits for room (block policy); the worker waits for input
            "source_blocked": self.queue.waiting_puts > 0,
            "worker_idle": self.queue.waiting_gets > 0,
        }
        if self.connection is not None:
            gauges["connected"] = self.connection.connected.is_set()
            gauges["in_flight"] = self.connection.in_flight
        gate = self._gate()
        if gate is not None:
            gauges["intake_paused"] = gate.is_shut
            gauges["intake_held"] = len(self.intake.held)
        if self.network is not None:
            delivery = self.network.delivery
            box = delivery.outbox.stats()
            gauges.update(
                outbox_depth=box.depth,
                outbox_bytes=box.bytes,
                outbox_oldest_age_seconds=box.oldest_age_s if box.oldest_age_s is not None else 0.0,
                disk_full=delivery.disk_full,
                outbox_budget_bytes=box.budget_bytes,
                outbox_disk_bytes=box.disk_bytes,
                state_free_bytes=box.free_bytes,
            )
        return gauges

    def counters(self) -> Reading:
        counters: Reading = {}
        if self.connection is not None:
            counters.update(
                reconnects=self.connection.reconnects,
                publish_stalls=self.connection.stalls,
                session_takeovers=self.connection.backoff.takeovers,
            )
        if self.network is not None:
            box = self.network.delivery.outbox.stats()
            counters.update(
                outbox_expired=box.expired, outbox_overflowed=box.overflowed, outbox_corrupt=box.corrupt,
                outbox_replaced=box.replaced,
            )  # fmt: skip
        gate = self._gate()
        if gate is not None:
            counters["intake_paused_seconds"] = int(gate.paused_seconds())
        counters["inputs_redelivered"] = self.intake.shed_total
        counters.update(self.source.counters())  # what the source's link counted (the framed serial source)
        return counters

    def status(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"queue_policy": self.queue.policy.value, "client_id": self.client_id}
        if self.metrics.emulated is not None:  # its latencies are the emulator's
            extra["emulated"] = self.metrics.emulated
        if self.metrics.accelerator is not None:
            extra["accelerator"] = dict(self.metrics.accelerator)
        source_status = self.source.status()
        if source_status is not None:  # the framed serial source: its board and what the wire did
            extra["source"] = source_status
        if self.updater is not None:
            extra["update"] = self.updater.status()
        extra.update(self.source.report())
        return self.metrics.snapshot(extra)

    def publish_status(self) -> None:
        """The status message now (an update's step), besides its period."""
        if self.connection is not None:
            self.connection.publish(self.status_topic, json.dumps(self.status()).encode(), qos=1, retain=True)

    def run(self) -> None:
        """The status thread, until ``stopping``."""
        interval = self.health.status_interval_s
        watchdog = self.notifier.watchdog_interval_s
        tick = min(interval, watchdog, 10.0) if watchdog else min(interval, 10.0)
        next_status = time.monotonic() + interval
        while not self.stopping.wait(tick):
            if watchdog and self.supervisor.healthy():
                self.notifier.notify("WATCHDOG=1")
            for repeated in self.repeated():
                repeated.tick()
            if time.monotonic() >= next_status and self.connection is not None:
                next_status += interval
                self.connection.publish(self.status_topic, json.dumps(self.status()).encode(), qos=0, retain=True)

    def repeated(self) -> list[Repeated]:
        """The conditions whose logs are summarised (see ``edgeline.lograte``)."""
        found = [self.sinks.unpublishable_log, self.processor.failures_log, self.processor.evictions_log]
        if self.connection is not None:
            found.append(self.connection.bad_topic_log)
        if self.network is not None:
            delivery = self.network.delivery
            found += [self.network.shed_log, delivery.refused_log]
            found += [delivery.outbox.overflow_log, delivery.outbox.expiry_log, delivery.full_log]
        gate = self._gate()
        if gate is not None:
            found.append(gate.pauses)
        return found
