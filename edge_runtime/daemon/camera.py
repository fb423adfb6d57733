"""Cameras and video as a source: the latest frame first, every wait bounded, every drop counted.

One ``CameraFeed`` per camera, each with two threads of its own, so one stuck camera never slows another:

    reader thread   open (bounded by open_timeout_s) ──► read frames (each read bounded by read_timeout_s) into
                    the camera's slot ──► a timeout, an ended live stream, no frame for stall_s: close, and open
                    again after the daemon's back-off (0.25 s doubling to reconnect_max_s, with jitter)
    pump thread     waits until the camera's previous frame is answered, takes the newest frame from the slot,
                    pre-processes it (the bundle's own ``edgeline.imaging.FramePrep``) and queues it as arrays

Live sources (RTSP, HTTP, V4L2, picamera2, testsrc) keep **one** frame: a frame the model had no time for is
overwritten and counted ``overwritten``, never queued, so the delay cannot grow. A frame older than ``max_age_ms``
when the model is free is dropped ``stale``; while the answers cannot leave (the outbox is full, the intake gate
shut), frames are dropped ``backpressure``. A file or a folder of images is a replay: every frame once, in order,
none dropped; the pump keeps at most ``[queue] max_batch`` of its frames in the queue (batches, bounded memory).

States (the status message's ``cameras``): ``connecting`` (first open), ``running``, ``reconnecting`` (a live source
lost, waiting or opening again), ``ended`` (a file that ended), ``failed`` (a source that can never work here: an
unknown scheme, a file that is not a video, the camera extra missing). A daemon whose cameras have all ended or
failed stops: exit 0 when every one ended, 1 when one failed (systemd restarts it).

Stopping never waits on a camera: the threads are daemon threads, and ``run`` returns when ``stopping`` is set
whatever a reader is blocked in (an open against a frozen server ends by its own deadline, after we left).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edgeline.daemon.config import CameraConfig, SourceConfig, camera_speed
from edgeline.daemon.health import Metrics, percentiles
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.queueing import QueueClosed
from edgeline.daemon.reconnect import Retry
from edgeline.daemon.snapshots import Snapshots
from edgeline.daemon.sources import SourceBase, Submit
from edgeline.daemon.topics import TopicFilter
from edgeline.errors import EdgelineError, PayloadError
from edgeline.lograte import Repeated
from edgeline.video import CameraError, CameraSpec, Frame, FrameReader, Pixel, open_reader, parse_camera

__all__ = ["DROP_REASONS", "STATES", "CameraFeed", "CameraSource"]

log = logging.getLogger("edgeline.camera")

STATES = ("connecting", "running", "reconnecting", "ended", "failed")
DROP_REASONS = ("overwritten", "stale", "backpressure", "corrupt")
NEVER_WORKS = ("unsupported", "missing-extra", "not-a-video")
"""Open failures that no retry can mend: the camera is ``failed``."""
RETRY_FIRST_S = 0.25
RECENT = 1024
"""Timings kept per camera and stage for the percentiles (the last this many frames)."""
Opener = Callable[..., FrameReader]
Prep = Callable[[np.ndarray, Pixel], np.ndarray]


def _said(exc: Exception) -> str:
    """An exception as one line of the log: ours as it is (it names the camera), a library's with its type."""
    return str(exc) if isinstance(exc, CameraError) else f"{type(exc).__name__}: {exc}"


class _Recent:
    """The last ``RECENT`` samples of one timing, in seconds, and their percentiles (``health.percentiles``)."""

    def __init__(self) -> None:
        self.values: deque[float] = deque(maxlen=RECENT)

    def add(self, seconds: float) -> None:
        self.values.append(max(0.0, seconds))

    def percentiles(self) -> tuple[float | None, float | None]:
        return percentiles(np.fromiter(self.values, np.float64, len(self.values)))


