"""The serial link (``edgeline.firmware_bridge.link``) against hostile and unlucky boards: boards written out by hand
(``tests.serial_faults``: a go-back-N board without I/O, served on a pseudo-terminal), the link in process, and
``edgeline run --serial-protocol frames`` with a real Mosquitto.

    a HELLO without "seq", its first frame damaged or   the start is learned, never assumed: no ACK covers a sample
    out of order                                        not taken, every sample answered
    a board that restarted without "boot"               its previous boot's answers are not sent down as its new
                                                        frames' answers (answers_stale)
    a board that reads, 2,000 frames back to back       every answer written down, none dropped at the queue
    a flood of HELLOs (restarts, names, refusals)       a bounded number of log lines; counts exact
    control characters in anything a board sends        escaped: no forged line, no escape sequence in the log
    two openers of one port                             the second refused, naming the holder; it takes no frame,
                                                        and gets the port once the first lets it go
    a new device name in every HELLO                    at most MAX_DEVICE_NAMES names per port; the rest refused
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.daemon.messages import Answer, Message
from edgeline.firmware_bridge.link import BoardLink, parse_input_id
from edgeline.firmware_bridge.protocol import FLAG_ACK_REQUESTED, Frame, FrameType, encode
from tests import waiting
from tests.mqtt_broker import Broker, Collector
from tests.serial_faults import GoBackBoard, PtyPeer
from tests.test_firmware_bridge import HELLO, Process, Recorder, Wire, make_link, results_of
from tests.test_firmware_bridge import processes as processes  # the same fixture: the processes a test started
from tests.test_firmware_hostile import daemon_counts, run_daemon

TIMEOUT_S = 60.0
wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)
SAMPLE = np.arange(64, dtype="<f4").tobytes()


def hello_frame(seq: int = 0, t_us: int = 1000, **change: Any) -> bytes:
    return encode(Frame(FrameType.HELLO, 0, seq, t_us, json.dumps({**HELLO, **change}).encode()))


def samples(seq: int, t_us: int = 2000, reliable: bool = False) -> bytes:
    return encode(Frame(FrameType.SAMPLES, 1, seq, t_us, SAMPLE, FLAG_ACK_REQUESTED if reliable else 0))


def log_lines(caplog: pytest.LogCaptureFixture, containing: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records if containing in r.getMessage()]


# -- 1. an ACK never covers a sample the host has not taken ----------------------------------------------------------


def drive(board: GoBackBoard, rounds: int = 80) -> tuple[BoardLink, Recorder, Wire]:
    """The link and ``board`` talk until the board is done or ``rounds`` pass: what the link writes goes to the board,
    what the board writes to the link; when neither has anything to say, the board's resend timeout passes. Every
    sample taken is made safe at once (as the daemon's outbox would)."""
    link, recorder, wire = make_link()
    seen = made_safe = 0
    for _ in range(rounds):
        frames = wire.frames[seen:]
        seen += len(frames)
        data = board.take(frames)
        if not data:
            if board.done:
                break
            data = board.resend()
        link._take(data)
        for _, _, safe in recorder.samples[made_safe:]:
            for call in safe:
                call()
        made_safe = len(recorder.samples)
    return link, recorder, wire


def hello_requests(wire: Wire) -> int:
    return sum(f.type == FrameType.HELLO_REQUEST for f in wire.frames)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("case", "fault", "requests"),
    [
        ("the HELLO says seq", {"say_seq": True, "damaged": {0}}, 1),
        ("no seq, nothing wrong", {}, 2),
        ("no seq, first frame a CRC error", {"damaged": {0}}, 3),
        ("no seq, out of order", {"order": [1, 0]}, 3),
        ("no seq, two frames damaged", {"damaged": {0, 1}}, 3),
    ],
)
def test_the_start_of_a_stream_is_learned_never_assumed(case: str, fault: dict[str, Any], requests: int) -> None:
    """Without "seq" in the HELLO the link took the first frame it saw as the start: frame 0 with a CRC error, then
    1-7 taken and ACK 7, which told the board 0 was safe: lost. Now nothing is taken or acknowledged on a stream
    until its start is learned from the board's go-back after a HELLO the link asked for, with nothing refused in
    between, and confirmed by a second one. What it costs: a round trip or two (HELLO_REQUESTs counted)."""
    board = GoBackBoard(10, **{"say_seq": False, **fault})
    _, recorder, wire = drive(board)
    taken = [seq for seq, _, _ in recorder.samples]
    assert taken == list(range(10)), f"{case}: taken {taken}, acknowledged {sorted(board.acked)}"
    assert board.acked == set(range(10)) and board.done, case
    assert hello_requests(wire) == requests, case


