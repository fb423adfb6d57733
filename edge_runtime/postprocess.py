"""Reading model outputs as answers: labels and scores for classifiers, scores and flags for anomalies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeline.manifest import Postprocess

__all__ = ["Interpretation", "interpret", "softmax"]


@dataclass(frozen=True)
class Interpretation:
    label: str | None = None
    index: int | None = None
    score: float | None = None
    top_k: tuple[tuple[str, float], ...] = ()
    anomaly_score: float | None = None
    anomaly: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields that apply to this model kind, ready for JSON."""
        out: dict[str, Any] = {}
        if self.index is not None:
            out.update(label=self.label, class_index=self.index, score=self.score)
            if len(self.top_k) > 1:
                out["top_k"] = [{"label": label, "score": score} for label, score in self.top_k]
        if self.anomaly_score is not None:
            out.update(anomaly_score=self.anomaly_score, anomaly=self.anomaly)
        return out


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    exp = np.exp(shifted)
    result: np.ndarray = exp / exp.sum()
    return result


def interpret(
    post: Postprocess, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], *, top_k: int = 1
) -> Interpretation:
    """Interpret one sample's float outputs (batch 1) according to the manifest's postprocess."""
    if post.kind == "classify":
        row = outputs[0].reshape(-1).astype(np.float64)
        labels = post.labels

        def name(index: int) -> str:
            return labels[index] if labels else str(index)

        # Ranked by output (softmax keeps the order, but its rounding could give near outputs one score): the
        # first of equal outputs wins, by argmax or a stable sort.
        if top_k <= 1:  # softmax's score of the best class is 1 / sum(exp(row - best)), in place
            best = int(row.argmax())
            if post.score == "softmax":
                np.subtract(row, row[best], out=row)
                score = 1.0 / float(np.add.reduce(np.exp(row, out=row)))
            else:
                score = float(row[best])
            label = name(best)
            return Interpretation(label=label, index=best, score=score, top_k=((label, score),))
        scores = softmax(row) if post.score == "softmax" else row
        order = np.argsort(-row, kind="stable")[:top_k].tolist()
        best = order[0]
        return Interpretation(
            label=name(best),
            index=best,
            score=float(scores[best]),
            top_k=tuple((name(i), float(scores[i])) for i in order),
        )
    if post.kind == "anomaly":
        assert post.threshold is not None  # the manifest validator guarantees it
        if post.anomaly_score == "reconstruction":
            error = inputs[0].reshape(-1).astype(np.float64) - outputs[0].reshape(-1).astype(np.float64)
            score = float(np.mean(error * error))
        else:
            score = float(outputs[0].reshape(-1)[0])
        return Interpretation(anomaly_score=score, anomaly=score > post.threshold)
    return Interpretation()
