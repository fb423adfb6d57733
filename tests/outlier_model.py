"""A digits CNN with one outlier channel: the model mixed precision is tested and measured on.

It is trained on sklearn's 8x8 digits as any small CNN; then channel 8 of ``conv1`` is multiplied by ``OUTLIER`` and
what ``mix`` reads of it divided by the same: exactly the same function (ReLU commutes with a positive scale), but
one channel of ``act1``'s output is now 300 times the others. Plain int8 gives that tensor one scale, which crushes
the other eight channels to a few steps: the held-out accuracy drops by about 15 points, far past a 1-point budget.
Keeping the tensor in float (``conv1``, fused with ``act1``, and ``mix``, which reads it) restores it, and every
other layer stays int8. Shared by ``tests/test_mixed_precision.py`` and ``benchmarks/mixed_precision.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.training import digit_images as digits
from tests.training import trained_model

__all__ = ["CALIBRATION", "KEPT", "OUTLIER", "SOURCE", "TRAIN", "digits", "trained_outlier_model"]

TRAIN = 1400  # the digits before are trained on (and calibrate); those after are held out
CALIBRATION = 32
OUTLIER = 300.0  # what channel 8 of conv1 is multiplied by
KEPT = ("conv1", "act1", "mix")
"""What an expert keeps float: the outlier tensor's maker (conv1 and the ReLU it is fused with) and its reader."""

SOURCE = """\
from pathlib import Path

import torch
from torch import nn


class OutlierCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 9, 3, padding=1)
        self.act1 = nn.ReLU()
        self.mix = nn.Conv2d(9, 8, 1)
        self.act2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 32, 3, padding=1)
        self.act3 = nn.ReLU()
        self.conv4 = nn.Conv2d(32, 32, 3, stride=2, padding=1)
        self.act4 = nn.ReLU()
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = x / 16.0
        x = self.act2(self.mix(self.act1(self.conv1(x))))
        x = self.act4(self.conv4(self.act3(self.conv3(x))))
        return self.fc(torch.flatten(x, 1))


def outlier():
    model = OutlierCNN()
    weights = Path(__file__).with_name("outlier.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


def trained_outlier_model() -> Path:
    """The model's source file, its trained weights beside it (``outlier.pt``): trained once for this code
    (tests/cache.py); never modified by its users."""
    images, labels = digits()

    def plant(module: Any) -> None:
        module.conv1.weight[8] *= OUTLIER
        module.conv1.bias[8] *= OUTLIER
        module.mix.weight[:, 8] /= OUTLIER

    x, y = images[:TRAIN], labels[:TRAIN]
    return trained_model(SOURCE, "outlier_model.py", "outlier", "outlier.pt", x, y, key=[OUTLIER], edit=plant)
