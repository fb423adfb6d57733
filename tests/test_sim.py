"""Simulated sensors: exact counts through a real Mosquitto, repeatable seeded streams, bounds, and clear errors.

The data is a small fake prepared directory (no model is trained here): ``digits/validation.npz`` with 20 images of
1x8x8 and their labels, and for the vibration sensor 20 frames of 640 values, half of them labelled anomalous.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edgeline.cli import main
from edgeline.daemon.config import BrokerAddress
from edgeline.sim.data import MODEL_SHAPES, SENSOR_MODELS, Samples, load_sensor_samples, resolve_model
from edgeline.sim.publisher import PublishOptions, fleet_messages, publish
from edgeline.sim.sensors import ReplaySensor, VibrationSensor, fleet_devices, float32_values, make_sensor
from tests.mqtt_broker import Broker, free_port

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

T = TypeVar("T")
SAMPLES = 20
HANG_GUARD_S = 120.0
"""How long a run may take before it counts as hung (and is reported so): a guard, never what a test checks."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake ``edgeline reference prepare`` output directory: digits and autoencoder validation sets."""
    root = tmp_path_factory.mktemp("prepared")
    rng = np.random.default_rng(7)
    (root / "digits").mkdir()
    np.savez(
        root / "digits" / "validation.npz",
        x=rng.integers(0, 17, size=(SAMPLES, 1, 8, 8)).astype(np.float32) / 16,
        labels=np.arange(SAMPLES, dtype=np.int64) % 10,
    )
    (root / "autoencoder").mkdir()
    np.savez(
        root / "autoencoder" / "validation.npz",
        x=rng.normal(size=(SAMPLES, 640)).astype(np.float32),
        labels=np.arange(SAMPLES, dtype=np.int64) % 2,
    )
    return root


class Collector:
    """A paho-mqtt 2.x subscriber keeping every (topic, decoded JSON payload) it receives."""

    def __init__(self, broker: Broker, topic_filter: str) -> None:
        assert topic_filter.endswith("/#"), "the sentinel goes to the filter's own topic tree"
        self.sentinel_topic = topic_filter.removesuffix("#") + "sentinel"
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_connect = lambda client, *_: client.subscribe(topic_filter, qos=1)
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert subscribed.wait(5), "the collector got no SUBACK"

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((message.topic, json.loads(message.payload)))

    def wait_for(self, count: int, timeout: float = 10.0) -> list[tuple[str, dict[str, Any]]]:
        """Wait until ``count`` messages arrived, then publish a sentinel from this client and wait for it: what
        the broker took before it (an extra message) comes before it. What came before the sentinel."""
        deadline = time.monotonic() + timeout
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        self.client.publish(self.sentinel_topic, b'{"id": "sentinel"}', qos=1)
        deadline = time.monotonic() + timeout
        while not any(topic == self.sentinel_topic for topic, _ in self.messages) and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            at = [index for index, (topic, _) in enumerate(self.messages) if topic == self.sentinel_topic]
            assert at == [len(self.messages) - 1], f"the sentinel at {at} of {len(self.messages)} messages"
            return self.messages[: at[0]]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def collect(session_broker: Broker) -> Iterator[Any]:
    made: list[Collector] = []

    def start(topic_filter: str) -> Collector:
        made.append(Collector(session_broker, topic_filter))
        return made[-1]

    yield start
    for collector in made:
        collector.close()


def run_cli(*argv: str | Path) -> tuple[int, str]:
    """``edgeline ARGV`` in a fresh process, as a user runs it: exit code and its output; a run still going after
    ``HANG_GUARD_S`` fails the test as hung."""
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "edgeline.cli", *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
    except subprocess.TimeoutExpired as hung:
        said = hung.stderr.decode(errors="replace") if isinstance(hung.stderr, bytes) else hung.stderr
        pytest.fail(f"edgeline {' '.join(map(str, argv))} hung: still running after {HANG_GUARD_S:g} s\n{said}")
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed.returncode, completed.stdout + completed.stderr


