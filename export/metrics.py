"""Classification and agreement metrics. Pure numpy, property-tested."""

from __future__ import annotations

import numpy as np

__all__ = ["accuracy", "confusion_matrix", "cosine_similarity_rows", "macro_f1"]


def accuracy(truth: np.ndarray, predicted: np.ndarray) -> float:
    if truth.size == 0:
        raise ValueError("accuracy of no samples")
    return float(np.mean(truth == predicted))


def confusion_matrix(truth: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """``matrix[t, p]`` counts samples of true class t predicted as p."""
    matrix = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(matrix, (truth.astype(np.int64), predicted.astype(np.int64)), 1)
    return matrix


def macro_f1(truth: np.ndarray, predicted: np.ndarray, classes: int) -> float:
    """Mean F1 over the classes that occur in ``truth`` or ``predicted``."""
    matrix = confusion_matrix(truth, predicted, classes)
    true_positive = np.diag(matrix).astype(np.float64)
    predicted_count = matrix.sum(axis=0)
    actual_count = matrix.sum(axis=1)
    present = (predicted_count + actual_count) > 0
    denominator = predicted_count + actual_count
    f1 = np.divide(2 * true_positive, denominator, out=np.zeros(classes), where=denominator > 0)
    return float(f1[present].mean()) if present.any() else 0.0


def cosine_similarity_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows; two all-zero rows count as identical (1.0)."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    dot = np.einsum("ij,ij->i", a, b)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    cosine = np.divide(dot, norms, out=np.zeros_like(dot), where=norms > 0)
    return np.where(both_zero, 1.0, np.clip(cosine, -1.0, 1.0))
