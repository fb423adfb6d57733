"""The RTSP half of ``edgeline sim camera``: Debian's GStreamer RTSP server, run by the system Python.

    /usr/bin/python3 camera_rtsp.py --port 0 --width 640 --height 480 --fps 30 --codec h264 < raw RGB frames

Standalone on purpose: a virtual environment has no ``gi`` (PyGObject comes from Debian's ``python3-gi``), and the
system Python may have no numpy, so this script imports only the standard library and ``gi``. Its parent renders the
scene and writes raw RGB frames (width * height * 3 bytes each) to its stdin as they are due; end of input (the
parent gone, even SIGKILLed) ends this process. It prints one line, ``listening PORT``, once the server accepts
connections at ``rtsp://127.0.0.1:PORT/scene``.

Each client gets its own pipeline (``appsrc ! videoconvert ! openh264enc ! h264parse ! rtph264pay``, or ``jpegenc !
rtpjpegpay``), so a new client starts on a key frame and a client that stops reading backs up only its own pipeline;
every appsrc is live and leaky (it keeps the newest two frames), so the thread that feeds them never waits on a
client. Debian has no x264enc: openh264enc, at a bitrate that keeps the frame-number barcode legible.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from fractions import Fraction
from typing import Any

__all__ = ["main"]

MOUNT = "/scene"
H264_BITRATE = 4_000_000
"""bits per second at 640x480 (scaled by area): openh264enc's default, 128 kbit/s, smears the barcode."""
JPEG_QUALITY = 85


def _pipeline(width: int, height: int, fps: float, codec: str) -> str:
    rate = Fraction(fps).limit_denominator(1001)
    caps = f"video/x-raw,format=RGB,width={width},height={height},framerate={rate.numerator}/{rate.denominator}"
    source = (
        f"appsrc name=src is-live=true do-timestamp=true format=time max-buffers=2 leaky-type=downstream "
        f"caps={caps} ! videoconvert ! video/x-raw,format=I420"
    )
    if codec == "mjpeg":
        return f"( {source} ! jpegenc quality={JPEG_QUALITY} ! rtpjpegpay name=pay0 pt=26 )"
    bitrate = max(500_000, int(H264_BITRATE * width * height / (640 * 480)))
    gop = max(1, round(fps))  # a key frame every second: what a client that joins, or lost a packet, waits for
    return (
        f"( {source} ! openh264enc bitrate={bitrate} gop-size={gop} complexity=low rate-control=bitrate "
        f"! h264parse config-interval=-1 ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
    )


class Feeder:
    """The appsrc of every prepared client pipeline, and the thread that reads frames from stdin into them."""

    def __init__(self, gst: Any, frame_bytes: int) -> None:
        self.gst = gst
        self.frame_bytes = frame_bytes
        self.sources: list[Any] = []
        self.lock = threading.Lock()

    def media_configure(self, factory: Any, media: Any) -> None:
        source = media.get_element().get_by_name("src")
        with self.lock:
            self.sources.append(source)
        media.connect("unprepared", lambda *_: self._forget(source))

    def _forget(self, source: Any) -> None:
        with self.lock:
            if source in self.sources:
                self.sources.remove(source)

    def run(self, stream: Any, loop: Any) -> None:
        """Until the end of stdin: each frame to every client's appsrc (dropped when there is none)."""
        try:
            while True:
                data = stream.read(self.frame_bytes)
                if len(data) < self.frame_bytes:
                    break
                with self.lock:
                    sources = list(self.sources)
                for source in sources:
                    source.emit("push-buffer", self.gst.Buffer.new_wrapped(data))
        finally:
            loop.quit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--fps", type=float, required=True)
    parser.add_argument("--codec", choices=("h264", "mjpeg"), default="h264")
    args = parser.parse_args(argv)
    try:
        import gi  # type: ignore[import-not-found,unused-ignore]  # Debian's python3-gi: not in a virtual environment

        gi.require_version("Gst", "1.0")
        gi.require_version("GstRtspServer", "1.0")
        from gi.repository import GLib, Gst, GstRtspServer  # type: ignore[import-not-found,unused-ignore]
    except (ImportError, ValueError) as exc:
        print(f"camera_rtsp: GStreamer's RTSP server is not available ({exc})", file=sys.stderr)
        return 3
    Gst.init(None)
    missing = [
        name
        for name in ("appsrc", "videoconvert", "openh264enc", "h264parse", "jpegenc")
        if not Gst.ElementFactory.find(name)
    ]
    if missing:
        print(f"camera_rtsp: GStreamer elements missing: {', '.join(missing)}", file=sys.stderr)
        return 3
    server = GstRtspServer.RTSPServer()
    server.set_address(args.host)
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(_pipeline(args.width, args.height, args.fps, args.codec))
    factory.set_shared(False)
    feeder = Feeder(Gst, args.width * args.height * 3)
    factory.connect("media-configure", feeder.media_configure)
    server.get_mount_points().add_factory(MOUNT, factory)
    if server.attach(None) == 0:
        print(f"camera_rtsp: cannot listen on {args.host}:{args.port}", file=sys.stderr)
        return 2
    loop = GLib.MainLoop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signum, loop.quit)
    threading.Thread(target=feeder.run, args=(sys.stdin.buffer, loop), name="feeder", daemon=True).start()
    print(f"listening {server.get_bound_port()}", flush=True)
    loop.run()
    sys.stdout.flush()
    # Not sys.exit: the feeder thread may be inside a read of stdin, and finalising the interpreter under it aborts
    # ("could not acquire lock for <stdin>"). Nothing is left to flush or close: the kernel closes the sockets.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
