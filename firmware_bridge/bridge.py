"""``edgeline bridge``: boards on serial ports (the framed protocol) to an MQTT broker, and their answers back down.

    board ─SAMPLES─► link ─► sensors/{device}/{stream}  ─► a daemon anywhere (`edgeline run`, default topics)
    board ◄─ANSWER── link ◄─ edgeline/+/{device}/result ◄─┘
    board ─RESULT──► link ─► boards/{device}/{stream}/result     (what a board ran itself)
    board ◄─CONFIG── link ◄─ boards/{device}/config                (an operator's settings: rate, streams on/off)

Every sample is published in the daemon's own payload format (``{"id", "data"}``, QoS 1), so a daemon with its
default subscription answers it; its id (``stream.seq.index.t_us[.boot]``) routes the answer back to the frame. The
bridge subscribes to the answers of each board it meets (by the ``device`` of its HELLO), once. In reliable mode a
frame's ACK goes to the board once the broker has acknowledged every sample of it: a bridge killed at any moment
loses nothing, since the board resends what was not acknowledged to the next one.

Each port has its own thread and ``BoardLink`` (reopened with back-off); one MQTT connection carries them all. The
links' counters, summed, are the bridge's ``serial_*`` counters, in its status message (``edgeline/bridge/
{instance}/status``, retained) and on ``/metrics`` (``--prometheus-port``), with two latency stages: ``publish``
(a frame's arrival to the broker's PUBACK of its samples) and ``total`` (its arrival to its answer sent down).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import orjson

from edgeline.daemon.config import BrokerAddress, BrokerConfig
from edgeline.daemon.health import Metrics, MetricsServer
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.topics import topic_problem
from edgeline.errors import EdgelineError
from edgeline.firmware_bridge.link import Board, BoardLink, StreamSpec, input_id, parse_input_id, sum_counters
from edgeline.firmware_bridge.protocol import Frame
from edgeline.firmware_bridge.source import sample_payload
from edgeline.firmware_bridge.topics import DEFAULT_ANSWERS, DEFAULT_CONFIG, DEFAULT_PUBLISH, DEFAULT_RESULTS
from edgeline.lograte import Repeated

__all__ = ["Bridge", "BridgeOptions"]

log = logging.getLogger("edgeline.bridge")

SESSION_EXPIRY_S = 3600
"""The broker keeps the bridge's session (and the answers for its boards) this long while it is away."""
STOP_WAIT_S = 5.0
MAX_CONFIG_BYTES = 1024
"""A CONFIG is a few settings: a larger payload is a mistake (it must fit one frame in any case)."""
MAX_TRACKED = 65536
"""Input frames whose arrival time is kept for the round-trip latency (``total``), at most."""


@dataclass(frozen=True)
class BridgeOptions:
    publish: str = DEFAULT_PUBLISH
    answers: str = DEFAULT_ANSWERS
    results: str = DEFAULT_RESULTS
    board_config: str = DEFAULT_CONFIG
    qos: int = 1
    baudrate: int = 115200
    instance: str = ""
    status_interval_s: float = 10.0
    prometheus_port: int = 0
    max_unacknowledged: int = 256
    """Samples handed to the broker and not yet acknowledged, at most: past it a link waits (its board waits)."""

    def topic(self, template: str, board: Board, stream: str) -> str:
        return template.format(device=board.device, stream=stream, instance=self.instance)


def default_instance() -> str:
    return f"{socket.gethostname().split('.')[0] or 'host'}-{os.getpid()}"


