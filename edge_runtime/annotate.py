"""An answer drawn on the image it answers: a rectangle per detection in its class's colour with its label and score
beside it, and a caption bar for what is one answer per image (a class, an anomaly score). The one drawing function
of ``edgeline infer --annotate`` and of the daemon's snapshots.

    annotate(image, answer, pixel="rgb", caption="red 0.97")   -> a new uint8 array of the image's shape

Rectangles are numpy (exact pixels, no dependency); a label (its patch and text) is Pillow's where it is installed
(the ``images`` extra), drawn on its own small region, never on the whole frame; without Pillow the patches and the
bar are drawn plain. Text scales with the image (``font_size``), the caption fits its bar. A detection's ``box`` is
[x1, y1, x2, y2] normalised to the image (``edgeline.postprocess``): continuous coordinates, pixel edges at integers,
so the rectangle's outer edge is the box's own, its line drawn inwards; what falls outside the image is not drawn.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeline.errors import EdgelineError

__all__ = [
    "BAR_ROWS",
    "CAPTION_SIZE",
    "MAX_DRAWN",
    "PALETTE",
    "annotate",
    "answer_caption",
    "box_line_width",
    "class_colour",
    "font_size",
]

BAR_ROWS = 18
"""The caption bar's height in pixels (at most the image's)."""
CAPTION_SIZE = 11
"""The caption's text height in pixels (it fits the bar)."""
MAX_DRAWN = 1000
"""The most detections drawn on one image (the best ones)."""
PALETTE: tuple[tuple[int, int, int], ...] = tuple(
    (code >> 16, (code >> 8) & 0xFF, code & 0xFF)
    for code in (
        0xFF3838, 0xFF9D97, 0xFF701F, 0xFFB21D, 0xCFD231, 0x48F90A, 0x92CC17, 0x3DDB86, 0x1A9334, 0x00D4BB,
        0x2C99A8, 0x00C2FF, 0x344593, 0x6473FF, 0x0018EC, 0x8438FF, 0x520085, 0xCB38FF, 0xFF95C8, 0xFF37C7,
    )
)  # fmt: skip
"""RGB colours of classes 0, 1, 2, ... (then again from the first): twenty that stand apart."""
_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as edgeline.imaging makes gray
_TEXT_PAD = 2
_PLAIN_CHAR = (6, 11)  # a character's width and height where Pillow is not installed (no text drawn)


def box_line_width(height: int, width: int) -> int:
    """The rectangles' line width in pixels on an image of ``height`` x ``width``: 1 up to ~240 pixels a side."""
    return max(1, round(min(height, width) / 160))


def class_colour(index: int) -> tuple[int, int, int]:
    """The RGB colour of class ``index``."""
    return PALETTE[index % len(PALETTE)]


def answer_caption(answer: Mapping[str, Any]) -> str:
    """An answer in a few words: "label 0.93", "anomaly 0.0123", "3 detections" (empty for an answer without any)."""
    label, score = answer.get("label"), answer.get("score")
    if label is not None:
        return f"{label} {score:.2f}" if isinstance(score, int | float) else str(label)
    if answer.get("anomaly_score") is not None:
        return f"anomaly {answer['anomaly_score']:.3g}"
    detections = answer.get("detections")
    if isinstance(detections, list | tuple):
        return f"{len(detections)} detection{'' if len(detections) == 1 else 's'}"
    return ""


def _fill(plane: np.ndarray, rows: tuple[int, int], columns: tuple[int, int], colour: np.ndarray) -> None:
    """Rows and columns from..to (inclusive) set to ``colour``, clipped to the image (nothing where none is left)."""
    height, width = plane.shape[:2]
    top, bottom = max(rows[0], 0), min(rows[1], height - 1)
    left, right = max(columns[0], 0), min(columns[1], width - 1)
    if top <= bottom and left <= right:
        plane[top : bottom + 1, left : right + 1] = colour


