"""Tools to break things on purpose around the daemon: certificates, a network black hole, clients that survive.

    make_pki          a CA, a server certificate for localhost/127.0.0.1, a client certificate, an unrelated CA
    BlackHoleProxy    a loopback TCP proxy whose ``pause()`` silently drops everything, as a network partition does
    DurablePublisher  a QoS 1 publisher with a persistent session that reconnects by itself and records its PUBACKs
    DurableCollector  a QoS 1 subscriber with a persistent session that reconnects by itself and keeps everything
    kill_and_restart  SIGKILL a broker, leave it down for a while, start it again on the same ports
    tmpfs, ext4       a small file system of a test's own (root only), unmounted when done; ``fill`` takes its room

Everything here talks to 127.0.0.1 only, and every loop is bounded in count and in time; ``close()`` (or the
context manager) ends every thread it started. The broker side (``Broker(persistence=..., tls=...)``) is in
``tests.mqtt_broker``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from tests.mqtt_broker import HOST, TlsFiles

if TYPE_CHECKING:
    from tests.mqtt_broker import Broker

__all__ = [
    "BlackHoleProxy",
    "DurableCollector",
    "DurablePublisher",
    "Endpoint",
    "Pki",
    "kill_and_restart",
    "make_pki",
]

CERT_VALIDITY = datetime.timedelta(days=1)
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""Certificates start a little in the past, so a clock a few seconds behind ours does not reject them."""
OPENSSL_TIMEOUT_S = 20.0
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 1.0
"""A broker back after a restart is found within about a second."""
SESSION_EXPIRY_S = 3600
"""MQTT 5 session expiry: far longer than any test, so the broker keeps the session while we are away."""
KEEPALIVE_S = 5
WAIT_S = 20.0
MAX_MIDS = 65_535
"""paho numbers messages 1..65535 and then starts again: a ledger keyed by message id holds that many at most."""


# --- certificates --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files ``make_pki`` wrote (keys unencrypted) and the client certificate's common name."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_name: str
    other_ca_cert: Path
    """A CA that signed nothing of ours: trusting only it must fail the TLS handshake with our broker."""
    other_ca_key: Path

    @property
    def broker_tls(self) -> TlsFiles:
        """What ``Broker(tls=...)`` needs: our CA (it checks client certificates), the server certificate and key."""
        return TlsFiles(cafile=self.ca_cert, certfile=self.server_cert, keyfile=self.server_key)


