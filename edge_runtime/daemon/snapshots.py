"""Snapshots of a camera: a JPEG of an answered frame, now and then or when an answer says so.

    [camera] snapshot_every_s = 60          one per camera at most this often
             snapshot_when = "label=person,score>=0.8"   and/or when an answer meets every condition
             snapshot_min_interval_s = 1    never two of one camera closer than this, whatever asks
             snapshot_topic = "edgeline/{name}/{device}/snapshot"   published there too (QoS 0, the JPEG bytes)
             snapshot_files = true, snapshot_max_files = 200, snapshot_max_bytes = 50 MiB

Files go to ``<state dir>/snapshots/<camera>-<UTC time>-<frame>-<label>.jpg`` with the answer beside it as
``.json``; the oldest are removed past either bound. They are written with ``edgeline.durable`` (a fresh file,
renamed into place; nothing planted there is followed). The JPEG is the frame as the camera gave it, with the
answer drawn by ``edgeline.annotate`` (as ``edgeline infer --annotate`` draws it): a bar at its top with the camera,
the frame and the top label and score (or the number of detections), and a detector's boxes, each with its label and
score (the text with Pillow where it is installed; without it the bar and the labels' patches are plain, and the
label is in the file name and the ``.json``).

Encoding runs on a thread of its own, one snapshot at a time: a snapshot that comes while another is being
written is skipped (counted ``snapshots_skipped``), so the worker that answers frames never waits on a JPEG.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.annotate import annotate, answer_caption
from edgeline.daemon.config import CameraConfig
from edgeline.daemon.messages import Answer
from edgeline.durable import ensure_directory, remove_file, write_atomically
from edgeline.errors import EdgelineError
from edgeline.lograte import Repeated
from edgeline.video import Frame

__all__ = ["Snapshots", "encode_jpeg", "parse_condition"]

log = logging.getLogger("edgeline.camera")

SNAPSHOT_DIR = "snapshots"
Publish = Callable[[str, str, bytes], None]
"""(camera, topic, jpeg): publish one snapshot."""


def parse_condition(text: str | None) -> tuple[str | None, float | None]:
    """``label=NAME`` and/or ``score>=X``: (label, minimum score); the configuration has checked the form."""
    label: str | None = None
    score: float | None = None
    for part in (text or "").split(","):
        if part.startswith("label="):
            label = part[len("label=") :]
        elif part.startswith("score>="):
            score = float(part[len("score>=") :])
    return label, score


def encode_jpeg(array: np.ndarray, pixel: str, quality: int = 5) -> bytes:
    """An RGB, BGR or gray uint8 image as JPEG bytes (PyAV's MJPEG encoder; ``quality`` is its qscale, 2-31)."""
    try:
        import av
    except ImportError as exc:
        raise EdgelineError("snapshots need the camera extra: pip install 'edgeline[camera]'") from exc
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    height, width = array.shape[:2]
    image = np.ascontiguousarray(array[: height - height % 2, : width - width % 2])
    fmt = "gray" if image.ndim == 2 else ("bgr24" if pixel == "bgr" else "rgb24")
    frame = av.VideoFrame.from_ndarray(image, format=fmt).reformat(format="yuvj420p")
    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height = image.shape[1], image.shape[0]
    codec.pix_fmt = "yuvj420p"
    codec.time_base = Fraction(1, 30)
    codec.options = {"qscale": str(quality)}
    codec.flags |= av.codec.context.Flags.qscale
    codec.global_quality = quality * 118  # FF_QP2LAMBDA
    packets = [*codec.encode(frame), *codec.encode(None)]
    return b"".join(bytes(packet) for packet in packets)


def _annotated(frame: Frame, record: dict[str, Any]) -> np.ndarray:
    """The frame with the answer drawn: a bar at its top (camera, frame, answer) and a detector's boxes."""
    return annotate(frame.array, record, pixel=frame.pixel, caption=_caption(record))


def _caption(record: dict[str, Any]) -> str:
    parts = [str(record.get("camera", "")), f"frame {record.get('frame', '')}", answer_caption(record)]
    return "  ".join(part for part in parts if part)[:120]


class Snapshots:
    """Decides, encodes, writes and publishes the snapshots of every camera of a daemon (see the module)."""

    def __init__(self, settings: CameraConfig, state_dir: Path | None, publish: Publish | None = None):
        self.settings = settings
        self.directory = state_dir / SNAPSHOT_DIR if state_dir is not None and settings.snapshot_files else None
        self.state_dir = state_dir
        self.publish = publish
        self.label, self.min_score = parse_condition(settings.snapshot_when)
        self.counts = {"snapshots": 0, "snapshots_skipped": 0, "snapshots_failed": 0}
        self._last: dict[str, float] = {}
        self._last_periodic: dict[str, float] = {}
        self._work: queue.Queue[tuple[str, Frame, dict[str, Any]] | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self.failures = Repeated(log, "snapshots failed")

    def start(self) -> None:
        if self.directory is not None:
            assert self.state_dir is not None
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                ensure_directory(self.directory, within=self.state_dir)
            except OSError as exc:
                raise EdgelineError(f"snapshots: cannot make {self.directory}: {exc.strerror or exc}") from exc
        self._thread = threading.Thread(target=self._run, name="edgeline-snapshots", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with contextlib.suppress(queue.Full):
            self._work.put_nowait(None)

    def wanted(self, camera: str, record: dict[str, Any], now: float) -> bool:
        """Whether this answer of ``camera`` makes a snapshot now (and, if so, notes that it did)."""
        last = self._last.get(camera)
        if last is not None and now - last < self.settings.snapshot_min_interval_s:
            return False
        conditional = self.label is not None or self.min_score is not None
        met = conditional
        if self.label is not None and record.get("label") != self.label:
            met = False
        score = record.get("score")
        if self.min_score is not None and not (isinstance(score, int | float) and score >= self.min_score):
            met = False
        periodic = False
        every = self.settings.snapshot_every_s
        if every > 0:
            previous = self._last_periodic.get(camera)
            periodic = previous is None or now - previous >= every
        if not (met or periodic):
            return False
        self._last[camera] = now
        if periodic:
            self._last_periodic[camera] = now
        return True

    def __call__(self, camera: str, frame: Frame, answer: Answer) -> None:
        """The worker thread, for every answered frame: cheap unless a snapshot is due."""
        if not self.wanted(camera, answer.record, time.monotonic()):
            return
        try:
            self._work.put_nowait((camera, frame, dict(answer.record)))
        except queue.Full:
            self.counts["snapshots_skipped"] += 1

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            camera, frame, record = item
            try:
                self._take(camera, frame, record)
                self.counts["snapshots"] += 1
            except Exception as exc:  # a full disk, a planted link: said, counted, the cameras go on
                self.counts["snapshots_failed"] += 1
                self.failures.happened(1, f"camera {camera}: {type(exc).__name__}: {exc}")

    def _take(self, camera: str, frame: Frame, record: dict[str, Any]) -> None:
        jpeg = encode_jpeg(_annotated(frame, record), frame.pixel)
        if self.directory is not None:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            label = re.sub(r"[^A-Za-z0-9._-]", "_", str(record.get("label", "")))[:40]
            stem = f"{camera}-{stamp}-{frame.index:08d}" + (f"-{label}" if label else "")
            write_atomically(self.directory / f"{stem}.jpg", jpeg)
            write_atomically(self.directory / f"{stem}.json", json.dumps(record, default=str).encode())
            self._prune()
        if self.publish is not None and self.settings.snapshot_topic is not None:
            self.publish(camera, self.settings.snapshot_topic, jpeg)

    def _prune(self) -> None:
        """The oldest snapshots removed past ``snapshot_max_files`` or ``snapshot_max_bytes``."""
        assert self.directory is not None
        entries = []
        for path in self.directory.iterdir():
            if path.suffix not in (".jpg", ".json") or path.name.startswith("."):
                continue
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            entries.append((info.st_mtime, path.name, path, info.st_size))
        entries.sort()
        total = sum(size for *_, size in entries)
        images = sum(1 for *_, path, _ in entries if path.suffix == ".jpg")
        for _, _, path, size in entries:
            if images <= self.settings.snapshot_max_files and total <= self.settings.snapshot_max_bytes:
                break
            if remove_file(path):
                total -= size
                images -= path.suffix == ".jpg"
