"""sklearn's digits, and training the tests' small classifiers of them: one loop for every test that trains one
(deterministic for a seed set before the model is built; one thread, which batches this small train many times
faster on a shared machine)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["digit_features", "digit_images", "train_classifier"]


def train_classifier(
    module: Any,
    x: Any,
    y: Any,
    *,
    epochs: int = 25,
    lr: float = 0.01,
    parameters: Iterable[Any] | None = None,
    loss: Callable[..., Any] | None = None,
) -> None:
    """Adam on batches of 64 of the tensors ``x``, ``y`` for ``epochs`` passes (``parameters``: only these are
    trained; ``loss``: cross-entropy unless given); ``module`` is left in eval mode."""
    import torch

    criterion = loss or torch.nn.functional.cross_entropy
    optimizer = torch.optim.Adam(module.parameters() if parameters is None else parameters, lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.train()
        for _ in range(epochs):
            for start in range(0, len(x), 64):
                optimizer.zero_grad()
                criterion(module(x[start : start + 64]), y[start : start + 64]).backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    module.eval()


def digit_images() -> tuple[Any, Any]:
    """sklearn's 8x8 digits as (N, 1, 8, 8) float32 images of raw pixel values (0..16), and their int64 labels."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32)[:, None], data.target.astype(np.int64)


def digit_features() -> tuple[Any, Any]:
    """sklearn's 8x8 digits as 64 float32 features (0..16), and their int64 labels."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data.astype(np.float32), data.target.astype(np.int64)
