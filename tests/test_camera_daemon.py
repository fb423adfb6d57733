"""``edgeline run BUNDLE --camera [NAME=]SOURCE``: cameras and video as the daemon's source.

Real parts throughout: the bundle is a real export with its pre-processing (``tests/camera_bundle.py``), videos are
encoded and decoded by PyAV, live cameras are ``testsrc:`` (the synthetic scene, paced like a camera) or
``edgeline sim camera`` (Debian's GStreamer RTSP server, killed and frozen for real), answers go through a real
Mosquitto or stdout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.daemon.camera import DROP_REASONS, CameraSource
from edgeline.daemon.config import CameraConfig, DaemonConfig, load_config
from edgeline.daemon.messages import Answer, Message
from edgeline.errors import EdgelineError
from edgeline.video import parse_camera
from tests import waiting
from tests.camera_bundle import COMMITTED, LABELS, colour_bundle, export_colour, write_video
from tests.camera_server import CameraServerFactory, SilentServer, StallingMjpegServer
from tests.mqtt_broker import Broker, Collector, free_port

pytestmark = pytest.mark.device  # the device tier runs these: a base install with the camera extra

wait_until = partial(waiting.wait_until, timeout=30.0)
EDGELINE = [sys.executable, "-m", "edgeline.cli"]
SECRET = "pa55w0rd-never-shown"


@pytest.fixture(scope="module")
def bundle() -> Path:
    return colour_bundle()


@pytest.fixture(scope="session")
def fresh_colour_bundle() -> Path:
    """The colour model exported now (once per content: tests/cache.py), in a fixture as the tiny bundles are."""
    return export_colour()


@pytest.mark.quick
@pytest.mark.workstation  # compares with a fresh export
def test_the_committed_camera_bundle_is_what_the_exporter_writes_today(fresh_colour_bundle: Path) -> None:
    from edgeline import read_bundle

    fresh, committed = read_bundle(fresh_colour_bundle).manifest, read_bundle(COMMITTED).manifest
    stale = f"{COMMITTED} is stale: python -m tests.camera_bundle"
    assert (committed.image, committed.inputs, committed.postprocess) == (
        fresh.image, fresh.inputs, fresh.postprocess,
    ), stale  # fmt: skip


def _prep(frame: np.ndarray, pixel: str) -> np.ndarray:
    return np.zeros((1, 3, 32, 32), np.float32) + float(frame[0, 0, 0]) / 255.0


# -- quick: the camera source in-process, real readers --------------------------------------------------------


class _Consumer:
    """The daemon's side, by hand: take each message, and answer it when told."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.lock = threading.Lock()

    def submit(self, message: Message) -> None:
        with self.lock:
            self.messages.append(message)

    def answer_all(self) -> int:
        with self.lock:
            taken, self.messages = self.messages, []
        for message in taken:
            assert message.on_answers is not None
            message.on_answers([Answer("t", b"{}", {"latency_ms": 1.0}, is_error=False)])
        return len(taken)


def _run_source(source: CameraSource, consumer: _Consumer) -> tuple[threading.Event, threading.Thread]:
    stopping = threading.Event()
    thread = threading.Thread(target=source.run, args=(consumer.submit, stopping), daemon=True)
    thread.start()
    return stopping, thread


@pytest.mark.quick
def test_a_live_camera_keeps_the_latest_frame_and_counts_every_one_it_overwrites() -> None:
    """While the model is busy, a live camera's frames overwrite each other in one slot: never more than one of its
    frames waits, the next one taken is the newest, and frames in = queued + overwritten + the one in the slot."""
    settings = CameraConfig(sources=("testsrc:?size=160x96&rate=100",))
    source = CameraSource(settings, _prep)
    consumer = _Consumer()
    stopping, thread = _run_source(source, consumer)
    feed = source.feeds[0]
    try:
        assert wait_until(lambda: len(consumer.messages) == 1)
        first = consumer.messages[0]
        assert wait_until(lambda: feed.dropped["overwritten"] >= 20)  # the model "busy" for 20 frames
        assert len(consumer.messages) == 1  # nothing queued behind it
        consumer.answer_all()
        assert wait_until(lambda: len(consumer.messages) == 1)
        second = consumer.messages[0]
        assert second.fields is not None and first.fields is not None
        assert second.fields["frame"] > first.fields["frame"] + 20  # the newest, not the next
        for _ in range(10):
            consumer.answer_all()
            assert wait_until(lambda: len(consumer.messages) == 1)
    finally:
        stopping.set()
        thread.join(5)
    assert not thread.is_alive() and wait_until(lambda: feed._ended)  # the reader put its last frame
    frames_in, dropped, answered = feed.counts["frames_in"], sum(feed.dropped.values()), feed.counts["answered"]
    queued_not_answered = len(consumer.messages)
    in_slot = 1 if feed._slot is not None else 0
    assert frames_in == answered + queued_not_answered + dropped + in_slot
    assert answered == 11 and feed.dropped["overwritten"] >= 20


