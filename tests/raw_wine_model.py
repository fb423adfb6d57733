"""A wine MLP fed the raw features: the model whose int8 loss is in the data, not in a layer.

sklearn's wine data as it comes: proline in the hundreds and thousands, hue and the phenols near 1. An MLP learns
from it as it is (no normalisation anywhere), but int8 gives its input one scale for all thirteen features, set by
proline: every feature under about 3 lands on a step or two, and plain int8 loses about 26 points of held-out
accuracy. No layer is to blame: ``quantization.layers`` lists ``input x`` first and it loses the most; on a CPU,
mixed precision keeps the layer reading it (``fc1``) float, which takes the input float; a microcontroller's model
takes int8 input, so the export says to scale the features alike before the model. Used by
tests/test_mixed_precision.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

from tests.cache import cached

__all__ = ["SOURCE", "TRAIN", "trained_wine_model", "wine_data"]

TRAIN = 120  # the first 120 of the shuffled samples are trained on (and calibrate); the 58 after are held out

SOURCE = """\
from pathlib import Path

import torch
from torch import nn


class RawWineMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(13, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)
        self.act2 = nn.ReLU()
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))))


def wine():
    model = RawWineMLP()
    weights = Path(__file__).with_name("wine.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


def wine_data() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's wine samples, raw, in one fixed shuffled order."""
    from sklearn.datasets import load_wine

    data = load_wine()
    order = np.random.default_rng(0).permutation(len(data.target))
    return data.data.astype(np.float32)[order], data.target.astype(np.int64)[order]


def trained_wine_model() -> Path:
    """The model's source file, its trained weights beside it (``wine.pt``): trained once for this code."""

    def make(directory: Path) -> None:
        import torch

        from edgeline.export.loading import load_model

        source = directory / "raw_wine.py"
        source.write_text(SOURCE, encoding="utf-8")
        features, labels = wine_data()
        torch.manual_seed(0)
        module = load_model(f"{source}:wine").module
        x, y = torch.from_numpy(features[:TRAIN]), torch.from_numpy(labels[:TRAIN])
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            module.train()
            for _ in range(6000):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(module(x), y).backward()
                optimizer.step()
        finally:
            torch.set_num_threads(threads)
        torch.save(module.eval().state_dict(), directory / "wine.pt")

    return cached("trained", [SOURCE, TRAIN, inspect.getsource(wine_data), "6000 steps"], make) / "raw_wine.py"
