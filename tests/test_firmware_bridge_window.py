"""`edgeline bridge` against what a user runs: a stock Mosquitto (its default queue of 1,000 messages per client)
with a daemon slower than the boards, a bridge SIGKILLed while its answers are on their way, and two boards of one
name on two bridges. Every sample is answered or counted, never lost silently; a board gets only its own answers.

The daemon is made slower than the board by stopping it (SIGSTOP) until the broker has taken more than its queue
holds, then letting it go (SIGCONT): what a slow model does, without a timing that could decide the test."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgeline.firmware_bridge.bridge import Bridge, BridgeOptions
from edgeline.firmware_bridge.link import parse_hello
from edgeline.firmware_bridge.window import AnswerWindow
from edgeline.sim.board import WINDOW, BoardOptions, PythonBoard, Uart
from tests import test_firmware_bridge as end_to_end
from tests.mqtt_broker import Broker, Collector, free_port
from tests.serial_faults import FrameRelay
from tests.test_firmware_bridge import BOARDS, HELLO, TIMEOUT_S, Process, make_board, stopped
from tests.waiting import wait_until

pytestmark = pytest.mark.device

MAX_UNANSWERED = 500
board_data = end_to_end.board_data  # the same fixtures as the end-to-end tests
processes = end_to_end.processes


# -- the window's rules ------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_window_holds_acks_above_its_mark_and_releases_them_as_answers_come() -> None:
    window = AnswerWindow(high_water=2, timeout_s=10.0, max_tracked=100)
    acked: list[int] = []
    for i in range(4):
        window.enter(f"s{i}", "d", arrived=0.0)
        window.when_room(f"s{i}", lambda i=i: acked.append(i))
    assert acked == [0, 1] and window.full("d") and window.held == 2 and not window.full("other")
    window.enter("s0", "d", arrived=0.0)  # a resend of a sample in the window: not counted twice
    assert window.in_flight == 4
    assert window.answered("s0") == 0.0 and acked == [0, 1]  # 3 unanswered: still above the mark
    assert window.answered("s0") is None  # a second answer
    window.forget("s1")  # the broker refused it
    assert acked == [0, 1, 2, 3] and window.held == 0
    assert window.expire(now=5.0) == 0 and window.expire(now=10.0) == 2 and window.in_flight == 0
    for i in range(3):  # boards whose daemon is not known yet share one window, moved to the daemon once known
        window.enter(f"u{i}", "unknown", arrived=20.0)
        window.when_room(f"u{i}", lambda i=i: acked.append(10 + i))
    window.enter("k0", "daemon a", arrived=20.0)
    window.rekey("unknown", "daemon a")
    assert window.full("daemon a") and not window.full("unknown") and window.held == 1 and acked[-2:] == [10, 11]
    window.answered("k0")
    assert window.held == 1  # 3 in the window of daemon a: above the mark
    window.answered("u0")
    assert acked[-1] == 12 and window.held == 0 and window.in_flight == 2


@pytest.mark.quick
def test_an_answer_goes_only_to_this_bridges_board_of_its_boot_and_waits_for_its_hello() -> None:
    from edgeline.daemon.config import BrokerAddress

    bridge = Bridge(["test://a"], BrokerAddress("127.0.0.1", 1), BridgeOptions(instance="gw"))
    link = bridge.links[0]
    written: list[tuple[int, int]] = []
    link.answer = lambda stream, seq, payload: written.append((stream, seq)) or True  # type: ignore[method-assign]

    def answer(ident: str) -> bytes:
        return json.dumps({"id": ident, "device": "b-1", "label": "3"}).encode()

    bridge._route(answer("1.5.0.100.7@gw:0"))  # before the board's HELLO: kept
    assert written == [] and bridge.metrics.snapshot()["counts"]["answers_before_hello"] == 1
    board = parse_hello(json.dumps({**HELLO, "boot": 7}).encode())
    link.board = board
    bridge.on_hello(link, board, False)
    assert written == [(1, 5)]
    bridge._route(answer("1.6.0.100.7@other-bridge"))  # the twin's input, on another bridge
    bridge._route(answer("1.6.0.100.6@gw:0"))  # its previous boot's input
    bridge._route(answer("1.6.0.100.7@gw:0"))
    counts = bridge.metrics.snapshot()["counts"]
    assert written == [(1, 5), (1, 6)]
    assert (counts["answers_other_bridge"], counts["answers_earlier_boot"], counts["answers_routed"]) == (1, 1, 2)


@pytest.mark.quick
def test_twin_boards_on_one_bridge_each_get_only_the_answers_to_their_own_inputs() -> None:
    """A cloned image on two ports of one bridge: one name, one boot number. The input ids name the port
    (``@INSTANCE:PORT``), so each board gets the answers to its own inputs, never its twin's."""
    from edgeline.daemon.config import BrokerAddress

    bridge = Bridge(["test://a", "test://b"], BrokerAddress("127.0.0.1", 1), BridgeOptions(instance="gw"))
    written: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for port, link in enumerate(bridge.links):
        link.answer = lambda stream, seq, payload, port=port: written[port].append((stream, seq)) or True  # type: ignore[method-assign]
        link.board = board = parse_hello(json.dumps({**HELLO, "boot": 7}).encode())
        bridge.on_hello(link, board, False)

    def answer(ident: str) -> bytes:
        return json.dumps({"id": ident, "device": board.device, "label": "3"}).encode()

    bridge._route(answer("1.5.0.100.7@gw:0"))
    bridge._route(answer("1.5.0.230.7@gw:1"))  # the twin's input of the same stream and seq
    bridge._route(answer("1.6.0.300.7@gw:1"))
    bridge._route(answer("1.6.0.300.7@gw:2"))  # no such port here
    assert written == {0: [(1, 5)], 1: [(1, 5), (1, 6)]}
    assert bridge.metrics.snapshot()["counts"]["answers_other_bridge"] == 1


