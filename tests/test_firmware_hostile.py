"""The firmware bridge's link layer against hostile and deaf boards (issue 34, part A): real pseudo-terminals, a real
Mosquitto, the Python board and the C firmware on QEMU's Cortex-M4, and a board written out by hand for frames no
honest board sends.

    a HELLO whose shape overflows int64          refused; neither `run` nor `bridge` loses its link
    a device named with a NUL or a control char  refused; the bridge's MQTT connection and its other boards go on
    an exception while serving a board           said once with the board and the traceback, counted, port reopened
    a board that never reads its RX line         every input still answered on MQTT; what cannot be written is
                                                 dropped, counted (answers_unsent), said once
    NaN and Inf samples                          answered non-finite
    a frame far behind, a sequence jump          a repeat; gaps counted again from the jump
    a flood of LOG frames                        a few lines, not one per frame
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import tty
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.firmware_bridge.link import Board, BoardLink, StreamSpec, name_problem, parse_hello, parse_input_id
from edgeline.firmware_bridge.protocol import Decoder, Frame, FrameError, FrameType, encode
from edgeline.sim.board import BoardOptions, BoardSamples, PythonBoard, Uart
from tests import waiting
from tests.mqtt_broker import Broker, Collector
from tests.test_firmware_bridge import HELLO, Process, results_of, retained_status, start_daemon
from tests.test_firmware_bridge import processes as processes  # the same fixture: the processes a test started

TIMEOUT_S = 60.0
wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)
HUGE_SHAPE = [4611686018427387904, 4]
"""2**62 * 4 wraps to 0 in int64: numpy's product says this shape holds no values at all."""
SAMPLE = np.arange(64, dtype="<f4").tobytes()


def hello(**change: Any) -> dict[str, Any]:
    return {**HELLO, "device": "h-1", **change}


def stream(**change: Any) -> dict[str, Any]:
    streams: list[dict[str, Any]] = HELLO["streams"]  # type: ignore[assignment]
    return {**streams[0], "seq": 0, **change}


# -- the rules, in process ---------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("shape", [HUGE_SHAPE, [2**32, 2**32], [2**63, 2]])
def test_a_shape_is_checked_with_python_integers_against_the_frame_size(shape: list[int]) -> None:
    with pytest.raises(FrameError, match=r"shape .* fits in a frame"):
        parse_hello(json.dumps(hello(streams=[stream(shape=shape)])).encode())


@pytest.mark.quick
@pytest.mark.parametrize(
    "name", ["a\x00b", "a\x01b", "a\x7fb", "a\u0085b", "a\ufffeb", "a\U0010ffff", "a/b", "+", "#", ""]
)
def test_a_name_the_broker_would_refuse_is_refused_as_device_stream_and_board(name: str) -> None:
    assert name_problem(name) is not None
    with pytest.raises(FrameError, match="device"):
        parse_hello(json.dumps(hello(device=name)).encode())
    with pytest.raises(FrameError, match=r"streams\[0\]\.name"):
        parse_hello(json.dumps(hello(streams=[stream(name=name)])).encode())
    with pytest.raises(FrameError, match="device"):  # no way around it: a Board is checked when it is made
        Board(name, "fw", {})
    with pytest.raises(FrameError, match="stream name"):
        StreamSpec(1, name, np.dtype("<f4"), (1,), None, None)
    assert name_problem("pump-7.é_日本") is None


@pytest.mark.quick
def test_sequence_gaps_count_a_frame_behind_as_a_repeat_and_take_up_after_a_jump() -> None:
    from edgeline.firmware_bridge.protocol import SequenceGaps

    gaps = SequenceGaps()
    lost = [gaps.observe(1, seq) for seq in (10, 11, 5, 12, 40000, 40001, 40003, 40004, 30000, 40005)]
    assert lost == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0] and gaps.repeats == 3  # 5, 40000 and 30000: each behind
    # 40001 followed 40000: the stream jumped there. 40005 follows 40004, not 30000: a replay, the stream stays
    assert [gaps.observe(1, seq) for seq in (65535, 0, 2)] == [25529, 0, 1]  # wrapping: 0 follows 65535


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full: the next byte written waits for a read, as a board's port that stopped reading."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        while True:
            os.write(write_fd, b"\x00" * 65536)
    except BlockingIOError:
        return read_fd, write_fd


