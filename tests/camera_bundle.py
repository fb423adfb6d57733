"""An image model for the camera tests: which of red, green and blue dominates a frame, exported with its
pre-processing (``--preprocess``) as a LiteRT fp32 bundle, once for this code (``tests/cache.py``).

    colour_bundle()        the bundle's directory (never modify it)
    coloured(channel, ...) a frame whose ``channel`` (0 red, 1 green, 2 blue) dominates
    write_video(path, colours, ...)  a video file whose frame i is of colour ``colours[i]``, with PyAV
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tests.cache import cached, cached_export
from tests.package_tree import REPO

__all__ = ["COMMITTED", "LABELS", "MODEL", "PREPROCESS", "colour_bundle", "coloured", "export_colour", "write_video"]

LABELS = ("blue", "green", "red")
"""The model's outputs, in order (the sorted class names)."""
CHANNEL = {"red": 0, "green": 1, "blue": 2}
COMMITTED = REPO / "tests" / "data" / "colour-fp32"
"""A copy of the export, for the device tier (no torch): ``python -m tests.camera_bundle`` writes it again."""
PREPROCESS = "resize=squash,color=rgb,size=16x16"

MODEL = '''
import torch
from torch import nn


class Colour(nn.Module):
    """The strongest of the channels' means, R, G, B in: outputs blue, green, red (the classes' sorted order)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Conv2d(3, 3, 1, bias=False)
        with torch.no_grad():
            self.mix.weight.copy_(torch.tensor([[0.0, 0, 1], [0, 1, 0], [1, 0, 0]]).reshape(3, 3, 1, 1) * 10)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.mix(image)), 1)


def model() -> nn.Module:
    return Colour().eval()
'''


def coloured(channel: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 60, (height, width, 3))
    image[:, :, channel] += 170
    return image.astype(np.uint8)


def _inputs(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    channels = np.arange(count) % 3
    images = rng.random((count, 3, 16, 16), dtype=np.float32) * 0.25
    images[np.arange(count), channels] += 0.7
    labels = np.array([LABELS.index(name) for name in ("red", "green", "blue")])[channels]
    return images, labels


def colour_bundle() -> Path:
    """A fresh export where torch is installed; elsewhere (the device tier) the committed copy of one."""
    if importlib.util.find_spec("torch") is None:
        return COMMITTED
    return export_colour()


def export_colour() -> Path:
    def make(directory: Path) -> None:
        (directory / "colour.py").write_text(MODEL, encoding="utf-8")
        images, labels = _inputs(24, 1)
        np.savez(directory / "calibration.npz", image=images)
        np.savez(directory / "validation.npz", image=images[:12], labels=labels[:12])
        (directory / "labels.txt").write_text("\n".join(LABELS) + "\n", encoding="utf-8")

    inputs = cached("camera-model", [MODEL], make)
    return cached_export(
        f"{inputs / 'colour.py'}:model", "--profile", "rpi5", "--backend", "litert", "--precision", "fp32",
        "--calibration", inputs / "calibration.npz", "--validation", inputs / "validation.npz",
        "--labels", inputs / "labels.txt", "--preprocess", PREPROCESS,
    )  # fmt: skip


def write_video(
    path: Path, colours: Sequence[str], *, codec: str = "mpeg4", size: tuple[int, int] = (64, 48), fps: int = 10
) -> Path:
    """A video whose frame i is dominated by ``colours[i]`` (PyAV; mpeg4 in .mp4, mjpeg in .avi)."""
    import av

    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if codec != "mjpeg":
            stream.options = {"g": "5"}  # keyframes often: a damaged stretch costs few frames
        for index, name in enumerate(colours):
            frame = av.VideoFrame.from_ndarray(coloured(CHANNEL[name], height, width, seed=index), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


if __name__ == "__main__":
    fresh = export_colour()
    shutil.rmtree(COMMITTED, ignore_errors=True)
    shutil.copytree(fresh, COMMITTED)
    print(COMMITTED, file=sys.stderr)
