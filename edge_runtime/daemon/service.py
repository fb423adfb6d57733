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
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgeline.daemon.codecs import example_payload, get_codec
from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.guards import check_topics, check_window
from edgeline.daemon.health import Metrics, MetricsServer, SystemdNotifier
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.mqtt import MqttConnection, MqttSink, MqttSource
from edgeline.daemon.outbox import MemoryOutbox, Outbox, Pending
from edgeline.daemon.processor import Processor
from edgeline.daemon.queueing import BoundedQueue, DropPolicy, QueueClosed, QueueEmpty, QueueFull
from edgeline.daemon.silence import SilenceWatch
from edgeline.daemon.sources import Source, make_source
from edgeline.daemon.state import StateLock, default_state_dir, instance_id
from edgeline.daemon.supervisor import Supervisor
from edgeline.daemon.topics import TopicFilter, render_topic
from edgeline.errors import EdgelineError
from edgeline.model import load

__all__ = ["EXIT_FAILED", "Daemon"]

log = logging.getLogger("edgeline.daemon")
EXIT_FAILED = 1
"""A daemon that could not go on (a thread died, a live source ended): systemd's Restart=on-failure restarts it."""
COMMIT_BACKLOG = 32
"""Batches the worker may hand the committer ahead of the disk."""
REMOVE_EVERY_S = 0.1
"""With nothing to commit, the committer still removes what the broker acknowledged this often."""
REFILL = 256
"""Answers read back from the outbox at a time, when they could not be held in memory as they came."""


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
        self.model = load(bundle, backend=backend)
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
        self._lock: StateLock | None = None
        self.outbox: Outbox | MemoryOutbox | None = None
        self.connection: MqttConnection | None = None
        self.sink: MqttSink | None = None
        if config.uses_broker:
            self.connection = MqttConnection(
                config.broker,
                client_id=self.client_id,
                will=(self.availability_topic, b"offline"),
                waiting=lambda: self.outbox.depth if self.outbox is not None else 0,
            )
            self.sink = MqttSink(self.connection, config.output.qos)
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
        watched = isinstance(self.source, MqttSource) and silence_s > 0
        self.silence = SilenceWatch(self.filters, silence_s) if watched else None
        self._metrics_server: MetricsServer | None = None
        self._acknowledged: deque[int] = deque()
        """Outbox seqs the broker has (their PUBACK came): the committer removes them with its next commit."""
        self._ready: deque[Pending] = deque()
        """Network thread: committed answers waiting for room in the in-flight window, oldest first (at most
        ``[broker] max_queued``)."""
        self._handed = 0
        """Network thread: the highest outbox seq taken into ``_ready``."""
        self._spilled = False
        """Network thread: answers wait in the outbox that were never taken into ``_ready`` (it was full, or the
        last run left them): the tick reads them back, in order, as it empties."""
        self._next_expiry = 0.0
        self._announced = 0
        """Network thread: the connection (``MqttConnection.generation``) "online" was last published on."""
        self._evicted: list[tuple[Message, list[Answer]]] = []
        self._evicted_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._commits: queue.Queue[tuple[list[tuple[str, bytes, float]], list[Callable[[], None]]] | None] | None = None
        self._committer: threading.Thread | None = None
        self._source_failed = False
        self.metrics.gauges(self._gauges)

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
            outbox = f", outbox {self.outbox.path}" if isinstance(self.outbox, Outbox) else ", outbox in memory"
            sinks.append(f"answers to {self.connection.address} at QoS {self.config.output.qos}{outbox}")
        if self.echo is not None:
            sinks.append("answers to stdout")
        return f"reading {self.source.description}; {'; '.join(sinks)}; instance {self.instance}"

    @property
    def expectation(self) -> str:
        where = ""
        if isinstance(self.source, MqttSource):
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
        to_broker = [(a.topic, a.payload, m.received) for m, answers in pairs for a in answers if a.topic is not None]
        acks = [m.ack for m, _ in pairs if m.ack is not None]
        if self.sink is not None and to_broker:
            assert self.outbox is not None
            if self._commits is not None:  # on disk: the committer hands them over once the answers are fsync'ed
                self._commits.put((to_broker, acks))
            else:
                self._hand_over(self.outbox.add(to_broker), acks)
            acks = []
        for message, answers in pairs:
            for answer in answers:
                if answer.topic is None and self.echo is None:
                    self.metrics.count("unpublishable")
                    log.warning("answer without a topic (device cannot form one): %s", answer.payload[:300])
                self._echo(answer)
            if self.echo is not None and self.sink is None:
                self.metrics.observe("publish", max(0.0, time.time() - now))
                self.metrics.observe("total", max(0.0, time.time() - message.received))
        if acks and self.connection is not None:
            self.connection.call_soon(lambda: _call_each(acks))
        else:
            _call_each(acks)

    # -- committer thread: group commit ---------------------------------------------------------------------------
    def _commit(self) -> None:
        """Commit what the worker handed over, as many batches as have queued up, together with the removal of
        what the broker acknowledged meanwhile, in one transaction (one fsync); then hand the answers and the
        inputs' acknowledgements to the network thread in one go. The worker goes on with the next batch
        meanwhile; it waits only when ``COMMIT_BACKLOG`` batches are queued (a disk that stalls holds the
        pipeline back, not memory)."""
        assert self._commits is not None and isinstance(self.outbox, Outbox)
        commits, outbox = self._commits, self.outbox
        interval = self.config.outbox.commit_interval_s
        finished = False
        last_commit = 0.0
        while not finished:
            try:
                items = [commits.get(timeout=REMOVE_EVERY_S)]
            except queue.Empty:
                items = []
            # group commit: let what comes gather until the interval since the last commit is over (fewer fsyncs,
            # less CPU and flash wear per answer, and one wake-up per interval however fast the stream)
            if items and items[0] is not None and (left := last_commit + interval - time.monotonic()) > 0:
                time.sleep(left)
            while True:
                try:
                    items.append(commits.get_nowait())
                except queue.Empty:
                    break
            finished = any(item is None for item in items)
            batches = [item for item in items if item is not None]
            self._expire()
            removed = self._take_acknowledged()
            if not batches:
                outbox.remove(removed)
                continue
            last_commit = time.monotonic()
            pending = outbox.add([row for rows, _ in batches for row in rows], remove=removed)
            self._hand_over(pending, [ack for _, acks in batches for ack in acks])

    def _take_acknowledged(self) -> list[int]:
        acknowledged, taken = self._acknowledged, []
        while acknowledged:
            taken.append(acknowledged.popleft())
        return taken

    def _expire(self) -> None:
        """At most once a second: drop (and count) the answers past their time to live."""
        assert self.outbox is not None
        if time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + 1.0
            self.outbox.expire()

    # -- network thread: answers to the client ----------------------------------------------------------------------
    def _hand_over(self, pending: list[Pending], acks: list[Callable[[], None]]) -> None:
        """Committed answers and their inputs' acknowledgements to the network thread: one task, one wake-up."""
        assert self.connection is not None
        self.connection.call_soon(lambda: self._handed_over(pending, acks))

    def _handed_over(self, pending: list[Pending], acks: list[Callable[[], None]]) -> None:
        _call_each(acks)
        if not self._spilled:
            ready, limit = self._ready, self.config.broker.max_queued
            for answer in pending:
                if len(ready) >= limit:
                    self._spilled = True  # the rest wait in the outbox: the tick reads them back, in order
                    break
                if answer.seq > self._handed:
                    ready.append(answer)
                    self._handed = answer.seq
        self._pump()

    def _tick(self) -> None:
        """Every turn of the network loop: fill the in-flight window from the answers ready, and those from the
        outbox when some wait there that were never handed over. Cheap when there is nothing to do."""
        assert self.outbox is not None and self.connection is not None
        connection = self.connection
        if connection.generation != self._announced and connection.connected.is_set() and not self.stopping.is_set():
            # on every connection, not only the first: after a lost link the broker has published our will
            self._announced = connection.generation
            connection.publish(self.availability_topic, b"online", qos=1, retain=True)
        if isinstance(self.outbox, MemoryOutbox):
            self._expire()
        limit = self.config.broker.max_queued
        room = limit - len(self._ready)
        if self._spilled and room >= max(1, min(REFILL, limit // 2)):
            waiting = self.outbox.take(min(room, REFILL), after=self._handed)
            if waiting:
                self._ready.extend(waiting)
                self._handed = waiting[-1].seq
                self.metrics.count("outbox_read_back", len(waiting))
            else:
                self._spilled = False  # what is committed from now on is handed over as it comes
        self._pump()

    def _pump(self) -> None:
        """Publish ready answers, oldest first, while the window has room (network thread)."""
        assert self.connection is not None and self.sink is not None
        ready = self._ready
        if not ready or not self.sink.ready:
            return
        room = self.connection.room
        while ready and room > 0:
            answer = ready.popleft()
            if not self._publish(answer):
                ready.appendleft(answer)
                return
            room -= 1

    def _publish(self, pending: Pending) -> bool:
        """One answer to the client (or dropped, counted, past its time to live); False when it cannot take it."""
        assert self.outbox is not None and self.sink is not None
        age = time.time() - pending.created
        if age > self.outbox.ttl_s:
            self.outbox.drop(pending.seq)
            return True
        done = self._done_callback(pending.seq, pending.created, pending.received)
        return self.sink.publish(pending.topic, pending.payload, expiry_s=self.outbox.ttl_s - age, done=done)

    def _done_callback(self, seq: int, created: float, received: float) -> Callable[[bool, str | None], None]:
        def done(ok: bool, reason: str | None) -> None:
            now = time.time()
            if ok:
                self.metrics.count("published")
                self.metrics.observe("publish", max(0.0, now - created))
                self.metrics.observe("total", max(0.0, now - received))
            else:
                self.metrics.count("publish_refused")
                log.warning("the broker refused an answer (%s); it is not retried", reason)
            if isinstance(self.outbox, Outbox):
                self._acknowledged.append(seq)
            elif self.outbox is not None:
                self.outbox.remove([seq])

        return done

    # -- source thread -----------------------------------------------------------------------------------------
    def _submit(self, message: Message, timeout: float | None = None) -> None:
        """Queue one message; with drop-oldest, answer the message it evicts. Raises QueueClosed when stopping."""
        evicted = self.queue.put(message, timeout=timeout)
        if evicted is not None:
            # answered now, delivered by the worker (this may be the MQTT client's network thread)
            self.metrics.count("dropped")
            reason = f"queue full ({self.config.queue.capacity}): dropped unprocessed"
            answers = self.processor.refuse(evicted, "dropped", reason)
            with self._evicted_lock:
                self._evicted.append((evicted, answers))

    def _read_source(self) -> None:
        def submit(message: Message) -> None:
            if self.silence is not None:
                self.silence.heard(message.topic)
            while not self.stopping.is_set():  # block policy: wait for room, but not past a stop
                try:
                    self._submit(message, timeout=0.5)
                    return
                except QueueFull:
                    continue
            raise QueueClosed

        try:
            self.source.run(submit, self.stopping)
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
                continue
            except QueueClosed:
                self._answer_evicted()
                return
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

    def _answer_evicted(self) -> None:
        with self._evicted_lock:
            evicted, self._evicted = self._evicted, []
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
            gauges["reconnects"] = self.connection.reconnects
            gauges["publish_stalls"] = self.connection.stalls
        if self.outbox is not None:
            box = self.outbox.stats()
            gauges.update(
                outbox_depth=box.depth,
                outbox_bytes=box.bytes,
                outbox_oldest_age_seconds=box.oldest_age_s if box.oldest_age_s is not None else 0.0,
                outbox_expired=box.expired,
                outbox_overflowed=box.overflowed,
            )
        return gauges

    def status(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"queue_policy": self.queue.policy.value, "client_id": self.client_id}
        if self.metrics.accelerator is not None:
            extra["accelerator"] = dict(self.metrics.accelerator)
        return self.metrics.snapshot(extra)

    def _report(self) -> None:
        interval = self.config.health.status_interval_s
        watchdog = self.notifier.watchdog_interval_s
        tick = min(interval, watchdog) if watchdog else interval
        next_status = time.monotonic() + interval
        while not self.stopping.wait(tick):
            if watchdog and self.supervisor.healthy():
                self.notifier.notify("WATCHDOG=1")
            if time.monotonic() >= next_status and self.connection is not None:
                next_status += interval
                self.connection.publish(self.status_topic, json.dumps(self.status()).encode(), qos=0, retain=True)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.model.accelerator_fallback is not None:  # loud: slower by design, never a silent surprise
            log.warning("%s: %s", self.model.name, self.model.accelerator_fallback)
        self.source.open()
        if self.connection is not None:
            self._lock = StateLock(self.state_dir)
            box = self.config.outbox
            if box.enabled:
                self.outbox = Outbox(
                    self.state_dir / "outbox.sqlite",
                    max_answers=box.max_answers,
                    max_bytes=box.max_bytes,
                    ttl_s=box.ttl_s,
                    synchronous=box.synchronous,
                )
                if self.outbox.depth:
                    log.info("%d answers left by the last run wait in the outbox", self.outbox.depth)
            else:
                self.outbox = MemoryOutbox(max_answers=box.max_answers, max_bytes=box.max_bytes, ttl_s=box.ttl_s)
            self._spilled = self.outbox.depth > 0  # left by the last run: read back first, in order
            self.connection.on_tick(self._tick)
            self.connection.start(lambda target: self.supervisor.spawn("edgeline-mqtt", target))
        if self.config.health.prometheus_port:
            health = self.config.health
            self._metrics_server = MetricsServer(self.metrics, health.prometheus_port, health.prometheus_host).start()
        spawn = self.supervisor.spawn
        if isinstance(self.outbox, Outbox):
            self._commits = queue.Queue(COMMIT_BACKLOG)
            self._committer = spawn("edgeline-committer", self._commit)
        self._worker = spawn("edgeline-worker", self._work)
        spawn("edgeline-status", self._report)
        spawn("edgeline-source", self._read_source)
        self.notifier.notify("READY=1")

    def stop(self) -> None:
        """Drain: no new input (still subscribed: what the broker sends now is left unacknowledged, for the next
        run), answer what is queued, flush the outbox while the broker takes it, say offline, leave."""
        self.notifier.notify("STOPPING=1")
        self.stopping.set()
        self.queue.close()
        deadline = time.monotonic() + self.config.daemon.drain_timeout_s
        if self._worker is not None:
            self._worker.join(max(0.1, deadline - time.monotonic()))
            if self._worker.is_alive():
                log.error("the worker did not finish within %g s", self.config.daemon.drain_timeout_s)
        if self._committer is not None and self._commits is not None:
            self._commits.put(None)  # after the worker's last batch
            self._committer.join(max(0.1, deadline - time.monotonic()))
        if self.outbox is not None:
            self._flush(deadline)
        if self.connection is not None:
            if self.connection.connected.is_set():
                self.connection.publish(self.availability_topic, b"offline", qos=1, retain=True)
                self._wait_for_in_flight(deadline)
            self.connection.close()
        if self.outbox is not None:
            if self.outbox.depth and isinstance(self.outbox, Outbox):
                log.info("%d answers stay in the outbox for the next start", self.outbox.depth)
            elif self.outbox.depth:
                log.warning("%d answers in the memory outbox are lost ([outbox] enabled = false)", self.outbox.depth)
            self.outbox.close()
        if self._lock is not None:
            self._lock.release()
        if self._metrics_server is not None:
            self._metrics_server.stop()

    def _flush(self, deadline: float) -> None:
        """Until the broker has every answer (the network thread sends them, reading back what waits), as long as
        it is connected and the drain time lasts."""
        assert self.outbox is not None and self.connection is not None
        committer_done = self._committer is None or not self._committer.is_alive()
        while self.connection.connected.is_set() and time.monotonic() < deadline:
            if committer_done and isinstance(self.outbox, Outbox):
                self.outbox.remove(self._take_acknowledged())
            if self.outbox.depth == 0:
                break
            time.sleep(0.02)
        if committer_done and isinstance(self.outbox, Outbox):
            self.outbox.remove(self._take_acknowledged())

    def _wait_for_in_flight(self, deadline: float) -> None:
        """The broker's acknowledgement of what is still on its way (the offline message among it), briefly."""
        assert self.connection is not None
        limit = min(deadline, time.monotonic() + 2.0)
        while self.connection.in_flight and self.connection.connected.is_set() and time.monotonic() < limit:
            time.sleep(0.02)

    def run_until_signalled(self) -> int:
        """Run until SIGTERM or SIGINT, or until a finite source is exhausted; then drain and stop. The exit
        code: 0, or ``EXIT_FAILED`` when the pipeline could not go on."""

        def handle(signum: int, frame: Any) -> None:
            self.stopping.set()

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            log.info(
                "edgeline run: %s v%d (%s) %s; %s", self.model.name, self.model.version, self.model.backend,
                self.description, self.model.batching,
            )  # fmt: skip
            log.info("%s", self.expectation)
            failed = self.supervisor.failed
            while not self.stopping.wait(0.2) and not self.source_done.is_set() and not failed.is_set():
                if self.silence is not None:
                    self._warn_silent()
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