@pytest.mark.quick
def test_a_claim_of_another_bridge_is_a_twin_once_it_changes_a_retained_one_alone_is_not() -> None:
    from edgeline.firmware_bridge.claims import Claims

    sent: list[tuple[str, bytes]] = []
    here, there = Claims("gw-a", lambda t, p: sent.append((t, p))), Claims("gw-b", lambda t, p: sent.append((t, p)))
    there.claim("twin", "/dev/ttyACM0", 0)
    assert here.received(*sent[-1]) is None  # the first seen may be a retained claim of a bridge gone since
    there.claim("twin", "/dev/ttyACM0", 0)
    assert here.received(*sent[-1]) == ("twin", "gw-b", "/dev/ttyACM0")
    here.claim("twin", "/dev/ttyUSB1", 0)
    assert here.received(*sent[-1]) is None and here.received(sent[-1][0], b"not json") is None


@pytest.mark.quick
def test_a_stopping_bridge_clears_only_the_claims_that_are_still_its_own() -> None:
    from edgeline.firmware_bridge.claims import Claims

    sent: list[tuple[str, bytes]] = []
    here, there = Claims("gw-a", lambda t, p: sent.append((t, p))), Claims("gw-b", lambda t, p: sent.append((t, p)))
    here.claim("moved", "/dev/ttyACM0", 0)
    here.claim("kept", "/dev/ttyACM1", 0)
    for claim in list(sent):  # the broker sends each bridge every claim, its own included
        here.received(*claim)
    there.claim("moved", "/dev/ttyUSB0", 1)  # the board moved to the other bridge, which claims it now
    here.received(*sent[-1])
    sent.clear()
    assert here.release() == 1 and sent == [("edgeline/board-claims/kept", b"")]
    here.received(*sent[-1])  # the broker's cleared claim: nothing left to release
    assert here.release() == 0


# -- end to end ----------------------------------------------------------------------------------------------


