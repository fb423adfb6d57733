"""`edgeline bridge` with emulated boards and a real Mosquitto, in one run: what it carries and what it costs at 1, 4
and 16 boards, and the round trip board → bridge → Mosquitto → `edgeline run` → answer → bridge → board.

Throughput rows: N ``PythonBoard``s (reliable mode, unpaced: the highest rate a board takes, so each is held back
only by its window of 8 unacknowledged frames) on loopback TCP ports, ``--samples`` split between them; one
``edgeline bridge --max-unanswered 0`` subprocess reads all of them. No daemon runs: with no window (samples nobody
answers) the bridge acknowledges a frame to its board once the broker has acknowledged its sample (PUBACK), so nothing
else is needed, and no subscriber takes the samples.
The bridge's status message (every 0.2 s) gives ``published`` and the bridge's uptime; when it arrives, this script
reads the bridge's CPU (``/proc/PID/stat``: user + sys), its own (the boards' threads) and the machine's. Figures
are taken between the first and the last status message with ``0 < published < total``: the steady state, without
start-up and tail.

Slow-daemon row: N ``PythonBoard``s (reliable, unpaced) through a *stock* Mosquitto (its default
``max_queued_messages``, 1,000 per client) to ``edgeline run tests/data/tiny-int8``, which answers fewer samples a
second than the boards offer. The bridge holds the boards' ACKs until their samples are answered; lost = samples asked
for - samples the boards say were answered (0 is the goal: with ``--max-unanswered 0``, acknowledged at the PUBACK as
the bridge did before its window, the broker drops what does not fit its queue). The row reports the highest
``in_flight`` and ``acks_held`` the bridge's status showed, which says whether the daemon was in fact slower than the
boards.

Answered rows: N reliable unpaced ``PythonBoard``s with ``edgeline run tests/data/tiny-int8`` answering, side by side
with the bridge of another commit (``--before REF``, its package tree from ``git archive`` on PYTHONPATH): answered
samples per second (the bridge's ``answers_routed`` over its steady state). What acknowledging a frame at its answer,
rather than at the broker's PUBACK, costs a board whose window is 8 frames.

Broker-kill runs (``--kill-runs``, and ``--kill-runs-before`` of ``--before``): 3 reliable boards x 1,500 samples, a
persistent Mosquitto SIGKILLed and restarted twice while they stream (``tests/test_bridge_broker_faults.py``, many
times): samples acknowledged to a board and never answered, ANSWER frames sent twice. Flood rows: a board that says
HELLO ``--flood`` times with a new device name each time, then cycling 16 names; the resident memory of the bridge and
of Mosquitto before and after, and what the broker still holds.

Latency rows: one board (the C firmware on QEMU's mps2-an386, and a ``PythonBoard`` for comparison), reliable, at
``--rate`` Hz, with ``edgeline run tests/data/tiny-int8`` (default topics) answering; the figure is the bridge's own
``total`` stage: from the moment the bridge decoded the SAMPLES frame (after reading it from the port) to the moment
it wrote that sample's ANSWER frame to the port (handed to the OS socket), i.e. publish + broker + daemon (decode,
inference, publish) + broker + the bridge's routing. It does not include the board's UART (the firmware → QEMU's
chardev → the socket, before; the socket → the board's polling loop, after).

    python benchmarks/firmware_bridge.py --before COMMIT --write benchmarks/results/firmware_bridge.md

A smoke run (about a minute): ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
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

from edgeline.device_profiles.toml import tomllib
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

    def __init__(self, scratch: Path, name: str, *args: str, code: Code | None = None) -> None:
        self.log = scratch / f"{name}.log"
        env = None if code is None or code.tree is None else {**os.environ, "PYTHONPATH": str(code.tree)}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [*EDGELINE, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
            )

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
def command(scratch: Path, name: str, *args: str, code: Code | None = None) -> Iterator[Command]:
    started = Command(scratch, name, *args, code=code)
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


@dataclass(frozen=True)
class Code:
    """Whose ``edgeline bridge`` a row runs: this work tree (``tree`` None), or a commit's package tree."""

    label: str
    tree: Path | None = None


THIS_TREE = Code("now")


