"""A real Mosquitto broker for tests, and the pytest fixtures that start it.

    broker          a fresh broker for one test (function scope): safe to stop and restart
    stock_broker    a fresh broker with Mosquitto's default queue limits (``stock``): what a user installs
    session_broker  one broker shared by the whole session: never stop it
    broker_factory  fresh brokers with options (persistence, a TLS + password + ACL listener), stopped at teardown
    pki             a CA, server and client certificates for this session (``tests.faults.make_pki``)
    unique_topic    a topic prefix no other test uses, so tests sharing a broker cannot see each other
    durable_broker  a persistent broker of one test; ``answers`` and ``publisher``: persistent MQTT 5 clients on it
                    (``tests.faults``) that survive its restarts, for counting what is lost
    Collector       a paho-mqtt subscriber that keeps what arrives and waits for a count

Each broker is Debian's ``mosquitto`` on a free loopback port, with a config generated in its own temporary
directory (anonymous, no persistence, logging to ``mosquitto.log`` there). It is stopped at teardown: terminate,
a bounded wait, then kill. A missing ``mosquitto`` fails the test (CI installs it; run ``scripts/setup.sh``).
The options of ``Broker`` (persistence, a secure listener) are all off unless asked for.

Registered for every test by ``tests/conftest.py``; importing this module starts nothing.
"""

from __future__ import annotations

import collections
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest

if TYPE_CHECKING:
    from tests.faults import DurableCollector, DurablePublisher, Pki

__all__ = [
    "Broker",
    "BrokerFactory",
    "BrokerStartError",
    "Collector",
    "TlsFiles",
    "broker",
    "broker_factory",
    "find_mosquitto",
    "free_port",
    "pki",
    "running_broker",
    "session_broker",
    "stock_broker",
    "unique_topic",
]

HOST = "127.0.0.1"
DEBIAN_MOSQUITTO = "/usr/sbin/mosquitto"
"""Where Debian installs it; /usr/sbin is not on a normal user's PATH."""
START_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
PORT_ATTEMPTS = 5
MAX_QUEUED_MESSAGES = 100_000
"""Per client; far above anything a test sends, so a slow test subscriber never loses messages (unless ``stock``)."""
STOCK_MAX_QUEUED_MESSAGES = 1000
"""Mosquitto's own default (``max_queued_messages``, per client; mosquitto.conf(5)): past it, QoS 1 messages for a
client are dropped although their publisher was acknowledged."""
SETUP_HINT = "run scripts/setup.sh (it installs Debian's mosquitto and mosquitto-clients)"


class BrokerStartError(RuntimeError):
    """Mosquitto is missing, or did not start accepting connections in time."""


@dataclass(frozen=True)
class TlsFiles:
    """What a TLS listener needs: the CA that signs client certificates, the server certificate and its key (PEM)."""

    cafile: Path
    certfile: Path
    keyfile: Path


def find_mosquitto() -> str:
    """The path of the ``mosquitto`` executable: on PATH, or where Debian puts it."""
    found = shutil.which("mosquitto")
    if found:
        return found
    if os.access(DEBIAN_MOSQUITTO, os.X_OK):
        return DEBIAN_MOSQUITTO
    raise BrokerStartError(f"mosquitto is not installed (not on PATH, no {DEBIAN_MOSQUITTO}); {SETUP_HINT}")


PORT_BAND_BASE = 20_000
PORT_BAND_SIZE = 1_000
"""Each pytest-xdist worker takes its ports from a band of its own below Linux's ephemeral range (32768 and up),
so two workers never race for one port, and no client's ephemeral port lands on a port a test is about to bind."""
_next_in_band: dict[int, int] = {}
_band_lock = threading.Lock()


