"""`edgeline bridge` when the broker dies, when answers come twice, when a board floods HELLOs or restarts without
``boot``: nothing acknowledged to a board is lost, no answer goes down twice, the bridge and the broker stay bounded,
and what a board sends never writes a line of the bridge's log of its own.

The broker is a persistent Mosquitto SIGKILLed and restarted on its port with its database (``durable_broker``):
its PUBACK is not durable (it saves at the end of the pass, ``tests.mqtt_broker.Broker``), so a bridge that took
the broker's PUBACK for "safe" acknowledged to its boards samples that the kill then lost."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edgeline.daemon.config import BrokerAddress
from edgeline.firmware_bridge.bridge import Bridge, BridgeOptions
from edgeline.firmware_bridge.protocol import FLAG_ACK_REQUESTED, Frame, FrameType, encode
from edgeline.sim.board import BoardOptions, PythonBoard, Uart
from tests import test_firmware_bridge as end_to_end
from tests import test_firmware_hostile as hostile
from tests.mqtt_broker import Broker, Collector
from tests.test_firmware_bridge import HELLO, TIMEOUT_S, Process, Wire, samples_frame, stopped
from tests.test_firmware_hostile import PtyBoard
from tests.waiting import wait_until

pytestmark = pytest.mark.device

board_data = end_to_end.board_data
processes = end_to_end.processes
pty_board = hostile.pty_board


def start_daemon(bundle: Path, broker: Broker, state: Path) -> Process:
    """`edgeline run` (default topics, a persistent session), once it is online."""
    online = Collector(broker, "edgeline/+/+/availability")
    try:
        daemon = Process("run", str(bundle), "--broker", broker.address, "--state-dir", str(state))
        came = wait_until(lambda: b"online" in online.payloads or daemon.process.poll() is not None, TIMEOUT_S)
        assert came and daemon.process.poll() is None, f"the daemon did not come online: {daemon.stop()[2][-3000:]}"
    finally:
        online.close()
    return daemon


def final_status(broker: Broker, instance: str) -> dict[str, Any]:
    """The status a stopped bridge published last (retained)."""
    status = Collector(broker, f"edgeline/bridge/{instance}/status")
    try:
        assert wait_until(lambda: status.payloads, TIMEOUT_S), "no status from the bridge"
        said: dict[str, Any] = json.loads(status.payloads[-1])
    finally:
        status.close()
    return said


def board_stats(boards: list[PythonBoard]) -> list[dict[str, Any]]:
    return [dict(b.session.stats()) if b.session is not None else {} for b in boards]


# -- the rules, in process ---------------------------------------------------------------------------------------


@pytest.mark.quick
def test_a_reliable_sample_is_safe_at_its_answer_taken_again_when_not_answered_and_answered_once() -> None:
    from edgeline.firmware_bridge.window import Answer, AnswerWindow, Taken

    window = AnswerWindow(high_water=500, timeout_s=10.0, max_tracked=100, remember=8)
    acked: list[str] = []
    retaken: list[str] = []

    def retake(name: str) -> bool:
        retaken.append(name)
        return name != "gone"  # a board that restarted cannot send it again

    for name in ("a", "b", "gone"):
        taken, _ = window.take(name, "d", 0.0, safe=lambda name=name: acked.append(name),
                               retake=lambda name=name: retake(name))  # fmt: skip
        assert taken is Taken.NEW
        window.published(name)  # the broker's PUBACK: no promise, nothing acknowledged
    assert acked == [] and window.held == 3
    kind, arrived, safe = window.answer("a")
    assert (kind, arrived) == (Answer.FIRST, 0.0) and safe is not None and acked == []
    safe()
    assert acked == ["a"] and window.answer("a")[0] is Answer.DUPLICATE  # a redelivery: sent down once
    assert window.answer("earlier-run")[0] is Answer.LATE and window.answer("earlier-run")[0] is Answer.DUPLICATE
    assert window.retake_all() == 1 and retaken == ["b", "gone"] and window.in_flight == 2  # the broker came back
    taken, _ = window.take("b", "d", 5.0, safe=lambda: acked.append("b again"), retake=lambda: retake("b"))
    assert taken is Taken.AGAIN and window.in_flight == 2 and window.held == 1  # the resend, published again
    window.published("b", token="a PUBACK of another taking")
    assert window.held == 1
    left = window.expire_left(now=10.0)  # "gone" timed out; "b" was published again at 5.0
    assert (left.unanswered, left.retaken) == (1, 0) and retaken[-1] == "gone" and window.in_flight == 1
    assert window.expire_left(now=15.0).retaken == 1 and retaken[-1] == "b" and window.in_flight == 0
    assert window.take("a", "d", 20.0)[0] is Taken.ANSWERED  # a resend of a sample answered already
    for i in range(20):  # what is remembered is bounded
        window.answer(f"x{i}")
    assert window.remembered <= 8 and window.answer("a")[0] is Answer.LATE


def bridge_with_wire(boot: int | None) -> tuple[Bridge, Wire]:
    """A bridge (not started) whose one port is a ``Wire``: the link's frames are read by the test, its board is
    fed HELLO and SAMPLES frames through the link itself."""
    bridge = Bridge(["test://a"], BrokerAddress("127.0.0.1", 1), BridgeOptions(instance="gw"))
    link = bridge.links[0]
    wire = Wire(link)
    link._port_for_writes = wire
    link.request_hello()
    hello = {**HELLO, "device": "nb-1"} if boot is None else {**HELLO, "device": "nb-1", "boot": boot}
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 1000, json.dumps(hello).encode())))
    return bridge, wire


def answer_of(ident: str) -> bytes:
    return json.dumps({"id": ident, "device": "nb-1", "label": "3"}).encode()


@pytest.mark.quick
def test_an_answer_that_comes_twice_goes_down_once() -> None:
    """A QoS 1 redelivery after a broker restart, or a daemon's outbox sending again what the broker had: before,
    each copy went down to the board as an ANSWER frame."""
    bridge, wire = bridge_with_wire(boot=7)
    for _ in range(3):
        bridge._route(answer_of("1.5.0.100.7@gw:0"))
    answers = [f for f in wire.frames if f.type == FrameType.ANSWER]
    assert [(f.stream, f.seq) for f in answers] == [(1, 5)]
    counts = bridge.metrics.snapshot()["counts"]
    assert (counts["answers_routed"], counts["answers_duplicate"]) == (1, 2)


@pytest.mark.quick
def test_a_board_without_boot_gets_no_answer_of_its_previous_boot_after_a_restart_the_link_saw() -> None:
    """Without ``boot`` in its HELLO a board's inputs of two boots can have the same numbers: the input id carries
    the link's session (``@gw:0:SESSION``), and a restart ends every answer owed to the session before."""
    bridge, wire = bridge_with_wire(boot=None)
    link = bridge.links[0]
    link._take(samples_frame(5, t_us=2000))
    before = link.session
    old = f"1.5.0.2000@gw:0:{before}"
    link._take(encode(Frame(FrameType.HELLO, 0, 0, 10, json.dumps({**HELLO, "device": "nb-1"}).encode())))
    after = link.session
    assert after != before and link.counters.board_restarts == 1
    link._take(samples_frame(5, t_us=2000))  # the same stream, seq and clock as the input of the boot before
    bridge._route(answer_of(old))
    bridge._route(answer_of("1.5.0.2000@gw:0"))  # an id of before sessions were in ids: as a board with no boot
    bridge._route(answer_of(f"1.5.0.2000@gw:0:{after}"))
    answers = [json.loads(f.payload)["id"] for f in wire.frames if f.type == FrameType.ANSWER]
    assert answers == ["1.5.0.2000@gw:0", f"1.5.0.2000@gw:0:{after}"]
    assert bridge.metrics.snapshot()["counts"]["answers_earlier_boot"] == 1


