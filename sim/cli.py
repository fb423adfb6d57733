"""``edgeline sim``: simulated sensors of one device or a fleet, publishing real samples to an MQTT broker.

    edgeline sim digits --data work --broker 127.0.0.1:1883 --rate 10 --count 100 --device pump --devices 3

``edgeline sim mcu``: an emulated sensor board on a serial port instead (edgeline.sim.mcu, edgeline.sim.board),
speaking the firmware bridge's wire protocol, for ``edgeline run --serial`` and ``edgeline bridge``:

    edgeline sim mcu --data work --rate 10 --count 100 --reliable

``edgeline sim camera``: a synthetic scene served as a camera on loopback, RTSP and HTTP MJPEG (edgeline.sim.camera),
for ``edgeline run --camera``:

    edgeline sim camera --rtsp 8554 --http 8080 --size 640x480 --fps 30

``edgeline sim fleet``: a fleet of real ``edgeline run`` daemons on one broker, fed inputs, checking one update
repository (edgeline.sim.fleet), for ``edgeline rollout``:

    edgeline sim fleet BUNDLE --devices 5 --broker 127.0.0.1:1883 --work work --updates REPO --trusted-root ROOT.json

Registering imports neither numpy-heavy data nor paho-mqtt; running does.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from edgeline.arguments import CommandParser, bounded_int
from edgeline.errors import EdgelineError
from edgeline.sim.camera import camera_parser
from edgeline.sim.data import SENSOR_MODELS
from edgeline.sim.sensor_arguments import add_sensor_arguments, make_sensors, publish_options

__all__ = ["add_sensor_arguments", "make_sensors", "publish_options", "register", "run_fleet", "run_mcu"]

DEFAULT_BROKER = "127.0.0.1:1883"


DEFAULT_BOARD_DEVICE = "mcu-1"
BOARDS = ("qemu", "python")


class _SimParser(CommandParser):
    """``edgeline sim SENSOR ...``, and ``edgeline sim mcu ...``, ``edgeline sim fleet ...`` and ``edgeline sim
    camera ...`` with options of their own. argparse cannot take a positional argument or a command at the same
    place, so the first word ``mcu``, ``fleet`` or ``camera`` hands the rest of the line to that parser
    (``edgeline sim mcu: error: ...`` for its mistakes); any other word is a sensor, as before. ``camera`` is also a
    sensor: a line with an option only the sensor has (``--data``, ``--model``, ``--broker``, ...) stays the
    sensor's."""

    words: dict[str, argparse.ArgumentParser]

    def parse_known_args(  # type: ignore[override]  # one signature for argparse's overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        word = getattr(self, "words", {}).get(given[0]) if given else None
        if word is not None and given[0] == "camera" and self._camera_sensor(word, given[1:]):
            word = None  # `edgeline sim camera --data ...`: the camera sensor, as before the camera server existed
        if word is not None:
            return word.parse_known_args(given[1:], namespace)
        return super().parse_known_args(given, namespace)

    def _camera_sensor(self, server: argparse.ArgumentParser, rest: list[str]) -> bool:
        """Whether ``sim camera REST`` is the camera sensor (an option only the sensor has: --data, --model,
        --broker, --out, ...) rather than the camera server (``edgeline.sim.camera``); refuses a line with both."""
        given = {word.split("=", 1)[0] for word in rest if word.startswith("--")}
        sensor = sorted(given & (set(self._option_string_actions) - set(server._option_string_actions)))
        serving = sorted(given & (set(server._option_string_actions) - set(self._option_string_actions)))
        if sensor and serving:
            self.error(
                f"camera: {', '.join(serving)} is for the camera server, {', '.join(sensor)} for the camera sensor "
                "(image samples over MQTT): one or the other"
            )
        return bool(sensor)


def register(subparsers: Any) -> None:
    """Add ``sim`` (and ``sim mcu``, ``sim fleet``) to the ``edgeline`` command."""
    models = "; ".join(f"{sensor}: {', '.join(names)}" for sensor, names in SENSOR_MODELS.items())
    help_line = "simulated sensors: publish real validation samples to an MQTT broker, or be a board on a serial port"
    listed = subparsers.add_parser("sim", help=help_line)  # its line in `edgeline --help`, and the command's prog
    parser = _SimParser(
        prog=listed.prog,
        description="Replay the validation samples of a prepared reference model (or any .npz) as sensor "
        "messages {id, data, label} of one device or a fleet, seeded, at a fixed rate, for a bounded count "
        f"and time. Sensors and the reference models they feed: {models}.",
        epilog=f"{listed.prog} mcu [--board qemu|python] [--uart socket|pty] ...: an emulated sensor board on a "
        f"serial port (QEMU's mps2-an386 Cortex-M4, or Python), speaking the firmware bridge's protocol; see "
        f"`{listed.prog} mcu --help`. {listed.prog} fleet BUNDLE --devices N ...: a fleet of `edgeline run` "
        f"daemons fed inputs, checking one update repository; see `{listed.prog} fleet --help`. {listed.prog} "
        f"camera [--rtsp PORT] [--http PORT] ...: a synthetic scene served as a camera (RTSP and HTTP MJPEG on "
        f"127.0.0.1) for `edgeline run --camera`; see `{listed.prog} camera --help`.",
    )
    subparsers.choices["sim"] = parser  # the same command, parsed by the parser that also knows `sim mcu`, `fleet`
    parser.words = {
        "mcu": _mcu_parser(f"{listed.prog} mcu"),
        "fleet": _fleet_parser(f"{listed.prog} fleet"),
        "camera": camera_parser(f"{listed.prog} camera"),
    }
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


def _mcu_parser(prog: str) -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=prog,
        description="Start an emulated sensor board and print where its UART is (one line), then run until Ctrl-C, "
        "SIGTERM or --for. The board speaks the firmware bridge's wire protocol (docs/firmware-protocol.md): a "
        "HELLO, the samples of --data on stream 1 at --rate, COUNT of them, a heartbeat and a stats line every "
        "second. The QEMU board is the C firmware (firmware_bridge/c/sensor_board.c) built for a Cortex-M4 and run "
        "on QEMU's mps2-an386; the Python board is the same session in Python.",
    )
    parser.add_argument(
        "--board",
        choices=BOARDS,
        help="qemu or python (default: qemu when qemu-system-arm and arm-none-eabi-gcc are installed)",
    )
    parser.add_argument(
        "--device", default=DEFAULT_BOARD_DEVICE, metavar="ID", help=f"the board's id (default {DEFAULT_BOARD_DEVICE})"
    )
    parser.add_argument("--rate", type=float, default=10.0, metavar="HZ", help="samples per second (default 10)")
    parser.add_argument(
        "--count", type=bounded_int(1, 2**32 - 1), default=100, metavar="N", help="samples to send (default 100)"
    )
    parser.add_argument(
        "--reliable", action="store_true", help="ask for an ACK of every sample: window of 8, go-back-N resends"
    )
    parser.add_argument(
        "--deaf",
        action="store_true",
        help="never read the RX line, as many sensor firmwares: nothing the host sends is taken (with --uart pty, "
        "the host's writes find the port full); the board's HELLO at boot is all the host learns of it",
    )
    parser.add_argument(
        "--data",
        type=Path,
        metavar="DIR_OR_NPZ",
        help="the --out DIR of `edgeline reference prepare digits` (or DIR/digits), or an .npz file to replay",
    )
    parser.add_argument(
        "--uart",
        choices=("socket", "pty"),
        default="socket",
        help="socket: socket://127.0.0.1:PORT (default); pty: a pseudo-terminal, /dev/pts/N",
    )
    parser.add_argument("--for", dest="duration", type=float, metavar="SECONDS", help="stop after SECONDS")
    parser.add_argument(
        "--build-dir",
        type=Path,
        metavar="DIR",
        help="where QEMU firmware builds are cached (default: build/mcu of the source tree, or ~/.cache/edgeline/mcu)",
    )
    parser.set_defaults(func=run_mcu)
    return parser


