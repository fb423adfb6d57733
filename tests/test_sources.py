"""Sources other than MQTT: a serial port (a real pseudo-terminal, and pyserial's socket:// URL on loopback),
recorded messages from a file or stdin, and simulated sensors in-process; each run as `edgeline run`."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cbor2
import numpy as np
import pytest

import edgeline
from edgeline.daemon.sources import LineFramer, parse_record
from edgeline.daemon.topics import TopicFilter
from tests.mqtt_broker import Broker

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 30.0
EDGELINE = [sys.executable, "-m", "edgeline.cli"]


# -- framing and record forms --------------------------------------------------------------------------------


@pytest.mark.quick
def test_lines_are_the_same_however_the_stream_is_cut() -> None:
    lines = [b'{"a": 1}', b"x" * 50, b"", b"tail\r", b"  ", b"z"]
    stream = b"\n".join(lines) + b"\nlast-without-newline"
    expected = [(b'{"a": 1}', 8), (b"x" * 50, 50), (b"tail", 4), (b"z", 1), (b"last-without-newline", 20)]
    rng = np.random.default_rng(3)
    for _ in range(50):
        cuts = sorted(rng.choice(np.arange(1, len(stream)), size=int(rng.integers(0, 12)), replace=False))
        framer = LineFramer(limit=64)
        got: list[tuple[bytes, int]] = []
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            got += framer.feed(stream[start:end])
        got += framer.flush()
        assert got == expected


@pytest.mark.quick
def test_an_over_long_line_is_skipped_without_being_held() -> None:
    framer = LineFramer(limit=1000)
    got: list[tuple[bytes, int]] = []
    got += framer.feed(b"ok\n")
    for _ in range(100):  # a 1 MB line in 10 kB pieces
        got += framer.feed(b"y" * 10_000)
        assert len(framer._buffer) <= 1000
    got += framer.feed(b"\nnext\n")
    assert got == [(b"ok", 2), (b"", 1_000_000), (b"next", 4)]


@pytest.mark.quick
def test_the_record_forms() -> None:
    filters = [TopicFilter("plant/+/accel")]
    recorded, t = parse_record(b'{"topic": "plant/p1/accel", "t": 1.5, "payload": {"data": [1]}}', filters, "d")
    assert (recorded.device, json.loads(recorded.payload), t) == ("p1", {"data": [1]}, 1.5)
    named, _ = parse_record(b'{"topic": "x/y", "device": "pump", "payload": 1}', filters, "d")
    assert named.device == "pump"
    binary, _ = parse_record(
        json.dumps({"topic": "a", "payload_base64": base64.b64encode(b"\x01\x02").decode()}).encode(), filters, "d"
    )
    assert binary.payload == b"\x01\x02"
    piped, _ = parse_record(b'plant/p2/accel {"data": [2]}', filters, "d")
    assert (piped.topic, piped.device, piped.payload) == ("plant/p2/accel", "p2", b'{"data": [2]}')
    unmatched, _ = parse_record(b"other/topic {}", filters, "d")
    assert unmatched.device == "other/topic"
    for bare in (b'{"id": 1, "data": [3]}', b"{broken", b"[1, 2]", b"lonelyword"):
        message, when = parse_record(bare, filters, "d")
        assert (message.payload, message.device, when) == (bare, "d", None)


# -- helpers ---------------------------------------------------------------------------------------------------


def run_edgeline(*args: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*EDGELINE, *args], input=stdin, capture_output=True, timeout=timeout)


def answers_of(stdout: bytes) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


def check_results(bundle: Path, answers: list[dict[str, object]], inputs: dict[str, np.ndarray]) -> None:
    """Every id in ``inputs`` answered once, with the outputs ``predict`` gives for the same input."""
    model = edgeline.load(bundle)
    results = {str(a["id"]): a for a in answers if "error" not in a}
    assert sorted(results) == sorted(inputs)
    for identity, x in inputs.items():
        outputs = results[identity]["outputs"]
        assert isinstance(outputs, list)
        np.testing.assert_allclose(outputs[0], model.predict(x.reshape(1, 1, 8, 8))[0], rtol=1e-6, atol=1e-7)


class Lines:
    """Reads a child's pipe line by line with a deadline, so that a missing line fails the test, not hangs it."""

    def __init__(self, pipe: object) -> None:
        self.fd = pipe.fileno()  # type: ignore[attr-defined]
        self.buffer = b""

    def next(self, timeout: float = TIMEOUT_S) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no line within {timeout:g} s (so far: {self.buffer[-500:]!r})")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise AssertionError(f"the pipe closed (so far: {self.buffer[-500:]!r})")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def start_daemon(*args: str) -> tuple[subprocess.Popen[bytes], Lines, Lines]:
    """`edgeline run ARGS`, returned once it has opened its source (its start-up line is on stderr)."""
    process = subprocess.Popen([*EDGELINE, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = Lines(process.stdout), Lines(process.stderr)
    try:
        while b" edgeline run: " not in err.next():
            pass
    except AssertionError:
        process.kill()
        raise
    return process, out, err


def finish(process: subprocess.Popen[bytes], out: Lines, err: Lines) -> tuple[bytes, bytes]:
    """SIGTERM, then what is left on stdout and stderr."""
    process.send_signal(signal.SIGTERM)
    rest, stderr = process.communicate(timeout=TIMEOUT_S)
    return out.buffer + rest, err.buffer + stderr


def bad_lines() -> dict[str, bytes]:
    """One line per error code a JSON line can earn (oversized needs the limit set by the test's config)."""
    return {
        "malformed": b"{oops",
        "wrong-shape": b'{"data": [1.0, 2.0]}',
        "wrong-dtype": b'{"data": ["a", "b"]}',
        "missing-input": b'{"id": "no-data"}',
        "non-finite": b'{"data": [NaN]}',
        "oversized": b'{"data": [' + b"0.5, " * 2000 + b"0.5]}",
    }


@pytest.fixture
def small_limit(tmp_path: Path) -> Path:
    config = tmp_path / "daemon.toml"
    config.write_text("[input]\nmax_payload_bytes = 4096\n")
    return config


@pytest.fixture
def digits_data(tmp_path: Path) -> Path:
    """Prepared-reference layout for the digits sensor: DIR/digits/validation.npz."""
    data = tmp_path / "prepared"
    (data / "digits").mkdir(parents=True)
    rng = np.random.default_rng(5)
    x = rng.random((12, 1, 8, 8), dtype=np.float32)
    np.savez(data / "digits" / "validation.npz", x=x, labels=np.arange(12) % 10)
    return data


# -- serial --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_serial_json_lines_from_a_pseudo_terminal(built_litert_bundle: Path, small_limit: Path) -> None:
    """A real tty (the kind a USB-serial adapter gives): results equal to predict, every bad line a coded error."""
    master, slave = os.openpty()
    port = os.ttyname(slave)
    process, out, err = start_daemon(
        str(built_litert_bundle), "--serial", port, "--device", "mcu", "--config", str(small_limit)
    )
    try:
        rng = np.random.default_rng(1)
        inputs = {f"s{i}": rng.random(64, dtype=np.float32) for i in range(6)}
        bad = bad_lines()
        lines = [json.dumps({"id": k, "data": v.tolist()}).encode() for k, v in inputs.items()]
        lines[3:3] = list(bad.values())  # bad lines in the middle of good ones: nothing else may be lost
        for line in lines:
            os.write(master, line + b"\r\n")
        answers = [json.loads(out.next()) for _ in lines]
        rest, stderr = finish(process, out, err)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
        os.close(slave)
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert b"Traceback" not in stderr
    assert rest == b""  # exactly one answer per line
    assert {a["device"] for a in answers} == {"mcu"}
    assert [a["seq"] for a in answers] == list(range(1, len(lines) + 1))
    check_results(built_litert_bundle, answers, inputs)
    codes = [a["error"]["code"] for a in answers if "error" in a]  # type: ignore[index]
    assert codes == list(bad)


class LineServer:
    """A loopback TCP server that plays a serial device for pyserial's socket:// URL: each connection gets the
    next batch of lines and is then closed, as when a USB sensor is unplugged.

    Opening a port discards what has already arrived (pyserial's ``open`` resets the input buffer, as on a real
    tty), so a batch goes out only when the test says the daemon has the port open: ``send[i].set()``."""

    def __init__(self, batches: list[list[bytes]]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(TIMEOUT_S)
        self.port = self.server.getsockname()[1]
        self.batches = batches
        self.send = [threading.Event() for _ in batches]
        self.served = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for batch, go in zip(self.batches, self.send, strict=True):
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                if not go.wait(TIMEOUT_S):
                    return
                connection.sendall(b"".join(line + b"\n" for line in batch))
            self.served += 1

    def close(self) -> None:
        self.server.close()


@pytest.mark.integration
def test_serial_reopens_a_port_that_went_away(built_litert_bundle: Path) -> None:
    rng = np.random.default_rng(2)
    inputs = {f"r{i}": rng.random(64, dtype=np.float32) for i in range(4)}
    lines = [json.dumps({"id": k, "data": v.tolist()}).encode() for k, v in inputs.items()]
    server = LineServer([lines[:2], lines[2:]])
    process, out, err = start_daemon(str(built_litert_bundle), "--serial", f"socket://127.0.0.1:{server.port}")
    logged: list[bytes] = []
    try:
        server.send[0].set()  # the start-up line comes after the port is open
        answers = [json.loads(out.next()) for _ in range(2)]
        while b"reopened" not in (line := err.next()):  # the first connection closed; wait for the second
            logged.append(line)
        logged.append(line)
        server.send[1].set()
        answers += [json.loads(out.next()) for _ in range(2)]
        _, stderr = finish(process, out, err)
    finally:
        if process.poll() is None:
            process.kill()
        server.close()
    assert process.returncode == 0
    assert server.served == 2  # the daemon came back for the second connection
    assert any(b"lost" in line for line in logged) and b"Traceback" not in stderr
    check_results(built_litert_bundle, answers, inputs)


@pytest.mark.integration
def test_a_missing_serial_port_is_a_clear_error(built_litert_bundle: Path, tmp_path: Path) -> None:
    done = run_edgeline("run", str(built_litert_bundle), "--serial", str(tmp_path / "ttyUSB9"))
    assert done.returncode == 2
    assert f"--serial {tmp_path / 'ttyUSB9'}" in done.stderr.decode()
    assert b"Traceback" not in done.stderr


# -- replay ----------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_recording_replays_to_the_same_answers_as_predict(
    built_litert_bundle: Path, digits_data: Path, tmp_path: Path
) -> None:
    recording = tmp_path / "rec.jsonl"
    sim = run_edgeline(
        "sim", "digits", "--data", str(digits_data), "--count", "4", "--devices", "2", "--rate", "0",
        "--out", str(recording),
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr.decode()
    records = [json.loads(line) for line in recording.read_text().splitlines()]
    assert len(records) == 8
    done = run_edgeline("run", str(built_litert_bundle), "--replay", str(recording))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    answers = answers_of(done.stdout)
    assert len(answers) == 8  # the file ended: every record answered once, then a clean exit
    inputs = {r["payload"]["id"]: np.array(r["payload"]["data"], np.float32) for r in records}
    check_results(built_litert_bundle, answers, inputs)
    assert {a["device"] for a in answers} == {"sim-001", "sim-002"}


@pytest.mark.integration
def test_stdin_replay_of_mixed_line_forms_with_every_error_code(built_litert_bundle: Path, small_limit: Path) -> None:
    rng = np.random.default_rng(4)
    inputs = {f"p{i}": rng.random(64, dtype=np.float32) for i in range(3)}
    good = [json.dumps({"id": k, "data": v.tolist()}).encode() for k, v in inputs.items()]
    lines = [
        b"plant/press-1/image " + good[0],  # mosquitto_sub -v
        json.dumps({"topic": "plant/press-2/image", "payload": json.loads(good[1])}).encode(),
        good[2],  # bare
        *bad_lines().values(),
    ]
    done = run_edgeline(
        "run", str(built_litert_bundle), "--replay", "-", "--subscribe", "plant/+/image", "--device", "bench",
        "--config", str(small_limit), stdin=b"\n".join(lines) + b"\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    answers = answers_of(done.stdout)
    assert len(answers) == len(lines)
    check_results(built_litert_bundle, answers, inputs)
    assert [a["device"] for a in answers[:3]] == ["press-1", "press-2", "bench"]
    assert [a["error"]["code"] for a in answers[3:]] == list(bad_lines())  # type: ignore[index]


@pytest.mark.integration
def test_binary_codecs_replay_from_base64(built_litert_bundle: Path) -> None:
    x = np.linspace(0, 1, 64, dtype=np.float32)
    payload = cbor2.dumps({"id": "c1", "data": x.tolist()})
    line = json.dumps({"topic": "t/cam/image", "payload_base64": base64.b64encode(payload).decode()})
    done = run_edgeline("run", str(built_litert_bundle), "--replay", "-", "--codec", "cbor", stdin=line.encode())
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    check_results(built_litert_bundle, answers_of(done.stdout), {"c1": x})


@pytest.mark.integration
def test_a_mosquitto_sub_capture_replays_through_the_broker(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """Record live traffic with Debian's mosquitto_sub -v, replay it, and publish the answers to the broker."""
    rng = np.random.default_rng(6)
    inputs = {f"q{i}": rng.random(64, dtype=np.float32) for i in range(3)}
    since = broker.log_size()
    capture = subprocess.Popen(
        ["mosquitto_sub", *broker.client_args, "-i", "capture", "-v", "-C", "3", "-t", f"{unique_topic}/sensors/#"],
        stdout=subprocess.PIPE,
    )
    assert broker.wait_for_subscription("capture", f"{unique_topic}/sensors/#", timeout=TIMEOUT_S, since=since)
    for index, (identity, x) in enumerate(inputs.items()):
        payload = json.dumps({"id": identity, "data": x.tolist()}).encode()
        topic = f"{unique_topic}/sensors/dev-{index}/image"
        subprocess.run(["mosquitto_pub", *broker.client_args, "-t", topic, "-s"], input=payload, check=True)
    recorded, _ = capture.communicate(timeout=TIMEOUT_S)
    since = broker.log_size()
    answers = subprocess.Popen(
        [
            "mosquitto_sub",
            *broker.client_args,
            "-i",
            "answers",
            "-C",
            "3",
            "-W",
            "30",
            "-t",
            f"{unique_topic}/answers/#",
        ],
        stdout=subprocess.PIPE,
    )
    assert broker.wait_for_subscription("answers", f"{unique_topic}/answers/#", timeout=TIMEOUT_S, since=since)
    done = run_edgeline(
        "run", str(built_litert_bundle), "--replay", "-", "--subscribe", f"{unique_topic}/sensors/+/image",
        "--broker", broker.address, "--publish", f"{unique_topic}/answers/{{device}}", stdin=recorded,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout == b""  # --broker: answers go there, not to stdout
    published, _ = answers.communicate(timeout=TIMEOUT_S)
    received = answers_of(published)
    check_results(built_litert_bundle, received, inputs)
    assert sorted(str(a["device"]) for a in received) == ["dev-0", "dev-1", "dev-2"]


@pytest.mark.integration
def test_a_missing_recording_is_a_clear_error(built_litert_bundle: Path, tmp_path: Path) -> None:
    done = run_edgeline("run", str(built_litert_bundle), "--replay", str(tmp_path / "nope.jsonl"))
    assert done.returncode == 2
    assert b"--replay" in done.stderr and b"No such file" in done.stderr
    assert b"Traceback" not in done.stderr


# -- simulated sensors in-process --------------------------------------------------------------------------------


@pytest.mark.integration
def test_sim_in_process_equals_its_recording(built_litert_bundle: Path, digits_data: Path, tmp_path: Path) -> None:
    """`run --sim ARGS` and `sim ARGS --out` + `run --replay` see the same messages: the same answers."""
    sim_args = ["digits", "--data", str(digits_data), "--count", "5", "--devices", "3", "--rate", "0", "--seed", "9"]
    live = run_edgeline("run", str(built_litert_bundle), "--sim", " ".join(sim_args))
    assert live.returncode == 0, live.stderr.decode()[-2000:]
    recording = tmp_path / "rec.jsonl"
    assert run_edgeline("sim", *sim_args, "--out", str(recording)).returncode == 0
    replayed = run_edgeline("run", str(built_litert_bundle), "--replay", str(recording))
    live_answers, replay_answers = answers_of(live.stdout), answers_of(replayed.stdout)
    assert len(live_answers) == 15
    assert len({a["id"] for a in live_answers}) == 15
    strip = ("latency_ms", "timestamp")
    assert [{k: v for k, v in a.items() if k not in strip} for a in live_answers] == [
        {k: v for k, v in a.items() if k not in strip} for a in replay_answers
    ]


@pytest.mark.integration
def test_sim_piped_to_replay_on_stdin(built_litert_bundle: Path, digits_data: Path) -> None:
    sim = subprocess.Popen(
        [*EDGELINE, "sim", "digits", "--data", str(digits_data), "--count", "6", "--rate", "50", "--out", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    run = subprocess.run(
        [*EDGELINE, "run", str(built_litert_bundle), "--replay", "-"], stdin=sim.stdout, capture_output=True, timeout=60
    )
    sim.wait(timeout=30)
    assert (sim.returncode, run.returncode) == (0, 0), run.stderr.decode()[-2000:]
    assert [a["id"] for a in answers_of(run.stdout)] == [f"sim-{i}" for i in range(6)]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("sim_args", "named"),
    [("digits --count", "--count"), ("sonar", "sonar"), ("digits --topic 'a/{x}'", "--topic"), ("'open", "--sim")],
)
def test_bad_sim_arguments_are_a_clear_error(built_litert_bundle: Path, sim_args: str, named: str) -> None:
    done = run_edgeline("run", str(built_litert_bundle), "--sim", sim_args)
    assert done.returncode == 2
    assert named in done.stderr.decode()
    assert b"Traceback" not in done.stderr


@pytest.mark.integration
def test_a_closed_stdout_stops_the_daemon_quietly(built_litert_bundle: Path, digits_data: Path) -> None:
    run, out, err = start_daemon(
        str(built_litert_bundle), "--sim", f"digits --data {digits_data} --count 5000 --rate 0"
    )
    out.next()
    assert run.stdout is not None
    run.stdout.close()  # like `| head -1`
    assert run.wait(timeout=TIMEOUT_S) == 0
    stderr = err.buffer + (run.stderr.read() if run.stderr else b"")
    assert b"stdout was closed" in stderr and b"Traceback" not in stderr


@pytest.mark.integration
@pytest.mark.workstation  # needs a bundle only the export extra can make
def test_a_runtime_failure_in_a_replay_is_one_coded_answer_without_a_traceback(lookup_bundle: Path) -> None:
    lines = [b'{"id": "a", "data": [1, 2, 3]}', b'{"id": "b", "data": [1, 2, 300]}', b'{"id": "c", "data": [4, 5, 6]}']
    done = run_edgeline("run", str(lookup_bundle), "--replay", "-", stdin=b"\n".join(lines))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    answers = answers_of(done.stdout)
    assert [(a["id"], "error" in a) for a in answers] == [("a", False), ("b", True), ("c", False)]
    assert answers[1]["error"]["code"] == "inference-failed"  # type: ignore[index]
    assert b"inference failed: on a message from replay" in done.stderr and b"Traceback" not in done.stderr


@pytest.mark.quick
def test_a_second_program_on_a_serial_port_is_refused_not_given_half_its_lines() -> None:
    """A JSON-lines port is opened exclusively (a flock, as the framed link and serial tools do): a second daemon, or
    a bridge beside this one, is told the port is taken instead of splitting the board's lines with it."""
    from edgeline.daemon.sources import SerialSource
    from edgeline.errors import EdgelineError

    board, port = os.openpty()
    try:
        path = os.ttyname(port)
        first = SerialSource(path, baudrate=115200, device="b", max_payload_bytes=1024)
        second = SerialSource(path, baudrate=115200, device="b", max_payload_bytes=1024)
        first.open()
        try:
            with pytest.raises(EdgelineError, match=rf"--serial {path}: .*lock"):
                second.open()
        finally:
            first._port.close()  # type: ignore[union-attr]
        second.open()  # free again once the first closed it
        second._port.close()  # type: ignore[union-attr]
    finally:
        os.close(board)
        os.close(port)
