"""Frames from cameras and video: what a camera source reads, as numpy arrays, with every wait bounded.

    parse_camera("door=rtsp://user:pw@10.0.0.5/stream", index=0) -> CameraSpec       (raises CameraError)
    open_reader(spec, open_timeout_s=10, read_timeout_s=5) -> FrameReader     (raises CameraError)
    reader.read() -> Frame | None      (None: a finite source ended; raises CameraError on a timeout or a broken stream)
    reader.close()                     (idempotent; call it from the thread that reads)

One reader class per kind of source: PyAV (the ``camera`` extra, imported only here, when a reader is opened) reads
files, RTSP, HTTP (MJPEG, HLS) and V4L2 devices; a folder or glob of images is decoded file by file with PyAV;
``picamera2:N`` goes through the system's picamera2 (Raspberry Pi OS); ``testsrc:`` is ``edgeline.sim.scene``'s,
resolved by name so that nothing imports ``edgeline.sim`` until asked.

Deadlines: an open fails within ``open_timeout_s`` (plus a quarter second) whatever the server does: PyAV bounds its
two steps (connect and headers, then stream probing) each by the open timeout, so the open runs in a short-lived
thread that is left behind when the deadline passes (it ends by PyAV's own bound and closes what it opened). A read
of the library (one socket read) fails with ``timeout`` when nothing came within ``read_timeout_s`` (a frozen server);
``read()`` as a whole fails with ``timeout`` when no frame came within ``stall_s`` (default ``read_timeout_s``:
data that never makes a frame, such as garbage, or a stream of another kind only). Undecodable packets and frames
are counted in ``reader.corrupt`` and skipped (each takes its frame number); ``MAX_CORRUPT_IN_ROW`` of them in a row
give up.
The process's end: PyAV calls back into Python from inside FFmpeg (its timeout's interrupt callback) while it opens,
reads or closes a stream, so such a call still running once the interpreter has finalized crashes the process
(SIGSEGV in ``PyGILState_Ensure``). Every such call goes through ``LIBRARY_CALLS``; a process leaving closes it
(``leave_library``: no new call enters, the running ones are given a moment) and, if one is still inside, ends with
``os._exit`` after its own orderly stop (``edgeline run`` does).
A URL's credentials (``user:password@``, and query values such as ``password=``) are in ``CameraSpec.target`` only:
every text meant for people (``shown``, exceptions, logs) has ``***`` in their place.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import numpy as np

from edgeline.errors import CAMERA_REASONS, BackendUnavailableError, CameraError
from edgeline.registry import resolve

__all__ = [
    "CAMERA_REASONS",
    "CameraError",
    "CameraSpec",
    "Frame",
    "FrameReader",
    "camera_extra",
    "cameras_seen",
    "leave_library",
    "open_reader",
    "parse_camera",
    "v4l2_open_args",
]

log = logging.getLogger("edgeline.video")

Kind = Literal["file", "images", "rtsp", "http", "v4l2", "picamera2", "testsrc"]
Pixel = Literal["rgb", "bgr", "gray"]

INSTALL = "pip install 'edgeline[camera]'"
PICAMERA2_INSTALL = (
    "on Raspberry Pi OS: sudo apt install python3-picamera2, and a virtual environment made with "
    "--system-site-packages (the PyPI wheel has no libcamera)"
)
READERS = {"testsrc": "edgeline.sim.scene:TestsrcReader"}
"""Readers from other folders, by kind: imported only when a camera of that kind is opened."""
VIDEO_SUFFIXES = frozenset({
    ".mp4", ".m4v", ".mkv", ".avi", ".mov", ".webm", ".ts", ".m2ts", ".mts", ".h264", ".264", ".h265", ".265", ".hevc",
    ".mjpeg", ".mjpg", ".mpg", ".mpeg", ".ogv", ".flv", ".wmv", ".3gp", ".y4m", ".nut",
})  # fmt: skip
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pnm"})
FORMS = (
    "a video file (.mp4, .mkv, .avi, ...), a folder or glob of images (frames/*.jpg), rtsp:// or rtsps://, "
    "http:// or https:// (MJPEG, HLS), /dev/videoN or v4l2:///dev/videoN (?width=&height=&fps=&format=mjpeg|yuyv), "
    "picamera2:N (?width=&height=&fps=), testsrc: (?size=WxH&rate=&objects=&frames=)"
)
OPTIONS: dict[str, tuple[str, ...]] = {
    "v4l2": ("width", "height", "fps", "format"),
    "picamera2": ("width", "height", "fps"),
    "testsrc": ("size", "rate", "objects", "frames", "seed"),
}
V4L2_FORMATS = {"mjpeg": "mjpeg", "yuyv": "yuyv422"}
"""``?format=`` -> FFmpeg's v4l2 ``input_format``."""
MAX_NAME = 128
MAX_CORRUPT_IN_ROW = 100
"""Undecodable packets or frames in a row after which a stream is given up (``corrupt``)."""
OPEN_GRACE_S = 0.25
SECRET_KEYS = re.compile(r"pass|pwd|token|secret|key|auth|sig", re.IGNORECASE)
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