def make_pki(
    directory: Path,
    *,
    client_name: str = "edgeline-device",
) -> Pki:
    """Write a fresh PKI into ``directory``: EC P-256 keys, certificates valid for a day.

    The server certificate names ``localhost`` and ``127.0.0.1`` in its subjectAltName (what TLS clients check,
    not the CN), with serverAuth; the client certificate has CN ``client_name`` and clientAuth. Both are signed
    by ``ca``; ``other_ca`` is unrelated. Made with the ``openssl`` command (Debian's ``openssl`` package).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        directory=directory,
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
        client_name=client_name,
        other_ca_cert=directory / "other-ca.crt",
        other_ca_key=directory / "other-ca.key",
    )
    _write_pki_with_openssl(pki)
    return pki


_OPENSSL_EXTENSIONS = {
    "ca": "basicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n",
    "server": "basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\n"
    "extendedKeyUsage = serverAuth\nsubjectAltName = DNS:localhost, IP:127.0.0.1\n",
    "client": "basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\n"
    "extendedKeyUsage = clientAuth\n",
}
"""The x509v3 extensions of each kind of certificate: what TLS clients and Mosquitto check."""


def _write_pki_with_openssl(pki: Pki) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("make_pki needs the openssl command (apt install openssl)")
    days = str(CERT_VALIDITY.days)

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=OPENSSL_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")

    def config(kind: str, common_name: str) -> Path:
        path = pki.directory / f"{kind}-{uuid.uuid4().hex[:8]}.cnf"
        path.write_text(
            "[req]\ndistinguished_name = dn\nprompt = no\n"
            f"[dn]\nCN = {common_name}\n"
            "[ext]\nsubjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n" + _OPENSSL_EXTENSIONS[kind],
            encoding="utf-8",
        )
        return path

    def key(path: Path) -> None:
        run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))

    def ca(cert: Path, private: Path, common_name: str) -> None:
        key(private)
        settings = config("ca", common_name)
        run(
            "req",
            "-x509",
            "-new",
            "-key",
            str(private),
            "-out",
            str(cert),
            "-days",
            days,
            "-sha256",
            "-config",
            str(settings),
            "-extensions",
            "ext",
        )
        settings.unlink()

    def signed(kind: str, cert: Path, private: Path, common_name: str) -> None:
        key(private)
        settings = config(kind, common_name)
        request = cert.with_suffix(".csr")
        run("req", "-new", "-key", str(private), "-out", str(request), "-config", str(settings))
        run(
            "x509",
            "-req",
            "-in",
            str(request),
            "-CA",
            str(pki.ca_cert),
            "-CAkey",
            str(pki.ca_key),
            "-set_serial",
            f"0x{secrets.token_hex(16)}",
            "-days",
            days,
            "-sha256",
            "-out",
            str(cert),
            "-extfile",
            str(settings),
            "-extensions",
            "ext",
        )
        settings.unlink()
        request.unlink()

    ca(pki.ca_cert, pki.ca_key, "edgeline test CA")
    ca(pki.other_ca_cert, pki.other_ca_key, "edgeline unrelated CA")
    signed("server", pki.server_cert, pki.server_key, "localhost")
    signed("client", pki.client_cert, pki.client_key, pki.client_name)


# --- a network black hole ------------------------------------------------------------------------------------


class Endpoint(Protocol):
    """Where an MQTT client connects: a ``Broker`` or a ``BlackHoleProxy`` in front of one."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class _Link:
    """One proxied connection: the client's socket and ours to the target (None while it was accepted paused)."""

    def __init__(self, downstream: socket.socket, upstream: socket.socket | None) -> None:
        self.downstream = downstream
        self.upstream = upstream
        self.dead = upstream is None
        """A link that lost bytes or a side while paused: it can never carry a valid stream again."""
        self.threads: list[threading.Thread] = []

    def close(self) -> None:
        for sock in (self.downstream, self.upstream):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or sendall on it
            sock.close()


