"""Models of shapes the reference set lacks (recurrent layers, skip concatenations): export must report
honestly what it makes of them. Seeded: the same weights every run. Inputs: float32, batch 1."""

from __future__ import annotations

import torch
from torch import nn


class _LstmAutoencoder(nn.Module):
    """Sequence autoencoder (32 steps x 4 channels): an LSTM encoder, an LSTM decoder, a linear read-out."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.LSTM(4, 16, batch_first=True)
        self.decoder = nn.LSTM(16, 16, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        encoded, _ = self.encoder(x)
        decoded, _ = self.decoder(encoded)
        return self.out(decoded)


class _GruClassifier(nn.Module):
    """Sequence classifier (32 steps x 4 channels, 5 classes): a GRU and a linear head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 24, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states, _ = self.gru(x)
        return self.head(states[:, -1])


class _TinyUNet(nn.Module):
    """A U-Net-like image-to-image model (1x16x16): one down step, one up step, a skip concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.middle = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.merge = nn.Sequential(nn.Conv2d(24, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        middle = self.up(self.middle(self.pool(skip)))
        return self.merge(torch.cat([middle, skip], dim=1))


def _seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().eval()


def lstm_autoencoder() -> nn.Module:
    return _seeded(_LstmAutoencoder)


def gru_classifier() -> nn.Module:
    return _seeded(_GruClassifier)


def unet() -> nn.Module:
    return _seeded(_TinyUNet)
