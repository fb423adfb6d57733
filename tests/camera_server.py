"""Cameras for tests: a real ``edgeline sim camera`` on loopback, and two hostile servers.

    camera_server   a factory fixture: ``camera_server(codec="h264", http=False)`` -> a started ``CameraServer``
                    (stopped at teardown); ``.url`` (RTSP, or HTTP when it serves HTTP only), ``.rtsp_url``,
                    ``.http_url``, ``.pid``, ``kill()`` (SIGKILL), ``freeze()`` / ``thaw()`` (SIGSTOP / SIGCONT),
                    ``restart()`` on the same ports, ``stop()``
    silent_server   a started ``SilentServer``: accepts connections and never says a word (``rtsp_url``, ``http_url``)
    stalling_server a factory fixture: ``stalling_server(frames=5)`` -> a started ``StallingMjpegServer`` that sends
                    the HTTP MJPEG header and ``frames`` frames of the scene, then nothing, the socket left open

``CameraServer`` runs ``python -m edgeline.cli sim camera`` in a session of its own, so its signals reach the
GStreamer child too (the whole camera freezes, dies or stops at once); it is ready when its RTSP server answers an
OPTIONS request and its HTTP server a ``/scene.jpg``, each probe and the whole wait bounded. Its output is in
``DIRECTORY/camera.log``. Ports come from ``tests.mqtt_broker.free_port`` (this worker's band).

Registered for every test by ``tests/conftest.py``; importing this module starts nothing.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest

from tests.mqtt_broker import HOST, free_port

__all__ = [
    "CameraServer",
    "CameraServerFactory",
    "CameraStartError",
    "SilentServer",
    "StallingMjpegServer",
    "camera_server",
    "silent_server",
    "stalling_server",
]

START_TIMEOUT_S = 20.0
"""A cold start imports numpy and PyAV, and GStreamer registers its plugins: seconds on a busy machine."""
STOP_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 1.0
EDGELINE = [sys.executable, "-m", "edgeline.cli"]


class CameraStartError(RuntimeError):
    """The camera did not start answering in time, or exited."""


def rtsp_answers(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether an RTSP server on host:port answers OPTIONS with 200."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.sendall(f"OPTIONS rtsp://{host}:{port}/scene RTSP/1.0\r\nCSeq: 1\r\n\r\n".encode())
            return connection.recv(64).startswith(b"RTSP/1.0 200")
    except OSError:
        return False


def http_answers(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether an HTTP server on host:port returns a frame at /scene.jpg."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/scene.jpg")
        response = connection.getresponse()
        return response.status == 200 and response.read()[:2] == b"\xff\xd8"
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


class CameraServer:
    """One ``edgeline sim camera`` process (and its GStreamer child) on fixed loopback ports."""

    def __init__(
        self,
        directory: Path,
        *,
        codec: str = "h264",
        rtsp: bool = True,
        http: bool = False,
        size: str = "640x480",
        fps: float = 30.0,
        objects: int = 3,
        seed: int = 0,
    ) -> None:
        if not (rtsp or http):
            raise ValueError("a camera serves RTSP, HTTP or both")
        self.directory = Path(directory)
        self.host = HOST
        self.codec = codec
        self.size, self.fps, self.objects, self.seed = size, fps, objects, seed
        self.rtsp_port = free_port() if rtsp else None
        self.http_port = free_port() if http else None
        self.process: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def rtsp_url(self) -> str:
        if self.rtsp_port is None:
            raise AttributeError("this camera serves no RTSP")
        return f"rtsp://{self.host}:{self.rtsp_port}/scene"

    @property
    def http_url(self) -> str:
        if self.http_port is None:
            raise AttributeError("this camera serves no HTTP")
        return f"http://{self.host}:{self.http_port}/scene.mjpg"

    @property
    def url(self) -> str:
        return self.rtsp_url if self.rtsp_port is not None else self.http_url

    @property
    def pid(self) -> int:
        if self.process is None:
            raise CameraStartError("the camera is not running")
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.directory / "camera.log"

    def command(self) -> list[str]:
        args = [*EDGELINE, "sim", "camera", "--codec", self.codec, "--size", self.size, "--fps", f"{self.fps:g}"]
        args += ["--objects", str(self.objects), "--seed", str(self.seed)]
        if self.rtsp_port is not None:
            args += ["--rtsp", str(self.rtsp_port)]
        if self.http_port is not None:
            args += ["--http", str(self.http_port)]
        return args

    def answers(self) -> bool:
        return (self.rtsp_port is None or rtsp_answers(self.host, self.rtsp_port)) and (
            self.http_port is None or http_answers(self.host, self.http_port)
        )

    def start(self) -> CameraServer:
        if self.process is not None:
            raise CameraStartError("already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.frozen = False
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                raise CameraStartError(f"edgeline sim camera exited with code {code}: {self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise CameraStartError(f"the camera did not answer within {START_TIMEOUT_S:g} s: {self.tail()}")
            time.sleep(0.05)
        return self

    def tail(self, lines: int = 8) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"

    def _signal_group(self, signum: int) -> None:
        if self.process is None:
            raise CameraStartError("the camera is not running")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL to the camera and its GStreamer child at once, as a power cut would."""
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        self.process.wait(STOP_TIMEOUT_S)
        self.process, self.frozen = None, False

    def freeze(self) -> None:
        """SIGSTOP the camera and its child: connections stay open, nothing more is sent."""
        self._signal_group(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self._signal_group(signal.SIGCONT)
        self.frozen = False

    def restart(self) -> CameraServer:
        """A fresh camera on the same ports (killed first if it runs)."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """SIGTERM (thawed first), a bounded wait, then SIGKILL."""
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        if self.frozen:
            self.thaw()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_TIMEOUT_S)
        self._signal_group(signal.SIGKILL)  # the child too, should it outlive its parent
        self.process.wait(STOP_TIMEOUT_S)
        self.process, self.frozen = None, False

    def __enter__(self) -> CameraServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _TcpServer:
    """A loopback listener whose accepted connections a thread of its own serves; all closed by ``stop()``."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((HOST, free_port()))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.port: int = self.listener.getsockname()[1]
        self.accepted = 0
        self.connections: list[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, name=type(self).__name__, daemon=True)

    @property
    def rtsp_url(self) -> str:
        return f"rtsp://{HOST}:{self.port}/scene"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.port}/scene.mjpg"

    def start(self) -> _TcpServer:
        self.thread.start()
        return self

    def _accept(self) -> None:
        while not self.stopped.is_set():  # until stop(): each accept waits 0.2 s at most
            try:
                connection, _ = self.listener.accept()
            except OSError:
                continue
            self.accepted += 1
            self.connections.append(connection)
            self.serve(connection)

    def serve(self, connection: socket.socket) -> None:
        """What to do with a new connection: nothing at all, here."""

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(STOP_TIMEOUT_S)
        for connection in [*self.connections, self.listener]:
            connection.close()


