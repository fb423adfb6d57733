"""`edgeline run` under long fault runs at QoS 1: what is lost, what is duplicated, how fast it recovers, what it costs.

Six scenarios, one after the other, each with a fresh Mosquitto, a fresh ``--state-dir`` and a unique ``--instance``;
three faults here, and three kinds of pressure (``backlog``, ``slow-broker``, ``disk-full``: ``benchmarks/
daemon_pressure.py``, which says what they do and report; ``disk-full`` needs root):

- ``broker-kill``: N inputs (default 10,000) while the broker (persistence on, autosave on every change) is
  SIGKILLed and restarted K times (default 10), down 0.5 s each time;
- ``daemon-kill``: N inputs while the daemon is SIGKILLed K times and restarted at once, same state and instance;
- ``black-hole``: N inputs while a loopback TCP proxy between daemon and broker stops forwarding without closing
  anything (``tests.faults.BlackHoleProxy``), H times (default 3) for 10 s; ``[broker] keepalive_s = 2``.

The bundle is the digits classifier (LiteRT int8): its 64-float inputs are ~0.4 kB of JSON. With DS-CNN's 490 floats
(~3.5 kB) Mosquitto's save on every change cannot keep up at 150/s once a broker restart leaves a backlog: its
database grows past 10 MB, each save rewrites it, and the run measures Mosquitto's disk rather than the daemon (a
5,000-input run took 3 minutes to drain); ``--bundle`` with a lower ``--rate`` runs it anyway.

Inputs are JSON ``{"id": ..., "data": [...]}`` for the bundle's input, published at a fixed rate (default 150/s) by
``tests.faults.DurablePublisher`` (persistent session, resends what the broker did not acknowledge); answers are
collected by ``DurableCollector`` (persistent session). The daemon always connects through a proxy that reads the
MQTT stream it forwards (forwarding everything, except during a black hole), so each input the broker acknowledged
and that got no answer is put in one of three places: the broker never delivered it to the daemon ("lost in the
broker"), the daemon published its answer and the broker did not deliver it ("answer lost in the broker"), or the
daemon received it and never published its answer ("lost by the daemon").

Reported per scenario: inputs, faults, answered, lost (and where), duplicated (inputs answered more than once; QoS 1
allows it), coded error answers, recovery time (fault end -> the first answer to an input never answered before;
fault end is the broker's restart, the new daemon's spawn, the proxy's resume), time to notice a black hole (the
daemon's "lost the broker" log line), the daemon's peak RSS (VmHWM, the max over its processes) and the peak outbox
depth in its status messages (``[health] status_interval_s = 0.5``).

    python benchmarks/daemon_faults.py --write benchmarks/results/daemon_faults.md

``--write`` appends the tables to the file as a dated section (the command line with them), below earlier runs. A
smoke run: ``python benchmarks/daemon_faults.py --quick`` (300 inputs, 1 fault of each kind, a 4 s black hole, a
backlog of 2,000, ...), or choose ``--messages N --faults K --holes H --rate R --scenarios ...`` and the pressure
scenarios' ``--backlog``, ``--slow-inputs``, ``--slow-rate``, ``--acks-per-s``, ``--full-s``. Full scale takes
about 8 minutes.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults import BlackHoleProxy, DurableCollector, DurablePublisher
from tests.mqtt_broker import Broker

TITLE = "Daemon under long fault runs"
SCENARIOS = ("broker-kill", "daemon-kill", "black-hole")
ALL_SCENARIOS = (*SCENARIOS, "backlog", "slow-broker", "disk-full")
"""The last three are ``daemon_pressure``'s."""
STATUS_INTERVAL_S = 0.5
BLACK_HOLE_KEEPALIVE_S = 2
BROKER_DOWN_S = 0.5
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
RECOVERY_TIMEOUT_S = 60.0
"""Before the next fault, wait this long at most for the first new answer after the last one."""
SETTLE_S = 10.0
"""At the end, stop waiting for answers once none has arrived for this long (or all arrived)."""
END_TIMEOUT_S = 180.0
SAMPLE_S = 0.2
ID = re.compile(rb'"id"\s*:\s*"([^"]*)"')


def payload_id(payload: bytes) -> str | None:
    found = ID.search(payload)
    return found.group(1).decode() if found else None


# --- the daemon's side of the wire ---------------------------------------------------------------------------