@pytest.mark.quick
def test_a_board_that_reads_slowly_takes_a_frame_longer_than_the_write_timeout_and_a_deaf_one_none() -> None:
    """The write timeout bounds the time a port takes no byte, not the whole frame: a board that reads slower than
    the frame comes (or an emulated one a busy machine runs late) is not taken for a deaf one, whose frames are
    dropped once the port took nothing for the timeout."""
    from edgeline.firmware_bridge.link import FRAME_WRITE_TURNS, _writer

    timeout_s, chunk, pause_s = 1.0, 4096, 0.2  # a read every 0.2 s: 5 within each timeout, the frame takes ~2 s
    frame = b"\x01" * (chunk * 10)
    read_fd, write_fd = _full_pipe()
    stop, reads = threading.Event(), []

    def slow_reader() -> None:
        while not stop.wait(pause_s):
            reads.append(len(os.read(read_fd, chunk)))

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    try:
        assert _writer(_Fd(write_fd), timeout_s)(frame) is True
    finally:
        stop.set()
        reader.join(5)
        os.close(read_fd), os.close(write_fd)
    # the writer needed the reads of more than one timeout (else it would prove nothing) and fewer than its cap
    assert chunk * 10 / chunk <= len(reads) and len(reads) * pause_s > timeout_s, reads
    assert len(reads) * pause_s < FRAME_WRITE_TURNS * timeout_s, reads

    read_fd, write_fd = _full_pipe()  # nobody reads: the frame is not written, and the writer returns
    try:
        assert _writer(_Fd(write_fd), 0.3)(frame) is False
    finally:
        os.close(read_fd), os.close(write_fd)


# -- a board written out by hand, on a pty -----------------------------------------------------------------------


class PtyBoard:
    """A board on a pseudo-terminal that sends what the test says: it answers each HELLO_REQUEST with ``hello``
    and keeps every frame the host sends it."""

    def __init__(self, hello: dict[str, Any]) -> None:
        self.hello = hello
        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)
        self.url = os.ttyname(self.slave)
        self.received: list[Frame] = []
        self.control_seq = 0
        self.clock_us = 1000
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = Decoder()
        while not self._stopping.is_set():
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if not ready:
                continue
            try:
                data = os.read(self.master, 4096)
            except OSError:  # no host has the pty open right now
                self._stopping.wait(0.05)
                continue
            for frame in decoder.feed(data):
                self.received.append(frame)
                if frame.type == FrameType.HELLO_REQUEST:
                    self.say_hello()

    def say_hello(self) -> None:
        self.control(FrameType.HELLO, json.dumps(self.hello).encode())

    def control(self, kind: FrameType, payload: bytes = b"") -> None:
        with self._lock:
            seq, self.control_seq = self.control_seq, self.control_seq + 1
        self.send(Frame(kind, 0, seq, 0, payload))

    def samples(self, seq: int, payload: bytes = SAMPLE) -> None:
        self.send(Frame(FrameType.SAMPLES, 1, seq, 0, payload))

    def send(self, frame: Frame) -> None:
        with self._lock:
            self.clock_us += 1000
            data = encode(Frame(frame.type, frame.stream, frame.seq, self.clock_us, frame.payload, frame.flags))
            while data:  # bounded by the host reading: the test's timeout ends it otherwise
                _, ready, _ = select.select([], [self.master], [], TIMEOUT_S)
                assert ready, "the host read nothing for a minute"
                data = data[os.write(self.master, data) :]

    def answers(self) -> list[Frame]:
        return [f for f in list(self.received) if f.type == FrameType.ANSWER]

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(5.0)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def pty_board() -> Iterator[Callable[[dict[str, Any]], PtyBoard]]:
    made: list[PtyBoard] = []

    def make(hello: dict[str, Any]) -> PtyBoard:
        made.append(board := PtyBoard(hello))
        return board

    yield make
    for board in made:
        board.close()


