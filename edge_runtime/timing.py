"""Timing ``predict`` on this machine: a figure for this machine only, never presented as another's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from edgeline.model import Model

__all__ = ["median_latency_ms"]


def median_latency_ms(
    model: Model, sample: Sequence[np.ndarray], *, warmup: int = 3, runs: int = 50, budget_s: float = 2.0
) -> float:
    """Median wall time of one ``predict``: at least 5 runs, at most ``runs`` or ``budget_s`` seconds."""
    for _ in range(warmup):
        model.predict(*sample)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (len(times) < runs and time.perf_counter() < deadline):
        start = time.perf_counter()
        model.predict(*sample)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0