def _edges(box: object, height: int, width: int) -> tuple[int, int, int, int] | None:
    """A normalised box's first and last pixel columns and rows (unclipped), or None for what is not a box."""
    if not isinstance(box, list | tuple) or len(box) != 4:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in box):
        return None
    x1, y1, x2, y2 = (min(max(float(v), -1.0), 2.0) for v in box)  # far outside is as good as just outside
    if x2 < x1 or y2 < y1:
        return None
    left, top = math.floor(x1 * width), math.floor(y1 * height)
    return left, top, max(left, math.ceil(x2 * width) - 1), max(top, math.ceil(y2 * height) - 1)


def _rectangle(plane: np.ndarray, edges: tuple[int, int, int, int], line: int, colour: np.ndarray) -> None:
    left, top, right, bottom = edges
    _fill(plane, (top, min(top + line - 1, bottom)), (left, right), colour)
    _fill(plane, (max(bottom - line + 1, top), bottom), (left, right), colour)
    _fill(plane, (top, bottom), (left, min(left + line - 1, right)), colour)
    _fill(plane, (top, bottom), (max(right - line + 1, left), right), colour)


def font_size(height: int, width: int) -> int:
    """The labels' text height in pixels on an image of ``height`` x ``width``: 8 up to ~320 pixels a side."""
    return max(8, round(min(height, width) / 40))


@functools.lru_cache(maxsize=8)
def _font(size: int) -> Any:
    """Pillow's own font at ``size`` (its bitmap font, of one size, where Pillow has no FreeType); None without
    Pillow."""
    try:
        from PIL import ImageFont
    except ImportError:
        return None
    try:
        return ImageFont.load_default(size)
    except (ImportError, OSError, TypeError):  # no FreeType: the bitmap font
        return ImageFont.load_default()


def _text_size(font: Any, text: str) -> tuple[int, int]:
    if font is None:
        return len(text) * _PLAIN_CHAR[0], _PLAIN_CHAR[1]
    _, _, right, bottom = font.getbbox(text)
    return int(right), int(bottom)


def _in_order(rgb: tuple[int, int, int], pixel: str, channels: int) -> np.ndarray:
    """An RGB colour as the image's pixel: BGR reversed, gray its luma."""
    if channels == 1:
        return np.array([round(sum(c * w for c, w in zip(rgb, _LUMA, strict=True)))], dtype=np.uint8)
    return np.array(rgb[::-1] if pixel == "bgr" else rgb, dtype=np.uint8)


def _check(image: object) -> np.ndarray:
    shape = getattr(image, "shape", None)
    if (
        not isinstance(image, np.ndarray)
        or image.dtype != np.uint8
        or image.ndim not in (2, 3)
        or (image.ndim == 3 and image.shape[2] not in (1, 3))
        or 0 in image.shape
    ):
        raise EdgelineError(
            f"annotate: {type(image).__name__} of shape {list(shape) if shape is not None else '?'} is not an "
            "image: uint8 (H, W, 3) or (H, W)"
        )
    return image


@dataclass(frozen=True)
class _Label:
    """Text at ``place`` (x, y) in ``ink`` at ``size``, on a patch of ``colour`` over ``rows`` and ``columns``
    (inclusive), or over what is there (``colour`` None)."""

    place: tuple[int, int]
    text: str
    ink: tuple[int, int, int]
    size: int
    rows: tuple[int, int]
    columns: tuple[int, int]
    colour: tuple[int, int, int] | None = None