def _fleet_parser(prog: str) -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=prog,
        description="Start N `edgeline run` daemons of BUNDLE (devices PREFIX-01 ... PREFIX-NN, each its own "
        "process, instance id and state directory DIR/ID, its log DIR/ID.log) on one broker, all checking one "
        "update repository; feed each inputs at --rate on fleet/ID/sensors/image (answers on fleet/ID/results/image); "
        "write the fleet file for `edgeline rollout --fleet`; print a line whenever a device's running version "
        "changes, and a table of the devices at the end. Runs until Ctrl-C, SIGTERM or --for; exit 1 when a "
        "daemon ended by itself meanwhile.",
    )
    parser.add_argument("bundle", metavar="BUNDLE", type=Path, help="the bundle every device starts on")
    parser.add_argument(
        "--devices", type=bounded_int(1, 100), required=True, metavar="N", help="fleet size (each device a process)"
    )
    parser.add_argument(
        "--broker", default=DEFAULT_BROKER, metavar="HOST:PORT", help=f"MQTT broker (default {DEFAULT_BROKER})"
    )
    parser.add_argument("--work", type=Path, required=True, metavar="DIR", help="the devices' state and logs")
    parser.add_argument(
        "--updates", metavar="REPO", help="the repository every device checks: a directory, file:// or http(s):// URL"
    )
    parser.add_argument("--trusted-root", type=Path, metavar="ROOT.json", help="its pinned root metadata")
    parser.add_argument(
        "--check-interval", type=float, default=5.0, metavar="S", help="seconds between update checks (default 5)"
    )
    parser.add_argument(
        "--rate", type=float, default=5.0, metavar="HZ", help="inputs per second per device (default 5)"
    )
    parser.add_argument(
        "--canary", type=bounded_int(0, 100), default=0, metavar="K", help="the first K devices form group canary"
    )
    parser.add_argument("--prefix", default="fleet", metavar="PREFIX", help="device ids PREFIX-01 ... (default fleet)")
    parser.add_argument(
        "--data",
        type=Path,
        metavar="DIR_OR_NPZ",
        help="samples to feed: `edgeline reference prepare digits --out DIR`, or an .npz (default: seeded random)",
    )
    parser.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="input order seed (default 0)")
    parser.add_argument(
        "--fleet-file", type=Path, metavar="FLEET.toml", help="where to write the fleet file (default DIR/fleet.toml)"
    )
    parser.add_argument("--for", dest="duration", type=float, metavar="SECONDS", help="stop after SECONDS")
    parser.set_defaults(func=run_fleet)
    return parser


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