def _worker_index() -> int:
    """0 outside xdist; N for worker ``gwN`` (bands wrap after a dozen workers: still far apart in time)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) % 12 if name.startswith("gw") and name[2:].isdigit() else 0


PORT_LOCKS = Path(tempfile.gettempdir()) / "edgeline-test-ports"
"""One lock file per port handed out: two pytest sessions on one machine (a developer's and CI's, or a helper's)
share the workers' bands, and a port one of them has just handed out is not bound yet."""
HELD_PORTS = 64
"""The latest ports this process handed out stay reserved (their ``flock`` held): long after each was bound by its
test, which is what closes the window; an older one is released (a process that dies releases its own)."""
_held: collections.deque[int] = collections.deque()


def _reserve(port: int) -> bool:
    """Whether ``port`` is now this process's: no other process holds its lock (``flock``, released by the kernel
    when its holder dies, so a killed session leaves nothing behind)."""
    try:
        PORT_LOCKS.mkdir(exist_ok=True)
        descriptor = os.open(PORT_LOCKS / str(port), os.O_RDONLY | os.O_CREAT, 0o644)  # flock needs no write access
    except OSError:  # another user's lock directory: no reservation, the bind probe alone (as before)
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return False
    _held.append(descriptor)
    if len(_held) > HELD_PORTS:
        os.close(_held.popleft())
    return True


def free_port(host: str = HOST) -> int:
    """A loopback port nobody listens on right now and no other test process has just handed out, from this
    worker's own band, never the same twice in a row: a restarted broker keeps its port, a new one gets the next.
    Someone outside the suite may still take it before we bind it (``Broker.start`` tries again)."""
    band = PORT_BAND_BASE + _worker_index() * PORT_BAND_SIZE
    with _band_lock:
        for _ in range(PORT_BAND_SIZE):
            offset = _next_in_band.get(band, os.getpid() % PORT_BAND_SIZE)
            _next_in_band[band] = (offset + 1) % PORT_BAND_SIZE
            port = band + offset
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            if not _reserve(port):
                continue
            return port
    raise BrokerStartError(f"no free port in {band}-{band + PORT_BAND_SIZE - 1} on {host}")


def write_password_file(path: Path, users: Mapping[str, str]) -> None:
    """A Mosquitto password file with these ``{user: password}``, hashed by ``mosquitto_passwd`` (``-b`` batch mode).

    Debian ships ``mosquitto_passwd`` in the ``mosquitto`` package itself, next to the broker; ``-c`` creates the
    file for the first user, later calls add to it.
    """
    if not users:
        raise ValueError("a password file needs at least one user")
    executable = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    for index, (user, password) in enumerate(users.items()):
        create = ["-c"] if index == 0 else []
        done = subprocess.run(
            [executable, "-b", *create, str(path), user, password],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise BrokerStartError(f"mosquitto_passwd failed for user {user!r}: {done.stderr.strip()}")


class Broker:
    """One Mosquitto process on ``host:port``, configured and logging in ``directory``.

    ``start()`` picks a free port (retrying if another process takes it first), ``restart()`` keeps it, so
    clients can reconnect to the same address after a simulated broker failure (``stop()`` or ``kill()``).

    Options, all off by default:

    ``persistence``
        Mosquitto keeps persistent sessions (clean_session false / a session expiry), their subscriptions, the
        messages queued or in flight for them and retained messages in ``mosquitto.db`` in ``directory``
        (``persistence_location``), and reloads them when it starts, so a ``restart()`` keeps them. It writes the
        file on a clean exit (``stop()``) and, with ``autosave_on_changes true`` and ``autosave_interval 1``, at the
        end of every main-loop pass in which at least one change was counted. What counts (mosquitto 2.0.11
        source): a persistent client connecting, a (un)subscription, a retained message, and a message *queued*
        for a client (offline, or its in-flight window full) or moved from its queue into flight. A message sent
        straight on to a connected subscriber with room in its window is not a change: it is saved only by the
        next save that something else triggers. Each save writes the whole database to ``mosquitto.db.new``,
        fsyncs it and renames it over ``mosquitto.db``, so a SIGKILL during a save leaves the previous one.
        Mosquitto sends a PUBACK while handling the PUBLISH, *before* the save at the end of that pass: a
        SIGKILL in between loses a message the publisher was told was received. There is no setting to save
        before acknowledging; this is the smallest window Mosquitto offers.

    ``stock``
        Leave ``max_queued_messages`` at Mosquitto's default (1,000 per client, with 20 in flight): the broker a
        user installs, which drops what a slow subscriber has not taken (logging "Outgoing messages are being
        dropped"). Without it the limit is raised to ``MAX_QUEUED_MESSAGES``.

    ``trace``
        Also log every packet (``log_type debug``): "Received PUBLISH from CLIENT (d0, q1, r0, m5, 'TOPIC', ...)"
        and "Sending PUBLISH to CLIENT (...)", flushed line by line, so a test can tell which hop lost a message.

    ``tls``, ``require_certificate``, ``users``, ``acl``
        Any of them opens a second listener on ``tls_port`` (``secure_port`` when it is plain TCP) with these
        settings, while ``port`` stays the anonymous, unencrypted listener every other helper uses (``Collector``,
        ``client_args``): an observer that needs no credentials. That takes ``per_listener_settings true``, first
        in the file (mosquitto refuses it after any security option), so that ``allow_anonymous``,
        ``password_file`` and ``acl_file`` apply to the listener they follow; otherwise they would be global and
        lock the plain listener too. In that mode an ACL check for a client with no listener is a denial, and a
        persistent client reloaded from ``mosquitto.db`` finds its listener by port: ``restart()`` keeps both
        ports. ``users`` (``{name: password}``) become a ``mosquitto_passwd`` file and turn
        ``allow_anonymous`` off on that listener; ``acl`` is the text of an ``acl_file`` (``user NAME`` then
        ``topic read|write|readwrite TOPIC`` lines; with an ACL file, anything not granted is denied).
    """

    def __init__(
        self,
        directory: Path,
        *,
        executable: str | None = None,
        persistence: bool = False,
        trace: bool = False,
        tls: TlsFiles | None = None,
        require_certificate: bool = False,
        users: Mapping[str, str] | None = None,
        acl: str | None = None,
        stock: bool = False,
    ) -> None:
        if require_certificate and tls is None:
            raise ValueError("require_certificate needs tls")
        self.directory = Path(directory)
        self.executable = executable or find_mosquitto()
        self.host = HOST
        self.port = 0
        self.secure_port = 0
        self.persistence = persistence
        self.trace = trace
        self.tls = tls
        self.require_certificate = require_certificate
        self.users = dict(users) if users is not None else None
        self.acl = acl
        self.stock = stock
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def has_secure_listener(self) -> bool:
        return self.tls is not None or self.users is not None or self.acl is not None

    @property
    def tls_port(self) -> int:
        """The TLS listener's port; an error when the broker has none."""
        if self.tls is None:
            raise AttributeError("this broker has no TLS listener (pass tls=...)")
        return self.secure_port

    @property
    def password_path(self) -> Path:
        return self.directory / "passwords"

    @property
    def acl_path(self) -> Path:
        return self.directory / "acl"

    @property
    def persistence_path(self) -> Path:
        """Where mosquitto keeps its database when ``persistence`` is on."""
        return self.directory / "mosquitto.db"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """``HOST:PORT``, as ``--broker`` takes it."""
        return f"{self.host}:{self.port}"

    @property
    def client_args(self) -> list[str]:
        """Where ``mosquitto_pub`` and ``mosquitto_sub`` find this broker: ``["-h", HOST, "-p", PORT]``."""
        return ["-h", self.host, "-p", str(self.port)]

    @property
    def config_path(self) -> Path:
        return self.directory / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        return self.directory / "mosquitto.log"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> Broker:
        """Start on new free ports; returns ``self``."""
        if self.running:
            raise BrokerStartError(f"broker already running on {self.address}")
        failures = []
        for _ in range(PORT_ATTEMPTS):
            self.port = free_port(self.host)
            self.secure_port = self._free_port_besides(self.port) if self.has_secure_listener else 0
            try:
                self._launch()
                return self
            except BrokerStartError as exc:
                failures.append(str(exc))
        raise BrokerStartError(f"mosquitto did not start after {PORT_ATTEMPTS} attempts: {failures[-1]}")

    def stop(self) -> None:
        """Terminate, wait a bounded time, kill if need be. Safe to call when stopped."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL, as a power cut would: no clean shutdown, no final save; returns once the process is reaped.

        Safe to call when stopped. The kernel closes the sockets at once (connected clients see a reset or EOF
        and reconnect), and ``restart()`` can bind the same ports again.
        """
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP the broker for the block, SIGCONT after: connections stay open, nothing is read, answered or
        acknowledged meanwhile (a PUBLISH sent to it waits in the socket), so a test can hold what a client has in
        flight still while it looks, then let everything go on as if the broker had been slow."""
        process = self._process
        if process is None or process.poll() is not None:
            raise BrokerStartError("the broker is not running")
        process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop (if running) and start again on the same ports (retried briefly while the old sockets are released).

        After ``kill()`` this is the crash-and-recover path: with ``persistence`` the broker reloads
        ``mosquitto.db`` as its last save left it.
        """
        self.stop()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self._launch()
                return
            except BrokerStartError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def log_text(self) -> str:
        """The broker's log so far (for assertion messages)."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_size(self) -> int:
        """Characters logged so far: pass as ``since`` to wait only for what is logged after now."""
        return len(self.log_text())

    def wait_for_log(self, matches: Callable[[str], bool], *, timeout: float = START_TIMEOUT_S, since: int = 0) -> bool:
        """Whether a log line (without its timestamp) satisfying ``matches`` appears within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_text()[since:].splitlines():
                _, _, message = line.partition(": ")
                if matches(message):
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def wait_for_subscription(
        self, client_id: str, topic_filter: str, *, timeout: float = START_TIMEOUT_S, since: int = 0
    ) -> bool:
        """Whether client ``client_id`` subscribes to ``topic_filter`` within ``timeout`` seconds.

        Mosquitto handles one packet at a time, so once the SUBSCRIBE is logged, anything published
        afterwards reaches that subscription: the race-free way to start publishing to a client we did not
        write (``mosquitto_sub``, the daemon).
        """

        def subscribed(message: str) -> bool:
            words = message.split(" ")
            return len(words) == 3 and words[0] == client_id and words[1].isdigit() and words[2] == topic_filter

        return self.wait_for_log(subscribed, timeout=timeout, since=since)

    def persistence_mark(self) -> tuple[int, int, int] | None:
        """The identity of ``mosquitto.db`` as it is now (inode, mtime, size), or None before the first save."""
        try:
            stat = self.persistence_path.stat()
        except FileNotFoundError:
            return None
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    def wait_for_save(self, since: tuple[int, int, int] | None, *, timeout: float = START_TIMEOUT_S) -> bool:
        """Whether mosquitto finishes a save after ``persistence_mark()`` returned ``since``, within ``timeout``.

        A save ends by renaming ``mosquitto.db.new`` over ``mosquitto.db``, so a changed mark means a complete,
        fsynced database. The "Saving in-memory database" log line comes before the write, too early to rely on.
        Wait for this before a ``kill()`` when the test is about what was saved rather than about the window
        between the PUBACK and the save (about 1 ms on an idle broker, see ``Broker``).
        """
        deadline = time.monotonic() + timeout
        while self.persistence_mark() in (since, None):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def __enter__(self) -> Broker:
        return self if self.running else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _free_port_besides(self, taken: int) -> int:
        """A second free port: the OS may hand out the one it just gave us again once its probe socket is closed."""
        for _ in range(PORT_ATTEMPTS):
            port = free_port(self.host)
            if port != taken:
                return port
        raise BrokerStartError(f"no second free port besides {taken}")

    def _write_config(self) -> None:
        lines = ["per_listener_settings true"] if self.has_secure_listener else []
        # The secure listener comes first: mosquitto opens listeners in this order and exits if one fails (a bad
        # certificate, a taken port), so once the plain port, opened last, accepts, every listener is up.
        lines += self._secure_listener_lines()
        lines += [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            *self._persistence_lines(),
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "log_type subscribe",
            *(["log_type debug"] if self.trace else []),
            "log_type unsubscribe",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
            "connection_messages true",
            *([] if self.stock else [f"max_queued_messages {MAX_QUEUED_MESSAGES}"]),
            "set_tcp_nodelay true",
        ]
        if os.geteuid() == 0:
            # As root, mosquitto would switch to the `mosquitto` user, who cannot write into our private
            # temporary directory; `user root` keeps it as root. Other users it never switches.
            lines.append("user root")
        self.config_path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _persistence_lines(self) -> list[str]:
        if not self.persistence:
            return ["persistence false"]
        return [
            "persistence true",
            f"persistence_location {self.directory}/",
            "autosave_interval 1",
            "autosave_on_changes true",
        ]

    def _secure_listener_lines(self) -> list[str]:
        """The second listener and its own security settings (``per_listener_settings`` makes them its own)."""
        if not self.has_secure_listener:
            return []
        lines = [f"listener {self.secure_port} {self.host}"]
        if self.tls is not None:
            lines += [f"cafile {self.tls.cafile}", f"certfile {self.tls.certfile}", f"keyfile {self.tls.keyfile}"]
            lines.append(f"require_certificate {'true' if self.require_certificate else 'false'}")
        if self.users is not None:
            write_password_file(self.password_path, self.users)
            lines += ["allow_anonymous false", f"password_file {self.password_path}"]
        else:
            lines.append("allow_anonymous true")
        if self.acl is not None:
            self.acl_path.write_text(self.acl.rstrip("\n") + "\n", encoding="utf-8")
            lines.append(f"acl_file {self.acl_path}")
        return lines

    def _launch(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_config()
        with open(self.directory / "mosquitto.out", "ab") as output:
            process = subprocess.Popen(
                [self.executable, "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        self._process = process
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                self._process = None
                raise BrokerStartError(
                    f"mosquitto exited with code {process.returncode} on port {self.port}: {self._tail()}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerStartError(
                    f"mosquitto did not accept connections on {self.address} within {START_TIMEOUT_S:g} s: "
                    f"{self._tail()}"
                )
            time.sleep(0.02)

    def _tail(self, lines: int = 5) -> str:
        text = self.log_text() + (self.directory / "mosquitto.out").read_text(encoding="utf-8", errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no log output)"


@contextmanager
def running_broker(directory: Path | None = None, *, stock: bool = False) -> Iterator[Broker]:
    """A started broker for code outside pytest (benchmarks, demos); in a temporary directory unless given one."""
    with (
        tempfile.TemporaryDirectory(prefix="edgeline-mosquitto-") as scratch,
        Broker(directory or Path(scratch), stock=stock) as running,
    ):
        yield running


def _started(make: Callable[[], Broker]) -> Broker:
    try:
        return make().start()
    except BrokerStartError as exc:
        pytest.fail(str(exc), pytrace=False)


class BrokerFactory(Protocol):
    """``broker_factory(persistence=..., trace=..., tls=..., require_certificate=..., users=..., acl=...)``:
    a started broker."""

    def __call__(
        self,
        *,
        persistence: bool = False,
        trace: bool = False,
        tls: TlsFiles | None = None,
        require_certificate: bool = False,
        users: Mapping[str, str] | None = None,
        acl: str | None = None,
    ) -> Broker: ...


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A fresh Mosquitto for this test only; the test may stop and restart it."""
    running = _started(partial(Broker, tmp_path_factory.mktemp("mosquitto")))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def stock_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A fresh Mosquitto for this test only, with Mosquitto's default queue limits (``Broker(stock=True)``)."""
    running = _started(partial(Broker, tmp_path_factory.mktemp("mosquitto"), stock=True))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One Mosquitto for the whole session; use with ``unique_topic`` and never stop it."""
    running = _started(partial(Broker, tmp_path_factory.mktemp("mosquitto-session")))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def broker_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerFactory]:
    """Started brokers with the options of ``Broker`` (each in its own directory), all stopped at teardown."""
    made: list[Broker] = []

    def make(
        *,
        persistence: bool = False,
        trace: bool = False,
        tls: TlsFiles | None = None,
        require_certificate: bool = False,
        users: Mapping[str, str] | None = None,
        acl: str | None = None,
    ) -> Broker:
        started = _started(
            partial(
                Broker,
                tmp_path_factory.mktemp("mosquitto"),
                persistence=persistence,
                trace=trace,
                tls=tls,
                require_certificate=require_certificate,
                users=users,
                acl=acl,
            )
        )
        made.append(started)
        return started

    try:
        yield make
    finally:
        for started in made:
            started.stop()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """This session's certificates (CA, server for localhost/127.0.0.1, client, an unrelated CA): see ``make_pki``."""
    from tests.faults import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def unique_topic() -> str:
    """A topic prefix of this test alone, e.g. ``edgeline-test/3f2a…``; build topics under it."""
    return f"edgeline-test/{uuid.uuid4().hex}"


# -- a persistent broker, and clients that survive its restarts (tests.faults): what "nothing lost" is counted with


@pytest.fixture
def durable_broker(broker_factory: BrokerFactory) -> Broker:
    """A Mosquitto of this test alone that saves its state (it may be SIGKILLed and restarted)."""
    return broker_factory(persistence=True)


@pytest.fixture
def answers(durable_broker: Broker, unique_topic: str) -> Iterator[DurableCollector]:
    """A persistent MQTT 5 subscriber to ``{unique_topic}/results/#`` on ``durable_broker``."""
    import paho.mqtt.client as mqtt

    from tests.faults import DurableCollector

    collector = DurableCollector(durable_broker, f"{unique_topic}/results/#", protocol=mqtt.MQTTv5)
    yield collector.start_and_subscribe()
    collector.close()


@pytest.fixture
def publisher(durable_broker: Broker) -> Iterator[DurablePublisher]:
    """A persistent MQTT 5 publisher on ``durable_broker`` that sends again what the broker did not acknowledge."""
    import paho.mqtt.client as mqtt

    from tests.faults import DurablePublisher

    with DurablePublisher(durable_broker, protocol=mqtt.MQTTv5) as client:
        assert client.wait_connected()
        yield client


class Collector:
    """A paho-mqtt 2.x subscriber that keeps every (topic, payload, retained) and can wait for a count."""

    def __init__(self, broker: Broker, topic_filter: str, timeout: float = 20.0) -> None:
        import paho.mqtt.client as mqtt

        self.messages: list[tuple[str, bytes, bool]] = []
        self.lock = threading.Condition()
        self.timeout = timeout
        subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_connect = lambda client, *_: client.subscribe(topic_filter, qos=1)
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert subscribed.wait(timeout), "no SUBACK from the broker"

    def _on_message(self, client: object, userdata: object, message: object) -> None:
        with self.lock:
            self.messages.append((message.topic, bytes(message.payload), bool(message.retain)))  # type: ignore[attr-defined]
            self.lock.notify_all()

    @property
    def payloads(self) -> list[bytes]:
        with self.lock:
            return [payload for _, payload, _ in self.messages]

    def wait_for(self, count: int, timeout: float | None = None) -> list[tuple[str, bytes, bool]]:
        """What has arrived once ``count`` messages have (or the timeout has passed: the caller checks)."""
        with self.lock:
            self.lock.wait_for(lambda: len(self.messages) >= count, timeout=timeout or self.timeout)
            return list(self.messages)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