def _varint(buffer: bytearray, position: int) -> tuple[int | None, int]:
    value = shift = 0
    while position < len(buffer):
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position
        if shift > 21:
            raise ValueError("malformed MQTT remaining length")
    return None, position


class PublishReader:
    """Reads one direction of an MQTT 5 connection and reports each PUBLISH as (topic, payload)."""

    def __init__(self, on_publish: Callable[[str, bytes], None]) -> None:
        self.on_publish = on_publish
        self.buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 2:
            length, start = _varint(self.buffer, 1)
            if length is None or len(self.buffer) < start + length:
                return
            first, body = self.buffer[0], bytes(self.buffer[start : start + length])
            del self.buffer[: start + length]
            if first >> 4 == 3:  # PUBLISH
                (size,) = struct.unpack_from(">H", body)
                topic = body[2 : 2 + size].decode(errors="replace")
                position = 2 + size + (2 if (first >> 1) & 3 else 0)  # the packet id, at QoS 1 and 2
                properties, position = _varint(bytearray(body), position)
                self.on_publish(topic, body[position + (properties or 0) :])


class _TappedSocket:
    """What ``BlackHoleProxy._pump`` reads from: the socket, with every chunk also fed to a ``PublishReader``."""

    def __init__(self, sock: socket.socket, reader: PublishReader) -> None:
        self.sock = sock
        self.reader = reader

    def recv(self, size: int) -> bytes:
        data = self.sock.recv(size)
        try:
            self.reader.feed(data)
        except (ValueError, struct.error):  # a stream we cannot read (cut by a black hole): start over
            self.reader.buffer.clear()
        return data


class TapProxy(BlackHoleProxy):
    """A ``BlackHoleProxy`` that also records the ids of the inputs the broker sent to the daemon and of the answers
    the daemon sent to the broker (bytes dropped during a pause are not forwarded, so not recorded either)."""

    def __init__(self, target_host: str, target_port: int, *, inputs: str, outputs: str) -> None:
        self.delivered: set[str] = set()
        self.answered: set[str] = set()
        self.events: list[tuple[float, str, str]] = []
        """(time.time(), "input" or "answer", id) of every PUBLISH seen, for a look afterwards (``--keep``)."""
        self._inputs, self._outputs = inputs, outputs
        super().__init__(target_host, target_port)

    def _pump(self, link: Any, source: socket.socket, sink: socket.socket | None) -> None:
        to_daemon = source is link.upstream

        def seen(topic: str, payload: bytes) -> None:
            if self._paused:
                return
            identity = payload_id(payload)
            if identity is None:
                return
            now = time.time()
            if to_daemon and topic.startswith(self._inputs):
                self.delivered.add(identity)
                self.events.append((now, "input", identity))
            elif not to_daemon and topic.startswith(self._outputs):
                self.answered.add(identity)
                self.events.append((now, "answer", identity))

        super()._pump(link, _TappedSocket(source, PublishReader(seen)), sink)  # type: ignore[arg-type]


# --- clients ---------------------------------------------------------------------------------------------------


