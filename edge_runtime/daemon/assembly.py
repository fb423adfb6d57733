"""Building a daemon: everything ``edgeline run`` opens and checks before it starts, in one place.

    assemble        every part, built ready and handed its neighbours (``Assembled``): what the daemon runs
    build_parts     the update state (the committed version may be newer than the bundle given), the model, the
                    codec and window checks, the names (state directory, instance, client id, topics), the metrics,
                    the processor, the queue, the broker connection and its sink, the source, the update client
    attach_updates  the update thread's agent, which makes the worker's swap around the processor
    open_outbox     at start: the outbox on disk, or in memory

The bundle is read once (its manifest parsed, its files hashed): the update state, the compiled-model cache and the
model are given what was read. The daemon (``edgeline.daemon.service``) takes what ``assemble`` returns and only
starts and stops it, so every refusal (a codec that does not fit the bundle, a window that does not fill the input,
a topic that would answer itself, a missing trusted root) is an ``EdgelineError`` raised here, before anything runs.
What is held only while the daemon runs (the state directory's lock, the outbox, the source's port or file, the
broker's connection) is opened at start, in the order it always was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgeline.daemon.codecs import example_payload, get_codec
from edgeline.daemon.config import DaemonConfig, OutboxConfig, UpdatesConfig
from edgeline.daemon.delivery import Delivery
from edgeline.daemon.guards import check_topics, check_window
from edgeline.daemon.health import Metrics, SystemdNotifier
from edgeline.daemon.intake import Intake, IntakeGate
from edgeline.daemon.messages import Answer, Message
from edgeline.daemon.mqtt import AnswerFormat, MqttConnection, MqttSink, MqttSource
from edgeline.daemon.network import NetworkTick, flow_level
from edgeline.daemon.outbox import MemoryOutbox, Outbox, OutboxInterface
from edgeline.daemon.processor import Processor
from edgeline.daemon.queueing import BoundedQueue, DropPolicy
from edgeline.daemon.reporting import Reporter
from edgeline.daemon.silence import SilenceWatch
from edgeline.daemon.sinks import Sinks
from edgeline.daemon.sources import Source, make_source
from edgeline.daemon.state import StateLock, default_state_dir, instance_id
from edgeline.daemon.supervisor import Supervisor
from edgeline.daemon.topics import TopicFilter, render_topic
from edgeline.daemon.worker import Worker
from edgeline.errors import EdgelineError
from edgeline.machine import this_machine
from edgeline.model import Model, open_bundle
from edgeline.video import Pixel

if TYPE_CHECKING:
    from edgeline.bundle import Bundle
    from edgeline.imaging import FramePrep
    from edgeline.manifest import Manifest
    from edgeline.updates.agent import UpdateAgent
    from edgeline.updates.cage import CageLimits
    from edgeline.updates.client import UpdateClient
    from edgeline.updates.policy import TargetFacts
    from edgeline.updates.store import State, Store
    from edgeline.updates.swap import Swap

__all__ = [
    "ANSWER_FORMATS", "Assembled", "DaemonParts", "UpdatePlan", "accelerator_of", "assemble", "attach_updates",
    "build_parts", "open_outbox",
]  # fmt: skip

log = logging.getLogger("edgeline.daemon")

ANSWER_FORMATS = {
    "json": AnswerFormat("application/json", utf8=True),
    "cbor": AnswerFormat("application/cbor", utf8=False),
    "msgpack": AnswerFormat("application/vnd.msgpack", utf8=False),
}
"""What answers are, by the codec they are written in (MQTT 5 Content Type and Payload Format Indicator)."""
COUNTERS = (
    "received", "results", "anomalies", "errors", "dropped", "published", "publish_refused", "batches",
    "disk_full", "intake_pauses", "outbox_read_back", "streams_evicted", "unpublishable",
)  # fmt: skip
"""The daemon's own counters, declared at 0 so that the status message and ``/metrics`` always carry them."""


@dataclass(frozen=True)
class UpdatePlan:
    """What ``[updates] enabled`` opened: the device's repository client, the update state and the bundle the
    daemon starts on (the committed version, when newer than the one given)."""

    client: UpdateClient
    store: Store
    state: State
    bundle: Path
    backend: str | None