def annotate(
    image: np.ndarray, answer: Mapping[str, Any], *, pixel: str = "rgb", caption: str | None = None
) -> np.ndarray:
    """A copy of ``image`` (uint8 (H, W, 3) in ``pixel`` order "rgb" or "bgr", or gray (H, W) / (H, W, 1)) with
    ``answer``'s detections drawn (the best on top, every label over every box) and, when ``caption`` is given, a
    bar at its top with that text. An answer without detections and no caption: the image unchanged."""
    out = _check(image).copy()
    height, width = out.shape[:2]
    plane = out.reshape(height, width, -1)
    channels = plane.shape[2]
    labels: list[_Label] = []
    size = font_size(height, width)
    font = _font(size)
    if caption:
        bar = min(BAR_ROWS, height)
        plane[:bar] = 0
        labels.append(_Label((4, 3), caption[:120], (255, 255, 0), CAPTION_SIZE, (0, bar - 1), (0, width - 1)))
    detections = answer.get("detections")
    line = box_line_width(height, width)
    for found in reversed(list(detections or ())[:MAX_DRAWN] if isinstance(detections, list | tuple) else []):
        if not isinstance(found, Mapping):
            continue
        edges = _edges(found.get("box"), height, width)
        if edges is None or edges[2] < 0 or edges[3] < 0 or edges[0] >= width or edges[1] >= height:
            continue  # not a box, or none of it in the image
        index = found.get("class_index")
        rgb = class_colour(index if isinstance(index, int) and not isinstance(index, bool) else 0)
        _rectangle(plane, edges, line, _in_order(rgb, pixel, channels))
        score = found.get("score")
        text = (f"{found.get('label', index)}" + (f" {score:.2f}" if isinstance(score, int | float) else ""))[:60]
        text_width, text_height = _text_size(font, text)
        chip_w, chip_h = text_width + 2 * _TEXT_PAD, text_height + _TEXT_PAD
        left, top = edges[0], edges[1]
        chip_left = max(0, min(left, width - chip_w))
        chip_top = top - chip_h if top - chip_h >= 0 else max(top, 0)  # above the box where there is room
        dark = sum(c * w for c, w in zip(rgb, _LUMA, strict=True)) > 140
        ink = (0, 0, 0) if dark else (255, 255, 255)
        rows, columns = (chip_top, chip_top + chip_h - 1), (chip_left, chip_left + chip_w - 1)
        labels.append(_Label((chip_left + _TEXT_PAD, chip_top), text, ink, size, rows, columns, rgb))
    for label in labels:
        if font is None:  # no Pillow: the patches alone
            if label.colour is not None:
                _fill(plane, label.rows, label.columns, _in_order(label.colour, pixel, channels))
        else:
            _draw_label(plane, label, pixel)
    return out


def _draw_label(plane: np.ndarray, label: _Label, pixel: str) -> None:
    """Pillow's patch and text on ``plane`` in place (its pixel order kept), in the label's region alone: a frame's
    whole picture converted for a few labels would cost tens of milliseconds."""
    from PIL import Image, ImageDraw

    height, width = plane.shape[:2]
    top, bottom = max(label.rows[0], 0), min(label.rows[1], height - 1)
    left, right = max(label.columns[0], 0), min(label.columns[1], width - 1)
    if top > bottom or left > right:
        return
    region = plane[top : bottom + 1, left : right + 1]
    gray = plane.shape[2] == 1
    if gray:
        picture = Image.fromarray(np.ascontiguousarray(region[:, :, 0]), mode="L")
    else:
        picture = Image.fromarray(np.ascontiguousarray(region[:, :, ::-1] if pixel == "bgr" else region), mode="RGB")
    draw = ImageDraw.Draw(picture)

    def ink(rgb: tuple[int, int, int]) -> int | tuple[int, int, int]:
        return int(_in_order(rgb, pixel, 1)[0]) if gray else rgb

    if label.colour is not None:
        draw.rectangle((0, 0, right - left, bottom - top), fill=ink(label.colour))
    draw.text((label.place[0] - left, label.place[1] - top), label.text, fill=ink(label.ink), font=_font(label.size))
    drawn = np.asarray(picture)
    if gray:
        region[:, :, 0] = drawn
    else:
        region[:] = drawn[:, :, ::-1] if pixel == "bgr" else drawn
