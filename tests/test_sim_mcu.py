"""The emulated sensor boards against a small host written here with the host's codec: the C firmware on QEMU's
mps2-an386 (edgeline.sim.mcu) and the same session in Python (edgeline.sim.board), checked alike.

A HELLO with the documented fields, SAMPLES equal to the .npz as little-endian float32, heartbeats each followed by
a stats line, HELLO_REQUEST answered, reliable mode's window resent unchanged while ACKs are withheld and finished once
they come, ANSWERs counted, CONFIG applied, and a reset seen as an unsolicited HELLO. The data is seeded random
digits-like images: scikit-learn is not in the device install.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import serial

from edgeline.cli import main
from edgeline.firmware_bridge.protocol import FLAG_ACK_REQUESTED, Decoder, Frame, FrameType, encode, pack_ack
from edgeline.sim.board import FIRMWARE, WINDOW, Board, BoardOptions, PythonBoard, Uart, load_board_samples
from edgeline.sim.mcu import EmulatedBoard, build_firmware, missing_tools

pytestmark = pytest.mark.device  # QEMU and gcc-arm-none-eabi come from scripts/setup.sh in both tiers

STORED = 12
"""Samples in the .npz: fewer than some counts below, so the boards loop over them."""
WAIT_S = 60.0
"""Hang guard of every wait here: none should come near it (10 s did, for the emulated board's 50 samples of one
second and two heartbeats, beside a whole suite on a machine at load 7)."""
BOARDS = ["qemu", "python"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("digits")
    x = (np.random.default_rng(23).integers(0, 17, size=(STORED, 1, 8, 8)) / 16).astype(np.float32)
    np.savez(root / "validation.npz", x=x, labels=np.arange(STORED) % 10)
    return root / "validation.npz", x


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcu-builds")


@pytest.fixture
def make_board(images: tuple[Path, np.ndarray], build_dir: Path) -> Iterator[Callable[..., Board]]:
    started: list[Board] = []

    def make(kind: str, uart: Uart = Uart.SOCKET, **settings: object) -> Board:
        options = BoardOptions(**settings)  # type: ignore[arg-type]
        if kind == "qemu":
            missing = missing_tools()
            assert not missing, f"{', '.join(missing)} missing: scripts/setup.sh installs gcc-arm-none-eabi and qemu"
            board: Board = EmulatedBoard(options, images[0], uart, build_dir)
        else:
            board = PythonBoard(options, images[0], uart)
        started.append(board)
        board.start()
        return board

    yield make
    for board in started:
        board.stop()


class Host:
    """The host's side, as small as a test can have it: pyserial, the codec, every frame kept."""

    def __init__(self, url: str) -> None:
        self.port = serial.serial_for_url(url, timeout=0.02)
        self.decoder = Decoder()
        self.frames: list[Frame] = []

    def send(self, kind: FrameType, stream: int = 0, seq: int = 0, payload: bytes = b"", flags: int = 0) -> None:
        self.port.write(encode(Frame(kind, stream, seq, 0, payload, flags)))

    def ack(self, seq: int) -> None:
        self.send(FrameType.ACK, payload=pack_ack(1, seq))

    def until(self, done: Callable[[list[Frame]], bool], what: str, timeout: float = WAIT_S) -> list[Frame]:
        """Read frames until ``done(frames since the call)``; fails naming ``what`` after ``timeout`` seconds."""
        start = len(self.frames)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.frames += self.decoder.feed(self.port.read(4096))
            if done(self.frames[start:]):
                return self.frames[start:]
        kinds = [(FrameType(f.type).name, f.stream, f.seq) for f in self.frames[start:]][-20:]
        raise AssertionError(f"no {what} in {timeout:g} s; last frames: {kinds}; refused: {self.decoder.refused}")

    def close(self) -> None:
        self.port.close()


@pytest.fixture
def connect() -> Iterator[Callable[[str], Host]]:
    hosts: list[Host] = []

    def make(url: str) -> Host:
        hosts.append(Host(url))
        return hosts[-1]

    yield make
    for host in hosts:
        host.close()


def of(kind: FrameType, frames: list[Frame]) -> list[Frame]:
    return [frame for frame in frames if frame.type == kind]


def hello(frame: Frame) -> dict[str, object]:
    assert frame.type == FrameType.HELLO and frame.stream == 0
    document: dict[str, object] = json.loads(frame.payload)
    return document


def settle(host: Host) -> None:
    """Read up to a HELLO the host asked for: a boot HELLO sent before the host connected (or waiting in the
    socket since) is behind it, and ``since_boot`` after a reset finds that reset's HELLO, not the first boot's."""
    host.send(FrameType.HELLO_REQUEST)
    host.until(lambda fs: any(f.seq != 0 for f in of(FrameType.HELLO, fs)), "HELLO, asked for")


