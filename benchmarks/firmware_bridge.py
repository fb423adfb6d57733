"""`edgeline bridge` with emulated boards and a real Mosquitto, in one run: what it carries and what it costs at 1, 4
and 16 boards, and the round trip board → bridge → Mosquitto → `edgeline run` → answer → bridge → board.

Throughput rows: N ``PythonBoard``s (reliable mode, unpaced: the highest rate a board takes, so each is held back
only by its window of 8 unacknowledged frames) on loopback TCP ports, ``--samples`` split between them; one
``edgeline bridge`` subprocess reads all of them. No daemon runs: the bridge acknowledges a frame to its board once the
broker has acknowledged its sample (PUBACK), so nothing else is needed, and no subscriber takes the samples.
The bridge's status message (every 0.2 s) gives ``published`` and the bridge's uptime; when it arrives, this script
reads the bridge's CPU (``/proc/PID/stat``: user + sys), its own (the boards' threads) and the machine's. Figures
are taken between the first and the last status message with ``0 < published < total``: the steady state, without
start-up and tail.

Slow-daemon row: N ``PythonBoard``s (reliable, unpaced) through a *stock* Mosquitto (its default
``max_queued_messages``, 1,000 per client) to ``edgeline run tests/data/tiny-int8``, which answers fewer samples a
second than the boards offer. The bridge's window (``--max-unanswered``, default 500) holds the boards' ACKs while
the daemon is behind; lost = samples asked for - samples the boards say were answered (0 is the goal: before the
window, the broker dropped what did not fit its queue). The row reports the highest ``in_flight`` and ``acks_held``
the bridge's status showed, which says whether the daemon was in fact slower than the boards.

Latency rows: one board (the C firmware on QEMU's mps2-an386, and a ``PythonBoard`` for comparison), reliable, at
``--rate`` Hz, with ``edgeline run tests/data/tiny-int8`` (default topics) answering; the figure is the bridge's own
``total`` stage: from the moment the bridge decoded the SAMPLES frame (after reading it from the port) to the moment
it wrote that sample's ANSWER frame to the port (handed to the OS socket), i.e. publish + broker + daemon (decode,
inference, publish) + broker + the bridge's routing. It does not include the board's UART (the firmware → QEMU's
chardev → the socket, before; the socket → the board's polling loop, after).

    python benchmarks/firmware_bridge.py --write benchmarks/results/firmware_bridge.md

A smoke run (about a minute): ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table, publish

from edgeline.sim.board import MAX_RATE_HZ, BoardOptions, PythonBoard, Uart
from tests.mqtt_broker import Broker, Collector, running_broker

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "tests" / "data" / "tiny-int8"
EDGELINE = [sys.executable, "-m", "edgeline.cli"]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STATUS_INTERVAL_S = 0.2
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
ROW_TIMEOUT_S = 180.0
"""No row runs longer than this: a board that never finishes is reported as such, not waited for."""


# -- processes and CPU ---------------------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of proc(5)


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (``/proc/stat``); busy includes steal."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    total = sum(values[:8])  # user .. steal (guest time is already in user)
    return total - idle, total


class Command:
    """An edgeline command in the background, its output in a file (a pipe nobody reads would block it)."""

    def __init__(self, scratch: Path, name: str, *args: str) -> None:
        self.log = scratch / f"{name}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen([*EDGELINE, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=out)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> int:
        """SIGTERM, a bounded wait, then SIGKILL; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        return self.process.returncode

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def command(scratch: Path, name: str, *args: str) -> Iterator[Command]:
    started = Command(scratch, name, *args)
    try:
        yield started
    finally:
        started.stop()


@dataclass(frozen=True)
class Snapshot:
    """One bridge status message, with the CPU clocks read when it arrived."""

    status: dict[str, Any]
    bridge_cpu_s: float
    own_cpu_s: float
    machine: tuple[int, int]

    @property
    def published(self) -> int:
        return int(self.status["counts"].get("published", 0))