@pytest.mark.quick
def test_a_frame_older_than_max_age_when_the_model_frees_up_is_dropped_stale() -> None:
    """Frames every 0.5 s; the model frees up while the newest frame is 0.15-0.3 s old, past max_age_ms = 100:
    that frame is dropped ``stale`` and the next one (fresh when taken) is queued."""
    settings = CameraConfig(sources=("testsrc:?size=160x96&rate=2",), max_age_ms=100)
    source = CameraSource(settings, _prep)
    consumer = _Consumer()
    stopping, thread = _run_source(source, consumer)
    feed = source.feeds[0]

    def slot_age() -> float:
        frame = feed._slot
        return -1.0 if frame is None else time.monotonic() - frame.captured

    try:
        assert wait_until(lambda: len(consumer.messages) == 1)
        assert wait_until(lambda: 0.15 <= slot_age() <= 0.3, every_s=0.005)
        consumer.answer_all()
        assert wait_until(lambda: feed.dropped["stale"] == 1)
        assert wait_until(lambda: len(consumer.messages) == 1)  # the next frame, taken as it came
    finally:
        stopping.set()
        thread.join(5)
    assert feed.dropped["overwritten"] == 0 and feed.counts["answered"] == 1


@pytest.mark.quick
def test_snapshots_are_taken_every_so_often_or_when_an_answer_says_so_never_closer_than_the_minimum() -> None:
    from edgeline.daemon.snapshots import Snapshots

    when = Snapshots(CameraConfig(snapshot_when="label=person,score>=0.8", snapshot_min_interval_s=1.0), None)
    person, weak, other = {"label": "person", "score": 0.9}, {"label": "person", "score": 0.5}, {"label": "cat"}
    assert [when.wanted("a", record, now) for record, now in ((weak, 0), (other, 0), (person, 0))] == [0, 0, 1]
    assert not when.wanted("a", person, 0.5) and when.wanted("b", person, 0.5) and when.wanted("a", person, 1.0)
    every = Snapshots(CameraConfig(snapshot_every_s=10, snapshot_min_interval_s=0), None)
    assert [every.wanted("a", other, now) for now in (0, 5, 9.9, 10, 12, 20.5)] == [1, 0, 0, 1, 0, 1]


@pytest.mark.quick
def test_a_snapshot_draws_a_detector_s_boxes_in_the_frame_s_pixel_order_below_its_caption() -> None:
    from edgeline.annotate import BAR_ROWS, class_colour
    from edgeline.daemon.snapshots import _annotated
    from edgeline.video import Frame

    array = np.full((96, 160, 3), 70, dtype=np.uint8)
    found = {"box": [0.5, 0.5, 0.75, 1.0], "class_index": 2, "label": "parcel", "score": 0.8}
    drawn = _annotated(Frame(array, "bgr", 7, 0.0), {"camera": "door", "frame": 7, "detections": [found]})
    red, green, blue = class_colour(2)
    # columns 80..119, rows 48..95 of the 160x96 frame, one pixel wide, in BGR
    for row, column in [(70, 80), (70, 119), (95, 100), (48, 100)]:
        assert tuple(drawn[row, column]) == (blue, green, red), (row, column)
    assert (drawn[49:95, 81:119] == 70).all() and (drawn[BAR_ROWS:, :80] == 70).all()
    assert (drawn[:BAR_ROWS] == 0).mean() > 0.5  # the caption's bar
    # and its text, where Pillow draws it (the images extra; a device with the camera extra alone gets the bar)
    assert (drawn[:BAR_ROWS] > 150).any() == (importlib.util.find_spec("PIL") is not None)