class BlackHoleProxy:
    """A TCP proxy on 127.0.0.1 (a free port) to ``target_host:target_port``; ``pause()`` turns it into a black hole.

    Running, it forwards bytes both ways, two threads per connection (blocking sockets; ``close()`` shuts the
    sockets down, which wakes them). Paused, it keeps *reading* from every socket and throws the bytes away, in
    both directions, and closes nothing: neither side gets an error, an EOF or a window that fills up, exactly as
    when packets vanish in a partition. Reading (rather than leaving bytes unread in the kernel) is the choice
    because (1) the client's PINGREQ is taken and its PINGRESP never comes, so paho's keepalive fires as it would
    on a dead network (it sends PINGREQ after ``keepalive`` seconds of silence and gives up one ``keepalive``
    later); (2) nothing said during the pause is delivered late after ``resume()``, so the broker never acts on a
    stale PUBLISH from a connection the client has already abandoned; (3) a busy client never blocks on a full
    socket buffer, and the proxy holds no data. The broker's own keepalive (1.5 × the client's) ends its side the
    same way.

    A connection accepted while paused is held open and silent (its CONNECT is discarded), and so is a link that
    lost a side or any bytes while paused: such a link can never carry a valid MQTT stream again, so
    ``resume()`` closes it, as a healed network's RST would, and the client reconnects. Links that came through
    the pause untouched are forwarded again. At most ``max_connections`` are open at once; more are closed at
    once.
    """

    def __init__(self, target_host: str, target_port: int, *, max_connections: int = 64) -> None:
        self.target = (target_host, target_port)
        self.host = HOST
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._accepted = 0
        self._paused = False
        self._closed = threading.Event()
        self._listener = socket.create_server((self.host, 0), backlog=16)
        self._listener.settimeout(0.1)  # the accept loop checks for close() ten times a second
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"black-hole-{self.port}", daemon=True)
        self._acceptor.start()

    @classmethod
    def to(cls, broker: Broker) -> BlackHoleProxy:
        """A proxy in front of this broker's plain listener."""
        return cls(broker.host, broker.port)

    @property
    def address(self) -> str:
        """``HOST:PORT``, as ``--broker`` takes it."""
        return f"{self.host}:{self.port}"

    @property
    def accepted(self) -> int:
        """Connections accepted so far, paused or not."""
        with self._lock:
            return self._accepted

    @property
    def open_links(self) -> int:
        with self._lock:
            return len(self._links)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def threads(self) -> list[threading.Thread]:
        """Its accept loop and the pumps of its open links (``close()`` ends them all)."""
        with self._lock:
            return [self._acceptor, *(thread for link in self._links for thread in link.threads)]

    def pause(self) -> None:
        """From now on, drop every byte both ways and forward no new connection; close nothing."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Forward again; close the links that lost bytes or a side while paused (see the class docstring)."""
        with self._lock:
            self._paused = False
            dead = [link for link in self._links if link.dead]
            self._links = [link for link in self._links if not link.dead]
        for link in dead:
            link.close()

    def close(self) -> None:
        """Stop accepting, close every connection and wait (bounded) for every thread."""
        self._closed.set()
        self._acceptor.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        for link in links:
            for thread in link.threads:
                thread.join(timeout=2.0)

    def __enter__(self) -> BlackHoleProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                downstream, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._admit(downstream)

    def _admit(self, downstream: socket.socket) -> None:
        downstream.settimeout(None)
        with self._lock:
            self._accepted += 1
            paused, full = self._paused, len(self._links) >= self.max_connections
        if full:
            downstream.close()
            return
        upstream = None
        if not paused:
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                downstream.close()  # the target is down: refuse, as the target itself would
                return
            upstream.settimeout(None)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        downstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(downstream, upstream)
        pumps = [(downstream, upstream)] if upstream is None else [(downstream, upstream), (upstream, downstream)]
        for source, sink in pumps:
            thread = threading.Thread(target=self._pump, args=(link, source, sink), daemon=True)
            link.threads.append(thread)
        with self._lock:
            if self._closed.is_set():
                link.close()
                return
            self._links.append(link)
        for thread in link.threads:
            thread.start()

    def _pump(self, link: _Link, source: socket.socket, sink: socket.socket | None) -> None:
        """Copy ``source`` to ``sink`` until either ends; while paused, read and drop. Ends with its socket."""
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            with self._lock:
                paused = self._paused
                if paused and data:
                    link.dead = True  # bytes were dropped: this stream is broken for good
            if not data:
                break
            if paused or link.dead or sink is None:
                continue
            try:
                sink.sendall(data)
            except OSError:
                break
        with self._lock:
            if self._paused:
                # A side hung up during the partition: the other side must not hear of it until it heals.
                link.dead = True
                return
            if link in self._links:
                self._links.remove(link)
        link.close()


# --- clients that survive broker restarts --------------------------------------------------------------------


