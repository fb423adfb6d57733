"""The pressure scenarios of ``benchmarks/daemon_faults.py``: a backlog at restart, a broker slow to acknowledge, a
full disk (docs/design.md, "Backpressure, a full disk, clones"), with ``edgeline run`` as a child process.

- ``backlog``: a first start and a SIGTERM register the daemon's persistent session (MQTT 5, a fixed ``--instance``,
  its own ``--state-dir``); ``--backlog`` inputs (default 50,000) are published while it is stopped and queued by
  the broker (``max_queued_messages`` raised to ``BROKER_QUEUE``: the test default must not be what decides); the
  daemon starts again with ``[outbox] max_answers = 1000`` and answers them.
- ``slow-broker``: a relay between the daemon and the broker lets the broker's PUBACKs to the daemon through at
  ``--acks-per-s`` (300) at most, while ``--slow-inputs`` (4,000) are published at ``--slow-rate`` (1,000/s);
  ``max_answers = 500``.
- ``disk-full``: ``--state-dir`` on a 4 MiB tmpfs of its own (root: mount; unmounted at the end, whatever
  happens), ``[outbox] max_bytes = 2 MiB``, inputs at ``--rate`` all along. After ``WARM_S`` the tmpfs is filled (a
  file written until ENOSPC) for ``--full-s`` (10 s), then freed; ``BETWEEN_S`` later it is filled again, and the
  daemon, once it counts the full disk (``MEET_FULL_S`` at most: SQLite reuses its pages and WAL in place, so a
  daemon that keeps up may never meet it), is SIGTERMed (it must be gone within ``[daemon] drain_timeout_s``) and
  started again on the full disk (it must not crash); the same once more; ``RESTARTED_S`` after the last restart the
  disk is freed, and inputs go on for ``TAIL_S`` at least.

Each with a fresh Mosquitto, ``--state-dir`` and ``--instance``, through ``daemon_faults.TapProxy`` (which places
each loss). Reported: inputs (acknowledged by the broker), answered, lost (and where), duplicated, coded error
answers, the peak outbox depth from the daemon's Prometheus endpoint (``[health] prometheus_port``:
``edgeline_outbox_depth`` scraped every ``SCRAPE_S``, so a lower bound of the true peak) against its cap, the peak
RSS (VmHWM, the max over the daemon's processes), the lines the daemon wrote on stderr (its log: warnings and errors
among them), the intake gate's pauses (``edgeline_intake_pauses_total``, summed over processes) and the time until
the last first answer (from the restart for ``backlog``, from the first input otherwise). The notes under the table
give each SIGTERM's exit code and time, the daemon's loss counters, the peaks of its ``intake_held``,
``queue_depth`` and ``in_flight`` gauges, the most inputs one daemon process held unanswered (the proxy's view),
and its warnings and errors.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from daemon_faults import (
    END_TIMEOUT_S,
    SETTLE_S,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Daemons,
    Tally,
    TapProxy,
    TimedCollector,
    _varint,
    acknowledged_ids,
    daemon_command,
    loss_notes,
    make_inputs,
    settle,
    spawn_subscribed,
    tally,
    wait_for,
)

from tests.faults import DurablePublisher
from tests.mqtt_broker import Broker, free_port

__all__ = ["PRESSURE_SCENARIOS", "PressureOutcome", "pressure_intro", "pressure_table", "run_pressure"]

PRESSURE_SCENARIOS = ("backlog", "slow-broker", "disk-full")
BROKER_QUEUE = 200_000
"""Mosquitto's ``max_queued_messages`` per client here: far above any backlog (at most 65,535 inputs)."""
BACKLOG_MAX_ANSWERS = 1000
SLOW_MAX_ANSWERS = 500
DISK_SIZE = "4m"
DISK_BYTES = 4 << 20
DISK_MAX_BYTES = 2 << 20
DRAIN_TIMEOUT_S = 10.0
"""``[daemon] drain_timeout_s`` (its default, written out): a stop on a full disk must end within it."""
EXIT_MARGIN_S = 2.0
"""A stop may take this long beyond the drain time (the interpreter's exit) and still count as within it."""
WARM_S, BETWEEN_S, BEFORE_STOP_S, RESTARTED_S, TAIL_S = 5.0, 10.0, 3.0, 5.0, 20.0
"""disk-full's phases: before the first fill; between the two; full before the SIGTERM; the restarted daemon on the
full disk; publishing after the disk is freed (the first episode lasts ``--full-s``)."""
MEET_FULL_S = 10.0
"""Before the SIGTERM, wait this long at most for the daemon to count the full disk."""
FULL_COUNTER = "edgeline_disk_full_total"
FULL_LOG = "the disk is full"
"""What the daemon logs (once per process) when a commit meets the full disk."""
LOG_LINES = 10_000
PUBLISH_TIMEOUT_S = 300.0
BACKLOG_TIMEOUT_S = 900.0
"""How long the restarted daemon gets to answer the whole backlog."""
BACKLOG_QUIET_S = 30.0
"""...unless no new answer came for this long."""
SCRAPE_S = 0.1
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$")
LEVEL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$")
PUBACK = 4
OUTSIDE = "(not a log record) "