class CameraFeed:
    """One camera: its reader and pump threads, its slot, its state and numbers (see the module)."""

    def __init__(
        self,
        spec: CameraSpec,
        settings: CameraConfig,
        prep: Prep,
        *,
        max_batch: int = 16,
        opener: Opener = open_reader,
        snapshots: Snapshots | None = None,
    ):
        self.spec = spec
        self.name = spec.name
        self.settings = settings
        self.prep = prep
        self.opener = opener
        self.snapshots = snapshots
        self.live = spec.live
        self.speed = 0.0 if spec.live else camera_speed(settings.speed)
        self.state = "connecting"
        self.last_error: str | None = None
        self.stream = 0
        """Streams opened so far (the answers' ``stream``: frame numbers are contiguous within one)."""
        self.width: int | None = None
        self.height: int | None = None
        self.pixel: Pixel | None = None
        self.counts: Counter[str] = Counter(frames_in=0, answered=0, reconnects=0, stalls=0, corrupt=0)
        self.dropped: Counter[str] = Counter(dict.fromkeys(DROP_REASONS, 0))
        self.timings = {stage: _Recent() for stage in ("decode", "preprocess", "inference", "age")}
        self._lock = threading.Condition()
        self._slot: Frame | None = None
        self._ended = False
        self._in_flight = 0
        self._limit = 1 if spec.live else max(1, max_batch)
        self.problems = Repeated(log, f"camera {self.name}: cannot read {spec.shown}")
        self.done = threading.Event()
        """Set when the camera ended or failed (a live camera only fails: it never ends by itself)."""
        self._gate: Callable[[], bool] = lambda: True

    # -- reader thread ---------------------------------------------------------------------------------------
    def read_loop(self, stopping: threading.Event) -> None:
        retry = Retry(RETRY_FIRST_S, self.settings.reconnect_max_s, jitter=True)
        try:
            while not stopping.is_set():
                reader = self._open(stopping, retry)
                if reader is None:
                    return
                try:
                    if self._read_stream(reader, stopping, retry):
                        return
                finally:
                    reader.close()
        finally:
            with self._lock:
                self._ended = True
                self._lock.notify_all()

    def _open(self, stopping: threading.Event, retry: Retry) -> FrameReader | None:
        """The source opened, or None when it can never be (``failed``) or the daemon is stopping."""
        while not stopping.is_set():
            try:
                reader = self.opener(
                    self.spec, open_timeout_s=self.settings.open_timeout_s,
                    read_timeout_s=self.settings.read_timeout_s, stall_s=self.settings.stall_s,
                )  # fmt: skip
            except Exception as exc:  # CameraError, or a library's own failure: tried again like a lost connection
                if not self.live or (isinstance(exc, CameraError) and exc.reason in NEVER_WORKS):
                    self._fail(_said(exc))
                    return None
                self._lost(_said(exc), retry, stopping)
                continue
            if stopping.is_set():
                reader.close()
                return None
            self.stream += 1
            self.width, self.height, self.pixel = reader.width, reader.height, reader.pixel
            if self.state != "connecting":
                log.info(
                    "camera %s: %s open again (%dx%d %s)", self.name, self.spec.shown, reader.width, reader.height,
                    reader.pixel,
                )  # fmt: skip
            self.state = "running"
            self.last_error = None
            return reader
        return None

    def _read_stream(self, reader: FrameReader, stopping: threading.Event, retry: Retry) -> bool:
        """Frames of one opened stream into the slot. True: the camera is done (ended, failed or stopping)."""
        corrupt_seen = 0
        started: float | None = None
        first_time: float | None = None
        while not stopping.is_set():
            began = time.monotonic()
            try:
                frame = reader.read()
            except Exception as exc:  # CameraError (a timeout, a broken stream), or a library's own failure
                self._note_corrupt(reader, corrupt_seen)
                if not self.live:  # a replay that breaks: what decoded was answered; the rest cannot be
                    self._fail(_said(exc))
                    return True
                if isinstance(exc, CameraError) and exc.reason == "timeout":
                    self.counts["stalls"] += 1
                self._lost(_said(exc), retry, stopping)
                return stopping.is_set()
            corrupt_seen = self._note_corrupt(reader, corrupt_seen)
            now = time.monotonic()
            if frame is None:
                if self.live:  # a live source does not end: it was lost
                    self._lost("the stream ended", retry, stopping)
                    return stopping.is_set()
                self.state = "ended"
                log.info("camera %s: %s ended after %d frames", self.name, self.spec.shown, self.counts["frames_in"])
                return True
            self.timings["decode"].add(now - began)
            self.height, self.width = frame.array.shape[:2]  # a size that changes mid-stream is followed
            retry.reset()
            if self.live:
                self._put_latest(frame)
                continue
            if self.speed > 0 and frame.source_time is not None:  # a replay at the file's own pace
                if started is None or first_time is None:
                    started, first_time = now, frame.source_time
                stopping.wait(max(0.0, started + (frame.source_time - first_time) / self.speed - time.monotonic()))
            if not self._put_next(frame, stopping):
                return True
        return True

    def _note_corrupt(self, reader: FrameReader, seen: int) -> int:
        corrupt = reader.corrupt
        if corrupt > seen:
            with self._lock:  # a frame the decoder refused came in, and is dropped: frames in = answered + dropped
                self.counts["frames_in"] += corrupt - seen
                self.counts["corrupt"] += corrupt - seen
                self.dropped["corrupt"] += corrupt - seen
            self.problems.happened(corrupt - seen, "undecodable frames skipped")
        return corrupt

    def _put_latest(self, frame: Frame) -> None:
        with self._lock:  # counted with the frame it overwrites: the status reads both at one moment
            self.counts["frames_in"] += 1
            if self._slot is not None:
                self.dropped["overwritten"] += 1
            self._slot = frame
            self._lock.notify_all()

    def _put_next(self, frame: Frame, stopping: threading.Event) -> bool:
        """A replay's frame, once the previous one was taken (none dropped). False: stopping."""
        with self._lock:
            while self._slot is not None:
                if stopping.is_set():
                    return False
                self._lock.wait(0.2)
            self.counts["frames_in"] += 1
            self._slot = frame
            self._lock.notify_all()
        return True

    def _lost(self, why: str, retry: Retry, stopping: threading.Event) -> None:
        delay = retry.next_delay()
        first = self.state == "connecting"
        self.state = "connecting" if first else "reconnecting"
        if not first:
            self.counts["reconnects"] += 1
        self.last_error = why
        self.problems.happened(1, f"{why}; trying again in {delay:.2f} s")
        stopping.wait(delay)

    def _fail(self, why: str) -> None:
        self.state = "failed"
        self.last_error = why
        log.error("camera %s: %s", self.name, why)

    # -- pump thread -----------------------------------------------------------------------------------------
    def pump(self, submit: Submit, stopping: threading.Event) -> None:
        """Frames from the slot into the daemon's queue, as the model frees up (see the module)."""
        try:
            while not stopping.is_set():
                frame = self._take(stopping)
                if frame is None:
                    return
                try:
                    self._submit(frame, submit)
                except QueueClosed:
                    return
                except Exception as exc:  # a bug of ours must cost one frame, not the camera
                    self.problems.happened(1, f"a frame could not be queued: {type(exc).__name__}: {exc}")
        finally:
            self.done.set()

    def _take(self, stopping: threading.Event) -> Frame | None:
        """The next frame to queue: once fewer than the limit are in flight, the newest in the slot. None: the
        camera is done (and nothing is left in its slot), or stopping."""
        with self._lock:
            while not stopping.is_set():
                if self._in_flight < self._limit and self._slot is not None:
                    frame, self._slot = self._slot, None
                    self._lock.notify_all()
                    return frame
                if self._ended and self._slot is None and (self._in_flight == 0 or not self.live):
                    return None
                self._lock.wait(0.2)
        return None

    def _submit(self, frame: Frame, submit: Submit) -> None:
        now = time.monotonic()
        if self.live and self.settings.max_age_ms > 0 and (now - frame.captured) * 1000.0 > self.settings.max_age_ms:
            self.dropped["stale"] += 1
            return
        if self.live and not self._gate():  # the answers cannot leave: a live frame is not kept waiting
            self.dropped["backpressure"] += 1
            return
        try:
            array = self.prep(frame.array, frame.pixel)
        except (PayloadError, EdgelineError) as exc:  # not an image; or a version swapped in that takes no frames
            self.dropped["corrupt"] += 1
            self.problems.happened(1, f"a frame cannot be pre-processed: {exc}")
            return
        self.timings["preprocess"].add(time.monotonic() - now)
        fields: dict[str, Any] = {"camera": self.name, "stream": self.stream, "frame": frame.index}
        if frame.source_time is not None:
            fields["source_time"] = round(frame.source_time, 6)
        with self._lock:
            self._in_flight += 1
        message = Message(
            topic=f"camera/{self.name}", payload=b"", device=self.name, arrays=(array,), fields=fields,
            captured=frame.captured, frame_size=(int(frame.array.shape[0]), int(frame.array.shape[1])),
            on_answers=lambda answers: self._answered(frame, answers),
        )  # fmt: skip
        try:
            submit(message)
        except BaseException:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()
            raise

    def _answered(self, frame: Frame, answers: list[Answer]) -> None:
        """The worker handed the frame's answers to the sinks (its thread): the next frame may go."""
        now = time.monotonic()
        with self._lock:
            self._in_flight -= 1
            self.counts["answered"] += 1
            self._lock.notify_all()
        self.timings["age"].add(now - frame.captured)
        for answer in answers:
            latency = answer.record.get("latency_ms")
            if isinstance(latency, int | float):
                self.timings["inference"].add(latency / 1000.0)
            if self.snapshots is not None and not answer.is_error:
                self.snapshots(self.name, frame, answer)
                break

    # -- what the status and the metrics read ----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:  # one moment: frames in = answered + dropped + the frames in the slot and in flight
            counts, dropped = dict(self.counts), dict(self.dropped)
        timings: dict[str, Any] = {}
        for stage, recent in self.timings.items():
            timings[f"{stage}_ms"] = dict(zip(("p50", "p99"), map(_ms, recent.percentiles()), strict=True))
        status: dict[str, Any] = {
            "state": self.state,
            "source": self.spec.shown,
            "live": self.live,
            "stream": self.stream,
            "size": None if self.width is None else [self.width, self.height],
            "pixel": self.pixel,
            **{key: int(value) for key, value in counts.items()},
            "dropped": {reason: int(dropped[reason]) for reason in DROP_REASONS},
            **timings,
        }
        if self.last_error is not None:
            status["last_error"] = self.last_error
        return status