@pytest.mark.quick
def test_a_finite_testsrc_is_a_replay_every_frame_once_in_order() -> None:
    settings = CameraConfig(sources=("clip=testsrc:?size=160x96&rate=30&frames=40",))
    source = CameraSource(settings, _prep, max_batch=4)
    assert source.finite
    consumer = _Consumer()
    seen: list[int] = []

    def answer_some() -> bool:
        with consumer.lock:
            pending = list(consumer.messages)
        assert len(pending) <= 4  # at most max_batch of a replay's frames wait
        seen.extend(m.fields["frame"] for m in pending if m.fields is not None)
        consumer.answer_all()
        return not thread.is_alive()

    stopping, thread = _run_source(source, consumer)
    try:
        assert wait_until(answer_some)
    finally:
        stopping.set()
    seen.extend(m.fields["frame"] for m in consumer.messages if m.fields is not None)
    assert seen == list(range(40))
    assert dict(source.feeds[0].dropped) == dict.fromkeys(DROP_REASONS, 0)
    assert source.feeds[0].state == "ended"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ftp://example/x", "ftp://example/x"),
        ("cam=gopher://u:" + SECRET + "@h/x", "gopher://***@h/x"),
    ],
)
def test_an_unknown_scheme_is_refused_by_name_without_its_password(text: str, expected: str) -> None:
    with pytest.raises(EdgelineError) as caught:
        CameraSource(CameraConfig(sources=(text,)), _prep)
    assert expected in str(caught.value) and SECRET not in str(caught.value)


@pytest.mark.quick
def test_two_cameras_with_one_name_are_refused() -> None:
    with pytest.raises(EdgelineError, match="'door' is given to two cameras"):
        CameraSource(CameraConfig(sources=("door=testsrc:", "door=testsrc:?rate=5")), _prep)


@pytest.mark.quick
def test_camera_settings_from_a_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[camera]\nsources = ["door=testsrc:"]\nread_timeout_s = 2\nspeed = "realtime"\n')
    config = load_config(path)
    assert config.source.kind == "camera" and config.camera.read_timeout_s == 2  # the cameras are the source
    assert config.with_overrides(source={"kind": "replay", "path": "-"}).camera.sources == ()
    flags = DaemonConfig().with_overrides(camera={"sources": ("testsrc:",), "max_age_ms": 100.0})
    assert flags.source.kind == "camera" and flags.camera.max_age_ms == 100 and flags.queue_policy == "block"
    for bad, why in (
        ('speed = "fast"', "speed 'fast'"),
        ('snapshot_when = "colour=red"', "snapshot_when"),
        ("open_timeout_s = 0", "open_timeout_s"),
    ):
        path.write_text(f'[camera]\nsources = ["testsrc:"]\n{bad}\n')
        with pytest.raises(EdgelineError, match=why):
            load_config(path)


# -- integration: the daemon process ----------------------------------------------------------------------------


