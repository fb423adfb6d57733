"""``edgeline bridge``: boards on serial ports (the framed protocol) to an MQTT broker, and their answers back down.

    board ─SAMPLES─► link ─► sensors/{device}/{stream}  ─► a daemon anywhere (`edgeline run`, default topics)
    board ◄─ANSWER── link ◄─ edgeline/+/{device}/result ◄─┘
    board ─RESULT──► link ─► boards/{device}/{stream}/result     (what a board ran itself)
    board ◄─CONFIG── link ◄─ boards/{device}/config                (an operator's settings: rate, streams on/off)

Every sample is published in the daemon's own payload format (``{"id", "data"}``, QoS 1), so a daemon with its
default subscription answers it; its id (``stream.seq.index.t_us[.boot]@instance:port[:session]``) routes the
answer back to the frame: to this bridge's board (a board of the same name on another bridge, a twin, makes the same
numbers), and to the boot that sent it (its ``boot``, or for a board without one the link's session: a restart the
link saw ends every answer owed to the boot before). The bridge subscribes to the answers of each board it meets (by
the ``device`` of its HELLO), once, and unsubscribes when no port serves that name any more (a board renamed: its
claim cleared, everything the bridge kept for the name forgotten); answers that come before the board's HELLO (a
restarted bridge's persistent session) wait for it, bounded. An answer that comes twice (a QoS 1 redelivery, a
sample published twice) goes down once (``answers_duplicate``). Each board it serves is claimed, retained, on
``edgeline/board-claims/{device}``: another bridge's live claim for a name served here is a twin, counted
(``duplicate_devices``) and said.

"Safe" is end to end. In reliable mode a frame's ACK goes to the board once every sample of it is answered
(``window.AnswerWindow``): a broker's PUBACK is no promise (a persistent Mosquitto saves after it acknowledges, and
one SIGKILLed in between loses what it acknowledged; a stock one drops what a slow daemon's queue has no room for),
the daemon's answer is (it answers from its durable outbox). Until then the board holds the frame; one not answered
within ``answer_timeout_s``, or in flight when the bridge reconnects to the broker, is taken again from the board's
resend and published again (``retaken``): a bridge, broker or daemon killed at any moment loses nothing. With
``max_unanswered`` 0 (samples nobody answers) the PUBACK is all there is, and makes a frame safe. Unreliable samples
that find the window full are dropped and counted (``dropped_backpressure``). What the bridge took reconciles:
``samples`` in the status message: sent = answered + dropped (by reason) + in flight.

Each port has its own thread and ``BoardLink`` (reopened with back-off); one MQTT connection carries them all. The
links' counters, summed, are the bridge's ``serial_*`` counters, in its status message (``edgeline/bridge/
{instance}/status``, retained) and on ``/metrics`` (``--prometheus-port``), with two latency stages: ``publish``
(a frame's arrival to the broker's PUBACK of its samples) and ``total`` (its arrival to its answer sent down). Every
line a board can make the bridge log goes through one throttle (``edgeline.lograte.Repeated``, per port) and quotes
what the board sent with ``edgeline.lograte.shown``.
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
from typing import Any, NamedTuple

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
from edgeline.firmware_bridge.window import Answer, AnswerWindow, Left, Taken
from edgeline.lograte import Repeated, shown

__all__ = ["Bridge", "BridgeOptions"]

log = logging.getLogger("edgeline.bridge")

SESSION_EXPIRY_S = 3600
"""The broker keeps the bridge's session (and the answers for its boards) this long while it is away."""
STOP_WAIT_S = 5.0
MAX_CONFIG_BYTES = 1024
"""A CONFIG is a few settings: a larger payload is a mistake (it must fit one frame in any case)."""
MAX_TRACKED = 65536
"""Samples in the window (published, not answered) at most, whatever ``max_unanswered``: past it the oldest leave it
(a reliable one is taken again from its board's resend; any other counts as not answered)."""
REMEMBERED_ANSWERS = 16384
"""Samples whose answer the bridge remembers (the latest 8,192 at least, in two generations), so that an answer that
comes again goes down once: far more than the answers in flight at any time (a window per daemon, and the boards'
frame windows); about 2 MB of ids at most."""
DEFAULT_MAX_UNANSWERED = 500
"""Per daemon. A stock Mosquitto queues 1,000 messages per client (``max_queued_messages``) besides 20 in flight
(``max_inflight_messages``); a daemon acknowledges an input once it is answered, so what a daemon has not answered
is in its queue or in flight. A reliable board's frames are acknowledged at their answers, so its own window of
unacknowledged frames (8 on the emulated boards) bounds what it has in flight; unreliable samples never pass the
mark. 500 + 8 x boards x samples per frame stays under 1,020 up to 65 one-sample boards per daemon, and leaves room
for a second bridge's boards (what a full queue drops anyway is taken again, never lost)."""
DEFAULT_ANSWER_TIMEOUT_S = 60.0
"""A sample not answered this long after its frame arrived leaves the window: a reliable one is taken again from its
board's resend (``retaken``), any other is counted ``unanswered``."""
MAX_EARLY_ANSWERS = 1024
"""Answers kept per board before its HELLO (a restarted bridge's session delivers them first), at most."""
MAX_EARLY_DEVICES = 64
MAX_LEAVING = 256
"""Names no port serves any more, waiting for the next tick to be let go, at most (past it the oldest goes at once)."""
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
    """Samples published and not answered per daemon, at most (0: no limit, and a reliable frame is safe at the
    broker's PUBACK; for samples nobody answers)."""
    answer_timeout_s: float = DEFAULT_ANSWER_TIMEOUT_S

    def topic(self, template: str, board: Board, stream: str) -> str:
        return template.format(device=board.device, stream=stream, instance=self.instance)


