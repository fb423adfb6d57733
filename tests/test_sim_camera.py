"""The simulated camera: the scene (edgeline.sim.scene), its barcode through real codecs, the ``testsrc:`` reader,
and ``edgeline sim camera`` served over RTSP (Debian's GStreamer) and HTTP MJPEG, read by PyAV as a user's reader
would: killed, restarted, frozen, and left unread by one client while another watches."""

from __future__ import annotations

import io
import itertools
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from edgeline.sim.camera import jpeg_encoder
from edgeline.sim.scene import BITS, CLASSES, COLOURS, Scene, SceneError, TestsrcReader, read_frame_number
from edgeline.video import CameraError, CameraSpec
from tests.camera_server import CameraServerFactory, SilentServer, StallingMjpegServer

av = pytest.importorskip("av")

RTSP_OPTIONS = {"rtsp_transport": "tcp"}
FRAMES = 30


def _testsrc(live: bool = True, **options: str) -> TestsrcReader:
    return TestsrcReader(CameraSpec("cam0", "testsrc", "testsrc:", "testsrc:", live, dict(options)))


def _numbers(container: av.container.InputContainer, count: int) -> list[int | None]:
    """The barcodes of the next ``count`` decoded frames (fewer if the stream ends)."""
    found: list[int | None] = []
    for frame in container.decode(video=0):
        found.append(read_frame_number(frame.to_ndarray(format="rgb24")))
        if len(found) >= count:
            break
    return found


def _read_stream(url: str, count: int = FRAMES, **open_args: object) -> list[int | None]:
    """The barcodes of ``count`` frames of a stream; each open and each read bounded by 15 s (a loaded machine's
    encoder can be seconds late with a key frame: the bound is for a hang, not a measure)."""
    with av.open(url, timeout=(15, 15), **open_args) as container:
        return _numbers(container, count)


def _increasing(numbers: list[int | None]) -> bool:
    return all(number is not None for number in numbers) and all(
        later > earlier  # type: ignore[operator]  # None ruled out above
        for earlier, later in itertools.pairwise(numbers)
    )


# -- the scene -----------------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_scene_is_a_function_of_seed_and_frame() -> None:
    one, again, other = Scene(seed=7), Scene(seed=7), Scene(seed=8)
    for index in (0, 1, 29, 1000):
        assert np.array_equal(one.frame(index), again.frame(index))
        assert one.boxes(index) == again.boxes(index)
    assert one.boxes(5) != other.boxes(5)
    assert not np.array_equal(one.frame(0), one.frame(1))  # things move
    assert np.array_equal(one.frame(40), Scene(seed=7).frame(40))  # any order: no state carried between frames
    assert one.frame(3).shape == (480, 640, 3) and one.frame(3).dtype == np.uint8