@dataclass(frozen=True)
class DaemonParts:
    """The opened, checked parts of a daemon, not running yet."""

    config: DaemonConfig
    processor: Processor
    queue: BoundedQueue[Message]
    metrics: Metrics
    source: Source
    connection: MqttConnection | None
    """The broker: a source (MQTT) and the sink of answers, or None without a broker."""
    sink: MqttSink | None
    state_dir: Path
    instance: str
    filters: list[TopicFilter]
    client_id: str
    availability_topic: str
    status_topic: str
    expected_payload: str
    """What a message for this model looks like (values abbreviated): logged at start and when silent."""
    lock: StateLock | None
    """The state directory's lock, when the update state needed it before the model was opened."""
    updates: UpdatePlan | None


def accelerator_of(model: Model) -> dict[str, str | None] | None:
    """What the bundle was built for and what runs it here, for the status message and the metrics; None for a
    bundle built for the CPU."""
    placement = model.manifest.placement
    if placement is None or placement.accelerator is None:
        return None
    return {"wanted": placement.accelerator, "in_use": model.accelerator, "fallback": model.accelerator_fallback}


OPENVINO_CACHE = "openvino-cache"
"""The folder of the state directory where OpenVINO keeps the models it compiled (``CACHE_DIR``)."""


def _cache_compiled_models(manifest: Manifest, config: DaemonConfig, backend: str | None) -> None:
    """A backend that compiles models (OpenVINO) caches them in the state directory, so a restart loads them rather
    than compiling again (seconds on a GPU or NPU): from the manifest read already. Its class says what it keeps
    (``RuntimeBackend.cache_compiled_models``); an unknown name is left to the model's opening to refuse."""
    from edgeline.backends import RUNTIME_BACKENDS, runtime_backend

    name = backend or manifest.backend
    if name in RUNTIME_BACKENDS:
        directory = (config.daemon.state_dir or default_state_dir()) / manifest.name / OPENVINO_CACHE
        runtime_backend(name).cache_compiled_models(directory)


def build_parts(
    bundle: Path,
    config: DaemonConfig,
    *,
    backend: str | None = None,
    source: Source | None = None,
    waiting: Callable[[], int] = lambda: 0,
) -> DaemonParts:
    """Open and check everything ``config`` names for ``bundle``; ``source`` replaces the configured one (tests),
    ``waiting`` tells the connection's reconnection line how many answers wait in the outbox."""
    from edgeline.bundle import read_bundle

    lock, kept = None, None
    if config.updates.enabled:  # the committed version may be newer than the bundle given
        start_on, lock, kept = _update_state(Path(bundle), config)
    else:
        start_on = read_bundle(bundle)  # the one read of the bundle: its manifest and files, passed on from here
    _cache_compiled_models(start_on.manifest, config, backend)
    model = open_bundle(start_on, backend=backend)
    name = model.name
    codec = get_codec(config.input.codec)
    if codec.name == "raw" and model.manifest.preprocess is not None:
        # raw payloads are the model's own tensors; predict() would apply the preprocessing a second time
        raise EdgelineError(
            f"{bundle}: the raw codec sends the model's own tensors, but this bundle preprocesses its inputs; "
            "use json, cbor or msgpack"
        )
    window = config.window if config.window is not None else model.manifest.window
    check_window(window, model.inputs)
    overrides = config.detection.overrides
    if overrides and model.manifest.postprocess.kind != "detect":
        given = ", ".join(f"--{key.replace('_', '-')} ([detection] {key})" for key in overrides)
        raise EdgelineError(f"{given}: for detectors; {name} is a {model.manifest.postprocess.kind} model")
    state_dir = (config.daemon.state_dir or default_state_dir()) / name
    instance = config.daemon.instance or instance_id(state_dir)
    filters = [TopicFilter(pattern) for pattern in config.input.subscribe]
    check_topics(config, name=name, instance=instance, filters=filters)
    client_id = config.broker.client_id.format(name=name, instance=instance)
    availability_topic = render_topic(config.health.availability_topic, device="", name=name, instance=instance)

    model.enable_batching(config.queue.max_batch)
    metrics = Metrics(model=name, version=model.version, instance=instance)
    metrics.accelerator = accelerator_of(model)
    metrics.emulated = this_machine().emulated
    metrics.declare(*COUNTERS)
    processor = Processor(
        model,
        codec,
        metrics,
        publish=config.output.publish,
        error_topic=config.output.error_topic,
        max_payload_bytes=config.input.max_payload_bytes,
        window=window,
        max_streams=config.input.max_streams,
        result_codec=get_codec("json") if codec.name == "raw" else None,
        instance=instance,
        detection_overrides=overrides,
    )
    connection, sink = None, None
    if config.uses_broker:
        connection = MqttConnection(
            config.broker, client_id=client_id, will=(availability_topic, b"offline"), waiting=waiting
        )
        sink = MqttSink(connection, config.output.qos, ANSWER_FORMATS["json" if codec.name == "raw" else codec.name])
    if source is None and config.source.kind == "camera":
        source = _camera_source(config, processor, connection, state_dir, name=name, instance=instance)
    if source is None:
        source = _configured_source(config, connection, filters)
    return DaemonParts(
        config=config,
        processor=processor,
        queue=BoundedQueue(config.queue.capacity, DropPolicy(config.queue_policy)),
        metrics=metrics,
        source=source,
        connection=connection,
        sink=sink,
        state_dir=state_dir,
        instance=instance,
        filters=filters,
        client_id=client_id,
        availability_topic=availability_topic,
        status_topic=render_topic(config.health.status_topic, device="", name=name, instance=instance),
        expected_payload=example_payload(codec.name, model.inputs, window),
        lock=lock,
        updates=_update_plan(config, *kept, start_on.path, backend) if kept is not None else None,
    )


