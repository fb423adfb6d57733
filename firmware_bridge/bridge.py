"""``edgeline bridge``: boards on serial ports (the framed protocol) to an MQTT broker, and their answers back down.

    board ─SAMPLES─► link ─► sensors/{device}/{stream}  ─► a daemon anywhere (`edgeline run`, default topics)
    board ◄─ANSWER── link ◄─ edgeline/+/{device}/result ◄─┘
    board ─RESULT──► link ─► boards/{device}/{stream}/result     (what a board ran itself)
    board ◄─CONFIG── link ◄─ boards/{device}/config                (an operator's settings: rate, streams on/off)

Every sample is published in the daemon's own payload format (``{"id", "data"}``, QoS 1), so a daemon with its
default subscription answers it; its id (``stream.seq.index.t_us[.boot]@instance``) routes the answer back to the
frame: to this bridge's board (a board of the same name on another bridge, a twin, makes the same numbers), and to
the boot that sent it. The bridge subscribes to the answers of each board it meets (by the ``device`` of its HELLO),
once; answers that come before the board's HELLO (a restarted bridge's persistent session) wait for it, bounded.
Each board it serves is claimed, retained, on ``edgeline/board-claims/{device}``: another bridge's live claim for a
name served here is a twin, counted (``duplicate_devices``) and said.

In reliable mode a frame's ACK goes to the board once the broker has acknowledged every sample of it, and the
daemon's window has room (``window.AnswerWindow``: samples published and not answered, at most
``max_unanswered`` per daemon, or the broker's queue for a slow daemon overflows and drops them); a bridge killed
at any moment loses nothing, since the board resends what was not acknowledged to the next one. Unreliable samples
that find the window full are dropped and counted (``dropped_backpressure``). What the bridge took reconciles:
``samples`` in the status message: sent = answered + dropped (by reason) + in flight.

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
from collections import OrderedDict, deque
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
from edgeline.firmware_bridge.claims import Claims
from edgeline.firmware_bridge.link import (
    DOWNLINK_FRAMES,
    Board,
    BoardLink,
    StreamSpec,
    input_id,
    parse_input_id,
    sum_counters,
)
from edgeline.firmware_bridge.protocol import Frame
from edgeline.firmware_bridge.source import sample_payload
from edgeline.firmware_bridge.topics import DEFAULT_ANSWERS, DEFAULT_CONFIG, DEFAULT_PUBLISH, DEFAULT_RESULTS
from edgeline.firmware_bridge.window import AnswerWindow
from edgeline.lograte import Repeated

__all__ = ["Bridge", "BridgeOptions"]

log = logging.getLogger("edgeline.bridge")

SESSION_EXPIRY_S = 3600
"""The broker keeps the bridge's session (and the answers for its boards) this long while it is away."""
STOP_WAIT_S = 5.0
MAX_CONFIG_BYTES = 1024
"""A CONFIG is a few settings: a larger payload is a mistake (it must fit one frame in any case)."""
MAX_TRACKED = 65536
"""Samples in the window (published, not answered) at most, whatever ``max_unanswered``: past it the oldest count
as not answered."""
DEFAULT_MAX_UNANSWERED = 500
"""Per daemon. A stock Mosquitto queues 1,000 messages per client (``max_queued_messages``) besides 20 in flight
(``max_inflight_messages``); a daemon acknowledges an input once it is answered, so what a daemon has not answered
is in its queue or in flight. With reliable boards the bridge may publish one window of frames per board past the
mark before their ACKs stop (8 frames on the emulated boards): 500 + 8 x boards x samples per frame stays under
1,020 up to 65 one-sample boards per daemon, and leaves room for a second bridge's boards. Unreliable samples never
pass it."""
DEFAULT_ANSWER_TIMEOUT_S = 60.0
"""A sample not answered this long after its frame arrived leaves the window, counted ``unanswered``."""
MAX_EARLY_ANSWERS = 1024
"""Answers kept per board before its HELLO (a restarted bridge's session delivers them first), at most."""
MAX_EARLY_DEVICES = 64
LIVE_S = 3.0
"""A board heard this recently is live (it sends a HEARTBEAT at least once a second): only live boards are claimed."""
TICK_S = 0.5
UNKNOWN_DAEMON = "a daemon not known yet"
"""The window of every board before any daemon answered: one, as if one daemon served them all (the common case,
and the safe guess: a window per board would let a daemon's queue take a window from each). Then a board no daemon
has answered yet counts in the window of the first daemon that answered any."""


