"""The daemon's source for boards on the framed protocol: ``edgeline run BUNDLE --serial URL --serial-protocol frames``.

Every sample of a ``SAMPLES`` frame becomes one input of the daemon, in its own JSON payload format
(``{"id", "data"}``), of device ``HELLO.device`` and stream ``HELLO.streams[].name`` (windows are kept per device and
stream), on topic ``sensors/{device}/{stream}`` (as ``edgeline bridge`` would publish it). Its answers go where the
daemon sends answers (stdout, the broker) and back down to the board as ``ANSWER`` frames. In reliable mode the
frame's ``ACK`` goes out once its answers are safe (committed to the outbox, or handed to every sink).

The link's counters (frames, bytes, CRC errors, resyncs, sequence gaps, board restarts, refused frames) are the
daemon's counters ``serial_*`` (status message and ``/metrics``), and the board itself is in the status message.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import orjson

from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.sources import SourceBase
from edgeline.daemon.topics import SENSOR_TOPIC
from edgeline.firmware_bridge.link import Board, BoardLink, StreamSpec, input_id
from edgeline.firmware_bridge.protocol import Frame

__all__ = ["FramesSource", "sample_payload"]

log = logging.getLogger("edgeline.source")

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
    daemon's ``counters`` and ``status``."""

    def __init__(self, url: str, *, baudrate: int, device: str | None = None):
        self.link = BoardLink(url, self, baudrate=baudrate)
        self.description = f"framed serial {url} at {baudrate} baud (the board named by its HELLO)"
        if device is not None:
            log.info("--device %s is not used with frames: the board's HELLO names it", device)
        self._submit: Callable[[Message], None] | None = None

    def open(self) -> None:
        self.link.open()

    def run(self, submit: Callable[[Message], None], stopping: threading.Event) -> None:
        self._submit = submit
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
        down = partial(self._answer_down, link, frame.stream, frame.seq)
        for index, sample in enumerate(samples):
            payload = sample_payload(input_id(frame.stream, frame.seq, index, frame.t_us, board.boot), sample)
            submit(
                Message(
                    topic=topic, payload=payload, device=board.device, stream=stream.name, ack=safe[index],
                    on_answers=down,
                )
            )  # fmt: skip

    def on_result(self, link: BoardLink, board: Board, frame: Frame, record: dict[str, Any]) -> None:
        log.debug("board %s ran the model itself: %s", board.device, str(record)[:300])

    @staticmethod
    def _answer_down(link: BoardLink, stream: int, seq: int, answers: list[Answer]) -> None:
        for answer in answers:
            try:
                payload = orjson.dumps(answer.record)
            except (TypeError, orjson.JSONEncodeError):  # never: records are made of JSON types; still, never raise
                continue
            link.answer(stream, seq, payload)

    # -- health ------------------------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return {f"serial_{name}": value for name, value in self.link.counters.as_dict().items()}

    def status(self) -> dict[str, Any] | None:
        return self.link.status()
