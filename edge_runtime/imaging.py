"""Camera frames and images into an image model's input 0: the one function export and the device both call.

    parse_preprocess("resize=letterbox,mean=0.485/0.456/0.406")   -> keys (what --preprocess says)
    preprocess_table({"resize": "letterbox", "mean": [0.485, ...]}) -> keys (an export config's [preprocess])
    image_preprocess(keys, input_spec)                              -> ImagePreprocess (the manifest's ``image``)
    FramePrep(spec, input_spec)(frame, pixel="rgb")                 -> float32 of input_spec.shape
    FramePrep.geometry(height, width).to_frame(boxes)               -> boxes in the frame, letterbox undone
    list_images(folder, role)                                       -> the image files under a folder, in path order
    read_image(path)                                                -> (H, W, 3) uint8 RGB (Pillow: export, infer)

numpy only: the device imports this module. A frame is resized with precomputed gather indices and weights per
source size (a camera's size can change at a reconnect; the tables of the last few sizes are kept), so a frame costs
a handful of numpy operations.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, get_args

import numpy as np
from pydantic import ValidationError

from edgeline.errors import EdgelineError, PayloadError
from edgeline.manifest import MAX_IMAGE_SIDE, ImagePreprocess, TensorSpec, image_axes

__all__ = [
    "COLORS",
    "IMAGE_SUFFIXES",
    "KEYS",
    "LAYOUTS",
    "MAX_IMAGES",
    "PLAN_CACHE",
    "RESIZES",
    "FramePrep",
    "Geometry",
    "Pixel",
    "format_preprocess",
    "frame_geometry",
    "image_preprocess",
    "list_images",
    "parse_preprocess",
    "preprocess_table",
    "read_image",
]

Pixel = Literal["rgb", "bgr", "gray"]
RESIZES: tuple[str, ...] = get_args(ImagePreprocess.model_fields["resize"].annotation)
COLORS: tuple[str, ...] = get_args(ImagePreprocess.model_fields["color"].annotation)
LAYOUTS: tuple[str, ...] = get_args(ImagePreprocess.model_fields["layout"].annotation)
KEYS: dict[str, str] = {
    "size": "HxW, e.g. 224x224 (default: the model's input)",
    "resize": " | ".join(RESIZES) + " (default letterbox)",
    "pad": "0..255, the letterbox's pad value (default 114)",
    "color": " | ".join(COLORS) + " (default: rgb, or gray for a 1-channel input)",
    "scale": "a number > 0, e.g. 1/255 or 0.003921 (default 1/255)",
    "mean": "one number, or one per channel separated by '/' (default 0)",
    "std": "one number > 0, or one per channel separated by '/' (default 1)",
    "layout": " | ".join(LAYOUTS) + " (default nchw)",
}
"""The keys of ``--preprocess`` and of an export config's ``[preprocess]``, with their valid values."""
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
"""The files an image folder is read for (case-insensitive), as torchvision's ImageFolder reads them."""
MAX_IMAGES = 100_000
"""The most image files a folder may hold (counted while it is listed)."""
PLAN_CACHE = 4
"""Frame sizes whose resize tables are kept (least recently used dropped): one camera's sizes across reconnects."""
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R BT.601, R, G, B


def _refuse(key: str, value: object, where: str) -> EdgelineError:
    return EdgelineError(f"{where}: {key}={value!r} is not valid; {key} is {KEYS[key]}")