@pytest.mark.quick
def test_a_stream_whose_start_never_settles_takes_and_acknowledges_nothing_and_asks_a_bounded_number_of_times() -> None:
    """A board whose go-back always comes with a refused frame first: the start is never learned, so nothing is taken
    and nothing acknowledged (the board keeps its window: nothing lost), and the link asks again at most
    LEARN_ROUNDS times at once, then once per HELLO_RETRY_S (here no time passes: no more)."""
    from edgeline.firmware_bridge.link import LEARN_ROUNDS

    class Unlucky(GoBackBoard):
        def take(self, frames: Any) -> bytes:
            frames = list(frames)
            out = super().take(frames)
            asked = any(f.type == FrameType.HELLO_REQUEST for f in frames)
            return out.replace(b"\x00", b"\x00\x01\x02\x00", 1) if asked else out  # garbage after the HELLO

    board = Unlucky(10, say_seq=False)
    link, recorder, wire = drive(board, rounds=200)
    assert recorder.samples == [] and wire.acks() == [] and board.acked == set()
    assert hello_requests(wire) == 1 + LEARN_ROUNDS
    assert link.counters.refused["cobs"] == 1 + LEARN_ROUNDS and link.counters.start_unknown > 0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("case", "fault"),
    [("crc", {"damaged": {0}}), ("order", {"order": [1, 0]}), ("seq in the HELLO", {"say_seq": True, "damaged": {0}})],
)
def test_a_daemon_answers_every_sample_of_a_board_without_seq_whose_first_frame_is_unlucky(
    case: str, fault: dict[str, Any], built_litert_bundle: Path, broker: Broker, tmp_path: Path,
    processes: list[Process],
) -> None:  # fmt: skip
    """`edgeline run --serial-protocol frames` and a go-back-N board on a pty whose HELLO has no "seq": its first
    frame damaged (a CRC error), or its first two frames swapped. Before, frame 0 was acknowledged to the board and
    never answered. Now every frame acknowledged is answered: 10/10."""
    count = 10
    board = GoBackBoard(count, **{"say_seq": False, **fault})
    collector = Collector(broker, "edgeline/#")
    wanted = {(1, seq) for seq in range(count)}
    try:
        with PtyPeer(board, resend_s=0.5) as peer:
            processes.append(daemon := run_daemon(built_litert_bundle, peer.url, broker, tmp_path))
            acked = wait_until(lambda: board.done)
            answered = wait_until(lambda: {parse_input_id(i) for i in results_of(collector)} >= wanted)
            with peer.lock:
                acknowledged, down = set(board.acked), dict(board.answered)
            code, _, err = daemon.stop()
    finally:
        collector.close()
    got = {parse_input_id(i) for i in results_of(collector)}
    assert acked, f"{case}: acknowledged {sorted(acknowledged)}; {err[-3000:]}"
    assert answered and got == wanted, f"{case}: acknowledged {sorted(acknowledged)}, answered {sorted(got)}"
    assert code == 0, err[-3000:]
    assert set(down) == set(range(count)), down


# -- 2. a restart the link has seen ends every answer owed to the previous boot ------------------------------------


def an_answer(message: Message) -> list[Answer]:
    record = {"id": json.loads(message.payload)["id"], "label": "3"}
    return [Answer(None, json.dumps(record).encode(), record, False)]