def stats_after(host: Host, check: Callable[[dict[str, object]], bool], what: str) -> dict[str, object]:
    """The first stats line from now on that passes ``check``."""
    found: list[dict[str, object]] = []

    def seen(frames: list[Frame]) -> bool:
        for frame in of(FrameType.LOG, frames)[len(found) :]:
            assert frame.payload.startswith(b"stats "), frame.payload
            found.append(json.loads(frame.payload[len(b"stats ") :]))
        return any(check(stats) for stats in found)

    host.until(seen, what)
    return next(stats for stats in found if check(stats))


def since_boot(frames: list[Frame]) -> list[Frame]:
    """The frames from a (re)boot's HELLO on: the first HELLO of a control stream starting over at 0."""
    boots = [i for i, f in enumerate(frames) if f.type == FrameType.HELLO and f.seq == 0]
    return frames[boots[0] :] if boots else []


def samples_from(frames: list[Frame], first: int, count: int) -> dict[int, Frame]:
    return {f.seq: f for f in of(FrameType.SAMPLES, frames) if first <= f.seq < first + count}


@pytest.mark.integration
@pytest.mark.parametrize("kind", BOARDS)
def test_a_board_says_hello_streams_its_samples_and_counts_answers(
    kind: str, make_board: Callable[..., Board], connect: Callable[[str], Host], images: tuple[Path, np.ndarray]
) -> None:
    count = STORED + 3
    board = make_board(kind, device="mcu-7", rate_hz=40.0, count=count)
    host = connect(board.url)
    host.send(FrameType.HELLO_REQUEST)
    frames = host.until(lambda fs: any(f.seq != 0 for f in of(FrameType.HELLO, fs)), "HELLO, asked for")
    asked = hello(next(f for f in of(FrameType.HELLO, frames) if f.seq != 0))  # (not a boot HELLO: control seq 0)
    assert asked["device"] == "mcu-7" and asked["firmware"] == FIRMWARE and asked["protocol"] == 1
    assert asked["boot"] == 0  # the first boot of this board
    (stream,) = asked["streams"]  # type: ignore[misc]
    assert {k: v for k, v in stream.items() if k != "seq"} == {
        "id": 1, "name": "digits", "dtype": "f32", "shape": [1, 8, 8], "rate_hz": 40.0,
    }  # fmt: skip
    assert isinstance(stream["seq"], int)

    # a reset: the board starts over with an unsolicited HELLO, and every sample comes while the host listens
    board.reset()
    frames = since_boot(
        host.until(lambda fs: len(samples_from(since_boot(fs), 0, count)) == count, f"{count} samples after reset")
    )
    boot = hello(frames[0])  # a fresh control stream (seq 0) and a fresh data stream
    assert boot["streams"][0]["seq"] == 0  # type: ignore[index]
    assert boot["boot"] == 1  # its count of boots survived the reset (RAM the reset leaves alone)
    sent = samples_from(frames, 0, count)
    for seq, frame in sent.items():
        assert frame.stream == 1 and frame.flags == 0
        assert frame.payload == images[1][seq % STORED].astype("<f4").tobytes()  # looping over the stored samples
    times = [sent[seq].t_us for seq in range(count)]
    period_us = 1_000_000 // 40
    # paced, by count on the board's own clock: in any stretch of the stream, no more samples than its periods allow
    # plus the one a late wake-up sends at once (the boards' schedule moves on by a period and never falls more than
    # one behind, so a stall is never caught up by a burst). How late samples come is not checked: on a busy machine
    # that is the machine's speed, not the board's pacing.
    early = [
        (j, k) for j, k in itertools.combinations(range(count), 2) if times[k] - times[j] < (k - j - 2) * period_us
    ]
    assert not early, (early, times)

    for seq in (0, 1, 1, 2):  # one answered twice: four answers, three inputs answered
        host.send(FrameType.ANSWER, stream=1, seq=seq, payload=b'{"id": "x", "result": 1}')
    stats = stats_after(host, lambda stats: stats["answers"] == 4, "stats counting 4 answers")
    assert stats == {"sent": count, "resent": 0, "acked": 0, "answers": 4, "answered": 3, "hello": 1, "refused": 0,
                     "done": True}  # fmt: skip
    beats = host.until(lambda frames: len(of(FrameType.LOG, frames)) >= 2, "two more heartbeats")
    kinds = [frame.type for frame in beats if frame.stream == 0]
    assert kinds[kinds.index(FrameType.HEARTBEAT) + 1] == FrameType.LOG  # a stats line follows each heartbeat
    beat_times = [frame.t_us for frame in of(FrameType.HEARTBEAT, host.frames)[-2:]]
    assert (beat_times[1] - beat_times[0]) / 1e6 > 0.8  # one a second at most (late ones on a busy machine are fine)


