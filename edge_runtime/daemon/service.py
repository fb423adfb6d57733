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

Every source is alike: MQTT is one (``edgeline.daemon.mqtt``), and so are serial, replay and sim. The broker
is also the sink of answers whenever it is used; stdout is the other sink. Without a broker, answers go to stdout.

SIGTERM or SIGINT: stop taking new input without unsubscribing, answer what is queued, flush the outbox as far as
the broker allows (``[daemon] drain_timeout_s``), say offline, disconnect (the session stays: what was not
answered is redelivered to the next run), exit 0. A finite source (a replay file, a bounded simulation) ends the
same way once it is exhausted. A thread that dies, or a live source that ends, exits 1.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.daemon.codecs import example_payload, get_codec
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.delivery import Delivery
from edgeline.daemon.guards import check_topics, check_window
from edgeline.daemon.health import Metrics, MetricsServer, SystemdNotifier
from edgeline.daemon.intake import Intake, IntakeGate
from edgeline.daemon.lograte import Repeated
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.mqtt import AnswerFormat, MqttConnection, MqttSink, MqttSource
from edgeline.daemon.outbox import MemoryOutbox, Outbox, OutboxInterface
from edgeline.daemon.processor import Processor
from edgeline.daemon.queueing import BoundedQueue, DropPolicy, QueueClosed, QueueEmpty
from edgeline.daemon.silence import SilenceWatch
from edgeline.daemon.sources import Source, make_source
from edgeline.daemon.state import StateLock, default_state_dir, instance_id
from edgeline.daemon.supervisor import Supervisor
from edgeline.daemon.topics import TopicFilter, render_topic
from edgeline.errors import EdgelineError
from edgeline.machine import this_machine
from edgeline.model import load

if TYPE_CHECKING:
    from edgeline.updates.agent import UpdateAgent
    from edgeline.updates.store import State, Store
    from edgeline.updates.swap import Swap

__all__ = ["EXIT_FAILED", "Daemon"]

log = logging.getLogger("edgeline.daemon")
EXIT_FAILED = 1
"""A daemon that could not go on (a thread died, a live source ended): systemd's Restart=on-failure restarts it."""
ANSWER_FORMATS = {
    "json": AnswerFormat("application/json", utf8=True),
    "cbor": AnswerFormat("application/cbor", utf8=False),
    "msgpack": AnswerFormat("application/vnd.msgpack", utf8=False),
}
"""What answers are, by the codec they are written in (MQTT 5 Content Type and Payload Format Indicator)."""