class _LibraryCalls:
    """The calls into PyAV that can call back into Python from FFmpeg (see the module): counted, and refused once
    the process is leaving."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._closed = False

    @contextlib.contextmanager
    def call(self, name: str) -> Iterator[None]:
        with self._changed:
            if self._closed:
                raise CameraError(f"camera {name}: the process is stopping", reason="ended")
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    def close(self, timeout_s: float) -> int:
        """No call enters from now on; the number still running after at most ``timeout_s``."""
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: self._running == 0, timeout_s)
            return self._running


LIBRARY_CALLS = _LibraryCalls()


def leave_library(timeout_s: float) -> int:
    """For a process about to exit: no camera enters PyAV again; how many calls are still inside it after at most
    ``timeout_s`` (an open or a read against a server that does not answer, bounded by its own deadline). Non-zero:
    the process must end with ``os._exit`` once its own state is safe, not through the interpreter's shutdown."""
    return LIBRARY_CALLS.close(timeout_s)


class FrameReader(Protocol):
    width: int
    height: int
    pixel: Pixel
    corrupt: int
    """Frames or packets the decoder refused so far (each counted, the stream goes on)."""

    def read(self) -> Frame | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class CameraSpec:
    name: str
    """The device in topics and answers (``cam0`` when the user gave none)."""
    kind: Kind
    target: str
    """What the library opens: a path, a URL (credentials included: never logged), a device, a camera number."""
    shown: str
    """``target`` as logs, status, metrics and answers may show it: credentials replaced by ``***``."""
    live: bool
    """Live sources keep the latest frame only; a file or a folder of images is a replay (every frame, in order)."""
    options: dict[str, str] = field(default_factory=dict)
    """Query options (``?width=640&height=480&fps=30&format=mjpeg`` for V4L2; testsrc's size/rate/objects)."""


@dataclass(frozen=True)
class Frame:
    array: np.ndarray
    """(height, width, 3) uint8 in ``pixel`` order, or (height, width) uint8 for gray."""
    pixel: Pixel
    index: int
    """The frame's number in this opened stream: 0, 1, 2, ... contiguous (a frame that failed to decode still takes
    its number)."""
    captured: float
    """``time.monotonic()`` when the frame was available (decoded, or picamera2's sensor timestamp mapped)."""
    source_time: float | None = None
    """The source's own timestamp in seconds (presentation time, sensor time), where it has one."""


# -- parsing ---------------------------------------------------------------------------------------------------------


def redact(text: str) -> str:
    """``text`` with a URL's ``user:password@`` replaced by ``***@`` (any text: also one that is not a URL)."""
    return _USERINFO.sub("***@", text)


def _shown_url(url: str) -> str:
    parts = urlsplit(url)
    query = parts.query
    if query:
        pairs = [part.partition("=") for part in query.split("&")]
        query = "&".join(k + s + ("***" if s and SECRET_KEYS.search(k) else v) for k, s, v in pairs)
    return redact(urlunsplit(parts._replace(query=query)))