def _update_state(bundle: Path, config: DaemonConfig) -> tuple[Bundle, StateLock, tuple[Store, State]]:
    """The bundle to start on (as read), and the state directory's lock, taken before the update state is read or
    written."""
    from edgeline.bundle import read_bundle
    from edgeline.updates.agent import starting_on
    from edgeline.updates.store import Store

    root = config.updates.trusted_root
    if root is not None and not root.is_file():  # said before the model is opened
        raise EdgelineError(f"--trusted-root {root}: no such file (the root.json of `edgeline keys generate`)")
    given = read_bundle(bundle)
    state_dir = (config.daemon.state_dir or default_state_dir()) / given.manifest.name
    lock = StateLock(state_dir)
    store = Store(state_dir / "updates", given=Path(bundle))
    start_on, state = starting_on(store, given)
    return start_on, lock, (store, state)


def _update_plan(config: DaemonConfig, store: Store, state: State, start_on: Path, backend: str | None) -> UpdatePlan:
    """The repository client (it reads the trusted root), once the model has opened."""
    from edgeline.updates.client import UpdateClient

    updates = config.updates
    assert updates.repository is not None and updates.trusted_root is not None
    client = UpdateClient(
        updates.repository, updates.trusted_root, store.directory, download_timeout_s=updates.download_timeout_s
    )
    return UpdatePlan(client=client, store=store, state=state, bundle=start_on, backend=backend)


class _FramePrepOfTheRunningVersion:
    """A camera frame made into the input of the version answering now: an update may bring another size or colour
    order, and its frames follow it from the swap on (``edgeline.imaging.FramePrep``, made once per version)."""

    def __init__(self, processor: Processor):
        self.processor = processor
        self._model: Model | None = None
        self._prep: FramePrep | None = None

    def __call__(self, frame: np.ndarray, pixel: Pixel) -> np.ndarray:
        model = self.processor.model
        if model is not self._model:
            self._model, self._prep = model, _frame_prep(model)
        assert self._prep is not None
        return self._prep(frame, pixel)


def _frame_prep(model: Model) -> FramePrep:
    from edgeline.image_infer import frame_prep

    return frame_prep(model, "--camera")


def _camera_source(
    config: DaemonConfig,
    processor: Processor,
    connection: MqttConnection | None,
    state_dir: Path,
    *,
    name: str,
    instance: str,
) -> Source:
    """The cameras, each frame made into the model's input by the bundle's own pre-processing."""
    from edgeline.daemon.camera import CameraSource
    from edgeline.daemon.snapshots import Snapshots

    prep = _FramePrepOfTheRunningVersion(processor)
    prep(np.zeros((2, 2, 3), np.uint8), "rgb")  # the starting version's, checked now: refused before anything runs
    snapshots = None
    camera = config.camera
    if camera.snapshots:
        publish = None
        if connection is not None and camera.snapshot_topic is not None:
            template = camera.snapshot_topic

            def publish(device: str, _: str, jpeg: bytes) -> None:
                topic = render_topic(template, device=device, name=name, instance=instance)
                connection.publish(topic, jpeg, qos=0)

        snapshots = Snapshots(camera, state_dir, publish)
    return CameraSource(camera, prep, max_batch=config.queue.max_batch, snapshots=snapshots)


