"""MQTT as one source and one sink among the others: the only module that sees paho-mqtt.

    MqttConnection   one paho client and our own network thread: persistent session (MQTT 5 by default, clean
                     start off, a session expiry; or MQTT 3.1.1 with clean session off), TLS with verified
                     certificates and host name, user name and password, capped exponential back-off with jitter,
                     resubscription on every connect, manual acknowledgement of inputs, PUBACK callbacks
    MqttSource       subscriptions → ``Message`` values whose ``ack`` sends the input's PUBACK
    MqttSink         answers → publishes whose ``on_done`` fires on the broker's PUBACK (or its refusal), over any
                     ``Transport`` (``edgeline.daemon.transport``: the connection is one)

paho's objects (``MQTTMessage``, reason codes, properties) are converted here into our own values; nothing past
this module imports paho.

Only the network thread touches the paho client. It runs our own select loop over paho's external-loop API
(``loop_read``, ``loop_write``, ``loop_misc``), so that other threads never write to the socket (over TLS that
corrupts the session) and never wake the loop once per packet: they hand it work with ``call_soon``, one closure
for a whole batch of publishes and acknowledgements, and one wake-up.

A failure to connect at start (refused, bad credentials, untrusted certificate) raises an ``EdgelineError``
naming the cause within seconds; once running, the connection retries for ever.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgeline.daemon.config import BrokerAddress, BrokerConfig, SourceConfig
from edgeline.daemon.messages import Message, Reply
from edgeline.daemon.paho_lean import in_flight, lean_client_or_stock, raw_topic
from edgeline.daemon.reconnect import SHORT_LIVED_S, Backoff, Lost
from edgeline.daemon.sources import SourceBase
from edgeline.daemon.topics import TopicFilter
from edgeline.daemon.transport import AnswerFormat, PublishDone, Transport
from edgeline.errors import EdgelineError
from edgeline.lograte import Repeated

__all__ = ["AnswerFormat", "BrokerRefused", "MqttConnection", "MqttSink", "MqttSource", "PublishDone"]

log = logging.getLogger("edgeline.mqtt")

PASSWORD_ENV = "EDGELINE_MQTT_PASSWORD"
SESSION_TAKEN_OVER = 142
"""MQTT 5 DISCONNECT reason: another client connected with the same client id."""
LOOP_TICK_S = 0.2

DEVICE_CACHE = 10_000

OnMessage = Callable[[str, bytes, "Callable[[], None] | None", "Reply | None"], None]


@functools.cache
def _expiring_properties() -> type:
    """paho's PUBLISH ``Properties`` whose Message Expiry Interval is what is left of an answer's time to live
    when the packet is built. paho builds it again when it resends the message after a reconnection, so a resent
    answer carries the time it has left, not its first interval (which made answers arrive up to twice their time
    to live late). It packs itself once per second of difference; answers made in the same second share one."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    class ExpiringProperties(Properties):
        def __init__(self, expires_at: float, form: AnswerFormat | None = None, correlation: bytes | None = None):
            super().__init__(PacketTypes.PUBLISH)
            if form is not None:
                self.ContentType = form.content_type
                self.PayloadFormatIndicator = int(form.utf8)
            if correlation is not None:
                self.CorrelationData = correlation
            object.__setattr__(self, "expires_at", expires_at)  # Properties' own __setattr__ takes property names
            object.__setattr__(self, "_packed", (0, b""))

        def pack(self) -> bytes:
            left = max(1, math.ceil(self.__dict__["expires_at"] - time.time()))
            seconds, packed = self.__dict__["_packed"]
            if seconds != left:
                self.MessageExpiryInterval = left
                packed = super().pack()
                object.__setattr__(self, "_packed", (left, packed))
            return bytes(packed)

    return ExpiringProperties


def _reply(message: Any) -> Reply | None:
    """An MQTT 5 input's Response Topic and Correlation Data, when it has a valid response topic."""
    properties = getattr(message, "properties", None)
    topic = getattr(properties, "ResponseTopic", None)
    if not isinstance(topic, str) or not topic or "+" in topic or "#" in topic or "\0" in topic:
        return None
    correlation = getattr(properties, "CorrelationData", None)
    return Reply(topic, bytes(correlation) if correlation is not None else None)