class SilentServer(_TcpServer):
    """Accepts every connection, reads nothing, sends nothing, closes nothing until stopped."""


class StallingMjpegServer(_TcpServer):
    """An HTTP MJPEG camera that sends ``frames`` frames of the scene (numbered 0 up), then stops sending with the
    connection left open."""

    def __init__(self, frames: int = 5, size: tuple[int, int] = (320, 240)) -> None:
        super().__init__()
        from edgeline.sim.camera import BOUNDARY, jpeg_encoder
        from edgeline.sim.scene import Scene

        scene = Scene(*size)
        encode = jpeg_encoder(*size)
        self.boundary = BOUNDARY
        self.jpegs = [encode(scene.frame(index)) for index in range(frames)]

    def serve(self, connection: socket.socket) -> None:
        connection.settimeout(PROBE_TIMEOUT_S)
        with contextlib.suppress(OSError):
            connection.recv(4096)  # the request, whatever it is
            head = f"HTTP/1.0 200 OK\r\nContent-Type: multipart/x-mixed-replace; boundary={self.boundary}\r\n\r\n"
            parts = [head.encode()]
            for jpeg in self.jpegs:
                part = f"--{self.boundary}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
                parts.append(part.encode() + jpeg + b"\r\n")
            connection.sendall(b"".join(parts))


class CameraServerFactory(Protocol):
    def __call__(
        self,
        *,
        codec: str = "h264",
        rtsp: bool = True,
        http: bool = False,
        size: str = "640x480",
        fps: float = 30.0,
        objects: int = 3,
        seed: int = 0,
    ) -> CameraServer: ...


@pytest.fixture
def camera_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CameraServerFactory]:
    """Started cameras of this test, each in its own directory, all stopped at teardown."""
    made: list[CameraServer] = []

    def make(
        *,
        codec: str = "h264",
        rtsp: bool = True,
        http: bool = False,
        size: str = "640x480",
        fps: float = 30.0,
        objects: int = 3,
        seed: int = 0,
    ) -> CameraServer:
        server = CameraServer(
            tmp_path_factory.mktemp("camera"),
            codec=codec,
            rtsp=rtsp,
            http=http,
            size=size,
            fps=fps,
            objects=objects,
            seed=seed,
        )
        made.append(server)
        try:
            return server.start()
        except CameraStartError as exc:
            pytest.fail(str(exc), pytrace=False)

    try:
        yield make
    finally:
        for server in made:
            server.stop()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stalling_server() -> Iterator[Callable[..., StallingMjpegServer]]:
    """``stalling_server(frames=N)``: a started ``StallingMjpegServer``, stopped at teardown."""
    made: list[StallingMjpegServer] = []

    def make(frames: int = 5, size: tuple[int, int] = (320, 240)) -> StallingMjpegServer:
        server = StallingMjpegServer(frames, size)
        server.start()
        made.append(server)
        return server

    try:
        yield make
    finally:
        for server in made:
            server.stop()
