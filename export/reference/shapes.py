"""A small detector on synthetic shapes: the reference model of ``--task detect``.

Data: **synthetic, seeded.** 96x96 RGB images on textured backgrounds (a colour gradient, smooth blotches, faint
stripes and noise), each with one to four filled shapes whose sides are 14 to 40 pixels, placed so that they
overlap little. Four classes, two of which differ by colour alone: ``red_circle`` and ``blue_circle`` (a model fed
BGR where it wants RGB swaps them), ``red_square`` and ``green_triangle``. Colours are jittered, so are the shapes'
proportions. Boxes are the tight boxes of the painted pixels. Training and held-out images come from different
random streams of the seed.

Model: a YOLOv8-style anchor-free head on one stride-8 grid (12x12 = 144 candidates): a five-convolution backbone
(BatchNorm and ReLU), a 3x3 convolution, then per cell four distances to the box's sides (in cells, ReLU) and one
sigmoid score per class. The forward pass returns what Ultralytics' YOLOv8 exports: ``(1, 4+C, N)``, cx, cy, w, h
in input pixels, then the class scores. Box coordinates up to 96 and scores under 1 share that one output: the
int8 trap detection users fall into.

Training: a cell is responsible for a box when its centre lies in the box's central part (and the cell holding
the box's centre always is), the smaller box winning a cell two claim. Loss: binary cross-entropy of every cell's
class scores (target 1 for a responsible cell's class), plus L1 on the four distances and 1 - GIoU for the
responsible cells. Adam with a one-cycle rate, seeded batches, one thread (``THREADS``;
``edgeline.export.reference.training.limited_threads``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edgeline.export.reference.data import (
    DetectionDataset,
    DetectionImages,
    calibration_indices,
    rng_for,
    write_yolo,
)
from edgeline.export.reference.training import limited_threads, seeded_build

__all__ = [
    "HEAD",
    "IMAGE_PREPROCESS",
    "INPUT_SHAPE",
    "LABELS",
    "NAME",
    "TASK",
    "ShapeDetector",
    "ShapesData",
    "build",
    "make_data",
    "make_images",
    "model",
    "to_inputs",
    "train",
    "train_detector",
    "write_yolo",
]

NAME = "shapes"
TASK = "detect"
HEAD = "yolov8"
LABELS: tuple[str, ...] = ("red_circle", "blue_circle", "red_square", "green_triangle")
INPUT_SHAPE: tuple[int, ...] = (3, 96, 96)
IMAGE_PREPROCESS = "resize=letterbox,pad=114,color=rgb,scale=1/255,mean=0,std=1,layout=nchw"
"""RGB in [0, 1], NCHW, letterboxed: a frame of any shape keeps its proportions, as the boxes need."""

SIZE = INPUT_SHAPE[1]
STRIDE = 8
GRID = SIZE // STRIDE
SIDES = (14, 40)
"""A shape's side (or diameter) in pixels, before its proportions are jittered."""
TRAIN_IMAGES, VALIDATION_IMAGES = 3000, 400
COLOURS = {"red": (210, 40, 40), "blue": (40, 60, 215), "green": (40, 190, 60)}
CLASS_SHAPES = (("circle", "red"), ("circle", "blue"), ("square", "red"), ("triangle", "green"))


ShapesData = DetectionImages
"""Images (N, 96, 96, 3) uint8 RGB and per image its boxes ((K, 4) x1, y1, x2, y2 pixels) and classes."""


_Y, _X = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
"""Pixel centres."""