class Watch:
    """The daemon's availability and the bridges' status and claims: the few messages a test reads on a stock
    broker (a subscriber of every sample would itself be a slow client of its queue)."""

    def __init__(self, broker: Broker) -> None:
        self.online = Collector(broker, "edgeline/+/+/availability")
        self.bridges = Collector(broker, "edgeline/bridge/#")

    def daemon_online(self) -> bool:
        return any(p == b"online" and "/bridge/" not in t for t, p, _ in list(self.online.messages))

    def status(self, instance: str) -> dict[str, Any]:
        found = [p for t, p, _ in list(self.bridges.messages) if t == f"edgeline/bridge/{instance}/status"]
        return json.loads(found[-1]) if found else {}

    def counts(self, instance: str) -> dict[str, Any]:
        return dict(self.status(instance).get("counts") or {})

    def board_stats(self, instance: str) -> dict[str, Any]:
        boards = self.status(instance).get("boards") or [{}]
        return dict(boards[0].get("board_stats") or {})

    def close(self) -> None:
        self.online.close()
        self.bridges.close()


@pytest.fixture
def watch(stock_broker: Broker) -> Iterator[Watch]:
    watching = Watch(stock_broker)
    yield watching
    watching.close()


def start_daemon(bundle: Path, broker: Broker, state: Path, watch: Watch) -> Process:
    daemon = Process("run", str(bundle), "--broker", broker.address, "--state-dir", str(state))
    assert wait_until(watch.daemon_online, TIMEOUT_S), "the daemon did not come online"
    return daemon


def bridge(url: str, broker: Broker, instance: str, *more: str) -> Process:
    return Process("bridge", url, "--broker", broker.address, "--instance", instance, "--status-interval", "0.3",
                   "--max-unanswered", str(MAX_UNANSWERED), *more)  # fmt: skip


def reconciled(status: dict[str, Any]) -> bool:
    """sent = answered + dropped + in flight, with nothing in flight."""
    samples = status.get("samples") or {}
    if not samples:
        return False
    dropped = sum(samples["dropped"].values())
    return bool(samples["in_flight"] == 0 and samples["sent"] == samples["answered"] + dropped)


@pytest.mark.integration
def test_reliable_samples_are_all_answered_through_a_stock_broker_with_a_daemon_slower_than_the_board(
    built_litert_bundle: Path, board_data: Path, stock_broker: Broker, watch: Watch, tmp_path: Path,
    processes: list[Process],
) -> None:  # fmt: skip
    """2,000 reliable samples, the daemon stopped until the broker has been offered more than it queues for it
    (1,000): the bridge stops acknowledging at its window (the board waits), so every sample is answered once the
    daemon goes on. Before the window, the board had every sample acknowledged and about half were never answered."""
    count = 2000
    board = PythonBoard(BoardOptions("slow-1", rate_hz=100_000, count=count, reliable=True), board_data, Uart.SOCKET)
    with board:
        processes.append(daemon := start_daemon(built_litert_bundle, stock_broker, tmp_path / "state", watch))
        with stopped(daemon):
            processes.append(gateway := bridge(board.url, stock_broker, "gw"))
            offered = wait_until(
                lambda: watch.board_stats("gw").get("done") or watch.status("gw").get("acks_held", 0) > 0, TIMEOUT_S
            )  # the board finished (all acknowledged), or the bridge holds its ACKs: either way past the queue
            assert offered, f"neither: {watch.counts('gw')}"
            held = watch.status("gw")
        answered = wait_until(lambda: watch.board_stats("gw").get("answered", 0) >= count, 120)
        stats, status = watch.board_stats("gw"), watch.status("gw")
        code, _, err = gateway.stop()
    assert code == 0, err[-3000:]
    assert answered, f"answered {stats.get('answered')} of {count} (board: {stats}; bridge: {status.get('counts')})"
    assert stats["sent"] == stats["acked"] == count and stats["done"], stats
    assert held.get("acks_held", 0) > 0 and held["in_flight"] <= MAX_UNANSWERED + 8, held.get("samples")
    assert reconciled(status), status["samples"]
    assert status["samples"]["answered"] == count and sum(status["samples"]["dropped"].values()) == 0


