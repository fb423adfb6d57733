"""The daemon's source for boards on the framed protocol: ``edgeline run BUNDLE --serial URL --serial-protocol frames``.

Every sample of a ``SAMPLES`` frame becomes one input of the daemon, in its own JSON payload format
(``{"id", "data"}``), of device ``HELLO.device`` and stream ``HELLO.streams[].name`` (windows are kept per device and
stream), on topic ``sensors/{device}/{stream}`` (as ``edgeline bridge`` would publish it). Its answers go where the
daemon sends answers (stdout, the broker) and back down to the board as ``ANSWER`` frames. In reliable mode the
frame's ``ACK`` goes out once its answers are safe (committed to the outbox, or handed to every sink).

Every answer the daemon owes fits in the queue to the board: the source hands the daemon at most ``MAX_OWED`` inputs
whose answers are not written down yet (answered or not); past it, it waits (the board's frames wait in the port, and
a reliable board's window fills) until answers leave. So a board that reads loses no answer however fast it sends,
and a board that does not read is found as before (its port takes no byte of a frame for the write timeout: what
waits for it is dropped, counted ``answers_unsent``), which frees the room. An answer goes down only to the session
of its input (``BoardLink.answer(..., session=)``): never to a board that restarted since.

The link's counters (frames, bytes, CRC errors, resyncs, sequence gaps, board restarts, refused frames) are the
daemon's counters ``serial_*`` (status message and ``/metrics``), and the board itself is in the status message.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import orjson

from edgeline.daemon.config import SourceConfig
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.sources import SourceBase
from edgeline.daemon.topics import SENSOR_TOPIC, TopicFilter
from edgeline.firmware_bridge.link import Board, BoardLink, StreamSpec, input_id
from edgeline.firmware_bridge.protocol import Frame
from edgeline.lograte import Repeated, shown

__all__ = ["MAX_OWED", "FramesSource", "sample_payload"]

log = logging.getLogger("edgeline.source")

MAX_OWED = 1024
"""Inputs handed to the daemon whose answers are not written to the board yet, at most: the daemon owes them
(queued, in flight) or they wait in the queue to the board. Each is one ANSWER frame (at most 4,114 bytes, a few
hundred as a rule) and, from a reliable board, at most one ACK."""
DOWNLINK_ROOM = 2 * MAX_OWED + 64
"""The queue to the board: an answer and an ACK for every input owed, and room for the link's own frames."""
STALLED_S = 60.0
"""An input waits for room at most this long without any answer leaving (a daemon that stopped answering is the
supervisor's to find): then it is handed on all the same, and its answer may find the queue full (counted)."""
_ROOM_POLL_S = 0.02

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def sample_payload(identity: str, sample: np.ndarray) -> bytes:
    """One sample in the daemon's json codec, ``{"id": ..., "data": [...]}``, serialised in C (no Python loop).

    orjson writes NaN and Inf as ``null``, which the daemon would answer ``wrong-dtype``: a sample holding one is
    written by Python's json instead, as ``NaN``/``Infinity``, which the daemon answers ``non-finite``."""
    if sample.dtype.kind == "f" and not np.isfinite(sample).all():
        return json.dumps({"id": identity, "data": sample.tolist()}).encode()
    return orjson.dumps({"id": identity, "data": np.ascontiguousarray(sample)}, option=_NUMPY)


