"""The firmware bridge end to end: boards (the Python board, and the C firmware on QEMU's Cortex-M4) speaking the
framed protocol to `edgeline run --serial-protocol frames` and to `edgeline bridge` with a real Mosquitto and a real
daemon, answers back down to the board; then wire faults from a relay of our own, counted exactly, and nothing lost
in reliable mode when the bridge is killed."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeline
from edgeline.firmware_bridge.link import Board, BoardLink, StreamSpec, parse_hello, parse_input_id
from edgeline.firmware_bridge.protocol import FLAG_ACK_REQUESTED, Frame, FrameError, FrameType, encode, unpack_ack
from edgeline.sim.board import BoardOptions, PythonBoard, Uart, load_board_samples
from tests.mqtt_broker import Broker, Collector, free_port
from tests.serial_faults import FrameRelay

pytestmark = pytest.mark.device

EDGELINE = [sys.executable, "-m", "edgeline.cli"]
TIMEOUT_S = 60.0
HELLO = {
    "device": "b-1",
    "firmware": "test",
    "protocol": 1,
    "streams": [{"id": 1, "name": "digits", "dtype": "f32", "shape": [1, 8, 8], "rate_hz": 10, "seq": 5}],
}


# -- the link's rules, frame by frame ------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.samples: list[tuple[int, np.ndarray, list[Callable[[], None]]]] = []
        self.hellos: list[bool] = []

    def on_hello(self, link: BoardLink, board: Board, restarted: bool) -> None:
        self.hellos.append(restarted)

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        self.samples.append((frame.seq, samples, safe))

    def on_result(self, link: BoardLink, board: Board, frame: Frame, record: dict[str, Any]) -> None:
        pass


class Wire:
    """What a link writes, decoded: stands in for the port. The link queues its frames for its writer thread; the
    test takes them from the queue, in order, when it looks."""

    def __init__(self, link: BoardLink) -> None:
        from edgeline.firmware_bridge.protocol import Decoder

        self.link = link
        self.decoder = Decoder()
        self._frames: list[Frame] = []

    @property
    def frames(self) -> list[Frame]:
        while not self.link._downlink.empty():
            self._frames.extend(self.decoder.feed(self.link._downlink.get_nowait()[1]))
        return self._frames

    def acks(self) -> list[tuple[int, int]]:
        return [unpack_ack(f.payload) for f in self.frames if f.type == FrameType.ACK]


def make_link() -> tuple[BoardLink, Recorder, Wire]:
    recorder = Recorder()
    link = BoardLink("test://", recorder)
    wire = Wire(link)
    link._port_for_writes = wire  # open, as far as the link's queue knows: the test reads what it queues
    link.request_hello()
    return link, recorder, wire


def samples_frame(seq: int, count: int = 1, reliable: bool = True, t_us: int = 0) -> bytes:
    payload = np.arange(64 * count, dtype="<f4").tobytes()
    return encode(Frame(FrameType.SAMPLES, 1, seq, t_us, payload, FLAG_ACK_REQUESTED if reliable else 0))


@pytest.mark.quick
def test_reliable_frames_are_taken_in_order_and_acknowledged_only_once_safe() -> None:
    link, recorder, wire = make_link()
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 10, json.dumps(HELLO).encode())))
    assert recorder.hellos == [False]
    link._take(samples_frame(5, count=2) + samples_frame(7))  # 6 lost on the wire: 7 is not taken
    assert [seq for seq, _, _ in recorder.samples] == [5]
    assert link.counters.sequence_gaps == 1 and recorder.samples[0][1].shape == (2, 1, 8, 8)
    recorder.samples[0][2][0]()
    assert wire.acks() == []  # one sample of two is safe: not the frame
    recorder.samples[0][2][1]()
    assert wire.acks() == [(1, 5)]
    link._take(samples_frame(5, count=2))  # a resend of a frame already safe: acknowledged again, not taken again
    assert wire.acks() == [(1, 5), (1, 5)] and len(recorder.samples) == 1
    link._take(samples_frame(6) + samples_frame(7))  # the board goes back to 6 (go-back-N)
    assert [seq for seq, _, _ in recorder.samples] == [5, 6, 7]
    recorder.samples[2][2][0]()  # 7 safe before 6: no ACK yet, it would say 6 is safe
    assert wire.acks()[-1] == (1, 5)
    recorder.samples[1][2][0]()
    assert wire.acks()[-1] == (1, 7)
    link._take(samples_frame(8))
    link.retake(1, 8)  # the broker refused it: the board's resend is taken again
    link._take(samples_frame(8))
    assert [seq for seq, _, _ in recorder.samples] == [5, 6, 7, 8, 8]


@pytest.mark.quick
def test_what_the_link_refuses_is_counted_by_reason_and_costs_nothing_else() -> None:
    link, recorder, wire = make_link()
    link._hello_wanted_since = None  # the HELLO_REQUEST was answered by a HELLO that got lost
    link._take(samples_frame(0, reliable=False))  # before any HELLO: refused, and the board is asked who it is
    link._take(samples_frame(1, reliable=False))  # asked already: not once more for every frame
    assert link.counters.refused["stream"] == 2
    assert sum(f.type == FrameType.HELLO_REQUEST for f in wire.frames) == 2
    bad = {**HELLO, "streams": [{"id": 0, "name": "x", "dtype": "f32", "shape": [1]}]}
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 1, json.dumps(bad).encode())))
    link._take(encode(Frame(FrameType.HELLO, 0, 1, 2, b"not json")))
    assert link.counters.refused["hello"] == 2 and link.board is None
    link._take(encode(Frame(FrameType.HELLO, 0, 2, 3, json.dumps(HELLO).encode())))
    wrong = encode(Frame(FrameType.SAMPLES, 1, 5, 4, b"\x00" * 10, FLAG_ACK_REQUESTED))  # not a whole sample
    unknown = encode(Frame(FrameType.SAMPLES, 9, 0, 5, b"\x00" * 4))
    answer = encode(Frame(FrameType.ANSWER, 1, 0, 6, b"{}"))  # a host-to-board type from the board
    link._take(wrong + unknown + b"\x01\x02garbage\x00" + answer + samples_frame(6, t_us=7))
    refused = link.counters.refused
    assert (refused["samples"], refused["stream"], refused["direction"], refused["cobs"]) == (1, 3, 1, 1)
    assert wire.acks() == [(1, 5)]  # the refused frame is safe (or the board resends it for ever)
    assert [seq for seq, _, _ in recorder.samples] == [6]


@pytest.mark.quick
def test_a_hello_not_asked_for_or_with_the_clock_gone_back_is_a_restart() -> None:
    link, recorder, _ = make_link()
    hello = json.dumps(HELLO).encode()
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 1000, hello)))
    link._take(samples_frame(5, t_us=2000))
    link.request_hello()
    link._take(encode(Frame(FrameType.HELLO, 0, 1, 3000, hello)))  # asked for, clock going on: the same session
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 10, hello)))  # not asked for
    link.request_hello()
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 5, hello)))  # asked for, but the clock went back
    assert recorder.hellos == [False, False, True, True]
    assert link.counters.board_restarts == 2


@pytest.mark.quick
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"device": "a/b"}, "device"),
        ({"protocol": 2}, "protocol"),
        ({"streams": [{"id": 1, "name": "x", "dtype": "f64", "shape": [1]}]}, "dtype"),
        ({"streams": [{"id": 1, "name": "x", "dtype": "f32", "shape": [0]}]}, "shape"),
        ({"streams": [{"id": 1, "name": "x", "dtype": "f32", "shape": [2000]}]}, "fits in a frame"),
        ({"streams": "x"}, "streams"),
    ],
)
def test_a_bad_hello_names_its_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(FrameError, match=named):
        parse_hello(json.dumps({**HELLO, **change}).encode())


@pytest.mark.quick
def test_a_board_on_another_port_keeps_its_name_and_two_live_boards_with_one_id_are_a_clone() -> None:
    from edgeline.daemon.config import BrokerAddress
    from edgeline.firmware_bridge.bridge import Bridge, BridgeOptions

    bridge = Bridge(["test://a", "test://b", "test://c"], BrokerAddress("127.0.0.1", 1), BridgeOptions())
    board = parse_hello(json.dumps(HELLO).encode())
    a, b, c = bridge.links
    for link in (a, b, c):
        link.board = board
    bridge.on_hello(a, board, False)
    b.connected.set()
    bridge.on_hello(b, board, False)  # a's port is gone (not connected): the board moved to b
    assert bridge.boards["b-1"] is b and bridge.metrics.snapshot()["counts"]["duplicate_devices"] == 0
    c.connected.set()
    bridge.on_hello(c, board, False)  # b is live: a second board with the same id
    assert bridge.boards["b-1"] is c and bridge.metrics.snapshot()["counts"]["duplicate_devices"] == 1


@pytest.mark.quick
def test_input_ids_route_answers_back_and_nothing_else() -> None:
    assert parse_input_id("3.65535.0.123456789") == parse_input_id("3.65535.0.123456789.7") == (3, 65535)
    for other in ("1.2.3", "0.1.0.0", "1.65536.0.0", "a.b.c.d", 7, None, "1.-2.0.0", "1.2.3.4.5.6"):
        assert parse_input_id(other) is None


# -- end to end ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def board_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("board") / "validation.npz"
    np.savez(path, x=rng.random((16, 1, 8, 8), dtype=np.float32), labels=np.arange(16) % 10)
    return path


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.1)


class Process:
    """An edgeline command in the background, its stderr kept."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.process = subprocess.Popen([*EDGELINE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str, str]:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=TIMEOUT_S)
        return self.process.returncode, out.decode(), err.decode()


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        if process.process.poll() is None:
            process.process.kill()
            process.process.communicate(timeout=TIMEOUT_S)


