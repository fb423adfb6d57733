"""The trial of a new version beside the previous one, on the same inputs.

During the trial the new version answers, and for every input the previous version runs too (its answer is not
published): the two are compared, and the new version's failures and latencies are counted. An input the new
version fails on (an exception, NaN or Inf out) while the previous one answers is answered by the previous one,
naming its version: an update never costs a user an answer. The trial ends after ``gates.inputs`` inputs, or after
``gates.seconds`` once ``gates.min_inputs`` have been seen; ``judge`` then says commit or roll back, and why.

It also ends as soon as its outcome is certain: when the error rate or the agreement would miss its gate even if
every input the trial may still take were answered and agreed (``remaining``: up to ``gates.inputs``; once
``gates.seconds`` are up, only those still missing to ``gates.min_inputs``). A version with random weights stops
after 21 to 26 of the default 200 inputs, one that fails on every input after 3: never a verdict the whole trial
would not have reached (``docs/updates.md`` says why not a statistical test).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeline.arrays import all_finite
from edgeline.updates.policy import Gates

__all__ = ["LATENCY_SAMPLES", "Judgement", "Trial", "agree"]

LATENCY_SAMPLES = 10_000
"""The latest calls whose times a trial keeps (a trial of a million inputs must not keep a million)."""


def agree(kind: str, new: Sequence[np.ndarray], old: Sequence[np.ndarray], *, tolerance: float,
          new_flag: bool | None = None, old_flag: bool | None = None) -> bool:  # fmt: skip
    """Whether two versions answered one input alike: the same top-1 class for a classifier, the same flag for an
    anomaly detector, else every output within ``tolerance`` of the previous one, relative to its largest
    magnitude."""
    if kind == "classify":
        return int(np.argmax(new[0])) == int(np.argmax(old[0]))
    if kind == "anomaly" and new_flag is not None and old_flag is not None:
        return new_flag == old_flag
    for a, b in zip(new, old, strict=True):
        if a.shape != b.shape:
            return False
        scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-12)
        if float(np.max(np.abs(a.astype(np.float64) - b))) > tolerance * scale:
            return False
    return True


@dataclass(frozen=True)
class Judgement:
    commit: bool
    reason: str
    figures: dict[str, Any]


@dataclass
class Trial:
    version: int
    previous_version: int
    gates: Gates
    kind: str
    latency_budget_ms: float | None
    """The bundle's latency budget where this machine can be held to it; None: compare with the previous version."""
    latency_note: str = ""
    started: float = field(default_factory=time.monotonic)
    inputs: int = 0
    failures: int = 0
    agreed: int = 0
    new_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    old_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    last_failure: str | None = None

    def record(
        self, *, new_ok: bool, agreed: bool, new_s: float | None, old_s: float | None, failure: str | None = None
    ) -> None:
        """One input of the trial. Once it has its ``gates.inputs`` (it ends between two batches), the rest of the
        batch is still answered but not counted: a trial of 40 inputs says 40, not where the batch ended."""
        if self.inputs >= self.gates.inputs:
            return
        self.inputs += 1
        if not new_ok:
            self.failures += 1
            self.last_failure = failure
        elif agreed:
            self.agreed += 1
        if new_s is not None:
            self.new_ms.append(new_s * 1000.0)
        if old_s is not None:
            self.old_ms.append(old_s * 1000.0)

    @staticmethod
    def finite(outputs: Sequence[np.ndarray]) -> bool:
        return all(all_finite(o) for o in outputs)

    def remaining(self, now: float | None = None) -> int:
        """The most inputs the trial may still take: up to ``gates.inputs``; once ``gates.seconds`` are up, only
        those still missing to ``gates.min_inputs`` (it ends as soon as it has them)."""
        now = time.monotonic() if now is None else now
        if now - self.started >= self.gates.seconds:
            return max(0, min(self.gates.min_inputs, self.gates.inputs) - self.inputs)
        return max(0, self.gates.inputs - self.inputs)

    def done(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.inputs >= self.gates.inputs:
            return True
        if now - self.started >= self.gates.seconds and self.inputs >= min(self.gates.min_inputs, self.gates.inputs):
            return True
        return self._missed_gate(self.remaining(now)) is not None

    def _missed_gate(self, remaining: int) -> str | None:
        """Why the error rate or the agreement misses its gate even if the ``remaining`` inputs are all answered
        and agree (0: as the trial stands), or None."""
        g = self.gates
        inputs = self.inputs + remaining
        if inputs and self.failures / inputs > g.max_error_rate:
            why = f"failed on {self.failures} of {self.inputs} inputs the previous version answered"
            if remaining:
                why += f": more than {g.max_error_rate:.1%} of even {inputs}, stopped {remaining} inputs early"
            else:
                why += f" ({self.failures / inputs:.1%} > {g.max_error_rate:.1%})"
            return why + (f", e.g. {self.last_failure}" if self.last_failure else "")
        answered = self.inputs - self.failures
        best = (self.agreed + remaining) / (answered + remaining) if answered + remaining else None
        if best is not None and best < g.min_agreement:
            what = "top-1 class" if self.kind == "classify" else ("flag" if self.kind == "anomaly" else "outputs")
            agreed = f"agreed with v{self.previous_version} ({what})"
            if not remaining:
                return f"{agreed} on {best:.1%} of inputs (< {g.min_agreement:.0%})"
            return (
                f"{agreed} on {self.agreed} of {answered} inputs: below {g.min_agreement:.0%} even if the "
                f"{remaining} inputs left all agreed ({best:.1%}), stopped early"
            )
        return None

    @staticmethod
    def _percentile(values: deque[float], q: float) -> float | None:
        return float(np.percentile(np.asarray(values), q)) if values else None

    def figures(self) -> dict[str, Any]:
        answered = self.inputs - self.failures
        return {
            "version": self.version,
            "previous": self.previous_version,
            "inputs": self.inputs,
            "of": self.gates.inputs,
            "failures": self.failures,
            "error_rate": self.failures / self.inputs if self.inputs else None,
            "agreement": self.agreed / answered if answered else None,
            "median_ms": self._percentile(self.new_ms, 50),
            "p25_ms": self._percentile(self.new_ms, 25),
            "p95_ms": self._percentile(self.new_ms, 95),
            "previous_median_ms": self._percentile(self.old_ms, 50),
            "previous_p25_ms": self._percentile(self.old_ms, 25),
            "previous_p95_ms": self._percentile(self.old_ms, 95),
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }

    def judge(self) -> Judgement:
        f = self.figures()
        g = self.gates
        missed = self._missed_gate(self.remaining())
        if missed is not None:
            return Judgement(False, missed, f)
        p95, median, old = f["p95_ms"], f["median_ms"], f["previous_median_ms"]
        limit = g.max_latency_ms or self.latency_budget_ms
        if p95 is not None and limit is not None and p95 > limit:
            return Judgement(False, f"p95 model latency {p95:.3g} ms > {limit:g} ms{self.latency_note}", f)
        # Without a budget to hold it to: the typical call against the previous version's, measured side by side on
        # the same inputs. Medians, because a trial's few inputs make a p95 the one call a busy machine delayed; and
        # the lower quartiles as well, because on a busy machine calls are either prompt or delayed by the scheduler
        # (milliseconds), and with about half of them delayed the medians of two identical models land one in each
        # mode (seen: 1.22 ms against 0.137 ms). A version that is slower itself is slower in its prompt calls too.
        p25, old_p25 = f["p25_ms"], f["previous_p25_ms"]
        if (
            limit is None and median is not None and old is not None and p25 is not None and old_p25 is not None
            and median > max(2.0 * old, 1.0) and p25 > max(2.0 * old_p25, 1.0)
        ):  # fmt: skip
            return Judgement(
                False,
                f"median model latency {median:.3g} ms > twice v{self.previous_version}'s {old:.3g} ms (lower "
                f"quartile {p25:.3g} ms > twice {old_p25:.3g} ms){self.latency_note}",
                f,
            )
        return Judgement(True, f"{self.inputs} inputs: error rate, agreement and latency within the gates", f)