@pytest.mark.quick
def test_a_name_let_go_has_its_claim_cleared_if_still_ours_and_claims_of_names_not_served_are_not_kept() -> None:
    from edgeline.firmware_bridge.claims import Claims

    sent: list[tuple[str, bytes]] = []
    served = {"a"}
    here = Claims("gw-a", lambda topic, payload: sent.append((topic, payload)), serves=served.__contains__)
    here.claim("a", "/dev/ttyACM0", None)
    here.received(*sent[-1])  # the broker sends each bridge its own claims too
    for index in range(100):  # every claim of the fleet comes on the subscription
        here.received(f"edgeline/board-claims/other-{index}", b'{"instance": "gw-b", "n": 1}')
    assert here.tracked == 2  # "a": claimed, and the broker's last word on it
    sent.clear()
    served.clear()
    assert here.forget("a") and sent == [("edgeline/board-claims/a", b"")] and here.tracked == 0
    served.add("b")
    here.claim("b", "/dev/ttyACM0", None)
    here.received("edgeline/board-claims/b", b'{"instance": "gw-b", "port": "/dev/ttyUSB0", "n": 3}')  # moved there
    sent.clear()
    served.clear()
    assert not here.forget("b") and sent == [] and here.tracked == 0  # the other bridge's claim stays