@contextlib.contextmanager
def stopped(process: Process) -> Iterator[None]:
    """The process frozen (SIGSTOP) for the block: the broker queues what it does not take."""
    process.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.process.send_signal(signal.SIGCONT)


def start_daemon(collector: Collector, bundle: Path, broker: Broker, state: Path) -> Process:
    """`edgeline run BUNDLE --broker` with the default topics, once it is subscribed (its "online" is out): what a
    bridge publishes before then has no subscriber to go to."""
    daemon = Process("run", str(bundle), "--broker", f"{broker.host}:{broker.port}", "--state-dir", str(state))
    wait_until(
        lambda: any(t.endswith("/availability") and p == b"online" for t, p, _ in list(collector.messages)),
        TIMEOUT_S,
        "the daemon online",
    )
    return daemon


def results_of(collector: Collector) -> dict[str, dict[str, Any]]:
    return {
        str(record["id"]): record
        for topic, payload, _ in list(collector.messages)
        if topic.endswith("/result") and isinstance(record := json.loads(payload), dict)
    }


def retained_status(collector: Collector, suffix: str) -> dict[str, Any] | None:
    found = [json.loads(p) for topic, p, _ in list(collector.messages) if topic.endswith(suffix)]
    return found[-1] if found else None


@pytest.mark.integration
@pytest.mark.workstation  # /metrics needs prometheus-client (the metrics extra)
def test_run_reads_a_board_on_a_pty_and_sends_every_answer_back_down(
    built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """`edgeline run --serial PTY --serial-protocol frames`: the board's samples are answered exactly once with the
    model's outputs, every answer goes back down, every frame is acknowledged; the link's counters are in the
    status message and on /metrics."""
    count = 40
    board = PythonBoard(BoardOptions("pump-7", rate_hz=100, count=count, reliable=True), board_data, Uart.PTY)
    port = free_port()
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[broker]\nhost = "{broker.host}"\nport = {broker.port}\n[output]\nmqtt = true\n'
        f'[health]\nstatus_interval_s = 0.5\nprometheus_port = {port}\nstatus_topic = "edgeline/{{name}}/status"\n'
    )
    collector = Collector(broker, "edgeline/#")
    try:
        with board:
            processes.append(
                daemon := Process("run", str(built_litert_bundle), "--serial", board.url, "--serial-protocol",
                                  "frames", "--config", str(config), "--state-dir", str(tmp_path / "state"))
            )  # fmt: skip
            wait_until(lambda: (s := board.session) is not None and s.stats()["acked"] >= count, TIMEOUT_S, "acked")
            session = board.session
            assert session is not None
            wait_until(lambda: session.stats()["answers"] >= count, TIMEOUT_S, "answers back down")
            wait_until(lambda: len(results_of(collector)) >= count, TIMEOUT_S, "answers on MQTT")
            stats = session.stats()
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

            def board_said() -> dict[str, Any]:
                return ((retained_status(collector, "/status") or {}).get("source") or {}).get("board_stats") or {}

            wait_until(lambda: board_said().get("done") is True, 20, "the board's own stats in the status message")
        code, _, err = daemon.stop()
    finally:
        collector.close()
    assert code == 0, err[-3000:]
    assert (stats["sent"], stats["acked"], stats["answers"]) == (count, count, count), stats
    results = results_of(collector)
    samples = load_board_samples(board_data)
    model = edgeline.load(built_litert_bundle)
    assert len(results) == count
    for identity, record in results.items():
        stream, seq = parse_input_id(identity) or (0, -1)
        assert stream == 1 and record["device"] == "pump-7"
        x = np.frombuffer(samples.samples[seq % len(samples.samples)], dtype="<f4").reshape(1, 1, 8, 8)
        np.testing.assert_allclose(record["outputs"][0], model.predict(x)[0], rtol=1e-6, atol=1e-7)
    status = retained_status(collector, "/status")
    assert status is not None
    counts = status["counts"]
    assert counts["serial_samples"] == count and counts["serial_answers_sent"] == count
    assert counts["serial_acks_sent"] >= 1 and counts["serial_crc_errors"] == counts["serial_sequence_gaps"] == 0
    assert status["source"]["device"] == "pump-7" and status["source"]["board_stats"]["answers"] == count
    scraped = {m[0]: float(m[1]) for m in re.findall(r"^edgeline_(serial_\w+)_total\{[^}]*\} (\S+)$", metrics, re.M)}
    assert scraped["serial_frames"] > count and scraped["serial_board_restarts"] == 0, scraped