# --- the broker, a slow one, a small disk, the daemon's metrics -------------------------------------------------


class QueueingBroker(Broker):
    """A ``Broker`` whose Mosquitto queues up to ``BROKER_QUEUE`` messages per client (no byte limit)."""

    def _write_config(self) -> None:
        super()._write_config()
        text = re.sub(r"(?m)^max_queued_(messages|bytes) .*\n", "", self.config_path.read_text(encoding="utf-8"))
        queue = f"max_queued_messages {BROKER_QUEUE}\nmax_queued_bytes 0\n"
        self.config_path.write_text(text + queue, encoding="utf-8")


class AckPacer:
    """Gives each PUBACK its turn: ``per_s`` a second at most, over every connection of one relay."""

    def __init__(self, per_s: float) -> None:
        self.interval = 1.0 / per_s
        self.paced = 0
        self._next = 0.0
        self._lock = threading.Lock()

    def wait_turn(self) -> None:
        with self._lock:
            self._next = max(self._next + self.interval, time.monotonic())
            turn = self._next
            self.paced += 1
        time.sleep(max(0.0, turn - time.monotonic()))


class _PacedSocket:
    """What ``BlackHoleProxy._pump`` writes to (it only calls ``sendall``): whole MQTT packets, each PUBACK after
    its turn. Every other packet passes at once, though behind a PUBACK that waits, as on a slow link."""

    def __init__(self, sock: socket.socket, pacer: AckPacer) -> None:
        self.sock = sock
        self.pacer = pacer
        self.buffer = bytearray()

    def sendall(self, data: bytes) -> None:
        self.buffer += data
        ready = bytearray()
        while len(self.buffer) >= 2:
            length, start = _varint(self.buffer, 1)
            if length is None or len(self.buffer) < start + length:
                break
            if self.buffer[0] >> 4 == PUBACK:
                if ready:
                    self.sock.sendall(ready)
                    ready.clear()
                self.pacer.wait_turn()
            ready += self.buffer[: start + length]
            del self.buffer[: start + length]
        if ready:
            self.sock.sendall(ready)


class SlowAckProxy(TapProxy):
    """A ``TapProxy`` that holds the broker's PUBACKs to the daemon to ``acks_per_s``: a broker slow to
    acknowledge the daemon's answers."""

    def __init__(self, target_host: str, target_port: int, *, inputs: str, outputs: str, acks_per_s: float) -> None:
        self.pacer = AckPacer(acks_per_s)  # before the accept thread starts
        super().__init__(target_host, target_port, inputs=inputs, outputs=outputs)

    def _pump(self, link: object, source: socket.socket, sink: socket.socket | None) -> None:
        if source is getattr(link, "upstream", None) and sink is not None:
            sink = _PacedSocket(sink, self.pacer)  # type: ignore[assignment]  # sendall is all _pump uses
        super()._pump(link, source, sink)


@contextlib.contextmanager
def small_disk(directory: Path) -> Iterator[Path]:
    """A ``DISK_SIZE`` tmpfs mounted on ``directory`` (made here), unmounted on the way out whatever happened."""
    directory.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(directory)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield directory
    finally:
        done = subprocess.run(["umount", str(directory)], check=False, capture_output=True, timeout=30)
        if done.returncode != 0:  # still busy (a process that would not die): detach it, freed once unused
            subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True, timeout=30)