@pytest.mark.quick
@pytest.mark.parametrize("objects", [0, 1, 3, 8, 20])
def test_boxes_are_where_their_colour_is(objects: int) -> None:
    scene = Scene(320, 240, objects=objects, seed=3)
    for index in (0, 17, 90):
        frame, boxes = scene.frame(index), scene.boxes(index)
        assert len(boxes) == objects
        for position, (class_index, x1, y1, x2, y2) in enumerate(boxes):
            assert class_index == position % len(CLASSES)
            assert 0 <= x1 < x2 <= 320 and 2 * scene.block <= y1 < y2 <= 240  # inside, below the barcode
            covered = any(  # a later shape drawn over this one's centre
                bx1 <= (x1 + x2) // 2 < bx2 and by1 <= (y1 + y2) // 2 < by2
                for _, bx1, by1, bx2, by2 in boxes[position + 1 :]
            )
            if not covered:
                assert tuple(frame[(y1 + y2) // 2, (x1 + x2) // 2]) == tuple(COLOURS[class_index])


@pytest.mark.quick
def test_shapes_bounce_inside_the_frame() -> None:
    scene = Scene(160, 96, objects=4, seed=1)
    for index in range(0, 3000, 7):
        for _, x1, y1, x2, y2 in scene.boxes(index):
            assert 0 <= x1 < x2 <= 160 and 2 * scene.block <= y1 < y2 <= 96


@pytest.mark.quick
@pytest.mark.parametrize(
    ("arguments", "named"),
    [((100, 480), "scene size 100x480"), ((640, 480, 0.0), "scene rate 0"), ((640, 480, 30.0, 65), "objects 65")],
)
def test_a_bad_scene_is_refused_by_name(arguments: tuple[float, ...], named: str) -> None:
    with pytest.raises(SceneError, match=named):
        Scene(*arguments)  # type: ignore[arg-type]


@pytest.mark.quick
@pytest.mark.parametrize("width", [160, 320, 640, 1280])
def test_barcode_reads_back(width: int) -> None:
    scene = Scene(width, 96 if width == 160 else 240)
    for index in (0, 1, 255, 256, 65_537, 2**31 + 5, 2**32 - 1):
        assert read_frame_number(scene.frame(index)) == index
    assert read_frame_number(scene.frame(2**32 + 3)) == 3  # 32 bits: the number wraps (4.5 years at 30 fps)
    bgr = scene.frame(12)[..., ::-1]
    assert read_frame_number(bgr) == 12  # black and white blocks: any channel order
    assert read_frame_number(scene.frame(12).mean(axis=2).astype(np.uint8)) == 12


@pytest.mark.quick
def test_no_barcode_reads_as_none() -> None:
    rng = np.random.default_rng(0)
    blank = [np.zeros((480, 640, 3), np.uint8), np.full((480, 640, 3), 255, np.uint8)]
    noise = [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(50)]
    assert [read_frame_number(array) for array in blank + noise] == [None] * 52
    assert read_frame_number(np.zeros((10, 10, 3), np.uint8)) is None  # too small to hold one
    broken = Scene().frame(77)
    broken[:8, 8 * (BITS - 1) :] = 255 - broken[:8, 8 * (BITS - 1) :]  # one check bit flipped
    assert read_frame_number(broken) is None


def _round_trip(codec: str, frames: list[np.ndarray], options: dict[str, str], pix_fmt: str) -> list[int | None]:
    """Encode with PyAV's encoder, decode with its decoder, in this process."""
    height, width = frames[0].shape[:2]
    encoder = av.CodecContext.create(codec, "w")
    encoder.width, encoder.height, encoder.pix_fmt = width, height, pix_fmt
    encoder.time_base = Fraction(1, 30)
    encoder.options = options
    decoder = av.CodecContext.create(codec, "r")
    packets = []
    for index, array in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(array, format="rgb24").reformat(format=pix_fmt)
        frame.pts = index
        packets += encoder.encode(frame)
    packets += encoder.encode(None)
    decoded = [frame for packet in packets for frame in decoder.decode(packet)]
    decoded += decoder.decode(None)
    return [read_frame_number(frame.to_ndarray(format="rgb24")) for frame in decoded]


@pytest.mark.quick
@pytest.mark.parametrize("crf", ["23", "35"])
def test_barcode_survives_h264(crf: str) -> None:
    """libx264 at its default quality (crf 23), and at a poor one (35)."""
    scene = Scene(seed=2)
    numbers = list(range(1000, 1000 + FRAMES))
    decoded = _round_trip("h264", [scene.frame(n) for n in numbers], {"crf": crf, "preset": "ultrafast"}, "yuv420p")
    assert decoded == numbers


@pytest.mark.quick
@pytest.mark.parametrize("size", [(640, 480), (320, 240), (160, 120)])
def test_barcode_survives_mjpeg(size: tuple[int, int]) -> None:
    """Through PyAV's mjpeg (the HTTP camera's encoder) and through Pillow at quality 50."""
    from PIL import Image

    scene = Scene(*size, seed=4)
    numbers = [0, 1, 2, 77, 2**20 + 3, 2**32 - 2]
    encode = jpeg_encoder(*size)
    decoder = av.CodecContext.create("mjpeg", "r")
    for number in numbers:
        [frame] = decoder.decode(av.Packet(encode(scene.frame(number))))
        assert read_frame_number(frame.to_ndarray(format="rgb24")) == number
        out = io.BytesIO()
        Image.fromarray(scene.frame(number)).save(out, "JPEG", quality=50)
        assert read_frame_number(np.asarray(Image.open(out).convert("RGB"))) == number


# -- testsrc: ------------------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_testsrc_with_frames_gives_each_once_then_ends() -> None:
    reader = _testsrc(live=False, frames="5", size="320x240", rate="10", seed="9")
    assert (reader.width, reader.height, reader.pixel) == (320, 240, "rgb")
    frames = [reader.read() for _ in range(7)]
    assert frames[5:] == [None, None]
    taken = [frame for frame in frames if frame is not None]
    assert [frame.index for frame in taken] == [0, 1, 2, 3, 4]
    assert [read_frame_number(frame.array) for frame in taken] == [0, 1, 2, 3, 4]
    assert [frame.source_time for frame in taken] == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert all(frame.pixel == "rgb" and frame.array.shape == (240, 320, 3) for frame in taken)
    assert np.array_equal(taken[3].array, Scene(320, 240, 10.0, 3, 9).frame(3))
    assert [taken[k].captured <= taken[k + 1].captured for k in range(4)] == [True] * 4
    reader.close()


@pytest.mark.quick
def test_live_testsrc_skips_what_a_late_reader_missed() -> None:
    reader = _testsrc(rate="50")
    first, second = reader.read(), reader.read()
    assert first is not None and second is not None
    assert second.index > first.index  # never the same frame twice
    time.sleep(0.3)  # 15 frame intervals at least: a camera would not wait for us
    late = reader.read()
    assert late is not None and late.index >= second.index + 15
    assert read_frame_number(late.array) == late.index and late.source_time == late.index / 50
    assert reader.skipped >= 14
    reader.close()
    assert reader.read() is None


@pytest.mark.quick
def test_closing_a_live_testsrc_ends_its_wait() -> None:
    reader = _testsrc(rate="0.2")  # one frame every 5 s: the second read waits
    assert reader.read() is not None
    closer = threading.Timer(0.1, reader.close)
    closer.start()
    assert reader.read() is None  # not frame 1, 5 s later: close() ended the wait
    closer.join()


@pytest.mark.quick
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"size": "100x100"}, "scene size 100x100"),
        ({"size": "big"}, "size=big"),
        ({"rate": "0"}, "rate=0"),
        ({"rate": "fast"}, "rate=fast"),
        ({"objects": "-1"}, "objects=-1"),
        ({"frames": "many"}, "frames=many"),
        ({"seed": "2"}, None),
        ({"colour": "red"}, "unknown option colour"),
    ],
)
def test_testsrc_options_are_checked(options: dict[str, str], named: str | None) -> None:
    if named is None:
        _testsrc(**options).close()
        return
    with pytest.raises(CameraError, match=named) as raised:
        _testsrc(**options)
    assert raised.value.reason == "unsupported"


