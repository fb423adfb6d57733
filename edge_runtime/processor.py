"""One sensor message in, its answers out: size check, decode, window, predict, interpret, encode.

Every input gets exactly one answer. For models without a window the input is the message: one result or one
coded error. For windowed models the inputs are the windows a message completes: one result per window, and a
message that cannot be used (malformed, wrong shape, NaN...) gets one coded error. Pure apart from the model
call; the daemon runs it on its worker thread, never on the MQTT network thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_runtime.codecs import Codec, Decoded
from edge_runtime.errors import PayloadError
from edge_runtime.health import Metrics
from edge_runtime.manifest import Window
from edge_runtime.model import Model
from edge_runtime.topics import render_topic
from edge_runtime.windowing import StreamWindows

__all__ = ["Answer", "Message", "Processor"]

log = logging.getLogger("edgeline.processor")


@dataclass(frozen=True)
class Message:
    """A message as it arrived: the network thread builds it and queues it, nothing more."""

    topic: str
    payload: bytes
    device: str
    received: float = field(default_factory=time.time)
    size: int | None = None
    """The payload's real size when a source had to cut it short (over the limit); None: ``len(payload)``."""
    # Seam for a durable outbox: called once the message's answers are handed over (paho manual_ack).
    ack: Callable[[], None] | None = None


@dataclass(frozen=True)
class _Decoded:
    """A message of a batch that decoded: waiting for its model call."""

    index: int
    message: Message
    sequence: int
    identity: str | None
    arrays: list[np.ndarray]


@dataclass(frozen=True)
class Answer:
    topic: str
    payload: bytes
    record: dict[str, Any]
    is_error: bool


