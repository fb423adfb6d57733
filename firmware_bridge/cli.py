"""``edgeline bridge URL [URL ...] --broker HOST:PORT``: boards on serial ports to MQTT (``edgeline.firmware_bridge
.bridge``). Registering imports nothing heavy."""

from __future__ import annotations

import argparse
import re
import signal
import threading
from typing import Any

from edgeline.errors import EdgelineError

__all__ = ["register"]

_INSTANCE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def register(subparsers: Any) -> None:
    from edgeline.firmware_bridge.topics import DEFAULT_ANSWERS, DEFAULT_CONFIG, DEFAULT_PUBLISH, DEFAULT_RESULTS

    parser = subparsers.add_parser(
        "bridge",
        help="boards on serial ports (the framed protocol) to an MQTT broker, and their answers back down",
        description="Read microcontroller boards speaking edgeline's framed serial protocol (docs/firmware-"
        "protocol.md) and publish every sample in the daemon's payload format; send each answer a daemon "
        "publishes for a board back down to it. With the default topics, `edgeline bridge` and `edgeline run` "
        "meet. Runs until SIGTERM or Ctrl-C; a port that goes away is reopened.",
    )
    parser.add_argument("urls", nargs="+", metavar="URL", help="pyserial URLs: /dev/ttyACM0, socket://HOST:PORT, ...")
    parser.add_argument("--broker", default="127.0.0.1:1883", metavar="HOST:PORT", help="MQTT broker")
    parser.add_argument(
        "--publish",
        default=DEFAULT_PUBLISH,
        metavar="TEMPLATE",
        help=f"where samples go, with {{device}} and {{stream}} (default {DEFAULT_PUBLISH})",
    )
    parser.add_argument(
        "--answers",
        default=DEFAULT_ANSWERS,
        metavar="FILTER",
        help=f"the answers to send down, a filter with {{device}} (default {DEFAULT_ANSWERS}: the daemon's)",
    )
    parser.add_argument(
        "--results",
        default=DEFAULT_RESULTS,
        metavar="TEMPLATE",
        help=f"where the boards' own results go, with {{device}} and {{stream}} (default {DEFAULT_RESULTS})",
    )
    parser.add_argument(
        "--board-config",
        default=DEFAULT_CONFIG,
        metavar="TEMPLATE",
        help=f"where a board's settings are published (JSON: rate_hz, streams on/off; retained), sent down as a "
        f"CONFIG frame, with {{device}} (default {DEFAULT_CONFIG})",
    )
    parser.add_argument("--qos", type=int, choices=[0, 1], default=1, metavar="QOS", help="MQTT QoS (default 1)")
    parser.add_argument("--baudrate", type=int, default=115200, metavar="N", help="serial speed (default 115200)")
    parser.add_argument("--instance", metavar="ID", help="this bridge's id in its topics (default host-pid)")
    parser.add_argument(
        "--status-interval", type=float, default=10.0, metavar="S", help="status message period (default 10 s)"
    )
    parser.add_argument("--prometheus-port", type=int, default=0, metavar="PORT", help="serve /metrics (0: off)")
    parser.add_argument(
        "--max-unanswered",
        type=int,
        default=500,
        metavar="N",
        help="samples published and not yet answered, per daemon, at most (default 500, under a stock Mosquitto's "
        "queue of 1,000 per client): past it other samples than reliable ones are dropped, counted (a reliable frame "
        "is acknowledged to its board once every sample of it is answered, whatever this is); 0: no limit, for "
        "samples nobody answers: a reliable frame is then acknowledged at the broker's PUBACK, and the broker's "
        "queue limits apply",
    )
    parser.add_argument(
        "--answer-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="a sample not answered this long leaves the window: a reliable one is taken again from its board's "
        "resend and published again, any other is counted as unanswered (default 60 s)",
    )
    parser.add_argument("--for", dest="duration", type=float, metavar="S", help="stop after S seconds")
    parser.set_defaults(func=run_bridge)


def _template(flag: str, template: str, fields: tuple[str, ...], wildcards: bool = False) -> str:
    try:
        rendered = template.format(**{name: "x" for name in (*fields, "instance")})
    except (KeyError, IndexError, ValueError) as exc:
        raise EdgelineError(f"{flag} {template!r}: only {{{'}, {'.join(fields)}}} may be used ({exc})") from None
    if "{device}" not in template:
        raise EdgelineError(f"{flag} {template!r}: needs {{device}}, so that each board has its own topics")
    if not wildcards and ("+" in rendered or "#" in rendered):
        raise EdgelineError(f"{flag} {template!r}: a topic to publish to cannot hold a wildcard (+ or #)")
    return template


def run_bridge(args: argparse.Namespace) -> int:
    from edgeline.daemon.config import BrokerAddress
    from edgeline.firmware_bridge.bridge import Bridge, BridgeOptions

    if args.instance is not None and not _INSTANCE.match(args.instance):
        raise EdgelineError(f"--instance {args.instance!r}: 1-64 letters, digits, '.', '_' or '-'")
    if not 0 < args.status_interval <= 3600:
        raise EdgelineError(f"--status-interval {args.status_interval:g}: between 0 and 3600 seconds")
    if args.max_unanswered < 0:
        raise EdgelineError(f"--max-unanswered {args.max_unanswered}: 0 (no limit) or more")
    if not 0 < args.answer_timeout <= 86400:
        raise EdgelineError(f"--answer-timeout {args.answer_timeout:g}: between 0 and 86400 seconds")
    options = BridgeOptions(
        publish=_template("--publish", args.publish, ("device", "stream")),
        answers=_template("--answers", args.answers, ("device",), wildcards=True),
        results=_template("--results", args.results, ("device", "stream")),
        board_config=_template("--board-config", args.board_config, ("device",)),
        qos=args.qos,
        baudrate=args.baudrate,
        instance=args.instance or "",
        status_interval_s=args.status_interval,
        prometheus_port=args.prometheus_port,
        max_unanswered=args.max_unanswered,
        answer_timeout_s=args.answer_timeout,
    )
    bridge = Bridge(args.urls, BrokerAddress.parse(args.broker), options)
    stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return bridge.run(stopping, args.duration)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