# -- the broker killed twice ---------------------------------------------------------------------------------------


BOARDS_KILLED = 3
SAMPLES_KILLED = 1500


@pytest.mark.integration
@pytest.mark.parametrize("run", [1, 2])
def test_no_sample_acknowledged_to_a_board_is_lost_and_no_answer_goes_down_twice_when_the_broker_is_killed_twice(
    run: int, built_litert_bundle: Path, board_data: Path, durable_broker: Broker, tmp_path: Path,
    processes: list[Process],
) -> None:  # fmt: skip
    """3 reliable boards, 1,500 samples each, the persistent broker SIGKILLed and restarted twice while they stream.
    Before: in one run of two a sample acknowledged to its board was never answered (the broker had PUBACKed it,
    then the kill lost it before its save), and every run sent 28-49 ANSWER frames twice per board (answers
    delivered again after the restart). Now every sample is answered once, and each board gets each answer once."""
    total = BOARDS_KILLED * SAMPLES_KILLED
    boards = [
        PythonBoard(BoardOptions(f"kill{run}-{i}", rate_hz=400, count=SAMPLES_KILLED, reliable=True), board_data,
                    Uart.SOCKET)
        for i in range(BOARDS_KILLED)
    ]  # fmt: skip
    try:
        for board in boards:
            board.start()
        processes.append(start_daemon(built_litert_bundle, durable_broker, tmp_path / "state"))
        processes.append(
            bridge := Process("bridge", *(b.url for b in boards), "--broker", durable_broker.address, "--instance",
                              f"gw{run}", "--status-interval", "0.5")
        )  # fmt: skip

        def answered() -> int:
            return sum(int(s.get("answered", 0)) for s in board_stats(boards))

        for mark in (total // 4, total // 2):
            assert wait_until(lambda mark=mark: answered() >= mark, TIMEOUT_S), board_stats(boards)
            durable_broker.kill()
            durable_broker.restart()

        def finished() -> bool:
            return all(s.get("done") and s.get("answered") == SAMPLES_KILLED for s in board_stats(boards))

        done = wait_until(finished, 180)
        code, _, err = bridge.stop()
        status = final_status(durable_broker, f"gw{run}")
        written = [int(board["answers_sent"]) for board in status["boards"]]
        # every ANSWER the bridge wrote has reached its board (a board reads its port up to the bridge's exit)
        wait_until(lambda: [s.get("answers") for s in board_stats(boards)] == written, TIMEOUT_S)
        stats = board_stats(boards)
    finally:
        for board in boards:
            board.stop()
    assert code == 0, err[-3000:]
    for said in stats:
        assert said["sent"] == said["acked"] == SAMPLES_KILLED, f"{stats}; done: {done}"
        assert said["answered"] == SAMPLES_KILLED, f"acknowledged and never answered: {stats}; {err[-2000:]}"
        assert said["answers"] == SAMPLES_KILLED, f"answers sent down twice: {stats}"
    samples = status["samples"]  # where every sample the bridge took went: each taking answered or taken again
    assert samples["in_flight"] == 0 and samples["answered"] == total, samples
    assert samples["sent"] == samples["answered"] + sum(samples["dropped"].values()), samples
    assert samples["dropped"]["unanswered"] == samples["dropped"]["publish_failed"] == 0, samples


# -- a board that restarts without boot ----------------------------------------------------------------------------


def bridge_status(collector: Collector, instance: str) -> dict[str, Any]:
    found = [p for t, p, _ in list(collector.messages) if t == f"edgeline/bridge/{instance}/status" and p]
    return json.loads(found[-1]) if found else {}


def counts_of(collector: Collector, instance: str) -> dict[str, Any]:
    return dict(bridge_status(collector, instance).get("counts") or {})


@pytest.mark.integration
def test_a_board_restarting_without_boot_gets_only_the_answers_to_its_new_inputs(
    built_litert_bundle: Path, broker: Broker, tmp_path: Path, processes: list[Process],
    pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """A board without ``boot`` sends 50 reliable samples; the daemon is stopped, so their answers come after the
    board restarted and sent 50 new ones from seq 0. Before, the 100 answers all went down (the board took its
    previous boot's answers for its new inputs'); now only the 50 of the new boot do."""
    count = 50
    samples = Collector(broker, "sensors/#")
    status = Collector(broker, "edgeline/bridge/#")
    board = pty_board(hostile.hello(device="nb-2", streams=[hostile.stream()]))  # no "boot"
    try:
        processes.append(daemon := start_daemon(built_litert_bundle, broker, tmp_path / "state"))
        processes.append(
            bridge := Process("bridge", board.url, "--broker", broker.address, "--instance", "gw", "--status-interval",
                              "0.3")
        )  # fmt: skip
        assert wait_until(lambda: counts_of(status, "gw").get("serial_frames", 0) >= 1, TIMEOUT_S), "no HELLO"

        def published() -> list[str]:
            return [json.loads(p)["id"] for t, p, _ in list(samples.messages) if t == "sensors/nb-2/digits"]

        with stopped(daemon):
            for seq in range(count):
                board.send(Frame(FrameType.SAMPLES, 1, seq, 0, hostile.SAMPLE, FLAG_ACK_REQUESTED))
            assert wait_until(lambda: len(published()) >= count, TIMEOUT_S), published()
            board.clock_us = 500  # it restarts: its clock starts again, its HELLO is not asked for
            board.say_hello()
            assert wait_until(lambda: counts_of(status, "gw").get("serial_board_restarts") == 1, TIMEOUT_S)
            for seq in range(count):
                board.send(Frame(FrameType.SAMPLES, 1, seq, 0, hostile.SAMPLE, FLAG_ACK_REQUESTED))
            assert wait_until(lambda: len(published()) >= 2 * count, TIMEOUT_S), published()

        def answered() -> int:
            counts = counts_of(status, "gw")
            return int(counts.get("answers_routed", 0)) + int(counts.get("answers_earlier_boot", 0))

        assert wait_until(lambda: answered() >= 2 * count, TIMEOUT_S), counts_of(status, "gw")
        code, _, err = bridge.stop()
    finally:
        samples.close()
        status.close()
    assert code == 0, err[-3000:]
    ids = published()
    first, second = ids[:count], ids[count:]
    down = [json.loads(f.payload)["id"] for f in board.answers()]
    assert sorted(down) == sorted(second), f"{len(down)} answers; of the boot before: {len(set(down) & set(first))}"
    assert counts_of(status, "gw")["answers_earlier_boot"] == count


# -- a HELLO flood -------------------------------------------------------------------------------------------------


def subscriptions_of(broker: Broker, client_id: str) -> set[str]:
    """The filters ``client_id`` holds now, from the broker's log of its SUBSCRIBEs and UNSUBSCRIBEs, in order."""
    held: set[str] = set()
    for line in broker.log_text().splitlines():
        words = line.partition(": ")[2].split(" ")
        if len(words) == 3 and words[0] == client_id and words[1].isdigit():
            held.add(words[2])
        elif len(words) == 2 and words[0] == client_id and "/" in words[1]:
            held.discard(words[1])
    return held


def retained_claims(broker: Broker) -> dict[str, bytes]:
    """The claims the broker keeps now: subscribed, then a marker published after it, which comes after them."""
    claims = Collector(broker, "edgeline/board-claims/#")
    try:
        import paho.mqtt.publish as mqtt_publish

        mqtt_publish.single("edgeline/board-claims/zz-marker", b"", qos=1, hostname=broker.host, port=broker.port)
        assert wait_until(lambda: any(t.endswith("zz-marker") for t, _, _ in list(claims.messages)), TIMEOUT_S)
        return {t: p for t, p, retained in list(claims.messages) if retained and p}
    finally:
        claims.close()


@pytest.mark.integration
def test_a_hello_flood_with_a_new_name_each_time_leaves_the_bridge_and_the_broker_bounded(
    broker: Broker, processes: list[Process], pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """A board that says a new device name at every HELLO: before, the bridge subscribed twice and claimed (retained)
    per name and kept each name for ever (10,000 names: the bridge from 58.6 to 84.6 MB, the broker from 8 to 29
    MB). Now a name no port serves any more is let go: its subscriptions, its claim, what the bridge kept for it."""
    import paho.mqtt.publish as mqtt_publish

    flood = 300
    mqtt_publish.single("boards/fl-0/config", json.dumps({"rate_hz": 3}), qos=1, retain=True, hostname=broker.host,
                        port=broker.port)  # fmt: skip
    status = Collector(broker, "edgeline/bridge/#")
    board = pty_board(hostile.hello(device="fl-0", streams=[hostile.stream()]))
    try:
        processes.append(
            bridge := Process("bridge", board.url, "--broker", broker.address, "--instance", "gw", "--status-interval",
                              "0.3")
        )  # fmt: skip

        def configs() -> int:
            return sum(f.type == FrameType.CONFIG for f in list(board.received))

        assert wait_until(lambda: configs() == 1, TIMEOUT_S), "the config of the first name was not sent down"
        for index in range(1, flood + 1):
            board.hello = hostile.hello(device=f"fl-{index}", streams=[hostile.stream()])
            board.say_hello()
        board.hello = hostile.hello(device="fl-0", streams=[hostile.stream()])  # back to its first name: the
        board.say_hello()  # config comes down again once every HELLO before it is handled
        assert wait_until(lambda: configs() == 2, TIMEOUT_S), counts_of(status, "gw")

        def bounded() -> bool:
            said = bridge_status(status, "gw")
            return bool(said.get("boards_known", flood) <= 1 and said.get("names_kept", flood) <= 8)

        kept = wait_until(bounded, TIMEOUT_S)  # names let go at the bridge's next tick
        wanted = {"edgeline/board-claims/+", "edgeline/+/fl-0/result", "boards/fl-0/config"}
        wait_until(lambda: subscriptions_of(broker, "edgeline-bridge-gw") == wanted, TIMEOUT_S)
        subscribed = subscriptions_of(broker, "edgeline-bridge-gw")
        wait_until(lambda: list(retained_claims(broker)) == ["edgeline/board-claims/fl-0"], TIMEOUT_S)
        claims = retained_claims(broker)
        said = bridge_status(status, "gw")
        code, _, err = bridge.stop()
    finally:
        status.close()
    assert code == 0, err[-3000:]
    assert kept, {k: said.get(k) for k in ("boards_known", "names_kept")}
    assert subscribed == wanted, f"{len(subscribed)} subscriptions, e.g. {sorted(subscribed)[:5]}"
    assert list(claims) == ["edgeline/board-claims/fl-0"], f"{len(claims)} claims, e.g. {sorted(claims)[:5]}"


# -- what a board makes the bridge log -------------------------------------------------------------------------------

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


@pytest.mark.integration
def test_a_flood_of_hellos_costs_the_bridge_a_bounded_number_of_log_lines(
    broker: Broker, processes: list[Process], pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """One port has a live board ``tw``; the board on the other says HELLO 1,200 times, as ``tw`` (a clone), as
    ``cf`` (restarting: its config is sent again each time) and as a new name. Before, each said a line or two (a
    third of them the bridge's own: "sent its config")."""
    import paho.mqtt.publish as mqtt_publish

    from edgeline.firmware_bridge.link import MAX_DEVICE_NAMES

    flood = 1200
    mqtt_publish.single("boards/cf/config", json.dumps({"rate_hz": 3}), qos=1, retain=True, hostname=broker.host,
                        port=broker.port)  # fmt: skip
    status = Collector(broker, "edgeline/bridge/#")
    live = pty_board(hostile.hello(device="tw", streams=[hostile.stream()]))
    flooding = pty_board(hostile.hello(device="cf", streams=[hostile.stream()]))
    try:
        processes.append(
            bridge := Process("bridge", live.url, flooding.url, "--broker", broker.address, "--instance", "gw",
                              "--status-interval", "0.3")
        )  # fmt: skip
        assert wait_until(lambda: any(f.type == FrameType.CONFIG for f in list(flooding.received)), TIMEOUT_S)
        for index in range(flood):
            name = ("tw", "cf", f"new-{index}")[index % 3]
            flooding.hello = hostile.hello(device=name, streams=[hostile.stream()])
            flooding.say_hello()
        flooding.hello = hostile.hello(device="cf", streams=[hostile.stream()])
        flooding.say_hello()
        frames = flood + 2
        assert wait_until(lambda: counts_of(status, "gw").get("serial_frames", 0) >= frames, TIMEOUT_S)
        code, _, err = bridge.stop()
    finally:
        status.close()
    assert code == 0, err[-3000:]
    lines = err.splitlines()
    for kind in ("sent its config", "two boards say they are"):  # the bridge's own: the first said, the rest counted
        assert sum(kind in line for line in lines) == 1, [line for line in lines if kind in line]
    # the link says each name a port took (at most MAX_DEVICE_NAMES) and the rest once, or once a minute; so does
    # the bridge (about 40 lines in all, whether 300 HELLOs or 1,200)
    assert len(lines) <= MAX_DEVICE_NAMES + 20, f"{len(lines)} lines:\n" + "\n".join(lines[:80])


@pytest.mark.integration
def test_what_a_board_sends_never_writes_a_line_or_a_control_character_of_its_own_into_the_bridges_log(
    broker: Broker, processes: list[Process], pty_board: Callable[[dict[str, Any]], PtyBoard],
) -> None:  # fmt: skip
    """A device name, a firmware, a LOG line and a config holding line breaks, escape sequences and C1 controls:
    every line of the log is a line the bridge wrote, quoting them escaped."""
    import paho.mqtt.publish as mqtt_publish

    device = "ev\u2028CRITICAL edgeline.bridge: forged\u202e"  # a name may hold these: they are not C0/C1 controls
    forged = "\n2026-01-01 00:00:00,000 CRITICAL edgeline.bridge: forged \x1b[2J\x1b]0;owned\x07\r\x85"
    config = json.dumps({"rate_hz": 3, "note": "\x85\x1b[31m\u2028"}, ensure_ascii=False)
    mqtt_publish.single(f"boards/{device}/config", config.encode(), qos=1, retain=True, hostname=broker.host,
                        port=broker.port)  # fmt: skip
    status = Collector(broker, "edgeline/bridge/#")
    board = pty_board(hostile.hello(device=device, firmware=f"fw{forged}", streams=[hostile.stream()]))
    try:
        processes.append(
            bridge := Process("bridge", board.url, "--broker", broker.address, "--instance", "gw", "--status-interval",
                              "0.3", "--log-level", "debug")
        )  # fmt: skip
        assert wait_until(lambda: any(f.type == FrameType.CONFIG for f in list(board.received)), TIMEOUT_S)
        board.control(FrameType.LOG, f"sensor says{forged}".encode())
        board.control(FrameType.LOG, b'stats {"x": "\\u001b[31m\\n"}')
        assert wait_until(lambda: counts_of(status, "gw").get("serial_frames", 0) >= 3, TIMEOUT_S)
        code, _, err = bridge.stop()
    finally:
        status.close()
    assert code == 0, err[-3000:]
    lines = err.split("\n")[:-1]
    assert lines and all(LOG_LINE.match(line) for line in lines), [line for line in lines if not LOG_LINE.match(line)]
    assert not [line for line in lines if line.startswith("2026-01-01 00:00:00,000")], "a line the board wrote"
    raw = sorted({repr(c) for line in lines for c in line if not c.isprintable()})
    assert not raw, f"raw {raw} in: " + "\n".join(line for line in lines if not line.isprintable())