class Processor:
    def __init__(
        self,
        model: Model,
        codec: Codec,
        metrics: Metrics,
        *,
        publish: str,
        error_topic: str | None = None,
        max_payload_bytes: int = 1 << 20,
        window: Window | None = None,
        max_streams: int = 1024,
        result_codec: Codec | None = None,
    ):
        self.model = model
        self.codec = codec
        # Results cannot be published raw; a raw input stream is answered in another codec (json by default).
        self.result_codec = result_codec or codec
        self.metrics = metrics
        self.publish = publish
        self.error_topic = error_topic
        self.max_payload_bytes = max_payload_bytes
        self.window = window if window is not None else model.manifest.window
        self.streams = StreamWindows(self.window, max_streams=max_streams) if self.window else None
        self._sequence: Counter[str] = Counter()
        self._sequence_lock = threading.Lock()  # drops are answered on the network thread
        self._base = {"model": model.name, "version": model.version}

    def process(self, message: Message) -> list[Answer]:
        sequence = self._next_sequence(message.device)
        self.metrics.count("received")
        identity: str | None = None
        try:
            decoded = self._decode(message)
            identity = decoded.id
            if self.streams is None:
                return [self._infer(message, sequence, identity, list(decoded.arrays))]
            windows = self.streams.push(message.device, decoded.arrays[0])
            return [
                self._infer(message, sequence, identity, [w.reshape(self.model.inputs[0].shape)], window=i)
                for i, w in enumerate(windows)
            ]
        except Exception as exc:
            return self._failure(message, sequence, identity, exc)

    def process_batch(self, messages: Sequence[Message]) -> list[list[Answer]]:
        """The answers of each message, in order. When the model takes batches (``Model.enable_batching``), every
        full batch of valid inputs runs in one call; the rest, and windowed models, run one by one."""
        size = self.model.batch_size
        if size <= 1 or self.streams is not None or len(messages) < size:
            return [self.process(message) for message in messages]
        answers: list[list[Answer]] = [[] for _ in messages]
        pending: list[_Decoded] = []
        for index, message in enumerate(messages):
            sequence = self._next_sequence(message.device)
            self.metrics.count("received")
            try:
                decoded = self._decode(message)
            except PayloadError as exc:
                answers[index] = self._failure(message, sequence, None, exc)
                continue
            pending.append(_Decoded(index, message, sequence, decoded.id, list(decoded.arrays)))
        whole = len(pending) - len(pending) % size
        for start in range(0, whole, size):
            self._infer_batch(pending[start : start + size], answers)
        for item in pending[whole:]:
            answers[item.index] = self._infer_one(item)
        return answers

    def _failure(self, message: Message, sequence: int, identity: str | None, exc: Exception) -> list[Answer]:
        """The coded error of an input: its own ``PayloadError``, or ``inference-failed`` when the runtime failed
        on an input that passed every check (logged, and the daemon keeps going)."""
        if isinstance(exc, PayloadError):
            return self._error(message, sequence, identity, exc.code, str(exc))
        text = f"{type(exc).__name__}: {exc}"
        log.warning("inference failed on a message from %s: %s", message.device, text)
        return self._error(message, sequence, identity, "inference-failed", text)

    def _infer_one(self, item: _Decoded) -> list[Answer]:
        try:
            return [self._infer(item.message, item.sequence, item.identity, item.arrays)]
        except Exception as exc:
            return self._failure(item.message, item.sequence, item.identity, exc)

    def _decode(self, message: Message) -> Decoded:
        size = len(message.payload) if message.size is None else message.size
        if size > self.max_payload_bytes:
            raise PayloadError(
                f"payload of {size} bytes exceeds the limit of {self.max_payload_bytes}", code="oversized"
            )
        return self.codec.decode(message.payload, self.model.inputs, window=self.window)

    def _infer_batch(self, batch: Sequence[_Decoded], answers: list[list[Answer]]) -> None:
        start = time.perf_counter()
        try:
            outputs = self.model.predict_batch([item.arrays for item in batch])
        except Exception:  # the runtime failed on one of them: run them one by one, so only that one fails
            for item in batch:
                answers[item.index] = self._infer_one(item)
            return
        latency_ms = (time.perf_counter() - start) * 1000.0
        self.metrics.count("batches")
        for item, result in zip(batch, outputs, strict=True):
            if isinstance(result, PayloadError):
                answers[item.index] = self._failure(item.message, item.sequence, item.identity, result)
            else:
                answer = self._result(
                    item.message, item.sequence, item.identity, item.arrays, result, latency_ms, len(batch)
                )
                answers[item.index] = [answer]

    def refuse(self, message: Message, code: str, text: str) -> list[Answer]:
        """The one answer of an input that never reaches the processor (``dropped`` from a full queue)."""
        sequence = self._next_sequence(message.device)
        self.metrics.count("received")
        return self._error(message, sequence, None, code, text)

    def _next_sequence(self, device: str) -> int:
        with self._sequence_lock:
            self._sequence[device] += 1
            if len(self._sequence) > 100_000:  # a flood of device ids must not grow memory without bound
                self._sequence.clear()
                self._sequence[device] = 1
            return self._sequence[device]

    def _record(self, message: Message, sequence: int, identity: str | None) -> dict[str, Any]:
        return {
            "id": identity if identity is not None else f"{message.device}-{sequence}",
            "device": message.device,
            "seq": sequence,
            **self._base,
        }

    def _infer(
        self, message: Message, sequence: int, identity: str | None, inputs: list[np.ndarray], window: int | None = None
    ) -> Answer:
        start = time.perf_counter()
        outputs = self.model.predict(*inputs)
        latency_ms = (time.perf_counter() - start) * 1000.0
        return self._result(message, sequence, identity, inputs, outputs, latency_ms, window=window)

    def _result(
        self,
        message: Message,
        sequence: int,
        identity: str | None,
        inputs: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        latency_ms: float,
        batch: int = 1,
        window: int | None = None,
    ) -> Answer:
        """``latency_ms`` is the model call's time; for a batch, the whole call's, and ``batch`` says how many
        samples it carried."""
        self.metrics.latency(latency_ms)
        self.metrics.count("results")
        record = self._record(message, sequence, identity)
        if window is not None:
            record["window"] = window
        record["outputs"] = [output.tolist() for output in outputs]
        record.update(self.model.interpret(inputs, outputs).as_dict())
        record["latency_ms"] = round(latency_ms, 4)
        if batch > 1:
            record["batch"] = batch
        record["timestamp"] = time.time()
        topic = render_topic(self.publish, device=message.device, name=self.model.name)
        return Answer(topic, self.result_codec.encode(record), record, is_error=False)

    def _error(self, message: Message, sequence: int, identity: str | None, code: str, text: str) -> list[Answer]:
        self.metrics.error(code)
        record = self._record(message, sequence, identity)
        record["error"] = {"code": code, "message": text}
        record["timestamp"] = time.time()
        payload = self.result_codec.encode(record)
        answers = [
            Answer(render_topic(self.publish, device=message.device, name=self.model.name), payload, record, True)
        ]
        if self.error_topic:
            topic = render_topic(self.error_topic, device=message.device, name=self.model.name)
            answers.append(Answer(topic, payload, record, True))
        return answers
