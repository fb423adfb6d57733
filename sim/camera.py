"""``edgeline sim camera``: the synthetic scene (``edgeline.sim.scene``) served as a camera on loopback.

    edgeline sim camera --rtsp 8554 --codec h264 --http 8080 --size 640x480 --fps 30 --objects 3 --seed 0

prints one line per URL (``rtsp://127.0.0.1:8554/scene``, ``http://127.0.0.1:8080/scene.mjpg``), then a line saying
when each frame is rendered, and serves until SIGTERM or Ctrl-C. Without ``--rtsp`` and ``--http``, both, on free
ports. One thread renders frame N at ``T0 + N / fps`` on the monotonic clock (the newest by the clock: a render that
falls behind skips frames, as a camera does) and hands it to the two servers, each of which keeps only the newest:

- RTSP: Debian's GStreamer RTSP server in a child process run by the system Python (``sim/camera_rtsp.py``: a
  virtual environment has no ``gi``), fed raw RGB frames on its stdin by a writer thread of its own, so a frozen or
  slow child never holds up the renderer or the HTTP clients.
- HTTP MJPEG (``multipart/x-mixed-replace``, stdlib ``http.server``): a thread per client, which sends the newest
  JPEG when there is a new one (encoded once per frame for every client, only while someone watches) and gives up on
  a client whose socket takes no data for ``SEND_TIMEOUT_S``; at most ``MAX_CLIENTS`` at once. ``/scene.jpg`` is
  one frame.

Registering the command imports nothing heavy; running it imports numpy, and PyAV or Pillow for JPEG.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from edgeline.arguments import CommandParser, bounded_int
from edgeline.errors import EdgelineError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CameraOptions", "SimCamera", "camera_parser", "parse_size", "run_camera"]

HOST = "127.0.0.1"
RTSP_MOUNT = "/scene"
HTTP_PATH = "/scene.mjpg"
SNAPSHOT_PATH = "/scene.jpg"
BOUNDARY = "edgelineframe"
SYSTEM_PYTHON = "/usr/bin/python3"
"""Debian's Python, where ``python3-gi`` installs PyGObject."""
RTSP_PACKAGES = (
    "python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-rtsp gir1.2-gst-plugins-base-1.0 gstreamer1.0-plugins-good "
    "gstreamer1.0-plugins-bad"
)
RTSP_HINT = f"RTSP needs Debian's {RTSP_PACKAGES} (scripts/setup.sh installs them)"
CHILD_START_S = 10.0
CHILD_STOP_S = 3.0
SEND_TIMEOUT_S = 5.0
"""An HTTP client whose socket takes nothing for this long is dropped: a stopped reader costs only its own thread."""
SEND_BUFFER_BYTES = 256 * 1024
"""Per HTTP client (the kernel doubles it): without a bound, Linux grows a loopback send buffer to megabytes, which
a stopped reader would fill with seconds of stale frames before its send even blocks."""
FRAME_WAIT_S = 1.0
MAX_CLIENTS = 16
JPEG_QUALITY = 85
Codec = Literal["h264", "mjpeg"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CameraOptions:
    width: int = 640
    height: int = 480
    fps: float = 30.0
    objects: int = 3
    seed: int = 0
    codec: Codec = "h264"
    rtsp_port: int | None = 0
    """None: no RTSP server; 0: a free port."""
    http_port: int | None = 0
    """None: no HTTP server; 0: a free port."""


def parse_size(text: str) -> tuple[int, int]:
    """``640x480`` -> (640, 480); even sides (H.264 and JPEG's 4:2:0 halve them)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: WIDTHxHEIGHT, e.g. 640x480")
    width, height = int(parts[0]), int(parts[1])
    if width % 2 or height % 2:
        raise argparse.ArgumentTypeError(f"{text}: even width and height (4:2:0 video halves them)")
    return width, height


def _port(text: str) -> int:
    return bounded_int(0, 65535)(text)


class _Latest:
    """One slot: the newest item and its sequence number; readers wait (bounded) for a newer one."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.sequence = 0
        self.item: bytes | None = None

    def put(self, item: bytes) -> None:
        with self.changed:
            self.item = item
            self.sequence += 1
            self.changed.notify_all()

    def newer(self, seen: int, timeout: float) -> tuple[int, bytes | None]:
        with self.changed:
            self.changed.wait_for(lambda: self.sequence > seen, timeout=timeout)
            return self.sequence, self.item


def jpeg_encoder(width: int, height: int) -> Callable[[np.ndarray], bytes]:
    """RGB array -> JPEG bytes: PyAV's mjpeg encoder (the camera extra), or Pillow; an error naming both when
    neither is installed."""
    try:
        import av
    except ImportError:
        pass
    else:
        from fractions import Fraction

        context = av.CodecContext.create("mjpeg", "w")
        context.width, context.height, context.pix_fmt = width, height, "yuvj420p"
        context.time_base = Fraction(1, 30)
        context.qscale = True  # a fixed quality (qscale 3, about Pillow's 85) rather than a bit rate
        context.global_quality = 3 * 118  # FF_QP2LAMBDA
        lock = threading.Lock()

        def encode_av(array: np.ndarray) -> bytes:
            frame = av.VideoFrame.from_ndarray(array, format="rgb24").reformat(format="yuvj420p")
            with lock:
                return b"".join(bytes(packet) for packet in context.encode(frame))

        return encode_av
    try:
        from PIL import Image
    except ImportError:
        raise EdgelineError(
            "HTTP MJPEG needs a JPEG encoder: pip install 'edgeline[camera]' (PyAV) or Pillow"
        ) from None
    import io

    def encode_pillow(array: np.ndarray) -> bytes:
        out = io.BytesIO()
        Image.fromarray(array).save(out, "JPEG", quality=JPEG_QUALITY)
        return out.getvalue()

    return encode_pillow


class _MjpegServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, stopped: threading.Event) -> None:
        self.jpegs = _Latest()
        self.stopped = stopped
        self.clients = 0
        self.clients_lock = threading.Lock()
        super().__init__((HOST, port), _MjpegHandler)

    def join(self) -> bool:
        with self.clients_lock:
            if self.clients >= MAX_CLIENTS:
                return False
            self.clients += 1
            return True

    def leave(self) -> None:
        with self.clients_lock:
            self.clients -= 1