@pytest.mark.integration
@pytest.mark.workstation  # /metrics needs prometheus-client (the metrics extra)
def test_bridge_and_run_meet_with_the_emulated_cortex_m4_board(
    built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """The C firmware on QEMU's mps2-an386 → `edgeline bridge` → Mosquitto → `edgeline run` (default topics) → the
    answer → the bridge → the board: exact counts, read from the board's own stats line."""
    from edgeline.sim.mcu import EmulatedBoard

    count = 30
    collector = Collector(broker, "#")
    board = EmulatedBoard(BoardOptions("m4-1", rate_hz=50, count=count, reliable=True), board_data)
    address = f"{broker.host}:{broker.port}"
    try:
        with board:
            processes.append(daemon := start_daemon(collector, built_litert_bundle, broker, tmp_path / "state"))
            metrics_port = free_port()
            processes.append(
                bridge := Process("bridge", board.url, "--broker", address, "--instance", "gw",
                                  "--status-interval", "0.5", "--prometheus-port", str(metrics_port))
            )  # fmt: skip

            def board_stats() -> dict[str, Any]:
                status = retained_status(collector, "bridge/gw/status")
                return (status or {}).get("boards", [{}])[0].get("board_stats") or {}

            wait_until(lambda: board_stats().get("answers", 0) >= count and board_stats().get("done"), 90, "answers")
            stats = board_stats()
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            code, _, err = bridge.stop()
            assert code == 0, err[-3000:]
            counts = final_bridge_status(collector, "gw")["counts"]
            daemon.stop()
    finally:
        collector.close()
    assert (stats["sent"], stats["acked"], stats["answers"]) == (count, count, count), stats
    results = results_of(collector)
    assert sorted(parse_input_id(i) for i in results) == [(1, seq) for seq in range(count)]
    assert counts["published"] == count and counts["answers_routed"] == count
    assert counts["serial_refused"] == counts["serial_sequence_gaps"] == counts["serial_board_restarts"] == 0
    scraped = {m[0]: float(m[1]) for m in re.findall(r"^edgeline_(\w+)_total\{[^}]*\} (\S+)$", metrics, re.M)}
    assert scraped["published"] == count and scraped["serial_frames"] >= count, scraped
    assert scraped["serial_crc_errors"] == scraped["serial_resyncs"] == 0


def make_board(kind: str, options: BoardOptions, data: Path) -> Any:
    """The Python board, or the C firmware on QEMU's Cortex-M4: both must hold up alike."""
    if kind == "qemu":
        from edgeline.sim.mcu import EmulatedBoard

        return EmulatedBoard(options, data)
    return PythonBoard(options, data)


BOARDS = pytest.mark.parametrize("kind", ["python", "qemu"])


def bridge_status(collector: Collector, instance: str) -> dict[str, Any]:
    status = retained_status(collector, f"bridge/{instance}/status")
    assert status is not None, "no status from the bridge"
    return status


def final_bridge_status(collector: Collector, instance: str) -> dict[str, Any]:
    """The status a stopped bridge published last, once it is here: the bridge publishes it, then "offline" on its
    availability topic (both QoS 1, in order). A status read before that one came is up to an interval old. (Live,
    not retained: a retained "offline" is an earlier bridge's, sent when the collector subscribed.)"""
    topic = f"edgeline/bridge/{instance}/availability"
    wait_until(
        lambda: any(t == topic and p == b"offline" and not retained for t, p, retained in list(collector.messages)),
        30,
        "the bridge offline",
    )
    return bridge_status(collector, instance)


@pytest.mark.integration
@BOARDS
def test_wire_faults_are_counted_exactly_and_cost_nothing_else(
    kind: str, built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """Garbage, bit flips, drops, split and merged frames, an unplug and a board reset, injected by the relay: the
    bridge's counters say exactly what was done, and every sample that crossed the wire intact is answered."""
    collector = Collector(broker, "#")
    board = make_board(kind, BoardOptions("f-1", rate_hz=60, count=100_000, reliable=False), board_data)
    address = f"{broker.host}:{broker.port}"
    try:
        with board, FrameRelay(board.url, seed=3) as relay:
            processes.append(start_daemon(collector, built_litert_bundle, broker, tmp_path / "state"))
            processes.append(
                bridge := Process("bridge", relay.url, "--broker", address, "--instance", "gw", "--status-interval",
                                  "0.3")
            )  # fmt: skip
            wait_until(lambda: relay.frames_passed > 30, 30, "frames through the relay")

            def link() -> dict[str, Any]:
                return dict(bridge_status(collector, "gw")["boards"][0])

            # what the start cost (samples before the HELLO): counted by a status that has the HELLO and frames after it
            wait_until(lambda: not link()["hello_pending"] and link()["samples"] > 10, 30, "samples after the HELLO")
            before = Counter(link()["refused_by_reason"])
            relay.garbage(3)
            relay.flip(2)
            relay.drop(4)
            relay.split(3)
            relay.merge(3)
            wait_until(lambda: relay.pending() == 0, 30, "faults injected")
            expected = Counter(cobs=3, crc=2)  # the garbage and the flipped frames; the others make gaps
            try:  # every fault read by the bridge before the unplug: a frame still in the port's buffer goes with it
                wait_until(lambda: Counter(link()["refused_by_reason"]) - before == expected, 30, "the faults refused")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {Counter(link()['refused_by_reason']) - before}") from None
            relay.unplug(1.5)
            wait_until(lambda: bridge_status(collector, "gw")["counts"]["serial_reopens"] == 1, 30, "reopened")
            passed = relay.frames_passed
            wait_until(lambda: relay.frames_passed > passed + 30, 30, "frames after the replug")
            lost = relay.lost_unplugged  # (the frames the relay drops once the bridge has stopped are no gap)
            faults = Counter(link()["refused_by_reason"]) - before
            # the HELLO_REQUEST of the reopen answered first: a reply that came after the reset would be a second
            # restart (an emulator on a busy machine can take seconds to read it)
            wait_until(lambda: not bridge_status(collector, "gw")["boards"][0]["hello_pending"], 30, "its HELLO")
            board.reset()
            wait_until(lambda: bridge_status(collector, "gw")["counts"]["serial_board_restarts"] == 1, 30, "reset")
            passed = relay.frames_passed
            wait_until(lambda: relay.frames_passed > passed + 30, 30, "frames after the reset")
            code, _, err = bridge.stop()
            assert code == 0, err[-3000:]
            # one log line per change of state: lost, failing to open (while unplugged), open again; and a restart
            said = [line.split(": ", 1)[-1] for line in err.splitlines() if "edgeline.bridge" in line]
            assert sum(" lost: " in line for line in said) == 1, said
            assert sum("retrying with back-off" in line for line in said) <= 1, said
            assert sum("open again" in line for line in said) == 1, said
            assert sum("restarted" in line for line in said) == 1, [line for line in said if "restarted" in line]
            final = final_bridge_status(collector, "gw")
            counts = final["counts"]
            by_reason = Counter(final["boards"][0]["refused_by_reason"]) - before
            try:
                wait_until(lambda: len(results_of(collector)) >= counts["published"], 30, "every sample answered")
            except AssertionError as exc:
                sent = [json.loads(p)["id"] for t, p, _ in list(collector.messages) if t.startswith("sensors/")]
                unanswered = sorted(set(sent) - set(results_of(collector)))
                raise AssertionError(
                    f"{exc}: {len(results_of(collector))} answered of {counts['published']} published; the broker "
                    f"carried {len(sent)} samples ({len(set(sent))} ids); unanswered {unanswered[:20]}"
                ) from None
            answered = len(results_of(collector))
    finally:
        collector.close()
    assert relay.injected["garbage"] == 3 and relay.injected["flip"] == 2 and relay.injected["drop"] == 4
    assert faults == {"cobs": 3, "crc": 2}
    # a reset can cut the frame on the wire (QEMU's UART): the board's first byte ends it, one refused frame at most
    assert by_reason - faults in (Counter(), Counter(cobs=1), Counter(crc=1), Counter(short=1)), by_reason
    assert counts["serial_refused"] == sum(before.values()) + sum(by_reason.values())
    assert counts["serial_crc_errors"] == before["crc"] + by_reason["crc"]
    assert counts["serial_sequence_gaps"] == 2 + 4 + lost  # the flipped frames, the dropped ones, the unplug's
    assert (counts["serial_board_restarts"], counts["serial_reopens"]) == (1, 1), counts
    assert counts["published"] == answered  # every sample that crossed the wire is answered, or said not to be:
    assert (
        counts["serial_samples"] == counts["published"] + counts["unpublished_at_stop"]
    )  # taken as the bridge stopped


@pytest.mark.integration
@BOARDS
def test_reliable_mode_loses_nothing_across_wire_faults_and_a_killed_bridge(
    kind: str, built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """Drops, bit flips, garbage, split and merged frames, then the bridge SIGKILLed mid-stream and another started:
    the board resends what was not acknowledged, and every one of its samples is answered. The board's own counters
    (its stats line, through the bridge's status) say how it went."""
    count = 150
    collector = Collector(broker, "edgeline/#")
    board = make_board(kind, BoardOptions("r-1", rate_hz=60, count=count, reliable=True), board_data)
    address = f"{broker.host}:{broker.port}"
    bridge_args = ("--broker", address, "--instance", "gw", "--status-interval", "0.3")

    def board_says() -> dict[str, Any]:
        status = retained_status(collector, "bridge/gw/status") or {}
        return (status.get("boards") or [{}])[0].get("board_stats") or {}

    try:
        with board, FrameRelay(board.url, seed=4) as relay:
            processes.append(start_daemon(collector, built_litert_bundle, broker, tmp_path / "state"))
            processes.append(first := Process("bridge", relay.url, *bridge_args))
            wait_until(lambda: board_says().get("acked", 0) > 20, 30, "first acks")
            relay.drop(3)
            relay.flip(2)
            relay.garbage(2)
            relay.split(2)
            relay.merge(3)
            wait_until(lambda: relay.pending() == 0, 30, "faults injected")
            wait_until(lambda: board_says().get("acked", 0) > 60, 30, "acks after the faults")
            first.process.kill()  # SIGKILL: whatever it held unacknowledged, the board resends
            first.process.communicate(timeout=TIMEOUT_S)
            time.sleep(0.5)
            processes.append(second := Process("bridge", relay.url, *bridge_args))
            try:
                wait_until(lambda: board_says().get("acked", 0) >= count and board_says()["done"], 90, "all acked")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {board_says()}; the bridge said {second.stop()[2][-3000:]}") from None
            stats = board_says()
            second.stop()
        wanted = {(1, seq) for seq in range(count)}
        with contextlib.suppress(AssertionError):  # said below, with what is missing
            wait_until(lambda: {parse_input_id(i) for i in results_of(collector)} >= wanted, 30, "answers")
    finally:
        collector.close()
    answered = {parse_input_id(identity) for identity in results_of(collector)}
    assert answered >= wanted, f"lost: {sorted(wanted - answered)}"
    assert stats["sent"] == stats["acked"] == count and stats["resent"] > 0, stats


class ScriptedBoard:
    """A board written out by hand on a loopback port: answers HELLO_REQUEST, sends what the test says, and keeps
    every frame the host sends it."""

    def __init__(self) -> None:
        import socket

        from edgeline.firmware_bridge.protocol import Decoder

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"socket://127.0.0.1:{self.listener.getsockname()[1]}"
        self.received: list[Frame] = []
        self.decoder = Decoder()
        self.conn: Any = None
        self.seq = 0
        self.clock = 1000
        self.hello = {**HELLO, "device": "s-1"}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(TIMEOUT_S)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(0.2)
        while True:
            try:
                data = self.conn.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            for frame in self.decoder.feed(data):
                self.received.append(frame)
                if frame.type == FrameType.HELLO_REQUEST:
                    self.send(FrameType.HELLO, 0, json.dumps(self.hello).encode())

    def send(self, kind: FrameType, stream: int, payload: bytes) -> None:
        self.clock += 1000
        self.conn.sendall(encode(Frame(kind, stream, self.seq, self.clock, payload)))
        self.seq += 1

    def restart(self) -> None:
        self.seq, self.clock = 0, 10  # a new boot: its clock starts again
        self.send(FrameType.HELLO, 0, json.dumps(self.hello).encode())

    def configs(self) -> list[dict[str, Any]]:
        return [json.loads(f.payload) for f in list(self.received) if f.type == FrameType.CONFIG]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


@pytest.mark.integration
def test_a_boards_own_results_go_up_and_an_operators_config_comes_down_again_after_a_restart(
    broker: Broker, processes: list[Process]
) -> None:
    """RESULT frames (a board that runs the model itself) are published to its results topic; a config retained on
    its config topic is sent down as a CONFIG frame when the bridge meets the board, and again when it restarts."""
    import paho.mqtt.publish as mqtt_publish

    setting = {"rate_hz": 2.5, "streams": {"1": False}}
    mqtt_publish.single(
        "boards/s-1/config", json.dumps(setting), qos=1, retain=True, hostname=broker.host, port=broker.port
    )
    collector = Collector(broker, "boards/#")
    board = ScriptedBoard()
    try:
        processes.append(
            bridge := Process("bridge", board.url, "--broker", f"{broker.host}:{broker.port}", "--instance", "gw",
                              "--status-interval", "0.3")
        )  # fmt: skip
        wait_until(lambda: board.configs() == [setting], 30, "the retained config sent down")
        record = {"id": "local-1", "label": "7", "score": 0.93, "model": "digits"}
        board.send(FrameType.RESULT, 1, json.dumps(record).encode())
        wait_until(lambda: any(t == "boards/s-1/digits/result" for t, _, _ in list(collector.messages)), 30, "result")
        board.restart()
        wait_until(lambda: board.configs() == [setting, setting], 30, "the config sent again after the restart")
        code, _, err = bridge.stop()
    finally:
        collector.close()
        board.close()
    assert code == 0, err[-3000:]
    published = [json.loads(p) for t, p, _ in collector.messages if t == "boards/s-1/digits/result"]
    assert published == [record]