class FramesSource(SourceBase):
    """Boards on one serial port (see the module); what its link counted and the board it talks to are the
    daemon's ``counters`` and ``status``. Made by the serial source for ``protocol = "frames"``
    (``edgeline.daemon.sources.SERIAL_PROTOCOLS``), which answers for it what the configuration asks."""

    @classmethod
    def from_config(
        cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int
    ) -> FramesSource:
        assert settings.url is not None  # the serial source's ``needs``
        return cls(settings.url, baudrate=settings.baudrate, device=settings.device)

    def __init__(self, url: str, *, baudrate: int, device: str | None = None):
        self.link = BoardLink(url, self, baudrate=baudrate, downlink_frames=DOWNLINK_ROOM)
        self.description = f"framed serial {url} at {baudrate} baud (the board named by its HELLO)"
        if device is not None:
            log.info("--device %s is not used with frames: the board's HELLO names it", device)
        self._submit: Callable[[Message], None] | None = None
        self._stopping: threading.Event | None = None
        self._owed = 0
        """Inputs handed to the daemon whose ``on_answers`` has not come yet."""
        self._owed_changed = threading.Condition()
        self._stalled_log = Repeated(log, f"framed serial {url}: inputs handed on without room for their answers")
        self._results_log = Repeated(log, "boards' own results", level=logging.DEBUG, every_s=10.0)

    def open(self) -> None:
        self.link.open()

    def run(self, submit: Callable[[Message], None], stopping: threading.Event) -> None:
        self._submit, self._stopping = submit, stopping
        self.link.run(stopping)

    # -- LinkHandler -------------------------------------------------------------------------------------------
    def on_hello(self, link: BoardLink, board: Board, restarted: bool) -> None:
        """Nothing to do: the link has named the board and reset its streams' sequence numbers."""

    def on_samples(
        self, link: BoardLink, board: Board, stream: StreamSpec, frame: Frame, samples: np.ndarray,
        safe: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        submit = self._submit
        assert submit is not None, "on_samples before run()"
        topic = SENSOR_TOPIC.format(device=board.device, sensor=stream.name)
        down = partial(self._answer_down, link, frame.stream, frame.seq, link.session)
        for index, sample in enumerate(samples):
            payload = sample_payload(input_id(frame.stream, frame.seq, index, frame.t_us, board.boot), sample)
            self._wait_for_room(link)
            with self._owed_changed:
                self._owed += 1
            try:
                submit(
                    Message(
                        topic=topic, payload=payload, device=board.device, stream=stream.name, ack=safe[index],
                        on_answers=down,
                    )
                )  # fmt: skip
            except BaseException:  # not taken (the daemon stops): nothing owed for it
                self._settled()
                raise

    def _wait_for_room(self, link: BoardLink) -> None:
        """Until the answer of one more input fits (see the module): while any answer leaves, or until stopping."""
        owing_before, since = -1, time.monotonic()
        with self._owed_changed:
            while not (self._stopping is not None and self._stopping.is_set()):
                owing = self._owed + link.downlink_queued
                if owing < MAX_OWED:
                    return
                if owing != owing_before:
                    owing_before, since = owing, time.monotonic()
                elif time.monotonic() - since > STALLED_S:
                    self._stalled_log.happened(
                        1, f"{owing} answers owed or waiting to be written, none left for {STALLED_S:g} s: the "
                        "daemon does not answer; inputs handed on all the same (their answers may be dropped, counted "
                        "as answers_unsent)",
                    )  # fmt: skip
                    return
                self._owed_changed.wait(_ROOM_POLL_S)

    def _settled(self) -> None:
        with self._owed_changed:
            self._owed -= 1
            self._owed_changed.notify_all()

    def on_result(self, link: BoardLink, board: Board, frame: Frame, record: dict[str, Any]) -> None:
        self._results_log.happened(1, f"board {shown(board.device)} ran the model itself: {shown(str(record), 300)}")

    def _answer_down(self, link: BoardLink, stream: int, seq: int, session: int, answers: list[Answer]) -> None:
        """The answers of one input, down to the board if it is still the session the input came in."""
        try:
            for answer in answers:
                try:
                    payload = orjson.dumps(answer.record)
                except (TypeError, orjson.JSONEncodeError):  # never: records are JSON types; still, never raise
                    continue
                link.answer(stream, seq, payload, session=session)
        finally:
            self._settled()

    # -- health ------------------------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return {f"serial_{name}": value for name, value in self.link.counters.as_dict().items()}

    def status(self) -> dict[str, Any] | None:
        return self.link.status()