def default_instance() -> str:
    return f"{socket.gethostname().split('.')[0] or 'host'}-{os.getpid()}"


class _Routed(NamedTuple):
    """An answer for a board of this bridge, read: what sending it down needs."""

    device: str
    numbers: str
    """The input id before ``@``: ``stream.seq.index.t_us[.boot]``."""
    stream: int
    seq: int
    port: int
    session: int | None
    """The link's session the input came in (a board without ``boot``), or None."""
    payload: bytes


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
        """What each port's input ids end with (``@INSTANCE:PORT``, then ``:SESSION`` for a board without ``boot``):
        two boards of one name on this bridge (a cloned image on two ports) each get only the answers to their own
        inputs."""
        self.metrics = Metrics(model="bridge", version=1, instance=self.instance)
        self.metrics.declare(
            "published",
            "publish_failed",
            "unpublished_at_stop",
            "answers_routed",
            "answers_unrouted",
            "answers_duplicate",
            "board_results",
            "duplicate_devices",
            "answered",
            "unanswered",
            "retaken",
            "dropped_backpressure",
            "dropped_topic",
            "answers_other_bridge",
            "answers_earlier_boot",
            "answers_before_hello",
            "answers_before_hello_dropped",
            "names_released",
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
        self.claims = Claims(self.instance, partial(self.connection.publish, qos=1, retain=True), serves=self._serves)
        self.connection.add_subscription(self.claims.topic_filter, 1)
        self.boards: dict[str, BoardLink] = {}
        """Each name served, to the port that said it last. Bounded by the ports: a name no port serves any more
        leaves it, and is let go (``_leaving``)."""
        self._served: dict[int, str] = {}
        """Each port's name, by ``id(link)``: what a port that changes name leaves."""
        self._subscribed: set[str] = set()
        """The names whose answers and config the bridge is subscribed to: those served, and those leaving."""
        self._leaving: dict[str, None] = {}
        """Names no port serves any more, let go at the next tick (``MAX_LEAVING`` at most: then at once)."""
        self._config_topics: dict[str, str] = {}
        """Each board's config topic, to its device."""
        self._configs: dict[str, dict[str, Any]] = {}
        """Each board's last config: sent again when the board restarts."""
        self._lock = threading.Condition()
        self._unacknowledged = 0
        self._ack_at_answer = options.max_unanswered > 0
        """Reliable frames are acknowledged at their answers; with no window (samples nobody answers), at the PUBACK."""
        self.window = AnswerWindow(options.max_unanswered, options.answer_timeout_s, MAX_TRACKED, REMEMBERED_ANSWERS)
        self._answerer: dict[str, str] = {}
        """Each board's window key: the first daemon that answered it."""
        self._first_daemon = UNKNOWN_DAEMON
        """The window key of a board no daemon has answered yet."""
        self._early: OrderedDict[str, deque[_Routed]] = OrderedDict()
        """Answers that came before their board's HELLO, by device: sent down at its HELLO."""
        self._generation = 0
        """The MQTT connection's last generation seen: a new one is a reconnection."""
        self._stopping = threading.Event()
        self._link_ended = False
        self.failed_log = Repeated(log, "samples the broker did not take (not acknowledged to the board)")
        self.unrouted_log = Repeated(log, "answers that name no board of this bridge", level=logging.DEBUG)
        self.full_log = Repeated(log, "unreliable samples dropped: the daemon's window is full (it is slower than the "
                                 "boards)")  # fmt: skip
        self.unanswered_log = Repeated(log, "samples published and never answered (the broker or the daemon lost "
                                       "them; a stock broker drops what a slow daemon has not taken)")  # fmt: skip
        self.retaken_log = Repeated(log, "reliable samples not answered in time, or in flight when the broker came "
                                    "back: taken again from the boards' resends", level=logging.INFO)  # fmt: skip
        self.twin_log = Repeated(
            log, "two boards claim one name on two bridges (a cloned firmware image?); each gets only its own answers",
            level=logging.ERROR, remember=MAX_EARLY_DEVICES,
        )  # fmt: skip
        ports = len(self.links)
        # What a board makes the bridge say, each kind one throttle, one episode per port: a flood costs a few lines
        self.topic_log = Repeated(log, "boards whose topics the broker would refuse", level=logging.ERROR,
                                  remember=ports)  # fmt: skip
        self.clone_log = Repeated(log, "boards of one name on two ports", level=logging.ERROR, remember=ports)
        self.moved_log = Repeated(log, "boards moved to another port", level=logging.INFO, remember=ports)
        self.config_log = Repeated(log, "board configs sent", level=logging.INFO, remember=ports)
        self.config_refused_log = Repeated(log, "board configs refused", remember=ports)

    @property
    def _said(self) -> tuple[Repeated, ...]:
        return (self.failed_log, self.unrouted_log, self.full_log, self.unanswered_log, self.retaken_log,
                self.twin_log, self.topic_log, self.clone_log, self.moved_log, self.config_log,
                self.config_refused_log)  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def run(self, stopping: threading.Event, duration_s: float | None = None) -> int:
        """Bridge until ``stopping`` is set (or for ``duration_s``); 0 when it stopped as asked."""
        self._stopping = stopping
        server = None
        if self.options.prometheus_port:
            server = MetricsServer(self.metrics, self.options.prometheus_port).start()
        self.connection.start(_thread("edgeline-bridge-mqtt"))
        self._generation = self.connection.generation
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
        frame and its publish is counted in ``sent`` only. A sample of a reliable frame taken again (the board's
        resend of a frame not answered in time, refused by the broker, or in flight when the bridge reconnected) is
        taken, and counted, once more each time: each taking but the one answered ends as ``retaken`` (or
        ``publish_failed``)."""
        counts = self.metrics.snapshot()["counts"]
        dropped = {
            reason: int(counts.get(name, 0))
            for reason, name in (
                ("backpressure", "dropped_backpressure"),
                ("publish_failed", "publish_failed"),
                ("at_stop", "unpublished_at_stop"),
                ("unanswered", "unanswered"),
                ("topic", "dropped_topic"),
                ("retaken", "retaken"),
            )
        }
        return {
            "sent": int(counts.get("serial_samples", 0)),
            "answered": int(counts.get("answered", 0)),
            "dropped": dropped,
            "in_flight": self.window.in_flight,
        }

    def _tick(self) -> None:
        self._count_left(self.window.expire_left(time.monotonic()), "not answered within "
                         f"{self.options.answer_timeout_s:g} s")  # fmt: skip
        generation = self.connection.generation
        if generation != self._generation:
            reconnected, self._generation = self._generation > 0, generation
            retaken = self.window.retake_all() if reconnected and self._ack_at_answer else 0
            if retaken:  # what the broker acknowledged before it went may be lost: taken again, published again
                self.retaken_log.happened(0, f"the broker is back: {retaken} samples in flight, taken again")
        self._release_left()
        for said in self._said:
            said.tick()

    def _count_left(self, left: Left, why: str) -> None:
        if left.unanswered:
            self.metrics.count("unanswered", left.unanswered)
            self.unanswered_log.happened(left.unanswered, f"{left.unanswered} {why}")
        if left.retaken:
            self.metrics.count("retaken", left.retaken)
            self.retaken_log.happened(left.retaken, f"{left.retaken} {why}")

    def publish_status(self) -> None:
        self.connection.publish(self.status_topic, orjson.dumps(self.status()), qos=1, retain=True)

    def _gauges(self) -> dict[str, float | int | bool | None]:
        return {
            "connected": self.connection.connected.is_set(),
            "ports_open": sum(link.connected.is_set() for link in self.links),
            "boards_known": len(self.boards),
            "names_kept": self._names_kept(),
            "unacknowledged": self._unacknowledged,
            "in_flight": self.window.in_flight,
            "acks_held": self.window.held,
            "answers_remembered": self.window.remembered,
        }

    def _names_kept(self) -> int:
        """Entries of every structure the bridge keeps by device name (bounded: the names its ports serve, the
        early answers' devices, the claims of those names)."""
        return (len(self.boards) + len(self._subscribed) + len(self._leaving) + len(self._config_topics)
                + len(self._configs) + len(self._answerer) + len(self._early) + self.claims.tracked)  # fmt: skip

    # -- LinkHandler (a link's thread) -------------------------------------------------------------------------
    def on_hello(self, link: BoardLink, board: Board, restarted: bool) -> None:
        device, port = board.device, shown(link.url)
        for spec in board.streams.values():
            problem = topic_problem(self.options.topic(self.options.publish, board, spec.name))
            if problem is not None:
                self.topic_log.happened(1, f"board {shown(device)} stream {shown(spec.name)} on {port}: its topic "
                                        f"would be {problem}; its samples are refused", key=port)  # fmt: skip
        with self._lock:  # the names' bookkeeping and what it asks of the broker, in one order for every port
            other = self.boards.get(device)
            self.boards[device] = link
            self._leaving.pop(device, None)
            left = self._served.get(id(link))
            self._served[id(link)] = device
            if left is not None and left != device and not self._still_served(left):
                self._leave(left)
            if device not in self._subscribed:  # before any of its samples is published: no answer comes unheard
                self._subscribed.add(device)
                self.connection.add_subscription(self.options.answers.format(device=device), self.options.qos)
                config_topic = self.options.board_config.format(device=device)
                self._config_topics[config_topic] = device
                self.connection.add_subscription(config_topic, self.options.qos)
                self.claims.claim(device, link.url, board.boot)  # then again at every status message
        if other is not None and other is not link and other.board is not None and other.board.device == device:
            if other.connected.is_set():  # both ports are live: two boards, one id
                self.metrics.count("duplicate_devices")
                self.clone_log.happened(
                    1, f"two boards say they are {shown(device)}, on {shown(other.url)} and {port} (a cloned "
                    "firmware image?): each gets the answers to its own inputs; their samples share the device's "
                    "topics", key=port,
                )  # fmt: skip
            else:  # its old port is gone: the board was plugged in elsewhere, and keeps its name and streams
                self.moved_log.happened(1, f"board {shown(device)} moved from {shown(other.url)} to {port}", key=port)
        config = self._configs.get(device)
        if restarted and config is not None:  # it booted with its compiled-in settings: give it the operator's again
            self._configure(link, device, config)
        with self._lock:
            early = self._early.pop(device, deque())
        for routed in early:
            self._send_down(routed)

    def _still_served(self, device: str) -> bool:
        """Whether a port still has a board of this name (under the lock): it stays, mapped to that port."""
        for link in self.links:
            if link.board is not None and link.board.device == device and self._served.get(id(link)) == device:
                self.boards[device] = link
                return True
        return False

    def _leave(self, device: str) -> None:
        """No port serves ``device`` now (under the lock): it is let go at the next tick, unless a board says it again
        by then. A board that changes names faster than that costs the broker nothing per HELLO, only per tick."""
        self.boards.pop(device, None)
        self._leaving[device] = None
        while len(self._leaving) > MAX_LEAVING:
            self._release(next(iter(self._leaving)))

    def _release_left(self) -> None:
        with self._lock:
            for device in list(self._leaving):
                self._release(device)

    def _release(self, device: str) -> None:
        """Let go of a name no port serves (under the lock): what only it needed goes, on the broker (its
        subscriptions, its retained claim) and here."""
        del self._leaving[device]
        config_topic = self.options.board_config.format(device=device)
        self._subscribed.discard(device)
        self._config_topics.pop(config_topic, None)
        self._configs.pop(device, None)
        self._answerer.pop(device, None)
        self._early.pop(device, None)
        self.connection.remove_subscription(self.options.answers.format(device=device))
        self.connection.remove_subscription(config_topic)
        self.claims.forget(device)
        self.metrics.count("names_released")

    def _serves(self, device: str) -> bool:
        return device in self.boards

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        topic = self.options.topic(self.options.publish, board, stream.name)
        if topic_problem(topic) is not None:
            self.metrics.count("dropped_topic", len(samples))  # said at its HELLO
            return
        reliable, session = frame.ack_requested, link.session
        origin = self._origin[id(link)] + ("" if board.boot is not None else f":{session}")
        retake = partial(self._retake, link, session, frame.stream, frame.seq) if reliable else None
        at_answer = reliable and self._ack_at_answer
        arrived = time.monotonic()
        key = self._answerer.get(board.device, self._first_daemon)
        for index, sample in enumerate(samples):
            if not reliable and self.window.full(key):  # a reliable frame's ACK waits for its answers instead
                self.metrics.count("dropped_backpressure")
                self.full_log.happened(1, f"e.g. board {shown(board.device)}, {self.options.max_unanswered} "
                                       "unanswered")  # fmt: skip
                continue
            ident = input_id(frame.stream, frame.seq, index, frame.t_us, board.boot, origin)
            tracked = f"{board.device} {ident}"  # ids repeat across boards
            taking = object()
            taken, left = self.window.take(
                tracked, key, arrived, safe=safe[index] if at_answer else None, retake=retake if at_answer else None,
                token=taking,
            )  # fmt: skip
            self._count_left(left, f"pushed out of the window (past {MAX_TRACKED} samples)")
            if taken is not Taken.NEW:  # a resend of a frame taken again: one taking of this sample ends here
                self.metrics.count("retaken")
            if taken is Taken.ANSWERED:  # its answer went down already: acknowledged, not published again
                safe[index]()
                continue
            if not self._wait_for_room():  # stopping: not acknowledged, so a reliable board resends it to the next
                self.window.forget(tracked, taking)  # bridge; any other board's is lost
                self.metrics.count("unpublished_at_stop", len(samples) - index)
                return
            done = partial(self._published, tracked, taking, safe[index], retake, at_answer, arrived)
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

    @staticmethod
    def _retake(link: BoardLink, session: int, stream: int, seq: int) -> bool:
        """Take reliable frame ``seq`` (and every later one of its stream) again from the board's resend; False when
        the board restarted since (a new session): it cannot resend what it sent before."""
        if link.session != session:
            return False
        link.retake(stream, seq)
        return True

    def _published(
        self, tracked: str, taking: object, safe: Callable[[], None], retake: Callable[[], bool] | None,
        at_answer: bool, arrived: float, ok: bool, reason: str | None,
    ) -> None:  # fmt: skip
        with self._lock:
            self._unacknowledged -= 1
            self._lock.notify_all()
        if ok:
            self.metrics.count("published")
            self.metrics.observe("publish", time.monotonic() - arrived)
            if at_answer:
                self.window.published(tracked, taking)  # its ACK waits for its answer
            else:
                self.window.when_room(tracked, safe)
            return
        if not self.window.forget(tracked, taking):
            return  # taken again meanwhile (counted then): that taking is under way
        self.metrics.count("publish_failed")
        self.failed_log.happened(1, f"e.g. {shown(reason)}")
        if retake is not None:
            retake()  # reliable: the board's resend of this frame is taken again

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
        link = self.boards.get(device)
        if not isinstance(config, dict) or len(payload) > MAX_CONFIG_BYTES:
            self.metrics.count("configs_refused")
            self.config_refused_log.happened(
                1, f"board {shown(device)}: a config that is not a JSON object of at most {MAX_CONFIG_BYTES} bytes, "
                f"not sent: {shown(payload)}", key=shown(link.url) if link is not None else None,
            )  # fmt: skip
            return
        with self._lock:
            if self.options.board_config.format(device=device) not in self._config_topics:
                return  # released meanwhile
            self._configs[device] = config
        if link is not None:
            self._configure(link, device, config)

    def _configure(self, link: BoardLink, device: str, config: dict[str, Any]) -> None:
        if link.configure(config):
            self.metrics.count("configs_sent")
            self.config_log.happened(1, f"board {shown(device)}: sent its config {shown(orjson.dumps(config), 300)}",
                                     key=shown(link.url))  # fmt: skip

    def _route(self, payload: bytes, topic: str = "") -> None:
        """An answer: down to the board whose input it answers (this bridge's, the boot that sent it), once, kept
        until the board's HELLO when it is not known yet."""
        try:
            record = orjson.loads(payload)
        except orjson.JSONDecodeError:
            record = None
        device = record.get("device") if isinstance(record, dict) else None
        ident = record.get("id") if isinstance(record, dict) else None
        where = parse_input_id(ident)
        if not isinstance(device, str) or not isinstance(ident, str) or where is None:
            self.metrics.count("answers_unrouted")
            self.unrouted_log.happened(1, f"e.g. on {shown(topic)}: {shown(payload)}")
            return
        numbers, _, origin = ident.partition("@")
        place = self._place(origin)
        if place is None:
            self.metrics.count("answers_other_bridge")  # a board of the same name on another bridge (or before ids
            return  # said whose)
        kind, arrived, safe = self.window.answer(f"{device} {ident}")
        if kind is Answer.DUPLICATE:  # a QoS 1 redelivery, or the answer of a sample published twice: sent already
            self.metrics.count("answers_duplicate")
            return
        if kind is Answer.FIRST:
            self.metrics.count("answered")
            answerer = record.get("instance") if isinstance(record, dict) else None
            if isinstance(answerer, str) and answerer and device not in self._answerer and device in self.boards:
                self._answerer[device] = f"daemon {answerer}"
                if self._first_daemon == UNKNOWN_DAEMON:
                    self._first_daemon = self._answerer[device]
                    self.window.rekey(UNKNOWN_DAEMON, self._first_daemon)
        routed = _Routed(device, numbers, where[0], where[1], place[0], place[1], payload)
        if self._send_down(routed) and arrived is not None:
            self.metrics.observe("total", time.monotonic() - arrived)
        if safe is not None:  # answered: the board may forget the sample (its ACK, once its frame is all answered)
            safe()

    def _place(self, origin: str) -> tuple[int, int | None] | None:
        """(port, session or None) of an input id's origin (``INSTANCE:PORT[:SESSION]``) when it names this bridge,
        else None."""
        mine = self.instance + ":"
        if not origin.startswith(mine):
            return None
        port, _, session = origin[len(mine) :].partition(":")
        if not port.isdigit() or int(port) >= len(self.links) or not (session == "" or session.isdigit()):
            return None
        return int(port), int(session) if session else None

    def _send_down(self, routed: _Routed) -> bool:
        """Write an answer to its board: the port its input came from, or the port the board is on now; kept when
        the board is not here (yet). Whether it was queued for the board."""
        link: BoardLink | None = self.links[routed.port]
        if link is None or link.board is None or link.board.device != routed.device:
            link = self.boards.get(routed.device)  # another board on that port now: this one moved to another port
        board = link.board if link is not None else None
        if link is None or board is None or board.device != routed.device:
            self._keep_early(routed)
            return False
        parts = routed.numbers.split(".")
        boot = int(parts[4]) if len(parts) == 5 else None
        session = routed.session if board.boot is None else None
        if boot != board.boot or (session is not None and session != link.session):
            self.metrics.count("answers_earlier_boot")  # its previous boot's: its stream and seq name another input
            return False
        if not self._answer(link, routed, session):
            self.metrics.count("answers_unrouted")
            self.unrouted_log.happened(1, f"e.g. board {shown(routed.device)} away, or restarted")
            return False
        self.metrics.count("answers_routed")
        return True

    @staticmethod
    def _answer(link: BoardLink, routed: _Routed, session: int | None) -> bool:
        if session is None:  # a board with boot: its input ids tell its boots apart
            return link.answer(routed.stream, routed.seq, routed.payload)
        return link.answer(routed.stream, routed.seq, routed.payload, session=session)

    def _keep_early(self, routed: _Routed) -> None:
        with self._lock:
            kept = self._early.get(routed.device)
            if kept is None:
                if len(self._early) >= MAX_EARLY_DEVICES:
                    gone = self._early.popitem(last=False)[1]
                    self.metrics.count("answers_before_hello_dropped", len(gone))
                kept = self._early[routed.device] = deque()
            if len(kept) >= MAX_EARLY_ANSWERS:
                kept.popleft()
                self.metrics.count("answers_before_hello_dropped")
            kept.append(routed)
        self.metrics.count("answers_before_hello")

    # -- twins: one name claimed by boards on two bridges (claims.py) -----------------------------------------
    def _claim_live_boards(self) -> None:
        """Claimed again at every status message: a claim that changes is a live bridge's."""
        with self._lock:  # never a name let go meanwhile
            for link in self.links:
                board = link.board
                if board is not None and self._live(link) and self.boards.get(board.device) is link:
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
        said = f"{shown(device)} on {shown(link.url)} here and on bridge {shown(other)} ({shown(port)})"
        if self.twin_log.happened(1, said, key=(shown(device), shown(other))):
            self.metrics.count("duplicate_devices")


def _thread(name: str) -> Callable[[Callable[[], None]], threading.Thread]:
    def start(target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    return start
