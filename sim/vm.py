"""A whole emulated machine: Debian 12 booted with QEMU, systemd and the project's unit inside, running a command.

    scripts/vm.sh build                                   # the image (edgeline.sim.vm_image), cached in build/vm
    scripts/vm.sh run [--forward HOST_PORT[:GUEST_PORT]] [--share DIR] [--timeout S] [--write-log FILE] COMMAND

The guest is x86-64 under KVM (``-M q35 -accel kvm -cpu host``) when /dev/kvm is usable, else plain emulation
(TCG, said on stderr): what it tests (storage, systemd, the unit) does not depend on the instruction set; the arm64
userland is scripts/arm64.sh's. It boots the image's kernel and initrd (``-kernel``/``-initrd``) on a copy-on-write
overlay of its disk (a qcow2 file per run, so no run changes the cache) and shares nothing with the host but:

- a folder, over 9p (``mount_tag=host``, mounted at /host in the guest): the command, its output and exit status;
- loopback ports: ``Forward(host_port, guest_port)`` makes ``GUEST_BROKER:guest_port`` (10.0.2.100) in the guest a
  connection to 127.0.0.1:host_port on the host (``guestfwd``, one ``socat`` per connection). The guest's network
  is otherwise ``restrict=on``: no route to the host or beyond.

The protocol in the shared folder: the host writes ``command`` (shell text, run by /bin/sh as root in /host); at
every boot the guest's ``edgeline-vm-command.service`` appends a line to ``.vm/boots`` and runs the command with
``EDGELINE_VM_BOOT=N``, its output appended to ``.vm/output``; when the command ends by itself its status goes to
``.vm/status`` and the guest powers off, which ends QEMU. A command that runs ``vm-reboot`` (or ``systemctl
reboot``, then waits) runs again after the reboot with ``EDGELINE_VM_BOOT`` one more. Every wait is bounded: a first
boot within ``boot_timeout_s``, the whole run within its timeout; past either, QEMU is killed.

Public API (stable; edgeline.sim.powercut builds on it):

    build_image(cache_dir=None, *, say=...) -> Image            Image.disk, .kernel, .initrd, .info()
    kvm_problem() -> str | None                                 why /dev/kvm cannot be used (None: it can)
    Forward(host_port, guest_port=1883)
    BootOptions(share, forwards=(), write_log=None, disk=None, memory_mb=1024, cpus=2, accel=Accel.AUTO,
                boot_timeout_s=None)
    write_command(share, command)                               the shell text the guest runs
    Machine(image, options): start() -> Machine; wait(timeout_s, echo=None) -> int (the command's status);
                             boots() -> int; output() -> str; console() -> str; kill(); close(); a context manager
    run(command, options, *, image=None, timeout_s=600.0, echo=None) -> int

``write_log``: the disk is opened through QEMU's ``blklogwrites`` driver, which logs every guest write and flush to
that file in dm-log-writes format (replayed onto a copy of ``Image.disk`` it gives the guest's disk at any flush);
the guest's disk then offers neither discard nor write zeroes (``discard=off,write-zeroes=off``): plain writes only.
``disk``: boot this raw image read-write instead of an overlay of ``Image.disk`` (a replayed copy, say).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from edgeline.errors import EdgelineError
from edgeline.sim.vm_image import GUEST_BROKER, Image, build_image

__all__ = [
    "GUEST_BROKER",
    "Accel",
    "BootOptions",
    "Forward",
    "Image",
    "Machine",
    "build_image",
    "kvm_problem",
    "main",
    "run",
    "write_command",
]

KERNEL_ARGS = "root=/dev/vda rw console=ttyS0 quiet mitigations=off systemd.show_status=auto"
BOOT_TIMEOUT_S = {"kvm": 90.0, "tcg": 600.0}
"""From QEMU's start to the guest running the command."""
STOP_TIMEOUT_S = 10.0
KVM_CPU = "host,-arch-capabilities"
"""The host's CPU, without IA32_ARCH_CAPABILITIES: QEMU 7.2 under a nested KVM (a cloud VM, as here) aborts setting
that MSR (0x10a) at start, and nothing in the guest needs it."""