class BrokerRefused(EdgelineError):
    """The broker could not be reached or refused us at start: exit 2 with the cause."""


def _password(config: BrokerConfig) -> str | None:
    if config.password_file is not None:
        try:
            return config.password_file.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise EdgelineError(f"broker.password_file {config.password_file}: {exc.strerror or exc}") from exc
    return os.environ.get(PASSWORD_ENV)


def _tls_context(config: BrokerConfig) -> ssl.SSLContext:
    def readable(path: Path | None, key: str) -> str | None:
        if path is not None and not path.is_file():
            raise EdgelineError(f"broker.{key} {path}: no such file")
        return None if path is None else str(path)

    cafile = readable(config.tls_ca_file, "tls_ca_file")
    try:
        context = ssl.create_default_context(cafile=cafile)
        if config.tls_cert_file is not None:
            context.load_cert_chain(
                str(readable(config.tls_cert_file, "tls_cert_file")), readable(config.tls_key_file, "tls_key_file")
            )
    except (ssl.SSLError, OSError) as exc:
        raise EdgelineError(f"broker TLS files: {exc}") from exc
    if config.tls_insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def describe_socket_error(exc: BaseException) -> str:
    """One line for what went wrong while connecting: refused, unknown host, TLS verification, time-out."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the broker's certificate was not accepted: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the broker running and listening there?)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no answer (time-out)"
    return f"{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)


class _LastError(logging.Handler):
    """Keeps paho's last error line on the connection: the cause a failed first connection reports."""

    def __init__(self, connection: MqttConnection):
        super().__init__(logging.ERROR)
        self.connection = connection

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "not connected" not in text.lower():
            self.connection._last_error = text


