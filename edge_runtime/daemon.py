"""``edgeline run``: a bundle and a stream of sensor messages turned into a stream of answers.

    MQTT network thread ─┐                                                                ┌─► MQTT publish
    or a source thread  ─┴put─► bounded queue ──get_batch──► worker thread: Processor ───┤
      (serial, replay, sim)     (drop-oldest: the evicted     (one answer per input)      └─► stdout JSON lines
         (no inference here)     input is answered "dropped")
    status thread: status message + systemd WATCHDOG; availability: retained "online", "offline" as last will

The broker is used for the MQTT source, and for another source's answers when configured; without it, answers go
to stdout. SIGTERM or SIGINT: stop taking input, answer everything already queued, publish "offline", disconnect,
exit 0. A finite source (a replay file, a bounded simulation) ends the same way once it is exhausted.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_runtime.codecs import get_codec
from edge_runtime.config import DaemonConfig
from edge_runtime.errors import EdgelineError
from edge_runtime.health import Metrics, MetricsServer, SystemdNotifier
from edge_runtime.model import load
from edge_runtime.processor import Answer, Message, Processor
from edge_runtime.queueing import BoundedQueue, DropPolicy, QueueClosed, QueueEmpty, QueueFull
from edge_runtime.sources import Source, make_source
from edge_runtime.topics import TopicFilter, render_topic

__all__ = ["Daemon"]

log = logging.getLogger("edgeline.daemon")
CONNECT_TIMEOUT_S = 10.0


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
        codec = get_codec(config.input.codec)
        if codec.name == "raw" and self.model.manifest.preprocess is not None:
            # raw payloads are the model's own tensors; predict() would apply the preprocessing a second time
            raise EdgelineError(
                f"{bundle}: the raw codec sends the model's own tensors, but this bundle preprocesses its inputs; "
                "use json, cbor or msgpack"
            )
        self.model.enable_batching(config.queue.max_batch)
        self.metrics = Metrics(model=self.model.name, version=self.model.version)
        self.processor = Processor(
            self.model,
            codec,
            self.metrics,
            publish=config.output.publish,
            error_topic=config.output.error_topic,
            max_payload_bytes=config.input.max_payload_bytes,
            window=config.window,
            result_codec=get_codec("json") if codec.name == "raw" else None,
        )
        self.queue: BoundedQueue[Message] = BoundedQueue(config.queue.capacity, DropPolicy(config.queue_policy))
        self.filters = [TopicFilter(pattern) for pattern in config.input.subscribe]
        self.source = source or make_source(
            config.source, filters=self.filters, max_payload_bytes=config.input.max_payload_bytes
        )
        # Answers go to stdout when asked, and always when there is no broker to publish them to.
        self.echo = echo
        self._echo_lock = threading.Lock()
        self.notifier = notifier or SystemdNotifier()
        name = self.model.name
        self.availability_topic = render_topic(config.health.availability_topic, device="", name=name)
        self.status_topic = render_topic(config.health.status_topic, device="", name=name)
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.source_done = threading.Event()
        self._metrics_server: MetricsServer | None = None
        self.client = self._client(name) if config.uses_broker else None
        self._worker = threading.Thread(target=self._work, name="edgeline-worker", daemon=True)
        self._status = threading.Thread(target=self._report, name="edgeline-status", daemon=True)
        self._source_thread = threading.Thread(target=self._read_source, name="edgeline-source", daemon=True)

    def _client(self, name: str) -> Any:
        import paho.mqtt.client as mqtt

        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.config.broker.client_id.format(name=name),
            clean_session=True,
        )
        client.will_set(self.availability_topic, "offline", qos=1, retain=True)
        client.reconnect_delay_set(1, 30)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        return client

    @property
    def description(self) -> str:
        broker = self.config.broker
        where = f"{broker.host}:{broker.port}"
        if self.source is None:
            return f"on {where}, subscribed to {', '.join(f.pattern for f in self.filters)}"
        sinks = [f"results to {where}"] if self.client is not None else []
        if self.echo is not None:
            sinks.append("results to stdout")
        return f"reading {self.source.description}; {', '.join(sinks)}"

    # -- sinks: any thread --------------------------------------------------------------------------------------
    def _emit(self, answer: Answer) -> None:
        if self.client is not None:
            self.client.publish(answer.topic, answer.payload, qos=self.config.output.qos)
        if self.echo is not None:
            with self._echo_lock:
                try:
                    self.echo(answer)
                except BrokenPipeError:  # the reader of stdout went away (| head): nobody to answer, so stop
                    self.echo = None
                    if self.client is None:
                        log.warning("stdout was closed; stopping")
                        self.stopping.set()

    def _submit(self, message: Message, timeout: float | None = None) -> None:
        """Queue one message; with drop-oldest, answer the message it evicts. Raises QueueClosed when stopping."""
        evicted = self.queue.put(message, timeout=timeout)
        if evicted is not None:
            self.metrics.count("dropped")
            capacity = self.config.queue.capacity
            for answer in self.processor.refuse(evicted, "dropped", f"queue full ({capacity}): dropped unprocessed"):
                self._emit(answer)

    # -- network thread: never runs the model ---------------------------------------------------------------
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            log.warning("broker refused the connection: %s", reason)
            return
        if self.source is None:
            for topic_filter in self.filters:
                client.subscribe(topic_filter.pattern, qos=self.config.input.qos)
        client.publish(self.availability_topic, "online", qos=1, retain=True)
        self.connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connected.clear()
        if not self.stopping.is_set():
            self.metrics.count("disconnects")
            log.warning("lost the broker (%s); reconnecting", reason)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        device = next((d for f in self.filters if (d := f.device(msg.topic)) is not None), msg.topic)
        try:
            self._submit(Message(topic=msg.topic, payload=bytes(msg.payload), device=device))
        except QueueClosed:
            return  # shutting down: the broker redelivers unacknowledged QoS 1 messages to the next run

    # -- source thread (serial, replay, sim) ----------------------------------------------------------------
    def _read_source(self) -> None:
        assert self.source is not None

        def submit(message: Message) -> None:
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
        except Exception:
            log.exception("the source failed")
        finally:
            self.source_done.set()

    # -- worker thread ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        max_batch = self.config.queue.max_batch
        while True:
            try:
                batch = self.queue.get_batch(max_batch, timeout=0.5)
            except QueueEmpty:
                continue
            except QueueClosed:
                return
            for message, answers in zip(batch, self.processor.process_batch(batch), strict=True):
                for answer in answers:
                    self._emit(answer)
                if message.ack is not None:
                    message.ack()

    # -- status thread -----------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        stats = self.queue.stats()
        extra = {
            "queue_depth": stats.depth,
            "queue_capacity": stats.capacity,
            "queue_policy": stats.policy.value,
            "batch_size": self.model.batch_size,
            "connected": self.connected.is_set(),
        }
        return self.metrics.snapshot(extra)

    def _report(self) -> None:
        interval = self.config.health.status_interval_s
        watchdog = self.notifier.watchdog_interval_s
        tick = min(interval, watchdog) if watchdog else interval
        next_status = time.monotonic() + interval
        while not self.stopping.wait(tick):
            if watchdog:
                self.notifier.notify("WATCHDOG=1")
            if time.monotonic() >= next_status and self.client is not None:
                next_status += interval
                self.client.publish(self.status_topic, json.dumps(self.status()), qos=0, retain=True)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.source is not None:
            self.source.open()
        if self.client is not None:
            self._connect(self.client)
        if self.config.health.prometheus_port:
            self._metrics_server = MetricsServer(self.metrics, self.config.health.prometheus_port, self.status).start()
        self._worker.start()
        self._status.start()
        if self.source is not None:
            self._source_thread.start()
        self.notifier.notify("READY=1")

    def _connect(self, client: Any) -> None:
        broker = self.config.broker
        try:
            client.connect_async(broker.host, broker.port, keepalive=broker.keepalive_s)
        except (OSError, ValueError) as exc:
            raise EdgelineError(f"broker {broker.host}:{broker.port}: {exc}") from exc
        client.loop_start()
        if not self.connected.wait(CONNECT_TIMEOUT_S):
            client.loop_stop()
            raise EdgelineError(
                f"broker {broker.host}:{broker.port}: no connection within {CONNECT_TIMEOUT_S:g} s "
                "(is it running and reachable?)"
            )

    def stop(self) -> None:
        """Drain: no new input, answer what is queued, then say offline and leave."""
        self.notifier.notify("STOPPING=1")
        self.stopping.set()
        if self.client is not None and self.source is None:
            for topic_filter in self.filters:
                self.client.unsubscribe(topic_filter.pattern)
        self.queue.close()
        self._worker.join(timeout=60)
        if self._source_thread.is_alive():
            self._source_thread.join(timeout=5)
        if self.client is not None:
            info = self.client.publish(self.availability_topic, "offline", qos=1, retain=True)
            info.wait_for_publish(timeout=5)
            self.client.disconnect()
            self.client.loop_stop()
        if self._metrics_server is not None:
            self._metrics_server.stop()

    def run_until_signalled(self) -> int:
        """Run until SIGTERM or SIGINT, or until a finite source is exhausted; then drain and stop."""

        def handle(signum: int, frame: Any) -> None:
            self.stopping.set()

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            print(
                f"edgeline run: {self.model.name} v{self.model.version} ({self.model.backend}) {self.description}; "
                f"{self.model.batching}",
                file=sys.stderr,
                flush=True,
            )
            while not self.stopping.wait(0.2) and not self.source_done.is_set():
                pass
            self.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0