class Accel(enum.Enum):
    AUTO = "auto"
    """KVM when /dev/kvm is usable, else TCG (said on stderr)."""
    KVM = "kvm"
    TCG = "tcg"


@dataclass(frozen=True)
class Forward:
    """The guest's ``GUEST_BROKER:guest_port`` reaches the host's ``127.0.0.1:host_port``."""

    host_port: int
    guest_port: int = 1883

    def __post_init__(self) -> None:
        for name, port in (("host_port", self.host_port), ("guest_port", self.guest_port)):
            if not 1 <= port <= 65535:
                raise EdgelineError(f"Forward.{name} {port}: a TCP port is 1..65535")


@dataclass(frozen=True)
class BootOptions:
    share: Path
    """The folder the guest mounts at /host (``write_command`` puts the command there)."""
    forwards: tuple[Forward, ...] = ()
    write_log: Path | None = None
    """Log every guest write and flush here (blklogwrites, dm-log-writes format); None: no log."""
    disk: Path | None = None
    """A raw disk image to boot read-write; None: a throwaway overlay of the image's disk."""
    memory_mb: int = 1024
    cpus: int = 2
    accel: Accel = Accel.AUTO
    boot_timeout_s: float | None = None
    """None: ``BOOT_TIMEOUT_S`` for the accelerator in use."""