class _DurableClient:
    """A paho-mqtt 2.x client with a fixed client id and a persistent session, reconnecting by itself.

    MQTT 3.1.1: ``clean_session=False``, which the broker keeps until the client comes back. MQTT 5:
    ``clean_start=False`` with a ``SessionExpiryInterval`` of ``session_expiry_s``. ``loop_start()`` runs paho's
    network thread, which reconnects after every loss, waiting ``reconnect_delay_s[0]`` (0.1 s), then doubling up
    to ``reconnect_delay_s[1]`` (1 s); a test can make one client come back later than another with it.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        client_id: str | None,
        prefix: str,
        protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311,
        keepalive: int = KEEPALIVE_S,
        session_expiry_s: int = SESSION_EXPIRY_S,
        reconnect_delay_s: tuple[float, float] = (RECONNECT_MIN_S, RECONNECT_MAX_S),
    ) -> None:
        self.client_id = client_id or f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.protocol = protocol
        self._state = threading.Condition()
        self.connections = 0
        """Successful CONNACKs so far (1 after the first connection, +1 per reconnection)."""
        self.disconnections = 0
        self.sessions_resumed = 0
        """CONNACKs with session present: the broker still had our session after a disconnection."""
        self._connected = False
        if protocol == mqtt.MQTTv5:
            self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=protocol)
        else:
            self.client = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=protocol, clean_session=False
            )
        # paho annotates these as int, but only ever sleeps for them: fractions of a second work.
        self.client.reconnect_delay_set(*reconnect_delay_s)  # type: ignore[arg-type]
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        properties = None
        if protocol == mqtt.MQTTv5:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = session_expiry_s
        self.client.connect_async(
            endpoint.host, endpoint.port, keepalive=keepalive, clean_start=False, properties=properties
        )

    @property
    def connected(self) -> bool:
        with self._state:
            return self._connected

    def start(self) -> None:
        """Start paho's network thread: it connects, and reconnects after every loss."""
        self.client.loop_start()

    def wait_connected(self, timeout: float = WAIT_S, *, connections: int = 1) -> bool:
        """Whether the client is connected and has connected at least ``connections`` times, within ``timeout``."""
        with self._state:
            return self._state.wait_for(lambda: self._connected and self.connections >= connections, timeout=timeout)

    def close(self) -> None:
        """Disconnect cleanly (the broker keeps the session: it is persistent) and stop the network thread."""
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            return
        self._connected_hook(client, flags.session_present)
        with self._state:
            self._connected = True
            self.connections += 1
            self.sessions_resumed += int(flags.session_present)
            self._state.notify_all()

    def _on_disconnect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        with self._state:
            if self._connected:
                self.disconnections += 1
            self._connected = False
            self._state.notify_all()

    def _connected_hook(self, client: mqtt.Client, session_present: bool) -> None:
        """Called in paho's thread on every successful CONNACK, before waiters hear of it."""