# -- the command, without servers ----------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--size", "100x100", "--http"], "scene size 100x100"),
        (["--size", "641x480"], "even width and height"),
        (["--fps", "0", "--http"], "--fps 0"),
        (["--rtsp", "70000"], "--rtsp"),
        (["--data", "work", "--rtsp", "1"], "--rtsp is for the camera server, --data for the camera sensor"),
    ],
)
def test_sim_camera_refuses_bad_flags_in_one_line(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgeline.cli import main

    try:
        code = main(["sim", "camera", *arguments])
    except SystemExit as exit:  # argparse's own errors
        code = int(exit.code or 0)
    error = capsys.readouterr().err
    assert code == 2 and said in error and "Traceback" not in error
    assert len(error.strip().splitlines()) <= 3  # argparse's usage lines, then the one error line


@pytest.mark.quick
def test_rtsp_child_without_gi_says_what_is_missing() -> None:
    """Run by a Python without PyGObject (this virtual environment's), the RTSP child names what it lacks."""
    script = Path(__file__).resolve().parents[1] / "sim" / "camera_rtsp.py"
    done = subprocess.run(
        [sys.executable, "-I", str(script), "--width", "320", "--height", "240", "--fps", "30"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 3 and "GStreamer's RTSP server is not available" in done.stderr


# -- served ---------------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["h264", "mjpeg"])
def test_rtsp_serves_numbered_frames(camera_server: CameraServerFactory, codec: str) -> None:
    camera = camera_server(codec=codec)
    numbers = _read_stream(camera.rtsp_url, options=RTSP_OPTIONS)
    assert len(numbers) == FRAMES and _increasing(numbers), numbers


@pytest.mark.integration
def test_http_mjpeg_and_rtsp_at_once(camera_server: CameraServerFactory) -> None:
    camera = camera_server(codec="mjpeg", http=True, size="320x240", fps=25)
    with av.open(camera.http_url, format="mpjpeg", timeout=(5, 5)) as watching:
        http_numbers = _numbers(watching, FRAMES)
        rtsp_numbers = _read_stream(camera.rtsp_url, options=RTSP_OPTIONS)  # while the HTTP client stays connected
        more = _numbers(watching, 5)
    assert len(http_numbers) == FRAMES and _increasing(http_numbers + more), http_numbers + more
    assert len(rtsp_numbers) == FRAMES and _increasing(rtsp_numbers), rtsp_numbers
    with av.open(camera.http_url, format="mpjpeg", timeout=(5, 5)) as frame:
        assert next(frame.decode(video=0)).to_ndarray(format="rgb24").shape == (240, 320, 3)


@pytest.mark.integration
def test_killed_camera_restarts_on_its_port(camera_server: CameraServerFactory) -> None:
    camera = camera_server(codec="h264", http=True)
    before = _read_stream(camera.rtsp_url, 5, options=RTSP_OPTIONS)
    camera.kill()
    with pytest.raises((av.error.FFmpegError, OSError)):
        _read_stream(camera.rtsp_url, 1, options=RTSP_OPTIONS)
    camera.restart()
    after = _read_stream(camera.rtsp_url, FRAMES, options=RTSP_OPTIONS)
    assert _increasing(before) and len(after) == FRAMES and _increasing(after), (before, after)
    assert len(_read_stream(camera.http_url, 5, format="mpjpeg")) == 5


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["rtsp", "http"])
def test_frozen_camera_times_out_a_read(camera_server: CameraServerFactory, scheme: str) -> None:
    camera = camera_server(codec="mjpeg", http=scheme == "http", rtsp=scheme == "rtsp")
    url, args = (
        (camera.rtsp_url, {"options": RTSP_OPTIONS}) if scheme == "rtsp" else (camera.http_url, {"format": "mpjpeg"})
    )
    with av.open(url, timeout=(5, 2), **args) as container:
        assert len(_numbers(container, 5)) == 5
        camera.freeze()
        with pytest.raises((av.error.FFmpegError, OSError)):
            _numbers(container, 10_000)  # what was in flight, then the 2 s read deadline (the count only bounds it)
    camera.thaw()
    assert len(_read_stream(url, 3, **args)) == 3  # thawed: it serves again


@pytest.mark.integration
def test_a_stopped_http_reader_holds_up_nobody(camera_server: CameraServerFactory) -> None:
    """One client asks for the stream and never reads. Another reads all along, with a 3 s read deadline, until the
    camera drops the stopped one (its socket took nothing for SEND_TIMEOUT_S): the stall never reached it. Then the
    stopped client's socket ends (after what was in its buffers), and a new client starts at the newest frame."""
    camera = camera_server(rtsp=False, http=True)
    stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    watched: list[int | None] = []
    try:
        stalled.connect((camera.host, camera.http_port or 0))
        stalled.sendall(b"GET /scene.mjpg HTTP/1.0\r\n\r\n")
        with av.open(camera.http_url, format="mpjpeg", timeout=(5, 3)) as watching:
            for _ in range(200):  # 10 frames a round: 2,000 frames (over a minute) bound the wait for the drop
                watched += _numbers(watching, 10)
                if "http: dropped client" in camera.tail(50):
                    break
        assert "http: dropped client" in camera.tail(50)
        stalled.settimeout(10)
        received = 0
        while chunk := stalled.recv(1 << 16):  # what the kernel held, then the end: the camera closed it
            received += len(chunk)
            assert received < 64 << 20
    finally:
        stalled.close()
    assert _increasing(watched), watched
    later = _read_stream(camera.http_url, 5, format="mpjpeg")
    assert _increasing(later) and later[0] >= watched[-1], later  # type: ignore[operator]


# -- the hostile helpers do what they say ------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["rtsp", "http"])
def test_silent_server_never_answers(silent_server: SilentServer, scheme: str) -> None:
    url = silent_server.rtsp_url if scheme == "rtsp" else silent_server.http_url
    with pytest.raises((av.error.FFmpegError, OSError)):
        av.open(url, timeout=(1, 1), **({"options": RTSP_OPTIONS} if scheme == "rtsp" else {"format": "mpjpeg"}))
    assert silent_server.accepted >= 1


@pytest.mark.integration
def test_stalling_server_sends_frames_then_nothing(
    stalling_server: Callable[..., StallingMjpegServer],
) -> None:
    server = stalling_server(frames=4)
    got: list[int | None] = []
    with (
        av.open(server.http_url, format="mpjpeg", timeout=(2, 1)) as container,
        pytest.raises((av.error.FFmpegError, OSError)),
    ):
        for frame in container.decode(video=0):  # four frames, then the read deadline
            got.append(read_frame_number(frame.to_ndarray(format="rgb24")))
            assert len(got) <= 4
    assert got == [0, 1, 2, 3]
