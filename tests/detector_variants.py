"""Detectors the tests never trained, made of the reference shapes detector (``edgeline.export.reference.shapes``)
with other heads and inputs, written as model files for ``edgeline export FILE.py:model``.

Each file loads the trained weights from ``detector.pt`` beside it. ``HEADS`` maps a ``--head`` to the file whose
model has that output layout:

    yolov8     the reference detector itself: (1, 4+C, 144), cx, cy, w, h in input pixels, sigmoid scores
    yolov5     (1, 144, 5+C): boxes, an objectness (the best class score), then the class scores divided by it
    end2end    (1, 20, 6): x1, y1, x2, y2, score, class of the 20 best candidates after a greedy class-aware NMS done
               in the model with fixed shapes (a suppressed row scores 0)

``UPSCALED`` takes 384x384 images (the reference detector behind a 4x average pool) and gives its boxes in those
pixels, 0 to 384: concatenated with scores of 0 to 1, one int8 scale (384 / 255 = 1.5 per step) leaves the scores
nothing; ``UPSCALED_OPAQUE`` is the same model whose output is not the concatenation itself (a ``contiguous()``
after it), which edgeline cannot rewrite. ``NESTED`` is the reference detector as a YOLO model is built: a backbone
module and a head module whose forward makes the output (the concatenation is one module down).
"""

from __future__ import annotations

from pathlib import Path

HEADER = """
from pathlib import Path

import torch
from torch import nn

from edgeline.export.reference import shapes

IMAGE_PREPROCESS = "{preprocess}"
INPUT_SHAPE = (1, 3, {size}, {size})


def detector():
    model = shapes.build(0)
    model.load_state_dict(torch.load(Path(__file__).with_name("detector.pt"), weights_only=True))
    return model.eval()
"""

PREPROCESS = "resize=letterbox,pad=114,color=rgb,scale=1/255"

YOLOV8 = """
def model():
    return detector()
"""

YOLOV5 = """
class YoloV5(nn.Module):
    def __init__(self):
        super().__init__()
        self.detector = detector()

    def forward(self, images):
        out = self.detector(images)
        boxes, scores = out[:, :4], out[:, 4:]
        objectness = scores.amax(dim=1, keepdim=True)
        return torch.cat([boxes, objectness, scores / objectness.clamp(min=1e-6)], dim=1).permute(0, 2, 1)


def model():
    return YoloV5().eval()
"""

END2END = '''
KEEP, IOU = 20, 0.45


class End2End(nn.Module):
    """The 20 best candidates, then a greedy class-aware NMS unrolled over them: fixed shapes throughout."""

    def __init__(self):
        super().__init__()
        self.detector = detector()

    def forward(self, images):
        out = self.detector(images)[0]  # (4+C, N)
        scores, classes = out[4:].max(dim=0)
        best, order = scores.topk(KEEP)
        centre, size = out[0:2, order], out[2:4, order]
        boxes = torch.cat([centre - size / 2, centre + size / 2]).t()  # (K, 4)
        kinds = classes[order]
        top_left = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
        bottom_right = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
        inter = (bottom_right - top_left).clamp(min=0).prod(dim=2)
        area = (boxes[:, 2:] - boxes[:, :2]).prod(dim=1)
        iou = inter / (area[:, None] + area[None, :] - inter + 1e-9)
        clash = (iou > IOU) & (kinds[:, None] == kinds[None, :])
        alive = torch.ones(KEEP)
        for i in range(KEEP):  # a box lives unless a better one of its class that lives overlaps it
            earlier = torch.arange(KEEP) < i
            alive[i] = alive[i] * (1 - (clash[i] & earlier).float().mul(alive).sum().clamp(max=1))
        rows = torch.cat([boxes, (best * alive)[:, None], kinds[:, None].float()], dim=1)
        return rows[None]


def model():
    return End2End().eval()
'''

NESTED = '''
class Head(nn.Module):
    """The reference detector's head as a module of its own, as a YOLO model's last module is: it concatenates."""

    def __init__(self, trained):
        super().__init__()
        self.distances, self.scores = trained.distances, trained.scores
        self.register_buffer("centres", trained.centres, persistent=False)

    def forward(self, features):
        distances = torch.relu(self.distances(features).flatten(2)) * shapes.STRIDE
        top_left = self.centres - distances[:, 0:2]
        bottom_right = self.centres + distances[:, 2:4]
        scores = torch.sigmoid(self.scores(features).flatten(2))
        return torch.cat([(top_left + bottom_right) / 2, bottom_right - top_left, scores], dim=1)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        trained = detector()
        self.backbone, self.head = trained.features, Head(trained)

    def forward(self, images):
        return self.head(self.backbone(images))


def model():
    return Nested().eval()
'''

UPSCALED = """
class Upscaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.detector = detector()

    def forward(self, images):
        out = self.detector(nn.functional.avg_pool2d(images, 4))
        return {output}


def model():
    return Upscaled().eval()
"""

HEADS = {"yolov8": "yolov8.py", "yolov5": "yolov5.py", "end2end": "end2end.py"}
UPSCALED_FILE, UPSCALED_OPAQUE_FILE, NESTED_FILE = "upscaled.py", "upscaled_opaque.py", "nested.py"


def write_variants(folder: Path) -> None:
    """Every variant's file into ``folder`` (``detector.pt`` goes beside them)."""
    small = HEADER.format(preprocess=PREPROCESS, size=96)
    large = HEADER.format(preprocess=PREPROCESS, size=384)
    direct = "torch.cat([out[:, :4] * 4, out[:, 4:]], dim=1)"
    texts = {
        HEADS["yolov8"]: small + YOLOV8,
        HEADS["yolov5"]: small + YOLOV5,
        HEADS["end2end"]: small + END2END,
        UPSCALED_FILE: large + UPSCALED.format(output=direct),
        UPSCALED_OPAQUE_FILE: large + UPSCALED.format(output=f"{direct}.contiguous()"),
        NESTED_FILE: small + NESTED,
    }
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
