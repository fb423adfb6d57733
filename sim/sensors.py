"""Simulated sensors: seeded replays of real validation samples, one message at a time.

A sensor is made from samples (``edgeline.sim.data``), a device id and a seed. ``next_message(seq)`` is the message
number ``seq`` of that device, a pure function of (samples, device, seed, seq), so runs repeat exactly and the
devices of a fleet, seeded alike, still send different streams:

    {"id": "pump-001-17", "data": [0.25, 0.5, ...], "label": 3}

``data`` is the sample flattened, as float32 values written with the fewest digits that read back as the same
float32 (half the JSON of full float64 digits, exactly the same model input). ``label`` is the ground truth (class
id, or 1 for an anomaly and 0 for normal) so that a checker can score results end to end; the json codec reads
only ``id`` and ``data``.

Order: every pass over the samples is a fresh seeded permutation. The vibration sensor replays normal samples
(label 0) and, with probability ``anomaly_rate`` per message, an anomalous one (label 1) instead.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgeline.errors import EdgelineError
from edgeline.sim.data import SENSOR_MODELS, Samples

__all__ = [
    "ReplaySensor",
    "Sensor",
    "VibrationSensor",
    "check_device_id",
    "fleet_devices",
    "float32_values",
    "make_sensor",
]

_ANOMALY_BLOCK = 1024
"""Anomaly decisions are drawn this many at a time, each block from its own seed."""
_ORDER, _ANOMALY_ORDER, _ANOMALY_COIN = 0, 1, 2
"""Independent random streams of one sensor."""


class Sensor(Protocol):
    """One simulated sensor of one device."""

    name: str
    """The sensor kind, e.g. ``vibration``."""
    device: str

    def next_message(self, seq: int) -> dict[str, Any]:
        """Message ``seq`` (0, 1, ...): a JSON-ready dict with ``id`` and ``data``."""
        ...


def float32_values(sample: np.ndarray) -> list[float]:
    """``sample`` flattened, as the shortest decimals that read back as the same float32 values."""
    flat = np.ascontiguousarray(sample, dtype=np.float32).ravel()
    # numpy prints float32 with the fewest digits that round-trip; parsed as float64 they print the same.
    values: list[float] = flat.astype(str).astype(np.float64).tolist()
    return values


def fleet_devices(prefix: str, count: int = 1) -> list[str]:
    """Device ids: ``prefix`` alone for one device, ``prefix-001`` ... ``prefix-NNN`` for a fleet."""
    check_device_id(prefix)
    if count < 1:
        raise EdgelineError(f"--devices must be 1 or more, got {count}")
    if count == 1:
        return [prefix]
    return [f"{prefix}-{index:03d}" for index in range(1, count + 1)]


def check_device_id(device: str) -> str:
    """Refuse a device id that cannot be one MQTT topic level."""
    if not device or any(char in device for char in "/+#\x00") or device != device.strip():
        raise EdgelineError(
            f"device id {device!r}: must be non-empty, without '/', '+', '#' or surrounding spaces "
            "(it becomes one level of the topic)"
        )
    return device


def _device_key(device: str) -> int:
    return zlib.crc32(device.encode("utf-8"))


@dataclass
class _Permutations:
    """Index ``seq`` of an endless sequence of seeded permutations of ``range(size)``, one per pass."""

    size: int
    entropy: tuple[int, ...]
    _pass: int = field(default=-1, init=False)
    _order: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64), init=False)

    def __call__(self, seq: int) -> int:
        pass_number, offset = divmod(seq, self.size)
        if pass_number != self._pass:
            self._order = np.random.default_rng([*self.entropy, pass_number]).permutation(self.size)
            self._pass = pass_number
        return int(self._order[offset])


@dataclass
class ReplaySensor:
    """Replays ``samples`` in a seeded order; every message carries its sample's label when there is one."""

    name: str
    device: str
    samples: Samples
    seed: int = 0
    with_label: bool = True
    _order: _Permutations = field(init=False)

    def __post_init__(self) -> None:
        check_device_id(self.device)
        if self.seed < 0:
            raise EdgelineError(f"--seed must be 0 or more, got {self.seed}")
        self._order = _Permutations(len(self.samples), (self.seed, _device_key(self.device), _ORDER))

    def sample_index(self, seq: int) -> int:
        """Which sample message ``seq`` replays."""
        if seq < 0:
            raise ValueError(f"message numbers start at 0, got {seq}")
        return self._order(seq)

    def next_message(self, seq: int) -> dict[str, Any]:
        return _message(self.device, seq, self.samples, self.sample_index(seq), self.with_label)