def _configured_source(config: DaemonConfig, connection: MqttConnection | None, filters: list[TopicFilter]) -> Source:
    if config.source.kind == "mqtt":
        assert connection is not None
        return MqttSource(connection, filters, config.input.qos)
    made = make_source(config.source, filters=filters, max_payload_bytes=config.input.max_payload_bytes)
    assert made is not None
    return made


def attach_updates(
    plan: UpdatePlan,
    processor: Processor,
    *,
    device: str,
    config: DaemonConfig,
    on_event: Callable[[], None],
    reserve_bytes: Callable[[], int],
) -> tuple[UpdateAgent, Swap]:
    """The update thread's agent and the swap the worker polls between two batches, which the agent makes around the
    processor (no I/O: the client is open)."""
    from edgeline.updates.agent import UpdateAgent

    updater = UpdateAgent(
        client=plan.client, store=plan.store, state=plan.state, running=processor.model, running_bundle=plan.bundle,
        device=device, interval_s=config.updates.check_interval_s, backend=plan.backend,
        max_batch=config.queue.max_batch, on_event=lambda event: on_event(), reserve_bytes=reserve_bytes,
        cage=_cage(config.updates), worker=processor,
    )  # fmt: skip
    assert updater.swap is not None
    return updater, updater.swap


def _cage(updates: UpdatesConfig) -> Callable[[Manifest, TargetFacts], CageLimits] | None:
    """The limits a new version is opened under in a child process first, from ``[updates]``; None: no cage."""
    if not updates.cage:
        return None

    def limits(manifest: Manifest, facts: TargetFacts) -> CageLimits:
        from edgeline.memory import available_mb
        from edgeline.updates.cage import cage_limits

        return cage_limits(
            manifest, facts, seconds=updates.open_timeout_s, memory_mb=updates.cage_memory_mb,
            available_mb=available_mb(),
        )  # fmt: skip

    return limits


def open_outbox(box: OutboxConfig, state_dir: Path) -> OutboxInterface:
    """At start, under the state directory's lock: the outbox on disk, or in memory (``[outbox] enabled = false``)."""
    if not box.enabled:
        return MemoryOutbox(max_answers=box.max_answers, max_bytes=box.max_bytes, ttl_s=box.ttl_s)
    outbox = Outbox(
        state_dir / "outbox.sqlite",
        max_answers=box.max_answers,
        max_bytes=box.max_bytes,
        ttl_s=box.ttl_s,
        synchronous=box.synchronous,
    )
    if outbox.depth:
        log.info("%d answers left by the last run wait in the outbox", outbox.depth)
    return outbox


@dataclass(frozen=True)
class Assembled:
    """A daemon's parts, built ready and handed their neighbours, none running: what the daemon
    (``edgeline.daemon.service``) takes. Nothing here is changed afterwards to wire it to another part.

        parts: Intake (source → queue) · Worker (queue → Processor → Sinks) · Sinks (→ Delivery, stdout, the
        source's way back) · Delivery (outbox, committer) and NetworkTick (the MQTT loop's turn, the gate's level),
        with a broker · Reporter (status, watchdog) · the update agent and its swap, with updates
    """

    parts: DaemonParts
    supervisor: Supervisor
    stopping: threading.Event
    notifier: SystemdNotifier
    silence: SilenceWatch | None
    intake: Intake
    sinks: Sinks
    delivery: Delivery | None
    """The broker's side of the answers; its outbox opens at start, under the state directory's lock."""
    network: NetworkTick | None
    updater: UpdateAgent | None
    swap: Swap | None
    reporter: Reporter
    worker: Worker