def _number(key: str, text: object, where: str) -> float:
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise _refuse(key, text, where)
    try:
        value = float(Fraction(text.strip())) if isinstance(text, str) else float(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        raise _refuse(key, text, where) from None
    if not math.isfinite(value):
        raise _refuse(key, text, where)
    return value


def _value(key: str, raw: object, where: str) -> object:
    """One key's value, from text (``--preprocess``) or a TOML value, checked and typed."""
    if key in ("resize", "color", "layout"):
        valid = {"resize": RESIZES, "color": COLORS, "layout": LAYOUTS}[key]
        if not isinstance(raw, str) or raw.strip().lower() not in valid:
            raise _refuse(key, raw, where)
        return raw.strip().lower()
    if key == "pad":
        number = _number(key, raw, where)
        if not number.is_integer() or not 0 <= number <= 255:
            raise _refuse(key, raw, where)
        return int(number)
    if key == "scale":
        number = _number(key, raw, where)
        if number <= 0:
            raise _refuse(key, raw, where)
        return number
    if key in ("mean", "std"):
        items = raw.split("/") if isinstance(raw, str) else raw if isinstance(raw, (list, tuple)) else [raw]
        if not 1 <= len(items) <= 3:
            raise _refuse(key, raw, where)
        values = tuple(_number(key, item, where) for item in items)
        if key == "std" and any(v <= 0 for v in values):
            raise _refuse(key, raw, where)
        return values
    if key == "size":
        parts = raw.lower().split("x") if isinstance(raw, str) else raw if isinstance(raw, (list, tuple)) else None
        if parts is None or len(parts) != 2:
            raise _refuse(key, raw, where)
        sides = [_number(key, part, where) for part in parts]
        if not all(side.is_integer() and 1 <= side <= MAX_IMAGE_SIDE for side in sides):
            raise _refuse(key, raw, where)
        return (int(sides[0]), int(sides[1]))
    raise EdgelineError(f"{where}: unknown key {key!r}; valid keys: {', '.join(KEYS)}")


def parse_preprocess(text: str, where: str = "--preprocess") -> dict[str, object]:
    """``"resize=letterbox,pad=114,color=rgb,mean=0.485/0.456/0.406"`` → typed keys. Commas separate keys, '/'
    the values of one channel each; an unknown key, a key given twice or a bad value is an ``EdgelineError`` naming
    the key and its valid values."""
    keys: dict[str, object] = {}
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise EdgelineError(f"{where}: empty; give KEY=VALUE,... with keys {', '.join(KEYS)}")
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise EdgelineError(f"{where}: {item!r} is not KEY=VALUE; valid keys: {', '.join(KEYS)}")
        if key in keys:
            raise EdgelineError(f"{where}: {key} is given twice")
        keys[key] = _value(key, value.strip(), where)
    return keys


def preprocess_table(table: Mapping[str, object], where: str) -> dict[str, object]:
    """The same keys from a TOML table (an export config's ``[preprocess]``): strings as ``--preprocess`` takes
    them, or numbers and arrays (``mean = [0.485, 0.456, 0.406]``, ``size = [224, 224]``)."""
    return {str(key).lower(): _value(str(key).lower(), value, where) for key, value in table.items()}


def format_preprocess(keys: Mapping[str, object]) -> str:
    """Keys back to ``--preprocess`` text (what ``parse_preprocess`` reads into the same keys)."""

    def text(value: object) -> str:
        if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
            return f"{value[0]}x{value[1]}"
        if isinstance(value, tuple):
            return "/".join(repr(float(v)) for v in value)
        return repr(value) if isinstance(value, float) else str(value)

    return ",".join(f"{key}={text(value)}" for key, value in keys.items())


def image_preprocess(keys: Mapping[str, object], input_spec: TensorSpec) -> ImagePreprocess:
    """The manifest's ``image`` for an input: the keys given, the size (and channels) read from the input's shape
    and ``layout`` where not given. A spec that does not fit the input is refused, naming both."""
    unknown = sorted(set(keys) - set(KEYS))
    if unknown:
        raise EdgelineError(f"pre-processing: unknown key {unknown[0]!r}; valid keys: {', '.join(KEYS)}")
    layout = str(keys.get("layout", "nchw"))
    where = f"input {input_spec.name!r} of shape {list(input_spec.shape)}"
    try:
        channels, height, width = image_axes(input_spec.shape, layout)  # type: ignore[arg-type]
    except ValueError as exc:
        raise EdgelineError(
            f"pre-processing (layout {layout}) does not fit the model: input {input_spec.name!r} {exc}"
        ) from None
    color = str(keys.get("color", "gray" if channels == 1 else "rgb"))
    wanted = 1 if color == "gray" else 3
    if wanted != channels:
        raise EdgelineError(
            f"pre-processing color={color} makes {wanted} channel{'s' if wanted > 1 else ''}, but {where} takes "
            f"{channels} ({layout}): " + ("color=gray needs a 1-channel input" if wanted == 1 else "use color=gray")
        )
    size = keys.get("size", (height, width))
    if size != (height, width):
        assert isinstance(size, tuple)
        raise EdgelineError(
            f"pre-processing size={size[0]}x{size[1]} does not fit {where}: it takes {height}x{width} ({layout})"
        )
    try:
        return ImagePreprocess(**dict(keys, size=size, color=color, layout=layout))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'image'}: {e['msg']}" for e in exc.errors())
        raise EdgelineError(f"pre-processing for {where}: {problems}") from None