MAX_DOWNLINK_FRAMES = 4096
"""Frames queued for one board, at most, whatever the window (16 MB of the largest frames)."""


def downlink_frames(max_unanswered: int) -> int:
    """The queue to each board: every answer its daemon may owe (one window: a board that reads never loses one to
    a burst of them) and room for the ACKs and control frames beside them."""
    if max_unanswered <= 0:  # no window: samples nobody answers
        return DOWNLINK_FRAMES
    return min(MAX_DOWNLINK_FRAMES, max(DOWNLINK_FRAMES, max_unanswered + 64))


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
    max_unanswered: int = DEFAULT_MAX_UNANSWERED
    """Samples published and not answered per daemon, at most (0: no limit; for samples nobody answers)."""
    answer_timeout_s: float = DEFAULT_ANSWER_TIMEOUT_S

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
        self.links = [
            BoardLink(url, self, baudrate=options.baudrate, downlink_frames=downlink_frames(options.max_unanswered))
            for url in urls
        ]
        self._origin = {id(link): f"{self.instance}:{port}" for port, link in enumerate(self.links)}
        """What each port's input ids end with (``@INSTANCE:PORT``): two boards of one name on this bridge (a cloned
        image on two ports) each get only the answers to their own inputs."""
        self.metrics = Metrics(model="bridge", version=1, instance=self.instance)
        self.metrics.declare(
            "published",
            "publish_failed",
            "unpublished_at_stop",
            "answers_routed",
            "answers_unrouted",
            "board_results",
            "duplicate_devices",
            "answered",
            "unanswered",
            "dropped_backpressure",
            "dropped_topic",
            "answers_other_bridge",
            "answers_earlier_boot",
            "answers_before_hello",
            "answers_before_hello_dropped",
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
        self.claims = Claims(self.instance, partial(self.connection.publish, qos=1, retain=True))
        self.connection.add_subscription(self.claims.topic_filter, 1)
        self.boards: dict[str, BoardLink] = {}
        self._config_topics: dict[str, str] = {}
        """Each board's config topic, to its device."""
        self._configs: dict[str, dict[str, Any]] = {}
        """Each board's last config: sent again when the board restarts."""
        self._lock = threading.Condition()
        self._unacknowledged = 0
        self.window = AnswerWindow(options.max_unanswered, options.answer_timeout_s, MAX_TRACKED)
        self._answerer: dict[str, str] = {}
        """Each board's window key: the first daemon that answered it."""
        self._first_daemon = UNKNOWN_DAEMON
        """The window key of a board no daemon has answered yet."""
        self._early: OrderedDict[str, deque[bytes]] = OrderedDict()
        """Answers that came before their board's HELLO, by device: sent down at its HELLO."""
        self._stopping = threading.Event()
        self._link_ended = False
        self.failed_log = Repeated(log, "samples the broker did not take (not acknowledged to the board)")
        self.unrouted_log = Repeated(log, "answers that name no board of this bridge", level=logging.DEBUG)
        self.full_log = Repeated(log, "unreliable samples dropped: the daemon's window is full (it is slower than the "
                                 "boards)")  # fmt: skip
        self.unanswered_log = Repeated(log, "samples published and never answered (the broker or the daemon lost "
                                       "them; a stock broker drops what a slow daemon has not taken)")  # fmt: skip
        self.twin_log = Repeated(
            log, "two boards claim one name on two bridges (a cloned firmware image?); each gets only its own answers",
            level=logging.ERROR, remember=MAX_EARLY_DEVICES,
        )  # fmt: skip

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
        next_status = time.monotonic() + self.options.status_interval_s
        try:
            while not stopping.is_set():
                wait = min(TICK_S, max(0.0, next_status - time.monotonic()))
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - time.monotonic()))
                if stopping.wait(wait):
                    break
                self._tick()
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + self.options.status_interval_s
                    self._claim_live_boards()
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
            self.claims.release()  # a board that moves to another bridge is not met by our claim
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
        return self.metrics.snapshot({"boards": [link.status() for link in self.links], "samples": self.reconcile()})

    def reconcile(self) -> dict[str, Any]:
        """Where every sample the links took went: ``sent`` = ``answered`` + ``dropped`` (by reason) + ``in_flight``
        (published or being published, not answered yet). Exact once the bridge is at rest; a sample between its
        frame and its publish is counted in ``sent`` only. ``publish_failed`` samples of reliable frames are taken
        again when the board resends them (each taking counts)."""
        counts = self.metrics.snapshot()["counts"]
        dropped = {
            reason: int(counts.get(name, 0))
            for reason, name in (
                ("backpressure", "dropped_backpressure"),
                ("publish_failed", "publish_failed"),
                ("at_stop", "unpublished_at_stop"),
                ("unanswered", "unanswered"),
                ("topic", "dropped_topic"),
            )
        }
        return {
            "sent": int(counts.get("serial_samples", 0)),
            "answered": int(counts.get("answered", 0)),
            "dropped": dropped,
            "in_flight": self.window.in_flight,
        }

    def _tick(self) -> None:
        expired = self.window.expire(time.monotonic())
        if expired:
            self.metrics.count("unanswered", expired)
            self.unanswered_log.happened(expired, f"{expired} not answered within {self.options.answer_timeout_s:g} s")
        for said in (self.failed_log, self.unrouted_log, self.full_log, self.unanswered_log, self.twin_log):
            said.tick()

    def publish_status(self) -> None:
        self.connection.publish(self.status_topic, orjson.dumps(self.status()), qos=1, retain=True)

    def _gauges(self) -> dict[str, float | int | bool | None]:
        return {
            "connected": self.connection.connected.is_set(),
            "ports_open": sum(link.connected.is_set() for link in self.links),
            "boards_known": len(self.boards),
            "unacknowledged": self._unacknowledged,
            "in_flight": self.window.in_flight,
            "acks_held": self.window.held,
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
                    "two boards say they are %s, on %s and %s (a cloned firmware image?): each gets the answers "
                    "to its own inputs; their samples share the device's topics", board.device, other.url, link.url,
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
        self.claims.claim(board.device, link.url, board.boot)
        with self._lock:
            early = self._early.pop(board.device, deque())
        for payload in early:
            self._route(payload)

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        topic = self.options.topic(self.options.publish, board, stream.name)
        if topic_problem(topic) is not None:
            self.metrics.count("dropped_topic", len(samples))  # said at its HELLO
            return
        failed = partial(link.retake, frame.stream, frame.seq)
        arrived = time.monotonic()
        key = self._answerer.get(board.device, self._first_daemon)
        for index, sample in enumerate(samples):
            if not frame.ack_requested and self.window.full(key):  # a reliable frame's ACK waits instead (safe)
                self.metrics.count("dropped_backpressure")
                self.full_log.happened(1, f"e.g. board {board.device}, {self.options.max_unanswered} unanswered")
                continue
            if not self._wait_for_room():  # stopping: not acknowledged, so a reliable board resends it to the next
                self.metrics.count("unpublished_at_stop", len(samples) - index)  # bridge; any other board's is lost
                return
            ident = input_id(frame.stream, frame.seq, index, frame.t_us, board.boot, self._origin[id(link)])
            pushed = self.window.enter(f"{board.device} {ident}", key, arrived)  # ids repeat across boards
            if pushed:
                self.metrics.count("unanswered", pushed)
            done = partial(self._published, f"{board.device} {ident}", safe[index],
                           failed if frame.ack_requested else None, arrived)  # fmt: skip
            self.connection.publish(topic, sample_payload(ident, sample), qos=self.options.qos, done=done)

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
        self, ident: str, safe: Callable[[], None], failed: Callable[[], None] | None, arrived: float,
        ok: bool, reason: str | None,
    ) -> None:  # fmt: skip
        with self._lock:
            self._unacknowledged -= 1
            self._lock.notify_all()
        if ok:
            self.metrics.count("published")
            self.metrics.observe("publish", time.monotonic() - arrived)
            self.window.when_room(ident, safe)
            return
        self.window.forget(ident)
        self.metrics.count("publish_failed")
        self.failed_log.happened(1, f"e.g. {reason}")
        if failed is not None:
            failed()  # reliable: the board's resend of this frame is taken again

    # -- answers (the MQTT network thread) ---------------------------------------------------------------------
    def _on_answer(self, topic: str, payload: bytes, ack: Callable[[], None] | None, reply: object) -> None:
        try:
            device = self._config_topics.get(topic)
            if device is not None:
                self._board_config(device, payload)
            elif topic.startswith(self.claims.prefix):
                self._claimed(topic, payload)
            else:
                self._route(payload, topic)
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

    def _route(self, payload: bytes, topic: str = "") -> None:
        """An answer: down to the board whose input it answers (this bridge's, the boot that sent it), kept until
        the board's HELLO when it is not known yet."""
        try:
            record = orjson.loads(payload)
        except orjson.JSONDecodeError:
            record = None
        device = record.get("device") if isinstance(record, dict) else None
        ident = record.get("id") if isinstance(record, dict) else None
        where = parse_input_id(ident)
        if not isinstance(device, str) or not isinstance(ident, str) or where is None:
            self.metrics.count("answers_unrouted")
            self.unrouted_log.happened(1, f"e.g. on {topic}: {payload[:200]!r}")
            return
        numbers, _, origin = ident.partition("@")
        instance, _, port = origin.rpartition(":")
        if instance != self.instance or not port.isdigit() or int(port) >= len(self.links):
            self.metrics.count("answers_other_bridge")  # a board of the same name on another bridge (or before ids
            return  # said whose)
        arrived = self.window.answered(f"{device} {ident}")
        if arrived is not None:
            self.metrics.count("answered")
            answerer = record.get("instance") if isinstance(record, dict) else None
            if isinstance(answerer, str) and answerer and device not in self._answerer:
                self._answerer[device] = f"daemon {answerer}"
                if self._first_daemon == UNKNOWN_DAEMON:
                    self._first_daemon = self._answerer[device]
                    self.window.rekey(UNKNOWN_DAEMON, self._first_daemon)
        link: BoardLink | None = self.links[int(port)]  # the port its input came from
        if link is None or link.board is None or link.board.device != device:
            link = self.boards.get(device)  # another board on that port now: this one moved to another port
        board = link.board if link is not None else None
        if link is None or board is None or board.device != device:
            self._keep_early(device, payload)
            return
        parts = numbers.split(".")
        boot = int(parts[4]) if len(parts) == 5 else None
        if boot != board.boot:  # an input of its previous boot: its stream and seq now name another input
            self.metrics.count("answers_earlier_boot")
            return
        if not link.answer(where[0], where[1], payload):
            self.metrics.count("answers_unrouted")
            self.unrouted_log.happened(1, f"e.g. on {topic}: board {device} away")
            return
        self.metrics.count("answers_routed")
        if arrived is not None:
            self.metrics.observe("total", time.monotonic() - arrived)

    def _keep_early(self, device: str, payload: bytes) -> None:
        with self._lock:
            kept = self._early.get(device)
            if kept is None:
                if len(self._early) >= MAX_EARLY_DEVICES:
                    gone = self._early.popitem(last=False)[1]
                    self.metrics.count("answers_before_hello_dropped", len(gone))
                kept = self._early[device] = deque()
            if len(kept) >= MAX_EARLY_ANSWERS:
                kept.popleft()
                self.metrics.count("answers_before_hello_dropped")
            kept.append(payload)
        self.metrics.count("answers_before_hello")

    # -- twins: one name claimed by boards on two bridges (claims.py) -----------------------------------------
    def _claim_live_boards(self) -> None:
        """Claimed again at every status message: a claim that changes is a live bridge's."""
        for link in self.links:
            board = link.board
            if board is not None and self._live(link):
                self.claims.claim(board.device, link.url, board.boot)

    @staticmethod
    def _live(link: BoardLink) -> bool:
        return link.connected.is_set() and link.last_heard is not None and time.monotonic() - link.last_heard < LIVE_S

    def _claimed(self, topic: str, payload: bytes) -> None:
        twin = self.claims.received(topic, payload)
        link = self.boards.get(twin[0]) if twin is not None else None
        if twin is None or link is None or not self._live(link):
            return
        device, other, port = twin
        if self.twin_log.happened(1, f"{device} on {link.url} here and on bridge {other} ({port})", key=twin[:2]):
            self.metrics.count("duplicate_devices")


def _thread(name: str) -> Callable[[Callable[[], None]], threading.Thread]:
    def start(target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    return start
