"""Signed updates (``edgeline.updates``): what verifying a new version costs on the device, how long a running
daemon takes from finding it to serving it, what the swap does to the answers of a steady stream, and what the
shadow trial costs. One run, four parts, each bundle side by side:

1. Steps, in this process, on fresh directories each run: ``Repository.publish`` (the workstation), then the
   device's ``UpdateClient.check`` (TUF refresh: every metadata signature), a second ``check`` with the metadata
   held (what each periodic check costs), ``precheck``, ``offer``, ``fetch`` (a local directory repository: copy,
   length and sha256), ``unpack`` (tar, manifest sha256, every file's sha256 through ``read_bundle``),
   ``edgeline.model.load`` (files verified again, the doctor's verdict, the runtime opened), the golden self-test
   (``edgeline.verify.golden_check``) and the batching check the agent runs before it proposes the model
   (``Model.enable_batching`` at the daemon's ``max_batch``). One untimed run first (imports), then ``--repeats``.
2. Swaps: ``edgeline run BUNDLE --updates REPO --trusted-root ROOT --check-interval 0.2`` against a local Mosquitto,
   inputs streaming at ``--rate`` per second at QoS 1; a new version (the same model, its manifest's version
   rewritten: ``tests.update_repo.versioned``) is published with the default trial gates (200 inputs); the steps'
   times come from the daemon's log (millisecond timestamps). ``--swaps`` swaps per bundle, one after the other in
   one daemon.
3. The same streams, client side: each input's time from publish to its answer (matched by id), by what the daemon
   was doing when it was published.
4. The trial's cost: per input, the worker thread's CPU time (``/proc/PID/task/TID/schedstat``) and the answers'
   ``latency_ms`` (the model call of the version that answered) before the swap and during the trial of part 2;
   then two more daemons per bundle, one with a trial in progress (``Gates(inputs=100000, seconds=3600)``) and one
   without, each sent ``--burst`` inputs as fast as one publisher can, in ``--rounds`` interleaved rounds; and, in
   this process, what the place of a call in the trial's pair costs (two copies of one model, called in turn).

Bundles: ``tests/data/tiny-int8`` (the tests' tiny classifier, int8) and two MLPs exported here with torch as
rpi5 LiteRT fp32 bundles of about 1 MB and 20 MB (kept in WORK/exports and reused when their source is unchanged).
Everything runs on this machine: the figures are this host's, not a device's.

    nice -n 10 .venv/bin/python benchmarks/updates.py --work artifacts/bench-updates --repeats 5 \
        --write benchmarks/results/updates.md

About 5 minutes on a 2-core machine (the exports add about 15 s when WORK has none). A smoke run: add
``--repeats 1 --swaps 1 --rounds 1 --burst 300`` (about a minute).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table

from tests.mqtt_broker import Broker, running_broker
from tests.tiny_bundle import COMMITTED_BUNDLE
from tests.update_repo import versioned

REPO = Path(__file__).resolve().parents[1]
CAGE_MARKER = "<!-- benchmarks/update_cage.py: the section below is its own -->"
TIMEOUT_S = 90.0
STATUS_CONFIG = "[health]\nstatus_interval_s = 1.0\n"
"""The unpaced daemons publish their status every second (default 10 s): the trial's figures after the rounds."""
BEFORE_S = 2.5
"""Seconds of steady stream before each publish (and after each commit)."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

MLP_SOURCE = '''\
import torch
from torch import nn

HIDDEN = {hidden}


class MLP(nn.Module):
    """256 inputs, two hidden layers of HIDDEN, 10 class logits: the fp32 LiteRT model is 4 * (256 + HIDDEN + 10)
    * HIDDEN bytes and a little more."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(256, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10)
        )

    def forward(self, x):
        return self.net(x)


def model():
    return MLP()
