"""The daemon's configuration: a validated TOML file, overridden by command-line flags.

[daemon]   state_dir (default: $STATE_DIRECTORY from systemd, else $XDG_STATE_HOME/edgeline or ~/.local/state/edgeline),
           instance (default: derived from the host name and the state directory), drain_timeout_s
[source]   kind = "mqtt" | "serial" | "replay" | "sim" | "camera" (a key of ``SOURCES``); url, baudrate, protocol
           ("json-lines" | "frames": the firmware bridge's framed protocol, boards named by their HELLO) (serial);
           path, speed (replay); sim (the arguments of `edgeline sim`); device (the stream key of messages that carry
           no topic)
[broker]   host, port, client_id (template with {name}, {instance}), keepalive_s, protocol ("5" or "3.1.1"),
           session_expiry_s (7 days; 300 s with a shared subscription), reconnect_max_s, connect_timeout_s,
           max_inflight, max_queued; TLS: tls_ca_file, tls_cert_file, tls_key_file, tls_insecure_skip_verify;
           username, password_file (or $EDGELINE_MQTT_PASSWORD)
[input]    subscribe (default ["sensors/+/+"]: where `edgeline sim` publishes, sensors/{device}/{sensor}; or e.g.
           "$share/GROUP/sensors/+/accel"), codec, qos, max_payload_bytes, max_streams (windowed models: streams
           kept at once; the least recently used is evicted, counted), silence_warning_s (warn once when a
           subscription has heard nothing for that long; 0: never)
[output]   publish = "edgeline/{name}/{device}/result", error_topic, qos, mqtt (publish results to the broker;
           always with the MQTT source, otherwise only when set or --broker is given: else they go to stdout)
[queue]    capacity, policy = "drop-oldest" | "block" (default: block for MQTT at QoS 1, whose backlog waits at
           the broker, for replay and sim, and for framed serial, whose boards wait and resend; drop-oldest for
           serial JSON lines and MQTT at QoS 0), max_batch (inputs taken at once, and run as one batch when the
           model allows it; 1 = one sample per call)
[outbox]   enabled (false: the same bounds in memory, lost with the process), max_answers, max_bytes (the outbox's
           files, WAL included, take at most this, and at most half of the state directory's file system:
           edgeline.disk), ttl_s, synchronous ("full": survives a power cut; "normal": a crash),
           commit_interval_s (group commit: at most one fsync per interval, default 20 ms)
[health]   availability_topic, status_topic, status_interval_s, prometheus_port (0 = off), prometheus_host (loopback)
[window]   size, hop, channels (overrides the bundle's)
[camera]   sources (["NAME=SOURCE", ...]: files, image folders, rtsp://, http://, /dev/video0, picamera2:0, testsrc:),
           open_timeout_s, read_timeout_s, stall_s, reconnect_max_s, max_age_ms (0: off), speed ("max" | "realtime"
           | a factor: for files and image folders), snapshot_every_s, snapshot_when, snapshot_topic,
           snapshot_max_files, snapshot_max_bytes, snapshot_min_interval_s (see edgeline.daemon.camera)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from edgeline.daemon.topics import SENSOR_SUBSCRIPTION, TopicFilter, validate_template
from edgeline.device_profiles.toml import tomllib
from edgeline.device_profiles.validation import describe_validation_error
from edgeline.errors import EdgelineError
from edgeline.manifest import Window
from edgeline.registry import resolve
from edgeline.updates.policy import DOWNLOAD_TIMEOUT_S

__all__ = ["DEFAULT_QOS", "SOURCES", "BrokerAddress", "BrokerConfig", "DaemonConfig", "load_config", "source_class"]

CODEC_NAMES = ("json", "raw", "cbor", "msgpack")
SOURCES: dict[str, str] = {
    "mqtt": "edgeline.daemon.mqtt:MqttSource",
    "serial": "edgeline.daemon.sources:SerialSource",
    "replay": "edgeline.daemon.sources:ReplaySource",
    "sim": "edgeline.sim.source:SimSource",
    "camera": "edgeline.daemon.camera:CameraSource",
}
"""The one place a source is registered: ``[source] kind`` -> its class, as "module:Class", imported only when a
configuration names that kind (``edgeline.registry``). The kinds the configuration accepts (and lists when refusing
one) are these keys, in this order; what a kind needs, whether it loses nothing and how it is made are asked of its
class (``edgeline.daemon.sources.SourceBase``). Strings, not classes: this module cannot import the sources (they
import it), and ``edgeline.sim`` and the cameras are loaded only by a configuration that asks for them.
docs/adding-an-input-source.md."""
DEFAULT_PORT = 1883
SESSION_EXPIRY_S = 7 * 86400
SHARED_SESSION_EXPIRY_S = 300
"""Long enough for a restart or a reboot to find its session (and its share of the stream) again; short enough
that the share of a member that died is not held back from the live members for days."""
DEFAULT_QOS: Literal[0, 1] = 1
"""Of the daemon's subscriptions and answers, and of ``edgeline sim``: at least once on both sides."""


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker listens: an explicit host (``127.0.0.1`` for this machine) and a port."""

    host: str
    port: int = DEFAULT_PORT

    def __post_init__(self) -> None:
        if not self.host or any(char.isspace() for char in self.host) or "/" in self.host:
            raise EdgelineError(f"--broker host {self.host!r}: expected a host name or address, e.g. 127.0.0.1")
        if not 1 <= self.port <= 65535:
            raise EdgelineError(f"--broker port {self.port}: must be between 1 and 65535")

    @classmethod
    def parse(cls, text: str) -> BrokerAddress:
        """``HOST:PORT``, ``HOST`` (port 1883) or ``[IPv6]:PORT``."""
        host, port = text, str(DEFAULT_PORT)
        if text.startswith("["):
            host, bracket, rest = text[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise EdgelineError(f"--broker {text!r}: expected [IPv6]:PORT, e.g. [::1]:1883")
            port = rest[1:] or port
        elif text.count(":") == 1:
            host, _, port = text.partition(":")
        elif ":" in text:
            raise EdgelineError(f"--broker {text!r}: write an IPv6 address in brackets, e.g. [::1]:1883")
        if not port.isdigit():
            raise EdgelineError(f"--broker {text!r}: expected HOST:PORT, e.g. 127.0.0.1:1883")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def source_class(kind: str) -> Any:
    """The class registered for ``kind`` in ``SOURCES`` (a ``edgeline.daemon.sources.SourceBase``; typed ``Any``
    here, which cannot import it), imported on first use. One this install left out is a
    ``BackendUnavailableError`` naming what is missing."""
    return resolve(SOURCES, kind, "source", EdgelineError)


def _one_of(choices: list[str]) -> str:
    """``'a', 'b' or 'c'``: how pydantic words a ``Literal``'s choices (``describe_validation_error`` lists them)."""
    quoted = [repr(choice) for choice in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class SourceConfig(_Section):
    kind: str = "mqtt"
    """One of ``SOURCES`` (checked when validated, so a source registered later is a valid kind)."""
    url: str | None = None
    baudrate: int = Field(default=115200, ge=50, le=4_000_000)
    protocol: Literal["json-lines", "frames"] = "json-lines"
    path: str | None = None
    speed: float = Field(default=0.0, ge=0.0, le=1000.0)
    sim: str | None = None
    device: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[^/+#\s]+$")

    @field_validator("kind", mode="before")
    @classmethod
    def _registered(cls, kind: object) -> object:
        if isinstance(kind, str) and kind in SOURCES:
            return kind
        # worded as pydantic words a Literal's refusal: the same line as when the kinds were a Literal
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": _one_of(list(SOURCES))})

    @model_validator(mode="after")
    def _complete(self) -> SourceConfig:
        if self.protocol != "json-lines" and self.kind != "serial":  # source.protocol is the serial source's key
            raise ValueError(f"source.protocol = {self.protocol!r} applies to the serial source, not {self.kind}")
        needs: tuple[str, str] | None = source_class(self.kind).needs
        if needs is not None:
            key, example = needs
            if not getattr(self, key):
                raise ValueError(f"the {self.kind} source needs source.{key}: {example}")
        return self


def _answer_template(template: str | None) -> str | None:
    """A topic template with ``{device}``, ``{name}``, ``{instance}``, checked (pydantic's ``ValueError``)."""
    if template is None:
        return None
    try:
        return validate_template(template)
    except EdgelineError as exc:
        raise ValueError(str(exc)) from exc


SNAPSHOT_WHEN = r"^(label=[^,]+|score>=(0(\.\d+)?|1(\.0+)?))(,(label=[^,]+|score>=(0(\.\d+)?|1(\.0+)?)))*$"


class CameraConfig(_Section):
    """Cameras and video (``edgeline.daemon.camera``); every wait bounded."""

    sources: tuple[str, ...] = ()
    """``[NAME=]SOURCE`` each (``edgeline.video.parse_camera``); NAME defaults to cam0, cam1, ..."""
    open_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """Opening a source (connect, handshake, first header) must end within this."""
    read_timeout_s: float = Field(default=5.0, gt=0, le=600)
    """One read from the source (a socket read) must return within this, else the source is closed and reopened:
    a stall (a frozen server, a pulled cable)."""
    stall_s: float = Field(default=10.0, gt=0, le=3600)
    """A source that sends data but no frame for this long (garbage, another kind of stream) is a stall too."""
    reconnect_max_s: float = Field(default=2.0, ge=0.1, le=3600)
    """The longest wait between two attempts to reopen (the daemon's back-off: 0.25 s doubling, with jitter). Short by
    default: a camera is this device's own (on its cable or its LAN), an attempt costs one connection, and a camera
    that is back must be answered within seconds (benchmarks/results/camera.md: 30 s gave 3.1-4.1 s from the server's
    return to the first answer, 2 s gave 1.0-2.1 s)."""
    max_age_ms: float = Field(default=0.0, ge=0)
    """A frame older than this when the model is free for it is dropped as ``stale``; 0: off."""
    speed: str = "max"
    """Files and image folders: ``max`` (as fast as the model takes them), ``realtime`` (at the file's own
    timestamps), or a factor of it (``2``: twice as fast)."""
    snapshot_every_s: float = Field(default=0.0, ge=0)
    """A JPEG of an answered frame at most this often per camera; 0: only on ``snapshot_when``."""
    snapshot_when: str | None = Field(default=None, pattern=SNAPSHOT_WHEN)
    """``label=NAME`` and/or ``score>=X`` (comma: all must hold): a snapshot when an answer meets it."""
    snapshot_topic: str | None = None
    """Publish snapshots there too (template with {name}, {device}, {instance}); default: files only."""
    snapshot_files: bool = True
    """Write snapshots to ``<state dir>/snapshots``."""
    snapshot_max_files: int = Field(default=200, ge=1, le=1_000_000)
    snapshot_max_bytes: int = Field(default=50 << 20, ge=1 << 16)
    snapshot_min_interval_s: float = Field(default=1.0, ge=0)
    """Snapshots of one camera are at least this far apart, whatever asks for them."""

    @field_validator("speed")
    @classmethod
    def _speed(cls, speed: str) -> str:
        camera_speed(speed)
        return speed

    @field_validator("snapshot_topic")
    @classmethod
    def _template(cls, template: str | None) -> str | None:
        return _answer_template(template)

    @property
    def snapshots(self) -> bool:
        return self.snapshot_every_s > 0 or self.snapshot_when is not None


def camera_speed(text: str) -> float:
    """``max`` (or 0) -> 0 (unpaced), ``realtime`` -> 1, a positive factor as it is."""
    if text == "max":
        return 0.0
    if text == "realtime":
        return 1.0
    try:
        factor = float(text)
    except ValueError:
        factor = -1.0
    if not 0 <= factor <= 1000:
        raise ValueError(f"speed {text!r}: expected max, realtime or a factor between 0 and 1000, e.g. 2")
    return factor


class DaemonSection(_Section):
    state_dir: Path | None = None
    instance: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    drain_timeout_s: float = Field(default=10.0, gt=0, le=600)


class BrokerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    client_id: str = "edgeline-{name}-{instance}"
    # A dead link is noticed within two keepalives (a PINGREQ after one, no answer after the next): 20 s.
    keepalive_s: int = Field(default=10, ge=2, le=3600)
    protocol: Literal["5", "3.1.1"] = "5"
    session_expiry_s: int | None = Field(default=None, ge=0, le=0xFFFFFFFF)
    """How long the broker keeps our session (and queues inputs for it) while we are away. Default: 7 days, or
    ``SHARED_SESSION_EXPIRY_S`` when a subscription is shared (``$share/...``): a member that dies keeps its share
    of the stream queued for it until its session expires, while the other members could answer it."""
    reconnect_max_s: float = Field(default=10.0, ge=0.1, le=3600)
    connect_timeout_s: float = Field(default=10.0, gt=0, le=600)
    max_inflight: int = Field(default=64, ge=1, le=65535)
    max_queued: int = Field(default=1024, ge=1, le=1_000_000)
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_insecure_skip_verify: bool = False
    username: str | None = Field(default=None, min_length=1)
    password_file: Path | None = None

    @field_validator("client_id")
    @classmethod
    def _client_id(cls, client_id: str) -> str:
        try:
            client_id.format(name="n", instance="i")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"client_id {client_id!r}: only {{name}} and {{instance}} may be used ({exc})") from exc
        return client_id

    @model_validator(mode="after")
    def _pairs(self) -> BrokerConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("a client certificate needs both tls_cert_file and tls_key_file")
        if self.password_file is not None and self.username is None:
            raise ValueError("password_file needs a username")
        return self

    def session_expiry(self, shared: bool) -> int:
        """The session expiry to ask for: the one set, else the default for shared subscriptions or others."""
        if self.session_expiry_s is not None:
            return self.session_expiry_s
        return SHARED_SESSION_EXPIRY_S if shared else SESSION_EXPIRY_S

    @property
    def tls(self) -> bool:
        return self.tls_ca_file is not None or self.tls_cert_file is not None or self.tls_insecure_skip_verify


class InputConfig(_Section):
    subscribe: tuple[str, ...] = (SENSOR_SUBSCRIPTION,)
    codec: Literal["json", "raw", "cbor", "msgpack"] = "json"
    qos: Literal[0, 1] = DEFAULT_QOS
    max_payload_bytes: int = Field(default=1 << 20, ge=16)
    max_streams: int = Field(default=1024, ge=1, le=1_000_000)
    silence_warning_s: float = Field(default=60.0, ge=0)

    @field_validator("subscribe")
    @classmethod
    def _filters(cls, subscribe: tuple[str, ...]) -> tuple[str, ...]:
        if not subscribe:
            raise ValueError("at least one subscription is needed")
        for pattern in subscribe:
            try:
                TopicFilter(pattern)
            except EdgelineError as exc:
                raise ValueError(str(exc)) from exc
        return subscribe


class OutputConfig(_Section):
    publish: str = "edgeline/{name}/{device}/result"
    error_topic: str | None = None
    qos: Literal[0, 1] = DEFAULT_QOS
    mqtt: bool | None = None

    @field_validator("publish", "error_topic")
    @classmethod
    def _template(cls, template: str | None) -> str | None:
        return _answer_template(template)


class DetectionConfig(_Section):
    """A detector's answers: the manifest's thresholds replaced for this daemon (``edgeline.postprocess``'s
    overrides); unset, the bundle's own."""

    score_threshold: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    iou_threshold: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    max_detections: int | None = Field(default=None, ge=1, le=10_000)

    @property
    def overrides(self) -> dict[str, float]:
        return {key: value for key, value in self.model_dump().items() if value is not None}


class QueueConfig(_Section):
    capacity: int = Field(default=1024, ge=1, le=1_000_000)
    policy: Literal["drop-oldest", "block"] | None = None
    max_batch: int = Field(default=16, ge=1, le=4096)


class OutboxConfig(_Section):
    """The durable outbox between the worker and the broker (see ``edgeline.daemon.outbox``)."""

    enabled: bool = True
    max_answers: int = Field(default=100_000, ge=1)
    max_bytes: int = Field(default=64 << 20, ge=1024)
    """The most the outbox's files (database and WAL) take on the disk; the budget in effect is smaller on a small
    disk: half of the state directory's file system (``edgeline.disk``)."""
    ttl_s: float = Field(default=86400.0, gt=0)
    synchronous: Literal["full", "normal"] = "full"
    commit_interval_s: float = Field(default=0.02, ge=0, le=1)
    """Group commit: at most one commit (one fsync) per interval, for every answer that came meanwhile. 0: commit
    as soon as the disk is free."""


class HealthConfig(_Section):
    availability_topic: str = "edgeline/{name}/{instance}/availability"
    status_topic: str = "edgeline/{name}/{instance}/status"
    status_interval_s: float = Field(default=10.0, gt=0)
    prometheus_port: int = Field(default=0, ge=0, le=65535)
    prometheus_host: str = "127.0.0.1"

    @field_validator("availability_topic", "status_topic")
    @classmethod
    def _template(cls, template: str) -> str:
        try:
            return validate_template(template, ("name", "instance"), what="health topic")
        except EdgelineError as exc:
            raise ValueError(str(exc)) from exc


class UpdatesConfig(_Section):
    """Signed updates (``edgeline.updates``): where to look, the root metadata to trust, how often."""

    repository: str | None = None
    """A directory, a file:// URL or an http(s):// URL of a repository ``edgeline publish`` writes."""
    trusted_root: Path | None = None
    """The root.json of ``edgeline keys generate``, pinned on the device."""
    check_interval_s: float = Field(default=300.0, gt=0, le=7 * 86400)
    download_timeout_s: float = Field(default=DOWNLOAD_TIMEOUT_S, gt=0, le=86400)
    """Each file a check downloads (metadata, an archive) must arrive whole within this, or it is given up (refusal
    ``timeout``) and tried again at the next check: set it for the largest archive over the slowest link."""
    cage: bool = True
    """Open and self-test a new version in a child process first (``edgeline.updates.cage``): a version that
    crashes, hangs or bloats its runtime is refused (``crashed``, ``hung``, ``too-big``) and the daemon never opens
    it. ``false`` opens it in the daemon (a device that cannot afford a second interpreter for a few seconds)."""
    open_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """The cage's deadline: start, open, self-test and exit of a new version, as a whole."""
    cage_memory_mb: float | None = Field(default=None, gt=0)
    """What the caged version may take beyond a bare interpreter; default: the runtime's headroom, the version's
    measured memory (with a margin) and its golden arrays, at most 90% of what the daemon can still take."""

    @model_validator(mode="after")
    def _both(self) -> UpdatesConfig:
        if (self.repository is None) != (self.trusted_root is None):
            given = "repository" if self.repository is not None else "trusted_root"
            raise ValueError(
                f"updates.{given} is set alone: updates need a repository and the trusted root that signs it"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.repository is not None


class DaemonConfig(_Section):
    daemon: DaemonSection = DaemonSection()
    source: SourceConfig = Field(default_factory=SourceConfig.model_construct)
    """Default: MQTT with nothing else set, valid as it is; not validated, which would import the MQTT source's
    module (paho) wherever a configuration without ``[source]`` is read (``edgeline doctor``)."""
    broker: BrokerConfig = BrokerConfig()
    input: InputConfig = InputConfig()
    output: OutputConfig = OutputConfig()
    queue: QueueConfig = QueueConfig()
    outbox: OutboxConfig = OutboxConfig()
    health: HealthConfig = HealthConfig()
    updates: UpdatesConfig = UpdatesConfig()
    camera: CameraConfig = CameraConfig()
    detection: DetectionConfig = DetectionConfig()
    window: Window | None = None

    @model_validator(mode="before")
    @classmethod
    def _cameras_are_the_source(cls, data: object) -> object:
        """``[camera] sources`` without a ``[source] kind``: the cameras are the source."""
        if isinstance(data, dict):
            camera, source = data.get("camera"), data.get("source")
            has_kind = isinstance(source, dict) and "kind" in source
            if isinstance(camera, dict) and camera.get("sources") and (source is None or isinstance(source, dict)):
                data = data if has_kind else {**data, "source": {**(source or {}), "kind": "camera"}}
        return data

    @model_validator(mode="after")
    def _mqtt_source_publishes(self) -> DaemonConfig:
        if self.source.kind == "mqtt" and self.output.mqtt is False:
            raise ValueError("output.mqtt = false needs a source other than MQTT (the answers would go nowhere)")
        if (self.source.kind == "camera") != bool(self.camera.sources):
            raise ValueError(
                'the camera source needs camera.sources (e.g. ["cam0=rtsp://127.0.0.1:8554/scene"])'
                if self.camera.sources == ()
                else f'camera.sources is set, but the source is {self.source.kind}: set source.kind = "camera"'
            )
        json_only: str | None = None if self.input.codec == "json" else source_class(self.source.kind).json_only
        if json_only is not None:
            raise ValueError(
                f"input.codec = {self.input.codec!r}: the {self.source.kind} source hands the daemon JSON ({json_only})"
            )
        return self

    @property
    def uses_broker(self) -> bool:
        """Whether the daemon connects to the broker: for the MQTT source, or to publish another source's answers."""
        return self.source.kind == "mqtt" or bool(self.output.mqtt)

    @property
    def queue_policy(self) -> str:
        if self.queue.policy is not None:
            return self.queue.policy
        if source_class(self.source.kind).lossless(self.source) or (
            self.source.kind == "mqtt" and self.input.qos == 1  # [input] qos: the broker keeps the backlog
        ):
            return "block"  # recordings and at-least-once inputs must lose nothing
        return "drop-oldest"

    def with_overrides(
        self,
        *,
        broker: str | None = None,
        subscribe: list[str] | None = None,
        publish: str | None = None,
        codec: str | None = None,
        qos: int | None = None,
        source: dict[str, object] | None = None,
        state_dir: Path | None = None,
        instance: str | None = None,
        updates: str | None = None,
        trusted_root: Path | None = None,
        check_interval_s: float | None = None,
        download_timeout_s: float | None = None,
        camera: dict[str, object] | None = None,
        detection: Mapping[str, object] | None = None,
    ) -> DaemonConfig:
        """The command line wins over the file; the result is validated like the file.

        ``source``: the source flags given (``kind`` and its settings); ``--broker`` with a source other than MQTT
        means "publish the answers there".
        """
        data = self.model_dump()
        if source:
            if "kind" in source and source["kind"] != data["source"]["kind"]:
                data["source"] = {"device": data["source"]["device"]}  # another kind: its own settings only
                data["camera"]["sources"] = ()
            data["source"].update({key: value for key, value in source.items() if value is not None})
        if camera:
            data["camera"].update({key: value for key, value in camera.items() if value is not None})
            if camera.get("sources"):
                data["source"] = {"kind": "camera", "device": data["source"]["device"]}
        if broker is not None:
            address = BrokerAddress.parse(broker)
            data["broker"].update(host=address.host, port=address.port)
            if data["source"].get("kind", "mqtt") != "mqtt" and data["output"]["mqtt"] is None:
                data["output"]["mqtt"] = True
        if subscribe:
            data["input"]["subscribe"] = tuple(subscribe)
        if publish is not None:
            data["output"]["publish"] = publish
        if codec is not None:
            data["input"]["codec"] = codec
        if qos is not None:
            data["input"]["qos"] = qos
            data["output"]["qos"] = qos
        if state_dir is not None:
            data["daemon"]["state_dir"] = state_dir
        if instance is not None:
            data["daemon"]["instance"] = instance
        if updates is not None:
            data["updates"]["repository"] = updates
        if trusted_root is not None:
            data["updates"]["trusted_root"] = trusted_root
        if check_interval_s is not None:
            data["updates"]["check_interval_s"] = check_interval_s
        if download_timeout_s is not None:
            data["updates"]["download_timeout_s"] = download_timeout_s
        if detection:
            data["detection"].update({key: value for key, value in detection.items() if value is not None})
        return _validate(data, "command line")


def _validate(data: object, source: str) -> DaemonConfig:
    try:
        return DaemonConfig.model_validate(data)
    except ValidationError as exc:
        raise EdgelineError(
            describe_validation_error(exc, DaemonConfig, f"{source}: invalid daemon configuration")
        ) from exc


def load_config(path: Path | None) -> DaemonConfig:
    """The file's settings over the defaults; no file, the defaults."""
    if path is None:
        return DaemonConfig()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EdgelineError(f"--config {path}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EdgelineError(f"{path}: not valid TOML: {exc}") from exc
    return _validate(data, str(path))