@pytest.mark.integration
@pytest.mark.workstation  # /metrics needs prometheus-client (the metrics extra)
def test_unreliable_samples_the_window_has_no_room_for_are_dropped_and_counted_never_lost_silently(
    built_litert_bundle: Path, board_data: Path, stock_broker: Broker, watch: Watch, tmp_path: Path,
    processes: list[Process],
) -> None:  # fmt: skip
    """Unreliable samples, faster than the daemon takes them (it is stopped while the board sends): those past the
    window are dropped by the bridge and counted (``dropped_backpressure``); every other one is answered. Before,
    the broker dropped what its queue had no room for, and the bridge said ``published N, publish_failed 0``. The
    counters reconcile, in the status message and on /metrics."""
    count = 12_000  # 6 s at 2 kHz, all of it to the bridge: over 1,500 are taken while the daemon is stopped
    board = PythonBoard(BoardOptions("slow-2", rate_hz=2000, count=count, reliable=False), board_data, Uart.SOCKET)
    url = board.listen()  # the bridge is up and has the port open before the board boots (a busy machine once
    with contextlib.ExitStack() as powered:  # took so long to start the bridge that most of the stream went to no one)
        powered.callback(board.stop)
        processes.append(daemon := start_daemon(built_litert_bundle, stock_broker, tmp_path / "state", watch))
        with stopped(daemon):
            metrics_port = free_port()
            processes.append(gateway := bridge(url, stock_broker, "gw", "--prometheus-port", str(metrics_port)))
            assert wait_until(lambda: watch.status("gw"), TIMEOUT_S), "the bridge never said its status"
            board.start()
            behind = wait_until(lambda: watch.counts("gw").get("serial_samples", 0) > 1500, TIMEOUT_S)
            assert behind, f"the bridge took {watch.counts('gw').get('serial_samples')} while the daemon was stopped"
        assert wait_until(lambda: watch.board_stats("gw").get("done"), TIMEOUT_S), "the board did not finish"

        def accounted() -> int:
            counts = watch.counts("gw")
            return int(watch.board_stats("gw").get("answered", 0)) + int(counts.get("dropped_backpressure", 0))

        wait_until(lambda: accounted() >= watch.counts("gw")["serial_samples"] and reconciled(watch.status("gw")), 60)
        stats, status = watch.board_stats("gw"), watch.status("gw")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        code, _, err = gateway.stop()
    assert code == 0, err[-3000:]
    counts = status["counts"]
    taken = counts["serial_samples"]
    assert accounted() == taken, (
        f"of {taken}: answered {stats.get('answered')}, dropped {counts.get('dropped_backpressure')}"
    )
    assert counts["dropped_backpressure"] > 0 and counts["unanswered"] == 0, counts
    assert reconciled(status), status["samples"]
    assert status["samples"]["answered"] == stats["answered"]
    scraped = {m[0]: float(m[1]) for m in re.findall(r"^edgeline_(\w+?)(?:_total)?\{[^}]*\} (\S+)$", metrics, re.M)}
    dropped = ("dropped_backpressure", "publish_failed", "unpublished_at_stop", "unanswered", "dropped_topic")
    assert scraped["serial_samples"] == scraped["answered"] + sum(scraped[n] for n in dropped) + scraped["in_flight"]
    assert scraped["serial_samples"] == taken and scraped["dropped_backpressure"] == counts["dropped_backpressure"]