def _unsupported(text: str, why: str) -> CameraError:
    return CameraError(f"camera {redact(text)!r}: {why}; valid forms: [NAME=]SOURCE, SOURCE being {FORMS}",
                       reason="unsupported")  # fmt: skip


def _split_name(text: str, index: int) -> tuple[str, str]:
    head, eq, rest = text.partition("=")
    if not eq or any(c in head for c in ":/?\\") or Path(text).exists():
        return f"cam{index}", text
    bad = [c for c in head if c in "/+#" or c.isspace() or not c.isprintable()]
    if not head or len(head) > MAX_NAME or bad:
        raise _unsupported(text, f"NAME must be 1 to {MAX_NAME} characters without / + # or spaces (a topic level)")
    return head, rest


def _options(text: str, kind: str, query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in OPTIONS[kind]:
            raise _unsupported(text, f"{kind} takes the options {', '.join(OPTIONS[kind])}, not {key!r}")
        if key in options:
            raise _unsupported(text, f"option {key!r} given twice")
        options[key] = value
    for key, value in options.items():
        if key == "format":
            if value not in V4L2_FORMATS:
                raise _unsupported(text, f"format must be one of {', '.join(V4L2_FORMATS)}, not {value!r}")
        elif key == "size":
            if not re.fullmatch(r"[1-9][0-9]{0,4}x[1-9][0-9]{0,4}", value):
                raise _unsupported(text, f"size must be WIDTHxHEIGHT (640x480), not {value!r}")
        elif not re.fullmatch(r"[1-9][0-9]{0,5}", value) and not (key in ("fps", "rate") and _positive(value)):
            raise _unsupported(text, f"{key} must be a positive number, not {value!r}")
    if ("width" in options) != ("height" in options):
        raise _unsupported(text, "width and height go together")
    return options


def _positive(value: str) -> bool:
    try:
        number = float(value)
    except ValueError:
        return False
    return 0 < number <= 1000


def parse_camera(text: str, index: int) -> CameraSpec:
    """``[NAME=]SOURCE`` as a camera: its kind, what opens it, how it may be shown. Raises ``CameraError``
    (``unsupported``) naming the text, credentials hidden, and the valid forms."""
    if not isinstance(text, str) or not text.strip():
        raise _unsupported(str(text), "empty")
    name, source = _split_name(text.strip(), index)
    if not source:
        raise _unsupported(text, "no SOURCE after NAME=")
    scheme = source.partition(":")[0].lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", source) else ""
    if scheme in ("rtsp", "rtsps", "http", "https"):
        if not urlsplit(source).hostname:
            raise _unsupported(text, "a URL without a host")
        kind: Kind = "rtsp" if scheme.startswith("rtsp") else "http"
        return CameraSpec(name, kind, source, _shown_url(source), live=True)
    if scheme == "v4l2" or source.startswith("/dev/video"):
        parts = urlsplit(source) if scheme else urlsplit("v4l2://" + source)
        if parts.netloc or not re.fullmatch(r"/dev/[\w./-]+", parts.path):
            raise _unsupported(text, "a V4L2 device is /dev/videoN or v4l2:///dev/videoN")
        return CameraSpec(name, "v4l2", parts.path, parts.path, True, _options(text, "v4l2", parts.query))
    if scheme == "picamera2":
        number, _, query = source[len("picamera2:") :].partition("?")
        if not number.isdigit() or len(number) > 2:
            raise _unsupported(text, "picamera2 takes a camera number: picamera2:0")
        options = _options(text, "picamera2", query)
        return CameraSpec(name, "picamera2", str(int(number)), f"picamera2:{int(number)}", True, options)
    if scheme == "testsrc":
        rest, _, query = source[len("testsrc:") :].partition("?")
        if rest.strip("/"):
            raise _unsupported(text, "testsrc takes options only: testsrc:?size=640x480&rate=30&objects=3")
        options = _options(text, "testsrc", query)
        return CameraSpec(name, "testsrc", source, source, "frames" not in options, options)
    if scheme and len(scheme) > 1:
        raise _unsupported(text, f"unknown scheme {scheme + ':'!r}")
    return _path_spec(text, name, source)


def _path_spec(text: str, name: str, source: str) -> CameraSpec:
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if any(c in source for c in "*?["):
        return CameraSpec(name, "images", str(path), str(path), live=False)
    if path.is_dir():
        return CameraSpec(name, "images", str(path), str(path), live=False)
    if suffix in IMAGE_SUFFIXES:
        return CameraSpec(name, "images", str(path), str(path), live=False)
    if path.is_file() or suffix in VIDEO_SUFFIXES:
        return CameraSpec(name, "file", str(path), str(path), live=False)
    if path.exists():
        raise _unsupported(text, "not a regular file, a folder or a device")
    raise _unsupported(text, "no such file or folder, and no known scheme")


# -- opening ---------------------------------------------------------------------------------------------------------


def open_reader(
    spec: CameraSpec, *, open_timeout_s: float, read_timeout_s: float, stall_s: float | None = None
) -> FrameReader:
    """The reader of ``spec``'s kind, opened: ``width``, ``height`` and ``pixel`` are the source's now (they can differ
    at each open). Raises ``CameraError``."""
    if not (open_timeout_s > 0 and read_timeout_s > 0 and (stall_s is None or stall_s > 0)):
        raise ValueError(f"timeouts must be positive: open {open_timeout_s}, read {read_timeout_s}, stall {stall_s}")
    if spec.kind in READERS:
        try:
            reader_class = resolve(READERS, spec.kind, "camera source", BackendUnavailableError)
        except BackendUnavailableError as exc:
            raise CameraError(f"camera {spec.name}: {exc}", reason="missing-extra") from exc
        reader: FrameReader = reader_class(spec)
        return reader
    if spec.kind == "images":
        return _ImagesReader(spec, read_timeout_s)
    if spec.kind == "picamera2":
        return _Picamera2Reader(spec, open_timeout_s, read_timeout_s)
    return _AvReader(spec, open_timeout_s, read_timeout_s, stall_s)


def _av(spec: CameraSpec) -> Any:
    try:
        import av
    except ImportError as exc:
        raise CameraError(
            f"camera {spec.name} ({spec.shown}) needs the camera extra (PyAV), which is not installed: {INSTALL}",
            reason="missing-extra",
        ) from exc
    return av


def v4l2_open_args(spec: CameraSpec) -> tuple[str, str, dict[str, str]]:
    """What ``av.open`` takes for a V4L2 device: (device, ``"v4l2"``, FFmpeg's options from ``?width=...``)."""
    options: dict[str, str] = {}
    if "width" in spec.options:
        options["video_size"] = f"{int(spec.options['width'])}x{int(spec.options['height'])}"
    if "fps" in spec.options:
        options["framerate"] = spec.options["fps"]
    if "format" in spec.options:
        options["input_format"] = V4L2_FORMATS[spec.options["format"]]
    return spec.target, "v4l2", options


def _library_reason(exc: BaseException) -> str:
    """An exception's own reason without the URL the library puts beside it (it may carry credentials)."""
    strerror = getattr(exc, "strerror", None)
    return redact(str(strerror)) if strerror else type(exc).__name__


def _open_container(av: Any, spec: CameraSpec, open_timeout_s: float, read_timeout_s: float) -> Any:
    """``av.open`` for ``spec``, failed within ``open_timeout_s`` + ``OPEN_GRACE_S`` (see the module)."""
    target, form = spec.target, None
    container_options: dict[str, str] = {}
    if spec.kind == "v4l2":
        target, form, container_options = v4l2_open_args(spec)
    if spec.kind == "rtsp":
        container_options["rtsp_transport"] = "tcp"
        # RTSP names its streams and codecs in its SDP, so nothing needs probing: by default av.open reads about a
        # second of the stream to probe it, and those frames then come out as a burst a second old. Measured on
        # loopback (sim camera, 640x480 at 30 fps): open 0.96 s -> 0.08 s for H.264, 0.70 -> 0.08 s for MJPEG; the
        # first frame's render -> decode age 941 -> 54 ms and 672 -> 53 ms.
        container_options.update(analyzeduration="0", probesize="32")
    # fflags=nobuffer and flags=low_delay were measured and left out: on loopback (sim camera, 640x480 at 30 fps)
    # render -> decoded p50 stayed 43-44 ms for H.264 over RTSP, 7-8 ms for MJPEG, with or without them; the thread
    # type is what counts (see _AvReader).
    outcome: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        try:
            with LIBRARY_CALLS.call(spec.name):
                container = av.open(target, format=form, container_options=container_options,
                                    timeout=(open_timeout_s, read_timeout_s))  # fmt: skip
        except BaseException as exc:
            outcome["error"] = exc
        else:
            outcome["container"] = container
        with lock:
            done.set()
            if outcome.get("abandoned") and "container" in outcome:
                _close_quietly(outcome["container"], spec.name)

    began = time.monotonic()
    threading.Thread(target=run, name=f"open camera {spec.name}", daemon=True).start()
    finished = done.wait(open_timeout_s + OPEN_GRACE_S)
    with lock:
        if not finished and not done.is_set():
            outcome["abandoned"] = True
            raise CameraError(f"camera {spec.name}: {spec.shown} did not open within {open_timeout_s:g} s",
                              reason="timeout")  # fmt: skip
    if "container" in outcome:
        return outcome["container"]
    exc = outcome["error"]
    if isinstance(exc, CameraError):  # the process is stopping
        raise exc
    if isinstance(exc, av.ExitError) or time.monotonic() - began >= open_timeout_s:
        raise CameraError(f"camera {spec.name}: {spec.shown} did not open within {open_timeout_s:g} s",
                          reason="timeout") from None  # fmt: skip
    if spec.kind in ("file", "v4l2") and isinstance(exc, FileNotFoundError):
        raise CameraError(f"camera {spec.name}: no such {spec.kind}: {spec.shown}", reason="unreachable") from None
    if spec.kind == "file" and isinstance(exc, av.FFmpegError) and not isinstance(exc, OSError):
        raise CameraError(f"camera {spec.name}: {spec.shown} is not a video ({_library_reason(exc)})",
                          reason="not-a-video") from None  # fmt: skip
    raise CameraError(f"camera {spec.name}: cannot open {spec.shown}: {_library_reason(exc)}",
                      reason="unreachable") from None  # fmt: skip


def _close_quietly(thing: Any, name: str) -> None:
    try:
        with LIBRARY_CALLS.call(name):  # an RTSP close says TEARDOWN, under the interrupt callback
            thing.close()
    except CameraError:  # the process is leaving: what was not closed goes with it
        pass
    except Exception as exc:  # closing a broken stream may fail in the library: it is closed as far as we care
        log.debug("closing a camera stream: %s", _library_reason(exc))


def _pixel_of(format_name: str | None) -> Pixel:
    return "gray" if format_name and format_name.startswith("gray") else "rgb"


def _array(frame: Any, pixel: Pixel) -> np.ndarray:
    array: np.ndarray = frame.to_ndarray(format="gray" if pixel == "gray" else "rgb24")
    return array


class _AvReader:
    """Files, RTSP, HTTP and V4L2 through PyAV: one video stream, decoded packet by packet."""

    def __init__(self, spec: CameraSpec, open_timeout_s: float, read_timeout_s: float, stall_s: float | None = None):
        self.spec = spec
        self._av = av = _av(spec)
        if spec.kind == "file" and not Path(spec.target).is_file():  # a FIFO would block the open: never opened
            what = "not a regular file" if Path(spec.target).exists() else "no such file"
            raise CameraError(f"camera {spec.name}: {what}: {spec.shown}", reason="unreachable")
        self._container = _open_container(av, spec, open_timeout_s, read_timeout_s)
        self._read_timeout_s = read_timeout_s
        self._stall_s = read_timeout_s if stall_s is None else stall_s
        self._closed = False
        if not self._container.streams.video:
            self.close()
            what, reason = ("is not a video", "not-a-video") if spec.kind == "file" else ("has no video", "unreachable")
            raise CameraError(f"camera {spec.name}: {spec.shown} {what} (no video stream)", reason=reason)
        self._stream = stream = self._container.streams.video[0]
        # Frame threads hold about two frames back (measured here on loopback RTSP H.264, render -> decoded p50: 107
        # ms with AUTO, 41 ms with SLICE): a live stream decodes with slice threads only; a replay, where only
        # throughput counts, with both.
        stream.thread_type = "SLICE" if spec.live else "AUTO"
        context = stream.codec_context
        self.width = int(context.width or 0)
        self.height = int(context.height or 0)
        self.pixel: Pixel = _pixel_of(getattr(context.format, "name", None))
        self.corrupt = 0
        self._index = 0
        self._in_row = 0
        self._pending: deque[Any] = deque()
        self._packets: Iterator[Any] = self._container.demux(stream)
        self._ended = False
        if not (self.width and self.height):
            self._learn_size(open_timeout_s)

    def _learn_size(self, open_timeout_s: float) -> None:
        """RTP/JPEG names its size in each frame, not in its SDP, and RTSP is opened without probing: the first frame
        is decoded now, within the open's deadline, and kept for the first ``read``."""
        deadline = time.monotonic() + open_timeout_s
        try:
            while not self._pending and not self._ended:
                if time.monotonic() > deadline:
                    raise CameraError(f"camera {self.spec.name}: {self.spec.shown} opened but sent no frame within "
                                      f"{open_timeout_s:g} s", reason="timeout")  # fmt: skip
                self._next_packet()
        except CameraError:
            self.close()
            raise
        if self._pending:
            first = self._pending[0]
            self.width, self.height = int(first.width), int(first.height)
            self.pixel = _pixel_of(first.format.name)

    def read(self) -> Frame | None:
        if self._closed:
            raise CameraError(f"camera {self.spec.name}: read after close", reason="ended")
        deadline = time.monotonic() + self._stall_s
        while not self._pending:
            if self._ended:
                if self.spec.live:
                    raise CameraError(f"camera {self.spec.name}: {self.spec.shown} ended", reason="ended")
                return None
            if time.monotonic() > deadline:
                raise self._timeout(stalled=True)
            self._next_packet()
        return self._frame(self._pending.popleft())

    def _next_packet(self) -> None:
        av = self._av
        began = time.monotonic()
        try:
            with LIBRARY_CALLS.call(self.spec.name):
                packet = next(self._packets)
            if self.spec.live and time.monotonic() - began >= self._read_timeout_s:
                # The demuxer hit its read deadline, yet returned a packet: what H.264's parser held back, which
                # libavformat hands out instead of the error (the next read would wait a whole deadline more). A
                # frame that old is not news: the source is stalled now.
                raise av.ExitError(0, "read deadline")
        except StopIteration:
            self._ended = True
            return
        except av.ExitError:
            raise self._timeout() from None
        except (av.FFmpegError, OSError) as exc:  # a broken connection, or a file that breaks off mid-way
            self._ended = True
            if self.spec.live:
                raise CameraError(f"camera {self.spec.name}: {self.spec.shown} broke off: {_library_reason(exc)}",
                                  reason="ended") from None  # fmt: skip
            self._refused()
            return
        if packet.is_corrupt:  # the demuxer says its bytes are incomplete or damaged
            self._refused()
            return
        try:
            frames = packet.decode()
        except av.FFmpegError:
            self._refused()
            return
        for frame in frames:
            if frame.is_corrupt:
                self._refused()
            else:
                self._pending.append(frame)

    def _refused(self) -> None:
        self.corrupt += 1
        self._index += 1
        self._in_row += 1
        if self._in_row >= MAX_CORRUPT_IN_ROW:
            raise CameraError(f"camera {self.spec.name}: {self.spec.shown}: {self._in_row} undecodable packets in a "
                              "row", reason="corrupt")  # fmt: skip

    def _timeout(self, stalled: bool = False) -> CameraError:
        if stalled:
            return CameraError(f"camera {self.spec.name}: {self.spec.shown} sent data but no frame for "
                               f"{self._stall_s:g} s", reason="timeout")  # fmt: skip
        return CameraError(f"camera {self.spec.name}: nothing from {self.spec.shown} within "
                           f"{self._read_timeout_s:g} s", reason="timeout")  # fmt: skip

    def _frame(self, decoded: Any) -> Frame:
        self._in_row = 0
        pixel = _pixel_of(decoded.format.name)
        array = _array(decoded, pixel)
        self.height, self.width = int(array.shape[0]), int(array.shape[1])
        self.pixel = pixel
        index, self._index = self._index, self._index + 1
        return Frame(array, pixel, index, time.monotonic(), decoded.time)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if getattr(self, "_packets", None) is not None:
            _close_quietly(self._packets, self.spec.name)
        _close_quietly(self._container, self.spec.name)


class _ImagesReader:
    """A folder (sorted by name) or a glob of images, each decoded with PyAV; a file that is not one is counted in
    ``corrupt`` (it takes its frame number) and named in the log."""

    def __init__(self, spec: CameraSpec, read_timeout_s: float):
        self.spec = spec
        self._av = _av(spec)
        self._read_timeout_s = read_timeout_s
        source = Path(spec.target)
        names = sorted(glob.glob(spec.target)) if not source.is_dir() else sorted(str(p) for p in source.iterdir())
        self._files = deque(p for p in names if Path(p).is_file() and not Path(p).name.startswith("."))
        if not self._files:
            raise CameraError(f"camera {spec.name}: no image files in {spec.shown}", reason="unreachable")
        self.corrupt = 0
        self._index = 0
        self._first: Frame | None = None
        self._first = self._next()
        if self._first is None:
            raise CameraError(f"camera {spec.name}: no file of {spec.shown} is an image", reason="not-a-video")
        self.height, self.width = int(self._first.array.shape[0]), int(self._first.array.shape[1])
        self.pixel: Pixel = self._first.pixel

    def _next(self) -> Frame | None:
        deadline = time.monotonic() + self._read_timeout_s
        while self._files:
            path = self._files.popleft()
            index, self._index = self._index, self._index + 1
            try:
                with LIBRARY_CALLS.call(self.spec.name), self._av.open(path, timeout=self._read_timeout_s) as container:
                    decoded = next(container.decode(video=0))
                    pixel = _pixel_of(decoded.format.name)
                    return Frame(_array(decoded, pixel), pixel, index, time.monotonic())
            except (self._av.FFmpegError, OSError, StopIteration, IndexError) as exc:
                self.corrupt += 1
                log.warning("camera %s: %s skipped: not an image (%s)", self.spec.name, path, _library_reason(exc))
            if time.monotonic() > deadline:
                raise CameraError(f"camera {self.spec.name}: no image decoded in {self._read_timeout_s:g} s",
                                  reason="timeout")  # fmt: skip
        return None

    def read(self) -> Frame | None:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        frame = self._next()
        if frame is not None:
            self.height, self.width, self.pixel = int(frame.array.shape[0]), int(frame.array.shape[1]), frame.pixel
        return frame

    def close(self) -> None:
        self._files.clear()
        self._first = None


class _Picamera2Reader:
    """A Raspberry Pi camera through the system's picamera2 (imported here, only when asked). Kept thin: the device
    part cannot run without a camera, and is tested against a fake of picamera2's API (tests/test_video.py)."""

    def __init__(self, spec: CameraSpec, open_timeout_s: float, read_timeout_s: float):
        self.spec = spec
        try:
            from picamera2 import Picamera2  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise CameraError(f"camera {spec.name} ({spec.shown}) needs picamera2: {PICAMERA2_INSTALL}",
                              reason="missing-extra") from exc  # fmt: skip
        self._read_timeout_s = read_timeout_s
        self.corrupt = 0
        self._index = 0
        self._camera: Any = None
        try:
            self._camera = camera = Picamera2(int(spec.target))
            # picamera2's "RGB888" is B,G,R in memory (its manual, "Image formats"; BENCHMARKS.md): the frames say bgr.
            main: dict[str, Any] = {"format": "RGB888"}
            if "width" in spec.options:
                main["size"] = (int(spec.options["width"]), int(spec.options["height"]))
            controls = {"FrameRate": float(spec.options["fps"])} if "fps" in spec.options else {}
            camera.configure(camera.create_video_configuration(main=main, controls=controls))
            camera.start()
        except Exception as exc:  # no such camera, busy, a size it cannot do: the library's own sentence
            self.close()
            raise CameraError(f"camera {spec.name}: cannot open {spec.shown}: {exc}", reason="unreachable") from None
        self.pixel: Pixel = "bgr"
        self._first: Frame | None = self._capture(open_timeout_s)
        self.height, self.width = int(self._first.array.shape[0]), int(self._first.array.shape[1])

    def _capture(self, timeout_s: float) -> Frame:
        try:
            request = self._camera.capture_request(wait=False).get_result(timeout=timeout_s)
        except Exception as exc:  # concurrent.futures.TimeoutError, or the camera's failure
            self.close()
            what = "no frame within" if "Timeout" in type(exc).__name__ else f"failed ({exc}) within"
            raise CameraError(f"camera {self.spec.name}: {self.spec.shown}: {what} {timeout_s:g} s",
                              reason="timeout") from None  # fmt: skip
        try:
            array = np.array(request.make_array("main"), dtype=np.uint8, copy=True)
            sensor_ns = request.get_metadata().get("SensorTimestamp")
        finally:
            request.release()
        captured, source_time = time.monotonic(), None
        if isinstance(sensor_ns, int):  # CLOCK_BOOTTIME in ns: its age now, taken off the monotonic clock
            source_time = sensor_ns / 1e9
            boot = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
            captured -= min(max(0.0, time.clock_gettime(boot) - source_time), 10.0)
        index, self._index = self._index, self._index + 1
        return Frame(array, "bgr", index, captured, source_time)

    def read(self) -> Frame | None:
        if self._camera is None:
            raise CameraError(f"camera {self.spec.name}: read after close", reason="ended")
        if self._first is not None:
            frame, self._first = self._first, None
            return frame
        frame = self._capture(self._read_timeout_s)
        self.height, self.width = int(frame.array.shape[0]), int(frame.array.shape[1])
        return frame

    def close(self) -> None:
        camera, self._camera = self._camera, None
        if camera is not None:
            for step in (camera.stop, camera.close):
                try:
                    step()
                except Exception as exc:  # a camera that never started cannot stop: closed as far as we care
                    log.debug("camera %s: %s", self.spec.name, exc)


# -- what this machine has -------------------------------------------------------------------------------------------


def cameras_seen(dev: Path = Path("/dev"), sysfs: Path = Path("/sys/class/video4linux")) -> list[dict[str, Any]]:
    """The V4L2 devices (``/dev/video*``, with their driver's name where sysfs gives it) and whether picamera2 can be
    imported (``edgeline doctor``). Nothing is opened."""
    seen: list[dict[str, Any]] = []
    numbered = (p for p in dev.glob("video*") if p.name[5:].isdigit())
    for device in sorted(numbered, key=lambda p: int(p.name[5:]))[:64]:
        entry: dict[str, Any] = {"kind": "v4l2", "source": str(device)}
        try:
            with open(sysfs / device.name / "name", "rb") as handle:
                entry["name"] = handle.read(256).decode("utf-8", "replace").strip()
        except OSError:
            pass
        seen.append(entry)
    picamera2 = importlib.util.find_spec("picamera2") is not None
    seen.append({"kind": "picamera2", "source": "picamera2:0", "importable": picamera2})
    return seen


def camera_extra() -> str | None:
    """PyAV's version when the camera extra is installed, else None (``edgeline doctor``)."""
    if importlib.util.find_spec("av") is None:
        return None
    try:
        return importlib.metadata.version("av")
    except importlib.metadata.PackageNotFoundError:
        return None