'''
MLPS = (("mlp1mb", 400), ("mlp20mb", 2100))
"""(bundle name, hidden width): 266 k and 4.97 M parameters."""


# -- bundles -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    key: str
    label: str
    bundle: Path
    name: str
    values: int
    """Numbers per input message."""
    size: int
    """The bundle's files, bytes."""


def spec_of(key: str, label: str, bundle: Path) -> Spec:
    import edgeline

    manifest = edgeline.read_bundle(bundle).manifest
    values = int(np.prod(manifest.inputs[0].shape))
    size = (
        sum((bundle / entry.path).stat().st_size for entry in manifest.files)
        + (bundle / "manifest.json").stat().st_size
    )
    return Spec(key, label, bundle, manifest.name, values, size)


def export_mlps(work: Path) -> tuple[list[Spec], list[str]]:
    """The two MLP bundles, exported with ``edgeline export`` unless WORK/exports holds them from the same source."""
    import edgeline

    exports = work / "exports"
    exports.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261126)
    calibration, validation = exports / "calibration.npz", exports / "validation.npz"
    if not calibration.exists() or not validation.exists():
        np.savez(calibration, x=rng.random((32, 1, 256), dtype=np.float32))
        np.savez(validation, x=rng.random((16, 1, 256), dtype=np.float32), labels=rng.integers(0, 10, size=16))
    specs, notes = [], []
    for name, hidden in MLPS:
        source = exports / f"{name}.py"
        out = exports / name
        text = MLP_SOURCE.format(hidden=hidden)
        try:
            fresh = source.read_text() != text or edgeline.read_bundle(out).manifest.version != 1
        except Exception:
            fresh = True
        if fresh:
            source.write_text(text)
            command = [sys.executable, "-m", "edgeline.cli", "export", f"{source}:model", "--profile", "rpi5",
                       "--backend", "litert", "--precision", "fp32", "--calibration", str(calibration),
                       "--validation", str(validation), "--out", str(out), "--name", name, "--version", "1",
                       "--force"]  # fmt: skip
            print(f"[export] {name}", file=sys.stderr, flush=True)
            began = time.perf_counter()
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"edgeline export of {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            notes.append(f"{name} exported in this run ({time.perf_counter() - began:.1f} s)")
        else:
            notes.append(f"{name} reused from {out} (same source)")
        parameters = 256 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
        label = f"MLP 256→{hidden}→{hidden}→10 ({parameters:,} parameters), LiteRT fp32 for rpi5, exported here"
        specs.append(spec_of(name, label, out))
    return specs, notes


def size_text(size: int) -> str:
    return f"{size / 1e6:.2f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


def column(spec: Spec) -> str:
    return f"{spec.key} ({size_text(spec.size)})"


# -- statistics ----------------------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"  # NaN: nothing measured


# -- part 1: the steps in-process ------------------------------------------------------------------------------

BATCHING: dict[str, str] = {}
"""What ``enable_batching`` said, by bundle."""

STEPS = (
    ("publish", "publish (workstation): read + hash the bundle, tar, hash, sign targets/snapshot/timestamp"),
    ("check", "check: TUF refresh of a fresh device (root, timestamp, snapshot, targets: signatures)"),
    ("precheck", "precheck (signed facts: name, profile, runtime installed)"),
    ("offer", "offer (`get_targetinfo`)"),
    ("fetch", "fetch: copy from the directory, length + sha256 against the signed metadata"),
    ("unpack", "unpack: tar, manifest sha256, every file's size + sha256 (`read_bundle`)"),
    ("load", "`edgeline.model.load`: files verified again, doctor's verdict, runtime opened"),
    ("golden", "golden self-test (`golden_check`)"),
    ("batching", "batching check (`enable_batching(max_batch)`, as the agent does)"),
    ("device", "**device side, check to batching**"),
    ("recheck", "a later check with the metadata held, nothing new (each periodic check)"),
)


def one_step_run(spec: Spec, keys: Path, root: Path, run_dir: Path, max_batch: int) -> dict[str, float]:
    from edgeline.model import load
    from edgeline.updates.client import UpdateClient
    from edgeline.updates.policy import precheck
    from edgeline.updates.repository import Repository
    from edgeline.verify import golden_check

    times: dict[str, float] = {}
    bundle_v2 = versioned(run_dir / "bundle-v2", 2, source=spec.bundle)

    def timed(key: str, call: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        result = call()
        times[key] = (time.perf_counter() - began) * 1000.0
        return result

    timed("publish", lambda: Repository(run_dir / "repo", keys).publish(bundle_v2))
    client = UpdateClient(str(run_dir / "repo"), root, run_dir / "device")
    choice, updater = timed("check", lambda: client.check(name=spec.name, device="bench", running=1))
    facts = choice.take
    assert facts is not None and facts.version == 2, choice
    timed("precheck", lambda: precheck(facts, name=spec.name, profile=facts.profile))
    offer = timed("offer", lambda: client.offer(updater, facts))
    archive = timed("fetch", lambda: client.fetch(updater, offer))
    bundle = timed("unpack", lambda: client.unpack(archive, offer, run_dir / "device" / "bundles" / "v2"))
    model = timed("load", lambda: load(bundle.path))
    golden = timed("golden", lambda: golden_check(model))
    assert golden["ok"], golden
    timed("batching", lambda: model.enable_batching(max_batch))
    times["device"] = sum(
        times[k] for k in ("check", "precheck", "offer", "fetch", "unpack", "load", "golden", "batching")
    )
    again, _ = timed("recheck", lambda: client.check(name=spec.name, device="bench", running=2))
    assert again.take is None
    times["archive_bytes"] = float(archive.stat().st_size)
    times["batch_size"] = float(model.batch_size)
    BATCHING[spec.key] = model.batching
    return times


def hash_times(spec: Spec, repeats: int) -> list[float]:
    import edgeline

    data = [(spec.bundle / entry.path).read_bytes() for entry in edgeline.read_bundle(spec.bundle).manifest.files]
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for blob in data:
            hashlib.sha256(blob).digest()
        times.append((time.perf_counter() - began) * 1000.0)
    return times


def measure_steps(specs: list[Spec], work: Path, repeats: int, max_batch: int) -> tuple[str, dict[str, Any]]:
    from edgeline.updates.keys import generate

    base = work / "steps"
    shutil.rmtree(base, ignore_errors=True)
    root = generate(base / "keys")
    runs: dict[str, list[dict[str, float]]] = {spec.key: [] for spec in specs}
    for index in range(repeats + 1):  # the first run is untimed: imports (tuf, LiteRT), first file reads
        for spec in specs:  # interleaved
            run_dir = base / f"{spec.key}-{index}"
            times = one_step_run(spec, base / "keys", root, run_dir, max_batch)
            if index > 0:
                runs[spec.key].append(times)
            shutil.rmtree(run_dir)
        print(f"[steps] run {index}/{repeats} done", file=sys.stderr, flush=True)
    rows = [("step, ms: median (min–max)", *(column(spec) for spec in specs))]
    for key, label in STEPS:
        rows.append((label, *(spread([t[key] for t in runs[spec.key]], 1 if key != "offer" else 2) for spec in specs)))
    rows.append(("archive fetched (tar), bytes", *(f"{int(runs[s.key][0]['archive_bytes']):,}" for s in specs)))
    rows.append(("batching check's verdict", *(BATCHING[s.key].replace("|", "/") for s in specs)))
    rows.append(("for scale: sha256 of the bundle's files already in memory (`hashlib`), ms",
                 *(spread(hash_times(spec, repeats), 2) for spec in specs)))  # fmt: skip
    return markdown_table(rows), {"runs": runs}


# -- the daemon and the MQTT clients ------------------------------------------------------------------------------


def read_ns(path: Path) -> int:
    """Nanoseconds a thread has run on a CPU (``schedstat``'s first field); 0 once the thread is gone."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class DaemonProc:
    """``edgeline run`` in a child process (its log on stderr, in a file) with ``--updates``."""

    def __init__(self, spec: Spec, bundle: Path, broker: Broker, topic: str, work: Path, repo: Path, root: Path,
                 interval: float, config: str = "") -> None:  # fmt: skip
        self.instance = f"bench-{work.name}"
        self.client_id = f"edgeline-{spec.name}-{self.instance}"
        self.subscription = f"{topic}/in/+"
        self.status_topic = f"edgeline/{spec.name}/{self.instance}/status"
        self.log = work / "daemon.log"
        self.broker = broker
        self.args = [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--broker", broker.address,
                     "--subscribe", self.subscription, "--publish", f"{topic}/out/{{device}}", "--qos", "1",
                     "--state-dir", str(work / "state"), "--instance", self.instance, "--updates", str(repo),
                     "--trusted-root", str(root), "--check-interval", str(interval)]  # fmt: skip
        if config:
            (work / "daemon.toml").write_text(config)
            self.args += ["--config", str(work / "daemon.toml")]
        self.process: subprocess.Popen[bytes] | None = None
        self.threads: dict[str, Path] = {}

    def start(self) -> None:
        since = self.broker.log_size()
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO)
        deadline = time.monotonic() + TIMEOUT_S
        while not self.broker.wait_for_subscription(self.client_id, self.subscription, timeout=0.5, since=since):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.client_id} did not subscribe:\n{self.log_text()[-3000:]}")
        while not {"edgeline-worker", "edgeline-update"} <= {name[:15] for name in self._scan()}:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.client_id}: no worker or update thread:\n{self.log_text()[-3000:]}")
            time.sleep(0.05)

    def _scan(self) -> dict[str, Path]:
        """The daemon's named threads (names as the kernel keeps them: 15 characters at most)."""
        assert self.process is not None
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            if name.startswith("edgeline-"):
                self.threads[name] = task / "schedstat"
        return self.threads

    def thread_ns(self, prefix: str) -> int:
        return sum(read_ns(path) for name, path in self.threads.items() if name.startswith(prefix))

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def logged(self, needle: str) -> float | None:
        """Wall-clock time of the first log line containing ``needle`` (None: not logged)."""
        for line in self.log_text().splitlines():
            if needle in line:
                return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return None

    def wait_logged(self, needles: Iterable[str], timeout: float = TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_text()
            for needle in needles:
                if needle in text:
                    return needle
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"none of {list(needles)} logged:\n{text[-4000:]}")
            time.sleep(0.05)


class Sampler:
    """The worker's and the update thread's CPU nanoseconds, sampled every 20 ms with the wall clock."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.daemon = daemon
        self.samples: list[tuple[float, int, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping.wait(0.02):
            now = time.time()
            self.samples.append(
                (now, self.daemon.thread_ns("edgeline-worker"), self.daemon.thread_ns("edgeline-update"))
            )

    def ns_between(self, a: float, b: float, index: int) -> float:
        """CPU ns of the thread (1: worker, 2: update thread) between wall times a and b (linear between samples)."""
        times = np.array([s[0] for s in self.samples])
        values = np.array([s[index] for s in self.samples], dtype=np.float64)
        return float(np.interp(b, times, values) - np.interp(a, times, values))


class Traffic:
    """One publisher and one subscriber (answers and the daemon's status) for one daemon's topic."""

    def __init__(self, broker: Broker, topic: str, status_topic: str, spec: Spec) -> None:
        self.topic = topic
        self.status_topic = status_topic
        self.lock = threading.Lock()
        self.sent: dict[str, float] = {}
        self.answers: dict[str, tuple[float, dict[str, Any]]] = {}
        self.duplicates = 0
        self.statuses: list[dict[str, Any]] = []
        rng = np.random.default_rng(spec.values)
        self.data = [orjson.dumps([round(float(v), 4) for v in rng.random(spec.values)]) for _ in range(64)]
        self.listener = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.listener.on_message = self._on_message
        subscribed = threading.Event()
        self.listener.on_subscribe = lambda *_: subscribed.set()
        self.listener.connect(broker.host, broker.port)
        self.listener.subscribe([(f"{topic}/out/#", 1), (status_topic, 1)])
        self.listener.loop_start()
        self.publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.publisher.max_inflight_messages_set(1000)
        self.publisher.max_queued_messages_set(0)
        self.publisher.connect(broker.host, broker.port)
        self.publisher.loop_start()
        if not subscribed.wait(10):
            raise RuntimeError("the answers' subscriber got no SUBACK")

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        now = time.time()
        record = orjson.loads(msg.payload)
        with self.lock:
            if msg.topic == self.status_topic:
                self.statuses.append(record)
                return
            identity = str(record.get("id"))
            if identity in self.answers:
                self.duplicates += 1
            else:
                self.answers[identity] = (now, record)

    def send(self, identity: str, index: int) -> None:
        payload = b'{"id":"' + identity.encode() + b'","data":' + self.data[index % len(self.data)] + b"}"
        with self.lock:
            self.sent[identity] = time.time()
        self.publisher.publish(f"{self.topic}/in/dev", payload, qos=1)

    def paced(self, prefix: str, rate: float, stopping: threading.Event) -> tuple[threading.Thread, list[str]]:
        ids: list[str] = []

        def run() -> None:
            began = time.monotonic()
            index = 0
            while not stopping.is_set():
                delay = began + index / rate - time.monotonic()
                if delay > 0 and stopping.wait(delay):
                    return
                identity = f"{prefix}{index}"
                ids.append(identity)
                self.send(identity, index)
                index += 1

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, ids

    def wait_answers(self, ids: Iterable[str], timeout: float = TIMEOUT_S) -> set[str]:
        wanted = set(ids)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                missing = wanted - self.answers.keys()
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)

    def close(self) -> None:
        for client in (self.publisher, self.listener):
            client.loop_stop()
            client.disconnect()


# -- parts 2 and 3: swaps under a steady stream ---------------------------------------------------------------

PHASES = (
    ("before", "before the publish"),
    ("waiting", "publish → found (the check interval)"),
    ("verifying", "found → answers from now on (update thread: fetch, verify, open, self-test)"),
    ("trial", "trial (answers from now on → committed)"),
    ("after", "after the commit"),
)


@dataclass
class Swap:
    version: int
    published: tuple[float, float]
    events: dict[str, float | None]
    outcome: str
    trial: dict[str, Any] | None
    inputs: list[tuple[str, float, float | None, dict[str, Any] | None]]
    """(id, sent, answered, answer record)."""
    update_cpu_ms: float
    counted_from: float
    """Inputs sent earlier warm a fresh daemon up (the first swap's first second): not counted."""
    worker_us: dict[str, float] = field(default_factory=dict)
    """Worker CPU µs per answered input, by phase."""


def phase_of(sent: float, swap: Swap) -> str:
    ev = swap.events
    if sent < swap.counted_from:
        return "warm-up"
    if sent < swap.published[0]:
        return "before"
    if ev["found"] is None or sent < ev["found"]:
        return "waiting"
    if ev["trial"] is None or sent < ev["trial"]:
        return "verifying"
    if ev["end"] is None or sent < ev["end"]:
        return "trial"
    return "after"


def swap_runs(spec: Spec, broker: Broker, work: Path, swaps: int, rate: float) -> tuple[list[Swap], str]:
    from edgeline.updates.keys import generate
    from edgeline.updates.repository import Repository

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = generate(work / "keys")
    repository = Repository(work / "repo", work / "keys")
    v1 = versioned(work / "bundles" / "v1", 1, source=spec.bundle)
    repository.publish(v1)
    topic = f"bench/updates/{spec.key}/swap"
    daemon = DaemonProc(spec, v1, broker, topic, work, work / "repo", root, 0.2)
    daemon.start()
    traffic = Traffic(broker, topic, daemon.status_topic, spec)
    results: list[Swap] = []
    try:
        with Sampler(daemon) as sampler:
            for index in range(swaps):
                version = 2 + index
                bundle = versioned(work / "bundles" / f"v{version}", version, source=spec.bundle)
                stopping = threading.Event()
                thread, ids = traffic.paced(f"s{version}-", rate, stopping)
                counted_from = time.time() + (1.0 if index == 0 else 0.0)
                time.sleep(BEFORE_S + (1.0 if index == 0 else 0.0))
                published0 = time.time()
                repository.publish(bundle)
                published1 = time.time()
                end = daemon.wait_logged([f"v{version} committed", f"v{version} rolled back"])
                time.sleep(BEFORE_S)
                stopping.set()
                thread.join()
                missing = traffic.wait_answers(ids)
                if missing:
                    raise RuntimeError(f"{len(missing)} inputs unanswered, e.g. {sorted(missing)[:3]}")
                events = {
                    "found": daemon.logged(f"v{version} found"),
                    "verified": daemon.logged(f"v{version}: signature, hashes and manifest verified"),
                    "self-test": daemon.logged(f"v{version} passed its golden self-test"),
                    "trial": daemon.logged(f"v{version} answers from now on"),
                    "end": daemon.logged(end),
                }
                trial = None
                deadline = time.monotonic() + 15
                while trial is None and time.monotonic() < deadline:
                    with traffic.lock:
                        for status in reversed(traffic.statuses):
                            last = (status.get("update") or {}).get("last_trial") or {}
                            if last.get("version") == version:
                                trial = last
                                break
                    time.sleep(0.1)
                with traffic.lock:
                    inputs = [(i, traffic.sent[i], *traffic.answers.get(i, (None, None))) for i in ids]
                found, trial_at = events["found"], events["trial"]
                cpu = sampler.ns_between(found, trial_at, 2) / 1e6 if found and trial_at else float("nan")
                swap = Swap(version, (published0, published1), events, "committed" if "committed" in end else
                            "rolled back", trial, inputs, cpu, counted_from)  # fmt: skip
                for phase, _ in PHASES:
                    answered = [a for i, s, a, r in inputs if a is not None and phase_of(s, swap) == phase]
                    if len(answered) >= 20:
                        a, b = min(answered), max(answered)
                        swap.worker_us[phase] = sampler.ns_between(a, b, 1) / 1e3 / (len(answered) - 1)
                results.append(swap)
                print(f"[swap] {spec.key} v{version}: {swap.outcome}", file=sys.stderr, flush=True)
    finally:
        traffic.close()
        daemon.stop()
    duplicates = traffic.duplicates
    return (
        results,
        f"{spec.key}: {sum(len(s.inputs) for s in results)} inputs sent, all answered, {duplicates} duplicates",
    )


def swap_table(specs: list[Spec], runs: dict[str, list[Swap]]) -> str:
    def between(swaps: list[Swap], a: str, b: str) -> list[float]:
        out = []
        for s in swaps:
            x = s.published[1] if a == "published" else s.events[a]
            y = s.events[b]
            if x is not None and y is not None:
                out.append((y - x) * 1000.0)
        return out

    rows = [("ms: median (min–max)", *(column(spec) for spec in specs))]
    rows.append(("swaps committed", *(f"{sum(s.outcome == 'committed' for s in runs[k.key])} / {len(runs[k.key])}"
                                      for k in specs)))  # fmt: skip
    for label, a, b in (
        ("publish done → vN found (waits for the next check, every 0.2 s)", "published", "found"),
        ("found → verified (fetch, unpack)", "found", "verified"),
        ("verified → passed its golden self-test (load, self-test)", "verified", "self-test"),
        ("self-test → answers from now on (batching check, the worker's next poll)", "self-test", "trial"),
        ("**found → answers from now on**", "found", "trial"),
        ("answers from now on → committed (the trial: 200 inputs)", "trial", "end"),
        ("**found → committed**", "found", "end"),
    ):
        rows.append((label, *(spread(between(runs[spec.key], a, b), 0) for spec in specs)))
    rows.append(("update thread CPU, found → answers from now on", *(spread([s.update_cpu_ms for s in runs[k.key]], 0)
                                                                    for k in specs)))  # fmt: skip
    return markdown_table(rows)


def latency_table(specs: list[Spec], runs: dict[str, list[Swap]]) -> str:
    rows = [("bundle", "inputs published", "inputs", "p50 ms", "p99 ms", "max ms", "answered by")]
    for spec in specs:
        for phase, label in PHASES:
            latencies, versions = [], Counter()
            for swap in runs[spec.key]:
                for _, sent, answered, record in swap.inputs:
                    if answered is not None and record is not None and phase_of(sent, swap) == phase:
                        latencies.append((answered - sent) * 1000.0)
                        old = record["version"] < swap.version
                        versions["previous" if old else "new"] += 1
            by = ", ".join(f"{name} {count}" for name, count in sorted(versions.items()))
            rows.append((spec.key, label, str(len(latencies)), fmt(pct(latencies, 50)), fmt(pct(latencies, 99)),
                         fmt(max(latencies, default=float("nan"))), by or "-"))  # fmt: skip
    return markdown_table(rows)


def paced_cost_table(specs: list[Spec], runs: dict[str, list[Swap]]) -> str:
    rows = [("bundle", "phase", "answers", "answer's `latency_ms` p50 / p99",
             "trial's own median: new / previous ms", "trial's own p95: new / previous ms",
             "worker CPU µs per input")]  # fmt: skip
    for spec in specs:
        for phase in ("before", "trial", "after"):
            calls, worker = [], []
            for swap in runs[spec.key]:
                for _, sent, _answered, record in swap.inputs:
                    if record is not None and phase_of(sent, swap) == phase:
                        calls.append(float(record["latency_ms"]) / int(record.get("batch", 1)))
                if phase in swap.worker_us:
                    worker.append(swap.worker_us[phase])
            figures = ["-", "-"]
            if phase == "trial":
                for index, (new_key, old_key) in enumerate(
                    (("median_ms", "previous_median_ms"), ("p95_ms", "previous_p95_ms"))
                ):
                    new = [s.trial[new_key] for s in runs[spec.key] if s.trial and s.trial.get(new_key) is not None]
                    old = [s.trial[old_key] for s in runs[spec.key] if s.trial and s.trial.get(old_key) is not None]
                    figures[index] = f"{spread(new, 3)} / {spread(old, 3)}"
            rows.append((spec.key, phase, str(len(calls)), f"{fmt(pct(calls, 50), 3)} / {fmt(pct(calls, 99), 3)}",
                         *figures, spread(worker, 0)))  # fmt: skip
    return markdown_table(rows)


# -- part 4: unpaced, with and without a trial ----------------------------------------------------------------


@dataclass
class Burst:
    throughput: float
    worker_us: float
    call_ms: list[float]
    batched: float
    versions: Counter[int]


def burst(daemon: DaemonProc, traffic: Traffic, prefix: str, count: int) -> Burst:
    ids = [f"{prefix}{i}" for i in range(count)]
    worker0 = daemon.thread_ns("edgeline-worker")
    began = time.time()
    for index, identity in enumerate(ids):
        traffic.send(identity, index)
    missing = traffic.wait_answers(ids)
    worker1 = daemon.thread_ns("edgeline-worker")
    if missing:
        raise RuntimeError(f"{len(missing)} of {count} inputs unanswered")
    with traffic.lock:
        records = [traffic.answers[i] for i in ids]
    last = max(at for at, _ in records)
    calls = [float(r["latency_ms"]) / int(r.get("batch", 1)) for _, r in records]
    batched = sum(int(r.get("batch", 1)) > 1 for _, r in records) / count
    return Burst(count / (last - began), (worker1 - worker0) / 1e3 / count, calls, batched,
                 Counter(int(r["version"]) for _, r in records))  # fmt: skip


def unpaced_runs(spec: Spec, broker: Broker, work: Path, rounds: int, count: int) -> dict[str, Any]:
    from edgeline.updates.keys import generate
    from edgeline.updates.policy import Gates
    from edgeline.updates.repository import Repository

    shutil.rmtree(work, ignore_errors=True)
    daemons: dict[str, tuple[DaemonProc, Traffic]] = {}
    try:
        for kind in ("no trial", "trial"):
            where = work / kind.replace(" ", "-")
            where.mkdir(parents=True)
            root = generate(where / "keys")
            repository = Repository(where / "repo", where / "keys")
            v1 = versioned(where / "bundles" / "v1", 1, source=spec.bundle)
            repository.publish(v1)
            if kind == "trial":
                v2 = versioned(where / "bundles" / "v2", 2, source=spec.bundle)
                repository.publish(v2, gates=Gates(inputs=100_000, seconds=3600))
            topic = f"bench/updates/{spec.key}/{where.name}"
            daemon = DaemonProc(spec, v1, broker, topic, where, where / "repo", root, 3600.0, STATUS_CONFIG)
            daemon.start()
            traffic = Traffic(broker, topic, daemon.status_topic, spec)
            daemons[kind] = (daemon, traffic)
            if kind == "trial":
                daemon.wait_logged(["v2 answers from now on"])
            burst(daemon, traffic, "warm-", 300)  # untimed: a fresh process's first inputs
        results: dict[str, list[Burst]] = {kind: [] for kind in daemons}
        for index in range(rounds):
            for kind, (daemon, traffic) in daemons.items():
                results[kind].append(burst(daemon, traffic, f"r{index}-", count))
            print(f"[unpaced] {spec.key} round {index + 1}/{rounds}", file=sys.stderr, flush=True)
        traffic = daemons["trial"][1]
        with traffic.lock:
            seen = len(traffic.statuses)
        deadline = time.monotonic() + 5.0
        trial = None
        while trial is None and time.monotonic() < deadline:  # a status published after the last round
            time.sleep(0.1)
            with traffic.lock:
                fresh = traffic.statuses[seen:]
            trial = next((s["update"]["trial"] for s in fresh if (s.get("update") or {}).get("trial")), None)
        return {"results": results, "trial": trial}
    finally:
        for daemon, traffic in daemons.values():
            traffic.close()
            daemon.stop()


def unpaced_table(specs: list[Spec], runs: dict[str, dict[str, Any]]) -> str:
    rows = [("bundle", "daemon", "answered by", "msg/s median (min–max)", "worker CPU µs per input",
             "model call ms per input p50", "answers from batched calls")]  # fmt: skip
    for spec in specs:
        for kind, bursts in runs[spec.key]["results"].items():
            versions: Counter[int] = Counter()
            for b in bursts:
                versions.update(b.versions)
            calls = [c for b in bursts for c in b.call_ms]
            rows.append((spec.key, f"{kind} (v1 → {'v2 on trial beside v1' if kind == 'trial' else 'v1 alone'})",
                         ", ".join(f"v{v}: {n}" for v, n in sorted(versions.items())),
                         spread([b.throughput for b in bursts], 0), spread([b.worker_us for b in bursts], 0),
                         fmt(pct(calls, 50), 3), f"{statistics.median(b.batched for b in bursts):.0%}"))  # fmt: skip
    return markdown_table(rows)


def call_order(specs: list[Spec], calls: int) -> str:
    """Two opened copies of one bundle called one after the other on the same input, as ``TrialRunner`` calls the
    new version and then the previous one: back to back, and 20 ms apart (a 50/s stream)."""
    import edgeline

    rows = [("bundle", "inputs", "first call p50 / p95 ms", "second call p50 / p95 ms",
             "first / second, p50")]  # fmt: skip
    for spec in specs:
        first_model, second_model = edgeline.load(spec.bundle), edgeline.load(spec.bundle)
        shape = first_model.inputs[0].shape
        rng = np.random.default_rng(0)
        samples = [rng.random(shape, dtype=np.float32) for _ in range(64)]
        for gap, label in ((0.0, "back to back"), (0.02, "20 ms apart")):
            first, second = [], []
            for index in range(calls * (4 if gap == 0.0 else 1)):
                x = samples[index % len(samples)]
                t0 = time.perf_counter()
                first_model.predict(x)
                t1 = time.perf_counter()
                second_model.predict(x)
                t2 = time.perf_counter()
                first.append((t1 - t0) * 1000.0)
                second.append((t2 - t1) * 1000.0)
                if gap:
                    time.sleep(gap)
            ratio = pct(first, 50) / pct(second, 50)
            rows.append((spec.key, f"{len(first)}, {label}", f"{pct(first, 50):.3f} / {pct(first, 95):.3f}",
                         f"{pct(second, 50):.3f} / {pct(second, 95):.3f}", f"{ratio:.2f}"))  # fmt: skip
        print(f"[order] {spec.key}", file=sys.stderr, flush=True)
    return markdown_table(rows)


# -- the machine ------------------------------------------------------------------------------------------------


def machine_times() -> list[int]:
    return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


def our_cpu_s() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def describe_machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} cores ({model})"


CODE_PATHS = ("edge_runtime", "tests/update_repo.py", "tests/mqtt_broker.py", "tests/tiny_bundle.py", "tests/data")
"""What this benchmark runs of the repository."""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()


def source_state() -> tuple[str, str]:
    """(a description of the code measured, an identity that changes with it), from read-only git commands: the
    commit, the last commit that changed ``CODE_PATHS``, and their uncommitted changes."""
    last = git("log", "-1", "--format=%h", "--", *CODE_PATHS)
    changed = [line[3:] for line in git("status", "--porcelain", "--", *CODE_PATHS).splitlines() if line.strip()]
    text = f"edgeline at {git('rev-parse', '--short', 'HEAD')} (the code measured last changed in {last})"
    if changed:
        text += f", with uncommitted changes in {', '.join(changed)}"
    diff = git("diff", "HEAD", "--", *CODE_PATHS)
    return text, hashlib.sha256(f"{last}\n{changed}\n{diff}".encode()).hexdigest()


# -- main ---------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("artifacts/bench-updates"), help="exports and scratch")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the steps (part 1; default 5)")
    parser.add_argument("--swaps", type=int, default=5, help="swaps per bundle (parts 2-4; default 5)")
    parser.add_argument("--rate", type=float, default=50.0, help="inputs per second during swaps (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="unpaced rounds per daemon (part 4; default 5)")
    parser.add_argument("--burst", type=int, default=3000, help="inputs per unpaced round (default 3000)")
    parser.add_argument("--write", type=Path, help="also write the markdown here")
    args = parser.parse_args()

    from edgeline.daemon.config import QueueConfig

    started, machine0, ours0, source0 = time.monotonic(), machine_times(), our_cpu_s(), source_state()
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    max_batch = QueueConfig().max_batch
    mlps, export_notes = export_mlps(work)
    tiny = "tests/data/tiny-int8, the tests' conv + linear classifier, LiteRT int8-static for rpi5"
    specs = [spec_of("tiny", tiny, COMMITTED_BUNDLE), *mlps]

    steps, _ = measure_steps(specs, work, args.repeats, max_batch)
    order = call_order(specs, 300)
    swaps: dict[str, list[Swap]] = {}
    unpaced: dict[str, dict[str, Any]] = {}
    notes = []
    with running_broker() as broker:
        for spec in specs:
            swaps[spec.key], note = swap_runs(spec, broker, work / "swap" / spec.key, args.swaps, args.rate)
            notes.append(note)
        for spec in specs:
            unpaced[spec.key] = unpaced_runs(spec, broker, work / "unpaced" / spec.key, args.rounds, args.burst)

    elapsed = time.monotonic() - started
    spent = [b - a for a, b in zip(machine0, machine_times(), strict=True)]
    busy_s = (sum(spent) - spent[3] - spent[4]) / CLOCK_TICKS
    others = max(0.0, busy_s - (our_cpu_s() - ours0)) / elapsed
    steal = spent[7] / max(sum(spent), 1)
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    niceness = os.nice(0)
    command = " ".join([*(["nice", "-n", str(niceness)] if niceness else []), "python", "benchmarks/updates.py",
                        *sys.argv[1:]])  # fmt: skip
    shared = others >= 0.1
    source1 = source_state()
    source = (
        source0[0]
        if source0[1] == source1[1]
        else (f"the code changed during the run: {source0[0]} at the start, {source1[0]} at the end")
    )
    machine = (
        f"Run finished {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {describe_machine()}, "
        f"{'a shared machine: other processes used' if shared else 'other processes used only'} {others:.2f} cores "
        f"on average during the run (the machine's busy CPU less this script's and its children's; steal "
        f"{steal:.0%}; load average {' '.join(load0)} before, {' '.join(load1)} after); {elapsed:.0f} s in all. "
        f"{source}; Python {sys.version.split()[0]}. {'; '.join(export_notes)}. "
        "Mosquitto on loopback (tests.mqtt_broker), no persistence; every daemon has its "
        f"own state directory (outbox on, the default)."
    )
    sizes = "; ".join(f"**{s.key}**: {s.label}; {s.size:,} bytes (manifest and files)" for s in specs)
    trial_cost = {
        k: v["trial"] for k, v in unpaced.items() if v["trial"] is not None
    }  # the long trials' own figures, from the daemon's status
    trial_lines = "; ".join(
        f"{k}: {t['inputs']} inputs, median new {fmt(t.get('median_ms') or float('nan'), 3)} ms / previous "
        f"{fmt(t.get('previous_median_ms') or float('nan'), 3)} ms, p95 new {fmt(t['p95_ms'] or float('nan'), 3)} ms "
        f"/ previous {fmt(t['previous_p95_ms'] or float('nan'), 3)} ms, agreement {t['agreement']}"
        for k, t in trial_cost.items()
    )
    sections = [
        f"Command: `{command}`",
        machine,
        f"Bundles ({sizes}). Every figure below was measured in this run; nothing is estimated.",
        "## 1. Verifying a new version, step by step (device side, in-process)\n\n"
        f"Median (min–max) of {args.repeats} runs after one untimed run, the bundles interleaved; each run on fresh "
        "directories (a new repository, a device with no TUF metadata and no downloads). The repository is a local "
        "directory the script has just written, so its files are in the page cache: a USB stick or an HTTP "
        "server adds its own read or transfer time to `fetch`. Every file is hashed (sha256) five times between "
        "publish and serving: twice at publish (`read_bundle`, then TUF's target hash over the tar) and three times "
        "on the device (TUF at fetch, `read_bundle` at unpack, `read_bundle` again in `load`); the last row gives "
        "the cost of one such hash here.\n\n" + steps,
        "## 2. Swap time: found → serving, from the daemon's log\n\n"
        f"{args.swaps} swaps per bundle, one after the other in one daemon (`edgeline run ... --updates REPO "
        f"--trusted-root ROOT --check-interval 0.2`), each while inputs stream at {args.rate:g}/s at QoS 1 (JSON); "
        "the new version is the same model with a higher version, published with the default trial gates "
        "(200 inputs, or 600 s), so the trial takes about 200 / rate seconds. Times are differences between "
        "the daemon's log lines (millisecond timestamps). 'update thread CPU': the `edgeline-updates` thread's CPU "
        "time over that span (`schedstat`).\n\n" + swap_table(specs, swaps),
        "## 3. Answers around a swap: client-side latency\n\n"
        "Every input of part 2's streams, from its publish to its answer's arrival at a subscriber (matched by id), "
        "grouped by what the daemon was doing when the input was published (from its log); all swaps of a bundle "
        "pooled; the first second of the first stream (a fresh daemon's first inputs) is left out. 'answered by': the "
        "version that answered (new = the version being swapped in). "
        + " ".join(f"{n}." for n in notes)
        + "\n\n"
        + latency_table(specs, swaps),
        "## 4. What the shadow trial costs\n\n"
        "### Paced (part 2's streams)\n\n"
        "Per input, before the swap, during the trial and after the commit: the answers' `latency_ms` (the model "
        "call of the version that answered, divided by the batch when batched: during a trial it does not include "
        "the previous version's call), the trial's own median and p95 of each version's call (`last_trial` in the "
        "daemon's "
        "status after the commit), and the worker thread's CPU time per answered input over the phase (decode, "
        "model calls, comparison, encode; from `schedstat`, median over the swaps).\n\n"
        + paced_cost_table(specs, swaps),
        "### Unpaced: throughput with and without a trial\n\n"
        f"Two daemons per bundle, both started on v1 with `--updates` (checks every 3600 s: only the one at "
        f"start; status every 1 s): 'no trial' has nothing newer to take; 'trial' found v2 at start, published with "
        f"`Gates(inputs=100000, seconds=3600)`, so its trial lasts the whole measurement. Each got 300 untimed "
        f"inputs, then {args.rounds} interleaved rounds of {args.burst} inputs sent as fast as one publisher can "
        f"(QoS 1, up to 1000 in flight); msg/s = inputs / (last answer − first publish). The trial's own figures "
        f"at the end (status): {trial_lines or 'none received'}.\n\n" + unpaced_table(specs, unpaced),
        "### The order of the two calls\n\n"
        "A trial calls both versions on every input, one after the other (`TrialRunner.run`). In this process: two "
        "opened copies of each bundle (`edgeline.load`) called one after the other on the same input, back to back "
        "(as under a backlog) and with 20 ms between inputs (as a 50/s stream); per-call `time.perf_counter`. Both "
        "copies are the same model, so any difference is the place in the order: what a trial that always called "
        "the same version first would wrongly blame on it.\n\n" + order,
    ]
    text = "\n\n".join(sections)
    print(text)
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        # the cage's section (benchmarks/update_cage.py) is kept, after its marker
        old = args.write.read_text() if args.write.exists() else ""
        kept = old[old.index(CAGE_MARKER) :] if CAGE_MARKER in old else ""
        args.write.write_text("# Signed updates: verification, swap time, the answers around a swap, the trial's cost"
                              "\n\n" + text + "\n" + ("\n" + kept if kept else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
