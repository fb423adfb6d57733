"""What to simulate, how fast and for how long, as command-line arguments: shared by ``edgeline sim``
(``edgeline.sim.cli``) and ``edgeline run --sim`` (``edgeline.sim.source``, a daemon source, which never imports a
command module).

Adding the arguments imports neither numpy-heavy data nor paho-mqtt; making the sensors does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from edgeline.daemon.topics import SENSOR_TOPIC
from edgeline.sim.data import MODEL_SHAPES, SENSORS

if TYPE_CHECKING:
    from edgeline.sim.publisher import PublishOptions
    from edgeline.sim.sensors import Sensor

__all__ = ["DEFAULT_DEVICE", "add_sensor_arguments", "make_sensors", "publish_options"]

DEFAULT_DEVICE = "sim"


def add_sensor_arguments(parser: argparse.ArgumentParser) -> None:
    """What to simulate, how fast and for how long: shared by ``edgeline sim`` and ``edgeline run --sim``."""
    parser.add_argument("sensor", metavar="SENSOR", choices=SENSORS, help="one of: %(choices)s")
    parser.add_argument(
        "--rate", type=float, default=10.0, metavar="HZ", help="messages per second per device; 0: unpaced"
    )
    parser.add_argument("--count", type=int, default=100, metavar="N", help="messages per device (default 100)")
    parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        metavar="ID",
        help=f"device id, or the fleet's prefix (default {DEFAULT_DEVICE})",
    )
    parser.add_argument("--devices", type=int, default=1, metavar="N", help="fleet size: devices ID-001 ... ID-NNN")
    parser.add_argument(
        "--data",
        type=Path,
        metavar="DIR_OR_NPZ",
        help="the --out DIR of `edgeline reference prepare MODEL` (or DIR/MODEL), or an .npz file to replay",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_SHAPES),
        metavar="NAME",
        help="reference model to feed: %(choices)s (the sensor's own by default; camera: resnet8 or vww)",
    )
    parser.add_argument(
        "--topic",
        default=SENSOR_TOPIC,
        metavar="TEMPLATE",
        help=f"fields {{device}} and {{sensor}} (default {SENSOR_TOPIC}: where `edgeline run` listens by default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="order and anomaly seed (default 0)")
    parser.add_argument(
        "--anomaly-rate", type=float, metavar="P", help="vibration: share of messages replaying an anomaly (default 0)"
    )
    parser.add_argument(
        "--time-limit", type=float, default=600.0, metavar="S", help="stop after S seconds at most (default 600)"
    )
    parser.add_argument("--no-label", action="store_true", help="leave the ground-truth label out of messages")


def make_sensors(args: argparse.Namespace) -> list[Sensor]:
    """The sensors of every device the arguments name, with their samples loaded."""
    from edgeline.sim.data import load_sensor_samples, resolve_model
    from edgeline.sim.sensors import fleet_devices, make_sensor

    model = resolve_model(args.sensor, args.model)
    samples = load_sensor_samples(args.data, model)
    return [
        make_sensor(
            args.sensor,
            samples,
            device=device,
            seed=args.seed,
            anomaly_rate=args.anomaly_rate,
            with_label=not args.no_label,
        )
        for device in fleet_devices(args.device, args.devices)
    ]


def publish_options(args: argparse.Namespace, qos: int = 0) -> PublishOptions:
    """How many messages, how fast, where and for how long: checked, with errors naming the flag."""
    from edgeline.sim.publisher import PublishOptions

    return PublishOptions(count=args.count, rate_hz=args.rate, topic=args.topic, qos=qos, time_limit_s=args.time_limit)