def _background(rng: np.random.Generator) -> np.ndarray:
    y, x = _Y / SIZE, _X / SIZE
    corners = rng.uniform(40, 215, size=(4, 3)).astype(np.float32)
    image = (corners[0] * ((1 - x) * (1 - y))[..., None] + corners[1] * (x * (1 - y))[..., None]
             + corners[2] * ((1 - x) * y)[..., None] + corners[3] * (x * y)[..., None])  # fmt: skip
    for _ in range(int(rng.integers(2, 6))):  # blotches: smooth, of any colour, the shapes' too
        centre, radius = rng.uniform(0, 1, size=2), rng.uniform(0.08, 0.3)
        weight = np.exp(-((x - centre[0]) ** 2 + (y - centre[1]) ** 2) / (2 * radius**2))[..., None]
        image = image * (1 - 0.5 * weight) + 0.5 * weight * rng.uniform(0, 255, size=3).astype(np.float32)
    if rng.random() < 0.5:  # faint stripes
        angle, period = rng.uniform(0, np.pi), rng.uniform(0.05, 0.2)
        stripes = np.sin((x * np.cos(angle) + y * np.sin(angle)) / period * 2 * np.pi)[..., None]
        image = image + stripes * rng.uniform(5, 20)
    return image + rng.normal(0, 6, size=image.shape).astype(np.float32)


def _mask(kind: str, cx: float, cy: float, half_w: float, half_h: float) -> tuple[int, int, np.ndarray]:
    """The shape's pixels within its window: (top row, left column, boolean mask of the window)."""
    top, left = max(0, int(cy - half_h) - 1), max(0, int(cx - half_w) - 1)
    bottom, right = min(SIZE, int(cy + half_h) + 2), min(SIZE, int(cx + half_w) + 2)
    y, x = _Y[top:bottom, left:right], _X[top:bottom, left:right]
    if kind == "circle":
        mask = ((x - cx) / half_w) ** 2 + ((y - cy) / half_h) ** 2 <= 1.0
    elif kind == "square":
        mask = (np.abs(x - cx) <= half_w) & (np.abs(y - cy) <= half_h)
    else:  # a triangle standing on its base
        fraction = np.clip((y - (cy - half_h)) / (2 * half_h), 0.0, 1.0)
        mask = (y >= cy - half_h) & (y <= cy + half_h) & (np.abs(x - cx) <= half_w * fraction)
    return top, left, np.asarray(mask, dtype=bool)


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    if boxes.size == 0:
        return np.zeros(0)
    width = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None)
    height = np.clip(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None)
    inter = width * height
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    result: np.ndarray = inter / (area + areas - inter)
    return result


def make_images(count: int, rng: np.random.Generator) -> ShapesData:
    """``count`` images with their boxes and classes (see the module)."""
    images = np.empty((count, SIZE, SIZE, 3), dtype=np.uint8)
    all_boxes, all_classes = [], []
    for index in range(count):
        image = _background(rng)
        boxes: list[np.ndarray] = []
        classes: list[int] = []
        for _ in range(int(rng.integers(1, 5))):
            for _attempt in range(20):  # a place where it overlaps the others little
                side = rng.uniform(*SIDES)
                aspect = rng.uniform(0.75, 1.33)
                half_w, half_h = side * np.sqrt(aspect) / 2, side / np.sqrt(aspect) / 2
                cx, cy = rng.uniform(half_w, SIZE - half_w), rng.uniform(half_h, SIZE - half_h)
                kind = int(rng.integers(0, len(LABELS)))
                top, left, mask = _mask(CLASS_SHAPES[kind][0], cx, cy, half_w, half_h)
                rows, columns = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
                if rows.size == 0:
                    continue
                box = np.asarray([left + columns[0], top + rows[0], left + columns[-1] + 1, top + rows[-1] + 1],
                                 dtype=np.float32)  # fmt: skip
                if (_iou(box, np.asarray(boxes).reshape(-1, 4)) > 0.1).any():
                    continue
                colour = np.asarray(COLOURS[CLASS_SHAPES[kind][1]], dtype=np.float32) + rng.normal(0, 14, size=3)
                window = image[top : top + mask.shape[0], left : left + mask.shape[1]]
                window[mask] = colour + rng.normal(0, 5, size=(int(mask.sum()), 3))
                boxes.append(box)
                classes.append(kind)
                break
        images[index] = np.clip(image, 0, 255).astype(np.uint8)
        all_boxes.append(np.asarray(boxes, dtype=np.float32).reshape(-1, 4))
        all_classes.append(np.asarray(classes, dtype=np.int64))
    return DetectionImages(images, tuple(all_boxes), tuple(all_classes))


