"""A synthetic camera scene: moving coloured shapes over a textured background, deterministic per (seed, frame).

    scene = Scene(640, 480, fps=30.0, objects=3, seed=0)
    scene.frame(i)                -> (480, 640, 3) uint8 RGB, frame i (any i, in any order)
    scene.boxes(i)                -> [(class_index, x1, y1, x2, y2), ...] ground truth in pixels (x1 <= x < x2)
    read_frame_number(array)      -> i, or None when the array carries no barcode

Frame ``i`` shows the scene at time ``i / fps``: objects bounce at speeds in pixels per second, so a scene looks the
same at any rate. Each frame carries its own number as a barcode along the top edge (``BITS`` black or white blocks
of ``block`` pixels square: 32 bits of the number, then a CRC-8 of them) that survives JPEG and H.264 at their usual
qualities, so a test or a benchmark reading a stream knows which frame it holds: end-to-end latency, lost and
duplicated frames. ``TestsrcReader`` is the ``testsrc:`` camera (``edgeline.video.FrameReader``).

numpy only: the daemon imports this module when a user asks for ``testsrc:``.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from edgeline.errors import EdgelineError
from edgeline.video import CameraError, CameraSpec, Frame, Pixel

__all__ = [
    "BITS",
    "CLASSES",
    "Scene",
    "SceneError",
    "TestsrcReader",
    "barcode_block",
    "read_frame_number",
    "testsrc_options",
]

CLASSES = ("red", "green", "blue", "yellow", "magenta", "cyan", "orange", "white")
"""Class ``k`` of ``boxes()`` is the colour ``CLASSES[k]``; object ``n`` has class ``n % len(CLASSES)``."""
COLOURS = np.array(
    [[230, 30, 30], [30, 200, 40], [40, 60, 230], [235, 220, 30], [220, 40, 220], [30, 210, 220], [245, 140, 20],
     [245, 245, 245]],
    dtype=np.uint8,
)  # fmt: skip
DATA_BITS = 32
CHECK_BITS = 8
BITS = DATA_BITS + CHECK_BITS
"""Blocks in the barcode: the frame number (most significant bit first), then its CRC-8."""
MAX_BLOCK = 8
"""Barcode blocks are 8x8 (a JPEG block) when the frame is at least ``BITS * 8`` = 320 pixels wide, smaller below."""
MIN_WIDTH, MIN_HEIGHT = 160, 96
MAX_SIDE = 4096
MAX_OBJECTS = 64
MAX_FPS = 1000.0


class SceneError(EdgelineError):
    """A scene that cannot be made: a size, rate or count out of range (the message names which)."""


def barcode_block(width: int) -> int:
    """The side of a barcode block in a frame ``width`` pixels wide (4 to 8)."""
    return min(MAX_BLOCK, width // BITS)


def _crc8(value: int) -> int:
    """CRC-8 (polynomial 0x07, initial 0xFF) of the 4 big-endian bytes of ``value``: an all-black or all-white
    strip, or a picture that happens to be there, fails it."""
    crc = 0xFF
    for byte in value.to_bytes(4, "big"):
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _bits(number: int) -> np.ndarray:
    value = number % (1 << DATA_BITS)
    word = (value << CHECK_BITS) | _crc8(value)
    return np.array([(word >> (BITS - 1 - k)) & 1 for k in range(BITS)], dtype=np.uint8)


def read_frame_number(array: np.ndarray) -> int | None:
    """The frame number in the barcode of an (H, W, 3) RGB (or BGR: the blocks are grey) or (H, W) uint8 frame, as
    ``Scene.frame`` drew it; None when there is none (its CRC fails). Each block is read at its centre (the mean of
    its inner half), so compression that blurs the block edges does not change the answer."""
    if array.ndim not in (2, 3) or array.shape[0] < MIN_HEIGHT or array.shape[1] < MIN_WIDTH:
        return None
    block = barcode_block(int(array.shape[1]))
    strip = array[:block, : BITS * block].astype(np.float32)
    if strip.ndim == 3:
        strip = strip.mean(axis=2)
    inner = strip.reshape(block, BITS, block)[block // 4 : block - block // 4, :, block // 4 : block - block // 4]
    bits = inner.mean(axis=(0, 2)) > 127.5
    word = 0
    for bit in bits:
        word = (word << 1) | int(bit)
    value, check = word >> CHECK_BITS, word & 0xFF
    return value if _crc8(value) == check else None


@dataclass(frozen=True)
class _Shape:
    class_index: int
    disc: bool
    width: int
    height: int
    x0: float
    y0: float
    vx: float
    """pixels per second"""
    vy: float


def _bounce(start: float, speed: float, time_s: float, span: int) -> int:
    """Where a point moving at ``speed`` from ``start`` is after ``time_s``, reflected at 0 and ``span``."""
    if span <= 0:
        return 0
    travelled = (start + speed * time_s) % (2 * span)
    return int(travelled if travelled <= span else 2 * span - travelled)


class Scene:
    """``objects`` shapes (rectangles and discs, alternately, in the colours of ``CLASSES``) bouncing at different
    speeds over a gradient with a soft checker texture, below the barcode strip. Pure: ``frame(i)`` depends on
    (size, fps, objects, seed, i) only, and draws by slicing over a precomputed background."""

    def __init__(self, width: int = 640, height: int = 480, fps: float = 30.0, objects: int = 3, seed: int = 0) -> None:
        if not (MIN_WIDTH <= width <= MAX_SIDE and MIN_HEIGHT <= height <= MAX_SIDE):
            raise SceneError(
                f"scene size {width}x{height}: width {MIN_WIDTH}-{MAX_SIDE} and height {MIN_HEIGHT}-{MAX_SIDE} pixels"
            )
        if not (isinstance(fps, (int, float)) and math.isfinite(fps) and 0 < fps <= MAX_FPS):
            raise SceneError(f"scene rate {fps}: frames per second above 0, at most {MAX_FPS:g}")
        if not 0 <= objects <= MAX_OBJECTS:
            raise SceneError(f"scene objects {objects}: 0 to {MAX_OBJECTS}")
        if not 0 <= seed < 2**32:
            raise SceneError(f"scene seed {seed}: 0 to {2**32 - 1}")
        self.width, self.height, self.fps, self.objects, self.seed = width, height, float(fps), objects, seed
        self.block = barcode_block(width)
        self.top = 2 * self.block
        """Shapes stay below this row: the barcode and a gap, so a codec's blur of a shape never reaches it."""
        self._background = self._make_background()
        rng = np.random.default_rng(seed)
        side = min(width, height - self.top)
        scale = width / 640
        self._shapes: list[_Shape] = []
        for n in range(objects):
            w, h = (int(side * rng.uniform(0.12, 0.25)) for _ in range(2))
            disc = n % 2 == 1
            if disc:
                h = w
            speed = rng.uniform(60, 180) * scale
            angle = rng.uniform(0.15, 1.4) + (math.pi / 2) * (n % 4)
            self._shapes.append(
                _Shape(
                    class_index=n % len(CLASSES),
                    disc=disc,
                    width=max(4, w),
                    height=max(4, h),
                    x0=rng.uniform(0, max(1, width - w)),
                    y0=rng.uniform(0, max(1, height - self.top - h)),
                    vx=speed * math.cos(angle),
                    vy=speed * math.sin(angle),
                )
            )
        self._masks = {
            (shape.width, shape.height): self._disc_mask(shape.width, shape.height)
            for shape in self._shapes
            if shape.disc
        }

    def _make_background(self) -> np.ndarray:
        y, x = np.mgrid[0 : self.height, 0 : self.width]
        checker = (((x // 64) + (y // 64)) % 2).astype(np.float32) * 24
        background = np.empty((self.height, self.width, 3), dtype=np.uint8)
        background[..., 0] = (40 + 120 * x / self.width + checker).astype(np.uint8)
        background[..., 1] = (40 + 120 * y / self.height + checker).astype(np.uint8)
        background[..., 2] = (110 + checker - 40 * x / self.width).astype(np.uint8)
        return background

    @staticmethod
    def _disc_mask(width: int, height: int) -> np.ndarray:
        y, x = np.mgrid[0:height, 0:width]
        distance = ((x + 0.5 - width / 2) / (width / 2)) ** 2 + ((y + 0.5 - height / 2) / (height / 2)) ** 2
        return np.asarray(distance <= 1.0)

    def boxes(self, index: int) -> list[tuple[int, int, int, int, int]]:
        """Every shape of frame ``index`` as (class_index, x1, y1, x2, y2), in drawing order (a later shape may
        cover an earlier one)."""
        time_s = index / self.fps
        found = []
        for shape in self._shapes:
            x = _bounce(shape.x0, shape.vx, time_s, self.width - shape.width)
            y = self.top + _bounce(shape.y0, shape.vy, time_s, self.height - self.top - shape.height)
            found.append((shape.class_index, x, y, x + shape.width, y + shape.height))
        return found

    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` (0 or more): (height, width, 3) uint8 RGB, a new array."""
        if index < 0:
            raise SceneError(f"frame {index}: frame numbers start at 0")
        array = self._background.copy()
        for shape, (class_index, x1, y1, x2, y2) in zip(self._shapes, self.boxes(index), strict=True):
            region = array[y1:y2, x1:x2]
            if shape.disc:
                region[self._masks[(shape.width, shape.height)]] = COLOURS[class_index]
            else:
                region[:] = COLOURS[class_index]
        block = self.block
        strip = np.repeat(_bits(index) * 255, block).astype(np.uint8)
        array[:block, : BITS * block] = strip[np.newaxis, :, np.newaxis]
        return array


# -- the testsrc: camera -------------------------------------------------------------------------------------------

TESTSRC_OPTIONS = ("size", "rate", "objects", "frames", "seed")
MAX_FRAMES = 2**31


@dataclass(frozen=True)
class TestsrcOptions:
    width: int = 640
    height: int = 480
    rate: float = 30.0
    objects: int = 3
    seed: int = 0
    frames: int | None = None
    """A finite replay of this many frames, unpaced; None: live, paced at ``rate``."""


def _option_int(name: str, text: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise CameraError(f"testsrc: {name}={text}: a whole number from {low} to {high}", reason="unsupported")
    return value


def testsrc_options(options: dict[str, str]) -> TestsrcOptions:
    """``testsrc:``'s query options, checked: size=WxH, rate=FPS, objects=N, frames=N, seed=N."""
    unknown = sorted(set(options) - set(TESTSRC_OPTIONS))
    if unknown:
        raise CameraError(
            f"testsrc: unknown option {', '.join(unknown)}: valid are {', '.join(TESTSRC_OPTIONS)}",
            reason="unsupported",
        )
    width, height = TestsrcOptions.width, TestsrcOptions.height
    if "size" in options:
        parts = options["size"].lower().split("x")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise CameraError(f"testsrc: size={options['size']}: WIDTHxHEIGHT, e.g. 640x480", reason="unsupported")
        width, height = _option_int("size", parts[0], 1, MAX_SIDE), _option_int("size", parts[1], 1, MAX_SIDE)
    rate = TestsrcOptions.rate
    if "rate" in options:
        try:
            rate = float(options["rate"])
        except ValueError:
            rate = -1.0
        if not (math.isfinite(rate) and 0 < rate <= MAX_FPS):
            raise CameraError(
                f"testsrc: rate={options['rate']}: frames per second above 0, at most {MAX_FPS:g}", reason="unsupported"
            )
    frames = options.get("frames")
    return TestsrcOptions(
        width=width,
        height=height,
        rate=rate,
        objects=_option_int("objects", options["objects"], 0, MAX_OBJECTS) if "objects" in options else 3,
        seed=_option_int("seed", options["seed"], 0, 2**32 - 1) if "seed" in options else 0,
        frames=None if frames is None else _option_int("frames", frames, 0, MAX_FRAMES),
    )


class TestsrcReader:
    """The ``testsrc:`` camera: a ``Scene`` as an ``edgeline.video.FrameReader``.

    Live (no ``frames=``): paced at ``rate`` by the monotonic clock from the moment it was opened; ``read()``
    returns the newest frame by the clock, waiting for the next one if the newest was already read, so a late reader
    skips frames as a real camera's does (``skipped`` counts them). Frame ``index`` is the frame's number in the
    stream (its slot on the clock, the number in its barcode): contiguous when the reader keeps up, with a gap where
    it skipped. With ``frames=N``: frames 0 to N-1, each once, unpaced, then None."""

    __test__ = False  # not a pytest test class, whatever its name says

    def __init__(self, spec: CameraSpec) -> None:
        options = testsrc_options(spec.options)
        try:
            self.scene = Scene(options.width, options.height, options.rate, options.objects, options.seed)
        except SceneError as exc:
            raise CameraError(f"testsrc: {exc}", reason="unsupported") from None
        self.spec = spec
        self.width, self.height = options.width, options.height
        self.pixel: Pixel = "rgb"
        self.corrupt = 0
        self.skipped = 0
        self.rate = options.rate
        self.frames = options.frames
        self._next = 0
        self._closed = threading.Event()
        self._start = time.monotonic()

    def read(self) -> Frame | None:
        """The next frame (live: the newest by the clock, waiting at most one frame interval); None once a finite
        source has given its last frame, or once closed."""
        if self._closed.is_set():
            return None
        if self.frames is not None:
            if self._next >= self.frames:
                return None
            index = self._next
        else:
            due = self._start + self._next / self.rate
            wait = due - time.monotonic()
            if wait > 0 and self._closed.wait(wait):  # close() from another thread ends the wait at once
                return None
            newest = int((time.monotonic() - self._start) * self.rate)
            index = max(self._next, newest)
            self.skipped += index - self._next
        array = self.scene.frame(index)
        self._next = index + 1
        return Frame(array, "rgb", index, time.monotonic(), source_time=index / self.rate)

    def close(self) -> None:
        self._closed.set()
