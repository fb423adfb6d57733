"""Simulated sensors as a daemon source: ``edgeline run BUNDLE --sim 'digits --count 10 --devices 3'``.

The same sensors, messages and pacing as ``edgeline sim``, handed to the daemon in-process instead of through a
broker. ``edgeline.daemon.config.SOURCES`` registers this class as ``"sim"`` by name and imports it only when a
configuration asks for it, so the device side never loads it otherwise.
"""

from __future__ import annotations

import argparse
import shlex
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from edgeline.daemon.config import SourceConfig
from edgeline.daemon.messages import Message
from edgeline.daemon.sources import SourceBase
from edgeline.daemon.topics import TopicFilter
from edgeline.errors import EdgelineError
from edgeline.sim.publisher import Pacing, fleet_messages
from edgeline.sim.sensor_arguments import add_sensor_arguments, make_sensors, publish_options
from edgeline.sim.sensors import Sensor

__all__ = ["SimSource"]


class _Arguments(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise EdgelineError(f"--sim: {message}")


class SimSource(SourceBase):
    needs = ("sim", "the arguments of `edgeline sim`, e.g. 'digits --count 10'")
    finite = True

    @classmethod
    def lossless(cls, settings: SourceConfig) -> bool:
        return True  # a bounded simulation waits for the model, like a recording

    @classmethod
    def from_config(
        cls, settings: SourceConfig, *, filters: Sequence[TopicFilter], max_payload_bytes: int
    ) -> SimSource:
        assert settings.sim is not None  # ``needs``
        return cls(settings.sim, device=settings.device)

    def __init__(self, arguments: str, *, device: str | None = None):
        parser = _Arguments(prog="--sim", add_help=False)
        add_sensor_arguments(parser)
        try:
            words = shlex.split(arguments)
        except ValueError as exc:
            raise EdgelineError(f"--sim {arguments!r}: {exc}") from exc
        self.args = parser.parse_args(words)
        if device is not None and "--device" not in words:
            self.args.device = device
        self.options = publish_options(self.args)
        rate = "unpaced" if self.options.rate_hz == 0 else f"{self.options.rate_hz:g} Hz"
        self.description = (
            f"simulated {self.args.sensor} sensors ({self.args.devices} x {self.options.count} messages, {rate})"
        )
        self._sensors: list[Sensor] = []

    def open(self) -> None:
        self._sensors = make_sensors(self.args)

    def run(self, submit: Callable[[Message], None], stopping: threading.Event) -> None:
        options = self.options
        pacing = Pacing(options.rate_hz, len(self._sensors), options.time_limit_s, wait=stopping.wait)
        for message in pacing.paced(fleet_messages(self._sensors, options.count, options.topic)):
            if stopping.is_set():
                return
            submit(Message(topic=message.topic, payload=message.payload, device=message.device))