def fill(filler: Path) -> int:
    """Take every free byte of ``filler``'s file system (writes until ENOSPC, smaller and smaller); bytes written."""
    chunk = bytes(1 << 16)
    written = 0
    fd = os.open(filler, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 512, 1):
            try:
                for _ in range(DISK_BYTES // size + 1):
                    written += os.write(fd, chunk[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    return written


class MetricsScraper:
    """Reads the daemon's Prometheus endpoint every ``SCRAPE_S`` in the background, across its restarts (the
    port is the configuration's; between two processes nobody answers, and that scrape is skipped)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.scrapes = 0
        self._peaks: dict[str, float] = {}
        self._last: dict[float, dict[str, float]] = {}
        """Per process (its ``process_start_time_seconds``), the last value of each sample."""
        self._latest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()

    def peak(self, name: str) -> float | None:
        with self._lock:
            return self._peaks.get(name)

    def latest(self, name: str) -> float:
        """The value of ``name`` in the last scrape (0 before any)."""
        with self._lock:
            return self._latest.get(name, 0.0)

    def total(self, name: str) -> int:
        """A counter summed over the daemon's processes (each starts from zero), from each one's last scrape."""
        with self._lock:
            return int(sum(values.get(name, 0.0) for values in self._last.values()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_S):
            try:
                with urllib.request.urlopen(self.url, timeout=1.0) as response:
                    text = response.read().decode()
            except (OSError, ValueError, http.client.HTTPException):
                continue
            values: dict[str, float] = {}
            for line in text.splitlines():
                if found := SAMPLE.match(line):
                    with contextlib.suppress(ValueError):
                        values.setdefault(found.group(1), float(found.group(2)))
            with self._lock:
                self.scrapes += 1
                self._last[values.get("process_start_time_seconds", 0.0)] = values
                self._latest = values
                for name, value in values.items():
                    self._peaks[name] = max(self._peaks.get(name, value), value)


# --- one scenario ------------------------------------------------------------------------------------------------


@dataclass
class Rig:
    """One scenario's broker, proxy, daemon processes, clients and scraper (the scenario's ExitStack closes them)."""

    broker: Broker
    proxy: TapProxy
    daemons: Daemons
    answers: TimedCollector
    publisher: DurablePublisher
    metrics: MetricsScraper
    client_id: str
    subscription: str
    inputs: list[tuple[str, bytes]]
    spawns: list[float] = field(default_factory=list)
    """When each daemon process was started (time.time())."""
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """What went wrong in the daemon (an exit code other than 0, a stop beyond its drain time): reported loudly."""

    def start_daemon(self, timeout: float = START_TIMEOUT_S) -> float:
        self.spawns.append(time.time())
        return spawn_subscribed(self.daemons, self.broker, self.client_id, self.subscription, timeout)

    def check_alive(self, when: str) -> None:
        """If the daemon died, say so (with its log) and start a new one, so that the count goes on."""
        code = self.daemons.current.poll()
        if code is None:
            return
        self.failures.append(f"the daemon DIED {when}: exit code {code}; its log ends:\n{self.daemons.log_tail()}")
        self.start_daemon()

    def stop_daemon(self, when: str) -> float:
        """SIGTERM the current daemon; how long it took to go. Its exit code goes to the notes."""
        began = time.monotonic()
        code = self.daemons.stop()
        took = time.monotonic() - began
        self.notes.append(f"SIGTERM {when}: exit {code if code is not None else 'none (SIGKILLed)'} in {took:.1f} s")
        if code != 0:
            self.failures.append(f"SIGTERM {when}: exit code {code}; its log ends:\n{self.daemons.log_tail()}")
        return took

    def publish(self, rate: float | None) -> threading.Thread:
        sender = threading.Thread(
            target=self.publisher.publish_all, args=(self.inputs, rate), name="publisher", daemon=True
        )
        sender.start()
        return sender

    def finish_publishing(self, sender: threading.Thread) -> set[str]:
        """Wait (bounded) for the publisher and the broker's PUBACKs; the ids the broker acknowledged."""
        sender.join(timeout=PUBLISH_TIMEOUT_S)
        if sender.is_alive():
            raise RuntimeError("the publisher did not finish")
        if not self.publisher.wait_acknowledged(PUBLISH_TIMEOUT_S):
            self.notes.append(f"{len(self.publisher.pending)} inputs never acknowledged by the broker")
        return acknowledged_ids(self.publisher)


@dataclass
class PressureOutcome:
    scenario: str
    inputs: int
    acknowledged: int
    counted: Tally
    cap: str
    peak_outbox: float | None
    peak_rss_mb: float
    log_levels: Counter[str]
    """Lines the daemon wrote on stderr, by level ("other": tracebacks and anything not in its log format)."""
    worst: Counter[str]
    """Its warning and error messages (without their time) and its lines outside the log format, counted."""
    intake_pauses: int
    answering_s: float | None
    seconds: float
    notes: list[str]
    failures: list[str]
    exits: list[int | None]


def run_pressure(scenario: str, bundle: Path, args: argparse.Namespace, scratch: Path) -> PressureOutcome:
    import edgeline

    name = edgeline.read_bundle(bundle).manifest.name
    tag = uuid.uuid4().hex[:8]
    instance = f"pressure-{scenario}-{tag}"
    prefix = f"pressure/{tag}"
    work = scratch / scenario
    work.mkdir()
    count = {"backlog": args.backlog, "slow-broker": args.slow_inputs}.get(scenario)
    if count is None:  # disk-full: as many as its phases take at --rate, at most
        stops = 2 * (MEET_FULL_S + DRAIN_TIMEOUT_S + RESTARTED_S)
        count = int(args.rate * (WARM_S + args.full_s + BETWEEN_S + BEFORE_STOP_S + stops + TAIL_S))
    port = free_port()
    outbox, cap = {
        "backlog": (f"max_answers = {BACKLOG_MAX_ANSWERS}", f"{BACKLOG_MAX_ANSWERS} answers"),
        "slow-broker": (f"max_answers = {SLOW_MAX_ANSWERS}", f"{SLOW_MAX_ANSWERS} answers"),
        "disk-full": (f"max_bytes = {DISK_MAX_BYTES}", f"{DISK_MAX_BYTES >> 20} MiB"),
    }[scenario]
    config = work / "daemon.toml"
    config.write_text(
        f"[daemon]\ndrain_timeout_s = {DRAIN_TIMEOUT_S}\n\n[outbox]\n{outbox}\n\n[health]\nprometheus_port = {port}\n"
    )
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        state = work
        if scenario == "disk-full":
            state = stack.enter_context(small_disk(work / "disk"))
            (state / "filler").touch()  # made while there is room: each fill appends to it
        broker = QueueingBroker(work / "broker").start()
        stack.callback(broker.stop)
        topics = {"inputs": f"{prefix}/in/", "outputs": f"{prefix}/out/"}
        proxy = (
            SlowAckProxy(broker.host, broker.port, **topics, acks_per_s=args.acks_per_s)
            if scenario == "slow-broker"
            else TapProxy(broker.host, broker.port, **topics)
        )
        stack.callback(proxy.close)
        daemons = Daemons(daemon_command(bundle, proxy.address, prefix, state, instance, config), work)
        stack.callback(daemons.close)
        answers = TimedCollector(broker, f"{prefix}/out/#")
        answers.start_and_subscribe()
        stack.callback(answers.close)
        publisher = DurablePublisher(broker)
        publisher.start()
        stack.callback(publisher.close)
        if not publisher.wait_connected(START_TIMEOUT_S):
            raise RuntimeError("the publisher did not connect")
        metrics = MetricsScraper(port)
        stack.callback(metrics.close)
        rig = Rig(
            broker=broker,
            proxy=proxy,
            daemons=daemons,
            answers=answers,
            publisher=publisher,
            metrics=metrics,
            client_id=f"edgeline-{name}-{instance}",
            subscription=f"{prefix}/in/+",
            inputs=make_inputs(bundle, count, f"{prefix}/in/dev"),
        )
        if scenario == "backlog":
            acknowledged, since = _backlog(rig)
        elif scenario == "slow-broker":
            acknowledged, since = _slow_broker(rig, args)
        else:
            acknowledged, since = _disk_full(rig, args, state / "filler")
        rig.stop_daemon("at the end")
        if isinstance(proxy, SlowAckProxy):
            rig.notes.append(f"the relay paced {proxy.pacer.paced} PUBACKs at {args.acks_per_s:g}/s at most")
        metrics.close()
        events = list(proxy.events)
        with open(work / "wire.tsv", "w") as out:
            out.writelines(f"{moment:.3f}\t{kind}\t{identity}\n" for moment, kind, identity in events)
        rig.notes.append(
            f"at most {_most_outstanding(events, rig.spawns)} inputs were with a daemon process unanswered at once "
            "(delivered to it, no answer sent yet: the proxy's view)"
        )
        last = max(answers.first_seen.values(), default=None)
        lines = list(daemons.log_lines())
        levels, worst = _read_log(lines)
        for number in range(len(daemons.processes)):
            text = (work / f"daemon-{number}.log").read_text(encoding="utf-8", errors="replace")
            if found := re.search(r"(\d+) answers stay in the outbox", text):
                rig.notes.append(f"daemon process {number} stopped with {found.group(1)} answers in its outbox")
        if metrics.scrapes == 0:
            rig.failures.append("the Prometheus endpoint never answered: no outbox depth, no counters")
        counters = ("outbox_overflowed", "dropped", "disk_full", "outbox_expired")
        rig.notes.append(", ".join(f"`edgeline_{c}_total` {metrics.total(f'edgeline_{c}_total')}" for c in counters))
        peaks = {gauge: metrics.peak(f"edgeline_{gauge}") for gauge in ("intake_held", "queue_depth", "in_flight")}
        rig.notes.append(
            "peaks: " + ", ".join(f"`{gauge}` {value:.0f}" for gauge, value in peaks.items() if value is not None)
        )
        return PressureOutcome(
            scenario=scenario,
            inputs=len(rig.inputs),
            acknowledged=len(acknowledged),
            counted=tally(answers.payloads, acknowledged, proxy),
            cap=cap,
            peak_outbox=metrics.peak("edgeline_outbox_depth"),
            peak_rss_mb=daemons.peak_rss_mb,
            log_levels=levels,
            worst=worst,
            intake_pauses=metrics.total("edgeline_intake_pauses_total"),
            answering_s=(last - since) if last is not None else None,
            seconds=time.monotonic() - started,
            notes=rig.notes,
            failures=rig.failures,
            exits=[process.returncode for process in daemons.processes],
        )
    raise AssertionError("unreachable")  # pragma: no cover


def _backlog(rig: Rig) -> tuple[set[str], float]:
    rig.start_daemon()
    rig.stop_daemon("after the first start (the session is registered)")
    began = time.monotonic()
    acknowledged = rig.finish_publishing(rig.publish(None))
    rig.notes.append(
        f"{len(acknowledged)} inputs acknowledged by the broker in {time.monotonic() - began:.0f} s while the daemon "
        "was stopped"
    )
    since = rig.start_daemon()
    settle(rig.answers, acknowledged, timeout=BACKLOG_TIMEOUT_S, quiet_s=BACKLOG_QUIET_S)
    return acknowledged, since


def _slow_broker(rig: Rig, args: argparse.Namespace) -> tuple[set[str], float]:
    rig.start_daemon()
    since = time.time()
    acknowledged = rig.finish_publishing(rig.publish(args.slow_rate))
    rig.notes.append(f"published in {time.time() - since:.1f} s")
    settle(rig.answers, acknowledged, timeout=len(rig.inputs) / args.acks_per_s + END_TIMEOUT_S)
    return acknowledged, since


def _disk_full(rig: Rig, args: argparse.Namespace, filler: Path) -> tuple[set[str], float]:
    rig.start_daemon()
    since = time.time()
    sender = rig.publish(args.rate)

    def at(offset: float) -> None:
        while time.time() < since + offset:  # bounded: the offsets are a minute at most
            time.sleep(0.05)

    def episode(what: str) -> float:
        """Fill the disk; the daemon's count of full-disk episodes before it."""
        before = rig.metrics.latest(FULL_COUNTER)
        written = fill(filler)
        print(f"  [disk-full] {what}", file=sys.stderr, flush=True)
        rig.notes.append(f"{what} at {time.time() - since:.1f} s ({written / 1e6:.2f} MB of filler)")
        return before

    def met(before: float | None) -> bool:
        """Whether the current daemon has met the full disk: its counter went past ``before``; for a daemon started
        on the full disk (None), its own log says so (logged once per process; its counter starts at 0)."""
        if before is None:
            return FULL_LOG in rig.daemons.log_tail(LOG_LINES)
        return rig.metrics.latest(FULL_COUNTER) > before

    def sigterm_on_full_disk(which: str, before: float | None) -> bool:
        """Give the daemon time to meet the full disk (committer retrying, intake shut: what the SIGTERM is meant
        for; SQLite reuses its WAL in place, so some commits may still pass), SIGTERM it; whether it is alive."""
        wait_for(lambda: met(before), MEET_FULL_S)
        code = rig.daemons.current.poll()
        if code is not None:
            rig.failures.append(
                f"{which} DIED on the full disk: exit code {code}; its log ends:\n{rig.daemons.log_tail()}"
            )
            return False
        knew = "had met" if met(before) else "had NOT met"
        took = rig.stop_daemon(f"to {which} on the full disk (it {knew} the full disk)")
        if took > DRAIN_TIMEOUT_S + EXIT_MARGIN_S:
            rig.failures.append(f"the stop on the full disk took {took:.1f} s, drain time {DRAIN_TIMEOUT_S:g} s")
        return True

    def free() -> None:
        filler.unlink()
        filler.touch()
        rig.notes.append(f"disk freed at {time.time() - since:.1f} s")

    at(WARM_S)
    before = episode(f"disk full for {args.full_s:g} s")
    at(WARM_S + args.full_s)
    rig.check_alive("on the full disk")
    rig.notes.append(f"before the disk was freed, the daemon {'had' if met(before) else 'had NOT'} met it")
    free()
    at(WARM_S + args.full_s + BETWEEN_S)
    rig.check_alive("after the disk was freed")
    before = episode("disk full again, for SIGTERMs and restarts")
    at(WARM_S + args.full_s + BETWEEN_S + BEFORE_STOP_S)
    if (
        sigterm_on_full_disk("the first daemon", before)
        and _restart_on_full_disk(rig)
        and sigterm_on_full_disk("the restarted daemon", None)
    ):
        _restart_on_full_disk(rig)
    free()
    if rig.daemons.current.poll() is not None:
        rig.start_daemon()
        rig.notes.append("a new daemon started once the disk was freed")
    acknowledged = rig.finish_publishing(sender)
    rig.check_alive("after the disk was freed again")
    settle(rig.answers, acknowledged, timeout=END_TIMEOUT_S, quiet_s=SETTLE_S)
    return acknowledged, since


def _restart_on_full_disk(rig: Rig) -> bool:
    """Start the daemon on the full disk and watch it for ``RESTARTED_S``; whether it lives (if not: the failures)."""
    began = time.monotonic()
    try:
        rig.start_daemon(timeout=RESTARTED_S + STOP_TIMEOUT_S)
    except RuntimeError as exc:
        rig.failures.append(f"the restart on the full disk failed: {exc}")
    while rig.daemons.current.poll() is None and time.monotonic() - began < RESTARTED_S:
        time.sleep(0.1)
    code = rig.daemons.current.poll()
    if code is None:
        rig.notes.append(f"restarted on the full disk: subscribed and alive after {time.monotonic() - began:.1f} s")
        return True
    rig.failures.append(
        f"the restart on the full disk CRASHED: exit code {code} after {time.monotonic() - began:.1f} s; its log "
        f"ends:\n{rig.daemons.log_tail()}"
    )
    return False


def _most_outstanding(events: list[tuple[float, str, str]], spawns: list[float]) -> int:
    """The most inputs delivered to one daemon process and not answered by it yet, at any moment."""
    delivered: set[str] = set()
    answered: set[str] = set()
    now = most = 0
    starts = iter([*sorted(spawns)[1:], float("inf")])
    next_start = next(starts)
    for moment, kind, identity in events:
        while moment >= next_start:  # a new process: the broker sends it again what the last one did not acknowledge
            delivered.clear()
            answered.clear()
            now, next_start = 0, next(starts)
        if kind == "input" and identity not in delivered:
            delivered.add(identity)
            now += identity not in answered
        elif kind == "answer" and identity not in answered:
            answered.add(identity)
            now -= identity in delivered
        most = max(most, now)
    return most


def _read_log(lines: Iterable[str]) -> tuple[Counter[str], Counter[str]]:
    levels: Counter[str] = Counter()
    worst: Counter[str] = Counter()
    for line in lines:
        found = LEVEL.match(line)
        level = found.group(1) if found else "other"
        levels[level] += 1
        if level in ("WARNING", "ERROR", "CRITICAL", "other"):
            worst[f"{level} {found.group(2)}" if found else f"{OUTSIDE}{line}"] += 1
    return levels, worst


# --- report ------------------------------------------------------------------------------------------------------


def pressure_intro(args: argparse.Namespace) -> str:
    return (
        f"Pressure: `{args.bundle.name}` at QoS 1, MQTT 5, through the tapping proxy of the fault scenarios; "
        f"Mosquitto queues up to {BROKER_QUEUE:,} messages per client. `backlog`: {args.backlog:,} inputs queued "
        f"while the daemon was stopped, then a start with `max_answers = {BACKLOG_MAX_ANSWERS}`. `slow-broker`: "
        f"{args.slow_inputs:,} inputs at {args.slow_rate:g}/s, the broker's PUBACKs to the daemon held to "
        f"{args.acks_per_s:g}/s, `max_answers = {SLOW_MAX_ANSWERS}`. `disk-full`: `--state-dir` on a "
        f"{DISK_BYTES >> 20} MiB tmpfs, `max_bytes = {DISK_MAX_BYTES}`, inputs at {args.rate:g}/s; the disk filled "
        f"at {WARM_S:g} s for {args.full_s:g} s, filled again {BETWEEN_S:g} s later; then SIGTERM (once the daemon "
        f"counts the full disk, {MEET_FULL_S:g} s at most), restart on the full disk, the same again, the disk freed "
        f"{RESTARTED_S:g} s after the last restart. Peak outbox: `edgeline_outbox_depth` from the daemon's "
        f"Prometheus endpoint, scraped every {SCRAPE_S:g} s (a lower bound). Log lines: what the daemon's processes "
        "wrote on stderr (warnings / errors). Answered in: from the restart (`backlog`) or the first input to the "
        "last first answer. The rest is in the docstring of `benchmarks/daemon_pressure.py`."
    )


def pressure_table(outcomes: list[PressureOutcome]) -> str:
    lines = [
        "| scenario | inputs (acked by broker) | answered | lost: in broker / answer in broker / by daemon "
        "| duplicated (extra copies) | error answers | peak outbox, Prometheus (cap) | peak RSS MB "
        "| log lines (warnings / errors) "
        "| intake pauses | answered in s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for o in outcomes:
        c = o.counted
        errors = ", ".join(f"{n} {code}" for code, n in c.errors.items()) or "0"
        peak = f"{o.peak_outbox:.0f}" if o.peak_outbox is not None else "-"
        serious = o.log_levels["ERROR"] + o.log_levels["CRITICAL"]
        took = f"{o.answering_s:.1f}" if o.answering_s is not None else "-"
        lines.append(
            f"| {o.scenario} | {o.inputs} ({o.acknowledged}) | {c.answered} "
            f"| **{c.lost}**: {len(c.lost_in_broker)} / {len(c.answer_lost_in_broker)} / {len(c.lost_by_daemon)} "
            f"| {c.duplicated} ({c.extra_copies}) | {errors} | {peak} ({o.cap}) | {o.peak_rss_mb:.0f} "
            f"| {o.log_levels.total()} ({o.log_levels['WARNING']} / {serious}) | {o.intake_pauses} | {took} |"
        )
        notes += loss_notes(o.scenario, c)
        for failure in o.failures:
            summary, _, log = failure.partition("\n")
            notes.append(f"- {o.scenario}: **{summary}**")
            if log:  # the daemon's last lines, as a block inside the list item
                notes += ["", "  ```", *(f"  {line[:400]}" for line in log.splitlines()), "  ```", ""]
        notes += [f"- {o.scenario}: {note}" for note in o.notes]
        records = [(message, n) for message, n in o.worst.most_common() if not message.startswith(OUTSIDE)]
        notes += [f"- {o.scenario}: logged {n}x: `{message[:300]}`" for message, n in records[:8]]
        if outside := o.log_levels["other"]:
            first = next(message for message in o.worst if message.startswith(OUTSIDE))
            notes.append(
                f"- {o.scenario}: {outside} lines outside the log format, the first: `{first[len(OUTSIDE) :]}`"
            )
        notes.append(
            f"- {o.scenario}: {len(o.exits)} daemon process(es), exit codes {o.exits}, {o.seconds:.0f} s; the proxy "
            f"saw {c.tapped[0]} of the acknowledged inputs reach the daemon and {c.tapped[1]} answers leave it"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(notes)
