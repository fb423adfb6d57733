"""``edgeline rollout``: a version reaches the fleet in waves, at a gateway beside the broker, and halts by itself.

    canary (K devices) ─► wait for each device's outcome ─► soak: watch their health ─► next wave (twice as many)
          │                 (committed | refused | silent)       (errors, anomalies, latency)      ... every device
          └── a wave whose failure rate exceeds --max-failure-rate: halt; the version is revoked in the signed
              metadata, devices that took it go back to their previous version, the others never see it

The wave's devices are the target's ``audience`` in the signed targets metadata: a device outside it never
downloads the version. Outcomes and health come from each device's retained status message
(``edgeline/{name}/{instance}/status``): its ``update`` section says what it runs, committed and refused, and its
counts and latencies give the rates. No cloud service is involved: the gateway needs the broker, the repository
directory and the targets, snapshot and timestamp keys.

A device that was reporting before its wave and stops reporting during it counts as failed (a version that kills
the daemon looks like this); a device never heard from is "unreachable", and one without the disk or memory for the
version now is "no-room" (it takes the version once it has room), and one whose download of it did not finish in
time is "timeout": all are said and left out of the rate. A wave
that no device could judge stops the rollout without revoking anything.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeline.errors import UpdateError
from edgeline.updates.policy import TargetFacts, target_path
from edgeline.updates.repository import Repository

__all__ = ["Fleet", "Health", "Outcome", "Rollout", "RolloutOptions", "load_fleet", "waves"]

log = logging.getLogger("edgeline.rollout")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FleetBroker(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)


class FleetDevice(_Frozen):
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    group: str | None = None


class Fleet(_Frozen):
    """FLEET.toml: the devices (their daemons' instance ids), in rollout order after the canaries."""

    name: str | None = None
    status_topic: str = "edgeline/{name}/{instance}/status"
    broker: FleetBroker = FleetBroker()
    device: tuple[FleetDevice, ...] = Field(min_length=1)

    def ordered(self, canary_group: str = "canary") -> list[str]:
        """Devices of the canary group first, then the others, each in file order."""
        first = [d.id for d in self.device if d.group == canary_group]
        return first + [d.id for d in self.device if d.group != canary_group]


def load_fleet(path: Path) -> Fleet:
    from edgeline.device_profiles.toml import tomllib
    from edgeline.device_profiles.validation import describe_validation_error

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UpdateError(f"--fleet {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UpdateError(f"{path}: not valid TOML: {exc}") from exc
    try:
        fleet = Fleet.model_validate(data)
    except ValidationError as exc:
        raise UpdateError(describe_validation_error(exc, Fleet, f"{path}: invalid fleet file")) from exc
    ids = [d.id for d in fleet.device]
    if len(set(ids)) != len(ids):
        raise UpdateError(f"{path}: a device id is listed twice")
    return fleet


def waves(devices: list[str], canary: int, factor: float = 2.0) -> list[list[str]]:
    """The devices of each wave: ``canary`` first, then waves ``factor`` times the size of everything before."""
    out: list[list[str]] = []
    done = 0
    size = max(1, canary)
    while done < len(devices):
        out.append(devices[done : done + size])
        done += len(out[-1])
        size = max(1, int(done * (factor - 1.0)) or 1)
    return out


@dataclass(frozen=True)
class Health:
    """A device's cumulative counts and latency from one status message."""

    received: int
    errors: int
    results: int
    anomalies: int
    p50_ms: float | None
    at: float

    @classmethod
    def of(cls, status: dict[str, Any]) -> Health:
        counts = status.get("counts") or {}
        model = (status.get("latency_ms") or {}).get("model") or {}
        return cls(
            received=int(counts.get("received", 0)),
            errors=int(counts.get("errors", 0)),
            results=int(counts.get("results", 0)),
            anomalies=int(counts.get("anomalies", 0)),
            p50_ms=model.get("p50"),
            at=time.monotonic(),
        )


def regression(before: Health, after: Health, *, max_error_increase: float, max_anomaly_increase: float) -> str | None:
    """Why a device's health after the update is worse than before it, or None. Rates are over the inputs between
    the two readings against the device's lifetime rates before; latency is the model's median call, twice as long
    and over 1 ms longer."""
    base_error = before.errors / before.received if before.received else 0.0
    base_anomaly = before.anomalies / before.results if before.results else 0.0
    received = after.received - before.received
    results = after.results - before.results
    if received > 0:
        rate = (after.errors - before.errors) / received
        if rate > base_error + max_error_increase:
            return f"error rate {rate:.1%} over {received} inputs (before: {base_error:.1%})"
    if results > 0:
        rate = (after.anomalies - before.anomalies) / results
        if rate > base_anomaly + max_anomaly_increase:
            return f"anomaly rate {rate:.1%} over {results} results (before: {base_anomaly:.1%})"
    # The median call: a p99 over a status window on a busy device is its few delayed calls, not the model.
    if (
        before.p50_ms is not None
        and after.p50_ms is not None
        and after.p50_ms > 2.0 * before.p50_ms
        and after.p50_ms - before.p50_ms > 1.0
    ):
        return f"median model latency {after.p50_ms:.3g} ms (before: {before.p50_ms:.3g} ms)"
    return None


class StatusWatch:
    """The latest status message of every instance of one bundle name, from the broker (retained and live)."""

    def __init__(self, fleet: Fleet, name: str):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.topic = fleet.status_topic.format(name=name, instance="+")
        self.instance_level = fleet.status_topic.split("/").index("{instance}")
        self._lock = threading.Lock()
        self.latest: dict[str, dict[str, Any]] = {}
        self.seen_at: dict[str, float] = {}
        self.connected = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="", protocol=mqtt.MQTTv311)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.connect_async(fleet.broker.host, fleet.broker.port, keepalive=30)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any = None) -> None:
        client.subscribe(self.topic, qos=1)
        self.connected.set()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        levels = message.topic.split("/")
        if len(levels) <= self.instance_level:
            return
        try:
            status = json.loads(message.payload)
        except ValueError:
            return
        if isinstance(status, dict):
            with self._lock:
                self.latest[levels[self.instance_level]] = status
                self.seen_at[levels[self.instance_level]] = time.monotonic()

    def get(self, device: str) -> tuple[dict[str, Any] | None, float | None]:
        with self._lock:
            return self.latest.get(device), self.seen_at.get(device)

    def __enter__(self) -> StatusWatch:
        self.client.loop_start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.disconnect()
        self.client.loop_stop()