@dataclass(frozen=True)
class Geometry:
    """Where a frame of ``frame_height`` x ``frame_width`` lands in the input: input pixel = frame pixel * scale +
    pad, per axis (continuous coordinates, pixel edges at integers). A letterbox has pad >= 0 (the bands), a centre
    crop pad < 0 (``crop_x``/``crop_y`` frame pixels cut off on the left/top), a squash pad 0 and two scales."""

    frame_height: int
    frame_width: int
    input_height: int
    input_width: int
    scale_x: float
    scale_y: float
    pad_x: float
    pad_y: float

    @property
    def crop_x(self) -> float:
        return max(0.0, -self.pad_x / self.scale_x)

    @property
    def crop_y(self) -> float:
        return max(0.0, -self.pad_y / self.scale_y)

    def to_frame(self, boxes: np.ndarray) -> np.ndarray:
        """(N, 4) x1, y1, x2, y2 in input pixels → the frame's coordinates normalised to [0, 1] by its width and
        height, clipped (a box in the letterbox's band ends at the frame's edge)."""
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        out = np.empty_like(boxes)
        out[:, 0::2] = (boxes[:, 0::2] - self.pad_x) / (self.scale_x * self.frame_width)
        out[:, 1::2] = (boxes[:, 1::2] - self.pad_y) / (self.scale_y * self.frame_height)
        return np.clip(out, 0.0, 1.0)

    def to_input(self, boxes: np.ndarray) -> np.ndarray:
        """The inverse of ``to_frame`` (unclipped): normalised frame boxes → input pixels."""
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        out = np.empty_like(boxes)
        out[:, 0::2] = boxes[:, 0::2] * self.frame_width * self.scale_x + self.pad_x
        out[:, 1::2] = boxes[:, 1::2] * self.frame_height * self.scale_y + self.pad_y
        return out


