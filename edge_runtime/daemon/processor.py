"""One sensor message in, its answers out: size check, decode, window, predict, interpret, encode.

Every input gets exactly one answer. For models without a window the input is the message: one result or one
coded error. For windowed models the inputs are the windows a message completes: one result per window, and a
message that cannot be used (malformed, wrong shape, NaN...) gets one coded error. Pure apart from the model
call; the daemon runs it on its worker thread, never on the MQTT network thread.

Nothing a message carries may escape as an exception: whatever goes wrong while handling one message becomes that
message's coded answer. Every answer carries the input's ``id`` when the payload has one that can be read (even
when the rest of it cannot: ``edgeline.daemon.salvage``), else ``<device>-<seq>``; never more than
``MAX_ID_CHARS`` of it. An answer whose topic cannot be formed from its device (wildcards, over 65,535 bytes)
becomes an ``invalid-topic`` error on the error topic, or, when that cannot be formed either, an answer without a
topic: written to stdout when that sink is on, logged otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edgeline.arrays import all_finite
from edgeline.daemon.codecs import Codec, Decoded
from edgeline.daemon.health import Metrics
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.salvage import readable_id
from edgeline.daemon.topics import render_topic, topic_problem
from edgeline.daemon.windowing import StreamWindows
from edgeline.errors import PAYLOAD_CODES, PayloadError
from edgeline.lograte import Repeated
from edgeline.manifest import Window
from edgeline.model import Model

__all__ = ["Processor", "Shadow"]

log = logging.getLogger("edgeline.processor")

MAX_DEVICE_IN_RECORD = 256
"""A device name longer than this is cut in answers (a 70,000-character device must not make 70 KB answers)."""


@dataclass(frozen=True)
class _Decoded:
    """A message of a batch that decoded: waiting for its model call."""

    index: int
    message: Message
    sequence: int
    identity: str | None
    arrays: list[np.ndarray]


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
        instance: str = "",
        top_k: int = 1,
        detection_overrides: Mapping[str, float] | None = None,
    ):
        self.model = model
        self.codec = codec
        # Results cannot be published raw; a raw input stream is answered in another codec (json by default).
        self.result_codec = result_codec or codec
        self.metrics = metrics
        self.failures_log = Repeated(log, "inference failed")
        """Said when it starts, then summed (a model that fails on every input must not fill the journal)."""
        self.publish = publish
        self.error_topic = error_topic
        self.max_payload_bytes = max_payload_bytes
        self.window = window if window is not None else model.manifest.window
        self.streams = StreamWindows(self.window, max_streams=max_streams) if self.window else None
        self._sequence: Counter[str] = Counter()
        self._sequence_lock = threading.Lock()  # drops are answered on the network thread
        self.instance = instance
        self.top_k = top_k
        self.detection_overrides = dict(detection_overrides or {})
        """A detector's thresholds for this daemon, over the manifest's (``[detection]``, ``--score-threshold``...)."""
        self.shadow: Shadow | None = None
        """A trial (``edgeline.updates.trial``): the previous version runs beside ``model`` on every input. Set
        and cleared on the worker thread only, between two batches."""
        self._evicted_seen = 0
        self.evictions_log = Repeated(log, "streams evicted with their partial windows (raise [input] max_streams)")

    def process(self, message: Message) -> list[Answer]:
        sequence = self._next_sequence(message.device)
        self.metrics.count("received")
        identity: str | None = None
        try:
            decoded = self._decode(message)
            identity = decoded.id
            if self.streams is None:
                return [self._infer(message, sequence, identity, list(decoded.arrays))]
            key = message.device if message.stream is None else f"{message.device}/{message.stream}"
            windows = self.streams.push(key, decoded.arrays[0])
            self._note_evictions()
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
        if size <= 1 or self.streams is not None or len(messages) < size or self.shadow is not None:
            return [self.process(message) for message in messages]
        answers: list[list[Answer]] = [[] for _ in messages]
        pending: list[_Decoded] = []
        for index, message in enumerate(messages):
            sequence = self._next_sequence(message.device)
            self.metrics.count("received")
            try:
                decoded = self._decode(message)
            except Exception as exc:
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
        if identity is None:
            identity = self._readable_id(message)
        if isinstance(exc, PayloadError):
            return self._error(message, sequence, identity, exc.code, str(exc))
        text = f"{type(exc).__name__}: {exc}"
        self.failures_log.happened(1, f"on a message from {message.device}: {text}")
        return self._error(message, sequence, identity, "inference-failed", text)

    def _infer_one(self, item: _Decoded) -> list[Answer]:
        try:
            return [self._infer(item.message, item.sequence, item.identity, item.arrays)]
        except Exception as exc:
            return self._failure(item.message, item.sequence, item.identity, exc)

    def _decode(self, message: Message) -> Decoded:
        if message.arrays is not None:  # made by the source (a camera frame, pre-processed)
            return Decoded(None, message.arrays)
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
        seconds = time.perf_counter() - start
        self.metrics.count("batches")
        for item, result in zip(batch, outputs, strict=True):
            try:
                if isinstance(result, Exception):
                    raise result
                answers[item.index] = [
                    self._result(item.message, item.sequence, item.identity, item.arrays, result, seconds, len(batch))
                ]
            except Exception as exc:  # one bad output (NaN...) costs that input its answer, not the batch
                answers[item.index] = self._failure(item.message, item.sequence, item.identity, exc)

    def refuse(self, message: Message, code: str, text: str) -> list[Answer]:
        """The one answer of an input that never reaches the processor (``dropped`` from a full queue). ``code`` is
        one of ``PAYLOAD_CODES``, the one list of the codes an answer carries: another is a bug of ours."""
        if code not in PAYLOAD_CODES:
            raise ValueError(f"unknown error code {code!r}; valid: {', '.join(PAYLOAD_CODES)}")
        sequence = self._next_sequence(message.device)
        self.metrics.count("received")
        return self._error(message, sequence, self._readable_id(message), code, text)

    def _readable_id(self, message: Message) -> str | None:
        if message.size is not None and message.size > self.max_payload_bytes:
            return None
        return readable_id(message.payload, self.codec.name)

    def _note_evictions(self) -> None:
        """Streams forgotten to make room: counted, and said when it starts, then summed (never silent)."""
        assert self.streams is not None
        evicted = self.streams.evicted
        if evicted == self._evicted_seen:
            return
        self.metrics.count("streams_evicted", evicted - self._evicted_seen)
        self.evictions_log.happened(evicted - self._evicted_seen, f"more than {self.streams.max_streams} streams")
        self._evicted_seen = evicted

    def _next_sequence(self, device: str) -> int:
        with self._sequence_lock:
            self._sequence[device] += 1
            if len(self._sequence) > 100_000:  # a flood of device ids must not grow memory without bound
                self._sequence.clear()
                self._sequence[device] = 1
            return self._sequence[device]

    def _record(
        self, message: Message, sequence: int, identity: str | None, model: Model | None = None
    ) -> dict[str, Any]:
        model = model or self.model
        record = {
            "id": identity if identity is not None else f"{message.device}-{sequence}",
            "device": message.device[:MAX_DEVICE_IN_RECORD],
            "seq": sequence,
            "model": model.name,
            "version": model.version,
        }
        if self.instance:
            record["instance"] = self.instance
        if message.fields:
            record.update(message.fields)
        return record

    def _infer(
        self, message: Message, sequence: int, identity: str | None, inputs: list[np.ndarray], window: int | None = None
    ) -> Answer:
        if self.shadow is not None:
            model, outputs, seconds = self.shadow.run(self.model, inputs)
            return self._result(message, sequence, identity, inputs, outputs, seconds, window=window, model=model)
        start = time.perf_counter()
        outputs = self.model.predict(*inputs)
        seconds = time.perf_counter() - start
        return self._result(message, sequence, identity, inputs, outputs, seconds, window=window)

    def _result(
        self,
        message: Message,
        sequence: int,
        identity: str | None,
        inputs: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        seconds: float,
        batch: int = 1,
        window: int | None = None,
        model: Model | None = None,
    ) -> Answer:
        """``seconds`` is the model call's time; for a batch, the whole call's, and ``batch`` says how many
        samples it carried. ``model``: the version that answered (during a trial, possibly the previous one)."""
        model = model or self.model
        topic = self._topic(self.publish, message.device)
        problem = topic_problem(topic)
        if problem is not None:
            raise _TopicError(f"the answer's topic cannot be formed from device {message.device[:64]!r}: {problem}")
        for output in outputs:
            if not all_finite(output):
                raise _ModelOutputError("the model's output holds NaN or Inf for this input")
        interpreted = model.interpret(
            inputs, outputs, top_k=self.top_k, frame_size=message.frame_size, overrides=self.detection_overrides
        ).as_dict()
        record = self._record(message, sequence, identity, model)
        if window is not None:
            record["window"] = window
        if model.manifest.postprocess.kind != "detect":  # a detector's answer is its boxes; its raw candidates
            # (YOLOv8 at 640: 8,400 x 84 floats) would make every answer megabytes
            record["outputs"] = [output.tolist() for output in outputs]
        record.update(interpreted)
        record["latency_ms"] = round(seconds * 1000.0, 4)
        if batch > 1:
            record["batch"] = batch
        record["timestamp"] = time.time()
        if message.captured is not None:
            record["age_ms"] = round((time.monotonic() - message.captured) * 1000.0, 3)
        payload = self.result_codec.encode(record, plain=True)
        self.metrics.observe("model", seconds)
        self.metrics.count("results")
        if interpreted.get("anomaly"):  # the anomaly rate a rollout watches (edgeline.updates.rollout)
            self.metrics.count("anomalies")
        return Answer(topic, payload, record, is_error=False)

    def _topic(self, template: str, device: str) -> str:
        return render_topic(template, device=device, name=self.model.name, instance=self.instance)

    def _error(self, message: Message, sequence: int, identity: str | None, code: str, text: str) -> list[Answer]:
        self.metrics.error(code)
        record = self._record(message, sequence, identity)
        record["error"] = {"code": code, "message": text}
        record["timestamp"] = time.time()
        payload = self.result_codec.encode(record, plain=True)
        topic = self._topic(self.publish, message.device)
        error_topic = self._topic(self.error_topic, message.device) if self.error_topic else None
        if topic_problem(topic) is None:
            answers = [Answer(topic, payload, record, True)]
            if error_topic is not None and topic_problem(error_topic) is None:
                answers.append(Answer(error_topic, payload, record, True))
            return answers
        # No answer topic for this device: the error topic if it can be formed (with the device, else without),
        # else no topic at all (stdout, or the log).
        if error_topic is not None and topic_problem(error_topic) is not None:
            error_topic = self._topic(self.error_topic or "", INVALID_DEVICE)
        if error_topic is not None and topic_problem(error_topic) is None:
            return [Answer(error_topic, payload, record, True)]
        return [Answer(None, payload, record, True)]


class Shadow(Protocol):
    """What runs an input during a trial: ``run`` returns the version that answers, its outputs and its model
    call's seconds (``edgeline.updates.swap.TrialRunner``)."""

    def run(self, model: Model, inputs: list[np.ndarray]) -> tuple[Model, list[np.ndarray], float]: ...


class _ModelOutputError(RuntimeError):
    """A finite input the model answered with NaN or Inf: answered ``inference-failed``."""


class _TopicError(PayloadError):
    def __init__(self, message: str):
        super().__init__(message, code="invalid-topic")


INVALID_DEVICE = "_invalid"
"""Stands for a device that cannot be part of a topic, in the error topic of its answer."""
