"""The swap: where a new version starts answering, between two batches on the worker thread, and its trial.

``Swap.propose`` (the update thread) hands over a model that is verified, opened and self-tested; ``Swap.poll`` (the
worker, between two batches: the only place the processor's model changes) starts its trial, ends it when the
gates can judge, and commits or rolls back through the agent. ``TrialRunner`` is the processor's shadow during a
trial: the new version answers, the previous one runs beside it on the same input.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edgeline.updates.policy import TargetFacts
from edgeline.updates.store import Installed
from edgeline.updates.trial import Trial, agree

if TYPE_CHECKING:
    from edgeline.model import Model

__all__ = ["Swap", "SwapOwner", "TrialRunner", "Worker"]


class TrialRunner:
    """``Processor.shadow`` during a trial: the new version answers, the previous one runs beside it."""

    def __init__(self, previous: Model, trial: Trial):
        self.previous = previous
        self.trial = trial
        self._turn = 0

    def _interpretable(self, model: Model, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> bool | None:
        if self.trial.kind != "anomaly":
            return None
        return model.interpret(inputs, outputs).anomaly

    @staticmethod
    def _call(model: Model, inputs: list[np.ndarray]) -> tuple[list[np.ndarray] | None, float | None, str | None]:
        """(outputs, seconds, failure) of one model call; a ``PayloadError`` is the input's fault and propagates."""
        from edgeline.errors import PayloadError

        start = time.perf_counter()
        try:
            outputs = model.predict(*inputs)
        except PayloadError:
            raise  # both versions refuse such an input alike
        except Exception as exc:
            return None, None, f"{type(exc).__name__}: {exc}"[:300]
        seconds = time.perf_counter() - start
        return outputs, seconds, None if Trial.finite(outputs) else "NaN or Inf in its outputs"

    def run(self, model: Model, inputs: list[np.ndarray]) -> tuple[Model, list[np.ndarray], float]:
        # The two calls alternate in order, so that neither version's timing always pays for the other's cache misses.
        self._turn += 1
        if self._turn % 2:
            new_outputs, new_s, failure = self._call(model, inputs)
            old_outputs, old_s, old_failure = self._call(self.previous, inputs)
        else:
            old_outputs, old_s, old_failure = self._call(self.previous, inputs)
            new_outputs, new_s, failure = self._call(model, inputs)
        if old_failure is not None or old_outputs is None:
            # the previous version fails on it too: this input says nothing about the new one
            if new_outputs is None:
                raise RuntimeError(failure or "the model failed")
            return model, new_outputs, new_s or 0.0
        if failure is not None or new_outputs is None:
            self.trial.record(new_ok=False, agreed=False, new_s=new_s, old_s=old_s, failure=failure)
            return self.previous, old_outputs, old_s or 0.0
        agreed = agree(
            self.trial.kind, new_outputs, old_outputs, tolerance=self.trial.gates.tolerance,
            new_flag=self._interpretable(model, inputs, new_outputs),
            old_flag=self._interpretable(self.previous, inputs, old_outputs),
        )  # fmt: skip
        self.trial.record(new_ok=True, agreed=agreed, new_s=new_s, old_s=old_s)
        return model, new_outputs, new_s or 0.0


class Worker(Protocol):
    """What the swap changes between two batches: the daemon's ``Processor``, its model and the shadow beside it
    during a trial. A protocol, so that updates never import the daemon (the daemon imports updates)."""

    model: Model

    @property
    def shadow(self) -> object: ...

    @shadow.setter
    def shadow(self, runner: TrialRunner | None) -> None: ...


class SwapOwner(Protocol):
    """What the swap reports to, on the worker thread: the update agent (``edgeline.updates.agent``), which makes
    its swap itself. A protocol, so that this module never imports the agent (the agent imports it)."""

    last_trial: dict[str, Any] | None

    def latency_budget(self, model: Model) -> float | None: ...

    def latency_note(self, model: Model) -> str: ...

    def set_running(self, model: Model) -> None: ...

    def commit(self, version: int, bundle: Path, previous: Model) -> None: ...

    def reverted(self, from_version: int, to: Installed) -> None: ...

    def refuse_version(self, version: int, reason: str, message: str) -> None: ...

    def event(self, step: str, version: int | None, message: str, *, reason: str | None = None) -> None: ...