UNJUDGED = frozenset({"unreachable", "no-room", "timeout"})
"""Outcomes that say nothing of the version: said, and left out of a wave's failure rate."""


@dataclass
class Outcome:
    device: str
    state: str  # committed | failed | unreachable | no-room | timeout | waiting
    detail: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"device": self.device, "state": self.state, "detail": self.detail}


@dataclass(frozen=True)
class RolloutOptions:
    canary: int = 1
    max_failure_rate: float = 0.1
    wave_timeout_s: float = 900.0
    soak_s: float = 60.0
    stale_after_s: float = 60.0
    """A device whose last status is older than this during its wave counts as silent."""
    max_error_increase: float = 0.02
    max_anomaly_increase: float = 0.05
    factor: float = 2.0


@dataclass
class Rollout:
    repository: Repository
    fleet: Fleet
    name: str
    version: int
    options: RolloutOptions = field(default_factory=RolloutOptions)
    say: Callable[[str], None] = print
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    halted: str | None = None
    stopped: str | None = None

    @property
    def path(self) -> str:
        return target_path(self.name, self.version)

    def _facts(self) -> TargetFacts:
        facts = self.repository.versions(self.name).get(self.version)
        if facts is None:
            raise UpdateError(
                f"{self.repository.directory}: {self.name} v{self.version} is not published "
                "(publish it with --hold first)"
            )
        if facts.revoked:
            raise UpdateError(f"{self.name} v{self.version} was revoked ({facts.revoked}); publish a new version")
        if facts.audience is None:
            raise UpdateError(
                f"{self.name} v{self.version} is already offered to every device: publish it with --hold for a rollout"
            )
        return facts

    def run(self) -> bool:
        """The whole rollout; True when every wave passed, False when it halted (a regression: the version is
        revoked) or stopped (no device of a wave could judge it: nothing is revoked)."""
        facts = self._facts()
        devices = self.fleet.ordered()
        plan = waves(devices, self.options.canary, self.options.factor)
        self.say(
            f"rollout of {self.name} v{self.version} to {len(devices)} devices in {len(plan)} waves "
            f"({', '.join(str(len(w)) for w in plan)}); halt above {self.options.max_failure_rate:.0%} failures"
        )
        offered = list(facts.audience or ())
        with StatusWatch(self.fleet, self.name) as watch:
            if not watch.connected.wait(30.0):
                raise UpdateError(f"broker {self.fleet.broker.host}:{self.fleet.broker.port} cannot be reached")
            time.sleep(1.0)  # the retained statuses arrive
            for number, wave in enumerate(plan, 1):
                baseline = {d: Health.of(s) for d in wave if (s := watch.get(d)[0]) is not None}
                offered += [d for d in wave if d not in offered]
                self._offer(tuple(offered))
                self.say(f"wave {number}/{len(plan)}: offered to {', '.join(wave)}")
                self._await_outcomes(watch, wave, baseline)
                self._soak(watch, wave, baseline)
                failed = [o for d in wave if (o := self.outcomes[d]).state == "failed"]
                judged = [d for d in wave if self.outcomes[d].state not in UNJUDGED]
                for device in wave:
                    outcome = self.outcomes[device]
                    self.say(f"  {device}: {outcome.state}{': ' + outcome.detail if outcome.detail else ''}")
                if not judged:  # nothing was learnt of the version: stop, revoke nothing
                    self._stop(number, wave)
                    return False
                if len(failed) / len(judged) > self.options.max_failure_rate:
                    why = f"wave {number}: {len(failed)} of {len(judged)} devices failed"
                    if failed:
                        why += f" ({failed[0].device}: {failed[0].detail})"
                    self._halt(why)
                    return False
        self._offer(None)
        self.say(f"{self.name} v{self.version} reached every wave: offered to every device from now on")
        return True

    def _offer(self, audience: tuple[str, ...] | None) -> None:
        def widen(facts: TargetFacts) -> TargetFacts:
            return facts.model_copy(update={"audience": audience})

        self.repository.update_target(self.path, widen)

    def _outcome(self, device: str, status: dict[str, Any] | None, seen: float | None, was_reporting: bool) -> Outcome:
        now = time.monotonic()
        if status is None:
            return Outcome(device, "unreachable", "no status heard")
        update = status.get("update") or {}
        refused = (update.get("refused") or {}).get(str(self.version))
        if refused:
            return Outcome(device, "failed", f"{refused.get('reason')}: {refused.get('message')}")
        committed = update.get("committed") or {}
        if committed.get("version") == self.version and update.get("running") == self.version:
            return Outcome(device, "committed")
        if seen is not None and now - seen > self.options.stale_after_s:
            return Outcome(device, "failed" if was_reporting else "unreachable", f"silent for {now - seen:.0f} s")
        last_refusal = update.get("last_refusal") or {}
        if last_refusal.get("version") == self.version:  # refused for now: the device tries again at each check
            detail = f"refused ({last_refusal.get('reason')}): {last_refusal.get('message')}"
            # a full disk or a link too slow for the archive says nothing of the version: left out of the rate, like
            # a device out of reach
            reason = last_refusal.get("reason")
            return Outcome(device, reason if reason in ("no-room", "timeout") else "waiting", detail)
        return Outcome(device, "waiting", str((update.get("last") or {}).get("step", "")))

    def _await_outcomes(self, watch: StatusWatch, wave: list[str], baseline: dict[str, Health]) -> None:
        deadline = time.monotonic() + self.options.wave_timeout_s
        while True:
            for device in wave:
                status, seen = watch.get(device)
                self.outcomes[device] = self._outcome(device, status, seen, device in baseline)
            if all(self.outcomes[d].state != "waiting" for d in wave) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for device in wave:
            if self.outcomes[device].state == "waiting":
                last = self.outcomes[device].detail
                self.outcomes[device] = Outcome(
                    device,
                    "failed",
                    f"no outcome within {self.options.wave_timeout_s:g} s (last step: {last or 'none'})",
                )

    def _soak(self, watch: StatusWatch, wave: list[str], baseline: dict[str, Health]) -> None:
        """Watch the wave's committed devices for ``soak_s``: a regression against their health before fails them."""
        committed = [d for d in wave if self.outcomes[d].state == "committed" and d in baseline]
        if not committed or self.options.soak_s <= 0:
            return
        end = time.monotonic() + self.options.soak_s
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            for device in committed:
                status, seen = watch.get(device)
                if status is None or self.outcomes[device].state != "committed":
                    continue
                silent = time.monotonic() - seen if seen is not None else 0.0
                if silent > self.options.stale_after_s:
                    self.outcomes[device] = Outcome(device, "failed", f"silent for {silent:.0f} s after it committed")
                    continue
                if (status.get("update") or {}).get("running") != self.version:
                    self.outcomes[device] = Outcome(device, "failed", "no longer runs the version")
                    continue
                why = regression(
                    baseline[device], Health.of(status),
                    max_error_increase=self.options.max_error_increase,
                    max_anomaly_increase=self.options.max_anomaly_increase,
                )  # fmt: skip
                if why is not None:
                    self.outcomes[device] = Outcome(device, "failed", why)

    def _stop(self, number: int, wave: list[str]) -> None:
        """No device of the wave could judge the version (out of reach, or without room for it): the rollout stops
        without revoking it, since nothing says it is bad; the devices offered it so far keep it offered."""
        states = ", ".join(f"{d} {self.outcomes[d].state}" for d in wave)
        self.stopped = f"wave {number}: no device of it could judge the version ({states})"
        self.say(f"STOPPED: {self.stopped}")
        self.say(
            f"{self.name} v{self.version} is not revoked: it stays offered to the devices of the waves so far; run "
            "the rollout again once they can be reached (or have room)"
        )

    def _halt(self, why: str) -> None:
        self.halted = why
        self.repository.update_target(self.path, lambda f: f.model_copy(update={"revoked": why[:300]}))
        self.say(f"HALTED: {why}")
        self.say(
            f"{self.name} v{self.version} is revoked in the signed metadata: devices that took it go back to their "
            "previous version, the others never fetch it"
        )
