"""``edgeline sim``: simulated sensors of one device or a fleet, publishing real samples to an MQTT broker.

    edgeline sim digits --data work --broker 127.0.0.1:1883 --rate 10 --count 100 --device pump --devices 3

Registering imports neither numpy-heavy data nor paho-mqtt; running does.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.daemon.topics import SENSOR_TOPIC
from edgeline.sim.data import MODEL_SHAPES, SENSOR_MODELS, SENSORS

if TYPE_CHECKING:
    from edgeline.sim.publisher import PublishOptions
    from edgeline.sim.sensors import Sensor

__all__ = ["add_sensor_arguments", "make_sensors", "publish_options", "register"]

DEFAULT_BROKER = "127.0.0.1:1883"
DEFAULT_DEVICE = "sim"


def register(subparsers: Any) -> None:
    """Add ``sim`` to the ``edgeline`` command."""
    models = "; ".join(f"{sensor}: {', '.join(names)}" for sensor, names in SENSOR_MODELS.items())
    parser = subparsers.add_parser(
        "sim",
        help="simulated sensors: publish real validation samples to an MQTT broker",
        description="Replay the validation samples of a prepared reference model (or any .npz) as sensor "
        "messages {id, data, label} of one device or a fleet, seeded, at a fixed rate, for a bounded count "
        f"and time. Sensors and the reference models they feed: {models}.",
    )
    add_sensor_arguments(parser)
    parser.add_argument(
        "--broker", default=DEFAULT_BROKER, metavar="HOST:PORT", help=f"MQTT broker (default {DEFAULT_BROKER})"
    )
    parser.add_argument(
        "--qos",
        type=int,
        choices=[0, 1],
        default=1,
        metavar="QOS",
        help="MQTT quality of service: %(choices)s (default 1, as `edgeline run`)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write the messages to FILE (- for stdout) as a recording for `edgeline run --replay`, not to a broker",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.set_defaults(func=run_sim)


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


def run_sim(args: argparse.Namespace) -> int:
    from edgeline.daemon.config import BrokerAddress
    from edgeline.sim.publisher import publish, record

    options = publish_options(args, qos=args.qos)
    if args.out is not None:
        report = record(make_sensors(args), args.out, options)
    else:
        broker = BrokerAddress.parse(args.broker)
        report = publish(make_sensors(args), broker, options)
    summary = json.dumps(asdict(report)) if args.json else report.summary()
    print(summary, file=sys.stderr if args.out == "-" else sys.stdout, flush=True)
    return 0