class TimedCollector(DurableCollector):
    """A ``DurableCollector`` that also stamps the first arrival of each id (time.time())."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_seen: dict[str, float] = {}
        self.new_times: list[float] = []

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        now = time.time()
        identity = payload_id(bytes(message.payload))
        with self._state:
            if identity is not None and identity not in self.first_seen:
                self.first_seen[identity] = now
                self.new_times.append(now)
        super()._on_message(client, userdata, message)

    def first_new_after(self, moment: float) -> float | None:
        """When the first answer to a never-answered input arrived after ``moment``; None if none yet."""
        with self._state:
            index = bisect.bisect_left(self.new_times, moment)
            return self.new_times[index] if index < len(self.new_times) else None

    def count_new(self) -> int:
        with self._state:
            return len(self.first_seen)


class Daemons:
    """The daemon's processes, one at a time (restarted after a kill); samples each one's VmHWM while it lives."""

    def __init__(self, command: list[str], logs: Path) -> None:
        self.command = command
        self.logs = logs
        self.processes: list[subprocess.Popen[bytes]] = []
        self.peak_kb: dict[int, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sampler = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._sampler.start()

    @property
    def current(self) -> subprocess.Popen[bytes]:
        return self.processes[-1]

    def spawn(self) -> float:
        """Start one more daemon (stderr, its log, to ``daemon-N.log``; stdout to ``daemon-N.out``); the time it was
        started."""
        number = len(self.processes)
        log, out = self.logs / f"daemon-{number}.log", self.logs / f"daemon-{number}.out"
        with open(log, "wb") as stderr, open(out, "wb") as stdout:
            started = time.time()
            process = subprocess.Popen(self.command, stdout=stdout, stderr=stderr)
        with self._lock:
            self.processes.append(process)
        return started

    def kill(self) -> None:
        """SIGKILL the current daemon (its VmHWM read just before) and reap it."""
        process = self.current
        self._read(process)
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> int | None:
        """SIGTERM the current daemon (it drains), bounded; its exit code (None if it had to be killed)."""
        process = self.current
        if process.poll() is not None:
            return process.returncode
        self._read(process)
        process.terminate()
        try:
            return process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)
            return None

    def close(self) -> None:
        """Kill whatever still runs and stop sampling. Safe to call twice."""
        self._stop.set()
        with self._lock:
            processes = list(self.processes)
        for process in processes:
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=STOP_TIMEOUT_S)
        self._sampler.join(timeout=2.0)

    @property
    def peak_rss_mb(self) -> float:
        with self._lock:
            return max(self.peak_kb.values(), default=0) / 1024

    def log_lines(self) -> Iterator[str]:
        """What every daemon process wrote on stderr, process after process."""
        for number in range(len(self.processes)):
            path = self.logs / f"daemon-{number}.log"
            yield from path.read_text(encoding="utf-8", errors="replace").splitlines()

    def log_tail(self, lines: int = 20) -> str:
        """The current process's last log lines, for an error message."""
        path = self.logs / f"daemon-{len(self.processes) - 1}.log"
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def _read(self, process: subprocess.Popen[bytes]) -> None:
        try:
            text = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            return
        for line in text.splitlines():
            if line.startswith("VmHWM:"):
                with self._lock:
                    self.peak_kb[process.pid] = max(self.peak_kb.get(process.pid, 0), int(line.split()[1]))

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with self._lock:
                live = [p for p in self.processes if p.poll() is None]
            for process in live:
                self._read(process)


def log_time(line: str) -> float | None:
    """The time.time() of a daemon log line (``%(asctime)s``: local time, milliseconds after a comma)."""
    try:
        stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
        return stamp + int(line[20:23]) / 1000
    except (ValueError, OverflowError):
        return None


def daemon_command(bundle: Path, broker: str, prefix: str, work: Path, instance: str, config: Path) -> list[str]:
    """``edgeline run`` at QoS 1 on ``PREFIX/in/+``, answering on ``PREFIX/out/{device}``, state in ``WORK/state``."""
    return [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--broker", broker,
            "--subscribe", f"{prefix}/in/+", "--publish", f"{prefix}/out/{{device}}", "--qos", "1",
            "--state-dir", str(work / "state"), "--instance", instance, "--config", str(config)]  # fmt: skip


def spawn_subscribed(daemons: Daemons, broker: Broker, client_id: str, topic_filter: str, timeout: float) -> float:
    """Start a daemon and return (its start time) once the broker logs its subscription: from then on, nothing
    published is missed. RuntimeError, with its log, if it exits or does not subscribe within ``timeout``."""
    since = broker.log_size()
    started = daemons.spawn()
    deadline = time.monotonic() + timeout
    while not broker.wait_for_subscription(client_id, topic_filter, timeout=0.5, since=since):
        if daemons.current.poll() is not None or time.monotonic() > deadline:
            code = daemons.current.poll()
            raise RuntimeError(
                f"the daemon did not subscribe within {timeout:g} s (exit code {code}):\n{daemons.log_tail()}"
            )
    return started


@dataclass
class Tally:
    """The answers against the inputs the broker acknowledged, each loss placed by what the proxy saw."""

    answered: int
    lost_in_broker: list[str]
    answer_lost_in_broker: list[str]
    lost_by_daemon: list[str]
    duplicated: int
    extra_copies: int
    errors: Counter[str]
    tapped: tuple[int, int]
    """Distinct inputs the proxy saw go to the daemon, distinct answers it saw come from it."""

    @property
    def lost(self) -> int:
        return len(self.lost_in_broker) + len(self.answer_lost_in_broker) + len(self.lost_by_daemon)