def finishes(call: Callable[[], T], what: str) -> T:
    """``call()`` in a thread, its result or its exception; if it is still running after ``HANG_GUARD_S``, the
    test fails as hung (the thread is a daemon: it cannot keep the session alive)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the test's thread as it is
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"finishes: {what}", daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        pytest.fail(f"{what} hung: still running after {HANG_GUARD_S:g} s")
    ((ok, value),) = outcome
    if not ok:
        raise value
    return value


# ---------------------------------------------------------------------------------------------------------------------
# through a real broker


@pytest.mark.integration
def test_fleet_of_three_sends_exactly_count_each(
    session_broker: Broker, unique_topic: str, collect: Any, prepared: Path
) -> None:
    collector = collect(f"{unique_topic}/#")
    argv: list[str | Path] = ["sim", "digits", "--data", prepared, "--broker", session_broker.address, "--rate", "100"]
    argv += ["--count", "12", "--device", "pump", "--devices", "3", "--topic", f"{unique_topic}/{{device}}/{{sensor}}"]
    argv += ["--qos", "1", "--json"]
    code, output = run_cli(*argv)
    assert code == 0, output
    report = json.loads(output)
    assert report["per_device"] == {"pump-001": 12, "pump-002": 12, "pump-003": 12}
    assert report["acknowledged"] == report["published"] == 36
    assert report["dropped"] == 0 and report["stopped_by"] == "count"

    received = collector.wait_for(36)
    assert len(received) == 36
    by_device: dict[str, list[dict[str, Any]]] = {}
    for topic, message in received:
        prefix, device, sensor = topic.rsplit("/", 2)
        assert prefix == unique_topic and sensor == "digits"
        by_device.setdefault(device, []).append(message)
    assert {device: len(messages) for device, messages in by_device.items()} == report["per_device"]
    ids = [message["id"] for _, message in received]
    assert len(set(ids)) == len(ids)
    assert {message["id"] for message in by_device["pump-002"]} == {f"pump-002-{seq}" for seq in range(12)}

    samples = load_sensor_samples(prepared, "digits")
    assert samples.labels is not None
    label_of = {sample.tobytes(): int(label) for sample, label in zip(samples.x, samples.labels, strict=True)}
    for _, message in received:
        data = np.asarray(message["data"], dtype=np.float32)
        assert data.shape == (8 * 8,)
        assert label_of[data.reshape(1, 8, 8).tobytes()] == message["label"], "data and label of one real sample"


@pytest.mark.integration
def test_seeded_runs_are_identical_through_the_broker(
    session_broker: Broker, unique_topic: str, collect: Any, prepared: Path
) -> None:
    runs = []
    for run in ("first", "second"):
        collector = collect(f"{unique_topic}/{run}/#")
        sensors = [make_sensor("digits", load_sensor_samples(prepared, "digits"), device=d, seed=5) for d in ("a", "b")]
        options = PublishOptions(count=8, rate_hz=0, topic=f"{unique_topic}/{run}/{{device}}", qos=1)
        report = publish(sensors, BrokerAddress.parse(session_broker.address), options)
        assert report.published == 16
        received = collector.wait_for(16)
        runs.append([(topic.rsplit("/", 1)[1], message) for topic, message in received])
    assert len(runs[0]) == 16
    # One connection keeps the order; per device it is the seeded order of that device.
    assert runs[0] == runs[1]
    device_a = [message["data"] for device, message in runs[0] if device == "a"]
    device_b = [message["data"] for device, message in runs[0] if device == "b"]
    assert device_a != device_b, "the devices of a fleet replay in different orders"


@pytest.mark.integration
def test_time_limit_stops_a_run_that_count_would_not(session_broker: Broker, unique_topic: str, prepared: Path) -> None:
    sensors = [make_sensor("digits", load_sensor_samples(prepared, "digits"), device="slow")]
    options = PublishOptions(count=1000, rate_hz=4, topic=f"{unique_topic}/{{device}}", time_limit_s=0.5)
    report = finishes(lambda: publish(sensors, BrokerAddress.parse(session_broker.address), options), "publish")
    assert report.stopped_by == "time-limit"
    assert 1 <= report.published < 1000
    assert report.acknowledged == report.published


@pytest.mark.integration
def test_count_bounds_an_unpaced_run(session_broker: Broker, unique_topic: str, collect: Any, prepared: Path) -> None:
    collector = collect(f"{unique_topic}/#")
    sensors = [make_sensor("digits", load_sensor_samples(prepared, "digits"), device="fast")]
    options = PublishOptions(count=3 * SAMPLES + 1, rate_hz=0, topic=f"{unique_topic}/{{device}}", qos=0)
    report = publish(sensors, BrokerAddress.parse(session_broker.address), options)
    assert report.published == report.acknowledged == 61
    assert len(collector.wait_for(61)) == 61


@pytest.mark.integration
def test_vibration_sensor_cli_injects_anomalies(
    session_broker: Broker, unique_topic: str, collect: Any, prepared: Path
) -> None:
    collector = collect(f"{unique_topic}/#")
    argv: list[str | Path] = ["sim", "vibration", "--data", prepared, "--broker", session_broker.address, "--rate", "0"]
    argv += ["--count", "40", "--device", "motor", "--topic", f"{unique_topic}/{{device}}", "--anomaly-rate", "1"]
    code, output = run_cli(*argv)
    assert code == 0, output
    received = collector.wait_for(40)
    assert len(received) == 40
    assert all(len(message["data"]) == 640 and message["label"] == 1 for _, message in received)


# ---------------------------------------------------------------------------------------------------------------------
# sensors, without a broker


def digits(prepared: Path) -> Samples:
    return load_sensor_samples(prepared, "digits")


@pytest.mark.quick
def test_messages_are_a_pure_function_of_seed_device_and_seq(prepared: Path) -> None:
    samples = digits(prepared)
    sensors = [make_sensor("digits", samples, device=device, seed=3) for device in fleet_devices("d", 3)]
    first = list(fleet_messages(sensors, 2 * SAMPLES + 5))
    again = [make_sensor("digits", samples, device=device, seed=3) for device in fleet_devices("d", 3)]
    assert list(fleet_messages(again, 2 * SAMPLES + 5)) == first
    # Asked out of order, a sensor answers the same.
    lone = make_sensor("digits", samples, device="d-002", seed=3)
    assert [lone.next_message(seq) for seq in (30, 2, 44, 0)] == [
        json.loads(first[3 * seq + 1].payload) for seq in (30, 2, 44, 0)
    ]
    other_seed = [make_sensor("digits", samples, device=device, seed=4) for device in fleet_devices("d", 3)]
    assert list(fleet_messages(other_seed, 10)) != first[:30]


@pytest.mark.quick
def test_every_pass_replays_each_sample_once(prepared: Path) -> None:
    sensor = ReplaySensor("digits", "cam", digits(prepared))
    for epoch in range(3):
        seen = [sensor.sample_index(seq) for seq in range(epoch * SAMPLES, (epoch + 1) * SAMPLES)]
        assert sorted(seen) == list(range(SAMPLES))


@pytest.mark.quick
def test_message_layout(prepared: Path) -> None:
    message = make_sensor("digits", digits(prepared), device="pad").next_message(7)
    assert set(message) == {"id", "data", "label"}
    assert message["id"] == "pad-7"
    assert len(message["data"]) == 64 and all(type(value) is float for value in message["data"])
    unlabelled = make_sensor("digits", digits(prepared), device="pad", with_label=False).next_message(7)
    assert set(unlabelled) == {"id", "data"} and unlabelled["data"] == message["data"]


@pytest.mark.quick
def test_fleet_topics_and_ids() -> None:
    assert fleet_devices("pump") == ["pump"]
    assert fleet_devices("pump", 3) == ["pump-001", "pump-002", "pump-003"]


@pytest.mark.quick
def test_float32_values_read_back_exactly() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.normal(scale=1e3, size=500).astype(np.float32),
            np.array([0.0, -0.0, 1e-45, -3.4028235e38, 0.1, 1 / 3], dtype=np.float32),
        ]
    )
    decoded = np.asarray(json.loads(json.dumps(float32_values(values))), dtype=np.float32)
    assert decoded.tobytes() == values.tobytes()
    assert len(json.dumps(float32_values(np.array([0.1], dtype=np.float32)))) == len("[0.1]")


@pytest.mark.quick
def test_vibration_anomaly_rate(prepared: Path) -> None:
    samples = load_sensor_samples(prepared, "autoencoder")
    truth = samples.labels
    assert truth is not None

    def labels(rate: float, seed: int = 0) -> list[int]:
        sensor = VibrationSensor("fan", samples, seed=seed, anomaly_rate=rate)
        return [int(truth[sensor.sample_index(seq)]) for seq in range(2000)]

    assert set(labels(0.0)) == {0}
    assert set(labels(1.0)) == {1}
    share = sum(labels(0.25)) / 2000
    assert 0.2 < share < 0.3
    assert labels(0.25) == labels(0.25)
    assert labels(0.25) != labels(0.25, seed=1)


@pytest.mark.quick
def test_sensor_catalogue_matches_the_reference_models() -> None:
    from edgeline.export.reference.registry import CATALOGUE

    # every model whose held-out samples are arrays (validation.npz) has a sensor; a detector's are images with boxes,
    # which a camera (``edgeline sim camera``) feeds, not a sensor
    replayed = {name: info for name, info in CATALOGUE.items() if info.task != "detect"}
    assert {name: info.input_shape for name, info in replayed.items()} == MODEL_SHAPES
    assert sorted(name for names in SENSOR_MODELS.values() for name in names) == sorted(replayed)
    assert resolve_model("camera") == "resnet8"
    assert resolve_model("camera", "vww") == "vww"


@pytest.mark.quick
def test_data_directory_layouts(prepared: Path, tmp_path: Path) -> None:
    assert load_sensor_samples(prepared, "digits").x.shape == (SAMPLES, 1, 8, 8)
    assert load_sensor_samples(prepared / "digits", "digits").x.shape == (SAMPLES, 1, 8, 8)
    # Any .npz replays as it is, whatever its shape or array name; labels stay optional.
    np.savez(tmp_path / "any.npz", frames=np.ones((4, 3), dtype=np.float64))
    samples = load_sensor_samples(tmp_path / "any.npz", "digits")
    assert samples.x.dtype == np.float32 and samples.labels is None and samples.sample_size == 3


@pytest.mark.integration
def test_sim_imports_neither_torch_nor_export() -> None:
    code = (
        "import sys, edgeline.sim.cli, edgeline.sim.data, edgeline.sim.sensors, edgeline.sim.publisher\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('edgeline.export')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------------
# user errors: exit code 2, one line, no traceback


@pytest.mark.quick
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["sim", "thermometer"],
            "invalid choice: 'thermometer' (choose from 'vibration', 'keyword', 'camera', 'digits')",
        ),
        (["sim", "digits"], "no data to replay: prepare one with `edgeline reference prepare digits --out DIR`"),
        (["sim", "digits", "--data", "{missing}"], "no such file or directory"),
        (["sim", "keyword", "--data", "{prepared}"], "neither"),
        (["sim", "camera", "--model", "digits", "--data", "{prepared}"], "valid: resnet8, vww"),
        (["sim", "digits", "--data", "{prepared}", "--anomaly-rate", "0.1"], "vibration sensor only"),
        (["sim", "vibration", "--data", "{prepared}", "--anomaly-rate", "2"], "between 0 and 1"),
        (["sim", "digits", "--data", "{prepared}", "--broker", "local host:1"], "--broker host"),
        (["sim", "digits", "--data", "{prepared}", "--broker", "127.0.0.1:http"], "expected HOST:PORT"),
        (["sim", "digits", "--data", "{prepared}", "--topic", "s/{room}"], "unknown field(s) room"),
        (["sim", "digits", "--data", "{prepared}", "--topic", "s/+/{device}"], "cannot be empty or contain"),
        (
            ["sim", "digits", "--data", "{prepared}", "--qos", "2"],
            "argument --qos: invalid choice: 2 (choose from 0, 1)",
        ),
        (["sim", "digits", "--data", "{prepared}", "--count", "0"], "--count must be between 1"),
        (["sim", "digits", "--data", "{prepared}", "--devices", "0"], "--devices must be 1 or more"),
        (["sim", "digits", "--data", "{prepared}", "--device", "a/b"], "device id 'a/b'"),
        # the daemon's connect path, so the daemon's words: see test_run_and_sim_fail_alike_on_a_refused_broker
        (["sim", "digits", "--data", "{prepared}", "--broker", "127.0.0.1:{port}"], ": connection refused (is the"),
    ],
)
def test_user_errors(
    argv: list[str], expected: str, prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = {"prepared": str(prepared), "missing": str(tmp_path / "missing"), "port": str(free_port())}
    args = [arg.format(**values) if arg.startswith("{") or ":{" in arg else arg for arg in argv]
    code = finishes(lambda: main(args), "edgeline " + " ".join(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeline sim: error: "), err
    assert expected in lines[0]


@pytest.mark.integration
def test_run_and_sim_fail_alike_on_a_refused_broker(built_litert_bundle: Path, prepared: Path) -> None:
    """One MQTT connect path: the daemon and the simulator refuse a dead broker in the same words, exit 2."""
    address = f"127.0.0.1:{free_port()}"
    runs = [
        [sys.executable, "-m", "edgeline.cli", "run", str(built_litert_bundle), "--broker", address],
        [sys.executable, "-m", "edgeline.cli", "sim", "digits", "--data", str(prepared), "--broker", address],
    ]
    errors = []
    for argv in runs:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        (line,) = [line for line in done.stderr.splitlines() if ": error: " in line]
        errors.append(line.split(": error: ", 1)[1])
    assert (
        errors[0] == errors[1] == f"broker {address}: connection refused (is the broker running and listening there?)"
    )
