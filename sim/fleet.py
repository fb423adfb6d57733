"""A simulated fleet: N ``edgeline run`` daemons on one broker, all checking one update repository, fed inputs.

What ``edgeline rollout`` is tested and shown against: each device is a real daemon in a child process, with its
own instance id and state directory, so an update reaches it, is tried, committed or refused exactly as on a device.

    with SimFleet(bundle, 3, broker="127.0.0.1:1883", work=Path("work"), updates=repo, trusted_root=root) as fleet:
        fleet.write_fleet_file(Path("work/fleet.toml"))
        fleet.wait_until(lambda: set(fleet.versions().values()) == {2}, 60, "every device on v2")

Device ``ID`` (``{prefix}-01``, ``{prefix}-02``, ...) is its daemon's ``--instance``; its topics are its own:

    fleet/ID/sensors/image          its inputs, {"id": "ID-N", "data": [...]} at QoS 1 (the daemon's device: image)
    fleet/ID/results/image          its answers; their "version" is the version that answered
    edgeline/NAME/ID/status         its retained status (every ``status_interval_s``, and at each update step)
    edgeline/NAME/ID/availability   retained "online"; "offline" at a clean stop, and as its last will

In ``work``: ``ID/`` is the daemon's state directory (kept: a fleet started again resumes on what its devices
committed), ``ID.log`` its log, ``ID.toml`` its configuration (the status interval only).

Inputs replay the samples of ``data`` (an .npz, or ``edgeline reference prepare digits --out DIR``) or, without it,
seeded random values in [0, 1) of the bundle's input shape: scikit-learn's digits need the export extra, and the tiny
8x8 classifier takes either. Before its daemons start, the fleet clears its devices' retained status and availability,
so that what an earlier run left on the broker is not taken for the new one. Every wait is bounded.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from edgeline.daemon.config import BrokerAddress, BrokerConfig
from edgeline.sim.fleet_status import FleetError, FleetObserver, VersionChange, running_version, update_phase

__all__ = [
    "ANSWER_TOPIC",
    "INPUT_SUBSCRIPTION",
    "INPUT_TOPIC",
    "SENSOR",
    "FleetError",
    "SimFleet",
    "VersionChange",
    "assign_groups",
    "fleet_file_text",
    "running_version",
    "update_phase",
]

SENSOR = "image"
"""The one sensor of every device: the daemon's device (the first + of its subscription) in its answers."""
INPUT_TOPIC = "fleet/{instance}/sensors/{sensor}"
INPUT_SUBSCRIPTION = "fleet/{instance}/sensors/+"
ANSWER_TOPIC = "fleet/{instance}/results/{device}"
"""The daemons' ``--publish``: the daemon fills in its instance and the input's device (``image``)."""
MAX_DEVICES = 100
"""Each device is a process of its own (about 100 MB): a machine runs a hundred at most."""
MAX_RATE_HZ = 1000.0
MAX_LAG_S = 1.0
"""The feeder, this far behind its schedule (a paused machine), carries on from now instead of sending a burst."""
RANDOM_SAMPLES = 256
_INSTANCE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
"""What the daemon takes as ``--instance`` (and ``edgeline rollout`` as a device id)."""


def assign_groups(devices: Sequence[str], groups: Mapping[str, int] | None) -> dict[str, str | None]:
    """Each device's group: ``{"canary": 1, "early": 2}`` puts the first device in ``canary``, the next two in
    ``early``; the others have none."""
    assigned: dict[str, str | None] = dict.fromkeys(devices)
    start = 0
    for group, count in (groups or {}).items():
        if not group.strip() or not group.isprintable():
            raise FleetError(f"group {group!r}: a printable name, e.g. canary")
        if count < 0:
            raise FleetError(f"group {group}: {count} devices; 0 or more")
        if start + count > len(devices):
            raise FleetError(f"groups of {start + count} devices in a fleet of {len(devices)}: {dict(groups or {})}")
        for device in devices[start : start + count]:
            assigned[device] = group
        start += count
    return assigned