def code_of(ref: str, scratch: Path) -> Code:
    """The ``edgeline`` package of git commit ``ref``, laid out as the wheel installs it (``tests.package_tree``'s
    links, over a copy extracted with ``git archive``): on PYTHONPATH it is imported before the work tree's editable
    install, for a row side by side with the code as it is now, in one run."""
    source, tree = scratch / f"source-{ref}", scratch / f"tree-{ref}"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True, timeout=120)
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True, timeout=120)
    with open(source / "pyproject.toml", "rb") as file:
        mapping: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    for name, folder in mapping.items():
        base = Path(*name.split("."))
        nested = {Path(*other.split(".")).relative_to(base) for other in mapping if other.startswith(name + ".")}
        for entry in (source / folder).iterdir():
            if entry.name != "__pycache__" and Path(entry.name) not in nested:
                (tree / base).mkdir(parents=True, exist_ok=True)
                (tree / base / entry.name).symlink_to(entry)
    return Code(ref, tree)


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
    code: Code | None = None,
    rate_hz: float = MAX_RATE_HZ,
) -> tuple[list[PythonBoard], StatusWatch, Command]:
    """Reliable Python boards sending ``count`` samples each at ``rate_hz`` (full rate), a watch of the bridge's
    status, and ``edgeline bridge`` (of ``code``: this work tree by default) over their ports: all stopped when
    ``stack`` closes."""
    started = []
    for device in devices:
        options = BoardOptions(device, rate_hz, count, reliable=True)
        board = PythonBoard(options, data, uart)
        stack.callback(board.stop)
        board.start()
        started.append(board)
    holder: list[Command] = []
    watch = StatusWatch(broker, instance, lambda: holder[0].pid if holder else None)
    stack.callback(watch.close)
    urls = [b.url for b in started]
    args = bridge_args(urls, broker, instance, *bridge_flags)
    bridge = stack.enter_context(command(scratch, instance, *args, code=code))
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


# -- answered throughput: the cost of acknowledging at the answer ------------------------------------------------


@dataclass(frozen=True)
class Answered:
    code: str
    boards: int
    count: int
    acked: int
    answered: int
    answers: int
    rate: float
    total_ms: tuple[float | None, float | None]
    window_s: float
    bridge_exit: int