def run_mcu(args: argparse.Namespace) -> int:
    """``edgeline sim mcu``: one board, until Ctrl-C, SIGTERM, --for, or the board's own end."""
    from edgeline.sim import mcu
    from edgeline.sim.board import BoardOptions, PythonBoard, Uart, load_board_samples

    if args.duration is not None and args.duration <= 0:
        raise EdgelineError(f"--for {args.duration:g}: seconds above 0")
    options = BoardOptions(args.device, args.rate, args.count, args.reliable, deaf=args.deaf)
    samples = load_board_samples(args.data)
    kind = args.board
    if kind is None:
        missing = mcu.missing_tools()
        kind = "python" if missing else "qemu"
        if missing:
            print(f"{' and '.join(missing)} not found: the Python board instead ({mcu.TOOLS_HINT})", file=sys.stderr)
    uart = Uart(args.uart)
    board: mcu.EmulatedBoard | PythonBoard = (
        mcu.EmulatedBoard(options, samples, uart, args.build_dir)
        if kind == "qemu"
        else PythonBoard(options, samples, uart)
    )
    stopped = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers go on the main thread only
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set()) if in_main else None
    try:
        with board:
            deaf = ", deaf: it never reads its RX line" if options.deaf else ""
            print(f"board {options.device} ({board.description}{deaf}) on {board.url}", flush=True)
            deadline = None if args.duration is None else time.monotonic() + args.duration
            # until stopped: a board runs as long as its user wants; each wait is short, so a signal is seen at once
            while not stopped.is_set() and board.alive:
                left = 0.5 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                stopped.wait(min(left, 0.5))
            if not stopped.is_set() and not board.alive:
                raise EdgelineError(f"board {options.device} ({board.description}) stopped by itself")
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a board is stopped: not an error
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return 0


def run_fleet(args: argparse.Namespace) -> int:
    """``edgeline sim fleet``: until Ctrl-C, SIGTERM or --for; exit 1 when a daemon ended by itself meanwhile."""
    import queue

    from edgeline.sim.fleet import SimFleet, VersionChange

    if args.duration is not None and not args.duration > 0:
        raise EdgelineError(f"--for {args.duration:g}: seconds above 0")
    changes: queue.SimpleQueue[VersionChange] = queue.SimpleQueue()
    fleet = SimFleet(
        args.bundle, args.devices, broker=args.broker, work=args.work, updates=args.updates,
        trusted_root=args.trusted_root, check_interval_s=args.check_interval, prefix=args.prefix, rate_hz=args.rate,
        groups={"canary": args.canary} if args.canary else None, data=args.data, seed=args.seed,
        on_change=changes.put,  # printed here, not on the MQTT thread: a slow terminal must not hold it up
    )  # fmt: skip
    stopped = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers go on the main thread only
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set()) if in_main else None
    reported: set[str] = set()

    def report() -> None:
        while not changes.empty():
            print(changes.get(), flush=True)
        for device, code in fleet.crashed().items():
            if device not in reported:
                reported.add(device)
                print(f"{device}: its daemon exited ({code}); see {fleet.work / device}.log", flush=True)

    try:
        with fleet:
            path = fleet.write_fleet_file(args.fleet_file or args.work / "fleet.toml")
            updates = f"checking {args.updates} every {args.check_interval:g} s" if args.updates else "no updates"
            print(
                f"fleet of {args.devices} {fleet.name} devices on {fleet.broker} ({updates}), fed {fleet.inputs} at "
                f"{args.rate:g} Hz each; fleet file {path}",
                flush=True,
            )
            deadline = None if args.duration is None else time.monotonic() + args.duration
            # each wait is short, so a signal or a change is seen at once
            while not stopped.is_set() and (deadline is None or time.monotonic() < deadline):
                report()
                stopped.wait(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a fleet is stopped: not an error
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    report()
    print(fleet.summary(), flush=True)
    return 1 if reported else 0
