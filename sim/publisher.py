"""Publish simulated sensor messages to an MQTT broker: a device, or a fleet interleaved on one connection.

    messages = fleet_messages(sensors, count=100, topic="sensors/{device}/{sensor}")   # pure: no broker
    report = publish(sensors, BrokerAddress.parse("127.0.0.1:1883"), PublishOptions(rate_hz=10, count=100))

Each of the fleet's devices sends ``count`` messages at ``rate_hz``; message ``j`` of the whole run is message
``j // D`` of device ``j % D``, due at ``j / (rate_hz * D)`` seconds, so the broker sees an even stream. The run
ends at ``count`` or at ``time_limit_s``, whichever comes first, and then waits (at most ``ack_timeout_s``) until
the broker has acknowledged every QoS 1 message (QoS 0: until every message is written to the socket).

A connection lost mid-run is not fatal, as for a real sensor: paho-mqtt reconnects; QoS 0 messages published
meanwhile are dropped and counted, QoS 1 messages are queued and sent on reconnection.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from edgeline.daemon.config import BrokerAddress
from edgeline.daemon.topics import SENSOR_TOPIC, validate_template
from edgeline.errors import EdgelineError
from edgeline.sim.sensors import Sensor

__all__ = [
    "DEFAULT_TOPIC",
    "Pacing",
    "PublishOptions",
    "PublishReport",
    "SimMessage",
    "encode_json",
    "fleet_messages",
    "publish",
    "record",
    "record_line",
    "validate_topic_template",
]

DEFAULT_TOPIC = SENSOR_TOPIC
TOPIC_FIELDS = ("device", "sensor")
CONNECT_TIMEOUT_S = 5.0
QUEUE_FULL_WAIT_S = 0.005
"""How long to wait before offering a message again when the client's queue is full (a burst at --rate 0)."""
MAX_COUNT = 10_000_000
MAX_RATE_HZ = 100_000.0


def validate_topic_template(template: str) -> str:
    """Refuse a topic template with fields other than {device} and {sensor}, or with MQTT wildcards."""
    return validate_template(template, TOPIC_FIELDS, what="--topic")


@dataclass(frozen=True)
class PublishOptions:
    """How much, how fast and how safely to publish. ``rate_hz`` is per device; 0 means as fast as possible."""

    count: int = 100
    rate_hz: float = 10.0
    topic: str = DEFAULT_TOPIC
    qos: int = 0
    time_limit_s: float = 600.0
    ack_timeout_s: float = 10.0
    client_id: str | None = None
    """None: ``edgeline-sim-<first device>-<process id>``."""

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_COUNT:
            raise EdgelineError(f"--count must be between 1 and {MAX_COUNT}, got {self.count}")
        if not 0 <= self.rate_hz <= MAX_RATE_HZ:
            raise EdgelineError(f"--rate must be between 0 (unpaced) and {MAX_RATE_HZ:g} Hz, got {self.rate_hz:g}")
        if self.qos not in (0, 1):
            raise EdgelineError(f"--qos must be 0 or 1, got {self.qos}")
        if not self.time_limit_s > 0:
            raise EdgelineError(f"--time-limit must be more than 0 seconds, got {self.time_limit_s:g}")
        if not self.ack_timeout_s > 0:
            raise EdgelineError(f"acknowledgement timeout must be more than 0 seconds, got {self.ack_timeout_s:g}")
        validate_topic_template(self.topic)


@dataclass(frozen=True)
class SimMessage:
    """One message of a run: where it goes, what it says, and whose it is."""

    topic: str
    payload: bytes
    device: str
    seq: int


@dataclass(frozen=True)
class PublishReport:
    """What a run did. ``acknowledged``: QoS 1 messages the broker acknowledged (QoS 0: messages written)."""

    broker: str
    sensor: str
    devices: tuple[str, ...]
    qos: int
    published: int
    dropped: int
    acknowledged: int
    per_device: dict[str, int]
    elapsed_s: float
    stopped_by: str
    """``count`` (every message sent) or ``time-limit``."""

    def summary(self) -> str:
        fleet = f"{len(self.devices)} devices" if len(self.devices) > 1 else f"device {self.devices[0]}"
        rate = self.published / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (
            f"sim {self.sensor}: {self.published} messages from {fleet} to {self.broker} (QoS {self.qos}) "
            f"in {self.elapsed_s:.2f} s ({rate:.1f}/s); {self.dropped} dropped, {self.acknowledged} acknowledged; "
            f"stopped by {self.stopped_by}"
        )


