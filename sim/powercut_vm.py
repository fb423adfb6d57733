"""``scripts/vm.sh power-cut --cuts N``: power cuts with torn writes on a whole machine (issue 35).

    record   the VM (``edgeline.sim.vm``) boots with its disk logged (blklogwrites); inside, systemd starts the
             project's unit (``edgeline@sensor``) on the sqrt bundle, against a Mosquitto on the host, reached
             through a tap (``edgeline.sim.mqtt_tap``: a loopback proxy that stamps, in the host's time, the
             daemon's PUBACK of each input and the broker's PUBACK of each answer); the host sends a steady QoS 1
             stream (``mosquitto_pub -l``) and a persistent QoS 1 subscriber (``mosquitto_sub -c``) takes the
             answers, each line stamped with the time it came; a thread samples the log's size, so that a flush of
             the log can be placed in the host's time
    cut      N cuts among the flushes logged while the stream ran (``edgeline.sim.powercut``), half of them inside
             a commit's writes (``--in-order``), each replayed onto a copy of the image's disk and checked offline
             (``edgeline.sim.imagecheck``); the first ``--boot`` of them also booted, the daemon started on the
             state the cut left
    account  per cut (``account``): the outbox's last seq ``S`` and the answers in it ``P``. Every answer the
             subscriber had before the cut's flush was logged is counted by ``S``; every seq up to ``S`` missing
             from ``P`` was removed because the broker acknowledged it before the removal was logged, so before
             the next flush was; every input the daemon acknowledged before the cut's flush was logged has its
             answer in ``P`` or acknowledged by the broker by then. Any shortfall is lost. Every answer in ``P``
             is one of the stream's inputs, and, on a booted cut, reaches the subscriber again (re-sent).

Placing an event against a flush takes no slack: a sample of the log's size is (the time before its ``stat``, the
size), with the time after it (``Recording.sampled_by``); an event stamped before a sample that saw the log short
of a flush's entry came before that entry was written, and one that came before an entry was written is stamped
before the first sample that saw the log past it. The stamps are taken where the order holds (``mqtt_tap``): the
daemon's PUBACK once the host read it, the broker's before the guest could. What falls between the two samples
around a flush (10 ms apart, more on a loaded host) is not judged against it.

It prints one JSON line: ``{"cuts": N, "acknowledged": A, "lost": 0, "inputs_acknowledged": I, "inputs_lost": 0,
"integrity_failures": 0, "unbootable": 0, ...}``; ``acknowledged``: the inputs whose answers the subscriber had
when the stream ended; ``inputs_acknowledged``: the inputs the daemon acknowledged. Exit 1 when any cut lost an
answer or an input, failed a check or did not boot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import socket
import subprocess
import sys
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from edgeline.bundle import read_bundle
from edgeline.errors import EdgelineError
from edgeline.sim.imagecheck import OutboxState
from edgeline.sim.mqtt_tap import MqttTap, Side, Stamped
from edgeline.sim.powercut import CutResult, plan_cuts, run_cuts
from edgeline.sim.vm import Accel, BootOptions, Forward, Image, Machine, build_image, write_command
from edgeline.sim.vm_image import source_tree
from edgeline.sim.writelog import Tail, WriteLog, read_log

__all__ = ["Account", "Recording", "account", "acknowledgements", "main", "record"]

INSTANCE = "sensor"
STATE_DIR = PurePosixPath("/var/lib/private/edgeline")
"""Where the unit's ``StateDirectory=edgeline/%i`` is under ``DynamicUser=yes`` (/var/lib/edgeline/%i links here);
the daemon keeps its state in ``%i/BUNDLE_NAME`` below it."""
TOPIC = "sensors/vm/x"
ANSWERS = "edgeline/#"
SAMPLE_S = 0.01
"""How often the log's size is sampled while the stream runs."""
START_S = 600.0
"""From QEMU's start to the unit running (a minute or two under TCG)."""
STOP_S = 180.0
"""From the host's stop to the guest's power-off (the daemon drains, systemd stops; minutes under TCG)."""
UPDATE_WAIT_S = 180.0
"""How much longer than ``--seconds`` the stream runs while the update has not yet answered past its trial."""
CONFIG = """\
[broker]
host = "{broker}"
port = 1883
[input]
subscribe = ["sensors/+/+"]
qos = 1
[output]
qos = 1
"""
UPDATES = f"""\
[updates]
repository = "/srv/edgeline-repo"
trusted_root = "/etc/edgeline/{INSTANCE}-root.json"
check_interval_s = 1.0
"""
UPDATE_GATES = {"inputs": 20, "min_inputs": 10, "seconds": 300.0, "max_latency_ms": 1000.0}
"""The trial of the update: 20 inputs (a second of the stream), so that it commits while the stream runs. Its
latency is held to an absolute budget far over any emulated call: the default (at most twice the previous version's
median) compares two timings that plain emulation on a busy host sets apart by chance (the same model timed 3.6
times apart, tests/test_vm.py), and what a cut tests is the storage, not the trial's judgement of speed."""
RECORD = f"""set -eu
# No lazy zeroing of inode tables while the log records: the log holds what edgeline writes (the logged disk offers
# no write zeroes, edgeline.sim.vm: QEMU 7.2's blklogwrites can interleave one with another request's entry, and
# the log would not parse). The journal in memory only: not the system's chatter either.
mount -o remount,noinit_itable /
mkdir -p /run/systemd/journald.conf.d
printf '[Journal]\\nStorage=volatile\\n' > /run/systemd/journald.conf.d/volatile.conf
systemctl restart systemd-journald
mkdir -p /var/lib/edgeline/bundles /etc/edgeline
cp -r /host/bundle /var/lib/edgeline/bundles/{INSTANCE}
cp /host/config.toml /etc/edgeline/{INSTANCE}.toml
if [ -d /host/repo ]; then
    mkdir -p /srv
    cp -r /host/repo /srv/edgeline-repo
    cp /host/root.json /etc/edgeline/{INSTANCE}-root.json
fi
chmod -R a+rX /var/lib/edgeline/bundles /etc/edgeline
[ ! -d /srv/edgeline-repo ] || chmod -R a+rX /srv/edgeline-repo
sync
systemctl start edgeline@{INSTANCE}
touch /host/started
while [ ! -e /host/stop ]; do sleep 0.1; done
cat /var/lib/edgeline/{INSTANCE}/*/updates/state.json > /host/state.json 2>/dev/null || true
systemctl is-active edgeline@{INSTANCE}
"""
RESTART = f"""set -eu
systemctl start edgeline@{INSTANCE}
touch /host/started
while [ ! -e /host/stop ]; do sleep 0.1; done
systemctl is-active edgeline@{INSTANCE}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        raise EdgelineError(f"{name} is not installed: scripts/setup.sh installs Debian's mosquitto and its clients")
    return found


@contextlib.contextmanager
def _broker(work: Path) -> Iterator[int]:
    port = _free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 0\n")
    with (work / "mosquitto.log").open("wb") as log:
        process = subprocess.Popen([_tool("mosquitto"), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _connects(port), 10, "the host's Mosquitto to listen")
        yield port
    finally:
        process.terminate()
        process.wait(10)


def _connects(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise EdgelineError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.05)


class Subscriber:
    """``mosquitto_sub`` with a persistent QoS 1 session: each answer a line ``UNIX_TIME PAYLOAD`` in a file."""

    def __init__(self, port: int, path: Path, client_id: str):
        self.path = path
        self._out = path.open("wb")
        command = [_tool("mosquitto_sub"), "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-c", "-i", client_id,
                   "-t", ANSWERS, "-F", "%U %p"]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self._out, stderr=subprocess.DEVNULL)

    def answers(self) -> list[tuple[float, str]]:
        """(time, input id) of every answer so far, duplicates included."""
        found = []
        for line in self.path.read_text(errors="replace").splitlines():
            stamp, _, payload = line.partition(" ")
            try:
                found.append((float(stamp), str(json.loads(payload)["id"])))
            except (ValueError, KeyError, TypeError):
                continue
        return found

    def answered_by_newer(self, version: int) -> int:
        """How many answers a version newer than ``version`` gave (the update's trial, then the committed one)."""
        count = 0
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                answer = json.loads(line.partition(" ")[2])
                count += "id" in answer and int(answer["version"]) > version  # answers, not status messages
            except (ValueError, KeyError, TypeError):
                continue
        return count

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        self._out.close()


def _from_now(machine: Machine, seconds: float) -> float:
    """``Machine.wait`` counts from QEMU's start: ``seconds`` from now."""
    return time.monotonic() - machine.started + seconds


def _ended(machine: Machine) -> bool:
    return machine.process is None or machine.process.poll() is not None


def _payload(number: int) -> str:
    values = [1.0 + ((number * 7 + i) % 13) / 4 for i in range(4)]
    return json.dumps({"id": f"in-{number}", "data": values})


@dataclass
class Recording:
    log: Path
    disk: Path
    started_log_bytes: int
    sizes: list[tuple[float, int]] = field(default_factory=list)
    """(wall time, log bytes), sampled while the stream ran: the time taken before the size was read."""
    sent: int = 0
    answers: list[tuple[float, str]] = field(default_factory=list)
    committed: int | None = None
    """The version ``state.json`` named committed when the stream ended (None: none, no update)."""
    input_acks: list[tuple[float, str]] = field(default_factory=list)
    """(wall time, input id): the daemon's PUBACKs of the stream's inputs, stamped once the host had read them."""
    answer_acks: list[tuple[float, str]] = field(default_factory=list)
    """(wall time, input id): the broker's PUBACKs of the daemon's answers, stamped before the daemon could read
    them (an answer the broker took, so delivered: the subscriber's session is persistent)."""
    sampled_by: list[float] = field(default_factory=list)
    """For each of ``sizes``, the wall time when its size had been read (empty: the sample's own time)."""
    tap_problems: list[str] = field(default_factory=list)
    """What the tap could not read (an incomplete record of acknowledgements)."""

    def times_around(self, offset: int) -> tuple[float, float]:
        """When the log was still short of ``offset`` (the time taken before the last sample that saw it so) and
        when it had reached past it (the time after the first sample that saw that): the entry at ``offset`` was
        written in between. -inf and inf past the samples' ends."""
        sizes = [size for _, size in self.sizes]
        read_by = self.sampled_by if len(self.sampled_by) == len(self.sizes) else [t for t, _ in self.sizes]
        at = bisect_right(sizes, offset)
        before = self.sizes[at - 1][0] if at > 0 else float("-inf")
        after = read_by[at] if at < len(read_by) else float("inf")
        return before, after


def acknowledgements(records: Sequence[Stamped]) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """The tap's records as (``Recording.input_acks``, ``Recording.answer_acks``): the client's PUBACKs of what the
    broker delivered, the broker's of what the client published; those that took the message, whose payload has
    an id (the stream's inputs and the daemon's answers, not its status)."""
    inputs: list[tuple[float, str]] = []
    answers: list[tuple[float, str]] = []
    for record in records:
        identity = _answer_id(record.ack.payload)
        if record.ack.accepted and identity:
            (inputs if record.ack.publisher is Side.BROKER else answers).append((record.at, identity))
    return inputs, answers


def _publish_update(bundle: Path, work: Path, share: Path) -> None:
    """Keys, and a signed repository holding the next version of ``bundle`` (the same model), into the share."""
    from edgeline.updates.keys import generate
    from edgeline.updates.policy import Gates
    from edgeline.updates.repository import Repository

    next_version = work / "next"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(bundle, next_version)
    manifest = json.loads((next_version / "manifest.json").read_text())
    manifest["version"] = int(manifest["version"]) + 1
    (next_version / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    root = generate(work / "keys")
    Repository(work / "repo", work / "keys").publish(next_version, gates=Gates(**UPDATE_GATES))
    shutil.copytree(work / "repo", share / "repo")
    shutil.copy2(root, share / "root.json")


def record(
    image: Image,
    work: Path,
    port: int,
    bundle: Path,
    *,
    seconds: float,
    rate_hz: float,
    accel: Accel = Accel.AUTO,
    update: bool = True,
) -> Recording:
    share = work / "share"
    shutil.rmtree(share, ignore_errors=True)
    share.mkdir(parents=True)
    shutil.copytree(bundle, share / "bundle")
    config = CONFIG.format(broker="10.0.2.100")
    if update:
        config += UPDATES
        _publish_update(bundle, work / "updates", share)
    (share / "config.toml").write_text(config)
    write_command(share, RECORD)
    log = work / "log.bin"
    recording = Recording(log, image.disk, 0)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            taken = time.time()
            size = log.stat().st_size
            recording.sizes.append((taken, size))
            recording.sampled_by.append(time.time())
            time.sleep(SAMPLE_S)

    with MqttTap(port) as tap:  # the guest's broker: every acknowledgement on the daemon's connection stamped
        subscriber = Subscriber(port, work / "answers.txt", "powercut-answers")
        try:
            options = BootOptions(share.resolve(), (Forward(tap.port),), write_log=log.resolve(), accel=accel)
            with Machine(image, options) as machine:
                _wait_for(lambda: (share / "started").exists() or _ended(machine), START_S, "the unit")
                if not (share / "started").exists():
                    machine.wait(1)
                recording.started_log_bytes = log.stat().st_size
                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                command = [_tool("mosquitto_pub"), "-h", "127.0.0.1", "-p", str(port), "-q", "1", "-i",
                           "powercut-inputs", "-t", TOPIC, "-l"]  # fmt: skip
                publisher = subprocess.Popen(command, stdin=subprocess.PIPE, text=True)
                assert publisher.stdin is not None
                begun = time.monotonic()
                first = int(json.loads((bundle / "manifest.json").read_text())["version"])
                # ``seconds`` of stream, and with an update on until the new version answered past its trial (committed
                # then): the update's steps take what the host's load gives an emulated guest, so they are waited for
                # (at most UPDATE_WAIT_S more), not assumed to fit in a time
                while time.monotonic() - begun < seconds or (
                    update
                    and subscriber.answered_by_newer(first) < UPDATE_GATES["inputs"] + 5
                    and time.monotonic() - begun < seconds + UPDATE_WAIT_S
                ):
                    publisher.stdin.write(_payload(recording.sent) + "\n")
                    publisher.stdin.flush()
                    recording.sent += 1
                    time.sleep(max(0.0, begun + recording.sent / rate_hz - time.monotonic()))
                publisher.stdin.close()
                publisher.wait(30)
                with contextlib.suppress(EdgelineError):
                    _wait_for(lambda: len({a for _, a in subscriber.answers()}) >= recording.sent, 30, "the answers")
                (share / "stop").touch()
                status = machine.wait(_from_now(machine, STOP_S))
                stop.set()
                sampler.join()
                if status != 0:
                    raise EdgelineError(f"the recording's guest command exited {status}:\n{machine.output()[-2000:]}")
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    recording.committed = int(json.loads((share / "state.json").read_text())["committed"]["version"])
        finally:
            stop.set()
            recording.answers = subscriber.answers()
            subscriber.close()
            tap.close()
            recording.input_acks, recording.answer_acks = acknowledgements(tap.records())
            recording.tap_problems = list(tap.problems)
            if tap.unmatched:
                recording.tap_problems.append(f"{tap.unmatched} PUBACKs of no PUBLISH the tap had seen")
    return recording


@dataclass(frozen=True)
class Account:
    """One cut's outbox against the subscriber's answers and the tap's acknowledgements. ``unaccounted``: answers
    the subscriber had before the cut's flush was logged, so committed before it, beyond the outbox's last seq;
    ``unacknowledged``: answers removed from the outbox beyond the broker's acknowledgements stamped before the
    next flush was logged (``broker_acknowledged_by``; ``received_by``: the subscriber's answers by then);
    ``strangers``: answers in the outbox to no input of the stream; ``inputs_lost``: of the inputs the daemon
    acknowledged before the cut's flush was logged (``inputs_acknowledged_before``), those whose answer is
    neither in the outbox nor acknowledged by the broker before the next flush was logged."""

    committed: int
    pending: int
    received_before: int
    received_by: int
    unaccounted: int
    unacknowledged: int
    strangers: int
    broker_acknowledged_by: int = 0
    inputs_acknowledged_before: int = 0
    inputs_lost: int = 0

    @property
    def lost(self) -> int:
        """Answers lost (the inputs' losses are ``inputs_lost``)."""
        return self.unaccounted + self.unacknowledged

    def as_dict(self) -> dict[str, int]:
        return {**self.__dict__, "lost": self.lost}


def account(recording: Recording, outbox: OutboxState | None, flush_offset: int, next_offset: int) -> Account:
    """The cut's outbox (None: there was none yet) against the subscriber's answers and the tap's record; the
    cut's flush at ``flush_offset`` in the log, the next at ``next_offset`` (the log's end after the last one).

    An answer reaches the subscriber, and an input is acknowledged, only after the answer's commit returned, so
    after its flush was logged (the guest's flush returns once the log has it): those before the log reached the
    cut's flush are committed in the cut. An answer leaves the outbox only after the broker acknowledged it, and a
    removal the cut kept was written before the next flush was logged: its acknowledgement is stamped before the
    log was seen past that flush. No slack either way (the module's docstring)."""
    before, _ = recording.times_around(flush_offset)
    _, after = recording.times_around(next_offset)
    received_before = len({answer for stamp, answer in recording.answers if stamp < before})
    received_by = len({answer for stamp, answer in recording.answers if stamp < after})
    # each removed row had a PUBACK of its own: acknowledgements are counted, not ids (an input answered twice
    # has two rows, each acknowledged)
    broker_by = [answer for stamp, answer in recording.answer_acks if stamp < after]
    committed = outbox.last_seq if outbox else 0
    rows = outbox.answers if outbox else ()
    held = {_answer_id(payload) for _, _, payload in rows}
    published = {f"in-{i}" for i in range(recording.sent)}
    acknowledged = {answer for stamp, answer in recording.input_acks if stamp < before}
    return Account(
        committed=committed,
        pending=len(rows),
        received_before=received_before,
        received_by=received_by,
        unaccounted=max(0, received_before - committed),
        unacknowledged=max(0, committed - len(rows) - len(broker_by)),
        strangers=sum(_answer_id(payload) not in published for _, _, payload in rows),
        broker_acknowledged_by=len(broker_by),
        inputs_acknowledged_before=len(acknowledged),
        inputs_lost=len(acknowledged - held - set(broker_by)),
    )


def _answer_id(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["id"])
    except (ValueError, KeyError, TypeError):
        return ""


def boot_cut(
    image: Image, disk: Path, work: Path, port: int, outbox: OutboxState | None, timeout_s: float, accel: Accel
) -> int:
    """Boot the cut's image, start the unit on it, and count the outbox's answers that do not come again."""
    share = work / "boot-share"
    shutil.rmtree(share, ignore_errors=True)
    share.mkdir(parents=True)
    write_command(share, RESTART)
    expected = {_answer_id(payload) for _, _, payload in (outbox.answers if outbox else ())}
    subscriber = Subscriber(port, work / f"{disk.stem}-answers.txt", f"powercut-{disk.stem}")
    try:
        options = BootOptions(share.resolve(), (Forward(port),), disk=disk.resolve(), accel=accel)
        with Machine(image, options) as machine:
            _wait_for(lambda: (share / "started").exists() or _ended(machine), START_S, "the boot")
            if not (share / "started").exists():
                machine.wait(1)
            with contextlib.suppress(EdgelineError):
                _wait_for(lambda: expected <= {a for _, a in subscriber.answers()}, timeout_s, "the re-sent answers")
            (share / "stop").touch()
            status = machine.wait(_from_now(machine, STOP_S))
            if status != 0:
                raise EdgelineError(f"the unit did not run on the cut's image:\n{machine.output()[-2000:]}")
    finally:
        got = {a for _, a in subscriber.answers()}
        subscriber.close()
    return len(expected - got)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/vm.sh power-cut", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuts", type=int, default=20, help="cut points (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cut points and caches (default 0)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the stream runs (default 20)")
    parser.add_argument("--rate", type=float, default=20.0, help="inputs per second (default 20)")
    parser.add_argument("--boot", type=int, default=2, help="cuts also booted (default 2)")
    parser.add_argument("--in-order", type=int, default=None,
                        help="cuts inside a commit's writes, in the log's order (default: half of --cuts)")  # fmt: skip
    parser.add_argument("--update", action=argparse.BooleanOptionalAction, default=True,
                        help="publish the bundle's next version for the unit to fetch, trial and commit during the "
                        "stream (default: yes)")  # fmt: skip
    parser.add_argument("--accel", choices=[a.value for a in Accel], default="auto", help="default: kvm if usable")
    tree = source_tree()
    parser.add_argument("--bundle", type=Path, default=tree / "tests/data/sqrt-fp32",
                        help="the bundle the unit runs (default: the repository's tests/data/sqrt-fp32)")  # fmt: skip
    parser.add_argument("--work", type=Path, default=tree / "build/powercut-vm",
                        help="scratch: the log, the cuts' images (default build/powercut-vm)")  # fmt: skip
    args = parser.parse_args(argv)
    in_order = args.cuts // 2 if args.in_order is None else args.in_order
    if args.cuts < 1 or not 0 <= in_order <= args.cuts:
        parser.error(f"--cuts {args.cuts} --in-order {in_order}: at least one cut, and from 0 to --cuts in order")
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        name = f"{STATE_DIR.name}/{INSTANCE}/{read_bundle(args.bundle).manifest.name}"
        image = build_image()
        with _broker(work) as port:
            accel = Accel(args.accel)
            recording = record(image, work, port, args.bundle, seconds=args.seconds, rate_hz=args.rate, accel=accel,
                               update=args.update)  # fmt: skip
            if recording.tap_problems:
                raise EdgelineError("the tap's record of acknowledgements is incomplete: " + "; ".join(
                    recording.tap_problems[:5]))  # fmt: skip
            log = read_log(recording.log, tail=Tail.READ, device_bytes=image.disk.stat().st_size)
            among = [
                k for k, index in enumerate(log.flushes) if log.entries[index].offset >= recording.started_log_bytes
            ]
            if not among:
                raise EdgelineError("no flush was logged while the stream ran")
            cuts = plan_cuts(log, args.cuts, args.seed, among=range(among[0], among[-1] + 1), in_order=in_order)
            totals = {"lost": 0, "inputs_lost": 0, "integrity_failures": 0, "unbootable": 0, "booted": 0,
                      "with_update": 0}  # fmt: skip
            seconds: list[float] = []
            placements: list[float] = []
            for result in run_cuts(log, image.disk, cuts, work / "cuts", state_dir=STATE_DIR, keep_images=True):
                image_path = work / "cuts" / f"cut-{result.cut.number:03d}.img"
                try:
                    offsets = _offsets(log, result.cut.flush)
                    line = _judge(result, name, recording, offsets, totals)
                    placements.append(_placement(recording, offsets[0]))
                    if result.cut.number < args.boot and result.check.fsck_clean:
                        instance = next((i for i in result.check.instances if i.name == name), None)
                        outbox = instance.outbox if instance else None
                        try:
                            missing = boot_cut(image, image_path, work, port, outbox, 60, accel)
                        except EdgelineError as exc:
                            totals["unbootable"] += 1
                            line["boot"] = str(exc)[:500]
                        else:
                            totals["booted"] += 1
                            totals["lost"] += missing
                            line["boot"] = {"not_resent": missing}
                finally:
                    image_path.unlink(missing_ok=True)
                seconds.append(result.replay_s + result.check.seconds)
                print(json.dumps(line), file=sys.stderr, flush=True)
    except EdgelineError as exc:
        print(f"power-cut: error: {exc}", file=sys.stderr)
        return 1
    acknowledged = len({answer for _, answer in recording.answers})
    with_update = totals.pop("with_update")
    summary = {"cuts": len(cuts), "acknowledged": acknowledged,
               "inputs_acknowledged": len({i for _, i in recording.input_acks}), **totals, "inputs": recording.sent,
               "log_bytes": log.size, "flushes": len(log.flushes), "update_committed": recording.committed,
               "cuts_with_update_committed": with_update, "cuts_in_order": sum(cut.in_order for cut in cuts),
               "flush_placement_ms_max": round(max(placements) * 1000, 1),
               "replay_check_s_per_cut": round(sum(seconds) / len(seconds), 2)}  # fmt: skip
    print(json.dumps(summary))
    failed = totals["lost"] or totals["inputs_lost"] or totals["integrity_failures"] or totals["unbootable"]
    return 1 if failed else 0


def _offsets(log: WriteLog, flush: int) -> tuple[int, int]:
    """Where flush number ``flush`` and the next one are in the log (the log's end after the last one)."""
    entries, flushes = log.entries, log.flushes
    following = entries[flushes[flush + 1]].offset if flush + 1 < len(flushes) else log.size
    return entries[flushes[flush]].offset, following


def _placement(recording: Recording, offset: int) -> float:
    """How long the samples leave when the entry at ``offset`` was written (what falls in there is not judged)."""
    before, after = recording.times_around(offset)
    return after - before if math.isfinite(after - before) else 0.0


def _judge(
    result: CutResult, name: str, recording: Recording, offsets: tuple[int, int], totals: dict[str, int]
) -> dict[str, Any]:
    line = result.as_dict()
    instance = next((i for i in result.check.instances if i.name == name), None)
    tally = account(recording, instance.outbox if instance else None, *offsets)
    totals["with_update"] += bool(instance and recording.committed and instance.committed == recording.committed)
    totals["lost"] += tally.lost
    totals["inputs_lost"] += tally.inputs_lost
    totals["integrity_failures"] += bool(result.check.problems or tally.strangers)
    line["account"] = tally.as_dict()
    return line


if __name__ == "__main__":
    sys.exit(main())