def _axis(source: int, scale: float, pad: float, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear gather tables for output pixels ``start..stop`` of one axis: the two source indices and the weight
    of the second, at half-pixel centres (source = (out + 0.5 - pad) / scale - 0.5, clamped to the edge)."""
    centres = (np.arange(start, stop, dtype=np.float64) + 0.5 - pad) / scale - 0.5
    centres = np.clip(centres, 0.0, source - 1)
    first = np.floor(centres).astype(np.intp)
    second = np.minimum(first + 1, source - 1)
    return first, second, centres - first


def _per_channel(
    table: tuple[np.ndarray, np.ndarray, np.ndarray], factors: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A column table for a row of interleaved pixels (W * channels values): both indices, and both weights times
    each channel's factor (the normalisation's multiplier, folded in)."""
    first, second, weight = table
    channels = len(factors)
    spread = np.arange(channels, dtype=np.intp)
    weight = weight.astype(np.float32)
    return (
        (first[:, None] * channels + spread).reshape(-1),
        (second[:, None] * channels + spread).reshape(-1),
        ((1 - weight)[:, None] * factors).reshape(-1).astype(np.float32),
        (weight[:, None] * factors).reshape(-1).astype(np.float32),
    )


@dataclass(frozen=True)
class _Plan:
    geometry: Geometry
    rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # indices and weights of the upper, lower row
    columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # the same of the left, right pixel's values
    region: tuple[slice, slice]  # where the frame lands in the input (height, width)
    folded: bool  # the columns' weights hold the normalisation's multiplier (and the channel order)
    gathered: np.ndarray  # scratch: source rows (uint8)
    scratch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # float32: two rows' values, two columns'


def frame_geometry(spec: ImagePreprocess, height: int, width: int) -> Geometry:
    """How a frame of ``height`` x ``width`` maps into the input ``spec`` makes (see ``Geometry``): what
    ``FramePrep.geometry`` says, without its tables (a detector's answer maps its boxes back with it)."""
    (out_h, out_w), mode = spec.size, spec.resize
    if mode == "squash":
        return Geometry(height, width, out_h, out_w, out_w / width, out_h / height, 0.0, 0.0)
    if mode == "center-crop":
        ratio = max(out_h / height, out_w / width)
        return Geometry(
            height, width, out_h, out_w, ratio, ratio, (out_w - width * ratio) / 2, (out_h - height * ratio) / 2
        )
    ratio = min(out_h / height, out_w / width)
    # the frame fills whole input pixels: its size rounded, the smaller half of the band on the left / top
    new_h, new_w = max(1, min(out_h, round(height * ratio))), max(1, min(out_w, round(width * ratio)))
    return Geometry(
        height, width, out_h, out_w, new_w / width, new_h / height, float((out_w - new_w) // 2),
        float((out_h - new_h) // 2),
    )  # fmt: skip


class FramePrep:
    """``spec`` applied to frames for an input of ``input_spec``: ``prep(frame, pixel)`` → float32 of the input's
    shape (before quantization, which ``edgeline.model`` applies per the input tensor)."""

    def __init__(self, spec: ImagePreprocess, input_spec: TensorSpec):
        self.spec = spec
        self.input_spec = input_spec
        try:
            channels, height, width = image_axes(input_spec.shape, spec.layout)
        except ValueError as exc:
            raise EdgelineError(f"image pre-processing: input {input_spec.name!r} {exc}") from None
        if (height, width) != spec.size or channels != spec.channels:
            raise EdgelineError(
                f"image pre-processing {spec.size[0]}x{spec.size[1]} {spec.color} does not fit input "
                f"{input_spec.name!r} of shape {list(input_spec.shape)} ({channels} channel(s) of {height}x{width})"
            )
        self._channels, self._height, self._width = channels, height, width
        std = np.broadcast_to(np.asarray(spec.std, dtype=np.float64), (channels,))
        mean = np.broadcast_to(np.asarray(spec.mean, dtype=np.float64), (channels,))
        # (x * scale - mean) / std as one multiply and one add per element
        self._multiply = (spec.scale / std).astype(np.float32)
        self._add = (-mean / std).astype(np.float32)
        self._template = np.empty((channels, height, width), dtype=np.float32)
        self._template[:] = (spec.pad * self._multiply + self._add)[:, None, None]
        self._plans: OrderedDict[tuple[int, int, str], _Plan] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def plan_sizes(self) -> tuple[tuple[int, int, str], ...]:
        """The frames (height, width, pixel order) whose tables are kept, least recently used first."""
        return tuple(self._plans)

    def geometry(self, height: int, width: int) -> Geometry:
        """How a frame of ``height`` x ``width`` maps into the input (see ``Geometry``)."""
        return frame_geometry(self.spec, height, width)

    def _plan(self, height: int, width: int, pixel: str) -> _Plan:
        key = (height, width, pixel)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        geometry = self.geometry(height, width)
        if self.spec.resize == "letterbox":
            x0, y0 = int(geometry.pad_x), int(geometry.pad_y)
            x1, y1 = x0 + round(width * geometry.scale_x), y0 + round(height * geometry.scale_y)
        else:
            x0, y0, x1, y1 = 0, 0, self._width, self._height
        top, bottom, wy = _axis(height, geometry.scale_y, geometry.pad_y, y0, y1)
        rows = (top, bottom, (1 - wy).astype(np.float32)[:, None], wy.astype(np.float32)[:, None])
        # frame and input of one channel count: the multiplier (in the frame's channel order) goes into the weights
        source_channels = 1 if pixel == "gray" else 3
        folded = source_channels == self._channels
        factors = self._multiply if not folded or pixel in ("gray", self.spec.color) else self._multiply[::-1]
        columns = _per_channel(
            _axis(width, geometry.scale_x, geometry.pad_x, x0, x1),
            factors if folded else np.ones(source_channels, dtype=np.float32),
        )
        values = width * source_channels
        plan = _Plan(
            geometry,
            rows,
            columns,
            (slice(y0, y1), slice(x0, x1)),
            folded,
            np.empty((len(top), values), dtype=np.uint8),
            (
                np.empty((len(top), values), dtype=np.float32),
                np.empty((len(top), values), dtype=np.float32),
                np.empty((len(top), len(columns[0])), dtype=np.float32),
                np.empty((len(top), len(columns[0])), dtype=np.float32),
            ),
        )
        self._plans[key] = plan
        while len(self._plans) > PLAN_CACHE:
            self._plans.popitem(last=False)
        return plan

    def _checked(self, frame: object, pixel: str) -> np.ndarray:
        if pixel not in COLORS:
            raise EdgelineError(f"pixel {pixel!r}: valid pixel orders are {', '.join(COLORS)}")
        shape = getattr(frame, "shape", None)
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8:
            what = f"dtype {frame.dtype}" if isinstance(frame, np.ndarray) else type(frame).__name__
            raise PayloadError(
                f"frame: {what} of shape {list(shape) if shape is not None else '?'}; an image is uint8 (H, W, 3) "
                "or (H, W)",
                code="wrong-shape",
            )
        gray = frame.ndim == 2 or (frame.ndim == 3 and frame.shape[2] == 1)
        colour = frame.ndim == 3 and frame.shape[2] == 3
        if not (gray or colour) or not all(1 <= side <= MAX_IMAGE_SIDE for side in frame.shape[:2]):
            raise PayloadError(
                f"frame of shape {list(frame.shape)} is not an image: (H, W, 3) or (H, W) uint8, each side "
                f"1..{MAX_IMAGE_SIDE}",
                code="wrong-shape",
            )
        if colour and pixel == "gray":
            raise PayloadError(
                f"frame of shape {list(frame.shape)} has 3 channels but pixel is gray", code="wrong-shape"
            )
        return frame.reshape(frame.shape[0], frame.shape[1], -1)

    def __call__(self, frame: np.ndarray, pixel: Pixel = "rgb") -> np.ndarray:
        """``frame`` (uint8 (H, W, 3) in ``pixel`` order, or (H, W) / (H, W, 1) gray, any size) → float32 of the
        input's shape: colour converted, resized, normalised, laid out. A frame that is not an image is refused
        (``PayloadError`` code ``wrong-shape``), naming its shape."""
        image = self._checked(frame, pixel)
        height, width, channels = image.shape
        pixel = pixel if channels == 3 else "gray"
        flat = image.reshape(height, width * channels)
        with self._lock:  # the tables and their scratch rows: one frame at a time through them
            plan = self._plan(height, width, pixel)
            top, bottom, w_top, w_bottom = plan.rows
            left, right, w_left, w_right = plan.columns
            upper, lower, resized, other = plan.scratch
            # rows first (the tables skip what a crop cuts off), then columns, in float32, into buffers kept with
            # the tables; a row's pixels as one axis (W * C), so each operation runs along it, not along 3 channels
            np.take(flat, top, axis=0, out=plan.gathered)
            np.multiply(plan.gathered, w_top, out=upper)
            np.take(flat, bottom, axis=0, out=plan.gathered)
            np.multiply(plan.gathered, w_bottom, out=lower)
            upper += lower
            np.take(upper, left, axis=1, out=resized)
            resized *= w_left
            np.take(upper, right, axis=1, out=other)
            other *= w_right
            resized += other
            return self._finish(resized, plan, pixel, channels)

    def _finish(self, resized: np.ndarray, plan: _Plan, pixel: str, channels: int) -> np.ndarray:
        """The resized rows (weighted, perhaps scaled) into a new array of the input's shape: normalised, laid
        out, the letterbox's bands filled."""
        top = plan.rows[0]
        pixels = resized.reshape(len(top), -1, channels)
        out = self._template.copy()
        region = out[:, plan.region[0], plan.region[1]]
        if plan.folded:
            ordered = pixels if pixel in ("gray", self.spec.color) else pixels[:, :, ::-1]
            np.add(ordered.transpose(2, 0, 1), self._add[:, None, None], out=region)
        else:
            np.multiply(self._to_color(pixels, pixel).transpose(2, 0, 1), self._multiply[:, None, None], out=region)
            region += self._add[:, None, None]
        if self.spec.layout == "nhwc":
            out = np.ascontiguousarray(out.transpose(1, 2, 0))
        return out.reshape(self.input_spec.shape)

    def _to_color(self, resized: np.ndarray, pixel: str) -> np.ndarray:
        """(h, w, c) in ``pixel`` order → (h, w, channels) in the spec's colour order."""
        target = self.spec.color
        if pixel == "gray":
            return resized if target == "gray" else np.broadcast_to(resized, (*resized.shape[:2], 3))
        if target == "gray":
            luma = _LUMA if pixel == "rgb" else _LUMA[::-1]
            return (resized @ luma)[:, :, None]
        return resized if pixel == target else resized[:, :, ::-1]


def list_images(folder: Path, role: str) -> list[Path]:
    """Every image file under ``folder`` (``IMAGE_SUFFIXES``, regular files: a FIFO would block its read),
    recursively, in path order; more than ``MAX_IMAGES`` is an ``EdgelineError`` starting with ``role``."""
    found: list[Path] = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            found.append(path)
            if len(found) > MAX_IMAGES:
                raise EdgelineError(f"{role} folder {folder}: more than {MAX_IMAGES:,} images")
    return found


def read_image(path: str | Path) -> np.ndarray:
    """An image file as (H, W, 3) uint8 RGB (image folders at export, ``edgeline infer`` on images; Pillow, the
    export and images extras'). EXIF orientation is not applied, as torchvision's ImageFolder loader does not.
    ``EdgelineError`` for a file that is not an image."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:
        raise EdgelineError("reading images needs Pillow: pip install 'edgeline[images]'") from exc
    path = Path(path)
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    except FileNotFoundError:
        raise EdgelineError(f"image {path}: no such file") from None
    except UnidentifiedImageError:
        raise EdgelineError(f"image {path}: not an image Pillow can read") from None
    except Image.DecompressionBombError as exc:
        raise EdgelineError(f"image {path}: too large ({exc})") from None
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or damaged file
        raise EdgelineError(f"image {path}: cannot be read ({exc})") from None