@pytest.mark.integration
@pytest.mark.parametrize("kind", BOARDS)
def test_reliable_mode_resends_the_window_until_acked_then_finishes(
    kind: str, make_board: Callable[..., Board], connect: Callable[[str], Host]
) -> None:
    count = 12
    board = make_board(kind, rate_hz=100.0, count=count, reliable=True)
    host = connect(board.url)
    settle(host)
    board.reset()

    # no ACK: the window fills, nothing past it is sent, and after 500 ms the whole window comes again, unchanged
    def resent_twice(frames: list[Frame]) -> bool:
        return sum(f.seq == WINDOW - 1 for f in of(FrameType.SAMPLES, since_boot(frames))) >= 2

    frames = since_boot(host.until(resent_twice, "the window resent"))
    samples = of(FrameType.SAMPLES, frames)
    assert max(f.seq for f in samples) == WINDOW - 1
    first = samples[:WINDOW]
    assert [f.seq for f in first] == list(range(WINDOW)) and all(f.flags & FLAG_ACK_REQUESTED for f in first)
    assert samples[WINDOW : 2 * WINDOW] == first  # go-back-N: the same frames, byte for byte (t_us included)

    # a HELLO_REQUEST: a HELLO giving the oldest unacknowledged seq, then the window again
    host.send(FrameType.HELLO_REQUEST)
    frames = host.until(lambda fs: bool(of(FrameType.HELLO, fs)) and len(of(FrameType.SAMPLES, fs)) >= WINDOW, "HELLO")
    assert hello(of(FrameType.HELLO, frames)[0])["streams"][0]["seq"] == 0  # type: ignore[index]

    # ACK up to 3: four places free, and seq 8 ... 11 come; then ACK all and the board is done
    host.ack(3)
    host.until(lambda fs: any(f.seq == count - 1 for f in of(FrameType.SAMPLES, fs)), "the last sample")
    host.ack(count - 1)
    stats = stats_after(host, lambda stats: stats["done"] is True, "done")
    assert stats["sent"] == count and stats["acked"] == count
    assert isinstance(stats["resent"], int) and stats["resent"] >= 2 * WINDOW
    host.send(FrameType.HELLO_REQUEST)
    frames = host.until(lambda fs: bool(of(FrameType.HELLO, fs)), "HELLO when done")
    assert hello(of(FrameType.HELLO, frames)[0])["streams"][0]["seq"] == count  # type: ignore[index]


@pytest.mark.integration
@pytest.mark.parametrize("kind", BOARDS)
def test_config_sets_the_rate_and_turns_the_stream_off(
    kind: str, make_board: Callable[..., Board], connect: Callable[[str], Host]
) -> None:
    board = make_board(kind, rate_hz=1.0, count=10_000)
    host = connect(board.url)
    host.send(FrameType.CONFIG, payload=b'{"rate_hz": 50.0}', flags=FLAG_ACK_REQUESTED, seq=5)
    host.send(FrameType.HELLO_REQUEST)

    def a_second_at_50_hz(fs: list[Frame]) -> bool:
        """Counted between two heartbeats (a second of the board's clock, however slow the machine): more than 10
        samples, where 1 Hz sends at most 2."""
        beats = [i for i, f in enumerate(fs) if f.type == FrameType.HEARTBEAT]
        return any(len(of(FrameType.SAMPLES, fs[a:b])) > 10 for a, b in itertools.pairwise(beats))

    frames = host.until(a_second_at_50_hz, "a board second at 50 Hz")
    assert hello(of(FrameType.HELLO, frames)[-1])["streams"][0]["rate_hz"] == 50.0  # type: ignore[index]  # (the last: a boot HELLO may come first)
    assert of(FrameType.ACK, frames)[0].payload == pack_ack(0, 5)  # a host's frame asking for an ACK gets one
    host.send(FrameType.CONFIG, payload=b'{"rate_hz": -1}')
    host.until(lambda fs: any(f.payload.startswith(b"config refused") for f in of(FrameType.LOG, fs)), "a refusal")
    host.send(FrameType.CONFIG, payload=b'{"streams": {"1": false}}')
    frames = host.until(lambda fs: len(of(FrameType.HEARTBEAT, fs)) >= 2, "two heartbeats")
    beats = [i for i, f in enumerate(frames) if f.type == FrameType.HEARTBEAT]
    assert not of(FrameType.SAMPLES, frames[beats[0] : beats[1]])  # a whole second without a sample