class StatusWatch(Collector):
    """Every status message of one bridge, each with the CPU clocks of the moment it arrived."""

    def __init__(self, broker: Broker, instance: str, bridge_pid: Callable[[], int | None]) -> None:
        self.snapshots: list[Snapshot] = []
        self.bridge_pid = bridge_pid
        super().__init__(broker, f"edgeline/bridge/{instance}/status")

    def _on_message(self, client: object, userdata: object, message: object) -> None:
        payload = bytes(message.payload)  # type: ignore[attr-defined]
        pid = self.bridge_pid()
        if not payload or pid is None:
            return
        try:
            bridge_cpu = process_cpu_s(pid)
        except OSError:  # the bridge has exited: its last status carries no CPU figure
            bridge_cpu = float("nan")
        times = os.times()
        snapshot = Snapshot(json.loads(payload), bridge_cpu, times.user + times.system, machine_jiffies())
        with self.lock:
            self.snapshots.append(snapshot)
            self.lock.notify_all()

    def last(self) -> Snapshot | None:
        with self.lock:
            return self.snapshots[-1] if self.snapshots else None


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def bridge_args(urls: list[str], broker: Broker, instance: str, *more: str) -> list[str]:
    return ["bridge", *urls, "--broker", broker.address, "--instance", instance,
            "--status-interval", str(STATUS_INTERVAL_S), *more]  # fmt: skip


# -- throughput ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    boards: int
    count: int
    sent: int
    acked: int
    resent: int
    done: bool
    rate: float
    bridge_cpu_us: float
    bridge_pct: float
    boards_pct: float
    machine_pct: float
    publish_ms: tuple[float | None, float | None]
    window_s: float
    bridge_exit: int


def boards_and_bridge(
    stack: ExitStack,
    broker: Broker,
    scratch: Path,
    data: Path,
    devices: list[str],
    count: int,
    instance: str,
    uart: Uart,
    *bridge_flags: str,
) -> tuple[list[PythonBoard], StatusWatch, Command]:
    """Reliable Python boards sending ``count`` samples each at full rate, a watch of the bridge's status, and
    ``edgeline bridge`` over their ports: all stopped when ``stack`` closes."""
    started = []
    for device in devices:
        options = BoardOptions(device, MAX_RATE_HZ, count, reliable=True)
        board = PythonBoard(options, data, uart)
        stack.callback(board.stop)
        board.start()
        started.append(board)
    holder: list[Command] = []
    watch = StatusWatch(broker, instance, lambda: holder[0].pid if holder else None)
    stack.callback(watch.close)
    urls = [b.url for b in started]
    bridge = stack.enter_context(command(scratch, instance, *bridge_args(urls, broker, instance, *bridge_flags)))
    holder.append(bridge)
    return started, watch, bridge