class DurablePublisher(_DurableClient):
    """Publishes at QoS 1 through broker restarts and records which messages the broker acknowledged.

    Unacknowledged messages are not lost on our side: paho-mqtt 2.x (read in ``paho/mqtt/client.py``, 2.2) keeps
    every QoS 1 message in ``_out_messages`` until its PUBACK (``_do_on_publish`` removes it) or
    ``drop_out_messages()``; on reconnection ``_messages_reconnect_reset_out`` turns the ones awaiting a PUBACK
    back into "to publish" with DUP set, and ``_handle_connack`` sends them again after a successful CONNACK.
    It does so whether or not the broker reports ``session present``, even with a clean session, so a message
    the broker never acknowledged is always sent again; one it acknowledged and then lost (SIGKILL before its
    save) is not. Messages published while disconnected wait in the same place.

    A message counts as acknowledged when ``on_publish`` reports its message id with a success reason code; under
    MQTT 5 a PUBACK with a failure code (135 Not authorized, for an ACL denial) is recorded in ``refused``.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        client_id: str | None = None,
        protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311,
        keepalive: int = KEEPALIVE_S,
        session_expiry_s: int = SESSION_EXPIRY_S,
        reconnect_delay_s: tuple[float, float] = (RECONNECT_MIN_S, RECONNECT_MAX_S),
        qos: int = 1,
    ) -> None:
        super().__init__(
            endpoint,
            client_id=client_id,
            prefix="durable-pub",
            protocol=protocol,
            keepalive=keepalive,
            session_expiry_s=session_expiry_s,
            reconnect_delay_s=reconnect_delay_s,
        )
        self.qos = qos
        self._ledger: dict[int, tuple[str, bytes]] = {}
        """Message id → (topic, payload) of everything handed to paho, in order."""
        self._acks: dict[int, int] = {}
        """Message id → PUBACK reason code (always 0 under MQTT 3.1.1, whose PUBACK has none)."""
        self.client.on_publish = self._on_publish

    def __enter__(self) -> DurablePublisher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def publish_all(self, messages: Iterable[tuple[str, bytes]], rate: float | None = None) -> list[int]:
        """Hand every (topic, payload) to paho, ``rate`` per second (as fast as possible when None); their mids.

        Does not wait for acknowledgements (``wait_acknowledged``) nor for a connection: while the broker is
        down, paho keeps the messages and sends them after reconnecting.
        """
        mids = []
        started = time.monotonic()
        for index, (topic, payload) in enumerate(messages):
            if rate:
                delay = started + index / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            info = self.client.publish(topic, payload, qos=self.qos)
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise RuntimeError(f"paho refused to queue message {index} on {topic}: {mqtt.error_string(info.rc)}")
            with self._state:
                if len(self._ledger) >= MAX_MIDS or info.mid in self._ledger:
                    raise RuntimeError(f"more than {MAX_MIDS} messages: paho's message ids wrapped around")
                self._ledger[info.mid] = (topic, payload)
            mids.append(info.mid)
        return mids

    def wait_acknowledged(self, timeout: float = WAIT_S) -> bool:
        """Whether every message published so far has its PUBACK (success or not) within ``timeout`` seconds."""
        with self._state:
            return self._state.wait_for(lambda: self._ledger.keys() <= self._acks.keys(), timeout=timeout)

    @property
    def published(self) -> list[tuple[str, bytes]]:
        with self._state:
            return list(self._ledger.values())

    @property
    def acknowledged(self) -> list[tuple[str, bytes]]:
        """The messages the broker acknowledged with success, in publishing order.

        Success is a reason code below 0x80: under MQTT 5 mosquitto answers 16 "No matching subscribers" when nobody
        subscribes to the topic, which is still a success.
        """
        with self._state:
            return [message for mid, message in self._ledger.items() if 0 <= self._acks.get(mid, -1) < 0x80]

    @property
    def refused(self) -> dict[int, int]:
        """Message id → failure reason code (MQTT 5 only; e.g. 135 when the ACL denies the topic)."""
        with self._state:
            return {mid: code for mid, code in self._acks.items() if code >= 0x80}

    @property
    def pending(self) -> list[int]:
        """Message ids still waiting for their PUBACK."""
        with self._state:
            return [mid for mid in self._ledger if mid not in self._acks]

    def _on_publish(
        self, client: mqtt.Client, userdata: object, mid: int, reason_code: ReasonCode, properties: Properties
    ) -> None:
        # Runs in paho's thread with paho's message lock held; never call paho while holding ours.
        with self._state:
            self._acks[mid] = reason_code.value
            self._state.notify_all()


class DurableCollector(_DurableClient):
    """Subscribes at QoS 1 with a persistent session and keeps every (topic, payload), across broker restarts.

    Messages the broker queued for us while we were away (offline, or the broker down and back with its
    persistence file) arrive after the reconnection. It subscribes again on every connection: harmless when the
    session was kept, and it re-creates the subscription when the broker lost it. Give the same ``client_id`` to
    a new collector to take over the session of one that was closed.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        topic_filter: str,
        *,
        client_id: str | None = None,
        protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv311,
        keepalive: int = KEEPALIVE_S,
        session_expiry_s: int = SESSION_EXPIRY_S,
        reconnect_delay_s: tuple[float, float] = (RECONNECT_MIN_S, RECONNECT_MAX_S),
    ) -> None:
        super().__init__(
            endpoint,
            client_id=client_id,
            prefix="durable-sub",
            protocol=protocol,
            keepalive=keepalive,
            session_expiry_s=session_expiry_s,
            reconnect_delay_s=reconnect_delay_s,
        )
        self.topic_filter = topic_filter
        self.messages: list[tuple[str, bytes]] = []
        self.subscriptions = 0
        """SUBACKs received (one per connection)."""
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message

    def __enter__(self) -> DurableCollector:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start_and_subscribe(self, timeout: float = WAIT_S) -> DurableCollector:
        """Start, and return once the first SUBACK is in: from then on, nothing published to the filter is missed."""
        self.start()
        if not self.wait_subscribed(timeout):
            self.close()
            raise TimeoutError(f"{self.client_id} got no SUBACK for {self.topic_filter} within {timeout:g} s")
        return self

    def wait_subscribed(self, timeout: float = WAIT_S, *, subscriptions: int = 1) -> bool:
        with self._state:
            return self._state.wait_for(lambda: self.subscriptions >= subscriptions, timeout=timeout)

    def wait_for(
        self, until: int | Callable[[list[tuple[str, bytes]]], bool], timeout: float = WAIT_S
    ) -> list[tuple[str, bytes]]:
        """Everything received once ``until`` holds: a message count, or a predicate on the list (else at timeout)."""
        if isinstance(until, int):
            count = until

            def done() -> bool:
                return len(self.messages) >= count
        else:
            predicate = until

            def done() -> bool:
                return predicate(list(self.messages))

        with self._state:
            self._state.wait_for(done, timeout=timeout)
            return list(self.messages)

    @property
    def payloads(self) -> list[bytes]:
        with self._state:
            return [payload for _, payload in self.messages]

    def id_counts(self) -> Counter[object]:
        """How often each ``"id"`` arrived, from JSON payloads (``{"id": ...}``); other payloads are ignored."""
        return count_ids(self.payloads)

    def distinct_ids(self) -> set[object]:
        return set(self.id_counts())

    def duplicates(self) -> dict[object, int]:
        """Ids that arrived more than once → how many times (QoS 1 is at least once: redelivery is allowed)."""
        return {key: times for key, times in self.id_counts().items() if times > 1}

    def _connected_hook(self, client: mqtt.Client, session_present: bool) -> None:
        client.subscribe(self.topic_filter, qos=1)

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        if any(code.is_failure for code in reason_codes):
            return
        with self._state:
            self.subscriptions += 1
            self._state.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._state:
            self.messages.append((message.topic, bytes(message.payload)))
            self._state.notify_all()


