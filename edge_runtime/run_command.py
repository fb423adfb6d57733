"""``edgeline run``: the on-device daemon (see ``edge_runtime.daemon``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from edge_runtime.config import load_config

__all__ = ["register"]


def register(subparsers: Any) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a bundle on a stream of MQTT sensor messages",
        description="Subscribe to sensor topics, answer every message with a result or a coded error, publish "
        "status and availability. Flags override the config file.",
    )
    run.add_argument("bundle", metavar="BUNDLE", type=Path)
    run.add_argument("--config", type=Path, metavar="daemon.toml", help="daemon configuration (TOML)")
    run.add_argument("--broker", metavar="HOST:PORT", help="MQTT broker (default 127.0.0.1:1883)")
    run.add_argument("--subscribe", nargs="+", metavar="TOPIC", help="topic filters; {device} = the first + level")
    run.add_argument("--publish", metavar="TEMPLATE", help="result topic template with {device} and {name}")
    run.add_argument("--codec", choices=["json", "raw", "cbor", "msgpack"], help="input payload codec")
    run.add_argument("--qos", type=int, choices=[0, 1], help="QoS for subscriptions and results")
    run.add_argument("--backend", help="runtime backend instead of the manifest's (e.g. tflite-runtime)")
    run.add_argument("--stdout", action="store_true", help="also print every answer as a JSON line on stdout")
    run.set_defaults(func=run_daemon)


def run_daemon(args: argparse.Namespace) -> int:
    from edge_runtime.daemon import Daemon
    from edge_runtime.processor import Answer

    config = load_config(args.config).with_overrides(
        broker=args.broker, subscribe=args.subscribe, publish=args.publish, codec=args.codec, qos=args.qos
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def echo(answer: Answer) -> None:  # JSON lines whatever the codec on the wire
        sys.stdout.write(json.dumps(answer.record, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    daemon = Daemon(args.bundle, config, backend=args.backend, echo=echo if args.stdout else None)
    return daemon.run_until_signalled()
