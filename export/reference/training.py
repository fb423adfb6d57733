"""The one training loop of the reference models, and the helpers that make it repeatable.

Training is short and deterministic: a fixed number of Adam steps with a one-cycle learning rate, batches
drawn from a seeded generator, initialisation under a seeded, forked RNG (the caller's global RNG state is
left as it was), and exactly two threads, restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

__all__ = [
    "TRAINING_THREADS",
    "accuracy",
    "fit",
    "fit_classifier",
    "limited_threads",
    "predict",
    "seeded_build",
]

TRAINING_THREADS = 2

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def limited_threads(threads: int = TRAINING_THREADS) -> Iterator[None]:
    """Run the block on exactly ``threads`` intra-op threads, then restore the caller's setting. Exactly, not at most:
    a sum splits differently across threads, so the weights a seed trains are the same whatever the machine's or
    the caller's thread count (the test suite runs its processes on one thread each)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def seeded_build(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``factory()`` with its weights initialised from ``seed``, in eval mode, global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    return model.eval()


def fit(
    model: nn.Module,
    inputs: np.ndarray,
    targets: np.ndarray,
    *,
    loss_fn: Loss,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
) -> nn.Module:
    """Train ``model`` for exactly ``steps`` Adam steps on random batches; return it in eval mode."""
    # Copies: datasets are read-only arrays, which torch.from_numpy would only warn about.
    x_all = torch.tensor(np.asarray(inputs, dtype=np.float32))
    y_all = torch.tensor(np.asarray(targets))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps)
    model.train()
    with limited_threads(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            batch = torch.randint(len(x_all), (batch_size,), generator=generator)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x_all[batch]), y_all[batch])
            loss.backward()
            optimizer.step()
            schedule.step()
    return model.eval()


def fit_classifier(
    model: nn.Module,
    inputs: np.ndarray,
    labels: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
) -> nn.Module:
    """:func:`fit` with cross-entropy on logits."""
    return fit(
        model,
        inputs,
        np.asarray(labels, dtype=np.int64),
        loss_fn=nn.functional.cross_entropy,
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
    )


def predict(model: nn.Module, inputs: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
    """Outputs of ``model`` for ``inputs`` in batches of ``batch_size``, without gradients, as float32.

    A program exported with a batch-1 example accepts only batch 1: pass ``batch_size=1`` for those.
    """
    outputs = []
    with torch.no_grad(), limited_threads():
        for start in range(0, len(inputs), batch_size):
            chunk = torch.tensor(np.asarray(inputs[start : start + batch_size], dtype=np.float32))
            outputs.append(model(chunk).numpy())
    return np.concatenate(outputs).astype(np.float32, copy=False)


def accuracy(model: nn.Module, inputs: np.ndarray, labels: np.ndarray, *, batch_size: int = 256) -> float:
    """Top-1 accuracy of a classifier's logits against integer ``labels``."""
    predicted = predict(model, inputs, batch_size=batch_size).argmax(axis=1)
    return float(np.mean(predicted == np.asarray(labels)))