def fleet_file_text(name: str, broker: BrokerAddress, groups: Mapping[str, str | None]) -> str:
    """FLEET.toml, as ``edgeline rollout --fleet`` reads it: the bundle name, the broker, each device in order."""
    lines = [
        "# a simulated fleet (edgeline sim fleet): the devices `edgeline rollout --fleet` takes a version to",
        f"name = {_toml_string(name)}",
        "[broker]",
        f"host = {_toml_string(broker.host)}",
        f"port = {broker.port}",
    ]
    for device, group in groups.items():
        lines += ["[[device]]", f"id = {_toml_string(device)}"]
        if group is not None:
            lines.append(f"group = {_toml_string(group)}")
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, but for characters beyond the BMP, which JSON writes as
    surrogate pairs (TOML refuses them), so those are written as they are; DEL, raw, TOML refuses too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


class SimFleet:
    """``count`` daemons running ``bundle`` on ``broker``, fed ``rate_hz`` inputs each, observed; see the module.

    ``start()`` clears the devices' retained messages, starts the daemons, waits (``start_timeout_s``) until each
    is online and has reported its status, then starts feeding. ``stop()`` stops feeding, SIGTERMs the daemons
    (they drain), SIGKILLs what is left after ``stop_timeout_s``; it is idempotent. What the daemons say is kept by
    a ``FleetObserver``: ``on_change`` is called on the MQTT thread for every ``VersionChange`` (keep it short); a
    device is ``alive`` while it says "online" and its last status is younger than ``stale_after_s`` (default: three
    status intervals and a second).
    """

    def __init__(
        self,
        bundle: Path,
        count: int,
        *,
        broker: str,
        work: Path,
        updates: str | None = None,
        trusted_root: Path | None = None,
        check_interval_s: float = 5.0,
        prefix: str = "fleet",
        rate_hz: float = 5.0,
        groups: dict[str, int] | None = None,
        data: Path | None = None,
        seed: int = 0,
        status_interval_s: float = 1.0,
        stale_after_s: float | None = None,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 20.0,
        on_change: Callable[[VersionChange], None] | None = None,
    ) -> None:
        from edgeline.bundle import read_bundle

        if not 1 <= count <= MAX_DEVICES:
            raise FleetError(f"--devices {count}: between 1 and {MAX_DEVICES} (each device is a process)")
        if (updates is None) != (trusted_root is None):
            raise FleetError("--updates and --trusted-root go together: the repository and the root that signs it")
        for flag, value in (("--check-interval", check_interval_s), ("--status-interval", status_interval_s)):
            if not (math.isfinite(value) and value > 0):
                raise FleetError(f"{flag} {value:g}: seconds above 0")
        if not (math.isfinite(rate_hz) and 0 < rate_hz <= MAX_RATE_HZ):
            raise FleetError(f"--rate {rate_hz:g}: inputs per second per device, above 0 and at most {MAX_RATE_HZ:g}")
        self.devices: tuple[str, ...] = tuple(f"{prefix}-{index:02d}" for index in range(1, count + 1))
        if not _INSTANCE.match(self.devices[-1]):
            raise FleetError(f"--prefix {prefix!r}: letters, digits, '.', '_' and '-' only, 60 characters at most")
        self.groups = assign_groups(self.devices, groups)
        self.broker = BrokerAddress.parse(broker)
        self.bundle = bundle.resolve()
        self.manifest = read_bundle(self.bundle).manifest
        if len(self.manifest.inputs) != 1:
            raise FleetError(f"{bundle}: {len(self.manifest.inputs)} inputs; a simulated fleet feeds models of one")
        self.name = self.manifest.name
        self.work = work.resolve()
        self.updates, self.trusted_root, self.check_interval_s = updates, trusted_root, check_interval_s
        self.rate_hz, self.data, self.seed = rate_hz, data, seed
        self.status_interval_s = status_interval_s
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.inputs = "not loaded yet"
        """What the feeder sends, in words (set by ``start``)."""
        stale_after_s = stale_after_s if stale_after_s is not None else 3 * status_interval_s + 1.0
        self._observer = FleetObserver(self.name, self.devices, stale_after_s=stale_after_s, on_change=on_change)
        self._lock = threading.Lock()
        self._fed = dict.fromkeys(self.devices, 0)
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._expected_exit: set[str] = set()
        self._stopping = threading.Event()
        self._feeder: threading.Thread | None = None
        self._connection: Any = None
        self._started = False
        self._stopped = False

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> SimFleet:
        if self._started:
            raise FleetError("this fleet was started already; make another")
        self._started = True
        try:
            sensors = self._sensors()
            self.work.mkdir(parents=True, exist_ok=True)
            self._connect()
            for device in self.devices:
                self._launch(device, fresh_log=True)
            self._wait_ready(self.devices)
            self._feeder = threading.Thread(target=self._feed, args=(sensors,), name="edgeline-fleet-feed", daemon=True)
            self._feeder.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop feeding, then the daemons (SIGTERM: they drain; SIGKILL after ``stop_timeout_s``); then the client."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._feeder is not None:
            self._feeder.join(5.0)
        running = [process for process in self._processes.values() if process.poll() is None]
        with self._lock:  # a daemon that ended before stays ``crashed``
            self._expected_exit.update(device for device, process in self._processes.items() if process in running)
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for process in running:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        if self._connection is not None:
            self._observer.wait_quiet(0.2, limit_s=1.0)  # the daemons' last answers and "offline", on their way to us
            self._connection.close(2.0)
            self._connection = None

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def kill(self, device: str) -> None:
        """A crash: SIGKILL the device's daemon, no drain (its broker session stays; the broker says "offline")."""
        process = self._processes.get(self._observer.known(device))
        if process is None or process.poll() is not None:
            raise FleetError(f"{device}: its daemon is not running")
        with self._lock:
            self._expected_exit.add(device)
        process.kill()
        process.wait(5.0)

    def restart(self, device: str) -> None:
        """Start the device's daemon again (after ``kill``, or after it ended), and wait until it is ready."""
        process = self._processes.get(self._observer.known(device))
        if process is not None and process.poll() is None:
            raise FleetError(f"{device}: its daemon is running (pid {process.pid}); kill it first")
        if self._stopped or not self._started:
            raise FleetError(f"{device}: the fleet is not running")
        with self._lock:
            self._expected_exit.discard(device)
        self._launch(device, fresh_log=False)
        self._wait_ready([device])

    # -- what the fleet heard: its observer's account, as ``FleetObserver`` documents each ------------------------
    @property
    def stale_after_s(self) -> float:
        return self._observer.stale_after_s

    def status(self, device: str) -> dict[str, Any] | None:
        return self._observer.status(device)

    def versions(self) -> dict[str, int | None]:
        return self._observer.versions()

    def phases(self) -> dict[str, str | None]:
        return self._observer.phases()

    def answered(self, device: str) -> int:
        return self._observer.answered(device)

    def answers_by_version(self, device: str) -> Counter[int]:
        return self._observer.answers_by_version(device)

    def version_sequence(self, device: str) -> list[int]:
        return self._observer.version_sequence(device)

    def errors(self, device: str) -> int:
        return self._observer.errors(device)

    def status_age(self, device: str) -> float | None:
        return self._observer.status_age(device)

    def alive(self, device: str) -> bool:
        return self._observer.alive(device)

    # -- what the fleet did ------------------------------------------------------------------------------------
    def fed(self, device: str) -> int:
        """Inputs sent to the device (handed to the MQTT client)."""
        with self._lock:
            return self._fed[self._observer.known(device)]

    def running(self, device: str) -> bool:
        """Whether the device's daemon process is running (this machine's view, not the broker's)."""
        process = self._processes.get(self._observer.known(device))
        return process is not None and process.poll() is None

    def pids(self) -> dict[str, int]:
        """The process id of each device's daemon (its latest start)."""
        return {device: process.pid for device, process in self._processes.items()}

    def crashed(self) -> dict[str, int]:
        """Devices whose daemon ended by itself (not by ``stop`` or ``kill``), with its exit code."""
        with self._lock:
            expected = set(self._expected_exit)
        return {
            device: code
            for device, process in self._processes.items()
            if device not in expected and (code := process.poll()) is not None
        }

    def log(self, device: str) -> str:
        """The daemon's log (every start of it)."""
        try:
            return self._log_path(self._observer.known(device)).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def write_fleet_file(self, path: Path) -> Path:
        """FLEET.toml of this fleet (``fleet_file_text``), for ``edgeline rollout --fleet``; returns ``path``."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(fleet_file_text(self.name, self.broker, self.groups), encoding="utf-8")
        except OSError as exc:
            raise FleetError(f"--fleet-file {path}: {exc.strerror or exc}") from exc
        return path

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until ``condition()`` holds (checked at every message and every 0.5 s); FleetError naming ``what`` and
        every device's state after ``timeout_s``."""
        if not self._observer.wait_for(condition, timeout_s, poll_s=0.5):
            raise FleetError(f"{what}: not within {timeout_s:g} s; {self.describe()}")

    def describe(self) -> str:
        """One line: each device's version, phase, liveness and answers."""
        phases = self.phases()
        parts = []
        for device, version in self.versions().items():
            state = "alive" if self.alive(device) else ("running" if self.running(device) else "down")
            parts.append(f"{device} v{version} {phases[device]} {state} {self.answered(device)} answers")
        return "; ".join(parts)

    def summary(self) -> str:
        """A table: each device's version, update phase (or its daemon's exit), answers, and answers by version."""
        return self._observer.table(self.crashed())

    # -- inside ------------------------------------------------------------------------------------------------
    def _log_path(self, device: str) -> Path:
        return self.work / f"{device}.log"

    def _sensors(self) -> list[Any]:
        """One replaying sensor per device, over the samples of ``data`` or seeded random ones."""
        import numpy as np

        from edgeline.sim.data import Samples, load_sensor_samples
        from edgeline.sim.sensors import ReplaySensor

        shape = tuple(self.manifest.inputs[0].shape[1:])
        if self.data is not None:
            samples = load_sensor_samples(self.data, "digits")
            if samples.sample_size != math.prod(shape):
                raise FleetError(
                    f"--data {self.data}: samples of {samples.sample_size} values; {self.name} takes "
                    f"{math.prod(shape)} ({'x'.join(map(str, shape))})"
                )
            self.inputs = f"the samples of {samples.source}"
        else:
            values = np.random.default_rng(self.seed).random((RANDOM_SAMPLES, *shape), dtype=np.float32)
            samples = Samples(values, None, f"seeded random values (seed {self.seed})")
            self.inputs = f"seeded random {'x'.join(map(str, shape))} values in [0, 1) (seed {self.seed})"
        return [ReplaySensor(SENSOR, device, samples, seed=self.seed) for device in self.devices]

    def _connect(self) -> None:
        """The fleet's own client: clears the retained messages of its devices, then subscribes (in that order, on
        one connection, so no stale status reaches us) to their status, availability and answers."""
        from edgeline.daemon.mqtt import MqttConnection

        config = BrokerConfig(
            host=self.broker.host, port=self.broker.port, session_expiry_s=0, connect_timeout_s=5.0, keepalive_s=10
        )
        connection = MqttConnection(config, client_id=f"edgeline-sim-fleet-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        connection.subscribe([], 1, self._observer.on_message)
        connection.start(_start_thread)
        self._connection = connection
        for device in self.devices:
            for topic in self._observer.retained_topics(device):
                connection.publish(topic, b"", qos=1, retain=True)
        for topic in self._observer.retained_topics("+"):
            connection.add_subscription(topic, 1)
        connection.add_subscription(ANSWER_TOPIC.format(instance="+", device="+"), 1)

    def _command(self, device: str) -> list[str]:
        command = [
            sys.executable, "-m", "edgeline.cli", "run", str(self.bundle), "--broker", str(self.broker),
            "--instance", device, "--state-dir", str(self.work / device), "--config", str(self.work / f"{device}.toml"),
            "--subscribe", INPUT_SUBSCRIPTION.format(instance=device), "--publish", ANSWER_TOPIC,
            "--qos", "1",
        ]  # fmt: skip
        if self.updates is not None and self.trusted_root is not None:
            command += ["--updates", self.updates, "--trusted-root", str(self.trusted_root.resolve())]
            command += ["--check-interval", f"{self.check_interval_s:g}"]
        return command

    def _launch(self, device: str, *, fresh_log: bool) -> None:
        config = f"# written by edgeline sim fleet\n[health]\nstatus_interval_s = {self.status_interval_s!r}\n"
        (self.work / f"{device}.toml").write_text(config, encoding="utf-8")
        self._observer.forget_availability(device)
        with self._log_path(device).open("wb" if fresh_log else "ab") as log:
            # a session of its own: a Ctrl-C at the terminal reaches the fleet, which stops its daemons in order
            self._processes[device] = subprocess.Popen(
                self._command(device), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True,
            )  # fmt: skip

    def _wait_ready(self, devices: Sequence[str]) -> None:
        """Until each device says "online" and has reported a status since its launch; FleetError naming the first
        daemon that ended meanwhile, or those not ready in time."""
        since = self._observer.progress(devices)

        def ready(device: str) -> bool:
            return self._observer.ready(device, since[device])

        def settled() -> bool:
            return all(map(ready, devices)) or any(self._processes[device].poll() is not None for device in devices)

        self._observer.wait_for(settled, self.start_timeout_s, poll_s=0.2)
        late = [device for device in devices if not ready(device)]
        if not late:
            return
        for device in devices:
            code = self._processes[device].poll()
            if code is not None:
                raise FleetError(
                    f"{device}: its daemon exited ({code}) while starting: {_last_lines(self.log(device))} "
                    f"(log {self._log_path(device)})"
                )
        raise FleetError(
            f"{', '.join(late)}: not online with a status within {self.start_timeout_s:g} s "
            f"(logs {self._log_path(late[0])}...): {_last_lines(self.log(late[0]))}"
        )

    def _feed(self, sensors: Sequence[Any]) -> None:
        """Message ``j`` goes to device ``j % N`` (its message ``j // N``), due ``j / (rate_hz * N)`` s from now."""
        from edgeline.sim.publisher import encode_json

        topics = [INPUT_TOPIC.format(instance=sensor.device, sensor=sensor.name) for sensor in sensors]
        interval = 1.0 / (self.rate_hz * len(sensors))
        due, index = time.monotonic(), 0
        while not self._stopping.is_set():
            lag = time.monotonic() - due
            if lag < 0:
                if self._stopping.wait(-lag):
                    return
            elif lag > MAX_LAG_S:
                due = time.monotonic()
            seq, which = divmod(index, len(sensors))
            sensor = sensors[which]
            self._connection.publish(topics[which], encode_json(sensor.next_message(seq)), qos=1)
            with self._lock:
                self._fed[sensor.device] += 1
            index += 1
            due += interval


def _last_lines(text: str, count: int = 1) -> str:
    """The log's last lines, joined on one line: a daemon that cannot start says why in its last."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:]) or "(nothing logged)"


def _start_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, name="edgeline-fleet-mqtt", daemon=True)
    thread.start()
    return thread