@pytest.mark.integration
@pytest.mark.parametrize("kind", BOARDS)
def test_a_board_on_a_pty(kind: str, make_board: Callable[..., Board], connect: Callable[[str], Host]) -> None:
    board = make_board(kind, Uart.PTY, count=3)
    assert board.url.startswith("/dev/pts/")
    host = connect(board.url)
    host.send(FrameType.HELLO_REQUEST)
    host.until(lambda fs: bool(of(FrameType.HELLO, fs)), "HELLO on the pty")


@pytest.mark.integration
def test_both_boards_send_the_same_hello_and_stats(
    make_board: Callable[..., Board], connect: Callable[[str], Host]
) -> None:
    said = []
    for kind in BOARDS:
        # reliable: the one sample is resent until acknowledged, so it comes even if sent before the host connected
        host = connect(make_board(kind, rate_hz=2.5, count=1, reliable=True).url)
        host.until(lambda fs: bool(of(FrameType.SAMPLES, fs)), "its one sample")
        host.send(FrameType.HELLO_REQUEST)
        frames = host.until(lambda fs: bool(of(FrameType.HELLO, fs) and of(FrameType.LOG, fs)), "HELLO and stats")
        said.append((of(FrameType.HELLO, frames)[0].payload, json.loads(of(FrameType.LOG, frames)[0].payload[6:])))
    assert said[0][0] == said[1][0]
    assert list(said[0][1]) == list(said[1][1])


@pytest.mark.integration
def test_firmware_builds_are_cached_by_settings_and_data(
    images: tuple[Path, np.ndarray], build_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiles: list[list[str]] = []
    real_run = subprocess.run

    def counted(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        compiles.append(command)  # a spy: the real compiler still runs
        return real_run(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", counted)  # what edgeline.sim.mcu calls
    samples = load_board_samples(images[0])
    options = BoardOptions(device="cache-1", count=5)
    first = build_firmware(options, samples, build_dir)
    already = len(compiles)  # 0 when an earlier test built the same firmware into this cache, else 1
    assert build_firmware(options, samples, build_dir) == first
    assert len(compiles) == already  # from the cache: the compiler did not run
    assert build_firmware(BoardOptions(device="cache-1", count=6), samples, build_dir) != first
    assert len(compiles) == already + 1
    other = tmp_path / "other.npz"
    np.savez(other, x=images[1][:3])
    assert build_firmware(options, load_board_samples(other), build_dir) != first


@pytest.mark.integration
@pytest.mark.parametrize("kind", BOARDS)
def test_sim_mcu_command_prints_where_the_board_is(
    kind: str, images: tuple[Path, np.ndarray], build_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "mcu", "--board", kind, "--data", str(images[0]), "--for", "0.5", "--build-dir", str(build_dir)]
    assert main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    described = "QEMU mps2-an386, Cortex-M4" if kind == "qemu" else "Python board"
    assert line.startswith(f"board mcu-1 ({described}) on socket://127.0.0.1:")


@pytest.mark.quick
def test_sim_mcu_deaf_makes_a_board_that_never_reads_and_says_so(
    images: tuple[Path, np.ndarray], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--deaf` reaches the board (the firmware's -DDEAF=1, the Python board's never-read loop) and its line says it."""
    from edgeline.sim import board as boards

    made: list[boards.BoardOptions] = []
    real = boards.PythonBoard.__init__

    def keep(self: Any, options: boards.BoardOptions, *args: Any, **kwargs: Any) -> None:
        made.append(options)
        real(self, options, *args, **kwargs)

    monkeypatch.setattr(boards.PythonBoard, "__init__", keep)
    argv = ["sim", "mcu", "--board", "python", "--deaf", "--data", str(images[0]), "--for", "0.2"]
    assert main(argv) == 0
    assert [options.deaf for options in made] == [True]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("board mcu-1 (Python board, deaf: it never reads its RX line) on socket://127.0.0.1:")


@pytest.mark.quick
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rate", "0"], "--rate 0: a board sends between 0.001 and 100000 Hz"),
        (["--rate", "1.0005"], "at most three decimals"),
        (["--count", "0"], "argument --count: 0 is out of range"),
        (["--device", "a/b"], "board device id 'a/b'"),
        (["--board", "fpga"], "invalid choice: 'fpga'"),
        (["--for", "-1"], "--for -1: seconds above 0"),
        ([], "no data to replay"),
    ],
)
def test_sim_mcu_user_errors(
    argv: list[str], expected: str, images: tuple[Path, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    data = [] if not argv else ["--data", str(images[0])]
    assert main(["sim", "mcu", "--board", "python", *data, *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeline sim mcu: error: "), err
    assert expected in lines[0]
