"""Models of their own for the "smaller, found on the way" cases of issue 53 (tests/test_int8_smaller.py).

``outlier_mlp``: a digits MLP (64 -> 64 -> 32 -> 16 -> 10) trained on sklearn's 8x8 digits, then the most active unit
of ``fc2`` is multiplied by ``OUTLIER`` and what ``head`` reads of it divided by the same: the same function (ReLU
commutes with a positive scale), but the tensor ``head`` reads has one unit 200 times the others. Plain int8 gives
that tensor one scale, which crushes the other fifteen units: held-out accuracy falls far past a 1-point budget.
Mixed precision keeps that tensor float (``fc2``, ``act2`` and ``head``, its reader): the model's last layer computes
in float and the microcontroller's int8 output is one QUANTIZE after it.

``layernorm_mlp``: an MLP with a LayerNorm after each hidden layer (random weights, seeded): the layer report must name
each LayerNorm. ``gru_tagger``: a GRU of its own (16 steps x 3 channels, 12 units, 4 classes), seeded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.training import digit_features as digits_flat
from tests.training import trained_model

__all__ = ["OUTLIER", "SOURCE", "TRAIN", "digits_flat", "smaller_models"]

TRAIN = 1400  # the digits before are trained on (and calibrate); those after are held out
OUTLIER = 200.0

SOURCE = """\
from pathlib import Path

import torch
from torch import nn


class OutlierMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(64, 64)
        self.act0 = nn.ReLU()
        self.fc1 = nn.Linear(64, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.act1(self.fc1(self.act0(self.fc0(x / 16.0))))
        return self.head(self.act2(self.fc2(x)))


class LayerNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.norm1 = nn.LayerNorm(32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 24)
        self.norm2 = nn.LayerNorm(24)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = self.act1(self.norm1(self.fc1(x / 16.0)))
        return self.head(self.act2(self.norm2(self.fc2(x))))


class GruTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 12, batch_first=True)
        self.head = nn.Linear(12, 4)

    def forward(self, x):
        states, _ = self.gru(x)
        return self.head(states[:, -1])


def outlier_mlp():
    model = OutlierMLP()
    weights = Path(__file__).with_name("outlier_mlp.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()


def layernorm_mlp():
    torch.manual_seed(53)
    model = LayerNormMLP()
    with torch.no_grad():  # LayerNorm's affine parameters away from their 1 and 0: a real gain and shift to read
        for norm in (model.norm1, model.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return model.eval()


def gru_tagger():
    torch.manual_seed(53)
    return GruTagger().eval()
"""


def smaller_models() -> Path:
    """The models' source file, ``outlier_mlp``'s trained weights beside it: made once for this code
    (tests/cache.py); never modified by its users."""
    features, labels = digits_flat()
    x, y = features[:TRAIN], labels[:TRAIN]

    def plant(module: Any) -> None:
        import torch

        hidden = module.act1(module.fc1(module.act0(module.fc0(torch.from_numpy(x) / 16.0))))
        unit = int(module.act2(module.fc2(hidden)).mean(0).argmax())  # a live one
        module.fc2.weight[unit] *= OUTLIER
        module.fc2.bias[unit] *= OUTLIER
        module.head.weight[:, unit] /= OUTLIER

    return trained_model(
        SOURCE, "smaller_models.py", "outlier_mlp", "outlier_mlp.pt", x, y, key=[OUTLIER], epochs=30, edit=plant
    )