def answered_row(broker: Broker, scratch: Path, data: Path, boards: int, total: int, code: Code) -> Answered:
    """Reliable unpaced boards, the daemon (already running) answering every sample: answered samples per second,
    from the bridge's ``answers_routed`` between its first and last status message of the steady state."""
    count = max(1, total // boards)
    instance = f"ans-{boards}-{code.label}"
    with ExitStack() as stack:
        devices = [f"ans{boards}-{code.label}-{i}" for i in range(boards)]
        started, watch, bridge = boards_and_bridge(
            stack, broker, scratch, data, devices, count, instance, Uart.SOCKET, code=code
        )

        def all_answered() -> bool:
            return bridge.process.poll() is not None or all(
                (s := b.session) is not None and s.done and s.stats()["answered"] >= count for b in started
            )

        wait_until(all_answered, ROW_TIMEOUT_S)
        seen = len(watch.snapshots)
        wait_until(lambda: len(watch.snapshots) > seen + 1, 5.0)
        exit_code = bridge.stop()
        stats = [b.session.stats() if b.session is not None else {} for b in started]

    def routed(snapshot: Snapshot) -> int:
        return int(snapshot.status["counts"].get("answers_routed", 0))

    mid = [s for s in watch.snapshots if 0 < routed(s) < count * boards] or watch.snapshots
    if len(mid) < 2 or routed(mid[0]) == routed(mid[-1]):
        raise RuntimeError(f"{instance}: fewer than two status messages with answers; bridge log:\n{bridge.tail()}")
    window = float(mid[-1].status["uptime_s"]) - float(mid[0].status["uptime_s"])
    final = watch.last() or mid[-1]
    latency = final.status["latency_ms"]["total"]
    return Answered(
        code=code.label,
        boards=boards,
        count=count,
        acked=sum(int(s.get("acked", 0)) for s in stats),
        answered=sum(int(s.get("answered", 0)) for s in stats),
        answers=sum(int(s.get("answers", 0)) for s in stats),
        rate=(routed(mid[-1]) - routed(mid[0])) / window,
        total_ms=(latency["p50"], latency["p99"]),
        window_s=window,
        bridge_exit=exit_code,
    )


# -- the broker killed while boards stream --------------------------------------------------------------------------

KILL_BOARDS = 3
KILL_SAMPLES = 1500
KILL_RATE_HZ = 400.0
STUCK_S = 20.0
"""A kill run whose boards' answers have not moved for this long is over: what is not answered now never will be
(the bridge before this change: a sample acknowledged and lost, its board done)."""


@dataclass(frozen=True)
class KillRun:
    sent: int
    acked: int
    answered: int
    answers: int
    done: bool
    counts: dict[str, Any]
    seconds: float
    bridge_exit: int

    @property
    def lost(self) -> int:
        """Samples acknowledged to their boards and never answered."""
        return self.acked - self.answered

    @property
    def duplicates(self) -> int:
        """ANSWER frames written to a board for an input answered already."""
        return self.answers - self.answered


def kill_run(scratch: Path, data: Path, run: int, code: Code) -> KillRun:
    """3 reliable boards, 1,500 samples each at 400 Hz, a persistent Mosquitto SIGKILLed and restarted on its port
    with its database when a quarter, then half, of the samples are answered (``tests/test_bridge_broker_faults.py``,
    as a benchmark: many runs)."""
    directory = scratch / f"kill-{code.label}-{run}"
    total = KILL_BOARDS * KILL_SAMPLES
    began = time.monotonic()
    with Broker(directory / "broker", persistence=True) as broker, daemon(broker, directory), ExitStack() as stack:
        instance = f"kill-{code.label}-{run}"
        devices = [f"kill{run}-{code.label}-{i}" for i in range(KILL_BOARDS)]
        started, watch, bridge = boards_and_bridge(
            stack, broker, directory, data, devices, KILL_SAMPLES, instance, Uart.SOCKET, code=code,
            rate_hz=KILL_RATE_HZ,
        )  # fmt: skip

        def stats() -> list[dict[str, Any]]:
            return [dict(b.session.stats()) if b.session is not None else {} for b in started]

        def answered() -> int:
            return sum(int(s.get("answered", 0)) for s in stats())

        for mark in (total // 4, total // 2):
            wait_until(lambda mark=mark: answered() >= mark or bridge.process.poll() is not None, ROW_TIMEOUT_S)
            broker.kill()
            broker.restart()
        last = [answered(), time.monotonic()]

        def over() -> bool:
            now, said = time.monotonic(), stats()
            if sum(int(s.get("answered", 0)) for s in said) != last[0]:
                last[:] = [sum(int(s.get("answered", 0)) for s in said), now]
            finished = all(s.get("done") and s.get("answered") == KILL_SAMPLES for s in said)
            return finished or bridge.process.poll() is not None or (all(s.get("done") for s in said)
                                                                       and now - last[1] > STUCK_S)  # fmt: skip

        wait_until(over, ROW_TIMEOUT_S)
        seconds = time.monotonic() - began
        seen = len(watch.snapshots)
        exit_code = bridge.stop()
        wait_until(lambda: len(watch.snapshots) > seen, 5.0)  # the status it publishes as it stops
        final = watch.last()
        written = [int(b.get("answers_sent", 0)) for b in (final.status.get("boards", []) if final else [])]
        # every ANSWER the bridge wrote has reached its board before the counts are read
        wait_until(lambda: [int(s.get("answers", 0)) for s in stats()] == written, 10.0)
        said = stats()
    return KillRun(
        sent=sum(int(s.get("sent", 0)) for s in said),
        acked=sum(int(s.get("acked", 0)) for s in said),
        answered=sum(int(s.get("answered", 0)) for s in said),
        answers=sum(int(s.get("answers", 0)) for s in said),
        done=all(bool(s.get("done")) for s in said),
        counts=final.status["counts"] if final else {},
        seconds=seconds,
        bridge_exit=exit_code,
    )


# -- a HELLO flood: memory of the bridge and the broker ---------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass(frozen=True)
class Flood:
    code: str
    hellos: int
    names: int
    bridge_mb: tuple[float, float]
    broker_mb: tuple[float, float]
    seconds: float
    counts: dict[str, Any]
    gauges: dict[str, Any]
    retained_claims: int


def flood_row(scratch: Path, hellos: int, distinct: int, code: Code) -> Flood:
    """One port, a board that says HELLO ``hellos`` times, each with the next of ``distinct`` names (a new name
    each time when ``distinct`` >= ``hellos``): the resident memory of the bridge and of Mosquitto before and after,
    once the bridge's status says it read every HELLO (and two more status messages came)."""
    import select
    import tty

    from edgeline.firmware_bridge.protocol import Frame, FrameType, encode

    def hello(index: int) -> bytes:
        said = {"device": f"flood-{index % distinct}", "firmware": "flood", "protocol": 1,
                "streams": [{"id": 1, "name": "x", "dtype": "f32", "shape": [1], "seq": 0}]}  # fmt: skip
        return encode(Frame(FrameType.HELLO, 0, index % 65536, 1000 * (index + 1), json.dumps(said).encode()))

    directory = scratch / f"flood-{code.label}-{distinct}"
    master, slave = os.openpty()
    tty.setraw(slave)
    os.set_blocking(master, False)
    try:
        with Broker(directory / "broker") as broker, ExitStack() as stack:
            instance = f"flood-{code.label}"
            holder: list[Command] = []
            watch = StatusWatch(broker, instance, lambda: holder[0].pid if holder else None)
            stack.callback(watch.close)
            args = bridge_args([os.ttyname(slave)], broker, instance)
            holder.append(bridge := stack.enter_context(command(directory, instance, *args, code=code)))

            def frames_read() -> int:
                last = watch.last()
                return int(last.status["counts"].get("serial_frames", 0)) if last else 0

            def settled(frames: int) -> None:
                wait_until(lambda: frames_read() >= frames, ROW_TIMEOUT_S)
                seen = len(watch.snapshots)
                wait_until(lambda: len(watch.snapshots) > seen + 2, 5.0)

            asked = select.select([master], [], [], START_TIMEOUT_S)[0]  # its HELLO_REQUEST: the port is open (a
            if not asked:  # byte written before that is flushed when it opens)
                raise RuntimeError(f"the bridge did not open its port; its log:\n{bridge.tail()}")
            _write(master, hello(0))
            settled(1)
            before = (rss_mb(bridge.pid), rss_mb(broker._process.pid))  # type: ignore[union-attr]
            began = time.monotonic()
            for start in range(1, hellos, 100):
                _write(master, b"".join(hello(i) for i in range(start, min(hellos, start + 100))))
            settled(hellos)
            seconds = time.monotonic() - began
            after = (rss_mb(bridge.pid), rss_mb(broker._process.pid))  # type: ignore[union-attr]
            final = watch.last()
            retained = len(retained_claims(broker))
            bridge.stop()
    finally:
        os.close(master)
        os.close(slave)
    status = final.status if final else {}
    return Flood(
        code=code.label, hellos=hellos, names=min(hellos, distinct), bridge_mb=(before[0], after[0]),
        broker_mb=(before[1], after[1]), seconds=seconds, counts=dict(status.get("counts") or {}),
        gauges={k: status.get(k) for k in ("boards_known", "names_kept")}, retained_claims=retained,
    )  # fmt: skip


def retained_claims(broker: Broker) -> list[str]:
    """The claims the broker holds: subscribed, then a marker published, which comes after every retained one."""
    import paho.mqtt.publish as mqtt_publish

    claims = Collector(broker, "edgeline/board-claims/#")
    try:
        mqtt_publish.single("edgeline/board-claims/zz-marker", b"", qos=1, hostname=broker.host, port=broker.port)
        wait_until(lambda: any(t.endswith("/zz-marker") for t, _, _ in list(claims.messages)), START_TIMEOUT_S)
        return [t for t, payload, kept in list(claims.messages) if kept and payload]
    finally:
        claims.close()


def _write(fd: int, data: bytes) -> None:
    """All of ``data`` into the pty's master, as the bridge reads the other end (bounded: a minute without room)."""
    import select

    view = memoryview(data)
    while view:
        _, ready, _ = select.select([], [fd], [], 60.0)
        if not ready:
            raise RuntimeError("the bridge read nothing of its port for a minute")
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(fd, 65536)  # what the bridge wrote to the board (HELLO_REQUEST): read, so its writer never waits


# -- the table -----------------------------------------------------------------------------------------------

COLUMNS = {
    "samples acked / sent (lost)": "the boards' own counters at the end (reliable mode: acked = the bridge said the "
    "sample is safe: answered, or with `--max-unanswered 0` (the throughput rows, and the bridge before this rule) "
    "acknowledged by the broker); lost = samples asked for - acked; in the stock-broker and answered rows, samples "
    "asked for - samples the boards say were answered",
    "resent": "frames the boards sent again (go-back-N: the whole window of 8 after 500 ms without an ACK, or "
    "after a HELLO_REQUEST); the boards start before the bridge, so a second or so of start-up resends is in it",
    "samples/s": "the bridge's `published` (samples the broker acknowledged; one sample per SAMPLES frame) per "
    "second of the bridge's uptime, between its first and last status message of the steady state; in the "
    "stock-broker rows, samples the boards say were answered per second from the bridge's start to the last answer "
    "(with the daemon at `[queue] max_batch = 1`, `[outbox] commit_interval_s = 0.05`: slower than the boards); in "
    "the answered rows, the bridge's `answers_routed` per second of its steady state (the daemon as configured by "
    "default)",
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


PARTS = ("throughput", "answered", "roundtrip", "slow", "kill", "flood")


def code_label(code: Code) -> str:
    return "this tree" if code.tree is None else f"commit {code.label}"


def kill_table(scratch: Path, data: Path, codes: list[Code], runs: int, runs_before: int) -> str:
    """The broker-kill runs of each code, one line per code, and one per run below."""
    header = ("bridge of", "runs", "samples per run", "acknowledged to boards", "answered", "lost (acknowledged, "
              "never answered)", "ANSWER frames sent twice", "runs with a loss", "retaken", "answers_duplicate "
              "(dropped)", "seconds per run")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    per_run: list[str] = []
    for code in codes:
        done = []
        for run in range(runs if code.tree is None else runs_before):
            result = kill_run(scratch, data, run, code)
            done.append(result)
            per_run.append(
                f"- {code_label(code)}, run {run + 1}: acked {result.acked} of {result.sent}, answered "
                f"{result.answered}, lost {result.lost}, sent twice {result.duplicates}, retaken "
                f"{result.counts.get('retaken', '-')}, duplicates dropped {result.counts.get('answers_duplicate', '-')}"
                f", all done {result.done}, {result.seconds:.1f} s, bridge exit code {result.bridge_exit}"
            )
            print(per_run[-1], file=sys.stderr)
        rows.append((
            code_label(code), str(len(done)), str(KILL_BOARDS * KILL_SAMPLES), str(sum(r.acked for r in done)),
            str(sum(r.answered for r in done)), str(sum(r.lost for r in done)), str(sum(r.duplicates for r in done)),
            str(sum(r.lost > 0 for r in done)), str(sum(int(r.counts.get("retaken", 0)) for r in done)),
            str(sum(int(r.counts.get("answers_duplicate", 0)) for r in done)),
            f"{sum(r.seconds for r in done) / max(1, len(done)):.1f}",
        ))  # fmt: skip
    return (
        f"## The broker SIGKILLed twice while boards stream\n\n{KILL_BOARDS} reliable PythonBoards x {KILL_SAMPLES} "
        f"samples at {KILL_RATE_HZ:g} Hz on loopback TCP, one `edgeline bridge`, `edgeline run tests/data/tiny-int8` "
        "(persistent session), a persistent Mosquitto (`persistence true`, `autosave_interval 1`, "
        "`autosave_on_changes true`) SIGKILLed and restarted on its port with its database when a quarter, then half, "
        "of the samples are answered; a fresh broker and daemon each run. Counted from the boards' own stats: lost = "
        "samples acknowledged (ACK) and never answered; sent twice = ANSWER frames - distinct inputs answered. A run "
        f"ends when every board is done and answered, or no answer came for {STUCK_S:g} s after the boards were "
        "done.\n\n" + markdown_table(rows) + "\n\n" + "\n".join(per_run)
    )


def flood_table(scratch: Path, codes: list[Code], hellos: int) -> str:
    """A HELLO flood per code (a new name each time), and one cycling through a few names (this tree)."""
    header = ("bridge of", "HELLOs", "names", "bridge RSS MB before -> after", "Mosquitto RSS MB before -> after",
              "seconds", "boards_known", "names_kept", "retained claims", "HELLOs refused")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    plan = [(code, hellos) for code in codes] + [(THIS_TREE, 16)]
    for code, distinct in plan:
        flood = flood_row(scratch, hellos, distinct, code)
        print(f"flood: {flood}", file=sys.stderr)
        rows.append((
            code_label(code), str(flood.hellos), f"{flood.names}" + (" (a new one each time)" if distinct >= hellos
            else " (in turn)"), f"{flood.bridge_mb[0]:.1f} -> {flood.bridge_mb[1]:.1f}",
            f"{flood.broker_mb[0]:.1f} -> {flood.broker_mb[1]:.1f}", f"{flood.seconds:.1f}",
            str(flood.gauges.get("boards_known")), str(flood.gauges.get("names_kept", "-")),
            str(flood.retained_claims), str(flood.counts.get("serial_refused", "-")),
        ))  # fmt: skip
    return (
        "## A HELLO flood: one port, a board that says HELLO with another device name each time\n\nThe bridge's and "
        "Mosquitto's resident memory (VmRSS) once the bridge has read the first HELLO, and again once its status "
        "says it read them all; `boards_known` and `names_kept` (entries kept by device name) from its last status; "
        "the claims the broker still holds (retained) at the end.\n\n" + markdown_table(rows)
    )


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
    parser.add_argument(
        "--answered-boards", type=int, nargs="+", default=[1, 4], help="rows with the daemon answering (default 1 4)"
    )
    parser.add_argument(
        "--answered-samples", type=int, default=4000, help="samples per answered row, split between boards (4000)"
    )
    parser.add_argument("--kill-runs", type=int, default=20, help="broker-kill runs of the code now (default 20)")
    parser.add_argument("--flood", type=int, default=10_000, help="HELLOs of the flood rows (default 10,000)")
    parser.add_argument(
        "--before", metavar="REF", help="a git commit whose bridge runs beside this tree's in the answered, "
        "broker-kill and flood rows (e.g. the commit before a change)",
    )  # fmt: skip
    parser.add_argument("--kill-runs-before", type=int, default=12, help="broker-kill runs of --before (default 12)")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help=f"what to run (default all: {' '.join(PARTS)})"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8,000 samples a row, 40 round trips")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.count, args.rate, args.slow_samples = 8000, 40, 20.0, 2000
        args.kill_runs, args.kill_runs_before, args.flood, args.answered_samples = 2, 1, 2000, 2000
    began = time.monotonic()
    header = ("row", "boards", "samples acked / sent (lost)", "resent", "samples/s", "bridge CPU µs/sample",
              "bridge CPU", "boards' CPU", "machine busy", "publish p50 / p99 ms", "total p50 / p99 ms")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    notes: list[str] = []
    extra: list[str] = []
    with tempfile.TemporaryDirectory(prefix="edgeline-fwb-") as tmp, running_broker() as broker:
        scratch = Path(tmp)
        data = make_data(scratch / "samples.npz")
        codes = [THIS_TREE] + ([code_of(args.before, scratch)] if args.before else [])
        plan = [(boards, Uart.SOCKET) for boards in args.boards] + ([(1, Uart.PTY)] if args.pty_row else [])
        if "throughput" not in args.parts:
            plan = []
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
            for boards in args.answered_boards if "answered" in args.parts else []:
                for code in codes:  # side by side: the cost of acknowledging at the answer rather than the PUBACK
                    ans = answered_row(broker, scratch, data, boards, args.answered_samples, code)
                    rows.append((
                        f"answered (PythonBoards on loopback TCP, unpaced, reliable; `edgeline run` answering; "
                        f"bridge of {code_label(code)})", str(boards),
                        f"{ans.acked} / {ans.count * ans.boards} ({ans.count * ans.boards - ans.answered} not "
                        f"answered)", "-", f"{ans.rate:.0f} answered", "-", "-", "-", "-", "-", ms(ans.total_ms),
                    ))  # fmt: skip
                    notes.append(
                        f"answered, bridge of {code_label(code)}, {boards} board(s) x {ans.count}: answered "
                        f"{ans.answered}, ANSWER frames {ans.answers}, measured over {ans.window_s:.1f} s; bridge "
                        f"exit code {ans.bridge_exit}"
                    )
                    print(f"answered: {ans}", file=sys.stderr)
            for kind in ("qemu", "python") if "roundtrip" in args.parts else ():
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
        if "kill" in args.parts:
            extra.append(kill_table(scratch, data, codes, args.kill_runs, args.kill_runs_before))
        if "flood" in args.parts:
            extra.append(flood_table(scratch, codes, args.flood))
    for window in (True, False) if "slow" in args.parts else ():  # a fresh broker and daemon each
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
        setting = (
            "window 500 (default: ACK at the answer)"
            if window
            else "no window (--max-unanswered 0: ACK at the PUBACK, as the bridge before its window)"
        )
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
    table = "\n\n".join([markdown_table(rows), *extra])
    publish(table, script=__file__, title="`edgeline bridge`: throughput, CPU, round trip, broker kills and floods",
            intro=intro, write=args.write)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
