"""``edgeline run``: the on-device daemon (see ``edgeline.daemon.service``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from edgeline.arguments import add_detection_arguments, detection_overrides
from edgeline.backends import RUNTIME_BACKENDS
from edgeline.errors import EdgelineError

__all__ = ["register"]

log = logging.getLogger(__name__)

SOURCE_FLAGS = {"serial": ("serial", "url"), "replay": ("replay", "path"), "sim": ("sim", "sim")}
"""A source's flag (its argparse dest, declared in the "sources other than MQTT" group) -> the ``[source] kind`` it
selects and the ``[source]`` key its value sets. ``--camera`` sets the ``[camera]`` section instead. The flags are
declared here rather than read from the source classes: ``edgeline run --help`` imports neither numpy nor pydantic."""
SOURCE_SETTING_FLAGS = (
    ("--baudrate", "baudrate", ("serial",)),
    ("--serial-protocol", "serial_protocol", ("serial",)),
    ("--speed", "speed", ("replay", "camera")),
    ("--max-age-ms", "max_age_ms", ("camera",)),
    ("--snapshot-every", "snapshot_every", ("camera",)),
    ("--snapshot-when", "snapshot_when", ("camera",)),
    ("--snapshot-topic", "snapshot_topic", ("camera",)),
)
"""A flag that sets one kind's setting (its name, its argparse dest) -> the kinds it applies to: given for another,
it is refused rather than dropped without a word."""


def register(subparsers: Any) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a bundle on a stream of sensor messages (MQTT, serial, a recording, simulated sensors)",
        description="Answer every sensor message with a result or a coded error. By default, subscribe to MQTT "
        "topics and publish answers, status and availability there. --serial, --replay or --sim read another "
        "source instead; their answers go to stdout, or to the broker when --broker is given. Flags override "
        "the config file.",
    )
    run.add_argument("bundle", metavar="BUNDLE", type=Path, help="bundle directory (written by `edgeline export`)")
    run.add_argument("--config", type=Path, metavar="daemon.toml", help="daemon configuration (TOML)")
    run.add_argument("--broker", metavar="HOST:PORT", help="MQTT broker (default 127.0.0.1:1883)")
    run.add_argument("--subscribe", nargs="+", metavar="TOPIC", help="topic filters; {device} = the first + level")
    run.add_argument("--publish", metavar="TEMPLATE", help="result topic template with {device} and {name}")
    run.add_argument(
        "--codec", choices=["json", "raw", "cbor", "msgpack"], metavar="CODEC", help="input payload codec: %(choices)s"
    )
    run.add_argument(
        "--qos",
        type=int,
        choices=[0, 1],
        metavar="QOS",
        help="QoS for subscriptions and results: %(choices)s (default 1: at least once; an input is acknowledged "
        "only once its answer is safe in the outbox)",
    )
    run.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="what must survive a restart (the outbox); default $STATE_DIRECTORY, else ~/.local/state/edgeline",
    )
    run.add_argument(
        "--instance", metavar="ID", help="this daemon's id in topics and results (default: host + state dir)"
    )
    run.add_argument(
        "--backend",
        choices=sorted(RUNTIME_BACKENDS),
        metavar="RUNTIME",
        help="runtime backend to run the model with instead of the manifest's: %(choices)s",
    )
    run.add_argument("--stdout", action="store_true", help="also print every answer as a JSON line on stdout")
    add_detection_arguments(run, "a detector's answers (the bundle's own settings unless given)")
    updates = run.add_argument_group("signed updates (edgeline publish): hot swap, trial, commit or roll back")
    updates.add_argument(
        "--updates", metavar="REPO", help="repository to check: a directory, file:// or http(s):// URL"
    )
    updates.add_argument(
        "--trusted-root", type=Path, metavar="ROOT.json", help="the pinned root metadata (edgeline keys generate)"
    )
    updates.add_argument("--check-interval", type=float, metavar="S", help="seconds between checks (default 300)")
    updates.add_argument(
        "--download-timeout-s",
        type=float,
        metavar="S",
        help="each file a check downloads must arrive whole within S seconds, else it is tried at the next check "
        "(default 600)",
    )
    sources = run.add_argument_group("sources other than MQTT (one at a time)")
    exclusive = sources.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--serial",
        metavar="URL",
        help="a serial port: /dev/ttyUSB0, socket://HOST:PORT, ... (JSON lines, or frames: --serial-protocol)",
    )
    exclusive.add_argument(
        "--replay", metavar="FILE", help="recorded messages, one per line (- for stdin); ends at the end of the file"
    )
    exclusive.add_argument(
        "--sim",
        metavar="'SENSOR [ARGS]'",
        help="simulated sensors in-process, with the arguments of `edgeline sim`, e.g. 'digits --count 10'",
    )
    exclusive.add_argument(
        "--camera",
        action="append",
        metavar="[NAME=]SOURCE",
        help="a camera or video (repeatable: one reader each): a video file or a folder/glob of images (every frame "
        "once), rtsp:// or http(s):// (MJPEG, HLS), /dev/video0[?width=640&height=480&fps=30&format=mjpeg], "
        "picamera2:0, testsrc: (synthetic); NAME is the device in topics and answers (default cam0, cam1, ...). "
        "The bundle must carry its pre-processing (export --preprocess)",
    )
    sources.add_argument(
        "--max-age-ms", type=float, metavar="MS", help="with --camera: drop a live frame older than MS (default off)"
    )
    sources.add_argument(
        "--snapshot-every",
        type=float,
        metavar="S",
        help="with --camera: a JPEG of an answered frame every S seconds per camera, in the state directory",
    )
    sources.add_argument(
        "--snapshot-when",
        metavar="COND",
        help="with --camera: a snapshot when an answer meets COND: label=NAME and/or score>=X (comma: all)",
    )
    sources.add_argument(
        "--snapshot-topic", metavar="TEMPLATE", help="with --camera: publish snapshots there too ({device}, {name})"
    )
    sources.add_argument("--baudrate", type=int, metavar="N", help="serial speed, with --serial (default 115200)")
    sources.add_argument(
        "--serial-protocol",
        choices=["json-lines", "frames"],
        metavar="PROTOCOL",
        help="with --serial: json-lines (default: one JSON message per line) or frames (the firmware bridge's "
        "framed protocol, docs/firmware-protocol.md: boards named by their HELLO, answers sent back down)",
    )
    sources.add_argument(
        "--speed",
        metavar="X",
        help="with --replay or a camera file: realtime, max (as fast as the model takes them: the default), or a "
        "factor of the recorded pace (2: twice as fast)",
    )
    sources.add_argument("--device", metavar="ID", help="stream key of messages without a topic (serial, bare lines)")
    run.set_defaults(func=run_daemon)


def _writes_to(stream: IO[str], fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (io.UnsupportedOperation)
        return False


@contextmanager
def _runtime_output_as_one_record() -> Iterator[None]:
    """While the daemon opens its model, what the runtime prints on the file descriptors (LiteRT's delegate line
    from C, ExecuTorch's warnings) is captured: the daemon's log holds records only, and that text becomes one
    record of its own (debug; a warning when opening failed). The daemon's own records written meanwhile still go
    to the log as they happen, through a copy of the log's file descriptor."""
    from edgeline.native_output import CapturedOutput, capture_native_output

    handlers = [
        handler
        for handler in logging.getLogger().handlers
        if isinstance(handler, logging.StreamHandler) and _writes_to(handler.stream, 2)
    ]
    log_copy = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    previous = {handler: handler.setStream(log_copy) for handler in handlers}
    captured = CapturedOutput()
    failed = True
    try:
        with capture_native_output() as captured:
            yield
        failed = False
    finally:
        for handler, stream in previous.items():
            handler.setStream(stream)
        log_copy.close()
        lines = [line.strip() for line in captured.text.splitlines() if line.strip()]
        if lines:  # one line: a journal or log file reader sees no stray runtime lines
            level = logging.WARNING if failed else logging.DEBUG
            log.log(level, "the runtime printed while the model loaded: %s", " | ".join(lines))


def run_daemon(args: argparse.Namespace) -> int:
    from edgeline.daemon.config import camera_speed, load_config
    from edgeline.daemon.messages import Answer
    from edgeline.daemon.service import Daemon

    replay_speed = camera_speed_text = None
    if args.speed is not None:
        try:
            replay_speed = camera_speed(args.speed)
        except ValueError as exc:
            raise EdgelineError(f"--speed: {exc}") from exc
        camera_speed_text = args.speed
    source: dict[str, object] = {
        "baudrate": args.baudrate,
        "speed": replay_speed if args.camera is None else None,
        "device": args.device,
        "protocol": args.serial_protocol,
    }
    for dest, (kind, key) in SOURCE_FLAGS.items():  # one at a time: argparse's mutually exclusive group
        if getattr(args, dest) is not None:
            source.update({"kind": kind, key: getattr(args, dest)})
    camera = {
        "sources": tuple(args.camera) if args.camera else None, "speed": camera_speed_text,
        "max_age_ms": args.max_age_ms, "snapshot_every_s": args.snapshot_every,
        "snapshot_when": args.snapshot_when, "snapshot_topic": args.snapshot_topic,
    }  # fmt: skip
    config = load_config(args.config).with_overrides(
        broker=args.broker,
        subscribe=args.subscribe,
        publish=args.publish,
        codec=args.codec,
        qos=args.qos,
        source={key: value for key, value in source.items() if value is not None},
        state_dir=args.state_dir,
        instance=args.instance,
        updates=args.updates,
        trusted_root=args.trusted_root,
        check_interval_s=args.check_interval,
        download_timeout_s=args.download_timeout_s,
        detection=detection_overrides(args),
        camera=camera,
    )
    # A setting of another source would be dropped without a word: refuse it.
    for flag, dest, kinds in SOURCE_SETTING_FLAGS:
        if getattr(args, dest) is not None and config.source.kind not in kinds:
            flags = ", ".join(f"--{k}" for k in kinds)
            raise EdgelineError(
                f"{flag} applies to the {' or '.join(kinds)} source ({flags}); this run reads {config.source.kind}"
            )

    def echo(answer: Answer) -> None:  # JSON lines whatever the codec on the wire
        sys.stdout.write(json.dumps(answer.record, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    to_stdout = args.stdout or not config.uses_broker
    with _runtime_output_as_one_record():  # the model is opened (and its batching checked) here
        daemon = Daemon(args.bundle, config, backend=args.backend, echo=echo if to_stdout else None)
    status = daemon.run_until_signalled()
    if daemon.reload_requested and status == 0:
        # SIGHUP: drained like SIGTERM; now the same command again, reading the configuration and the bundle anew
        # (the same process id, so systemd's ExecReload=kill -HUP $MAINPID and Type=notify follow it)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    if daemon.echo is None and to_stdout:  # stdout was closed under us: keep the interpreter's exit quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if getattr(args, "from_process_argv", False):
        _leave_cameras(status)
    return status


LIBRARY_GRACE_S = 0.5
"""How long a stopped daemon gives a camera's call into PyAV to come back before leaving without it."""


def _leave_cameras(status: int) -> None:
    """A camera thread still inside PyAV (an open or a read against a server that does not answer, bounded only by
    its own deadline) would crash the interpreter's shutdown (``edgeline.video``): the daemon has stopped in order
    (answers delivered, outbox closed), so the process ends here, with ``status``, without that shutdown."""
    video = sys.modules.get("edgeline.video")
    if video is None or not (inside := video.leave_library(LIBRARY_GRACE_S)):
        return
    log.info("%d camera call%s still inside FFmpeg: leaving without waiting for %s", inside,
             "s" if inside > 1 else "", "them" if inside > 1 else "it")  # fmt: skip
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(status)
