"""``edgeline run``: a bundle and a stream of sensor messages turned into a stream of answers.

    source thread ──submit──► bounded queue ──► worker: Processor ──► committer ──► outbox ──► MQTT network thread
    (MQTT: the network     (drop-oldest: the    (one answer per input;  │ (SQLite WAL;   then one   (publishes at QoS 1,
     thread; serial,        evicted input is     a failure is that      │  group commit,  hand-over  then the inputs'
     replay, sim)           answered "dropped")  input's coded error)   │  one fsync)     per batch  PUBACKs; an answer
                                                                        │                            leaves the outbox
                                                                        └──► stdout JSON lines      after its PUBACK)
    status thread: status message, systemd WATCHDOG (only while the pipeline progresses); availability: retained
    "online" on every connection, "offline" as last will and at a clean stop; a supervisor owns every thread
    (see ``edgeline.daemon.supervisor``)

Where each part lives (this module only starts and stops them and owns the signals):

    assembly.py   opening, checking and building every part ready (``assemble``): the model, the update state,
                  names and topics, processor, queue, connection, source, delivery, the update agent; the outbox
                  opens at start (``open_outbox``)
    intake.py     source thread (or network thread) → queue, through the intake gate
    worker.py     worker thread: queue → Processor → Sinks, the update swap between two batches
    sinks.py      the answers: to the delivery path (outbox, broker), stdout, the source's way back; then the acks
    network.py    the network thread's turn: "online", held inputs, redelivery, the delivery pump; the gate's level
    reporting.py  status thread: gauges, counters, the status message, the watchdog, log summaries

Every source is alike: MQTT is one (``edgeline.daemon.mqtt``), and so are serial, replay and sim. The broker
is also the sink of answers whenever it is used; stdout is the other sink. Without a broker, answers go to stdout.

SIGTERM or SIGINT: stop taking new input without unsubscribing, answer what is queued, flush the outbox as far as
the broker allows (``[daemon] drain_timeout_s``), say offline, disconnect (the session stays: what was not
answered is redelivered to the next run), exit 0. A finite source (a replay file, a bounded simulation) ends the
same way once it is exhausted. A thread that dies, or a live source that ends, exits 1.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeline.daemon.assembly import Assembled, accelerator_of, assemble, outbox_room
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.delivery import Delivery
from edgeline.daemon.health import MetricsServer, SystemdNotifier
from edgeline.daemon.intake import IntakeGate
from edgeline.daemon.messages import Answer
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.outbox import OutboxInterface
from edgeline.daemon.queueing import QueueClosed
from edgeline.daemon.sources import Source
from edgeline.daemon.state import StateLock
from edgeline.errors import EdgelineError
from edgeline.model import Model

__all__ = ["EXIT_FAILED", "Daemon", "Service"]

log = logging.getLogger("edgeline.daemon")
EXIT_FAILED = 1
"""A daemon that could not go on (a thread died, a live source ended): systemd's Restart=on-failure restarts it."""
Spawn = Callable[[str, Callable[[], None]], threading.Thread]