@pytest.mark.quick
def test_answers_owed_to_a_boards_previous_boot_are_not_sent_down_to_its_new_one() -> None:
    """A board that restarts without "boot" in its HELLO sends frames with the same stream and seq again: the
    previous boot's 50 answers went down as the answers of the new boot's frames. The link counts the restart, so
    each answer carries the session of its input and one of another session is dropped, counted (answers_stale);
    the new boot's 50 answers go down."""
    from edgeline.firmware_bridge.source import FramesSource

    source = FramesSource("test://", baudrate=115200)
    link = source.link
    wire = Wire(link)
    link._port_for_writes = wire
    link.request_hello()
    submitted: list[Message] = []
    source._submit = submitted.append
    link._take(hello_frame(t_us=1000))
    first = link.session
    link._take(b"".join(samples(seq, t_us=2000 + seq) for seq in range(50)))
    link._take(hello_frame(t_us=10))  # not asked for, the clock gone back: it restarted
    assert link.session != first and link.counters.board_restarts == 1
    link._take(b"".join(samples(seq, t_us=20 + seq) for seq in range(50)))
    assert len(submitted) == 100
    for message in submitted[:50]:  # the previous boot's answers, late
        assert message.on_answers is not None
        message.on_answers(an_answer(message))
    assert [f for f in wire.frames if f.type == FrameType.ANSWER] == []
    assert link.counters.answers_stale == 50 and link.counters.as_dict()["answers_stale"] == 50
    for message in submitted[50:]:
        assert message.on_answers is not None
        message.on_answers(an_answer(message))
    down = [f for f in wire.frames if f.type == FrameType.ANSWER]
    assert [f.seq for f in down] == list(range(50)) and link.counters.answers_stale == 50
    assert all(json.loads(f.payload)["id"].endswith(f".{20 + f.seq}") for f in down)  # the new boot's inputs


@pytest.mark.quick
def test_an_answer_queued_before_a_restart_is_not_written_after_it() -> None:
    """The answer was queued for the board, the board restarted before the writer got to it: not written."""
    link, _, _ = make_link()
    written: list[bytes] = []
    link._write_port = lambda data: written.append(data) or True
    link._take(hello_frame(t_us=1000))
    session = link.session
    link._drop_queued()  # (the HELLO_REQUEST)
    assert link.answer(1, 7, b'{"id": "1.7.0.2000"}', session=session)
    link._take(hello_frame(t_us=10))  # it restarted
    while not link._downlink.empty():
        link._write(*link._downlink.get_nowait())
    assert written == [] and link.counters.answers_stale == 1 and link.counters.answers_sent == 0
    assert not link.answer(1, 7, b"{}", session=session)  # and one that comes later is not even queued
    assert link.counters.answers_stale == 2


# -- 3. a board that reads gets every answer ---------------------------------------------------------------------


class Listener:
    """A board that answers HELLO_REQUEST and counts the ANSWER frames it reads (its samples: the test's)."""

    def __init__(self) -> None:
        self.answered: dict[int, int] = {}
        self.asked = 0

    def take(self, frames: list[Frame]) -> bytes:
        out = []
        for frame in frames:
            if frame.type == FrameType.HELLO_REQUEST:
                self.asked += 1
                hello = {**HELLO, "device": "reader-1"}
                out.append(encode(Frame(FrameType.HELLO, 0, self.asked, self.asked, json.dumps(hello).encode())))
            elif frame.type == FrameType.ANSWER:
                self.answered[frame.seq] = self.answered.get(frame.seq, 0) + 1
        return b"".join(out)


@pytest.mark.integration
def test_a_board_that_reads_gets_every_answer_of_2000_frames_sent_back_to_back(
    built_litert_bundle: Path, broker: Broker, tmp_path: Path, processes: list[Process]
) -> None:
    """2,000 frames back to back from a board that reads its port at 1 Mbaud's pace: the daemon answered them
    faster than the port took the answers, and 713 of 2,000 were dropped at the 256-frame queue to the board. Now
    the source hands the daemon no more inputs than the queue has room for the answers of: 2,000 of 2,000."""
    count = 2000
    board = Listener()
    collector = Collector(broker, "edgeline/#")
    try:
        with PtyPeer(board, read_bytes_per_s=100_000) as peer:
            processes.append(daemon := run_daemon(built_litert_bundle, peer.url, broker, tmp_path))
            assert wait_until(lambda: board.asked >= 1)
            peer.send(b"".join(samples(seq, t_us=10_000 + seq) for seq in range(count)))
            settled = wait_until(
                lambda: (c := daemon_counts(collector)).get("serial_answers_sent", 0)
                + c.get("serial_answers_unsent", 0) >= count,
                timeout=120,
            )  # fmt: skip
            down = wait_until(lambda: len(board.answered) >= count or daemon.process.poll() is not None)
            counts = daemon_counts(collector)
            code, _, err = daemon.stop()
    finally:
        collector.close()
    assert settled and down, f"{len(board.answered)} answers read by the board; {counts}; {err[-3000:]}"
    assert code == 0, err[-3000:]
    assert (counts["serial_answers_sent"], counts["serial_answers_unsent"]) == (count, 0), counts
    assert sorted(board.answered) == list(range(count)) and set(board.answered.values()) == {1}
    assert len(results_of(collector)) == count