@pytest.mark.integration
def test_answers_that_come_before_the_boards_hello_after_a_bridge_is_killed_reach_the_board(
    built_litert_bundle: Path, board_data: Path, stock_broker: Broker, watch: Watch, tmp_path: Path,
    processes: list[Process],
) -> None:  # fmt: skip
    """The bridge SIGKILLed while its samples wait for the (stopped) daemon; the daemon answers them into the
    bridge's persistent session; the next bridge gets them before it can hear the board (its port is unplugged
    meanwhile), keeps them, and sends them down at the board's HELLO. Before, they were dropped as unrouted. (The
    board resends them too, not acknowledged: answered already, they are acknowledged, not published again.)"""
    count = 600
    board = make_board("python", BoardOptions("k-1", rate_hz=200, count=count, reliable=True), board_data)
    with board, FrameRelay(board.url, seed=5) as relay:
        processes.append(daemon := start_daemon(built_litert_bundle, stock_broker, tmp_path / "state", watch))
        processes.append(first := bridge(relay.url, stock_broker, "gw"))
        assert wait_until(lambda: watch.board_stats("gw").get("answered", 0) >= 20, TIMEOUT_S), "first answers"
        with stopped(daemon):  # the board's window of frames published, not answered (so not acknowledged)
            assert wait_until(lambda: watch.status("gw").get("acks_held", 0) >= WINDOW, TIMEOUT_S), watch.status("gw")
            first.process.kill()  # their answers come in the bridge's session; the board resends them to the next
            first.process.communicate(timeout=TIMEOUT_S)
            unplugged = threading.Thread(target=relay.unplug, args=(6.0,))
            unplugged.start()
        processes.append(second := bridge(relay.url, stock_broker, "gw"))

        def early() -> int:
            counts = watch.counts("gw")
            return int(counts.get("answers_before_hello", 0)) + int(counts.get("answers_unrouted", 0))

        came_early = wait_until(lambda: early() > 0, 30)
        unplugged.join()
        answered = wait_until(
            lambda: watch.board_stats("gw").get("answered", 0) >= count and watch.board_stats("gw").get("done"), 90
        )
        stats, counts = watch.board_stats("gw"), watch.counts("gw")
        code, _, err = second.stop()
    assert code == 0, err[-3000:]
    assert came_early, f"no answer came before the HELLO: {counts}"
    assert answered, f"answered {stats.get('answered')} of {count}; bridge: {counts}"
    assert counts["answers_before_hello"] > 0 and counts["answers_before_hello_dropped"] == 0, counts


@pytest.mark.integration
@BOARDS
def test_twin_boards_on_two_bridges_each_get_only_their_own_answers_and_are_said(
    kind: str, built_litert_bundle: Path, board_data: Path, stock_broker: Broker, watch: Watch, tmp_path: Path,
    processes: list[Process],
) -> None:  # fmt: skip
    """Two boards with one `device` (a cloned image), each on its own bridge, one daemon: each board gets one
    answer per input (before: both answers of every seq, 600 for 300), and each bridge counts and says the twin."""
    count = 60
    twins = [make_board(kind, BoardOptions("twin", rate_hz=30, count=count, reliable=True), board_data)
             for _ in range(2)]  # fmt: skip
    with twins[0], twins[1]:
        processes.append(start_daemon(built_litert_bundle, stock_broker, tmp_path / "state", watch))
        gateways = [bridge(twin.url, stock_broker, name) for twin, name in zip(twins, ("gw-a", "gw-b"), strict=True)]
        processes.extend(gateways)

        def finished(name: str) -> bool:
            said = watch.board_stats(name)
            return bool(said.get("done")) and said.get("answered", 0) >= count

        wait_until(lambda: finished("gw-a") and finished("gw-b"), 120)

        def said_and_passed(name: str) -> bool:  # the twin's answers reach this bridge too (once it subscribed)
            counts = watch.counts(name)
            return counts.get("duplicate_devices", 0) >= 1 and counts.get("answers_other_bridge", 0) > 0

        wait_until(lambda: said_and_passed("gw-a") and said_and_passed("gw-b"), 10)
        stats = {name: watch.board_stats(name) for name in ("gw-a", "gw-b")}
        counts = {name: watch.counts(name) for name in ("gw-a", "gw-b")}
        logs = [gateway.stop() for gateway in gateways]
    for name in ("gw-a", "gw-b"):
        said = stats[name]
        assert said["answered"] == count and said["answers"] == count, f"{name}'s board: {said}"
        assert counts[name]["duplicate_devices"] == 1 and counts[name]["answers_other_bridge"] > 0, counts[name]
    for code, _, err in logs:
        assert code == 0, err[-3000:]
        assert sum("two boards claim one name" in line for line in err.splitlines()) == 1, err[-3000:]