def encode_json(message: dict[str, Any]) -> bytes:
    """The json codec's payload: compact, UTF-8."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")


def fleet_messages(sensors: Sequence[Sensor], count: int, topic: str = DEFAULT_TOPIC) -> Iterator[SimMessage]:
    """``count`` messages of each sensor, interleaved device by device (0, 1, 2, 0, 1, 2, ...)."""
    validate_topic_template(topic)
    topics = [topic.format(device=sensor.device, sensor=sensor.name) for sensor in sensors]
    for seq in range(count):
        for sensor, sensor_topic in zip(sensors, topics, strict=True):
            yield SimMessage(sensor_topic, encode_json(sensor.next_message(seq)), sensor.device, seq)


class Pacing:
    """Message ``j`` of a run is due ``j / (rate_hz * devices)`` seconds after the start (rate 0: at once).

    ``paced`` yields each message when it is due and stops at the time limit; ``stopped_by`` then says
    ``count`` (every message went out) or ``time-limit``.
    """

    def __init__(self, rate_hz: float, devices: int, time_limit_s: float, wait: Callable[[float], Any] = time.sleep):
        self.interval = 0.0 if rate_hz == 0 else 1.0 / (rate_hz * devices)
        self.time_limit_s = time_limit_s
        self.wait = wait
        self.stopped_by = "count"

    def paced(self, messages: Iterable[SimMessage]) -> Iterator[SimMessage]:
        start = time.monotonic()
        deadline = start + self.time_limit_s
        for index, message in enumerate(messages):
            due = start + index * self.interval
            if due > deadline or time.monotonic() > deadline:
                self.stopped_by = "time-limit"
                return
            delay = due - time.monotonic()
            if delay > 0:
                self.wait(delay)
            yield message


def record_line(message: SimMessage, t: float) -> bytes:
    """One line of a recording for ``edgeline run --replay``: topic, device, time and the JSON payload."""
    payload = json.loads(message.payload)
    line = {"topic": message.topic, "device": message.device, "t": round(t, 6), "payload": payload}
    return json.dumps(line, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"


def record(sensors: Sequence[Sensor], out: str, options: PublishOptions) -> PublishReport:
    """Write the run's messages to ``out`` (``-``: stdout) as a recording, paced like a broker run."""
    import sys

    if not sensors:
        raise EdgelineError("no sensors to record")
    per_device = {sensor.device: 0 for sensor in sensors}
    pacing = Pacing(options.rate_hz, len(sensors), options.time_limit_s)
    start = time.monotonic()
    try:
        stream = sys.stdout.buffer if out == "-" else open(out, "wb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise EdgelineError(f"--out {out}: {exc.strerror or exc}") from exc
    try:
        for message in pacing.paced(fleet_messages(sensors, options.count, options.topic)):
            stream.write(record_line(message, time.monotonic() - start))
            if options.rate_hz:
                stream.flush()  # a paced run is a live stream: a reader sees each message when it is due
            per_device[message.device] += 1
    except BrokenPipeError:
        pacing.stopped_by = "reader closed the pipe"
    finally:
        if stream is sys.stdout.buffer:
            with contextlib.suppress(BrokenPipeError):
                stream.flush()
        else:
            stream.close()
    written = sum(per_device.values())
    return PublishReport(
        broker="stdout" if out == "-" else out,
        sensor=sensors[0].name,
        devices=tuple(per_device),
        qos=0,
        published=written,
        dropped=0,
        acknowledged=written,
        per_device=per_device,
        elapsed_s=time.monotonic() - start,
        stopped_by=pacing.stopped_by,
    )


def publish(sensors: Sequence[Sensor], broker: BrokerAddress, options: PublishOptions) -> PublishReport:
    """Publish ``options.count`` messages of every sensor (one sensor per device) and report what happened.

    The connection is the daemon's own (``edgeline.daemon.mqtt.MqttConnection``): one connect path, so `run` and
    `sim` fail the same way, in the same words, and reconnect the same way. A publisher keeps no session.
    """
    from edgeline.daemon.config import BrokerConfig
    from edgeline.daemon.mqtt import MqttConnection

    if not sensors:
        raise EdgelineError("no sensors to publish")
    devices = tuple(sensor.device for sensor in sensors)
    if len(set(devices)) != len(devices):
        raise EdgelineError(f"device ids must be unique, got {', '.join(devices)}")
    client_id = options.client_id or f"edgeline-sim-{devices[0]}-{os.getpid()}"
    config = BrokerConfig(
        host=broker.host, port=broker.port, session_expiry_s=0, connect_timeout_s=CONNECT_TIMEOUT_S, keepalive_s=30
    )
    connection = MqttConnection(config, client_id=client_id)
    connection.start(_start_thread)
    try:
        return _run(connection, sensors, broker, options, sensors[0].name)
    finally:
        connection.close()


def _start_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, name="edgeline-sim-mqtt", daemon=True)
    thread.start()
    return thread


def _run(
    connection: Any, sensors: Sequence[Sensor], broker: BrokerAddress, options: PublishOptions, kind: str
) -> PublishReport:
    per_device = {sensor.device: 0 for sensor in sensors}
    done = threading.Condition()
    acknowledged = 0

    def on_done(ok: bool, reason: str | None) -> None:
        nonlocal acknowledged
        with done:
            acknowledged += ok
            done.notify_all()

    start = time.monotonic()
    published = dropped = 0
    pacing = Pacing(options.rate_hz, len(sensors), options.time_limit_s)
    for message in pacing.paced(fleet_messages(sensors, options.count, options.topic)):
        if options.qos == 0 and not connection.connected.is_set():
            dropped += 1  # at most once, and the link is down: gone, as from a real sensor
            continue
        deadline = time.monotonic() + options.ack_timeout_s
        while not connection.publish(message.topic, message.payload, qos=options.qos, done=on_done):
            if time.monotonic() > deadline:  # the client's queue stayed full: the broker takes nothing
                raise EdgelineError(
                    f"MQTT broker at {broker}: took nothing for {options.ack_timeout_s:g} s "
                    f"({published} messages published)"
                )
            time.sleep(QUEUE_FULL_WAIT_S)
        published += 1
        per_device[message.device] += 1
    with done:
        done.wait_for(lambda: acknowledged >= published, options.ack_timeout_s)
        count = acknowledged
    elapsed = time.monotonic() - start
    if options.qos == 1 and count < published:
        raise EdgelineError(
            f"MQTT broker at {broker}: acknowledged {count} of {published} QoS 1 messages "
            f"within {options.ack_timeout_s:g} s"
        )
    return PublishReport(
        broker=str(broker),
        sensor=kind,
        devices=tuple(per_device),
        qos=options.qos,
        published=published,
        dropped=dropped,
        acknowledged=count,
        per_device=per_device,
        elapsed_s=elapsed,
        stopped_by=pacing.stopped_by,
    )