# -- 4. one rate limit for every line a board can cause; 5. nothing it sends forges a line -------------------------


@pytest.mark.quick
def test_a_flood_of_hellos_costs_a_bounded_number_of_log_lines_and_exact_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """10,002 unsolicited HELLOs in 5 s wrote 10,002 "restarted" lines; a board that renames itself at every HELLO
    a line each. Now each kind is said when it starts and summarised (edgeline.lograte.Repeated); the counters say
    how many."""
    link, recorder, _ = make_link()
    with caplog.at_level(logging.DEBUG, logger="edgeline.bridge"):
        link._take(hello_frame(t_us=1000))
        link._take(b"".join(hello_frame(t_us=2000 + i) for i in range(10_000)))  # none asked for: restarts
        for index in range(2000):  # asked for, and a name of two each time
            link.request_hello()
            link._take(hello_frame(t_us=20_000 + index, device=f"twin-{index % 2}"))
        link._take(b"".join(encode(Frame(FrameType.HELLO, 0, i, 30_000 + i, b"{not json")) for i in range(10_000)))
    assert link.counters.board_restarts == 10_000 and recorder.hellos.count(True) == 10_000
    assert link.counters.refused["hello"] == 10_000
    lines = log_lines(caplog)
    assert len(log_lines(caplog, "restarted")) <= 2, log_lines(caplog, "restarted")[:5]
    assert len([line for line in lines if "twin-" in line]) <= 4, [line for line in lines if "twin-" in line][:5]
    assert len(lines) <= 12, lines[:20]


@pytest.mark.quick
def test_what_a_board_sends_never_forges_a_log_line_or_an_escape_sequence(caplog: pytest.LogCaptureFixture) -> None:
    """A LOG line, the HELLO's firmware, a device or stream name, a refused HELLO, a RESULT: each reached the log
    as the board wrote it, so "\\nCRITICAL ..." made a line of its own and escape sequences reached the terminal.
    Now every text of the board's is quoted on one line, escaped (edgeline.lograte.shown), bounded."""
    from edgeline.firmware_bridge.source import FramesSource

    forged = "\nCRITICAL edgeline: forged\x1b[2J\x1b]0;owned\x07\u2028CRITICAL again\u202e"
    source = FramesSource("test://", baudrate=115200)
    link = source.link
    link._port_for_writes = Wire(link)
    with caplog.at_level(logging.DEBUG):
        link.request_hello()
        stream = {**HELLO["streams"][0], "name": "s\u2028CRITICAL\u202e"}  # type: ignore[index]
        link._take(hello_frame(device="pump\u2028CRITICAL x\u202e", firmware=forged, streams=[stream]))
        link._take(encode(Frame(FrameType.LOG, 0, 1, 2000, forged.encode())))
        link._take(encode(Frame(FrameType.LOG, 0, 2, 3000, ("stats {}" + forged).encode())))
        link._take(encode(Frame(FrameType.LOG, 0, 3, 4000, b'stats {"x": 1}\n' + forged.encode())))
        link._take(encode(Frame(FrameType.RESULT, 1, 0, 5000, json.dumps({"label": forged}).encode())))
        link._take(hello_frame(t_us=10, device="other\u2028CRITICAL", firmware=forged))  # a restart, renamed
        link._take(hello_frame(t_us=20, device="bad\nname", firmware=forged))  # refused
        link._take(hello_frame(t_us=30, protocol=forged))  # refused
    messages = [r.getMessage() for r in caplog.records]
    assert sum("forged" in m for m in messages) >= 3, messages  # said, escaped
    for message in messages:
        assert not any(c in message for c in "\n\r\x1b\x07\u2028\u202e"), repr(message)
        assert not message.startswith("CRITICAL"), repr(message)