def run_daemon(bundle: Path, url: str, broker: Broker, tmp_path: Path) -> Process:
    """`edgeline run BUNDLE --serial URL --serial-protocol frames`, answers on MQTT, a status every 0.3 s."""
    config = tmp_path / "daemon.toml"
    config.write_text(
        f'[broker]\nhost = "{broker.host}"\nport = {broker.port}\n[output]\nmqtt = true\n'
        '[health]\nstatus_interval_s = 0.3\nstatus_topic = "edgeline/{name}/status"\n'
    )
    return Process("run", str(bundle), "--serial", url, "--serial-protocol", "frames", "--config", str(config),
                   "--state-dir", str(tmp_path / "state"))  # fmt: skip


def daemon_counts(collector: Collector) -> dict[str, Any]:
    """The counts of the daemon's last status message."""
    return dict((retained_status(collector, "/status") or {}).get("counts") or {})


# -- one frame must not stop a host ------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("command", ["run", "bridge"])
def test_a_hello_whose_shape_overflows_is_refused_and_the_link_goes_on(
    command: str, built_litert_bundle: Path, broker: Broker, tmp_path: Path, processes: list[Process],
    pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """The HELLO passed (numpy's product wrapped to 0) and the next SAMPLES raised ZeroDivisionError: `run` exited 1,
    `bridge` lived on with a dead link. Now the HELLO is refused, the SAMPLES after it too, and once the board says
    a HELLO that holds, its samples are answered back down, by the same process, on the same port."""
    collector = Collector(broker, "#")
    board = pty_board(hello(streams=[stream(shape=HUGE_SHAPE)]))
    address = f"{broker.host}:{broker.port}"
    try:
        if command == "run":
            processes.append(host := run_daemon(built_litert_bundle, board.url, broker, tmp_path))
        else:
            processes.append(start_daemon(collector, built_litert_bundle, broker, tmp_path / "state"))
            processes.append(host := Process("bridge", board.url, "--broker", address, "--instance", "gw"))
        assert wait_until(lambda: any(f.type == FrameType.HELLO_REQUEST for f in list(board.received))), "no host"
        board.samples(0, b"\x00" * 64)  # what raised ZeroDivisionError: a whole number of no-byte samples?
        board.hello = hello()
        board.say_hello()
        board.samples(1)
        answered = wait_until(lambda: any(f.seq == 1 for f in board.answers()))
        alive = host.process.poll() is None
        code, _, err = host.stop()
    finally:
        collector.close()
    assert alive and answered, err[-3000:]
    assert code == 0, err[-3000:]
    assert "HELLO refused" in err and "shape" in err and "Traceback" not in err, err[-3000:]


@pytest.mark.integration
def test_a_device_named_with_a_nul_is_refused_and_the_other_boards_go_on(
    built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process],
    pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """A HELLO's device "a\\0b" was accepted; the bridge subscribed to a topic holding it, Mosquitto closed the
    connection for a malformed packet, again at every reconnection: no board of the bridge got an answer back. Now
    that HELLO is refused, and the honest board beside it is answered, every sample."""
    count = 20
    collector = Collector(broker, "#")
    hostile = pty_board(hello(device="a\x00b"))
    honest = PythonBoard(BoardOptions("ok-1", rate_hz=50, count=count, reliable=True), board_data, Uart.PTY)
    try:
        with honest:
            processes.append(start_daemon(collector, built_litert_bundle, broker, tmp_path / "state"))
            processes.append(
                bridge := Process("bridge", hostile.url, honest.url, "--broker", f"{broker.host}:{broker.port}",
                                  "--instance", "gw", "--status-interval", "0.3")
            )  # fmt: skip
            session = honest.session
            assert session is not None
            answered = wait_until(lambda: session.stats()["answered"] >= count)
            stats = session.stats()
            code, _, err = bridge.stop()
    finally:
        collector.close()
    assert answered, f"{stats}; the bridge said {err[-3000:]}"
    assert code == 0, err[-3000:]
    assert "HELLO refused: device 'a\\x00b'" in err, err[-3000:]
    status = retained_status(collector, "bridge/gw/status")
    assert status is not None
    assert status["boards"][0]["refused_by_reason"]["hello"] >= 1 and status["boards"][0]["device"] is None
    assert status["counts"]["answers_routed"] == count


class FailsOnce:
    """A handler with a bug that the board's first SAMPLES frame meets (as the shape's ZeroDivisionError was)."""

    def __init__(self) -> None:
        self.samples: list[int] = []

    def on_hello(self, link: BoardLink, board: Board, restarted: bool) -> None:
        pass

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        self.samples.append(frame.seq)
        if len(self.samples) == 1:
            raise ZeroDivisionError("integer division or modulo by zero")

    def on_result(self, link: BoardLink, board: Board, frame: Frame, record: dict[str, Any]) -> None:
        pass


@pytest.mark.integration
def test_an_exception_while_serving_a_board_is_said_once_counted_and_the_port_reopened(
    board_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Any exception in a link: logged with the board and its traceback, once; counted (link_errors); the port
    reopened with back-off; the board's later samples taken. Before, the exception ended the link's thread."""
    handler = FailsOnce()
    stopping = threading.Event()
    with PythonBoard(BoardOptions("x-1", rate_hz=50, count=1000), board_data, Uart.PTY) as board:
        link = BoardLink(board.url, handler)
        ended: list[BaseException | None] = []

        def serve() -> None:
            try:
                link.run(stopping)
                ended.append(None)
            except BaseException as exc:
                ended.append(exc)

        thread = threading.Thread(target=serve, daemon=True)
        with caplog.at_level(logging.ERROR, logger="edgeline.bridge"):
            thread.start()
            try:
                taken = wait_until(lambda: len(handler.samples) > 5 or ended)
            finally:
                stopping.set()
                thread.join(10.0)
    assert ended == [None] and taken, ended
    assert link.counters.link_errors == 1 and link.counters.reopens == 1, link.counters
    said = [r for r in caplog.records if "link failed" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None, [r.getMessage() for r in caplog.records]
    assert "board x-1" in said[0].getMessage() and "ZeroDivisionError" in said[0].getMessage()


class EndsAtOnce(BoardLink):
    """A link that ends without being asked to (a bug beyond what its top loop takes): a fault put in on purpose."""

    def run(self, stopping: threading.Event) -> None:
        return


@pytest.mark.integration
def test_a_bridge_whose_link_ended_exits_non_zero_rather_than_live_on_without_it(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A bridge whose link thread had died went on running, its port never read again. Now it stops, exit 1."""
    from edgeline.daemon.config import BrokerAddress
    from edgeline.firmware_bridge.bridge import Bridge, BridgeOptions

    bridge = Bridge(["test://a"], BrokerAddress(broker.host, broker.port), BridgeOptions(instance="ends"))
    bridge.links[0] = EndsAtOnce("test://a", bridge)
    stopping = threading.Event()
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(bridge.run(stopping)), daemon=True)
    with caplog.at_level(logging.CRITICAL, logger="edgeline.bridge"):
        thread.start()
        thread.join(TIMEOUT_S)
        stopping.set()  # (before the fix it ran on: stop it)
        thread.join(TIMEOUT_S)
    assert code == [1], "the bridge ran on without its link"
    assert any("the link of test://a ended" in r.getMessage() for r in caplog.records)


# -- a board that never reads must not stall the pipeline --------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["python", "qemu"])
def test_a_board_that_never_reads_gets_every_input_answered_on_mqtt(
    kind: str, built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """A board that never reads its RX line, on a pty (it boots after the host: its boot HELLO is all the host
    learns of it): once the pty's buffer is full the host's writes find no room. The daemon stopped after 40
    answers, saying nothing; now every input is answered on MQTT, the answers the board could not take are dropped
    and counted (answers_unsent), and that is said once."""
    count = 300
    options = BoardOptions("deaf-1", rate_hz=100, count=count, deaf=True)
    if kind == "qemu":
        from edgeline.sim.mcu import EmulatedBoard

        board: Any = EmulatedBoard(options, board_data, Uart.PTY)
    else:
        board = PythonBoard(options, board_data, Uart.PTY)
    collector = Collector(broker, "edgeline/#")
    wanted = {(1, seq) for seq in range(count)}
    try:
        with board:
            processes.append(daemon := run_daemon(built_litert_bundle, board.url, broker, tmp_path))
            assert wait_until(lambda: ((retained_status(collector, "/status") or {}).get("source") or {}).get(
                "connected"))  # fmt: skip
            board.reset()  # it boots after the host: its HELLO at boot is heard (it never hears a HELLO_REQUEST)
            answered = wait_until(lambda: {parse_input_id(i) for i in results_of(collector)} >= wanted, timeout=120)
            reconciled = wait_until(
                lambda: (
                    (c := daemon_counts(collector)).get("serial_answers_sent", 0) + c.get("serial_answers_unsent", 0)
                    >= count
                )
            )
            alive = daemon.process.poll() is None
            counts = daemon_counts(collector)
            code, _, err = daemon.stop()
    finally:
        collector.close()
    got = {parse_input_id(i) for i in results_of(collector)}
    assert answered and alive, f"{len(got & wanted)} of {count} answered; {counts}; {err[-3000:]}"
    assert code == 0, err[-3000:]
    assert reconciled and counts["serial_answers_unsent"] > 0, counts
    assert counts["serial_answers_sent"] + counts["serial_answers_unsent"] == count, counts
    said = [line for line in err.splitlines() if "does not read" in line]
    assert len(said) == 1, said


@pytest.mark.integration
def test_a_board_that_never_reads_on_a_bridge_never_holds_up_the_other_boards(
    built_litert_bundle: Path, board_data: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """One bridge, two boards: one never reads its RX line, the other reads. Each board has its own queue and writer,
    so the reading board gets every answer while the deaf one's port is full, and every input of the deaf one is
    still answered on MQTT, what could not be written to it counted (answers_unsent)."""
    count = 300
    deaf = PythonBoard(BoardOptions("deaf-2", rate_hz=100, count=count, deaf=True), board_data, Uart.PTY)
    hearing = PythonBoard(BoardOptions("hearing-1", rate_hz=100, count=count, reliable=True), board_data, Uart.PTY)
    # (reliable: what it sends before the bridge opens its port is sent again, not lost before the test starts)
    collector = Collector(broker, "edgeline/#")
    wanted = {(1, seq) for seq in range(count)}

    def boards() -> dict[str, dict[str, Any]]:
        status = retained_status(collector, "edgeline/bridge/gw/status") or {}
        return {str(b.get("device")): b for b in status.get("boards") or []}

    try:
        with deaf, hearing:
            processes.append(start_daemon(collector, built_litert_bundle, broker, tmp_path / "state"))
            processes.append(gateway := Process("bridge", deaf.url, hearing.url, "--broker", broker.address,
                                                "--instance", "gw", "--status-interval", "0.3"))  # fmt: skip
            assert wait_until(lambda: (s := retained_status(collector, "edgeline/bridge/gw/status")) is not None
                              and all(b.get("connected") for b in s.get("boards") or [{}]))  # fmt: skip
            deaf.reset()  # it boots after the host: its HELLO at boot is heard (it never hears a HELLO_REQUEST)
            heard = wait_until(lambda: (boards().get("hearing-1", {}).get("board_stats") or {}).get("answered", 0)
                               >= count, timeout=120)  # fmt: skip
            answered = wait_until(
                lambda: {parse_input_id(i) for i, r in results_of(collector).items() if r.get("device") == "deaf-2"}
                >= wanted, timeout=120,
            )  # fmt: skip
            reconciled = wait_until(
                lambda: (b := boards().get("deaf-2", {})).get("answers_sent", 0) + b.get("answers_unsent", 0) >= count
            )
            found = boards()
            code, _, err = gateway.stop()
    finally:
        collector.close()
    assert heard, f"the reading board: {found.get('hearing-1')}"
    assert answered, f"the deaf board's inputs not all answered on MQTT: {found.get('deaf-2')}"
    assert code == 0, err[-3000:]
    deaf_link, hearing_link = found["deaf-2"], found["hearing-1"]
    assert reconciled and deaf_link["answers_unsent"] > 0, deaf_link
    assert deaf_link["answers_sent"] + deaf_link["answers_unsent"] == count, deaf_link
    assert hearing_link["answers_unsent"] == 0 and hearing_link["board_stats"]["answered"] == count, hearing_link
    assert sum("does not read" in line for line in err.splitlines()) <= 3, err[-3000:]  # said, not once per frame


# -- smaller -----------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_nan_and_inf_samples_are_answered_non_finite(
    built_litert_bundle: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """The documented answer to NaN or Inf is non-finite; the board's samples were written as JSON null and
    answered wrong-dtype."""
    rows = [np.full((1, 8, 8), 0.5, "<f4") for _ in range(4)]
    rows[1][0, 3, 3] = np.nan
    rows[2][0, 0, 7] = -np.inf
    samples = BoardSamples(tuple(r.tobytes() for r in rows), (1, 8, 8), "test")
    collector = Collector(broker, "edgeline/#")
    try:
        with PythonBoard(BoardOptions("nan-1", rate_hz=50, count=4, reliable=True), samples, Uart.PTY) as board:
            processes.append(daemon := run_daemon(built_litert_bundle, board.url, broker, tmp_path))
            assert wait_until(lambda: len(results_of(collector)) >= 4), results_of(collector)
            daemon.stop()
    finally:
        collector.close()
    by_seq = {parse_input_id(i): record for i, record in results_of(collector).items()}
    codes = {seq: (by_seq.get((1, seq)) or {}).get("error", {}).get("code") for seq in range(4)}
    assert codes == {0: None, 1: "non-finite", 2: "non-finite", 3: None}, by_seq
    assert "outputs" in by_seq[(1, 0)] and "outputs" in by_seq[(1, 3)]


@pytest.mark.integration
def test_a_frame_far_behind_is_a_repeat_and_gaps_are_counted_again_after_a_jump(
    built_litert_bundle: Path, broker: Broker, tmp_path: Path, processes: list[Process],
    pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """10, 11, then 5 (behind: a replay, a repeat), 12, then 40000 (more than half the sequence space on: behind, a
    repeat), 40001 (it follows: the stream jumped), 40003 (one lost: a gap). Before, repeats stayed 0 and, after
    the jump, every frame was behind, and no gap was ever counted again."""
    collector = Collector(broker, "edgeline/#")
    board = pty_board(hello())
    try:
        processes.append(daemon := run_daemon(built_litert_bundle, board.url, broker, tmp_path))
        assert wait_until(lambda: any(f.type == FrameType.HELLO_REQUEST for f in list(board.received)))
        sequence = [10, 11, 5, 12, 40000, 40001, 40003]
        for seq in sequence:
            board.samples(seq)
        taken = wait_until(lambda: daemon_counts(collector).get("serial_samples") == len(sequence))
        counts = daemon_counts(collector)
        daemon.stop()
    finally:
        collector.close()
    assert taken, counts
    assert (counts["serial_repeats"], counts["serial_sequence_gaps"]) == (2, 1), counts


@pytest.mark.integration
def test_a_flood_of_log_frames_is_rate_limited(
    built_litert_bundle: Path, broker: Broker, tmp_path: Path, processes: list[Process],
    pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """1,000 LOG frames gave 1,000 INFO lines; now the first is said, the rest counted."""
    collector = Collector(broker, "edgeline/#")
    board = pty_board(hello())
    try:
        processes.append(daemon := run_daemon(built_litert_bundle, board.url, broker, tmp_path))
        assert wait_until(lambda: any(f.type == FrameType.HELLO_REQUEST for f in list(board.received)))
        for index in range(1000):
            board.control(FrameType.LOG, f"sensor warm-up {index}".encode())
        taken = wait_until(lambda: daemon_counts(collector).get("serial_frames", 0) >= 1001)
        _, _, err = daemon.stop()
    finally:
        collector.close()
    said = [line for line in err.splitlines() if "sensor warm-up" in line]
    assert said and len(said) <= 2, f"{len(said)} lines: {said[:5]}"  # (1,000 lines filled the stderr pipe, too)
    assert "sensor warm-up 0" in said[0] and taken


@pytest.fixture(scope="module")
def board_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("board") / "validation.npz"
    np.savez(path, x=rng.random((16, 1, 8, 8), dtype=np.float32), labels=np.arange(16) % 10)
    return path