class _MjpegHandler(BaseHTTPRequestHandler):
    server: _MjpegServer
    timeout = SEND_TIMEOUT_S  # every socket operation: a client that sends no request or takes no data is dropped
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:  # the base class's name
        pass  # one line per request on stderr would drown the URLs a script reads

    def do_GET(self) -> None:  # http.server's name
        path = self.path.split("?", 1)[0]
        if path not in (HTTP_PATH, SNAPSHOT_PATH):
            self.send_error(404, f"no such path: {HTTP_PATH} (MJPEG) or {SNAPSHOT_PATH} (one frame)")
            return
        if not self.server.join():
            self.send_error(503, f"already {MAX_CLIENTS} clients")
            return
        try:
            if path == SNAPSHOT_PATH:
                self._snapshot()
            else:
                self._stream()
        except TimeoutError:
            client = ":".join(str(part) for part in self.client_address[:2])
            logger.warning("http: dropped client %s: it took nothing for %g s", client, SEND_TIMEOUT_S)
        except OSError:
            pass  # the client went away: its thread ends, nobody else waited for it
        finally:
            self.server.leave()

    def _snapshot(self) -> None:
        _, jpeg = self.server.jpegs.newer(0, SEND_TIMEOUT_S)
        if jpeg is None:
            self.send_error(503, "no frame yet")
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(jpeg)))
        self.end_headers()
        self.wfile.write(jpeg)

    def _stream(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.send_response(200)
        self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        seen = 0
        while not self.server.stopped.is_set():  # until the server stops or the client goes: each wait bounded
            sequence, jpeg = self.server.jpegs.newer(seen, FRAME_WAIT_S)
            if sequence == seen or jpeg is None:
                continue
            seen = sequence
            head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
            self.wfile.write(head.encode("ascii") + jpeg + b"\r\n")


class _RtspChild:
    """``sim/camera_rtsp.py`` under the system Python, and the writer thread that feeds it the newest frame."""

    def __init__(self, options: CameraOptions, stopped: threading.Event) -> None:
        python = shutil.which(SYSTEM_PYTHON)
        if python is None:
            raise EdgelineError(f"--rtsp: no {SYSTEM_PYTHON}; {RTSP_HINT}")
        script = Path(__file__).with_name("camera_rtsp.py")
        self.frames = _Latest()
        self.stopped = stopped
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=5)
        self.process = subprocess.Popen(
            [python, str(script), "--port", str(options.rtsp_port or 0), "--host", HOST, "--width",
             str(options.width), "--height", str(options.height), "--fps", repr(options.fps), "--codec", options.codec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        threading.Thread(target=self._forward_stderr, name="rtsp-stderr", daemon=True).start()
        self.port = self._wait_listening()
        threading.Thread(target=self._write, name="rtsp-writer", daemon=True).start()

    def _wait_listening(self) -> int:
        assert self.process.stdout is not None
        deadline = time.monotonic() + CHILD_START_S
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(max(0.0, deadline - time.monotonic())):
                    words = self.process.stdout.readline().decode(errors="replace").split()
                    if len(words) == 2 and words[0] == "listening" and words[1].isdigit():
                        return int(words[1])
                    if not words:  # end of output: the child exited
                        break
        self.stop()
        tail = " | ".join(self.stderr_tail) or "no output"
        if self.process.returncode == 3:
            raise EdgelineError(f"--rtsp: GStreamer's RTSP server is missing ({tail}); {RTSP_HINT}")
        raise EdgelineError(f"--rtsp: the RTSP server did not start within {CHILD_START_S:g} s ({tail})")

    def _forward_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.stderr_tail.append(line)
            print(f"rtsp: {line}", file=sys.stderr, flush=True)

    def _write(self) -> None:
        """The newest frame to the child's stdin; a frozen child blocks this thread only."""
        assert self.process.stdin is not None
        seen = 0
        try:
            while not self.stopped.is_set():
                seen, data = self.frames.newer(seen, FRAME_WAIT_S)
                if data is not None:
                    self.process.stdin.write(data)
                    self.process.stdin.flush()
        except (OSError, ValueError):
            pass  # the child is gone (or stdin closed by stop()): the main loop sees it exit

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        """End of input ends the child; then SIGTERM, then SIGKILL, each wait bounded."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        for ending in (None, self.process.terminate, self.process.kill):
            if ending is not None:
                ending()
            try:
                self.process.wait(CHILD_STOP_S)
                return
            except subprocess.TimeoutExpired:
                continue


class SimCamera:
    """The renderer and the servers of ``options``: ``start()`` (URLs then known), ``stop()``; a context manager."""

    def __init__(self, options: CameraOptions) -> None:
        from edgeline.sim.scene import Scene

        self.options = options
        self.scene = Scene(options.width, options.height, options.fps, options.objects, options.seed)
        self.stopped = threading.Event()
        self.rtsp: _RtspChild | None = None
        self.http: _MjpegServer | None = None
        self.start_time = 0.0
        """``time.monotonic()`` of frame 0: frame N is rendered at ``start_time + N / fps``."""
        self.rendered = 0
        self.skipped = 0
        self.encode: Callable[[np.ndarray], bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._serving = False

    @property
    def urls(self) -> list[str]:
        found = []
        if self.rtsp is not None:
            found.append(f"rtsp://{HOST}:{self.rtsp.port}{RTSP_MOUNT}")
        if self.http is not None:
            found.append(f"http://{HOST}:{self.http.server_address[1]}{HTTP_PATH}")
        return found

    def start(self) -> SimCamera:
        options = self.options
        try:
            if options.http_port is not None:
                self.encode = jpeg_encoder(options.width, options.height)
                try:
                    self.http = _MjpegServer(options.http_port, self.stopped)
                except OSError as exc:
                    raise EdgelineError(
                        f"--http {options.http_port}: cannot listen on {HOST}: {exc.strerror}"
                    ) from None
                self._spawn(self.http.serve_forever, "http")
                self._serving = True
            if options.rtsp_port is not None:
                self.rtsp = _RtspChild(options, self.stopped)
        except BaseException:
            self.stop()
            raise
        self.start_time = time.monotonic()
        self._spawn(self._render, "render")
        return self

    def _spawn(self, target: Callable[[], object], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _render(self) -> None:
        """Frame N at start_time + N / fps, until stopped (each wait at most one frame interval)."""
        fps, following = self.options.fps, 0
        while not self.stopped.is_set():
            index = max(following, int((time.monotonic() - self.start_time) * fps))
            self.skipped += index - following
            array = self.scene.frame(index)
            if self.rtsp is not None:
                self.rtsp.frames.put(array.tobytes())
            if self.http is not None and self.encode is not None and self.http.clients > 0:
                self.http.jpegs.put(self.encode(array))
            self.rendered += 1
            following = index + 1
            self.stopped.wait(max(0.0, self.start_time + following / fps - time.monotonic()))

    def failure(self) -> str | None:
        """Why the camera cannot go on (its RTSP server exited by itself), or None."""
        if self.rtsp is not None and self.rtsp.exit_code is not None and not self.stopped.is_set():
            tail = " | ".join(self.rtsp.stderr_tail) or "no output"
            return f"the RTSP server exited with code {self.rtsp.exit_code} ({tail})"
        return None

    def stop(self) -> None:
        self.stopped.set()
        if self.http is not None:
            if self._serving:
                self.http.shutdown()  # returns within serve_forever's poll interval (0.5 s)
                self._serving = False
            self.http.server_close()
        if self.rtsp is not None:
            self.rtsp.stop()
        for thread in self._threads:
            thread.join(timeout=CHILD_STOP_S)

    def __enter__(self) -> SimCamera:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def camera_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of ``edgeline sim camera`` (sim/cli.py hands it the words after ``camera``)."""
    parser = CommandParser(
        prog=prog,
        description="Serve a synthetic scene (moving coloured shapes, each frame's number in a barcode along the "
        "top edge) as a camera on 127.0.0.1: RTSP (H.264 or MJPEG, Debian's GStreamer RTSP server) at "
        f"rtsp://127.0.0.1:PORT{RTSP_MOUNT} and/or HTTP MJPEG at http://127.0.0.1:PORT{HTTP_PATH}. Prints each URL "
        "on a line of its own, then serves until SIGTERM or Ctrl-C. Without --rtsp and --http, both on free ports. "
        "(With an option of the camera sensor instead, --data, --model, --broker, --out, ..., `edgeline sim camera` "
        "is that sensor, publishing image samples over MQTT: see `edgeline sim --help`.)",
    )
    parser.add_argument(
        "--rtsp", type=_port, nargs="?", const=0, metavar="PORT", help="serve RTSP on PORT (0 or none: a free port)"
    )
    parser.add_argument(
        "--http", type=_port, nargs="?", const=0, metavar="PORT", help="serve HTTP MJPEG on PORT (0 or none: free)"
    )
    parser.add_argument("--codec", choices=("h264", "mjpeg"), default="h264", help="RTSP's codec (default h264)")
    parser.add_argument("--size", type=parse_size, default=(640, 480), metavar="WxH", help="default 640x480")
    parser.add_argument("--fps", type=float, default=30.0, metavar="FPS", help="frames per second (default 30)")
    parser.add_argument("--objects", type=bounded_int(0, 64), default=3, metavar="N", help="moving shapes (default 3)")
    parser.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="the scene's seed (default 0)")
    parser.set_defaults(func=run_camera)
    return parser


def run_camera(args: argparse.Namespace) -> int:
    """``edgeline sim camera``: until SIGTERM or Ctrl-C; an error (exit 2) if the RTSP server ends by itself."""
    if not (0 < args.fps <= 240):
        raise EdgelineError(f"--fps {args.fps:g}: frames per second above 0, at most 240")
    both = args.rtsp is None and args.http is None
    options = CameraOptions(
        width=args.size[0], height=args.size[1], fps=args.fps, objects=args.objects, seed=args.seed,
        codec=args.codec, rtsp_port=0 if both else args.rtsp, http_port=0 if both else args.http,
    )  # fmt: skip
    stopped = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers go on the main thread only
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set()) if in_main else None
    failure = None
    try:
        with SimCamera(options) as camera:
            for url in camera.urls:
                print(url, flush=True)
            print(
                f"scene {options.width}x{options.height} at {options.fps:g} fps, {options.objects} objects, seed "
                f"{options.seed}, RTSP {options.codec}; frame N is rendered at monotonic {camera.start_time:.6f} + "
                f"N/{options.fps:g} (pid {os.getpid()}); SIGTERM or Ctrl-C stops",
                flush=True,
            )
            while not stopped.is_set() and failure is None:  # each wait short: a signal is seen at once
                failure = camera.failure()
                stopped.wait(0.2)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a camera is stopped: not an error
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if failure is not None:
        raise EdgelineError(failure)
    return 0