def _run(bundle: Path, *args: str | Path, state: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EDGELINE, "run", str(bundle), *map(str, args), "--state-dir", str(state)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _answers(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.integration
def test_a_file_of_n_frames_gets_exactly_n_answers_in_order_with_their_labels(bundle: Path, tmp_path: Path) -> None:
    colours = ["red"] * 12 + ["green"] * 12 + ["blue"] * 12 + ["red"] * 9
    clip = write_video(tmp_path / "clip.mp4", colours)
    frames = tmp_path / "frames"
    frames.mkdir()
    done = _run(bundle, "--camera", f"belt={clip}", "--camera", f"{frames}", state=tmp_path / "state")
    # an empty folder cannot work (said in one line, exit 1 at the end): the file is still answered to its end
    assert done.returncode == 1, done.stderr
    assert f"no image files in {frames}" in done.stderr
    answers = _answers(done.stdout)
    assert [a["frame"] for a in answers] == list(range(len(colours)))
    assert {a["camera"] for a in answers} == {"belt"} and {a["stream"] for a in answers} == {1}
    assert [a["label"] for a in answers] == colours
    assert all(a["age_ms"] >= 0 and a["device"] == "belt" for a in answers)
    assert "Traceback" not in done.stderr


@pytest.mark.integration
def test_a_damaged_file_answers_what_decodes_and_counts_the_rest(bundle: Path, tmp_path: Path) -> None:
    clip = write_video(tmp_path / "clip.avi", ["green"] * 60, codec="mjpeg")
    data = bytearray(clip.read_bytes())
    rng = np.random.default_rng(3)
    start = len(data) // 3
    data[start : start + 600] = rng.integers(0, 256, 600, dtype=np.uint8).tobytes()  # garbage mid-stream
    damaged = tmp_path / "damaged.avi"
    damaged.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.avi"
    truncated.write_bytes(clip.read_bytes()[: len(data) * 2 // 3])
    for path in (damaged, truncated):
        done = _run(bundle, "--camera", path, state=tmp_path / "state")
        answers = _answers(done.stdout)
        assert "Traceback" not in done.stderr
        assert 0 < len(answers) < 60 or path is damaged, done.stderr
        assert [a["frame"] for a in answers] == sorted(a["frame"] for a in answers)
        assert all(a["label"] == "green" for a in answers)


@pytest.mark.integration
def test_a_file_that_is_not_a_video_is_one_line_and_exit_1(bundle: Path, tmp_path: Path) -> None:
    fake = tmp_path / "notes.mp4"
    fake.write_text("these are not the frames you are looking for\n" * 50)
    done = _run(bundle, "--camera", f"x={fake}", state=tmp_path / "state")
    assert done.returncode == 1
    assert str(fake) in done.stderr and "Traceback" not in done.stderr
    unknown = _run(bundle, "--camera", f"rtmp://u:{SECRET}@127.0.0.1/live", state=tmp_path / "state")
    assert unknown.returncode != 0 and "rtmp://***@127.0.0.1/live" in unknown.stderr
    assert SECRET not in unknown.stderr and "Traceback" not in unknown.stderr


@pytest.mark.integration
def test_a_bundle_without_preprocessing_is_refused_with_the_remedy(built_litert_bundle: Path, tmp_path: Path) -> None:
    done = _run(built_litert_bundle, "--camera", "testsrc:", state=tmp_path / "state")
    assert done.returncode != 0 and "--preprocess" in done.stderr and "Traceback" not in done.stderr


class _Daemon:
    """``edgeline run`` as a process, answers to a broker, status and metrics read while it runs."""

    def __init__(
        self,
        bundle: Path,
        broker: Broker,
        tmp_path: Path,
        *args: str,
        config: str = "",
        metrics: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.metrics_port = free_port() if metrics else 0  # the device tier has no prometheus-client
        self.config = tmp_path / "daemon.toml"
        self.config.write_text(f"[health]\nstatus_interval_s = 0.5\nprometheus_port = {self.metrics_port}\n{config}")
        self.log = tmp_path / "daemon.log"
        self.instance = f"cam{os.getpid()}x{self.metrics_port}"
        command = [
            *EDGELINE, "run", str(bundle), "--broker", broker.address, "--config", str(self.config),
            "--state-dir", str(tmp_path / "state"), "--instance", self.instance, *args,
        ]  # fmt: skip
        self.results = Collector(broker, "edgeline/colour/+/result")
        self.status_messages = Collector(broker, f"edgeline/colour/{self.instance}/status")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **(env or {})}
            )

    def status(self) -> dict[str, Any]:
        payloads = self.status_messages.payloads
        return json.loads(payloads[-1]) if payloads else {}

    def camera(self, name: str) -> dict[str, Any]:
        return self.status().get("cameras", {}).get(name, {})

    def answers(self, camera: str | None = None) -> list[dict[str, Any]]:
        found = [json.loads(payload) for payload in self.results.payloads]
        return [a for a in found if camera is None or a.get("camera") == camera]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        finally:
            self.results.close()
            self.status_messages.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def run_daemon(bundle: Path, broker: Broker, tmp_path: Path) -> Iterator[Callable[..., _Daemon]]:
    made: list[_Daemon] = []

    def start(*args: str, config: str = "", metrics: bool = False, env: dict[str, str] | None = None) -> _Daemon:
        daemon = _Daemon(bundle, broker, tmp_path / f"d{len(made)}", *args, config=config, metrics=metrics, env=env)
        made.append(daemon)
        return daemon

    (tmp_path / "d0").mkdir()
    for index in range(1, 4):
        (tmp_path / f"d{index}").mkdir()
    try:
        yield start
    finally:
        for daemon in made:
            if daemon.process.poll() is None:
                daemon.process.kill()
                daemon.process.wait(10)


@pytest.mark.integration
def test_a_live_camera_answers_its_newest_frames_and_every_frame_is_accounted_for(
    run_daemon: Callable[..., _Daemon],
) -> None:
    daemon = run_daemon("--camera", "door=testsrc:?size=320x240&rate=30")
    assert wait_until(lambda: len(daemon.answers("door")) >= 60), daemon.log_text()
    assert wait_until(lambda: daemon.camera("door").get("answered", 0) >= 60), daemon.log_text()
    camera = daemon.camera("door")
    assert camera["state"] == "running" and camera["size"] == [320, 240]
    assert camera["source"] == "testsrc:?size=320x240&rate=30"
    frames = [a["frame"] for a in daemon.answers("door")]
    assert frames == sorted(set(frames))  # increasing, never twice
    in_flight = camera["frames_in"] - camera["answered"] - sum(camera["dropped"].values())
    assert 0 <= in_flight <= 2  # the one being answered and the one in the slot
    assert daemon.stop() == 0


@pytest.mark.integration
@pytest.mark.workstation  # prometheus-client (the metrics extra)
def test_each_camera_has_its_metrics_labelled_by_name(run_daemon: Callable[..., _Daemon]) -> None:
    daemon = run_daemon("--camera", "door=testsrc:?size=160x96&rate=30", "--camera", "yard=testsrc:", metrics=True)
    assert wait_until(lambda: len(daemon.answers("door")) >= 5 and len(daemon.answers("yard")) >= 5)
    text = daemon.metrics()
    for name in ("door", "yard"):
        assert _metric(text, "edgeline_camera_frames_in_total", camera=name) >= 5, text
        assert _metric(text, "edgeline_camera_state", camera=name, state="running") == 1.0
        assert _metric(text, "edgeline_camera_state", camera=name, state="failed") == 0.0
        assert _metric(text, "edgeline_camera_dropped_total", camera=name, reason="overwritten") >= 0
        assert _metric(text, "edgeline_camera_seconds", camera=name, stage="age", quantile="0.99") > 0
    assert daemon.stop() == 0


def _metric(text: str, family: str, **labels: str) -> float:
    """The value of the one sample of ``family`` with these labels (among others); -1 when there is none."""
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name == family and all(f'{key}="{value}"' in rest.split("}")[0].split(",") for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


@pytest.mark.integration
def test_an_rtsp_camera_killed_and_back_at_another_size_is_reopened_and_its_size_followed(
    run_daemon: Callable[..., _Daemon], camera_server: CameraServerFactory
) -> None:
    server = camera_server(size="320x240", fps=15)
    url = server.rtsp_url.replace("rtsp://", f"rtsp://viewer:{SECRET}@")
    daemon = run_daemon("--camera", f"gate={url}", config="[camera]\nread_timeout_s = 2\nreconnect_max_s = 1\n")
    assert wait_until(lambda: len(daemon.answers("gate")) >= 10), daemon.log_text()
    assert wait_until(lambda: daemon.camera("gate").get("size") == [320, 240]), daemon.status()
    server.kill()
    assert wait_until(lambda: daemon.camera("gate").get("state") == "reconnecting"), daemon.log_text()
    server.size = "160x120"
    server.start()
    assert waiting.wait_until(lambda: any(a["stream"] >= 2 for a in daemon.answers("gate")), 60), daemon.log_text()
    assert wait_until(lambda: daemon.camera("gate").get("state") == "running")
    camera = daemon.camera("gate")
    assert camera["size"] == [160, 120] and camera["reconnects"] >= 1
    second = [a["frame"] for a in daemon.answers("gate") if a["stream"] == camera["stream"]]
    assert second == sorted(set(second))
    assert daemon.stop() == 0
    said = daemon.log_text() + json.dumps(daemon.status()) + json.dumps(daemon.answers())
    assert SECRET not in said and "rtsp://***@127.0.0.1" in said


@pytest.mark.integration
def test_a_frozen_camera_is_a_stall_and_the_daemon_stops_at_once_whatever_a_camera_does(
    run_daemon: Callable[..., _Daemon], camera_server: CameraServerFactory, silent_server: SilentServer
) -> None:
    """A camera SIGSTOPped mid-stream is a stall (its read deadline), reopened; a camera that accepts and never
    answers stays ``connecting``; neither slows a third camera; SIGTERM ends the daemon while both are stuck."""
    server = camera_server(size="160x120", fps=15, codec="mjpeg")
    daemon = run_daemon(
        "--camera", f"frozen={server.rtsp_url}", "--camera", f"mute={silent_server.rtsp_url}",
        "--camera", "fine=testsrc:?size=160x96&rate=20",
        config="[camera]\nread_timeout_s = 2\nopen_timeout_s = 60\nreconnect_max_s = 1\n",
    )  # fmt: skip
    assert wait_until(lambda: len(daemon.answers("frozen")) >= 5), daemon.log_text()
    server.freeze()
    assert wait_until(lambda: daemon.camera("frozen").get("stalls", 0) >= 1), daemon.log_text()
    assert daemon.camera("mute")["state"] == "connecting"
    before = len(daemon.answers("fine"))
    assert wait_until(lambda: len(daemon.answers("fine")) >= before + 20)  # the others go on
    server.thaw()
    stopped_at = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - stopped_at < 30  # not the mute camera's 60 s open deadline (a hang guard)


SLOW_EXIT_C = "#include <unistd.h>\n__attribute__((destructor)) static void slow_exit(void) { usleep(800000); }\n"


@pytest.mark.integration
def test_a_daemon_stopped_while_its_cameras_are_inside_ffmpeg_exits_cleanly(
    run_daemon: Callable[..., _Daemon], silent_server: SilentServer, tmp_path: Path
) -> None:
    """PyAV calls back into Python from inside FFmpeg while a stream opens (its deadline's interrupt callback, every
    0.1 s): a camera still opening after the interpreter had shut down crashed the process (SIGSEGV in
    ``PyGILState_Ensure``; the device tier saw a clean stop end with -11 under load). A library whose destructor
    takes its time at exit, as a big runtime's may on a loaded machine, holds that window open here."""
    source = tmp_path / "slow_exit.c"
    source.write_text(SLOW_EXIT_C)
    library = tmp_path / "libslow_exit.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    cameras = [f"mute{index}" for index in range(4)]
    daemon = run_daemon(
        *(arg for name in cameras for arg in ("--camera", f"{name}={silent_server.rtsp_url}")),
        config="[camera]\nopen_timeout_s = 60\n", env={"LD_PRELOAD": str(library)},
    )  # fmt: skip
    assert wait_until(lambda: len(silent_server.connections) >= len(cameras)), daemon.log_text()  # all opening
    assert wait_until(lambda: all(daemon.camera(name).get("state") == "connecting" for name in cameras))
    assert daemon.stop() == 0, daemon.log_text()
    assert "4 camera calls still inside FFmpeg: leaving without waiting for them" in daemon.log_text()


@pytest.mark.integration
def test_snapshots_are_written_bounded_decodable_and_published(
    run_daemon: Callable[..., _Daemon], broker: Broker, tmp_path: Path
) -> None:
    published = Collector(broker, "edgeline/colour/door/snapshot")
    daemon = run_daemon(
        "--camera", "door=testsrc:?size=160x96&rate=20", "--snapshot-every", "0.1",
        "--snapshot-topic", "edgeline/{name}/{device}/snapshot",
        config="[camera]\nsnapshot_min_interval_s = 0.1\nsnapshot_max_files = 3\n",
    )  # fmt: skip
    assert wait_until(lambda: daemon.status().get("counts", {}).get("snapshots", 0) >= 6), daemon.log_text()
    assert wait_until(lambda: len(published.payloads) >= 6), daemon.log_text()
    assert daemon.stop() == 0
    jpegs = published.payloads
    published.close()
    assert len(jpegs) >= 6 and all(jpeg[:2] == b"\xff\xd8" and jpeg[-2:] == b"\xff\xd9" for jpeg in jpegs)
    folder = tmp_path / "d0" / "state" / "colour" / "snapshots"
    images = sorted(folder.glob("door-*.jpg"))
    assert 1 <= len(images) <= 3
    import av

    with av.open(str(images[-1])) as container:
        picture = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert picture.shape[:2] == (96, 160)
    record = json.loads(images[-1].with_suffix(".json").read_text())
    assert record["camera"] == "door" and record["label"] in LABELS


@pytest.mark.integration
def test_while_answers_cannot_leave_live_frames_are_dropped_as_backpressure(
    run_daemon: Callable[..., _Daemon], broker: Broker
) -> None:
    daemon = run_daemon(
        "--camera", "door=testsrc:?size=160x96&rate=30", config="[outbox]\nmax_answers = 20\nenabled = false\n"
    )
    assert wait_until(lambda: len(daemon.answers("door")) >= 5), daemon.log_text()
    broker.stop()  # the answers wait in the outbox until it is full: the intake gate shuts
    # nothing to tell while the broker is away: wait for the daemon to say the gate shut, then bring it back
    assert wait_until(lambda: "intake paused" in daemon.log_text()), daemon.log_text()
    broker.restart()
    assert wait_until(lambda: daemon.camera("door").get("dropped", {}).get("backpressure", 0) > 0), daemon.status()
    assert wait_until(lambda: daemon.camera("door").get("answered", 0) > 25)  # and answering again
    assert daemon.stop() == 0


@pytest.mark.quick
def test_parse_camera_names_default_in_order() -> None:
    assert [parse_camera(t, i).name for i, t in enumerate(["testsrc:", "door=testsrc:", "testsrc:"])] == [
        "cam0", "door", "cam2",
    ]  # fmt: skip


class _PacedMjpegServer(StallingMjpegServer):
    """HTTP MJPEG: the frames of one size, then of another, 10 a second, on one connection; then silence."""

    def __init__(self, first: tuple[int, int], then: tuple[int, int], frames: int) -> None:
        super().__init__(frames, first)
        self.jpegs += StallingMjpegServer(frames, then).jpegs

    def serve(self, connection: Any) -> None:
        threading.Thread(target=self._send, args=(connection,), daemon=True).start()

    def _send(self, connection: Any) -> None:
        try:
            connection.recv(4096)
            head = f"HTTP/1.0 200 OK\r\nContent-Type: multipart/x-mixed-replace; boundary={self.boundary}\r\n\r\n"
            connection.sendall(head.encode())
            for jpeg in self.jpegs:
                part = f"--{self.boundary}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
                connection.sendall(part.encode() + jpeg + b"\r\n")
                if self.stopped.wait(0.1):
                    return
        except OSError:
            return


@pytest.mark.integration
def test_an_http_camera_that_stops_mid_stream_is_a_stall_reopened_and_a_size_change_is_followed(
    run_daemon: Callable[..., _Daemon],
) -> None:
    """A server that sends frames of one size, then of another, then nothing with the socket open: every frame of
    both sizes is pre-processed and answered as it comes, the silence is a stall, and the camera is reopened (the
    server sends it all again: stream 2)."""
    server = _PacedMjpegServer((320, 240), (160, 96), frames=15)
    server.start()
    try:
        daemon = run_daemon(
            "--camera", f"shelf={server.http_url}", config="[camera]\nread_timeout_s = 1\nreconnect_max_s = 0.5\n"
        )
        assert wait_until(lambda: any(a["stream"] >= 2 for a in daemon.answers("shelf"))), daemon.log_text()
        assert wait_until(lambda: daemon.camera("shelf").get("stalls", 0) >= 1)
        first = [a for a in daemon.answers("shelf") if a["stream"] == 1]
        assert len(first) >= 20 and [a["frame"] for a in first] == sorted({a["frame"] for a in first})
        assert first[-1]["frame"] >= 25  # frames of the second size were answered too
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.log_text()
    finally:
        server.stop()


@pytest.mark.quick
def test_frames_follow_the_version_answering_now(bundle: Path, built_litert_bundle: Path) -> None:
    """After an update's swap, frames are made into the new version's input (its own pre-processing), or refused
    by name when it takes none (each such frame counted ``corrupt`` by the camera, which goes on)."""
    from types import SimpleNamespace

    from edgeline import load
    from edgeline.daemon.assembly import _FramePrepOfTheRunningVersion

    processor = SimpleNamespace(model=load(bundle))
    prep = _FramePrepOfTheRunningVersion(processor)  # type: ignore[arg-type]
    frame = np.zeros((48, 64, 3), np.uint8)
    assert prep(frame, "rgb").shape == (1, 3, 16, 16)
    processor.model = load(built_litert_bundle)
    with pytest.raises(EdgelineError, match="does not say how a frame becomes its input"):
        prep(frame, "rgb")
    processor.model = load(bundle)
    assert prep(frame, "rgb").shape == (1, 3, 16, 16)