@dataclass
class VibrationSensor:
    """A machine's accelerometer (log-mel frames): normal samples, and anomalous ones at ``anomaly_rate``.

    With labels, normal means label 0 and anomalous label 1. Samples without labels are all replayed as they are,
    and then no anomalies can be injected.
    """

    device: str
    samples: Samples
    seed: int = 0
    anomaly_rate: float = 0.0
    with_label: bool = True
    name: str = "vibration"
    _normal: np.ndarray = field(init=False)
    _anomalous: np.ndarray = field(init=False)
    _normal_order: _Permutations | None = field(init=False)
    _anomalous_order: _Permutations | None = field(init=False)
    _block: tuple[int, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        check_device_id(self.device)
        if self.seed < 0:
            raise EdgelineError(f"--seed must be 0 or more, got {self.seed}")
        if not 0.0 <= self.anomaly_rate <= 1.0:
            raise EdgelineError(f"--anomaly-rate must be between 0 and 1, got {self.anomaly_rate}")
        labels = self.samples.labels
        if labels is None:
            if self.anomaly_rate > 0:
                raise EdgelineError(
                    f"{self.samples.source}: has no labels, so no anomalous samples to inject; "
                    "use a validation.npz with 'labels' (1 = anomaly) or --anomaly-rate 0"
                )
            self._normal = np.arange(len(self.samples))
        else:
            self._normal = np.flatnonzero(labels == 0)
        self._anomalous = np.empty(0, dtype=np.int64) if labels is None else np.flatnonzero(labels == 1)
        if self.anomaly_rate < 1 and len(self._normal) == 0:
            raise EdgelineError(f"{self.samples.source}: no normal samples (label 0) to replay")
        if self.anomaly_rate > 0 and len(self._anomalous) == 0:
            raise EdgelineError(f"{self.samples.source}: no anomalous samples (label 1) to inject")
        key = _device_key(self.device)
        self._normal_order = _Permutations(len(self._normal), (self.seed, key, _ORDER)) if len(self._normal) else None
        self._anomalous_order = (
            _Permutations(len(self._anomalous), (self.seed, key, _ANOMALY_ORDER)) if len(self._anomalous) else None
        )
        self._block = (-1, np.empty(0, dtype=bool))

    def is_anomalous(self, seq: int) -> bool:
        """Whether message ``seq`` replays an anomalous sample."""
        if self.anomaly_rate <= 0:
            return False
        if self.anomaly_rate >= 1:
            return True
        block, offset = divmod(seq, _ANOMALY_BLOCK)
        if block != self._block[0]:
            rng = np.random.default_rng([self.seed, _device_key(self.device), _ANOMALY_COIN, block])
            self._block = (block, rng.random(_ANOMALY_BLOCK) < self.anomaly_rate)
        return bool(self._block[1][offset])

    def sample_index(self, seq: int) -> int:
        """Which sample message ``seq`` replays."""
        if seq < 0:
            raise ValueError(f"message numbers start at 0, got {seq}")
        # Each pool keeps its own order, indexed by seq: a pure function of seq, whatever was sent before.
        if self.is_anomalous(seq):
            assert self._anomalous_order is not None  # checked in __post_init__: rate > 0 needs anomalies
            return int(self._anomalous[self._anomalous_order(seq)])
        assert self._normal_order is not None  # checked in __post_init__: rate < 1 needs normal samples
        return int(self._normal[self._normal_order(seq)])

    def next_message(self, seq: int) -> dict[str, Any]:
        return _message(self.device, seq, self.samples, self.sample_index(seq), self.with_label)


def _message(device: str, seq: int, samples: Samples, index: int, with_label: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"id": f"{device}-{seq}", "data": float32_values(samples.x[index])}
    if with_label and samples.labels is not None:
        message["label"] = int(samples.labels[index])
    return message


def make_sensor(
    kind: str,
    samples: Samples,
    *,
    device: str,
    seed: int = 0,
    anomaly_rate: float | None = None,
    with_label: bool = True,
) -> Sensor:
    """The sensor ``kind`` of ``device``, replaying ``samples`` from ``seed``."""
    if kind not in SENSOR_MODELS:
        raise EdgelineError(f"unknown sensor {kind!r}; valid: {', '.join(SENSOR_MODELS)}")
    if kind == "vibration":
        rate = 0.0 if anomaly_rate is None else anomaly_rate
        return VibrationSensor(device, samples, seed=seed, anomaly_rate=rate, with_label=with_label)
    if anomaly_rate is not None:
        raise EdgelineError(f"--anomaly-rate applies to the vibration sensor only, not {kind}")
    return ReplaySensor(kind, device, samples, seed=seed, with_label=with_label)
