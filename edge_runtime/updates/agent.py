"""The daemon's side of updates: a thread that checks the repository and takes a new version through its steps
(the swap itself, on the worker thread, is ``edgeline.updates.swap``).

    update thread (every check_interval_s)              worker thread (between two batches: ``Swap.poll``)
    check ─► found ─► precheck ─► fetch (TUF: length,   ─► trial: the new version answers, the previous one runs
    sha256) ─► unpack (manifest sha256, every file) ─►     beside it on the same inputs ─► judge ─► committed
    open (doctor's verdict) ─► golden self-test ─►          (persisted) | rolled back (the previous version answers
    propose                                                 again; the new one is refused from then on)

Every step is an ``Event``: one log line, a counter, and the daemon's status published at once (``on_event``).
Refusals that belong to the version (incompatible, malformed, self-test, trial, revoked) are persisted and never
tried again; those that belong to the repository's state (bad signature, tampered, rollback, expired) are retried
at the next check, and logged again only when they change.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.errors import REFUSAL_REASONS, BackendUnavailableError, EdgelineError, UpdateError, UpdateRefused
from edgeline.lograte import Repeated
from edgeline.updates.policy import Room, TargetFacts, precheck, room_refusal
from edgeline.updates.store import MAX_TRIAL_ATTEMPTS, Installed, State, Store
from edgeline.updates.swap import Swap, Worker

if TYPE_CHECKING:
    from edgeline.bundle import Bundle
    from edgeline.manifest import Manifest
    from edgeline.model import Model
    from edgeline.updates.cage import CageLimits
    from edgeline.updates.client import UpdateClient

__all__ = ["PERSISTED_REASONS", "Event", "UpdateAgent", "starting_bundle", "starting_on"]

log = logging.getLogger("edgeline.updates")

PERSISTED_REASONS = frozenset(
    {"incompatible", "malformed", "self-test", "trial", "revoked", "crashed", "hung", "too-big"}
)
"""Refusals that belong to the version itself: remembered in the state directory, never tried again."""
SAID_MEMORY = 64
"""Messages remembered as said (oldest forgotten first)."""
STEPS = ("checked", "found", "verified", "self-test", "trial", "committed", "rolled-back", "refused", "reverted")


@dataclass(frozen=True)
class Event:
    step: str
    version: int | None
    message: str
    reason: str | None = None
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "message": self.message,
            "reason": self.reason,
            "at": self.at,
        }


def starting_bundle(store: Store, given: Path, given_version: int) -> tuple[Path, State]:
    """The bundle to start on: the committed version when it is newer than the one given and still whole, else
    the one given. Whatever the state directory holds, this never raises (``Store.load`` sets a bad state file
    aside). A trial the last process did not finish counted one attempt against its version (``note_trying``);
    the agent refuses a version that used up its attempts when it starts (``refuse_died_in_trial``)."""
    committed, state = _committed_to_start_on(store, given, given_version)
    return (committed.path if committed is not None else given), state


def starting_on(store: Store, given: Bundle) -> tuple[Bundle, State]:
    """``starting_bundle`` for a bundle read already: the bundle to start on as read (and verified) here, so that
    the daemon opens it without reading its manifest and hashing its files again."""
    committed, state = _committed_to_start_on(store, given.path, given.manifest.version)
    return (committed if committed is not None else given), state


def _committed_to_start_on(store: Store, given: Path, given_version: int) -> tuple[Bundle | None, State]:
    """The committed version as read, when it is newer than the one given and whole; and the update state."""
    from edgeline.bundle import read_bundle

    state = store.load()
    trying = state.trying
    if trying is not None and trying["attempts"] < MAX_TRIAL_ATTEMPTS:
        log.warning("the trial of v%d was cut short (the process ended); it will be tried again", trying["version"])
    committed = state.committed
    if committed is not None and committed.version > given_version:
        path = store.resolve(committed)
        try:
            bundle = read_bundle(path)
        except EdgelineError as exc:
            log.error("the committed v%d cannot be opened (%s): starting on %s", committed.version, exc, given)
            return None, state
        log.info("starting on the committed v%d (%s) rather than v%d given", committed.version, path, given_version)
        return bundle, state
    return None, state


class UpdateAgent:
    """Checks ``client``'s repository for newer versions of the running bundle and takes them through the steps."""

    def __init__(
        self,
        *,
        client: UpdateClient,
        store: Store,
        state: State,
        running: Model,
        running_bundle: Path,
        device: str,
        interval_s: float,
        backend: str | None,
        max_batch: int,
        on_event: Callable[[Event], None] = lambda event: None,
        reserve_bytes: Callable[[], int] = lambda: 0,
        cage: Callable[[Manifest, TargetFacts], CageLimits] | None = None,
        worker: Worker | None = None,
    ):
        """``worker``: what a new version is swapped into between two batches (the daemon's ``Processor``); the
        agent makes its ``Swap`` around it. Without one, ``swap`` stays None until a test gives it one."""
        self.client = client
        self.store = store
        self.state = state
        self.name = running.name
        self.profile = running.manifest.profile
        self.inputs = running.manifest.inputs
        self.window = running.manifest.window
        self.device = device
        self.interval_s = interval_s
        self.backend = backend
        self.max_batch = max_batch
        self.on_event = on_event
        self.reserve_bytes = reserve_bytes
        """Bytes to leave free on the state directory's disk (the room the durable outbox may still grow into)."""
        self.cage = cage
        """The limits a version is opened and self-tested under in a child process first; None: in this process."""
        self.last_cage: dict[str, Any] | None = None
        self.running_version = running.version
        self.running_bundle = running_bundle
        self.counts: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter({reason: 0 for reason in REFUSAL_REASONS})
        self.last: Event | None = None
        self.last_trial: dict[str, Any] | None = None
        self.last_refusal: Event | None = None
        self._said = Repeated(log, "", every_s=math.inf, remember=SAID_MEMORY)
        """Each message (or key) is said once, and counted every time: ``_say``."""
        self._lock = threading.Lock()
        self.swap: Swap | None = Swap(self, worker) if worker is not None else None
        """The hand-over to the worker: made here, last, once the agent it reports to is whole."""

    # -- the update thread ---------------------------------------------------------------------------------------
    def run(self, stopping: threading.Event) -> None:
        """Check at start, then every ``interval_s``; a failed check is logged and tried again at the next one.
        While a trial runs, no new version is looked for."""
        self.refuse_died_in_trial()
        delay = 0.0
        while not stopping.wait(delay):
            delay = self.interval_s
            if self.swap is not None and self.swap.busy.is_set():
                delay = min(self.interval_s, 1.0)
                continue
            try:
                self.check_once()
            except EdgelineError as exc:  # the state directory refused a write (a planted link): said once, by name
                self.counts["check_errors"] += 1
                self._say(logging.ERROR, f"update check failed: {exc}")
            except Exception as exc:  # a bug of ours: said (once, with its traceback), and the thread goes on
                self.counts["check_errors"] += 1
                self._say(logging.ERROR, f"update check failed: {type(exc).__name__}: {exc}", exc_info=True)

    def refuse_died_in_trial(self) -> None:
        """At start: a version whose trial the process did not survive ``MAX_TRIAL_ATTEMPTS`` times is refused (it
        may be what kills it), counted and reported like every other refusal."""
        trying = self.state.trying
        if trying is None or trying["attempts"] < MAX_TRIAL_ATTEMPTS:
            return
        version, attempts = trying["version"], trying["attempts"]
        message = f"v{version}: the process ended {attempts} times during its trial"
        self._refused(UpdateRefused(message, reason="trial", version=version), version)

    def check_once(self) -> None:
        """One check. The last refusal stands until a check reads the repository and ends without a refusal and
        without losing its way to it: then the repository was fixed (or the disk freed) and it is cleared; one
        remembered against its version stands."""
        before = self.counts["refused"], self.counts["unreachable"], self.counts["checked"]
        self._check()
        refused, unreachable, checked = self.counts["refused"], self.counts["unreachable"], self.counts["checked"]
        if checked > before[2] and (refused, unreachable) == before[:2]:
            self._refusal_over()

    def _check(self) -> None:
        assert self.swap is not None, "attach a Swap first"
        self.counts["checks"] += 1
        with self._lock:  # the worker may be refusing a version (a trial's end) meanwhile
            refused = set(self.state.refused)
        try:
            choice, updater = self.client.check(
                name=self.name, device=self.device, running=self.running_version, refused=refused
            )
        except UpdateRefused as exc:
            self._refused(exc, None)
            return
        except UpdateError as exc:
            self.counts["unreachable"] += 1
            self._say(logging.WARNING, f"update check: {exc}")
            return
        self.event("checked", None, f"checked {self.client.repository}", quiet=True)
        if choice.running_revoked is not None:
            self._revert_revoked(choice.running_revoked)
            return
        facts = choice.take
        if facts is None:
            newest = choice.newest_offered
            if newest is not None and newest < self.running_version and newest not in self.state.refused:
                refusal = UpdateRefused(
                    f"the repository offers v{newest} at most; v{self.running_version} runs here and versions "
                    "never go back",
                    reason="downgrade",
                    version=newest,
                )
                self._refused(refusal, newest)
            return
        self.event(
            "found",
            facts.version,
            f"v{facts.version} found ({facts.backend} {facts.precision}); v{self.running_version} runs",
        )
        try:
            precheck(facts, name=self.name, profile=self.profile)
            offer = self.client.offer(updater, facts)
            self._check_room(offer.facts, int(offer.info.length))
            archive = self.client.fetch(updater, offer)
            destination = self.store.bundle_dir(facts.version)
            bundle = self.client.unpack(archive, offer, destination)
            archive.unlink(missing_ok=True)  # the unpacked bundle is verified again whenever it is opened
            self.event(
                "verified",
                facts.version,
                f"v{facts.version}: signature, hashes and manifest verified ({offer.info.length} bytes)",
            )
            self._check_same_io(bundle.manifest, facts.version)
            if self.cage is not None:
                self._self_test_caged(bundle.path, bundle.manifest, facts)
            # From here the daemon itself opens the version: a crash, a kernel OOM kill or a hang that only happens
            # in this process counts as an attempt of its trial, whatever the phase (two deaths refuse it).
            self.note_trying(facts.version)
            model = self._open(bundle.path, facts.version)
            if self.cage is None:
                self._self_test(model, facts.version)
            model.enable_batching(self.max_batch)
        except UpdateRefused as exc:
            self._refused(exc, facts.version)
            return
        except UpdateError as exc:
            self.counts["unreachable"] += 1
            self._say(logging.WARNING, f"update of v{facts.version}: {exc}")
            return
        self.swap.propose(model, facts, bundle.path)

    def _self_test_caged(self, bundle: Path, manifest: Manifest, facts: TargetFacts) -> None:
        """The version opened and self-tested in a child process first (``edgeline.updates.cage``); refused with
        the child's reason unless it passed and exited cleanly."""
        from edgeline.updates.cage import open_caged

        assert self.cage is not None
        limits = self.cage(manifest, facts)
        caged = open_caged(bundle, backend=self.backend, max_batch=self.max_batch, limits=limits)
        self.last_cage = {
            "version": facts.version, "ok": caged.ok, "reason": caged.reason, "seconds": round(caged.seconds, 3),
            "peak_rss_mb": None if caged.peak_rss_bytes is None else round(caged.peak_rss_bytes / 2**20, 1),
            "limit_s": limits.seconds,
            "limit_mb": None if limits.memory_bytes is None else round(limits.memory_bytes / 2**20, 1),
        }  # fmt: skip
        if not caged.ok:
            raise UpdateRefused(f"v{facts.version} {caged.message}", reason=caged.reason or "crashed",
                                version=facts.version)  # fmt: skip
        golden = caged.golden or {}
        self.event(
            "self-test",
            facts.version,
            f"v{facts.version} passed its golden self-test in a cage ({golden.get('samples')} samples, "
            f"{caged.seconds:.2f} s, peak {self.last_cage['peak_rss_mb']} MB)",
        )

    def _open(self, bundle: Path, version: int) -> Model:
        from edgeline.model import load

        try:
            return load(bundle, backend=self.backend)
        except BackendUnavailableError as exc:
            raise UpdateRefused(f"v{version} cannot run here: {exc}", reason="incompatible", version=version) from exc
        except EdgelineError as exc:
            raise UpdateRefused(f"v{version} cannot be opened: {exc}", reason="malformed", version=version) from exc

    def _self_test(self, model: Model, version: int) -> None:
        """The golden self-test in this process (``[updates] cage = false``)."""
        from edgeline.bundle_checks import golden_check

        try:
            golden = golden_check(model)
        except Exception as exc:  # the version's model failed on its own golden inputs (as a trial counts it)
            raise UpdateRefused(
                f"v{version} failed its golden self-test here: {type(exc).__name__}: {exc}"[:500],
                reason="self-test", version=version,
            ) from exc  # fmt: skip
        if golden["ok"] is None:
            raise UpdateRefused(
                f"v{version} cannot test itself here: {golden.get('reason')}", reason="self-test", version=version
            )
        if not golden["ok"]:
            raise UpdateRefused(
                f"v{version} failed its golden self-test here: {golden.get('mismatched_samples')} of "
                f"{golden.get('samples')} samples off (max |error| {golden.get('max_abs_error')})",
                reason="self-test", version=version,
            )  # fmt: skip
        self.event("self-test", version, f"v{version} passed its golden self-test ({golden.get('samples')} samples)")

    def _check_room(self, facts: TargetFacts, length: int) -> None:
        from edgeline.memory import available_mb

        try:
            free: int | None = shutil.disk_usage(self.store.directory).free
        except OSError:
            free = None
        room = Room(free_bytes=free, reserve_bytes=max(0, self.reserve_bytes()), available_mb=available_mb())
        problem = room_refusal(facts, length, room)
        if problem is not None:
            raise UpdateRefused(problem, reason="no-room", version=facts.version)

    def _check_same_io(self, manifest: Manifest, version: int) -> None:
        if manifest.inputs != self.inputs or manifest.window != self.window:
            raise UpdateRefused(
                f"v{version} takes other inputs than v{self.running_version} (a new input format is a new bundle "
                "name, or a restart with the new bundle)",
                reason="incompatible",
                version=version,
            )

    def _revert_revoked(self, reason: str) -> None:
        from edgeline.model import load

        assert self.swap is not None
        previous = self.state.previous
        version = self.running_version
        if previous is None:
            self._say(
                logging.ERROR,
                f"v{version} was revoked ({reason}) but no previous version is kept here: it keeps running",
            )
            return
        try:
            model = load(self.store.resolve(previous), backend=self.backend)
        except EdgelineError as exc:
            self._say(
                logging.ERROR,
                f"v{version} was revoked ({reason}); the previous v{previous.version} cannot be opened: {exc}",
            )
            return
        model.enable_batching(self.max_batch)
        self.refuse_version(version, "revoked", reason)
        self.swap.revert(model, previous, reason)

    # -- called by the worker (Swap) -----------------------------------------------------------------------------
    def set_running(self, model: Model) -> None:
        self.running_version = model.version

    def note_trying(self, version: int) -> None:
        with self._lock:
            attempts = 0
            if self.state.trying and self.state.trying.get("version") == version:
                attempts = int(self.state.trying.get("attempts", 0))
            self.state.trying = {"version": version, "attempts": attempts + 1}
            self.store.save(self.state)

    def commit(self, version: int, bundle: Path, previous: Model) -> None:
        with self._lock:
            state = self.state
            old = state.committed
            if old is None or old.version != previous.version:  # the given bundle ran, not the committed one
                old = Installed(version=previous.version, bundle=str(self.running_bundle.resolve()), given=True)
            state.previous = old
            state.committed = Installed(version=version, bundle=self.store.relative(bundle))
            state.trying = None
            self.store.save(state)
            self.running_bundle = bundle
            self.store.prune(state)

    def reverted(self, from_version: int, to: Installed) -> None:
        with self._lock:
            self.state.committed = to
            self.state.previous = None
            self.state.trying = None
            self.store.save(self.state)
            self.running_bundle = self.store.resolve(to)
            self.store.prune(self.state)

    def refuse_version(self, version: int, reason: str, message: str) -> None:
        with self._lock:
            self.store.refuse(self.state, version, reason, message)
            if self.state.trying and self.state.trying.get("version") == version:
                self.state.trying = None
            self.store.save(self.state)
            self.store.prune(self.state)
        self.refusals[reason] += 1

    def latency_budget(self, model: Model) -> float | None:
        from edgeline.bundle_checks import device_budget_refusal

        budget = model.manifest.budgets.max_latency_ms
        if budget is None or device_budget_refusal(model, self.backend) is not None:
            return None
        return budget

    def latency_note(self, model: Model) -> str:
        from edgeline.bundle_checks import device_budget_refusal

        if model.manifest.budgets.max_latency_ms is None:
            return " (the profile sets no latency budget)"
        refusal = device_budget_refusal(model, self.backend)
        return f" (the budget is not judged here: {refusal})" if refusal else ""

    # -- events ----------------------------------------------------------------------------------------------------
    def _refused(self, exc: UpdateRefused, version: int | None) -> None:
        version = exc.version if exc.version is not None else version
        if version is not None and exc.reason in PERSISTED_REASONS:
            self.refuse_version(version, exc.reason, str(exc))
        else:
            self.refusals[exc.reason] += 1
        event = Event("refused", version, str(exc), reason=exc.reason)
        with self._lock:
            self.last_refusal = event
        # the figures of a "no-room" refusal move at every check: it is said again only for another version
        key = f"no-room v{version}" if exc.reason == "no-room" else None
        self.event("refused", version, f"update refused ({exc.reason}): {exc}", reason=exc.reason, key=key)

    def _refusal_over(self) -> None:
        """A check went through: the last refusal no longer applies (unless it is remembered against its version),
        and the status stops saying it."""
        with self._lock:
            refusal = self.last_refusal
            if refusal is None or refusal.version in self.state.refused:
                return
            self.last_refusal = None
            what = f"v{refusal.version} " if refusal.version is not None else ""
            event = Event(
                "checked", refusal.version,
                f"the refusal of {what}({refusal.reason}) no longer applies: {self.client.repository} checked",
            )  # fmt: skip
            if self.last is not None and self.last.step == "refused":
                self.last = event
        self._say(logging.INFO, event.message)
        try:
            self.on_event(event)
        except Exception:
            log.exception("publishing the update event failed")

    def _say(self, level: int, message: str, key: str | None = None, *, exc_info: bool = False) -> bool:
        """Log ``message`` unless it (or ``key``, when given) was said already: a check that keeps ending the same
        way (a tampered archive on a USB stick, a repository out of reach) is said once, and counted every time.
        Returns whether it was said."""
        return self._said.happened(1, message, key=message if key is None else key, level=level, exc_info=exc_info)

    def event(
        self,
        step: str,
        version: int | None,
        message: str,
        *,
        reason: str | None = None,
        quiet: bool = False,
        key: str | None = None,
    ) -> None:
        event = Event(step, version, message, reason)
        self.counts[step] += 1
        if quiet:
            return
        level = logging.WARNING if step in ("refused", "rolled-back", "reverted") else logging.INFO
        if not self._say(level, message, key):
            return
        with self._lock:
            self.last = event
        try:
            self.on_event(event)
        except Exception:
            log.exception("publishing the update event failed")

    # -- status and metrics --------------------------------------------------------------------------------------
    def counters(self) -> dict[str, float | int | bool | None]:
        """Counters by step (``update_refused`` by reason is ``refusal_counts``, a labelled family)."""
        counts: dict[str, float | int | bool | None] = {
            f"update_{step.replace('-', '_')}": self.counts[step] for step in STEPS if step != "refused"
        }
        counts["update_checks"] = self.counts["checks"]  # attempts; update_checked: those that read the repository
        counts["update_unreachable"] = self.counts["unreachable"]
        counts["update_check_errors"] = self.counts["check_errors"]
        return counts

    def refusal_counts(self) -> dict[str, int]:
        return dict(self.refusals)

    def gauges(self) -> dict[str, float | int | bool | None]:
        runner = self.swap.runner if self.swap is not None else None
        return {
            "update_trial_active": runner is not None,
            "update_trial_inputs": runner.trial.inputs if runner is not None else 0,
        }

    def status(self) -> dict[str, Any]:
        runner = self.swap.runner if self.swap is not None else None
        with self._lock:
            state = self.state.as_dict()
            last = self.last.as_dict() if self.last else None
            refusal = self.last_refusal.as_dict() if self.last_refusal else None
        return {
            "repository": self.client.repository,
            "device": self.device,
            "running": self.running_version,
            "state": "trial" if runner is not None else (last["step"] if last else "idle"),
            "last": last,
            "last_refusal": refusal,
            "trial": runner.trial.figures() if runner is not None else None,
            "last_trial": self.last_trial,
            "last_cage": self.last_cage,
            "committed": state["committed"],
            "previous": state["previous"],
            "refused": state["refused"],
            "refusals": {k: v for k, v in self.refusals.items() if v},
        }