def tally(payloads: list[bytes], acknowledged: set[str], proxy: TapProxy) -> Tally:
    records = []
    for payload in payloads:
        with contextlib.suppress(ValueError):
            records.append(json.loads(payload))
    copies = Counter(r.get("id") for r in records)
    good = {r.get("id") for r in records if "error" not in r}
    errors = Counter(r["error"].get("code") for r in records if "error" in r and r.get("id") not in good)
    missing = sorted(acknowledged - set(copies), key=lambda i: int(i[1:]))
    return Tally(
        answered=len(set(copies) & acknowledged),
        lost_in_broker=[i for i in missing if i not in proxy.delivered and i not in proxy.answered],
        answer_lost_in_broker=[i for i in missing if i in proxy.answered],
        lost_by_daemon=[i for i in missing if i in proxy.delivered and i not in proxy.answered],
        duplicated=sum(1 for n in copies.values() if n > 1),
        extra_copies=sum(n - 1 for n in copies.values() if n > 1),
        errors=errors,
        tapped=(len(proxy.delivered & acknowledged), len(proxy.answered & acknowledged)),
    )


def acknowledged_ids(publisher: DurablePublisher) -> set[str]:
    """The ids of the inputs the broker acknowledged."""
    return {identity for _, payload in publisher.acknowledged if (identity := payload_id(payload)) is not None}


def loss_notes(scenario: str, counted: Tally) -> list[str]:
    notes = []
    for label, ids in (
        ("lost in the broker (never delivered to the daemon)", counted.lost_in_broker),
        ("answers lost in the broker (published by the daemon, never delivered)", counted.answer_lost_in_broker),
        ("lost by the daemon (delivered to it, no answer published)", counted.lost_by_daemon),
    ):
        if ids:
            shown = ", ".join(ids[:20]) + (", ..." if len(ids) > 20 else "")
            notes.append(f"- {scenario}: {len(ids)} {label}: {shown}")
    return notes


# --- one scenario ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    scenario: str
    inputs: int
    acknowledged: int
    faults: int
    counted: Tally
    recovery_s: list[float | None]
    notice_s: list[float | None] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    peak_outbox: int | None = None
    daemons: int = 1
    seconds: float = 0.0
    left_in_outbox: int = 0
    """Answers the last daemon left in its outbox when it was stopped at the end (its log says so)."""
    log_lines: int = 0
    """Lines the daemon's processes wrote on stderr (their log)."""


def make_inputs(bundle: Path, count: int, topic: str) -> list[tuple[str, bytes]]:
    import edgeline

    spec = edgeline.read_bundle(bundle).manifest.inputs[0]
    size = int(np.prod(spec.shape))
    rng = np.random.default_rng(0)
    return [
        (topic, json.dumps({"id": f"m{i}", "data": rng.random(size, dtype=np.float32).round(3).tolist()}).encode())
        for i in range(count)
    ]