@dataclass
class _Proposal:
    model: Model
    facts: TargetFacts
    bundle: Path


class Swap:
    """The hand-over between the update thread (``propose``, ``revert``) and the worker (``poll``, between two
    batches: the only place the processor's model changes)."""

    def __init__(self, agent: SwapOwner, processor: Worker):
        self.agent = agent
        self.processor = processor
        self._lock = threading.Lock()
        self._proposal: _Proposal | None = None
        self._revert: tuple[Model, Installed, str] | None = None
        self.runner: TrialRunner | None = None
        self.busy = threading.Event()
        """Set from a proposal until its trial ends: the update thread does not look for another meanwhile."""

    def propose(self, model: Model, facts: TargetFacts, bundle: Path) -> None:
        with self._lock:
            self._proposal = _Proposal(model, facts, bundle)
            self.busy.set()

    def revert(self, model: Model, to: Installed, reason: str) -> None:
        with self._lock:
            self._revert = (model, to, reason)
            self.busy.set()

    def poll(self) -> None:
        """Worker thread, between two batches."""
        if self.runner is not None:
            if self.runner.trial.done():
                self._end_trial()
            return
        if self._proposal is None and self._revert is None:  # every batch: nothing to take, no lock
            return
        with self._lock:
            proposal, self._proposal = self._proposal, None
            revert, self._revert = self._revert, None
        if revert is not None:
            self._do_revert(*revert)
        if proposal is not None:
            self._start_trial(proposal)

    def _start_trial(self, proposal: _Proposal) -> None:
        agent = self.agent
        previous = self.processor.model
        facts = proposal.facts  # its attempt was recorded before the daemon opened it (``UpdateAgent._check``)
        trial = Trial(
            version=facts.version,
            previous_version=previous.version,
            gates=facts.trial,
            kind=proposal.model.manifest.postprocess.kind,
            latency_budget_ms=agent.latency_budget(proposal.model),
            latency_note=agent.latency_note(proposal.model),
        )
        self.runner = TrialRunner(previous, trial)
        self.processor.shadow = self.runner
        self.processor.model = proposal.model
        agent.set_running(proposal.model)
        agent.event(
            "trial", facts.version,
            f"v{facts.version} answers from now on, beside v{previous.version} for {facts.trial.inputs} inputs "
            f"(or {facts.trial.seconds:g} s)",
        )  # fmt: skip
        self._bundle = proposal.bundle

    def _end_trial(self) -> None:
        assert self.runner is not None
        runner, self.runner = self.runner, None
        trial = runner.trial
        judgement = trial.judge()
        self.processor.shadow = None
        agent = self.agent
        agent.last_trial = judgement.figures
        if judgement.commit:
            agent.commit(trial.version, self._bundle, runner.previous)
            agent.event("committed", trial.version, f"v{trial.version} committed: {judgement.reason}")
        else:
            self.processor.model = runner.previous
            agent.set_running(runner.previous)
            agent.refuse_version(trial.version, "trial", judgement.reason)
            agent.event(
                "rolled-back", trial.version,
                f"v{trial.version} rolled back to v{runner.previous.version}: {judgement.reason}", reason="trial",
            )  # fmt: skip
        self.busy.clear()

    def _do_revert(self, model: Model, to: Installed, reason: str) -> None:
        old = self.processor.model
        self.processor.model = model
        self.agent.set_running(model)
        self.agent.reverted(old.version, to)
        self.agent.event(
            "reverted", old.version, f"v{old.version} revoked ({reason}): back to v{to.version}", reason="revoked"
        )
        self.busy.clear()
