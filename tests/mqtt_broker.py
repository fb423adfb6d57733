"""A real Mosquitto broker for tests, and the pytest fixtures that start it.

    broker          a fresh broker for one test (function scope): safe to stop and restart
    session_broker  one broker shared by the whole session: never stop it
    unique_topic    a topic prefix no other test uses, so tests sharing a broker cannot see each other
    Collector       a paho-mqtt subscriber that keeps what arrives and waits for a count

Each broker is Debian's ``mosquitto`` on a free loopback port, with a config generated in its own temporary
directory (anonymous, no persistence, logging to ``mosquitto.log`` there). It is stopped at teardown: terminate,
a bounded wait, then kill. A missing ``mosquitto`` fails the test (CI installs it; run ``scripts/setup.sh``).

Registered for every test by ``tests/conftest.py``; importing this module starts nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = [
    "Broker",
    "BrokerStartError",
    "Collector",
    "broker",
    "find_mosquitto",
    "free_port",
    "running_broker",
    "session_broker",
    "unique_topic",
]

HOST = "127.0.0.1"
DEBIAN_MOSQUITTO = "/usr/sbin/mosquitto"
"""Where Debian installs it; /usr/sbin is not on a normal user's PATH."""
START_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
PORT_ATTEMPTS = 5
MAX_QUEUED_MESSAGES = 100_000
"""Per client; far above anything a test sends, so a slow test subscriber never loses messages."""
SETUP_HINT = "run scripts/setup.sh (it installs Debian's mosquitto and mosquitto-clients)"


class BrokerStartError(RuntimeError):
    """Mosquitto is missing, or did not start accepting connections in time."""


def find_mosquitto() -> str:
    """The path of the ``mosquitto`` executable: on PATH, or where Debian puts it."""
    found = shutil.which("mosquitto")
    if found:
        return found
    if os.access(DEBIAN_MOSQUITTO, os.X_OK):
        return DEBIAN_MOSQUITTO
    raise BrokerStartError(f"mosquitto is not installed (not on PATH, no {DEBIAN_MOSQUITTO}); {SETUP_HINT}")


def free_port(host: str = HOST) -> int:
    """A port nobody listens on right now (the OS picks it); someone may take it before we bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Broker:
    """One Mosquitto process on ``host:port``, configured and logging in ``directory``.

    ``start()`` picks a free port (retrying if another process takes it first), ``restart()`` keeps it, so
    clients can reconnect to the same address after a simulated broker failure.
    """

    def __init__(self, directory: Path, *, executable: str | None = None) -> None:
        self.directory = Path(directory)
        self.executable = executable or find_mosquitto()
        self.host = HOST
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

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
        """Start on a new free port; returns ``self``."""
        if self.running:
            raise BrokerStartError(f"broker already running on {self.address}")
        failures = []
        for _ in range(PORT_ATTEMPTS):
            self.port = free_port(self.host)
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

    def restart(self) -> None:
        """Stop and start again on the same port (retried briefly while the old socket is released)."""
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

    def __enter__(self) -> Broker:
        return self if self.running else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _write_config(self) -> None:
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            "persistence false",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "log_type subscribe",
            "log_type unsubscribe",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
            "connection_messages true",
            f"max_queued_messages {MAX_QUEUED_MESSAGES}",
            "set_tcp_nodelay true",
        ]
        if os.geteuid() == 0:
            # As root, mosquitto would switch to the `mosquitto` user, who cannot write into our private
            # temporary directory; `user root` keeps it as root. Other users it never switches.
            lines.append("user root")
        self.config_path.write_text("\n".join(lines) + "\n", encoding="utf-8")

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
def running_broker(directory: Path | None = None) -> Iterator[Broker]:
    """A started broker for code outside pytest (benchmarks, demos); in a temporary directory unless given one."""
    with (
        tempfile.TemporaryDirectory(prefix="edgeline-mosquitto-") as scratch,
        Broker(directory or Path(scratch)) as running,
    ):
        yield running


def _started(directory: Path) -> Broker:
    try:
        return Broker(directory).start()
    except BrokerStartError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A fresh Mosquitto for this test only; the test may stop and restart it."""
    running = _started(tmp_path_factory.mktemp("mosquitto"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One Mosquitto for the whole session; use with ``unique_topic`` and never stop it."""
    running = _started(tmp_path_factory.mktemp("mosquitto-session"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def unique_topic() -> str:
    """A topic prefix of this test alone, e.g. ``edgeline-test/3f2a…``; build topics under it."""
    return f"edgeline-test/{uuid.uuid4().hex}"


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