def wait_for(condition: Callable[[], bool], timeout: float, tick: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(tick)
    return True


def run_scenario(scenario: str, bundle: Path, args: argparse.Namespace, scratch: Path) -> Outcome:
    import edgeline

    name = edgeline.read_bundle(bundle).manifest.name
    tag = uuid.uuid4().hex[:8]
    instance = f"faults-{scenario}-{tag}"
    prefix = f"faults/{tag}"
    faults = args.holes if scenario == "black-hole" else args.faults
    work = scratch / scenario
    work.mkdir()
    config = work / "daemon.toml"
    text = f"[health]\nstatus_interval_s = {STATUS_INTERVAL_S}\n"
    if scenario == "black-hole":
        text += f"\n[broker]\nkeepalive_s = {BLACK_HOLE_KEEPALIVE_S}\n"
    config.write_text(text)
    inputs = make_inputs(bundle, args.messages, f"{prefix}/in/dev")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        broker = Broker(work / "broker", persistence=scenario == "broker-kill").start()
        stack.callback(broker.stop)
        proxy = TapProxy(broker.host, broker.port, inputs=f"{prefix}/in/", outputs=f"{prefix}/out/")
        stack.callback(proxy.close)
        daemons = Daemons(daemon_command(bundle, proxy.address, prefix, work, instance, config), work)
        stack.callback(daemons.close)
        answers = TimedCollector(broker, f"{prefix}/out/#")
        answers.start_and_subscribe()
        stack.callback(answers.close)
        statuses = DurableCollector(broker, f"edgeline/{name}/{instance}/status").start_and_subscribe()
        stack.callback(statuses.close)
        spawn_subscribed(daemons, broker, f"edgeline-{name}-{instance}", f"{prefix}/in/+", START_TIMEOUT_S)
        publisher = DurablePublisher(broker)
        publisher.start()
        stack.callback(publisher.close)
        if not publisher.wait_connected(START_TIMEOUT_S):
            raise RuntimeError("the publisher did not connect")
        sender = threading.Thread(target=publisher.publish_all, args=(inputs, args.rate), name="publisher", daemon=True)
        publishing_started = time.time()
        sender.start()
        duration = len(inputs) / args.rate
        ends: list[float] = []
        pauses: list[tuple[float, float]] = []
        for number in range(faults):
            due = publishing_started + (number + 1) * duration / (faults + 1)
            if ends:  # the last fault's recovery first, so that each recovery is measured alone
                wait_for(lambda: answers.first_new_after(ends[-1]) is not None, RECOVERY_TIMEOUT_S)
            while time.time() < due and sender.is_alive():
                time.sleep(0.05)
            if not sender.is_alive():
                print(f"  [{scenario}] publishing ended after {number} faults", file=sys.stderr, flush=True)
                break
            print(f"  [{scenario}] fault {number + 1}/{faults}", file=sys.stderr, flush=True)
            if scenario == "broker-kill":
                broker.kill()
                time.sleep(BROKER_DOWN_S)
                broker.restart()
                ends.append(time.time())
            elif scenario == "daemon-kill":
                daemons.kill()
                ends.append(daemons.spawn())
            else:
                paused = time.time()
                proxy.pause()
                time.sleep(args.hole_s)
                proxy.resume()
                ends.append(time.time())
                pauses.append((paused, ends[-1]))
        sender.join(timeout=duration + END_TIMEOUT_S)
        if sender.is_alive():
            raise RuntimeError("the publisher did not finish")
        publisher.wait_acknowledged(END_TIMEOUT_S)
        acknowledged = acknowledged_ids(publisher)
        settle(answers, acknowledged)
        if ends:  # the last fault's recovery, if it came after publishing ended
            wait_for(lambda: answers.first_new_after(ends[-1]) is not None, 1.0)
        exit_code = daemons.stop()
        if exit_code not in (0, None):
            print(f"  [{scenario}] the daemon exited with {exit_code}", file=sys.stderr, flush=True)
        time.sleep(STATUS_INTERVAL_S)
        with open(work / "status.jsonl", "wb") as out:
            out.writelines(payload + b"\n" for payload in statuses.payloads)
        with open(work / "wire.tsv", "w") as out:
            out.writelines(f"{moment:.3f}\t{kind}\t{identity}\n" for moment, kind, identity in list(proxy.events))
        with open(work / "faults.tsv", "w") as out:
            out.writelines(f"{end:.3f}\n" for end in ends)
        return _outcome(scenario, inputs, acknowledged, answers, statuses, proxy, daemons, ends, pauses, started)
    raise AssertionError("unreachable")  # pragma: no cover


def settle(
    answers: TimedCollector, acknowledged: set[str], timeout: float = END_TIMEOUT_S, quiet_s: float = SETTLE_S
) -> None:
    """Until every acknowledged input has an answer, or none came for ``quiet_s``, or ``timeout``."""
    deadline = time.monotonic() + timeout
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        have = answers.count_new()
        if acknowledged <= set(answers.first_seen):
            return
        if have != last:
            last, quiet_since = have, time.monotonic()
        elif time.monotonic() - quiet_since > quiet_s:
            return
        time.sleep(0.2)


def _outcome(
    scenario: str,
    inputs: list[tuple[str, bytes]],
    acknowledged: set[str],
    answers: TimedCollector,
    statuses: DurableCollector,
    proxy: TapProxy,
    daemons: Daemons,
    ends: list[float],
    pauses: list[tuple[float, float]],
    started: float,
) -> Outcome:
    depths = []
    for payload in statuses.payloads:
        with contextlib.suppress(ValueError, AttributeError):
            depth = json.loads(payload).get("outbox_depth")
            if isinstance(depth, int):
                depths.append(depth)
    left = 0
    for line in daemons.log_lines():
        if found := re.search(r"(\d+) answers stay in the outbox", line):
            left = int(found.group(1))  # the last one: the final stop
    notice: list[float | None] = []
    lost_lines = [(log_time(line), line) for line in daemons.log_lines() if "lost the broker" in line]
    for paused, resumed in pauses:
        moments = [t for t, _ in lost_lines if t is not None and paused <= t <= resumed + 0.5]
        notice.append(min(moments) - paused if moments else None)
    return Outcome(
        scenario=scenario,
        inputs=len(inputs),
        acknowledged=len(acknowledged),
        faults=len(ends),
        counted=tally(answers.payloads, acknowledged, proxy),
        recovery_s=[(first - end) if (first := answers.first_new_after(end)) is not None else None for end in ends],
        notice_s=notice,
        peak_rss_mb=daemons.peak_rss_mb,
        peak_outbox=max(depths) if depths else None,
        daemons=len(daemons.processes),
        seconds=time.monotonic() - started,
        left_in_outbox=left,
        log_lines=sum(1 for _ in daemons.log_lines()),
    )


# --- report ----------------------------------------------------------------------------------------------------


def _spread(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not values:
        return "-"
    text = f"{statistics.median(known):.2f} / {max(known):.2f}" if known else "none"
    missing = len(values) - len(known)
    return text + (f" ({missing} never)" if missing else "")


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| scenario | inputs (acked by broker) | faults | answered | lost: in broker / answer in broker / by daemon "
        "| duplicated (extra copies) | error answers | recovery s, median / max | notice s, median / max "
        "| peak RSS MB | peak outbox | log lines |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        c = o.counted
        errors = ", ".join(f"{n} {code}" for code, n in c.errors.items()) or "0"
        lines.append(
            f"| {o.scenario} | {o.inputs} ({o.acknowledged}) | {o.faults} | {c.answered} "
            f"| **{c.lost}**: {len(c.lost_in_broker)} / {len(c.answer_lost_in_broker)} / {len(c.lost_by_daemon)} "
            f"| {c.duplicated} ({c.extra_copies}) | {errors} | {_spread(o.recovery_s)} "
            f"| {_spread(o.notice_s) if o.scenario == 'black-hole' else '-'} | {o.peak_rss_mb:.0f} "
            f"| {o.peak_outbox if o.peak_outbox is not None else '-'} | {o.log_lines} |"
        )
    notes = []
    for o in outcomes:
        notes += loss_notes(o.scenario, o.counted)
        if o.left_in_outbox:
            notes.append(
                f"- {o.scenario}: NOT FINISHED: the daemon still had {o.left_in_outbox} answers in its outbox when it "
                "was stopped at the end; those inputs count as lost by the daemon above"
            )
        notes.append(
            f"- {o.scenario}: {o.daemons} daemon process(es), {o.seconds:.0f} s; the proxy saw {o.counted.tapped[0]} "
            f"of the acknowledged inputs reach the daemon and {o.counted.tapped[1]} answers leave it"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def provenance() -> str:
    """Which edgeline ran: the commit, and whether ``edge_runtime/`` differed from it (read-only git calls)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "edge_runtime"], cwd=root, capture_output=True, timeout=10
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return "edgeline from a tree outside git"
    return f"edgeline at {commit}" + (" with uncommitted changes in `edge_runtime/`" if changed else "")


def append_section(body: str, *, heading: str, intro: str, write: Path | None) -> None:
    """Print ``body``; with ``write``, append it to that file under ``## DATE: heading`` with the exact command line
    and ``intro``, below the sections of earlier runs (a new file starts with ``TITLE``)."""
    print(body)
    if write is None:
        return
    command = " ".join(["python", f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    earlier = write.read_text(encoding="utf-8").rstrip("\n") if write.exists() else f"# {TITLE}"
    write.parent.mkdir(parents=True, exist_ok=True)
    write.write_text(
        f"{earlier}\n\n## {datetime.date.today().isoformat()}: {heading}\n\nCommand: `{command}`\n\n{intro}\n\n"
        f"{body}\n",
        encoding="utf-8",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=Path("artifacts/bench/bundles/digits-litert-int8-static"))
    parser.add_argument("--scenarios", nargs="+", choices=ALL_SCENARIOS, default=list(ALL_SCENARIOS))
    parser.add_argument("--messages", type=int, default=10_000, help="inputs per fault scenario (at most 65,535)")
    parser.add_argument("--faults", type=int, default=10, help="broker or daemon kills per scenario")
    parser.add_argument("--holes", type=int, default=3, help="black-hole periods")
    parser.add_argument("--hole-s", type=float, default=10.0, help="seconds per black hole")
    parser.add_argument("--rate", type=float, default=150.0, help="inputs per second (disk-full too)")
    parser.add_argument("--backlog", type=int, default=50_000, help="backlog: inputs queued while the daemon is down")
    parser.add_argument("--slow-inputs", type=int, default=4000, help="slow-broker: inputs")
    parser.add_argument("--slow-rate", type=float, default=1000.0, help="slow-broker: inputs per second")
    parser.add_argument("--acks-per-s", type=float, default=300.0, help="slow-broker: the broker's PUBACKs per second")
    parser.add_argument("--full-s", type=float, default=10.0, help="disk-full: seconds of the first full disk")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 300 inputs, 1 fault each, a 4 s black hole; a backlog of "
        "2,000, 1,000 inputs to a slow broker, 4 s of full disk"
    )  # fmt: skip
    parser.add_argument("--keep", type=Path, help="keep logs, broker files and status messages in this directory")
    parser.add_argument("--write", type=Path, help="append the tables to this file as a dated section")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.faults, args.holes, args.hole_s = 300, 1, 1, 4.0
        args.rate = min(args.rate, 50.0)
        args.backlog, args.slow_inputs, args.full_s = 2000, 1000, 4.0
    counts = {"--messages": args.messages, "--backlog": args.backlog, "--slow-inputs": args.slow_inputs}
    for flag, value in counts.items():
        if not 1 <= value <= 65_535:
            parser.error(f"{flag}: between 1 and 65535 (the publisher keys its ledger by MQTT message id)")
    if "disk-full" in args.scenarios and os.geteuid() != 0:
        parser.error("disk-full mounts a tmpfs and needs root; choose among the other scenarios")

    # Run as a script this module is __main__: daemon_pressure's `import daemon_faults` must find it, not a copy.
    sys.modules.setdefault("daemon_faults", sys.modules[__name__])
    from daemon_pressure import PRESSURE_SCENARIOS, pressure_intro, pressure_table, run_pressure

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwind: every scenario's ExitStack kills its daemons and brokers

    signal.signal(signal.SIGTERM, interrupted)
    outcomes = []
    pressed = []
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeline-faults-")))
        else:
            scratch = Path(tempfile.mkdtemp(prefix="faults-", dir=args.keep.absolute()))
            print(f"keeping everything in {scratch}", file=sys.stderr, flush=True)
        for scenario in args.scenarios:
            if scenario in PRESSURE_SCENARIOS:
                print(f"[{scenario}]", file=sys.stderr, flush=True)
                pressed.append(run_pressure(scenario, args.bundle, args, scratch))
                continue
            print(f"[{scenario}] {args.messages} inputs at {args.rate:g}/s", file=sys.stderr, flush=True)
            outcomes.append(run_scenario(scenario, args.bundle, args, scratch))
    intros, bodies = [provenance() + "."], []
    if outcomes:
        intros.append(
            f"Faults: `{args.bundle.name}` at QoS 1, {args.messages} inputs per scenario at {args.rate:g}/s; broker "
            f"and daemon SIGKILLs: {args.faults} each; black holes: {args.holes} of {args.hole_s:g} s with keepalive "
            f"{BLACK_HOLE_KEEPALIVE_S} s. Mosquitto with persistence and autosave on every "
            "change in `broker-kill` only. What each column means, and how a loss is placed, is in the docstring of "
            "`benchmarks/daemon_faults.py`. Mosquitto acknowledges a PUBLISH before it saves it, so a SIGKILL in that "
            "window loses an input the publisher was told was received: such losses count as lost in the broker."
        )
        bodies.append(table(outcomes))
    if pressed:
        intros.append(pressure_intro(args))
        bodies.append(pressure_table(pressed))
    heading = ", ".join(scenario.replace("-", " ") for scenario in args.scenarios)
    append_section("\n\n".join(bodies), heading=heading, intro="\n\n".join(intros), write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
