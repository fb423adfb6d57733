"""The real-broker fixture: paho-mqtt and Debian's own clients get messages through it, and it restarts in place."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from tests.mqtt_broker import Broker, BrokerStartError, Collector, find_mosquitto

TIMEOUT_S = 5.0


@pytest.fixture
def subscriber_factory() -> Iterator[type[Collector]]:
    made: list[Collector] = []

    class Closing(Collector):
        def __init__(self, broker: Broker, topic: str) -> None:
            super().__init__(broker, topic)
            made.append(self)

    yield Closing
    for subscriber in made:
        subscriber.close()


def publish_once(broker: Broker, topic: str, payload: bytes, qos: int = 1) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        client.publish(topic, payload, qos=qos).wait_for_publish(TIMEOUT_S)
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.mark.integration
def test_paho_publisher_reaches_paho_subscriber(
    session_broker: Broker, unique_topic: str, subscriber_factory: type[Collector]
) -> None:
    subscriber = subscriber_factory(session_broker, f"{unique_topic}/#")
    publish_once(session_broker, f"{unique_topic}/hello", b'{"id":"a","data":[1.0]}')
    assert subscriber.wait_for(1, TIMEOUT_S), session_broker.log_text()
    assert subscriber.payloads == [b'{"id":"a","data":[1.0]}']


def start_mosquitto_sub(broker: Broker, topic: str, client_id: str) -> subprocess.Popen[str]:
    """``mosquitto_sub`` for one message (``-C 1``) within 5 s (``-W 5``), returned once it has subscribed."""
    since = broker.log_size()
    sub = subprocess.Popen(
        ["mosquitto_sub", *broker.client_args, "-i", client_id, "-t", topic, "-q", "1", "-C", "1", "-W", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if not broker.wait_for_subscription(client_id, topic, since=since):
        sub.kill()
        sub.wait(TIMEOUT_S)
        pytest.fail(f"mosquitto_sub did not subscribe to {topic}; broker log:\n{broker.log_text()}")
    return sub


def finish(sub: subprocess.Popen[str]) -> str:
    """What ``mosquitto_sub`` printed; fails unless it got its message and exited by itself."""
    try:
        out, err = sub.communicate(timeout=TIMEOUT_S + 2)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait(TIMEOUT_S)
    assert sub.returncode == 0, f"mosquitto_sub exited with {sub.returncode}: {err}"
    return out


@pytest.mark.integration
def test_debian_clients_pass_a_message(session_broker: Broker, unique_topic: str) -> None:
    topic = f"{unique_topic}/cli"
    sub = start_mosquitto_sub(session_broker, topic, f"sub-{unique_topic.rpartition('/')[2]}")
    pub = subprocess.run(
        ["mosquitto_pub", *session_broker.client_args, "-t", topic, "-q", "1", "-m", "from mosquitto_pub"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert pub.returncode == 0, pub.stderr
    assert finish(sub).splitlines() == ["from mosquitto_pub"]


@pytest.mark.integration
def test_paho_message_reaches_mosquitto_sub(session_broker: Broker, unique_topic: str) -> None:
    topic = f"{unique_topic}/mixed"
    sub = start_mosquitto_sub(session_broker, topic, f"sub-{unique_topic.rpartition('/')[2]}")
    publish_once(session_broker, topic, b"from paho")
    assert finish(sub).splitlines() == ["from paho"]


@pytest.mark.integration
def test_restart_keeps_the_port_and_serves_again(
    broker: Broker, unique_topic: str, subscriber_factory: type[Collector]
) -> None:
    port = broker.port
    broker.stop()
    assert not broker.running
    broker.restart()
    assert broker.running
    assert broker.port == port
    assert broker.url == f"mqtt://127.0.0.1:{port}"
    subscriber = subscriber_factory(broker, f"{unique_topic}/#")
    publish_once(broker, f"{unique_topic}/after-restart", b"again")
    assert subscriber.wait_for(1, TIMEOUT_S), broker.log_text()
    assert subscriber.payloads == [b"again"]


@pytest.mark.integration
def test_each_test_gets_its_own_broker(broker: Broker, session_broker: Broker) -> None:
    assert broker.running and session_broker.running
    assert broker.port != session_broker.port
    assert broker.directory != session_broker.directory
    assert "listener" in broker.config_path.read_text(encoding="utf-8")


@pytest.mark.quick
def test_stop_is_bounded_and_idempotent(tmp_path: Path) -> None:
    with Broker(tmp_path) as running:
        assert running.running
    assert not running.running
    running.stop()


@pytest.mark.quick
def test_missing_mosquitto_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("tests.mqtt_broker.DEBIAN_MOSQUITTO", str(tmp_path / "no-mosquitto"))
    with pytest.raises(BrokerStartError, match=r"scripts/setup\.sh"):
        find_mosquitto()


@pytest.mark.quick
def test_a_broker_that_cannot_start_says_why(tmp_path: Path) -> None:
    fake = tmp_path / "mosquitto"
    fake.write_text("#!/bin/sh\necho 'Error: pretend failure' >&2\nexit 3\n", encoding="utf-8")
    fake.chmod(0o755)
    with pytest.raises(BrokerStartError, match="pretend failure"):
        Broker(tmp_path / "run", executable=str(fake)).start()


@pytest.mark.quick
def test_a_port_another_test_process_has_just_handed_out_is_never_handed_out_again() -> None:
    """Two pytest sessions on one machine share the workers' port bands: a port one of them handed out (not bound
    yet: a daemon is about to bind it) must not be the next one the other hands out; once that process is gone,
    its ports are free again."""
    import os
    import sys

    from tests import mqtt_broker

    child = subprocess.Popen(
        [sys.executable, "-c", "from tests.mqtt_broker import free_port; print(free_port(), flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTEST_XDIST_WORKER": os.environ.get("PYTEST_XDIST_WORKER", "gw0")},
    )  # fmt: skip
    try:
        assert child.stdout is not None
        taken = int(child.stdout.readline())
        band = taken - taken % mqtt_broker.PORT_BAND_SIZE
        mqtt_broker._next_in_band[band] = taken - band  # this process would hand out the same port next
        mine = mqtt_broker.free_port()
        assert mine != taken and band <= mine < band + mqtt_broker.PORT_BAND_SIZE
    finally:
        child.communicate("\n", timeout=30)
    mqtt_broker._next_in_band[band] = taken - band
    assert mqtt_broker.free_port() == taken, "released when the process that held it ended"