def assemble(
    bundle: Path,
    config: DaemonConfig,
    *,
    backend: str | None = None,
    echo: Callable[[Answer], None] | None = None,
    notifier: SystemdNotifier | None = None,
    source: Source | None = None,
) -> Assembled:
    """Open and check everything (``build_parts``), then build each running part with what it needs, in the order
    of their needs: delivery, intake (and its gate), sinks, network tick, update agent, reporter, worker."""
    delivery: Delivery | None = None

    def waiting() -> int:  # the connection's reconnection line: answers waiting in the outbox (built just below)
        return delivery.outbox.depth if delivery is not None and delivery.opened else 0

    parts = build_parts(bundle, config, backend=backend, source=source, waiting=waiting)
    processor, metrics, connection = parts.processor, parts.metrics, parts.connection
    supervisor, stopping = Supervisor(), threading.Event()
    box = config.outbox
    if connection is not None:
        assert parts.sink is not None
        state_dir = parts.state_dir
        delivery = Delivery(
            None, connection, parts.sink, metrics, max_queued=config.broker.max_queued,
            commit_interval_s=box.commit_interval_s, stopping=stopping, fail=supervisor.fail,
            open_outbox=lambda: open_outbox(box, state_dir),
        )  # fmt: skip
    gate = None
    if delivery is not None and parts.queue.policy is DropPolicy.BLOCK:  # a source that can wait: read no faster
        gate = _gate_for(delivery, box.max_answers, metrics)  # than answers leave
    silence_s = config.input.silence_warning_s
    silence = SilenceWatch(parts.filters, silence_s) if parts.source.subscribed and silence_s > 0 else None
    intake = Intake(
        parts.queue,
        refuse=processor.refuse,
        metrics=metrics,
        stopping=stopping,
        on_network_thread=(lambda: connection.on_network_thread) if connection is not None else lambda: False,
        heard=silence.heard if silence is not None else None,
        gate=gate,
    )
    if intake.gate is not None:
        parts.source.attach_gate(intake.gate.open)
    sinks = Sinks(echo=echo, intake=intake, metrics=metrics, connection=connection, stopping=stopping,
                  delivery=delivery)  # fmt: skip
    network = None
    if connection is not None and delivery is not None:
        network = NetworkTick(
            connection, delivery, intake, sinks, availability_topic=parts.availability_topic, stopping=stopping
        )
        connection.on_tick(network.tick)
    updater, swap = None, None
    if parts.updates is not None:

        def status_changed() -> None:  # an update's step: the status message at once (the reporter, built below)
            reporter.publish_status()

        updater, swap = attach_updates(
            parts.updates, processor, device=parts.instance, config=config, on_event=status_changed,
            reserve_bytes=lambda: outbox_room(box, delivery),
        )  # fmt: skip
    notifier = notifier or SystemdNotifier()
    reporter = Reporter(
        health=config.health, metrics=metrics, queue=parts.queue, processor=processor, intake=intake, sinks=sinks,
        source=parts.source, connection=connection, updater=updater, client_id=parts.client_id,
        status_topic=parts.status_topic, notifier=notifier, supervisor=supervisor, stopping=stopping, network=network,
    )  # fmt: skip
    worker = Worker(
        parts.queue, processor, sinks, metrics,
        max_batch=config.queue.max_batch, progress=supervisor.progress, swap=swap,
    )  # fmt: skip
    return Assembled(
        parts=parts, supervisor=supervisor, stopping=stopping, notifier=notifier, silence=silence, intake=intake,
        sinks=sinks, delivery=delivery, network=network, updater=updater, swap=swap, reporter=reporter, worker=worker,
    )  # fmt: skip


def _gate_for(delivery: Delivery, max_answers: int, metrics: Metrics) -> Callable[[Intake], IntakeGate]:
    """The intake gate of an intake: its level is the inputs taken there and not answered yet, and the answers the
    broker does not have; its byte mark follows the outbox's budget (``Delivery``: the outbox is open by the time a
    source submits)."""

    def gate(intake: Intake) -> IntakeGate:
        return IntakeGate(
            lambda: flow_level(delivery, intake),
            max_answers=max_answers,
            max_bytes=lambda: delivery.outbox.bytes_cap,
            disk_full=lambda: delivery.disk_full,
            metrics=metrics,
        )

    return gate


def outbox_room(box: OutboxConfig, delivery: Delivery | None) -> int:
    """The bytes the durable outbox may still grow into on the state directory's disk (its budget less what its
    files take): what an update leaves free there (0 for an outbox in memory; the whole budget before it opens)."""
    if not box.enabled:
        return 0
    if delivery is None or not delivery.opened:
        return box.max_bytes
    outbox = delivery.outbox
    return max(0, outbox.budget - outbox.disk_bytes)