# -- 6. one opener per port --------------------------------------------------------------------------------------


class Streamer:
    """A board that answers HELLO_REQUEST and sends one unreliable frame on every call after it (every 10 ms)."""

    def __init__(self) -> None:
        self.seq = 0
        self.started = False

    def take(self, frames: list[Frame]) -> bytes:
        out = []
        for frame in frames:
            if frame.type == FrameType.HELLO_REQUEST:
                self.started = True
                out.append(encode(Frame(FrameType.HELLO, 0, 0, 1, json.dumps(HELLO).encode())))
        if self.started:
            out.append(samples(self.seq % 65536, t_us=10 + self.seq))
            self.seq += 1
        return b"".join(out)


def serve(link: BoardLink) -> tuple[threading.Event, threading.Thread]:
    stopping = threading.Event()
    thread = threading.Thread(target=link.run, args=(stopping,), daemon=True)
    thread.start()
    return stopping, thread


@pytest.mark.integration
def test_a_second_opener_of_a_port_is_refused_naming_the_holder_takes_no_frame_and_gets_it_once_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two links on one port both opened it and split its frames between them. Now the port is opened exclusively
    (flock, as pyserial's exclusive=True and picocom): the second is refused with a line that names the port and
    the holder (pid, program), takes no frame, and retries with back-off, so it gets the port once the first lets
    go (a daemon restarted while the old one still held the port)."""
    with PtyPeer(Streamer()) as peer:
        first = BoardLink(peer.url, Recorder())
        first.open()
        second = BoardLink(peer.url, Recorder())
        with caplog.at_level(logging.INFO, logger="edgeline.bridge"):
            second.open()  # not an error: it waits for the port
            stop_first, first_thread = serve(first)
            stop_second, second_thread = serve(second)
            try:
                assert wait_until(lambda: first.counters.samples >= 100)
                stolen = second.counters.frames
                said = log_lines(caplog, "held by")
                stop_first.set()
                first_thread.join(10)
                taken = first.counters.samples
                freed = wait_until(lambda: second.counters.samples >= 20)
            finally:
                stop_first.set()
                stop_second.set()
                first_thread.join(10)
                second_thread.join(10)
    assert stolen == 0 and taken >= 100, (stolen, taken)
    assert len(said) == 1 and peer.url in said[0] and f"pid {os.getpid()}" in said[0], said
    assert freed, second.status()
    assert second.status()["held_by"] is None


@pytest.mark.quick
def test_loop_and_socket_urls_still_open() -> None:
    """The exclusive open is for device files: loop:// and socket:// open as before."""
    for url in ("loop://",):
        link = BoardLink(url, Recorder())
        link.open()
        link._port.close()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        link = BoardLink(f"socket://127.0.0.1:{listener.getsockname()[1]}", Recorder())
        link.open()
        link._port.close()


# -- 7. the names a port may take over its life --------------------------------------------------------------------


@pytest.mark.quick
def test_a_port_takes_a_bounded_number_of_device_names_over_its_life(caplog: pytest.LogCaptureFixture) -> None:
    """A HELLO flood with a new device name each time: every name was taken (the bridge grew from 58.6 to 84.6 MB
    over 10,000 names). Now a port takes at most MAX_DEVICE_NAMES names over its life; a HELLO with a new name past
    them is refused (counted under "names", said once), and the link's own state stays bounded."""
    from edgeline.firmware_bridge.link import MAX_DEVICE_NAMES

    link, recorder, _ = make_link()
    with caplog.at_level(logging.DEBUG, logger="edgeline.bridge"):
        for index in range(10_000):
            link.request_hello()
            link._take(hello_frame(t_us=1000 + index, device=f"name-{index}"))
        link.request_hello()
        link._take(hello_frame(t_us=20_000, device="name-3"))  # one it took before: taken again
    assert len(recorder.hellos) == MAX_DEVICE_NAMES + 1 and link.board is not None
    assert link.board.device == "name-3"
    assert link.counters.refused["names"] == 10_000 - MAX_DEVICE_NAMES
    assert len(link._device_names) == MAX_DEVICE_NAMES
    said = log_lines(caplog)
    assert len(log_lines(caplog, "names")) == 1 and len(said) <= MAX_DEVICE_NAMES + 4, said[-10:]