def kvm_problem(modules: Path = Path("/sys/module")) -> str | None:
    """Why /dev/kvm cannot boot the image here, or None when it can."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kvm: {exc.strerror}"
    os.close(fd)
    hardware = any((modules / name).is_dir() for name in ("kvm_intel", "kvm_amd"))
    if (modules / "kvm_pvm").is_dir() and not hardware:
        # PVM (a nested hypervisor in software) runs only guests whose kernel is built for it: Debian's hangs before
        # its first line on the console.
        return "/dev/kvm is kvm-pvm, whose guests need a PVM kernel"
    return None


def write_command(share: Path, command: str) -> None:
    """The shell text the guest runs at every boot (``EDGELINE_VM_BOOT`` says which)."""
    share.mkdir(parents=True, exist_ok=True)
    (share / "command").write_text(command.rstrip("\n") + "\n", encoding="utf-8")


def _say(line: str) -> None:
    print(f"vm: {line}", file=sys.stderr, flush=True)


class Machine:
    """One QEMU process booting ``image`` with ``options``; ``wait`` until its command has ended."""

    def __init__(self, image: Image, options: BootOptions, *, say: Callable[[str], None] = _say) -> None:
        self.image = image
        self.options = options
        self.say = say
        self.accel = _pick_accel(options.accel, say)
        self.boot_timeout_s = options.boot_timeout_s or BOOT_TIMEOUT_S[self.accel.value]
        self.process: subprocess.Popen[bytes] | None = None
        self.scratch: Path | None = None
        self.started = 0.0
        self.failed = False
        """Set when ``wait`` raised: ``close`` keeps the run's logs."""
        self._echoed = 0

    @property
    def vm_dir(self) -> Path:
        return self.options.share / ".vm"

    def command_line(self, scratch: Path) -> list[str]:
        options = self.options
        accel = (
            ["-machine", "q35,accel=kvm", "-cpu", KVM_CPU]
            if self.accel is Accel.KVM
            else ["-machine", "q35,accel=tcg", "-cpu", "max"]
        )
        if options.disk is not None:
            disk = f"driver=raw,node-name=disk,file.driver=file,file.filename={_escape(options.disk)}"
        else:
            disk = f"driver=qcow2,node-name=disk,file.driver=file,file.filename={_escape(scratch / 'overlay.qcow2')}"
        drive = ["-blockdev", disk]
        if options.write_log is not None:
            drive += [
                "-blockdev",
                f"driver=file,node-name=log,filename={_escape(options.write_log)}",
                "-blockdev",
                "driver=blklogwrites,node-name=root,file=disk,log=log,log-sector-size=512",
            ]
        root = "root" if options.write_log is not None else "disk"
        # A logged disk advertises neither discard nor write zeroes, so the guest sends plain writes and flushes
        # only: QEMU 7.2's blklogwrites can interleave a write of zeroes with another request's entry (the log
        # would not parse), and a discard's sectors are left to the replay's guess (edgeline.sim.writelog).
        device = f"virtio-blk-pci,drive={root}" + (",discard=off,write-zeroes=off" if options.write_log else "")
        socat = shutil.which("socat") or "socat"
        netdev = "user,id=net,restrict=on" + "".join(
            f",guestfwd=tcp:{GUEST_BROKER}:{f.guest_port}-cmd:{socat} - TCP:127.0.0.1:{f.host_port}"
            for f in options.forwards
        )
        return [
            "qemu-system-x86_64",
            "-name",
            "edgeline-vm",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-monitor",
            "none",
            *accel,
            "-smp",
            str(options.cpus),
            "-m",
            str(options.memory_mb),
            "-rtc",
            "base=utc",
            "-kernel",
            str(self.image.kernel),
            "-initrd",
            str(self.image.initrd),
            "-append",
            KERNEL_ARGS,
            "-chardev",
            f"file,id=console,path={_escape(scratch / 'console.log')}",
            "-serial",
            "chardev:console",
            *drive,
            "-device",
            device,
            "-netdev",
            netdev,
            "-device",
            "virtio-net-pci,netdev=net",
            "-virtfs",
            f"local,path={_escape(options.share)},mount_tag=host,security_model=none,id=host",
            "-device",
            "virtio-rng-pci",
        ]

    def start(self) -> Machine:
        if self.process is not None:
            raise EdgelineError("this machine is already started")
        options = self.options
        if not (options.share / "command").is_file():
            raise EdgelineError(f"{options.share}/command: no command for the guest (write_command)")
        shutil.rmtree(self.vm_dir, ignore_errors=True)
        self.vm_dir.mkdir(parents=True)
        runs = self.image.directory.parent / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="run-", dir=runs))
        if options.disk is None:
            subprocess.run(
                [
                    "qemu-img",
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-F",
                    "raw",
                    "-b",
                    str(self.image.disk),
                    str(self.scratch / "overlay.qcow2"),
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
        if options.write_log is not None:
            options.write_log.parent.mkdir(parents=True, exist_ok=True)
            options.write_log.write_bytes(b"")
        with open(self.scratch / "qemu.log", "wb") as log:
            self.process = subprocess.Popen(
                self.command_line(self.scratch),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()
        return self

    def boots(self) -> int:
        """How many times the guest has started the command (1 after the first boot, 2 after a reboot, ...)."""
        try:
            return len((self.vm_dir / "boots").read_text(encoding="utf-8").splitlines())
        except FileNotFoundError:
            return 0

    def output(self) -> str:
        """The command's output so far, every boot's."""
        return _read(self.vm_dir / "output")

    def console(self) -> str:
        """The guest's serial console (kernel, systemd) so far."""
        return _read(self.scratch / "console.log") if self.scratch else ""

    def wait(self, timeout_s: float = 600.0, echo: Callable[[str], None] | None = None) -> int:
        """The command's exit status once the guest has powered off; ``echo`` gets its output as it comes. Kills
        QEMU and raises when the first boot or the whole run takes too long, or the guest stops without a status."""
        process = self.process
        if process is None:
            raise EdgelineError("the machine was not started")
        while process.poll() is None:
            elapsed = time.monotonic() - self.started
            if self.boots() == 0 and elapsed > self.boot_timeout_s:
                self.kill()
                raise EdgelineError(f"the guest did not boot within {self.boot_timeout_s:g} s{self._tails()}")
            if elapsed > timeout_s:
                self.kill()
                raise EdgelineError(f"the guest's command did not end within {timeout_s:g} s{self._tails()}")
            self._echo(echo)
            time.sleep(0.2)
        self._echo(echo)
        if process.returncode != 0:
            raise EdgelineError(f"QEMU exited with status {process.returncode}{self._tails()}")
        try:
            return int((self.vm_dir / "status").read_text(encoding="utf-8").strip())
        except (FileNotFoundError, ValueError) as exc:
            raise EdgelineError(f"the guest powered off without the command's exit status{self._tails()}") from exc

    def _echo(self, echo: Callable[[str], None] | None) -> None:
        if echo is None:
            return
        text = self.output()
        if len(text) > self._echoed:
            echo(text[self._echoed :])
            self._echoed = len(text)

    def _tails(self) -> str:
        self.failed = True
        qemu = _read(self.scratch / "qemu.log") if self.scratch else ""
        parts = [("QEMU", qemu), ("console", self.console()), ("command output", self.output())]
        tails = "".join(f"\n--- {name}:\n" + "\n".join(text.splitlines()[-25:]) for name, text in parts if text)
        return f" (the whole console: {self.scratch}/console.log){tails}"

    def kill(self) -> None:
        """QEMU and what it started (``socat`` relays), at once: a power cut for the guest."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)

    def close(self) -> None:
        """Kill QEMU if it still runs; remove the run's overlay, and its logs unless the run failed (they stay for
        a look: the error names them)."""
        self.kill()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # relays left by connections that outlived QEMU
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.scratch is not None:
            if self.failed:
                with contextlib.suppress(FileNotFoundError):
                    (self.scratch / "overlay.qcow2").unlink()
            else:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> Machine:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _pick_accel(wanted: Accel, say: Callable[[str], None]) -> Accel:
    if wanted is Accel.TCG:
        return Accel.TCG
    problem = kvm_problem()
    if problem is None:
        return Accel.KVM
    if wanted is Accel.KVM:
        raise EdgelineError(f"KVM asked for, but {problem}")
    say(f"{problem}: plain emulation (TCG), many times slower than KVM")
    return Accel.TCG


def _escape(path: Path) -> str:
    """A path inside a QEMU option value (a comma is doubled)."""
    return str(path).replace(",", ",,")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def run(
    command: str,
    options: BootOptions,
    *,
    image: Image | None = None,
    timeout_s: float = 600.0,
    echo: Callable[[str], None] | None = None,
) -> int:
    """Boot, run ``command`` (shell text) in the guest until it ends, power off: its exit status."""
    write_command(options.share, command)
    with Machine(image or build_image(), options) as machine:
        return machine.wait(timeout_s, echo)


def _forward(text: str) -> Forward:
    host, _, guest = text.partition(":")
    try:
        return Forward(int(host), int(guest) if guest else 1883)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: HOST_PORT or HOST_PORT:GUEST_PORT") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/vm.sh", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="action", required=True)
    commands.add_parser("build", help="build the image (cached in build/vm); print its directory and what it holds")
    runner = commands.add_parser("run", help="boot the image and run COMMAND inside; exit with its status")
    runner.add_argument("--share", type=Path, help="the folder mounted at /host (default: a temporary one)")
    runner.add_argument(
        "--forward",
        type=_forward,
        action="append",
        default=[],
        metavar="HOST_PORT[:GUEST_PORT]",
        help=f"the guest's {GUEST_BROKER}:GUEST_PORT (default 1883) to 127.0.0.1:HOST_PORT",
    )
    runner.add_argument("--timeout", type=float, default=600.0, metavar="S", help="the whole run (default 600)")
    runner.add_argument("--write-log", type=Path, metavar="FILE", help="log every guest write and flush (blklogwrites)")
    runner.add_argument("--accel", choices=[a.value for a in Accel], default="auto", help="default: kvm if usable")
    runner.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND", help="shell text, or words")
    args = parser.parse_args(argv)
    try:
        image = build_image()
        if args.action == "build":
            print(image.directory)
            print(shlex.join(f"{k}={v}" for k, v in image.info().items()))
            return 0
        words = [word for word in args.command if word != "--"] if args.command[:1] == ["--"] else args.command
        if not words:
            parser.error("run needs a COMMAND")
        command = words[0] if len(words) == 1 else shlex.join(words)
        with contextlib.ExitStack() as stack:
            share = args.share or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeline-vm-")))
            options = BootOptions(
                share.resolve(), tuple(args.forward), write_log=args.write_log, accel=Accel(args.accel)
            )
            return run(command, options, image=image, timeout_s=args.timeout, echo=_echo_stdout)
    except EdgelineError as exc:
        print(f"vm: error: {exc}", file=sys.stderr)
        return 1


def _echo_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