def count_ids(payloads: Iterable[bytes]) -> Counter[object]:
    """The ``"id"`` of each JSON object payload, counted; payloads that are not such JSON are skipped."""
    counts: Counter[object] = Counter()
    for payload in payloads:
        try:
            decoded = json.loads(payload)
        except ValueError:
            continue
        if isinstance(decoded, dict) and "id" in decoded:
            key = decoded["id"]
            hashable = key is None or isinstance(key, (str, int, float))
            counts[key if hashable else json.dumps(key, sort_keys=True)] += 1
    return counts


def kill_and_restart(broker: Broker, down_s: float = 0.5) -> None:
    """SIGKILL the broker, leave it down ``down_s`` seconds (clients fail to reconnect meanwhile), restart it."""
    broker.kill()
    time.sleep(down_s)
    broker.restart()


@contextlib.contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``: ``4m``, ``1m``) mounted on ``directory`` (made), unmounted when the
    block ends. Root only (CI runs as root): the caller skips otherwise (``can_mount``)."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True, timeout=30)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False, timeout=30)


@contextlib.contextmanager
def ext4(directory: Path, size: str, image: Path) -> Iterator[Path]:
    """An ext4 file system (what an SD card holds) of ``size`` (``3M``) in the file ``image``, mounted on
    ``directory`` (made) through a loop device that is freed when it is unmounted at the end of the block. Root
    only, and ``mkfs.ext4`` (``can_mount``)."""
    mkfs = shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4"
    subprocess.run(["truncate", "-s", size, str(image)], check=True, timeout=30)
    subprocess.run([mkfs, "-q", "-F", str(image)], check=True, timeout=60)
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(directory)], check=True, timeout=30)
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], check=False, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], check=False, timeout=30)  # busy: freed when let go
        image.unlink(missing_ok=True)


def can_mount(kind: str = "tmpfs") -> bool:
    """Whether this process may mount a file system of ``kind`` (``tmpfs``, ``ext4``: a loop device)."""
    if kind == "ext4" and not (shutil.which("mkfs.ext4") or Path("/usr/sbin/mkfs.ext4").exists()):
        return False
    if kind == "ext4" and not Path("/dev/loop-control").exists():
        return False
    return os.geteuid() == 0 and shutil.which("mount") is not None


def fill(filler: Path) -> Path:
    """Take every free byte of the disk with ``filler`` (made beforehand: writes end on ENOSPC)."""
    chunk = b"\0" * 65536
    fd = os.open(filler, os.O_WRONLY | os.O_APPEND)
    try:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, chunk[:size])
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler
