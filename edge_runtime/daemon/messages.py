"""The daemon's own message types: what every source hands in, and what every sink sends out.

Sources convert their foreign objects (paho's ``MQTTMessage``, a serial line, a recorded record) into a
``Message`` at their boundary; nothing past the queue sees anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Answer", "Message", "Reply"]


@dataclass(frozen=True)
class Reply:
    """An input's MQTT 5 Response Topic and Correlation Data: its answer goes there too, carrying the data back."""

    topic: str
    correlation: bytes | None = None


@dataclass(frozen=True)
class Message:
    """A message as it arrived: a source builds it and queues it, nothing more."""

    topic: str
    payload: bytes
    device: str
    received: float = field(default_factory=time.time)
    """Wall-clock time of arrival (seconds since the epoch): survives a restart in the outbox."""
    queued: float = field(default_factory=time.monotonic)
    """Monotonic time of arrival: the start of the ``queued`` latency stage."""
    size: int | None = None
    """The payload's real size when a source had to cut it short (over the limit); None: ``len(payload)``."""
    reply: Reply | None = None
    """MQTT 5 request/response: where the sender wants its answer (besides the publish template), and with what."""
    stream: str | None = None
    """The sensor stream of a device that sends several (a board's stream name): windows are kept per device and
    stream. None: one stream per device (MQTT's device is the topic's first ``+`` level)."""
    on_answers: Callable[[list[Answer]], None] | None = None
    """Called with the input's answers once the sinks have them: the framed serial source sends them back down to the
    board (an ANSWER frame), so the board can act on them."""
    ack: Callable[[], None] | None = None
    """Called once the message's answers are safe (committed to the outbox, or handed to every sink): the MQTT
    source sends its PUBACK then, so the broker keeps the message until its answer cannot be lost."""
    arrays: tuple[np.ndarray, ...] | None = None
    """The model's inputs already made (a camera frame through the bundle's pre-processing): no payload to decode,
    so no JPEG or JSON round trip between a camera and the model. None: decode ``payload``."""
    fields: dict[str, Any] | None = None
    """Added to every answer of the message (a camera's name, frame number, stream, source timestamp)."""
    frame_size: tuple[int, int] | None = None
    """(height, width) of the camera frame ``arrays`` were made from: a detector's boxes are given in its
    coordinates (the letterbox undone). None: in the input's."""
    captured: float | None = None
    """``time.monotonic()`` when the input was captured (a camera frame decoded): answers carry ``age_ms``,
    capture to answer."""


@dataclass(frozen=True)
class Answer:
    """One answer of an input: a result or a coded error, already encoded for the wire."""

    topic: str | None
    """None: no MQTT topic can be formed for it (its device cannot be part of one): stdout or the log only."""
    payload: bytes
    record: dict[str, Any]
    is_error: bool