class MqttConnection:
    """One client to one broker, kept connected by our own network thread.

    ``generation`` counts successful connections: an input's PUBACK is only sent on the connection it came in
    on. After a reconnect the broker redelivers what was not acknowledged (same session), so an old
    acknowledgement could only hit a different message that reuses the packet id.
    """

    def __init__(
        self,
        config: BrokerConfig,
        *,
        client_id: str,
        will: tuple[str, bytes] | None = None,
        waiting: Callable[[], int] = lambda: 0,
    ):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.config = config
        self.client_id = client_id
        self.address = str(BrokerAddress(config.host, config.port))
        self.v5 = config.protocol == "5"
        self._waiting = waiting
        self._mqtt = mqtt
        self._Properties = Properties
        self._Expiring = _expiring_properties()
        self._PacketTypes = PacketTypes
        Client = lean_client_or_stock()  # paho's own when its internals are not what the lean one expects
        if self.v5:
            client = Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        else:
            client = Client(
                CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False, protocol=mqtt.MQTTv311
            )
        client.manual_ack_set(True)
        # The in-flight window is ours (``window``): paho's own walks every message it holds on each PUBACK, and
        # it ignores the broker's Receive Maximum. paho's queue stays capped all the same.
        client.max_inflight_messages_set(0)
        client.max_queued_messages_set(config.max_queued)
        if config.username is not None:
            client.username_pw_set(config.username, _password(config))
        if config.tls:
            client.tls_set_context(_tls_context(config))
            if config.tls_insecure_skip_verify:
                client.tls_insecure_set(True)
        if will is not None:
            client.will_set(will[0], will[1], qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_input_fast = self._input
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        # paho's errors only, through a logger of our own: with on_log set, paho formats a line for every packet
        paho_log = logging.Logger("edgeline.paho", logging.ERROR)  # not registered: one per connection
        paho_log.propagate = False
        paho_log.addHandler(_LastError(self))
        client.enable_logger(paho_log)
        # Only our network thread touches the client (see the module's docstring). With this callback set and no
        # loop_start(), paho's publish() and ack() only queue the packet, and our loop writes it.
        client.on_socket_register_write = lambda *_: None
        self._client = client
        self.connected = threading.Event()
        self.generation = 0
        self.reconnects = 0
        self.disconnects = 0
        self.publish_refused = 0
        self._subscriptions: list[tuple[str, int]] = []
        self._on_input: OnMessage | None = None
        self._pending: dict[int, PublishDone | None] = {}
        """QoS 1 publishes waiting for their PUBACK, by packet id (network thread only)."""
        self._progress_at = time.monotonic()
        """When a PUBACK last came, or the first publish went out after none was waiting."""
        self.stall_after_s = max(3.0 * config.keepalive_s, 5.0)
        """Publishes waiting this long with no PUBACK on a live link: reconnect (paho sends them again)."""
        self.stalls = 0
        self._closing = threading.Event()
        self._outcome = threading.Event()  # the first connection attempt has succeeded or failed
        self._failure: str | None = None
        self._subscribed = threading.Event()  # the broker has answered the first connection's subscriptions
        self._filters: dict[int, str] = {}  # SUBSCRIBE mid -> its filter, until its SUBACK (network thread)
        self._awaited: set[int] = set()  # the SUBACKs the first connection waits for
        self._refused: list[str] = []  # the first connection's filters the broker refused, and why
        self._last_error: str | None = None
        self._lost_at: float | None = None
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._posted: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_pending = False
        self._tick: Callable[[], None] | None = None
        self.window = config.max_inflight
        """Answers in flight at most: ``[broker] max_inflight``, or less when the broker's Receive Maximum (MQTT 5
        CONNACK) says so."""
        self._expiry: tuple[Any, Any] = (None, None)  # the last expiry second's Properties, shared by its answers
        self._expires: dict[int, float] = {}
        """Wall-clock time past which a QoS 1 publish in flight must not be sent again, by packet id."""
        self.backoff = Backoff(config.reconnect_max_s)
        self._redelivering = False
        """Network thread: we end this connection ourselves (``redeliver``): no loss, no back-off."""
        self.bad_topic_log = Repeated(log, "messages on a topic that is not UTF-8", level=logging.ERROR)

    # -- configuration, before start -----------------------------------------------------------------------
    def subscribe(self, filters: Sequence[TopicFilter], qos: int, on_input: OnMessage) -> None:
        """Subscribe on every connect; ``on_input(topic, payload, ack)`` runs on the network thread."""
        self._subscriptions = [(f.pattern, qos) for f in filters]
        self._on_input = on_input

    def add_subscription(self, pattern: str, qos: int) -> None:
        """One more filter, from any thread, after ``start`` too (``edgeline bridge`` subscribes to the answers of
        each board it meets): subscribed now when connected, and on every connect after; ``subscribe``'s handler
        gets its messages."""

        def add() -> None:
            if (pattern, qos) in self._subscriptions:
                return
            self._subscriptions.append((pattern, qos))
            if self.connected.is_set():
                self._subscribe(self._client, pattern, qos)

        if self._thread is None:
            add()
        else:
            self.call_soon(add)

    def _subscribe(self, client: Any, pattern: str, qos: int) -> int | None:
        """Network thread: SUBSCRIBE to one filter; its mid, by which its SUBACK names it."""
        _, mid = client.subscribe(pattern, qos=qos)
        if mid is not None:
            self._filters[mid] = pattern
        return mid

    def remove_subscription(self, pattern: str) -> None:
        """Undo ``add_subscription``, from any thread, in the order of the calls: unsubscribed now when connected,
        and not subscribed again on a later connect (``edgeline bridge`` lets go of a name no board has any more)."""

        def remove() -> None:
            kept = [(p, q) for p, q in self._subscriptions if p != pattern]
            if len(kept) == len(self._subscriptions):
                return
            self._subscriptions = kept
            if self.connected.is_set():
                self._client.unsubscribe(pattern)

        if self._thread is None:
            remove()
        else:
            self.call_soon(remove)

    def on_tick(self, tick: Callable[[], None]) -> None:
        """Run ``tick()`` on the network thread at every turn of its loop (at least every ``LOOP_TICK_S``), connected
        or not: the daemon refills the client from its outbox there. It must be cheap when it has nothing to do."""
        self._tick = tick

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self, run: Callable[[Callable[[], None]], threading.Thread]) -> None:
        """Connect, and return once the broker has accepted us and taken our subscriptions; ``run(target)`` starts
        the network thread (the supervisor's). Raises ``BrokerRefused`` naming the cause when the first attempt
        fails, or the broker refuses or leaves unanswered a subscription within ``connect_timeout_s``."""
        config = self.config
        if config.tls_insecure_skip_verify:
            log.warning("broker %s: TLS certificate verification is OFF (tls_insecure_skip_verify)", self.address)
        kwargs: dict[str, Any] = {"keepalive": config.keepalive_s}
        if self.v5:
            properties = self._Properties(self._PacketTypes.CONNECT)
            shared = any(pattern.startswith("$share/") for pattern, _ in self._subscriptions)
            properties.SessionExpiryInterval = config.session_expiry(shared)
            properties.ReceiveMaximum = min(config.max_inflight * 4, 65535)
            kwargs.update(clean_start=False, properties=properties)
        # TCP connect and TLS handshake; before connect_async: paho refuses a change once a connection is under way
        self._client.connect_timeout = min(config.connect_timeout_s, 5.0)
        self._client.connect_async(config.host, config.port, **kwargs)
        self._thread = run(self._network)
        deadline = time.monotonic() + config.connect_timeout_s
        if not self._outcome.wait(config.connect_timeout_s):
            self.close(0)
            raise BrokerRefused(
                f"broker {self.address}: no answer within {config.connect_timeout_s:g} s"
                + (f" ({self._last_error})" if self._last_error else "")
            )
        if self._failure is not None:
            self.close(0)
            raise BrokerRefused(f"broker {self.address}: {self._failure}")
        # Subscribed, not only connected: a message published after we say we are up reaches us (a session new to
        # the broker holds nothing for filters it has not taken yet; a session it kept holds them)
        if not self._subscribed.wait(max(0.0, deadline - time.monotonic())):
            self.close(0)
            raise BrokerRefused(
                f"broker {self.address}: no answer to our subscriptions within {config.connect_timeout_s:g} s"
            )
        if self._refused:
            self.close(0)
            raise BrokerRefused(f"broker {self.address}: refused the subscription {'; '.join(self._refused)}")

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly (MQTT 5: the session stays for its expiry interval) and stop the network thread."""
        was_connected = self.connected.is_set()

        def leave() -> None:
            self._closing.set()
            if was_connected:
                try:
                    self._client.disconnect()
                except Exception as exc:  # pragma: no cover - a socket error while leaving
                    log.debug("disconnect: %s", exc)

        if self._thread is None or not self._thread.is_alive() or self._thread is threading.current_thread():
            leave()
        else:
            self.call_soon(leave)
            self._thread.join(timeout + LOOP_TICK_S * 2)
            self._closing.set()  # the thread may have died before it ran ``leave``
        if self._thread is None or not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def _network(self) -> None:
        """Our loop instead of paho's: its back-off has no jitter and its log says nothing per attempt."""
        self._thread_id = threading.get_ident()
        backoff = self.backoff
        while not self._closing.is_set():
            try:
                self._client.reconnect()
            except (OSError, ValueError) as exc:
                self._last_error = describe_socket_error(exc)
                if not self._outcome.is_set():
                    self._fail(self._last_error)
                    return
                delay = backoff.next_delay(accepted=False)
                log.debug(
                    "broker %s: %s; attempt %d, next in %.1f s", self.address, self._last_error, backoff.attempt, delay
                )
                self._wait(delay)
                continue
            generation = self.generation
            self._serve()
            if self._closing.is_set():
                return
            if not self._outcome.is_set():  # lost before the CONNACK: TLS alerts, a refused client certificate
                self._fail(self._lost_before_connack())
                return
            self.connected.clear()
            if self._redelivering:
                self._redelivering = False
                continue  # our own ending: at once, no back-off
            delay = backoff.next_delay(accepted=self.generation != generation)
            log.debug("broker %s: reconnecting in %.1f s (attempt %d)", self.address, delay, backoff.attempt)
            self._wait(delay)

    def _serve(self) -> None:
        """One connection's life: what other threads posted, then paho's reads, writes and keepalive, until the
        connection ends. After ``close`` it only lets the DISCONNECT leave (a short grace)."""
        client, success = self._client, self._mqtt.MQTT_ERR_SUCCESS
        wake = self._wake_r
        grace: float | None = None
        while True:
            sock = client.socket()
            if sock is None:
                return
            if self._closing.is_set():
                if grace is None:
                    grace = time.monotonic() + 0.25
                elif time.monotonic() > grace:
                    return
            self._run_posted()
            if self._stalled():
                return
            buffered = client.buffered + (sock.pending() if isinstance(sock, ssl.SSLSocket) else 0)
            try:
                readable, _, _ = select.select(
                    [sock, wake], [sock] if client.want_write() else [], [], 0.0 if buffered else LOOP_TICK_S
                )
            except (OSError, ValueError):  # the socket went away under us
                return
            if wake in readable:
                self._drain_wake()
            if (sock in readable or buffered) and (client.loop_read() != success or client.socket() is None):
                return
            if client.want_write() and client.loop_write() != success:
                return
            if client.loop_misc() != success:
                return

    def _stalled(self) -> bool:
        """Answers in flight and no PUBACK for ``stall_after_s`` while the link answers its pings: a broker (or a
        proxy) that takes publishes and never acknowledges them. Say so and drop the link: the reconnection sends
        them again (DUP), and the window cannot stay shut unseen."""
        if not self._pending or not self.connected.is_set():
            return False
        waited = time.monotonic() - self._progress_at
        if waited < self.stall_after_s:
            return False
        self.stalls += 1
        self._progress_at = time.monotonic()
        log.error(
            "broker %s: no PUBACK for %.0f s with %d publishes in flight; reconnecting to send them again",
            self.address, waited, len(self._pending),
        )  # fmt: skip
        self._last_error = "no PUBACK"
        self._client.disconnect()  # the session stays; the reconnection resends what is in flight
        for _ in range(3):  # let the DISCONNECT leave
            if self._client.socket() is None or self._client.loop_write() != self._mqtt.MQTT_ERR_SUCCESS:
                break
        return True

    def _wait(self, delay: float) -> None:
        """Between connection attempts: still run what other threads post (they may be waiting on it)."""
        end = time.monotonic() + delay
        while not self._closing.is_set() and (left := end - time.monotonic()) > 0:
            select.select([self._wake_r], [], [], min(left, LOOP_TICK_S))
            self._drain_wake()
            self._run_posted()

    def _drain_wake(self) -> None:
        """Empty the wake-up socket, then allow the next post to write to it. In that order: cleared first, a post
        between the two would write a byte that the reads then swallow, leaving the flag set with nothing to wake
        the next select (every later post waited a whole ``LOOP_TICK_S``). A post before the flag is cleared sends
        nothing and needs nothing: the loop runs the posted tasks before it selects again."""
        with contextlib.suppress(OSError):  # BlockingIOError: nothing more to read
            while self._wake_r.recv(4096):
                pass
        self._wake_pending = False

    def _run_posted(self) -> None:
        posted = self._posted
        while posted:
            try:
                posted.popleft()()
            except Exception:
                log.exception("a task on the network thread failed")
        if self._tick is not None:
            try:
                self._tick()
            except Exception:
                log.exception("the network thread's tick failed")

    def redeliver(self) -> None:
        """Network thread: end this connection and make a new one at once (the session stays), so that the broker
        sends again what it sent us and we left unacknowledged."""
        if self.connected.is_set() and not self._closing.is_set():
            self._redelivering = True
            self._client.disconnect()

    def call_soon(self, task: Callable[[], None]) -> None:
        """Run ``task()`` on the network thread, soon, in the order posted (any thread; one wake-up however many
        tasks are waiting). Tasks that publish or acknowledge do it there, without another hand-off."""
        self._posted.append(task)
        if not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed (we are done)
                self._wake_w.send(b"\0")

    @property
    def on_network_thread(self) -> bool:
        return threading.get_ident() == self._thread_id

    def _lost_before_connack(self) -> str:
        """The cause of a connection the broker ended before its CONNACK. Over TLS that is how mosquitto refuses a
        client certificate (missing, or signed by a CA it does not trust): it closes the session, and its alert
        often never arrives (a bare EOF), so name the likely cause rather than only the socket error."""
        text = f"the broker closed the connection before accepting it ({self._last_error or 'no reason given'})"
        if not self.config.tls:
            return text
        if self.config.tls_cert_file is None:
            return f"TLS: {text}; does it require a client certificate? (set tls_cert_file and tls_key_file)"
        return f"TLS: {text}; did it refuse our client certificate? (is tls_cert_file signed by a CA it trusts?)"

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._outcome.set()

    # -- paho callbacks: network thread; never let an exception out ----------------------------------------
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        try:
            if reason.is_failure:
                text = f"the broker refused the connection: {reason}"
                if not self._outcome.is_set():
                    self._fail(text)
                else:
                    log.error("broker %s: %s", self.address, text)
                return
            self.generation += 1
            self.backoff.connected(time.monotonic())
            self._progress_at = time.monotonic()  # what is resent now has the whole stall delay for its PUBACK
            self._drop_expired_resends(client)
            receive_maximum = getattr(properties, "ReceiveMaximum", None)
            self.window = min(self.config.max_inflight, receive_maximum or self.config.max_inflight)
            # The first connection's (or its retry's) subscriptions, when the session is new to the broker: one it
            # kept has them already, and sends what it held for us at once, which waits on the network thread for
            # the daemon's source (so the SUBACK after it would never be read before start returned)
            if getattr(flags, "session_present", False) and not self._subscribed.is_set():
                self._subscribed.set()
            awaiting = not self._subscribed.is_set()
            self._awaited.clear()
            self._filters.clear()  # a SUBACK of a connection that ended never comes
            for pattern, qos in self._subscriptions:
                mid = self._subscribe(client, pattern, qos)
                if awaiting and mid is not None:
                    self._awaited.add(mid)
            if awaiting and not self._awaited:
                self._subscribed.set()
            self.connected.set()
            if not self._outcome.is_set():
                self._outcome.set()
                return
            self.reconnects += 1
            down = time.monotonic() - self._lost_at if self._lost_at is not None else 0.0
            log.info("reconnected to %s after %.1f s, %d answers waiting", self.address, down, self._waiting())
        except Exception:
            log.exception("on_connect failed")

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        try:
            was_connected = self.connected.is_set()
            self.connected.clear()
            if self._closing.is_set() or not was_connected:
                return
            if self._redelivering:
                return
            self.disconnects += 1
            self._lost_at = time.monotonic()
            taken_over = self.v5 and getattr(reason, "value", None) == SESSION_TAKEN_OVER
            lost = self.backoff.lost(self._lost_at, taken_over=taken_over)
            if lost is Lost.TAKEOVER:
                log.error(
                    "broker %s: session taken over: %s with our client id %r (a cloned device? two daemons "
                    "with the same instance? set [daemon] instance or [broker] client_id); backing off up to "
                    "%g s between attempts; said once, counted as session_takeovers",
                    self.address,
                    "another client connected" if taken_over
                    else f"the broker ended our last {self.backoff.short_lived} connections within {SHORT_LIVED_S:g} s",
                    self.client_id, self.backoff.cap_s,
                )  # fmt: skip
            elif lost is Lost.LINK:
                log.warning("lost the broker %s (%s); reconnecting", self.address, self._last_error or reason)
        except Exception:
            log.exception("on_disconnect failed")

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        try:
            pattern = self._filters.pop(mid, None)  # one filter per SUBSCRIBE: one reason per SUBACK
            awaited = mid in self._awaited
            self._awaited.discard(mid)
            for reason in reasons:
                if getattr(reason, "is_failure", False):
                    named = repr(pattern) if pattern is not None else f"of message {mid}"
                    log.error("broker %s refused the subscription %s: %s", self.address, named, reason)
                    if awaited:
                        self._refused.append(f"{named}: {reason}")
            if awaited and not self._awaited:
                self._subscribed.set()
        except Exception:
            log.exception("on_subscribe failed")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        try:
            topic = message.topic
        except UnicodeDecodeError:
            raw = raw_topic(message)
            example = "" if raw is None else f", e.g. {raw[:200]!r}"
            self.bad_topic_log.happened(1, f"acknowledged and ignored{example}")
            if message.qos > 0:
                client.ack(message.mid, message.qos)  # on the network thread: a poison message is not kept for ever
            return
        self._input(topic, bytes(message.payload), message.mid, message.qos, _reply(message))

    def _input(self, topic: str, payload: bytes, mid: int, qos: int, reply: Reply | None = None) -> None:
        """One input, from either path of the client (the lean one, for packets without properties, or paho's
        ``on_message``)."""
        handler = self._on_input
        if handler is None:
            return
        try:
            ack = None
            if qos > 0:
                generation = self.generation
                ack = lambda: self._ack(generation, mid, qos)  # noqa: E731
            handler(topic, payload, ack, reply)
        except Exception:
            log.exception("handling a message from %s failed", topic)

    def _ack(self, generation: int, mid: int, qos: int) -> None:
        if not self.on_network_thread:
            self.call_soon(lambda: self._ack(generation, mid, qos))
        elif generation == self.generation and self.connected.is_set():
            self._client.ack(mid, qos)

    def _drop_expired_resends(self, client: Any) -> None:
        """Before paho sends again what was in flight when the link dropped (right after this CONNACK): forget the
        answers whose time to live is over, so that none is delivered late (``done(False, "expired")``).
        Reads paho's ``_out_messages`` through ``paho_lean.in_flight``: nothing where paho is not the checked one."""
        if not self._expires:
            return
        held = in_flight(client)
        if held is None:
            return
        out, mutex = held
        now = time.time()
        with mutex:
            expired = [mid for mid in out if self._expires.get(mid, now + 1) <= now]
            for mid in expired:
                del out[mid]
        for mid in expired:
            self._expires.pop(mid, None)
            self._finish(self._pending.pop(mid, None), False, "expired")

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        if mid not in self._pending:
            return  # a QoS 0 message written (its ``done`` fired when it was handed over)
        self._expires.pop(mid, None)
        self._progress_at = time.monotonic()
        ok = not getattr(reason, "is_failure", False)
        self._finish(self._pending.pop(mid), ok, None if ok else str(reason))

    def _finish(self, done: PublishDone | None, ok: bool, text: str | None) -> None:
        if not ok and text != "expired":
            self.publish_refused += 1
        if done is not None:
            try:
                done(ok, text)
            except Exception:
                log.exception("a publish callback failed")

    # -- any thread ------------------------------------------------------------------------------------------
    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int,
        retain: bool = False,
        expiry_at: float | None = None,
        form: AnswerFormat | None = None,
        correlation: bytes | None = None,
        done: PublishDone | None = None,
    ) -> bool:
        """Hand one message to the client; False when it could not take it (its queue is full: try later).
        ``form`` and ``correlation`` (MQTT 5) say what the payload is and carry a request's Correlation Data back.
        ``expiry_at`` (wall clock): past it, the message is not sent again after a reconnection, and MQTT 5's
        Message Expiry Interval says what is left of it each time it is sent.
        ``done`` fires when the broker acknowledges (QoS 1), or at once (QoS 0: nothing to wait for; a QoS 0
        packet still in the client when the connection drops is gone, and paho says nothing about it).

        From another thread than the network thread, the publish is posted there (``call_soon``) and this returns
        True: fine for status and availability messages; a stream of answers is posted in batches instead."""
        if not self.on_network_thread:

            def later() -> None:
                taken = self.publish(
                    topic, payload, qos=qos, retain=retain, expiry_at=expiry_at, form=form, correlation=correlation,
                    done=done,
                )  # fmt: skip
                if not taken:
                    self._finish(done, False, "the MQTT client's queue is full")

            self.call_soon(later)
            return True
        properties = None
        if self.v5 and correlation is not None:  # its own: the correlation data is the request's
            properties = self._Expiring(float(int(expiry_at)) if expiry_at is not None else 2e9, form, correlation)
        elif self.v5 and expiry_at is not None:
            key = (int(expiry_at), form)
            if self._expiry[0] != key:  # answers made in the same second share one (it packs itself once)
                self._expiry = (key, self._Expiring(float(key[0]), form))
            properties = self._expiry[1]
        try:
            if qos == 1 and not retain:
                info = self._client.publish_at_least_once(topic, payload, properties)
            else:
                info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        except ValueError as exc:  # an invalid topic: checked before, so a bug of ours if it happens
            self._finish(done, False, f"invalid topic: {exc}")
            return True
        if info.rc == self._mqtt.MQTT_ERR_QUEUE_SIZE:
            return False
        if qos == 0:
            self._finish(done, True, None)
        else:
            if not self._pending:
                self._progress_at = time.monotonic()  # nothing was waiting: the stall clock starts now
            self._pending[info.mid] = done  # on this thread: its PUBACK cannot have come yet
            if expiry_at is not None:
                self._expires[info.mid] = expiry_at
        return True

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    @property
    def in_flight(self) -> int:
        """QoS 1 publishes handed to the client and not yet acknowledged."""
        return len(self._pending)

    @property
    def room(self) -> int:
        """How many more publishes the window takes now."""
        return self.window - self.in_flight