def _block(in_channels: int, out_channels: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU()]


class ShapeDetector(nn.Module):
    """(N, 3, 96, 96) RGB in [0, 1] → (N, 4+C, 144): cx, cy, w, h in input pixels, then sigmoid class scores."""

    centres: torch.Tensor

    def __init__(self, classes: int = len(LABELS)) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_block(3, 8, 2), *_block(8, 16, 2), *_block(16, 16, 1), *_block(16, 32, 2), *_block(32, 32, 1),
            *_block(32, 32, 1),
        )  # fmt: skip
        self.distances = nn.Conv2d(32, 4, 1)
        self.scores = nn.Conv2d(32, classes, 1)
        centres = (torch.arange(GRID, dtype=torch.float32) + 0.5) * STRIDE
        cy, cx = torch.meshgrid(centres, centres, indexing="ij")
        self.register_buffer("centres", torch.stack([cx.reshape(-1), cy.reshape(-1)])[None], persistent=False)

    def raw(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Distances to the left, top, right, bottom side in cells (before the ReLU) and score logits, (N, k, 144)."""
        features = self.features(images)
        return self.distances(features).flatten(2), self.scores(features).flatten(2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        distances, logits = self.raw(images)
        distances = torch.relu(distances) * STRIDE
        top_left = self.centres - distances[:, 0:2]
        bottom_right = self.centres + distances[:, 2:4]
        return torch.cat([(top_left + bottom_right) / 2, bottom_right - top_left, torch.sigmoid(logits)], dim=1)


def build(seed: int = 0) -> nn.Module:
    return seeded_build(ShapeDetector, seed)


def _targets(data: ShapesData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per image and cell: the responsible box's class (-1: none), its box (x1, y1, x2, y2) and the cell's mask."""
    count = len(data)
    centres = (np.arange(GRID, dtype=np.float32) + 0.5) * STRIDE
    cy, cx = np.meshgrid(centres, centres, indexing="ij")
    cx, cy = cx.reshape(-1), cy.reshape(-1)
    classes = np.full((count, GRID * GRID), -1, dtype=np.int64)
    boxes = np.zeros((count, GRID * GRID, 4), dtype=np.float32)
    for index in range(count):
        order = np.argsort(-np.prod(data.boxes[index][:, 2:] - data.boxes[index][:, :2], axis=1))
        for k in order:  # large first: a smaller box claims its cells after
            x1, y1, x2, y2 = data.boxes[index][k]
            mx, my = (x1 + x2) / 2, (y1 + y2) / 2
            hw, hh = max((x2 - x1) * 0.3, STRIDE / 2), max((y2 - y1) * 0.3, STRIDE / 2)
            inside = (np.abs(cx - mx) <= hw) & (np.abs(cy - my) <= hh)
            inside[int(min(my // STRIDE, GRID - 1)) * GRID + int(min(mx // STRIDE, GRID - 1))] = True
            classes[index, inside] = data.classes[index][k]
            boxes[index, inside] = (x1, y1, x2, y2)
    return classes, boxes, np.stack([cx, cy], axis=0)


def _giou(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    width = (torch.minimum(predicted[:, 2], target[:, 2]) - torch.maximum(predicted[:, 0], target[:, 0])).clamp(min=0)
    height = (torch.minimum(predicted[:, 3], target[:, 3]) - torch.maximum(predicted[:, 1], target[:, 1])).clamp(min=0)
    inter = width * height
    area_p = (predicted[:, 2] - predicted[:, 0]).clamp(min=0) * (predicted[:, 3] - predicted[:, 1]).clamp(min=0)
    area_t = (target[:, 2] - target[:, 0]) * (target[:, 3] - target[:, 1])
    union = area_p + area_t - inter + 1e-7
    hull_w = torch.maximum(predicted[:, 2], target[:, 2]) - torch.minimum(predicted[:, 0], target[:, 0])
    hull = hull_w * (torch.maximum(predicted[:, 3], target[:, 3]) - torch.minimum(predicted[:, 1], target[:, 1])) + 1e-7
    return inter / union - (hull - union) / hull


def to_inputs(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, 3) RGB → float32 (N, 3, H, W) in [0, 1]: what ``IMAGE_PREPROCESS`` makes of a 96x96 image."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255)


STEPS = 800
"""Adam steps: 800 batches of 32 reach mAP@0.5 0.97 on the 400 held-out images (seed 0; 300 steps: 0.90)."""
THREADS = 1
"""Training threads: convolutions this small gain little from a second thread, and lose much to a busy machine
(measured here beside other work: 33 ms of CPU a step on one thread, 760 ms on two)."""


def train(model: nn.Module, data: DetectionDataset, *, seed: int = 0) -> nn.Module:
    """``STEPS`` Adam steps on ``data.train`` (about 35 s of one thread here)."""
    assert isinstance(model, ShapeDetector), f"shapes trains its own detector, not {type(model).__name__}"
    return train_detector(model, data.train, steps=STEPS, seed=seed)


def train_detector(model: ShapeDetector, data: ShapesData, *, steps: int, batch_size: int = 32,
                   learning_rate: float = 4e-3, seed: int = 0) -> nn.Module:  # fmt: skip
    """Train ``model`` for exactly ``steps`` Adam steps on random batches (horizontally flipped at random)."""
    classes_np, boxes_np, centres_np = _targets(data)
    inputs = torch.tensor(to_inputs(data.images))
    classes, boxes, centres = torch.tensor(classes_np), torch.tensor(boxes_np), torch.tensor(centres_np)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=learning_rate, total_steps=steps)
    flip_order = torch.arange(GRID * GRID).reshape(GRID, GRID).flip(1).reshape(-1)
    model.train()
    with limited_threads(THREADS), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            batch = torch.randint(len(inputs), (batch_size,), generator=generator)
            x, kinds, truth = inputs[batch], classes[batch], boxes[batch]
            flip = torch.rand(batch_size, generator=generator) < 0.5
            if flip.any():
                x = torch.where(flip[:, None, None, None], x.flip(3), x)
                mirrored = torch.stack([SIZE - truth[..., 2], truth[..., 1], SIZE - truth[..., 0], truth[..., 3]], -1)
                kinds = torch.where(flip[:, None], kinds[:, flip_order], kinds)
                truth = torch.where(flip[:, None, None], mirrored[:, flip_order], truth)
            distances, logits = model.raw(x)
            positive = kinds >= 0
            wanted = torch.zeros_like(logits)
            wanted.scatter_(1, kinds.clamp(min=0)[:, None, :], positive[:, None, :].float())
            positives = max(int(positive.sum()), 1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, wanted, reduction="sum") / positives
            cells = centres[None].expand(batch_size, -1, -1)  # (B, 2, N)
            target = torch.cat([cells - truth.permute(0, 2, 1)[:, 0:2], truth.permute(0, 2, 1)[:, 2:4] - cells], 1)
            chosen = positive[:, None, :].expand(-1, 4, -1)
            loss = loss + nn.functional.l1_loss(distances[chosen], target[chosen] / STRIDE, reduction="sum") / positives
            spread = torch.relu(distances) * STRIDE
            predicted = torch.cat([cells - spread[:, 0:2], cells + spread[:, 2:4]], 1).permute(0, 2, 1)[positive]
            loss = loss + (1 - _giou(predicted, truth[positive])).sum() / positives
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return model.eval()


def make_data(seed: int = 0) -> DetectionDataset:
    """Training and held-out images (different streams of ``seed``); calibration: ``CALIBRATION_SIZE`` of the
    training images."""
    train_images = make_images(TRAIN_IMAGES, rng_for(seed, "shapes-train"))
    validation = make_images(VALIDATION_IMAGES, rng_for(seed, "shapes-validation"))
    calibration = train_images.subset(calibration_indices(len(train_images), seed).tolist())
    return DetectionDataset(train=train_images, calibration=calibration, validation=validation)


def model() -> nn.Module:
    """The trained reference model (``edgeline export export/reference/shapes.py:model``)."""
    return train(build(), make_data())