class Bridge:
    def __init__(self, urls: Sequence[str], broker: BrokerAddress, options: BridgeOptions):
        if not urls:
            raise EdgelineError("edgeline bridge needs at least one serial URL")
        if len(set(urls)) != len(urls):
            raise EdgelineError(f"a serial URL is named twice: {', '.join(urls)}")
        self.options = options
        self.instance = options.instance or default_instance()
        self.links = [BoardLink(url, self, baudrate=options.baudrate) for url in urls]
        self.metrics = Metrics(model="bridge", version=1, instance=self.instance)
        self.metrics.declare(
            "published",
            "publish_failed",
            "unpublished_at_stop",
            "answers_routed",
            "answers_unrouted",
            "board_results",
            "duplicate_devices",
        )
        self.metrics.counters(lambda: {f"serial_{k}": v for k, v in sum_counters(self.links).items()})
        self.metrics.gauges(self._gauges)
        self.status_topic = f"edgeline/bridge/{self.instance}/status"
        self.availability_topic = f"edgeline/bridge/{self.instance}/availability"
        config = BrokerConfig(host=broker.host, port=broker.port, session_expiry_s=SESSION_EXPIRY_S)
        self.connection = MqttConnection(
            config, client_id=f"edgeline-bridge-{self.instance}", will=(self.availability_topic, b"offline")
        )
        self.connection.subscribe([], options.qos, self._on_answer)
        self.boards: dict[str, BoardLink] = {}
        self._config_topics: dict[str, str] = {}
        """Each board's config topic, to its device."""
        self._configs: dict[str, dict[str, Any]] = {}
        """Each board's last config: sent again when the board restarts."""
        self._lock = threading.Condition()
        self._unacknowledged = 0
        self._arrived: OrderedDict[tuple[str, int, int], float] = OrderedDict()
        """When each recent input frame came, by (device, stream, seq): the answer sent down closes its round trip."""
        self._stopping = threading.Event()
        self._link_ended = False
        self.failed_log = Repeated(log, "samples the broker did not take (not acknowledged to the board)")
        self.unrouted_log = Repeated(log, "answers that name no board of this bridge", level=logging.DEBUG)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def run(self, stopping: threading.Event, duration_s: float | None = None) -> int:
        """Bridge until ``stopping`` is set (or for ``duration_s``); 0 when it stopped as asked."""
        self._stopping = stopping
        server = None
        if self.options.prometheus_port:
            server = MetricsServer(self.metrics, self.options.prometheus_port).start()
        self.connection.start(_thread("edgeline-bridge-mqtt"))
        self.connection.publish(self.availability_topic, b"online", qos=1, retain=True)
        serve = partial(self._serve_link, stopping=stopping)
        threads = [_thread(f"edgeline-bridge-{i}")(partial(serve, link)) for i, link in enumerate(self.links)]
        ports = ", ".join(link.url for link in self.links)
        log.info(
            "edgeline bridge %s: %s to %s; samples to %s, answers from %s, board results to %s%s",
            self.instance, ports, self.connection.address, self.options.publish, self.options.answers,
            self.options.results, f"; /metrics on port {server.port}" if server else "",
        )  # fmt: skip
        deadline = None if duration_s is None else time.monotonic() + duration_s
        try:
            while not stopping.is_set():
                wait = self.options.status_interval_s
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - time.monotonic()))
                if stopping.wait(wait):
                    break
                self.publish_status()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        finally:
            stopping.set()
            for thread in threads:
                thread.join(STOP_WAIT_S)
            with self._lock:  # what the broker has not acknowledged yet: the boards resend it to the next run
                self._lock.wait_for(lambda: self._unacknowledged == 0, STOP_WAIT_S)
            self.publish_status()
            self.connection.publish(self.availability_topic, b"offline", qos=1, retain=True)
            self.connection.close()
            if server is not None:
                server.stop()
        return 1 if self._link_ended else 0

    def _serve_link(self, link: BoardLink, stopping: threading.Event) -> None:
        """A link's thread. A link takes every exception of its board and reopens its port: if it ends all the same,
        the bridge cannot do its job, and stops with exit status 1 (a service manager starts it again), rather than
        live on with a port nobody reads."""
        try:
            link.run(stopping)
        finally:
            if not stopping.is_set():
                log.critical("the link of %s ended while the bridge runs: the bridge stops (exit status 1)", link.url)
                self._link_ended = True
                stopping.set()

    def status(self) -> dict[str, Any]:
        return self.metrics.snapshot({"boards": [link.status() for link in self.links]})

    def publish_status(self) -> None:
        self.connection.publish(self.status_topic, orjson.dumps(self.status()), qos=1, retain=True)

    def _gauges(self) -> dict[str, float | int | bool | None]:
        return {
            "connected": self.connection.connected.is_set(),
            "ports_open": sum(link.connected.is_set() for link in self.links),
            "boards_known": len(self.boards),
            "unacknowledged": self._unacknowledged,
        }

    # -- LinkHandler (a link's thread) -------------------------------------------------------------------------
    def on_hello(self, link: BoardLink, board: Board, restarted: bool) -> None:
        for spec in board.streams.values():
            problem = topic_problem(self.options.topic(self.options.publish, board, spec.name))
            if problem is not None:
                log.error("board %s stream %s: its topic would be %s; its samples are refused", board.device,
                          spec.name, problem)  # fmt: skip
        with self._lock:
            other = self.boards.get(board.device)
            self.boards[board.device] = link
        if other is not None and other is not link and other.board is not None and other.board.device == board.device:
            if other.connected.is_set():  # both ports are live: two boards, one id
                self.metrics.count("duplicate_devices")
                log.error(
                    "two boards say they are %s, on %s and %s (a cloned firmware image?): answers go to %s",
                    board.device, other.url, link.url, link.url,
                )  # fmt: skip
            else:  # its old port is gone: the board was plugged in elsewhere, and keeps its name and streams
                log.info("board %s moved from %s to %s", board.device, other.url, link.url)
        if other is None:
            self.connection.add_subscription(self.options.answers.format(device=board.device), self.options.qos)
            config_topic = self.options.board_config.format(device=board.device)
            self._config_topics[config_topic] = board.device
            self.connection.add_subscription(config_topic, self.options.qos)
        config = self._configs.get(board.device)
        if restarted and config is not None:  # it booted with its compiled-in settings: give it the operator's again
            self._configure(link, board.device, config)

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        topic = self.options.topic(self.options.publish, board, stream.name)
        if topic_problem(topic) is not None:
            return  # said at its HELLO
        failed = partial(link.retake, frame.stream, frame.seq)
        arrived = time.monotonic()
        with self._lock:
            self._arrived[(board.device, frame.stream, frame.seq)] = arrived
            if len(self._arrived) > MAX_TRACKED:
                self._arrived.popitem(last=False)
        for index, sample in enumerate(samples):
            if not self._wait_for_room():  # stopping: not acknowledged, so a reliable board resends it to the next
                self.metrics.count("unpublished_at_stop", len(samples) - index)  # bridge; any other board's is lost
                return
            payload = sample_payload(input_id(frame.stream, frame.seq, index, frame.t_us, board.boot), sample)
            done = partial(self._published, safe[index], failed if frame.ack_requested else None, arrived)
            self.connection.publish(topic, payload, qos=self.options.qos, done=done)

    def on_result(self, link: BoardLink, board: Board, frame: Frame, record: dict[str, Any]) -> None:
        spec = board.streams.get(frame.stream)
        topic = self.options.topic(self.options.results, board, spec.name if spec else str(frame.stream))
        self.metrics.count("board_results")
        self.connection.publish(topic, orjson.dumps(record), qos=self.options.qos)

    def _wait_for_room(self) -> bool:
        with self._lock:
            while self._unacknowledged >= self.options.max_unacknowledged:
                if self._stopping.is_set():
                    return False
                self._lock.wait(0.1)
            if self._stopping.is_set():
                return False
            self._unacknowledged += 1
        return True

    def _published(
        self, safe: Callable[[], None], failed: Callable[[], None] | None, arrived: float, ok: bool, reason: str | None
    ) -> None:
        with self._lock:
            self._unacknowledged -= 1
            self._lock.notify_all()
        if ok:
            self.metrics.count("published")
            self.metrics.observe("publish", time.monotonic() - arrived)
            safe()
            return
        self.metrics.count("publish_failed")
        self.failed_log.happened(1, f"e.g. {reason}")
        if failed is not None:
            failed()  # reliable: the board's resend of this frame is taken again

    # -- answers (the MQTT network thread) ---------------------------------------------------------------------
    def _on_answer(self, topic: str, payload: bytes, ack: Callable[[], None] | None, reply: object) -> None:
        try:
            device = self._config_topics.get(topic)
            if device is None:
                self._route(topic, payload)
            else:
                self._board_config(device, payload)
        finally:
            if ack is not None:
                ack()

    def _board_config(self, device: str, payload: bytes) -> None:
        """A CONFIG for a board, from its config topic (retained: a board that restarts, or a bridge that starts,
        gets it again): kept, and sent down now if the board is here."""
        try:
            config = orjson.loads(payload)
        except orjson.JSONDecodeError:
            config = None
        if not isinstance(config, dict) or len(payload) > MAX_CONFIG_BYTES:
            self.metrics.count("configs_refused")
            log.warning("board %s: a config that is not a JSON object of at most %d bytes, not sent: %r", device,
                        MAX_CONFIG_BYTES, payload[:200])  # fmt: skip
            return
        self._configs[device] = config
        link = self.boards.get(device)
        if link is not None:
            self._configure(link, device, config)

    def _configure(self, link: BoardLink, device: str, config: dict[str, Any]) -> None:
        if link.configure(config):
            self.metrics.count("configs_sent")
            log.info("board %s: sent its config %s", device, orjson.dumps(config).decode()[:300])

    def _route(self, topic: str, payload: bytes) -> None:
        try:
            record = orjson.loads(payload)
        except orjson.JSONDecodeError:
            record = None
        device = record.get("device") if isinstance(record, dict) else None
        where = parse_input_id(record.get("id")) if isinstance(record, dict) else None
        link = self.boards.get(device) if isinstance(device, str) else None
        if link is None or where is None or not link.answer(where[0], where[1], payload):
            self.metrics.count("answers_unrouted")
            self.unrouted_log.happened(1, f"e.g. on {topic}: {payload[:200]!r}")
            return
        self.metrics.count("answers_routed")
        with self._lock:
            arrived = self._arrived.pop((str(device), where[0], where[1]), None)
        if arrived is not None:
            self.metrics.observe("total", time.monotonic() - arrived)


def _thread(name: str) -> Callable[[Callable[[], None]], threading.Thread]:
    def start(target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    return start