def throughput_row(broker: Broker, scratch: Path, data: Path, boards: int, total: int, uart: Uart) -> Throughput:
    count = max(1, total // boards)
    instance = f"tp-{boards}-{uart.value}"
    with ExitStack() as stack:
        # no daemon answers: the window (samples not answered) is off
        started, watch, bridge = boards_and_bridge(
            stack, broker, scratch, data, [f"tp{boards}-{i}" for i in range(boards)], count, instance, uart,
            "--max-unanswered", "0",
        )  # fmt: skip

        def all_done() -> bool:
            return all((s := b.session) is not None and s.done for b in started) or bridge.process.poll() is not None

        wait_until(all_done, ROW_TIMEOUT_S)
        seen = len(watch.snapshots)
        wait_until(lambda: len(watch.snapshots) > seen + 1, 5.0)  # a status with every PUBACK in it
        exit_code = bridge.stop()
        stats = [b.session.stats() if b.session is not None else {} for b in started]
    snaps = [s for s in watch.snapshots if s.bridge_cpu_s == s.bridge_cpu_s]  # NaN: after the bridge exited
    mid = [s for s in snaps if 0 < s.published < count * boards]
    if len(mid) < 2 or mid[0].published == mid[-1].published:  # a very short run: from the start to the end
        mid = snaps
    if len(mid) < 2 or mid[0].published == mid[-1].published:
        raise RuntimeError(
            f"{boards} boards: fewer than two status messages with samples; bridge log:\n{bridge.tail()}"
        )
    first, last = mid[0], mid[-1]
    frames = last.published - first.published
    window = float(last.status["uptime_s"]) - float(first.status["uptime_s"])
    busy = last.machine[0] - first.machine[0]
    jiffies = last.machine[1] - first.machine[1]
    final = watch.last()
    publish_stage = (final.status if final else last.status)["latency_ms"]["publish"]
    return Throughput(
        boards=boards,
        count=count,
        sent=sum(int(s.get("sent", 0)) for s in stats),
        acked=sum(int(s.get("acked", 0)) for s in stats),
        resent=sum(int(s.get("resent", 0)) for s in stats),
        done=all(bool(s.get("done")) for s in stats),
        rate=frames / window,
        bridge_cpu_us=(last.bridge_cpu_s - first.bridge_cpu_s) / frames * 1e6,
        bridge_pct=(last.bridge_cpu_s - first.bridge_cpu_s) / window * 100,
        boards_pct=(last.own_cpu_s - first.own_cpu_s) / window * 100,
        machine_pct=busy / jiffies * 100 if jiffies else 0.0,
        publish_ms=(publish_stage["p50"], publish_stage["p99"]),
        window_s=window,
        bridge_exit=exit_code,
    )


# -- a stock broker and a daemon slower than the boards ----------------------------------------------------------


@dataclass(frozen=True)
class SlowDaemon:
    boards: int
    count: int
    sent: int
    acked: int
    answered: int
    resent: int
    done: bool
    rate: float
    max_in_flight: int
    max_acks_held: int
    counts: dict[str, Any]
    samples: dict[str, Any]
    window_s: float
    bridge_exit: int


def slow_daemon_row(broker: Broker, scratch: Path, data: Path, boards: int, total: int, window: bool) -> SlowDaemon:
    """``window`` False: ``--max-unanswered 0``, the bridge as it was before its window (for comparison)."""
    count = max(1, total // boards)
    instance = f"slow-{boards}-{'window' if window else 'off'}"
    with ExitStack() as stack:
        more = () if window else ("--max-unanswered", "0")
        devices = [f"slow{boards}-{i}" for i in range(boards)]
        started, watch, bridge = boards_and_bridge(
            stack, broker, scratch, data, devices, count, instance, Uart.SOCKET, *more
        )

        def all_answered() -> bool:
            return (
                all((s := b.session) is not None and s.done and s.stats()["answered"] >= count for b in started)
                or bridge.process.poll() is not None
                or stuck()
            )

        def stuck() -> bool:
            """Every board done, and no answer for 5 status messages (1 s): what is not answered now never will be."""
            routed = [s.status["counts"].get("answers_routed") for s in watch.snapshots[-6:]]
            boards_done = all((s := b.session) is not None and s.done for b in started)
            return boards_done and len(routed) == 6 and len(set(routed)) == 1

        began = time.monotonic()
        wait_until(all_answered, ROW_TIMEOUT_S)
        elapsed_s = time.monotonic() - began
        seen = len(watch.snapshots)
        wait_until(lambda: len(watch.snapshots) > seen + 1, 5.0)  # a status after the last answer
        exit_code = bridge.stop()
        stats = [b.session.stats() if b.session is not None else {} for b in started]
    final = watch.last()
    if final is None:
        raise RuntimeError(f"slow daemon: no status from the bridge; its log:\n{bridge.tail()}")
    answered = sum(int(s.get("answered", 0)) for s in stats)
    return SlowDaemon(
        boards=boards,
        count=count,
        sent=sum(int(s.get("sent", 0)) for s in stats),
        acked=sum(int(s.get("acked", 0)) for s in stats),
        answered=answered,
        resent=sum(int(s.get("resent", 0)) for s in stats),
        done=all(bool(s.get("done")) for s in stats),
        rate=answered / elapsed_s,
        max_in_flight=max(int(s.status.get("in_flight", 0)) for s in watch.snapshots),
        max_acks_held=max(int(s.status.get("acks_held", 0)) for s in watch.snapshots),
        counts=final.status["counts"],
        samples=final.status.get("samples", {}),
        window_s=elapsed_s,
        bridge_exit=exit_code,
    )


# -- round trip ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundTrip:
    board: str
    count: int
    stats: dict[str, Any]
    counts: dict[str, Any]
    total_ms: tuple[float | None, float | None]
    publish_ms: tuple[float | None, float | None]
    samples: int
    bridge_exit: int
    extra: str


def round_trip_row(
    broker: Broker, scratch: Path, data: Path, kind: str, rate: float, count: int, instance: str
) -> RoundTrip:
    from edgeline.sim.mcu import EmulatedBoard

    options = BoardOptions(f"rt-{kind}", rate, count, reliable=True)
    board: PythonBoard | EmulatedBoard = (
        EmulatedBoard(options, data, Uart.SOCKET) if kind == "qemu" else PythonBoard(options, data, Uart.SOCKET)
    )
    with ExitStack() as stack:
        stack.callback(board.stop)
        url = board.start()
        holder: list[Command] = []
        watch = StatusWatch(broker, instance, lambda: holder[0].pid if holder else None)
        stack.callback(watch.close)
        bridge = stack.enter_context(command(scratch, instance, *bridge_args([url], broker, instance)))
        holder.append(bridge)

        def board_stats() -> dict[str, Any]:
            last = watch.last()
            boards = last.status.get("boards", []) if last else []
            return dict(boards[0].get("board_stats") or {}) if boards else {}

        def finished() -> bool:
            said = board_stats()
            return (
                bool(said.get("done")) and int(said.get("answered", 0)) >= count
            ) or bridge.process.poll() is not None

        wait_until(finished, count / rate + ROW_TIMEOUT_S / 2)
        seen = len(watch.snapshots)
        exit_code = bridge.stop()
        wait_until(lambda: len(watch.snapshots) > seen, 2.0)  # the status it publishes as it stops
        stats = board_stats()
        extra = ""
        if isinstance(board, EmulatedBoard):
            extra = f"firmware build (or cache) {board.build_s:.1f} s, QEMU start {board.boot_s:.2f} s"
    final = watch.last()
    if final is None:
        raise RuntimeError(f"{kind}: no status from the bridge; its log:\n{bridge.tail()}")
    latency = final.status["latency_ms"]
    return RoundTrip(
        board=board.description,
        count=count,
        stats=stats,
        counts=final.status["counts"],
        total_ms=(latency["total"]["p50"], latency["total"]["p99"]),
        publish_ms=(latency["publish"]["p50"], latency["publish"]["p99"]),
        samples=int(latency["total"]["samples"]),
        bridge_exit=exit_code,
        extra=extra,
    )


SLOW_DAEMON = "[queue]\nmax_batch = 1\n[outbox]\ncommit_interval_s = 0.05\n"
"""A daemon slower than unpaced boards: one input per batch, its outbox committed every 50 ms."""


@contextmanager
def daemon(broker: Broker, scratch: Path, config: str = "") -> Iterator[Command]:
    """``edgeline run`` on the bundle with its default topics, once it is online (subscribed)."""
    instance = f"fwb-daemon-{os.getpid()}"
    online = Collector(broker, f"edgeline/+/{instance}/availability")
    settings = scratch / "daemon.toml"
    settings.write_text(config)
    try:
        args = ("run", str(BUNDLE), "--broker", broker.address, "--instance", instance, "--config", str(settings),
                "--state-dir", str(scratch / "daemon-state"))  # fmt: skip
        with command(scratch, "daemon", *args) as running:
            if not wait_until(lambda: b"online" in online.payloads or running.process.poll() is not None,
                              START_TIMEOUT_S):  # fmt: skip
                raise RuntimeError(f"the daemon did not come online; its log:\n{running.tail()}")
            if running.process.poll() is not None:
                raise RuntimeError(f"the daemon exited; its log:\n{running.tail()}")
            yield running
    finally:
        online.close()


# -- the table -----------------------------------------------------------------------------------------------

COLUMNS = {
    "samples acked / sent (lost)": "the boards' own counters at the end (reliable mode: acked = the bridge said the "
    "broker has it); lost = samples asked for - acked; in the stock-broker rows, samples asked for - samples the "
    "boards say were answered",
    "resent": "frames the boards sent again (go-back-N: the whole window of 8 after 500 ms without an ACK, or "
    "after a HELLO_REQUEST); the boards start before the bridge, so a second or so of start-up resends is in it",
    "samples/s": "the bridge's `published` (samples the broker acknowledged; one sample per SAMPLES frame) per "
    "second of the bridge's uptime, between its first and last status message of the steady state; in the "
    "stock-broker rows, samples the boards say were answered per second from the bridge's start to the last answer "
    "(with the daemon at `[queue] max_batch = 1`, `[outbox] commit_interval_s = 0.05`: slower than the boards)",
    "bridge CPU µs/sample": "user + sys CPU of the `edgeline bridge` process (all threads) over the same window, "
    "per published sample",
    "bridge CPU / boards' CPU": "the same CPU per wall second (100% = one core); boards' CPU is this script's "
    "process: the Python boards' threads and the status subscriber",
    "machine busy": "all CPUs of the machine, busy share (100% = both cores), anything running on it included",
    "publish p50 / p99 ms": "the bridge's `publish` stage: a frame decoded by the bridge to the broker's PUBACK of "
    "its sample (the last 4,096 samples of the run)",
    "total p50 / p99 ms": "the bridge's `total` stage: a frame decoded by the bridge to its ANSWER written to the "
    "board's port (publish, Mosquitto, `edgeline run` on tests/data/tiny-int8, Mosquitto, routing). Not included: "
    "the board's UART and the board's own handling on either side",
}


def ms(pair: tuple[float | None, float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in pair)


def make_data(path: Path, n: int = 64) -> Path:
    rng = np.random.default_rng(7)
    np.savez(path, x=rng.random((n, 1, 8, 8), dtype=np.float32), labels=np.arange(n, dtype=np.int64) % 10)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boards", type=int, nargs="+", default=[1, 4, 16], help="throughput rows (default 1 4 16)")
    parser.add_argument("--samples", type=int, default=20000, help="samples per throughput row, split between boards")
    parser.add_argument(
        "--no-pty-row",
        dest="pty_row",
        action="store_false",
        help="leave out the comparison row of one board on a pty (the other rows use socket:// URLs)",
    )
    parser.add_argument("--rate", type=float, default=10.0, help="round-trip rows: samples per second (default 10)")
    parser.add_argument("--count", type=int, default=200, help="round-trip rows: samples (default 200)")
    parser.add_argument(
        "--slow-boards", type=int, default=4, help="the slow-daemon row (stock broker): boards (default 4)"
    )
    parser.add_argument("--slow-samples", type=int, default=8000, help="the slow-daemon row: samples (default 8000)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8,000 samples a row, 40 round trips")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.count, args.rate, args.slow_samples = 8000, 40, 20.0, 2000
    began = time.monotonic()
    header = ("row", "boards", "samples acked / sent (lost)", "resent", "samples/s", "bridge CPU µs/sample",
              "bridge CPU", "boards' CPU", "machine busy", "publish p50 / p99 ms", "total p50 / p99 ms")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="edgeline-fwb-") as tmp, running_broker() as broker:
        scratch = Path(tmp)
        data = make_data(scratch / "samples.npz")
        plan = [(boards, Uart.SOCKET) for boards in args.boards] + ([(1, Uart.PTY)] if args.pty_row else [])
        for boards, uart in plan:
            row = throughput_row(broker, scratch, data, boards, args.samples, uart)
            expected = row.count * row.boards
            rows.append((
                f"throughput (PythonBoards on {'loopback TCP' if uart is Uart.SOCKET else 'a pty'}, unpaced; no "
                "daemon)", str(boards),
                f"{row.acked} / {row.sent} ({expected - row.acked})", str(row.resent), f"{row.rate:.0f}",
                f"{row.bridge_cpu_us:.0f}", f"{row.bridge_pct:.0f}%", f"{row.boards_pct:.0f}%",
                f"{row.machine_pct:.0f}%", ms(row.publish_ms), "-",
            ))  # fmt: skip
            notes.append(
                f"{boards} board(s) on {uart.value}: {row.count} samples each, measured over {row.window_s:.1f} s; "
                f"all done: {row.done}; bridge exit code {row.bridge_exit}"
            )
            print(f"throughput, {boards} board(s) on {uart.value}: {row}", file=sys.stderr)
        with daemon(broker, scratch):
            for kind in ("qemu", "python"):
                trip = round_trip_row(broker, scratch, data, kind, args.rate, args.count, f"rt-{kind}")
                stats, counts = trip.stats, trip.counts
                lost = trip.count - int(stats.get("acked", 0))
                rows.append((
                    f"round trip ({trip.board}, {args.rate:g} Hz, daemon answering)", "1",
                    f"{stats.get('acked', '?')} / {stats.get('sent', '?')} ({lost})", str(stats.get("resent", "?")),
                    "-", "-", "-", "-", "-", ms(trip.publish_ms), ms(trip.total_ms),
                ))  # fmt: skip
                notes.append(
                    f"{trip.board}: board says answers {stats.get('answers')}, answered {stats.get('answered')} of "
                    f"{trip.count}; bridge published {counts.get('published')}, answers_routed "
                    f"{counts.get('answers_routed')}, unrouted {counts.get('answers_unrouted')}, gaps "
                    f"{counts.get('serial_sequence_gaps')}, refused {counts.get('serial_refused')}; total stage over "
                    f"{trip.samples} samples; bridge exit code {trip.bridge_exit}"
                    + (f"; {trip.extra}" if trip.extra else "")
                )
                print(f"round trip, {kind}: {trip}", file=sys.stderr)
    for window in (True, False):  # a fresh broker and daemon each: nothing queued from the other run
        with (
            tempfile.TemporaryDirectory(prefix="edgeline-fwb-") as tmp,
            running_broker(stock=True) as broker,
        ):
            scratch = Path(tmp)
            data = make_data(scratch / "samples.npz")
            with daemon(broker, scratch, SLOW_DAEMON):
                slow = slow_daemon_row(broker, scratch, data, args.slow_boards, args.slow_samples, window)
        lost = slow.count * slow.boards - slow.answered
        dropped = slow.samples.get("dropped", {})
        setting = "window 500 (default)" if window else "no window (--max-unanswered 0: the bridge before it)"
        rows.append((
            f"stock Mosquitto (max_queued_messages 1,000), daemon slower than the boards, {setting} (PythonBoards on "
            "loopback TCP, unpaced, reliable)", str(slow.boards), f"{slow.acked} / {slow.sent} ({lost} not answered)",
            str(slow.resent), f"{slow.rate:.0f} answered", "-", "-", "-", "-", "-", "-",
        ))  # fmt: skip
        notes.append(
            f"stock broker, {setting}, {slow.boards} boards x {slow.count} samples: boards say answered "
            f"{slow.answered} of "
            f"{slow.count * slow.boards} in {slow.window_s:.1f} s; the bridge's window peaked at in_flight "
            f"{slow.max_in_flight} with {slow.max_acks_held} ACKs held (the daemon behind the boards); samples "
            f"{slow.samples}; published {slow.counts.get('published')}, answers_routed "
            f"{slow.counts.get('answers_routed')}, dropped {dropped}; all done: {slow.done}; bridge exit code "
            f"{slow.bridge_exit}"
        )
        print(f"slow daemon: {slow}", file=sys.stderr)
    elapsed = time.monotonic() - began
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    intro = (
        f"Run finished {time.strftime('%Y-%m-%d %H:%M %Z')} on {os.cpu_count()} cores ({cpu}), a shared VM (other "
        f"people's tests may run at the same time); {elapsed:.0f} s for the whole run. Host figures, not a device's: "
        "the boards, the bridge, Mosquitto and the daemon share the same two cores; the QEMU board is an emulated "
        "Cortex-M4 whose UART is a loopback socket (no baud rate), so its timing is QEMU's, not a real UART's.\n\n"
        "Columns:\n\n" + "\n".join(f"- {column}: {meaning}" for column, meaning in COLUMNS.items())
        + "\n\nPer row:\n\n" + "\n".join(f"- {note}" for note in notes)
    )  # fmt: skip
    publish(markdown_table(rows), script=__file__, title="`edgeline bridge`: throughput, CPU and round trip",
            intro=intro, write=args.write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
