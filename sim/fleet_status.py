"""What a simulated fleet (``edgeline.sim.fleet``) hears of its devices on the broker: statuses, availability, answers.

``FleetObserver`` is the fleet's bookkeeping, without processes or a connection: it is handed every message of the
fleet's subscriptions (``on_message``, the MQTT callback), keeps a record per device under its own lock, and answers
from any thread what was heard: each device's latest status, running version and update phase, its answers by the
version that gave them, whether it is alive as a gateway would judge. Waits on it wake at every message.

    observer = FleetObserver("digits", ["fleet-01", "fleet-02"], stale_after_s=4.0)
    connection.subscribe([...], 1, observer.on_message)
    observer.wait_for(lambda: set(observer.versions().values()) == {2}, 60.0, poll_s=0.5)

Only the topics of the fleet's devices count (see ``edgeline.sim.fleet``): ``edgeline/NAME/ID/status`` and
``.../availability`` of the bundle's NAME, and ``fleet/ID/results/+``; anything else, and any device not of the
fleet, is ignored.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgeline.errors import EdgelineError

__all__ = ["FleetError", "FleetObserver", "VersionChange", "running_version", "update_phase"]


class FleetError(EdgelineError):
    """A fleet that cannot be made, started or observed as asked; the message names the device and its log."""


@dataclass(frozen=True)
class VersionChange:
    """A device's running version or its update phase changed: ``fleet-03: v1 -> v2 (committed)``.

    ``before``: the version it ran before ``after`` (None the first time it is heard from); ``phase`` is
    ``update_phase`` of its status.
    """

    device: str
    before: int | None
    after: int | None
    phase: str

    def __str__(self) -> str:
        after = f"v{self.after}" if self.after is not None else "no version"
        if self.before is None:
            return f"{self.device}: {after} ({self.phase})"
        return f"{self.device}: v{self.before} -> {after} ({self.phase})"


def running_version(status: Mapping[str, Any]) -> int | None:
    """The version a status message says is answering: its ``update.running``, else its ``version``."""
    update = status.get("update")
    value = update.get("running") if isinstance(update, dict) else None
    value = status.get("version") if value is None else value
    return value if isinstance(value, int) else None


def update_phase(status: Mapping[str, Any]) -> str:
    """Where the running version stands: ``trial``, ``committed``, ``rolled back``, ``reverted`` (a revoked version
    left), or ``running`` (the bundle the daemon was given, or a daemon without updates)."""
    update = status.get("update")
    if not isinstance(update, dict):
        return "running"
    if update.get("state") == "trial" or update.get("trial") is not None:
        return "trial"
    committed = update.get("committed")
    if isinstance(committed, dict) and committed.get("version") == running_version(status):
        return "committed"
    last = update.get("last")
    step = last.get("step") if isinstance(last, dict) else None
    return str(step).replace("-", " ") if step in ("rolled-back", "reverted") else "running"


@dataclass
class _Seen:
    """What the observer knows of one device (guarded by the observer's lock)."""

    status: dict[str, Any] | None = None
    status_at: float | None = None
    statuses: int = 0
    availability: str | None = None
    onlines: int = 0
    answered: int = 0
    errors: int = 0
    by_version: Counter[int] = field(default_factory=Counter)
    version_runs: list[int] = field(default_factory=list)
    reported: tuple[int | None, str] | None = None
    before: int | None = None


class FleetObserver:
    """The statuses, availability and answers of the ``devices`` of a fleet running bundle ``name``; see the module.

    ``on_change`` is called on the MQTT thread for every ``VersionChange`` (keep it short). A device is ``alive``
    while it says "online" and its last status is younger than ``stale_after_s``.
    """

    def __init__(
        self,
        name: str,
        devices: Sequence[str],
        *,
        stale_after_s: float,
        on_change: Callable[[VersionChange], None] | None = None,
    ) -> None:
        self.name = name
        self.stale_after_s = stale_after_s
        self.on_change = on_change
        # reentrant: the conditions ``wait_for`` checks under the lock call the queries, which take it again
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._seen = {device: _Seen() for device in devices}

    def known(self, device: str) -> str:
        """``device``, when it is one of the fleet's; FleetError listing them otherwise."""
        if device not in self._seen:
            raise FleetError(f"no device {device!r} in this fleet; its devices: {', '.join(self._seen)}")
        return device

    def retained_topics(self, device: str) -> tuple[str, str]:
        """The device's retained status and availability topics; ``+``: every device's, to subscribe to."""
        return f"edgeline/{self.name}/{device}/status", f"edgeline/{self.name}/{device}/availability"

    # -- what was heard ----------------------------------------------------------------------------------------
    def status(self, device: str) -> dict[str, Any] | None:
        """The latest status message of the device's daemon (retained or live), or None before any."""
        with self._lock:
            status = self._seen[self.known(device)].status
            return dict(status) if status is not None else None

    def versions(self) -> dict[str, int | None]:
        """Each device's running version, as its latest status says (None before any)."""
        with self._lock:
            return {d: running_version(s.status) if s.status else None for d, s in self._seen.items()}

    def phases(self) -> dict[str, str | None]:
        """Each device's ``update_phase`` (None before any status)."""
        with self._lock:
            return {d: update_phase(s.status) if s.status else None for d, s in self._seen.items()}

    def answered(self, device: str) -> int:
        """Answers seen on the device's answer topic (results and coded errors)."""
        with self._lock:
            return self._seen[self.known(device)].answered

    def answers_by_version(self, device: str) -> Counter[int]:
        """The device's answers by the ``version`` that answered them."""
        with self._lock:
            return Counter(self._seen[self.known(device)].by_version)

    def version_sequence(self, device: str) -> list[int]:
        """The versions of the device's answers in the order they arrived, repeats collapsed: ``[1, 2]`` for a
        device that answered with v1, then only with v2; ``[1, 2, 1]`` for one that went back."""
        with self._lock:
            return list(self._seen[self.known(device)].version_runs)

    def errors(self, device: str) -> int:
        """The device's coded error answers."""
        with self._lock:
            return self._seen[self.known(device)].errors

    def status_age(self, device: str) -> float | None:
        """Seconds since the device's last status arrived; None before any."""
        with self._lock:
            at = self._seen[self.known(device)].status_at
        return None if at is None else time.monotonic() - at

    def alive(self, device: str) -> bool:
        """Whether the broker says "online" for the device and its status is fresh: what a gateway can see."""
        age = self.status_age(device)
        with self._lock:
            online = self._seen[device].availability == "online"
        return online and age is not None and age < self.stale_after_s

    def table(self, exits: Mapping[str, int]) -> str:
        """A table: each device's version, update phase (``exited CODE`` for the devices in ``exits``, whose daemon
        ended by itself), answers, and answers by the version that gave them."""
        phases = self.phases()
        rows = [("device", "version", "phase", "answered", "by version")]
        for device, version in self.versions().items():
            phase = phases[device] or "never reported"
            if device in exits:
                phase = f"exited {exits[device]}"
            counts = ", ".join(f"v{v}: {n}" for v, n in sorted(self.answers_by_version(device).items()))
            rows.append((device, "-" if version is None else f"v{version}", phase, str(self.answered(device)), counts))
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
            for row in rows
        ).rstrip()

    # -- a daemon starting -------------------------------------------------------------------------------------
    def forget_availability(self, device: str) -> None:
        """Before the device's daemon starts (again): its "online" counts from now on."""
        with self._lock:
            self._seen[self.known(device)].availability = None

    def progress(self, devices: Sequence[str]) -> dict[str, tuple[int, int]]:
        """For ``ready``: how many times each device has said "online", and reported a status, so far."""
        with self._lock:
            return {device: (self._seen[device].onlines, self._seen[device].statuses) for device in devices}

    def ready(self, device: str, since: tuple[int, int]) -> bool:
        """Whether the device has said "online" (and still does) and reported a status since ``progress`` said
        ``since``."""
        with self._lock:
            seen = self._seen[device]
            return seen.onlines > since[0] and seen.availability == "online" and seen.statuses > since[1]

    # -- waiting -----------------------------------------------------------------------------------------------
    def wait_for(self, condition: Callable[[], bool], timeout_s: float, *, poll_s: float) -> bool:
        """Until ``condition()`` holds, checked at every message and every ``poll_s``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, poll_s))
            return True

    def wait_quiet(self, quiet_s: float, *, limit_s: float) -> None:
        """Until nothing has arrived for ``quiet_s`` (at most ``limit_s``)."""
        end = time.monotonic() + limit_s
        with self._changed:
            while time.monotonic() < end and self._changed.wait(min(quiet_s, max(0.0, end - time.monotonic()))):
                pass

    # -- the MQTT thread ---------------------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes, ack: Callable[[], None] | None, reply: object) -> None:
        """The MQTT callback: one status, availability or answer of a device of ours (anything else is ignored)."""
        try:
            change = self._take(topic.split("/"), payload)
        finally:
            if ack is not None:
                ack()
        if change is not None and self.on_change is not None:
            self.on_change(change)

    def _take(self, levels: list[str], payload: bytes) -> VersionChange | None:
        if len(levels) != 4 or not payload:  # an empty payload: a retained message cleared
            return None
        if levels[0] == "edgeline" and levels[1] == self.name and levels[3] in ("status", "availability"):
            device, kind = levels[2], levels[3]
        elif levels[0] == "fleet" and levels[2] == "results":
            device, kind = levels[1], "results"
        else:
            return None
        with self._changed:
            seen = self._seen.get(device)
            if seen is None:
                return None
            change = None
            if kind == "availability":
                seen.availability = payload.decode("utf-8", "replace")
                seen.onlines += seen.availability == "online"
            elif kind == "results":
                answer = _json_object(payload)
                seen.answered += 1
                seen.errors += "error" in answer
                version = answer.get("version")
                if isinstance(version, int):
                    seen.by_version[version] += 1
                    if not seen.version_runs or seen.version_runs[-1] != version:
                        seen.version_runs.append(version)
            elif kind == "status":
                status = _json_object(payload)
                if not status:
                    return None
                seen.status, seen.status_at = status, time.monotonic()
                seen.statuses += 1
                change = self._change(device, seen, running_version(status), update_phase(status))
            self._changed.notify_all()
            return change

    @staticmethod
    def _change(device: str, seen: _Seen, version: int | None, phase: str) -> VersionChange | None:
        if seen.reported == (version, phase):
            return None
        if seen.reported is not None and seen.reported[0] != version:
            seen.before = seen.reported[0]
        seen.reported = (version, phase)
        return VersionChange(device, seen.before, version, phase)


def _json_object(payload: bytes) -> dict[str, Any]:
    try:
        value = json.loads(payload)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