class Service:
    """The composition root: it takes the parts ``edgeline.daemon.assembly.assemble`` built ready and owns their
    threads' lifecycle (``start``, ``stop``, ``run_until_signalled``). Its constructor does no I/O: ``start`` opens
    what is held only while running (the source, the state directory's lock, the outbox, the broker's connection)
    and starts the threads.

        parts: Intake (source → queue) · Worker (queue → Processor → Sinks) · Sinks (→ Delivery, stdout, the
        source's way back) · NetworkTick (the MQTT loop's turn, the gate's level) · Reporter (status, watchdog)
    """

    def __init__(self, assembled: Assembled):
        parts = assembled.parts
        self.config: DaemonConfig = parts.config
        self.processor, self.queue, self.metrics = parts.processor, parts.queue, parts.metrics
        self.source, self.connection, self.sink = parts.source, parts.connection, parts.sink
        self.state_dir, self.instance, self.filters = parts.state_dir, parts.instance, parts.filters
        self.client_id, self.expected_payload = parts.client_id, parts.expected_payload
        self.availability_topic, self.status_topic = parts.availability_topic, parts.status_topic
        self._lock: StateLock | None = parts.lock
        self.supervisor, self.stopping = assembled.supervisor, assembled.stopping
        self.source_done = threading.Event()
        self.notifier = assembled.notifier
        self.silence = assembled.silence
        self.intake, self.sinks, self.reporter, self.worker = (
            assembled.intake,
            assembled.sinks,
            assembled.reporter,
            assembled.worker,
        )
        self.network = assembled.network
        self._delivery = assembled.delivery
        """The broker's side of the answers (outbox, committer): its outbox opens at start, with a broker."""
        self.updater, self.swap = assembled.updater, assembled.swap
        self._metrics_server: MetricsServer | None = None
        self._worker_thread: threading.Thread | None = None
        self._source_failed = False
        self.reload_requested = False
        """SIGHUP: drain like SIGTERM, then the command starts itself again (new configuration and bundle)."""

    # -- what the CLI, the tests and the status read ---------------------------------------------------------
    @property
    def model(self) -> Model:
        """The version answering now (the update swap changes it between two batches)."""
        return self.processor.model

    @property
    def echo(self) -> Callable[[Answer], None] | None:
        """Answers to stdout; None without, or once the reader of stdout went away."""
        return self.sinks.echo

    @property
    def delivery(self) -> Delivery | None:
        """The broker's side of the answers (outbox, committer), from ``start`` on; None before, or without a
        broker."""
        delivery = self._delivery
        return delivery if delivery is not None and delivery.opened else None

    @property
    def gate(self) -> IntakeGate | None:
        """Flow control for a source that can wait (block policy) publishing to the broker; None otherwise."""
        return self.intake.gate

    @property
    def outbox(self) -> OutboxInterface | None:
        """Where answers wait for the broker (None without a broker, or before ``start``)."""
        return self.delivery.outbox if self.delivery is not None else None

    @property
    def accelerator(self) -> dict[str, str | None] | None:
        """What the bundle was built for and what runs it here; None for a bundle built for the CPU."""
        return accelerator_of(self.model)

    def status(self) -> dict[str, Any]:
        """The status message's body (``edgeline.daemon.reporting``)."""
        return self.reporter.status()

    def _outbox_room(self) -> int:
        """The bytes the durable outbox may still grow into on the state directory's disk (``outbox_room``)."""
        return outbox_room(self.config.outbox, self.delivery)

    @property
    def description(self) -> str:
        sinks = []
        if self.connection is not None:
            path = self.delivery.outbox.path if self.delivery is not None else None
            outbox = f", outbox {path}" if path is not None else ", outbox in memory"
            sinks.append(f"answers to {self.connection.address} at QoS {self.config.output.qos}{outbox}")
        if self.echo is not None:
            sinks.append("answers to stdout")
        return f"reading {self.source.description}; {'; '.join(sinks)}; instance {self.instance}"

    @property
    def expectation(self) -> str:
        image = self.model.manifest.image
        if self.config.source.kind == "camera" and image is not None:
            return f"each frame made into the model's input by the bundle's pre-processing: {image.describe()}"
        where = ""
        if self.source.subscribed:
            where = f" on {', '.join(f.pattern for f in self.filters)} (the device is the first + level)"
        return f"expecting {self.config.input.codec} messages{where}, e.g. {self.expected_payload}"

    def _warn_silent(self) -> None:
        assert self.silence is not None
        for pattern in self.silence.newly_silent():
            log.warning(
                "nothing received on %s for %g s: is anything publishing there? %s messages for this model look like "
                "%s ([input] silence_warning_s sets this delay; 0: no warning)",
                pattern, self.silence.after_s, self.config.input.codec, self.expected_payload,
            )  # fmt: skip

    # -- source thread -----------------------------------------------------------------------------------------
    def _read_source(self) -> None:
        try:
            self.source.run(self.intake.submit, self.stopping)
        except QueueClosed:
            pass
        except EdgelineError as exc:
            log.error("%s", exc)
            self._source_failed = True
        except Exception as exc:
            log.error("the source failed: %s: %s", type(exc).__name__, exc, exc_info=True)
            self._source_failed = True
        finally:
            if not self.source.finite and not self.stopping.is_set():
                self._source_failed = True
                log.error("the source %s ended", self.source.description)
            self.source_done.set()

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.model.accelerator_fallback is not None:  # loud: slower by design, never a silent surprise
            log.warning("%s: %s", self.model.name, self.model.accelerator_fallback)
        self.source.open()
        spawn = self.supervisor.spawn
        if self.connection is not None:
            assert self._delivery is not None
            self._start_broker(self.connection, self._delivery, spawn)
        if self.config.health.prometheus_port:
            health = self.config.health
            self._metrics_server = MetricsServer(self.metrics, health.prometheus_port, health.prometheus_host).start()
        self._worker_thread = spawn("edgeline-worker", self.worker.run)
        spawn("edgeline-status", self.reporter.run)
        spawn("edgeline-source", self._read_source)
        if self.updater is not None:
            updater = self.updater
            spawn("edgeline-updates", lambda: updater.run(self.stopping))
        self.notifier.notify("READY=1")

    def _start_broker(self, connection: MqttConnection, delivery: Delivery, spawn: Spawn) -> None:
        """The outbox (under the state directory's lock), then connect; then the committer."""
        if self._lock is None:
            self._lock = StateLock(self.state_dir)
        delivery.open()
        connection.start(lambda target: spawn("edgeline-mqtt", target))
        delivery.start(spawn)

    def stop(self) -> None:
        """Drain: no new input (still subscribed: what the broker sends now is left unacknowledged, for the next
        run), answer what is queued, flush the outbox while the broker takes it, say offline, leave. Every wait is
        bounded by ``[daemon] drain_timeout_s``."""
        self.notifier.notify("STOPPING=1")
        self.stopping.set()
        self.queue.close()
        deadline = time.monotonic() + self.config.daemon.drain_timeout_s
        if self._worker_thread is not None:
            self._worker_thread.join(max(0.1, deadline - time.monotonic()))
            if self._worker_thread.is_alive():
                log.error("the worker did not finish within %g s", self.config.daemon.drain_timeout_s)
        if self.delivery is not None:
            self.delivery.stop(deadline)
        if self.connection is not None:
            if self.connection.connected.is_set():
                self.connection.publish(self.availability_topic, b"offline", qos=1, retain=True)
                self._wait_for_in_flight(deadline)
            self.connection.close(max(0.5, deadline - time.monotonic()))
        if self.delivery is not None:
            self.delivery.close()
        if self._lock is not None:
            self._lock.release()
        if self._metrics_server is not None:
            self._metrics_server.stop()

    def _wait_for_in_flight(self, deadline: float) -> None:
        """The broker's acknowledgement of what is still on its way (the offline message among it), briefly."""
        assert self.connection is not None
        limit = min(deadline, time.monotonic() + 2.0)
        while self.connection.in_flight and self.connection.connected.is_set() and time.monotonic() < limit:
            time.sleep(0.02)

    def run_until_signalled(self) -> int:
        """Run until SIGTERM, SIGINT or SIGHUP, or until a finite source is exhausted; then drain and stop. The
        exit code: 0, or ``EXIT_FAILED`` when the pipeline could not go on. After SIGHUP, ``reload_requested``
        is set: the command starts itself again (``edgeline.daemon.run_command``)."""

        def handle(signum: int, frame: Any) -> None:
            if signum == signal.SIGHUP:
                self.reload_requested = True
                self.notifier.notify("RELOADING=1")
            self.stopping.set()

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self.start()
            log.info(
                "edgeline run: %s v%d (%s) %s; %s", self.model.name, self.model.version, self.model.backend,
                self.description, self.model.batching,
            )  # fmt: skip
            log.info("%s", self.expectation)
            if self.metrics.emulated is not None:
                log.info("emulated by %s: latencies here are the emulator's, not the device's", self.metrics.emulated)
            failed = self.supervisor.failed
            while not self.stopping.wait(0.2) and not self.source_done.is_set() and not failed.is_set():
                if self.silence is not None:
                    self._warn_silent()
            if self.reload_requested:
                log.info("SIGHUP: draining, then starting again with the configuration and bundle as they are now")
            self.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.supervisor.failed.is_set():
            log.error("stopped: %s", self.supervisor.failure)
            return EXIT_FAILED
        if self._source_failed:
            return EXIT_FAILED
        return 0


class Daemon(Service):
    """``edgeline run``'s daemon for ``bundle`` and ``config``: the parts assembled
    (``edgeline.daemon.assembly.assemble``: the model opened, every refusal raised) and handed to ``Service``.
    ``source`` replaces the configured one; ``echo`` takes the answers for stdout."""

    def __init__(
        self,
        bundle: Path,
        config: DaemonConfig,
        *,
        backend: str | None = None,
        echo: Callable[[Answer], None] | None = None,
        notifier: SystemdNotifier | None = None,
        source: Source | None = None,
    ):
        super().__init__(assemble(bundle, config, backend=backend, echo=echo, notifier=notifier, source=source))