class Daemon:
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
        self.config = config
        self._lock: StateLock | None = None
        start_on, update_state, store = bundle, None, None
        if config.updates.enabled:  # the committed version may be newer than the bundle given
            from edgeline.bundle import read_bundle
            from edgeline.updates.agent import starting_bundle
            from edgeline.updates.store import Store

            root = config.updates.trusted_root
            if root is not None and not root.is_file():  # said before the model is opened
                raise EdgelineError(f"--trusted-root {root}: no such file (the root.json of `edgeline keys generate`)")
            given = read_bundle(bundle).manifest
            state_dir = (config.daemon.state_dir or default_state_dir()) / given.name
            self._lock = StateLock(state_dir)  # before the update state is read or written
            store = Store(state_dir / "updates")
            start_on, update_state = starting_bundle(store, bundle, given.version)
        self.model = load(start_on, backend=backend)
        name = self.model.name
        codec = get_codec(config.input.codec)
        if codec.name == "raw" and self.model.manifest.preprocess is not None:
            # raw payloads are the model's own tensors; predict() would apply the preprocessing a second time
            raise EdgelineError(
                f"{bundle}: the raw codec sends the model's own tensors, but this bundle preprocesses its inputs; "
                "use json, cbor or msgpack"
            )
        window = config.window if config.window is not None else self.model.manifest.window
        check_window(window, self.model.inputs)
        self.state_dir = (config.daemon.state_dir or default_state_dir()) / name
        self.instance = config.daemon.instance or instance_id(self.state_dir)
        self.filters = [TopicFilter(pattern) for pattern in config.input.subscribe]
        check_topics(config, name=name, instance=self.instance, filters=self.filters)
        self.client_id = config.broker.client_id.format(name=name, instance=self.instance)
        self.availability_topic = render_topic(
            config.health.availability_topic, device="", name=name, instance=self.instance
        )
        self.status_topic = render_topic(config.health.status_topic, device="", name=name, instance=self.instance)

        self.model.enable_batching(config.queue.max_batch)
        self.metrics = Metrics(model=name, version=self.model.version, instance=self.instance)
        self.metrics.accelerator = self.accelerator
        self.metrics.emulated = this_machine().emulated
        self.processor = Processor(
            self.model,
            codec,
            self.metrics,
            publish=config.output.publish,
            error_topic=config.output.error_topic,
            max_payload_bytes=config.input.max_payload_bytes,
            window=window,
            max_streams=config.input.max_streams,
            result_codec=get_codec("json") if codec.name == "raw" else None,
            instance=self.instance,
        )
        self.queue: BoundedQueue[Message] = BoundedQueue(config.queue.capacity, DropPolicy(config.queue_policy))
        self.supervisor = Supervisor()
        self.stopping = threading.Event()
        self.source_done = threading.Event()
        self.echo = echo
        self._echo_lock = threading.Lock()
        self.notifier = notifier or SystemdNotifier()
        self.connection: MqttConnection | None = None
        self.sink: MqttSink | None = None
        if config.uses_broker:
            self.connection = MqttConnection(
                config.broker,
                client_id=self.client_id,
                will=(self.availability_topic, b"offline"),
                waiting=lambda: self.delivery.outbox.depth if self.delivery is not None else 0,
            )
            answers_in = "json" if codec.name == "raw" else codec.name
            self.sink = MqttSink(self.connection, config.output.qos, ANSWER_FORMATS[answers_in])
        if source is not None:
            self.source: Source = source
        elif config.source.kind == "mqtt":
            assert self.connection is not None
            self.source = MqttSource(self.connection, self.filters, config.input.qos)
        else:
            made = make_source(config.source, filters=self.filters, max_payload_bytes=config.input.max_payload_bytes)
            assert made is not None
            self.source = made
        self.expected_payload = example_payload(codec.name, self.model.inputs, window)
        """What a message for this model looks like (values abbreviated): logged at start and when silent."""
        silence_s = config.input.silence_warning_s
        watched = self.source.subscribed and silence_s > 0
        self.silence = SilenceWatch(self.filters, silence_s) if watched else None
        self._metrics_server: MetricsServer | None = None
        self.delivery: Delivery | None = None
        connection = self.connection
        self.intake = Intake(
            self.queue,
            refuse=self.processor.refuse,
            metrics=self.metrics,
            stopping=self.stopping,
            on_network_thread=(lambda: connection.on_network_thread) if connection is not None else lambda: False,
            heard=self.silence.heard if self.silence is not None else None,
        )
        self.shed_log = Repeated(log, "inputs beyond the broker's window", level=logging.INFO)
        self.unpublishable_log = Repeated(log, "answers without a topic (their device cannot form one), not sent")
        self._answer_size = 256  # bytes of a recent answer: the gate's estimate for inputs not answered yet
        self._announced = 0
        """Network thread: the connection (``MqttConnection.generation``) "online" was last published on."""
        self._worker: threading.Thread | None = None
        self._source_failed = False
        self.reload_requested = False
        """SIGHUP: drain like SIGTERM, then the command starts itself again (new configuration and bundle)."""
        self.metrics.declare(
            "received", "results", "anomalies", "errors", "dropped", "published", "publish_refused", "batches",
            "disk_full", "intake_pauses", "outbox_read_back", "streams_evicted", "unpublishable",
        )  # fmt: skip
        self.metrics.gauges(self._gauges)
        self.metrics.counters(self._counters)
        self.updater: UpdateAgent | None = None
        self.swap: Swap | None = None
        if store is not None and update_state is not None:
            self._attach_updates(store, update_state, start_on, backend)

    def _attach_updates(self, store: Store, state: State, start_on: Path, backend: str | None) -> None:
        from edgeline.updates.agent import UpdateAgent
        from edgeline.updates.client import UpdateClient
        from edgeline.updates.swap import Swap

        updates = self.config.updates
        assert updates.repository is not None and updates.trusted_root is not None
        client = UpdateClient(updates.repository, updates.trusted_root, store.directory)
        self.updater = UpdateAgent(
            client=client, store=store, state=state, running=self.model, running_bundle=start_on,
            device=self.instance, interval_s=updates.check_interval_s, backend=backend,
            max_batch=self.config.queue.max_batch, on_event=lambda event: self._publish_status(),
            reserve_bytes=self._outbox_room,
        )  # fmt: skip
        self.swap = Swap(self.updater, self.processor)
        self.updater.swap = self.swap
        self.metrics.counters(self.updater.counters)
        self.metrics.gauges(self.updater.gauges)
        self.metrics.labelled_counters(
            "update_refused", "reason", "Updates refused, by reason.", self.updater.refusal_counts
        )

    def _outbox_room(self) -> int:
        """The bytes the durable outbox may still grow into on the state directory's disk: what an update leaves
        free there (0 for an outbox in memory)."""
        box = self.config.outbox
        if not box.enabled:
            return 0
        outbox = self.outbox
        used = outbox.stats().bytes if outbox is not None else 0
        return max(0, box.max_bytes - used)

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
        """What the bundle was built for and what runs it here, for the status message and the metrics; None for
        a bundle built for the CPU."""
        placement = self.model.manifest.placement
        if placement is None or placement.accelerator is None:
            return None
        return {
            "wanted": placement.accelerator,
            "in_use": self.model.accelerator,
            "fallback": self.model.accelerator_fallback,
        }

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

    # -- sinks -------------------------------------------------------------------------------------------------
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

    def _deliver(self, pairs: Sequence[tuple[Message, list[Answer]]]) -> None:
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
        if to_broker:
            self._answer_size = len(to_broker[-1][1])
        if acks and self.connection is not None:
            self.connection.call_soon(lambda: _call_each(acks))
        else:
            _call_each(acks)

    # -- network thread ----------------------------------------------------------------------------------------
    def _tick(self) -> None:
        """Every turn of the network loop: say "online" on a new connection, take held inputs once the gate is
        open again, and let the delivery path fill the in-flight window."""
        assert self.connection is not None and self.delivery is not None
        connection = self.connection
        if connection.generation != self._announced and connection.connected.is_set() and not self.stopping.is_set():
            # on every connection, not only the first: after a lost link the broker has published our will
            self._announced = connection.generation
            connection.publish(self.availability_topic, b"online", qos=1, retain=True)
        intake = self.intake
        if intake.held:
            intake.release_held()
        if intake.shed and not intake.held and intake.pending == 0 and self.delivery.settled:
            # what the broker sent past our Receive Maximum was left unacknowledged: a new connection has it again
            self.shed_log.happened(
                intake.shed,
                f"{intake.shed} inputs past the {intake.max_held} held (the broker sent more than our Receive "
                "Maximum allows; Mosquitto 2.0.11 does after a reconnection to queued messages): left "
                "unacknowledged, reconnecting to have them sent again",
            )
            intake.shed = 0
            connection.redeliver()
        self.delivery.tick()

    def _level(self) -> tuple[int, int]:
        """The intake gate's level: inputs taken and not answered yet, and the answers the broker does not have."""
        assert self.delivery is not None
        answers, size = self.delivery.level()
        inputs = self.intake.pending
        return answers + inputs, size + inputs * self._answer_size

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

    # -- worker thread ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        max_batch = self.config.queue.max_batch
        progress = self.supervisor.progress
        while True:
            self._answer_evicted()
            try:
                batch = self.queue.get_batch(max_batch, timeout=0.5)
            except QueueEmpty:
                if self.swap is not None:  # a quiet stream: a trial that ends by its time, a revert, still happen
                    self._poll_swap()
                continue
            except QueueClosed:
                self._answer_evicted()
                return
            if self.swap is not None:  # between two batches, as late as can be: a proposal made while this worker
                self._poll_swap()  # waited for input answers from this batch on
            progress.begin()
            now = time.monotonic()
            for message in batch:
                self.metrics.observe("queued", max(0.0, now - message.queued))
            try:
                answers = self.processor.process_batch(batch)
            except Exception as exc:  # the processor answers every failure itself: this is a bug of ours
                log.error("processing failed: %s: %s", type(exc).__name__, exc, exc_info=True)
                answers = [self.processor.refuse(m, "inference-failed", f"{type(exc).__name__}: {exc}") for m in batch]
            self._deliver(list(zip(batch, answers, strict=True)))
            progress.done()

    def _poll_swap(self) -> None:
        """Between two batches: where a new version starts answering, and where a trial ends."""
        assert self.swap is not None
        try:
            self.swap.poll()
        except Exception as exc:  # a bug of ours must not cost the worker: the running version keeps answering
            log.error("the update swap failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        if self.processor.model is not self.model:
            self.model = self.processor.model
            self.metrics.version = self.model.version

    def _answer_evicted(self) -> None:
        evicted = self.intake.take_evicted()
        if evicted:
            self._deliver(evicted)

    # -- status thread -----------------------------------------------------------------------------------------
    def _gauges(self) -> dict[str, float | int | bool | None]:
        stats = self.queue.stats()
        gauges: dict[str, float | int | bool | None] = {
            "queue_depth": stats.depth,
            "queue_capacity": stats.capacity,
            "batch_size": self.model.batch_size,
            # back-pressure: the source waits for room (block policy); the worker waits for input
            "source_blocked": self.queue.waiting_puts > 0,
            "worker_idle": self.queue.waiting_gets > 0,
        }
        if self.connection is not None:
            gauges["connected"] = self.connection.connected.is_set()
            gauges["in_flight"] = self.connection.in_flight
        if self.gate is not None:
            gauges["intake_paused"] = self.gate.is_shut
            gauges["intake_held"] = len(self.intake.held)
        if self.delivery is not None:
            box = self.delivery.outbox.stats()
            gauges.update(
                outbox_depth=box.depth,
                outbox_bytes=box.bytes,
                outbox_oldest_age_seconds=box.oldest_age_s if box.oldest_age_s is not None else 0.0,
                disk_full=self.delivery.disk_full,
            )
        return gauges

    def _counters(self) -> dict[str, float | int | bool | None]:
        counters: dict[str, float | int | bool | None] = {}
        if self.connection is not None:
            counters.update(
                reconnects=self.connection.reconnects,
                publish_stalls=self.connection.stalls,
                session_takeovers=self.connection.backoff.takeovers,
            )
        if self.delivery is not None:
            box = self.delivery.outbox.stats()
            counters.update(outbox_expired=box.expired, outbox_overflowed=box.overflowed, outbox_corrupt=box.corrupt)
        if self.gate is not None:
            counters["intake_paused_seconds"] = int(self.gate.paused_seconds())
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
        return self.metrics.snapshot(extra)

    def _publish_status(self) -> None:
        """The status message now (an update's step), besides its period."""
        if self.connection is not None:
            self.connection.publish(self.status_topic, json.dumps(self.status()).encode(), qos=1, retain=True)

    def _report(self) -> None:
        interval = self.config.health.status_interval_s
        watchdog = self.notifier.watchdog_interval_s
        tick = min(interval, watchdog, 10.0) if watchdog else min(interval, 10.0)
        next_status = time.monotonic() + interval
        while not self.stopping.wait(tick):
            if watchdog and self.supervisor.healthy():
                self.notifier.notify("WATCHDOG=1")
            for repeated in self._repeated():
                repeated.tick()
            if time.monotonic() >= next_status and self.connection is not None:
                next_status += interval
                self.connection.publish(self.status_topic, json.dumps(self.status()).encode(), qos=0, retain=True)

    def _repeated(self) -> list[Repeated]:
        """The conditions whose logs are summarised (see ``edgeline.daemon.lograte``)."""
        found = [self.unpublishable_log, self.processor.failures_log, self.processor.evictions_log, self.shed_log]
        if self.connection is not None:
            found.append(self.connection.bad_topic_log)
        if self.delivery is not None:
            found.append(self.delivery.refused_log)
            found += [self.delivery.outbox.overflow_log, self.delivery.outbox.expiry_log, self.delivery.full_log]
        if self.gate is not None:
            found.append(self.gate.pauses)
        return found

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def _open_outbox(self) -> OutboxInterface:
        box = self.config.outbox
        if not box.enabled:
            return MemoryOutbox(max_answers=box.max_answers, max_bytes=box.max_bytes, ttl_s=box.ttl_s)
        outbox = Outbox(
            self.state_dir / "outbox.sqlite",
            max_answers=box.max_answers,
            max_bytes=box.max_bytes,
            ttl_s=box.ttl_s,
            synchronous=box.synchronous,
        )
        if outbox.depth:
            log.info("%d answers left by the last run wait in the outbox", outbox.depth)
        return outbox

    def start(self) -> None:
        if self.model.accelerator_fallback is not None:  # loud: slower by design, never a silent surprise
            log.warning("%s: %s", self.model.name, self.model.accelerator_fallback)
        self.source.open()
        spawn = self.supervisor.spawn
        if self.connection is not None:
            assert self.sink is not None
            if self._lock is None:
                self._lock = StateLock(self.state_dir)
            box = self.config.outbox
            self.delivery = Delivery(
                self._open_outbox(),
                self.connection,
                self.sink,
                self.metrics,
                max_queued=self.config.broker.max_queued,
                commit_interval_s=box.commit_interval_s,
                stopping=self.stopping,
                fail=self.supervisor.fail,
            )
            if self.queue.policy is DropPolicy.BLOCK:  # a source that can wait: read no faster than answers leave
                delivery = self.delivery
                self.intake.gate = IntakeGate(
                    self._level,
                    max_answers=box.max_answers,
                    max_bytes=box.max_bytes,
                    disk_full=lambda: delivery.disk_full,
                    metrics=self.metrics,
                )
            self.connection.on_tick(self._tick)
            self.connection.start(lambda target: spawn("edgeline-mqtt", target))
            self.delivery.start(spawn)
        if self.config.health.prometheus_port:
            health = self.config.health
            self._metrics_server = MetricsServer(self.metrics, health.prometheus_port, health.prometheus_host).start()
        self._worker = spawn("edgeline-worker", self._work)
        spawn("edgeline-status", self._report)
        spawn("edgeline-source", self._read_source)
        if self.updater is not None:
            updater = self.updater
            spawn("edgeline-updates", lambda: updater.run(self.stopping))
        self.notifier.notify("READY=1")

    def stop(self) -> None:
        """Drain: no new input (still subscribed: what the broker sends now is left unacknowledged, for the next
        run), answer what is queued, flush the outbox while the broker takes it, say offline, leave. Every wait is
        bounded by ``[daemon] drain_timeout_s``."""
        self.notifier.notify("STOPPING=1")
        self.stopping.set()
        self.queue.close()
        deadline = time.monotonic() + self.config.daemon.drain_timeout_s
        if self._worker is not None:
            self._worker.join(max(0.1, deadline - time.monotonic()))
            if self._worker.is_alive():
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


def _call_each(calls: Sequence[Callable[[], None]]) -> None:
    for call in calls:
        call()