class MqttSource(SourceBase):
    """Subscriptions as a source: every message becomes a ``Message`` whose ``ack`` is its PUBACK.

    The handler is installed before the connection starts: with a persistent session the broker sends what it
    kept for us right after its CONNACK, before any SUBSCRIBE. Until ``run`` hands over ``submit`` (the source
    thread starts right after the connection), the network thread waits for it.
    """

    subscribed = True

    @classmethod
    def from_config(cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int) -> None:
        """Made by the daemon from its broker connection (``edgeline.daemon.assembly``), not from ``[source]``."""
        return None

    def __init__(self, connection: MqttConnection, filters: Sequence[TopicFilter], qos: int):
        self.connection = connection
        self.filters = list(filters)
        self.description = f"MQTT {connection.address} as {connection.client_id}, subscribed to " + ", ".join(
            f.pattern for f in self.filters
        )
        self._submit: Callable[[Message], None] | None = None
        self._devices: dict[str, str] = {}  # topic -> device: a sensor publishes on the same topic every time
        self._stopping = threading.Event()
        self._bound = threading.Event()
        connection.subscribe(self.filters, qos, self._on_input)

    def open(self) -> None:
        """Nothing to open: the daemon starts the connection (it is the sink as well)."""

    def run(self, submit: Callable[[Message], None], stopping: threading.Event) -> None:
        """Messages arrive on the network thread; this thread only waits for the stop."""
        self._submit, self._stopping = submit, stopping
        self._bound.set()
        stopping.wait()

    def _on_input(self, topic: str, payload: bytes, ack: Callable[[], None] | None, reply: Reply | None = None) -> None:
        if not self._bound.is_set():  # a plain read on every later message: wait() takes a lock
            while not self._bound.wait(0.5):
                if self.connection.closing:
                    return
        if self._stopping.is_set() or self._submit is None:
            return  # not acknowledged: the broker redelivers it to the next run
        device = self._devices.get(topic)
        if device is None:
            device = next((d for f in self.filters if (d := f.device(topic)) is not None), topic)
            if len(self._devices) >= DEVICE_CACHE:  # a flood of topics must not grow memory without bound
                self._devices.clear()
            self._devices[topic] = device
        self._submit(Message(topic=topic, payload=payload, device=device, ack=ack, reply=reply))


class MqttSink:
    """Answers to the broker, over a ``Transport`` (the ``MqttConnection``, or a test's in-memory one). With an
    outbox, ``done`` removes the answer from it on PUBACK."""

    def __init__(self, connection: Transport, qos: int, form: AnswerFormat | None = None):
        self.connection = connection
        self.qos = qos
        self.form = form

    @property
    def ready(self) -> bool:
        return self.connection.connected.is_set()

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        expiry_at: float | None = None,
        correlation: bytes | None = None,
        done: PublishDone | None = None,
    ) -> bool:
        return self.connection.publish(
            topic, payload, qos=self.qos, expiry_at=expiry_at, form=self.form, correlation=correlation, done=done
        )