class CameraSource(SourceBase):
    """Every ``--camera`` of a daemon, as its one source (see the module). Its settings are the ``[camera]`` section
    (``camera.sources`` is checked with it), not ``[source]``."""

    @classmethod
    def lossless(cls, settings: SourceConfig) -> bool:
        """The block policy: the source keeps at most a few frames in the queue itself, a live camera drops what the
        model cannot take (counted by reason), a file or image folder waits."""
        return True

    @classmethod
    def from_config(cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int) -> None:
        """Made by the daemon (``edgeline.daemon.assembly``): each frame is made into the model's input by the
        bundle's own pre-processing, which the daemon has opened."""
        return None

    def __init__(
        self,
        settings: CameraConfig,
        prep: Prep,
        *,
        max_batch: int = 16,
        opener: Opener = open_reader,
        snapshots: Snapshots | None = None,
    ):
        self.snapshots = snapshots
        specs = [parse_camera(text, index) for index, text in enumerate(settings.sources)]
        names = [spec.name for spec in specs]
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise EdgelineError(f"--camera: the name {doubled[0]!r} is given to two cameras; name them NAME=SOURCE")
        self.feeds = [
            CameraFeed(spec, settings, prep, max_batch=max_batch, opener=opener, snapshots=snapshots) for spec in specs
        ]
        self.finite = all(not feed.live for feed in self.feeds)
        shown = ", ".join(f"{spec.name}={spec.shown}" for spec in specs)
        self.description = f"camera{'s' if len(specs) > 1 else ''} {shown}"

    def attach_gate(self, is_open: Callable[[], bool]) -> None:
        """Whether answers can leave now (the intake gate): a live frame is dropped ``backpressure`` when not."""
        for feed in self.feeds:
            feed._gate = is_open

    def open(self) -> None:
        """No camera is opened here: one that is slow to answer must not hold the daemon's start (sources that can
        never work, an unknown scheme, were refused when the source was made). The snapshots' folder is."""
        if self.snapshots is not None:
            self.snapshots.start()

    def run(self, submit: Submit, stopping: threading.Event) -> None:
        for feed in self.feeds:
            for role, target in (("read", feed.read_loop), ("pump", lambda f=feed: f.pump(submit, stopping))):
                name = f"edgeline-camera-{feed.name}-{role}"
                args = (stopping,) if role == "read" else ()
                threading.Thread(target=target, args=args, name=name, daemon=True).start()
        try:
            while not stopping.wait(0.2):
                if all(feed.done.is_set() for feed in self.feeds):
                    break
        finally:
            if self.snapshots is not None:
                self.snapshots.stop()
        failed = [feed for feed in self.feeds if feed.state == "failed"]
        if failed and not stopping.is_set():
            names = ", ".join(f"{feed.name} ({feed.last_error})" for feed in failed)
            raise EdgelineError(f"camera{'s' if len(failed) > 1 else ''} failed: {names}")

    def counters(self) -> dict[str, int]:
        """Every camera's frames summed (``camera_frames_in``, ``camera_dropped_overwritten``...) and the snapshots';
        each camera's own are in ``cameras`` and in the labelled metrics."""
        totals: Counter[str] = Counter()
        for feed in self.feeds:
            totals.update({f"camera_{key}": value for key, value in feed.counts.items()})
            totals.update({f"camera_dropped_{key}": value for key, value in feed.dropped.items()})
        if self.snapshots is not None:
            totals.update(self.snapshots.counts)
        return dict(totals)

    def report(self) -> dict[str, Any]:
        """The status message's ``cameras``: each camera's state and numbers."""
        return {"cameras": {feed.name: feed.status() for feed in self.feeds}}

    def register_metrics(self, metrics: Metrics) -> None:
        feeds = self.feeds
        for key, help_text in (
            ("frames_in", "Frames decoded, by camera."),
            ("answered", "Frames answered, by camera."),
            ("reconnects", "Camera sources reopened after a loss, by camera."),
            ("stalls", "Camera reads that timed out or yielded no frame for stall_s, by camera."),
        ):
            metrics.labelled_counters(f"camera_{key}", "camera", help_text, _by_camera(feeds, key))
        metrics.labelled_counters(
            "camera_dropped", ("camera", "reason"), "Frames dropped, by camera and reason.",
            lambda: {(f.name, reason): int(f.dropped[reason]) for f in feeds for reason in DROP_REASONS},
        )  # fmt: skip
        metrics.labelled_gauges(
            "camera_state", ("camera", "state"), "1 for the state each camera is in.",
            lambda: {(f.name, state): float(f.state == state) for f in feeds for state in STATES},
        )  # fmt: skip
        metrics.labelled_gauges(
            "camera_seconds", ("camera", "stage", "quantile"),
            "Per frame, over the last 1024: decode, preprocess, inference, and age (capture to answer), p50 and p99.",
            lambda: _quantiles(feeds),
        )  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _by_camera(feeds: Sequence[CameraFeed], key: str) -> Callable[[], dict[str, int]]:
    return lambda: {feed.name: int(feed.counts[key]) for feed in feeds}


def _quantiles(feeds: Sequence[CameraFeed]) -> dict[tuple[str, str, str], float | None]:
    values: dict[tuple[str, str, str], float | None] = {}
    for feed in feeds:
        for stage, recent in feed.timings.items():
            values[(feed.name, stage, "0.5")], values[(feed.name, stage, "0.99")] = recent.percentiles()
    return values
