"""The disk image of ``edgeline.sim.vm``: Debian 12 (x86-64) with systemd, Mosquitto, edgeline's device install (the
base install: no torch) in ``/opt/edgeline`` and the project's unit, built from Debian's and PyPI's packages.

Two layers, each cached under ``build/vm`` by a hash of what goes into it, built under a lock (``.lock``: a second
caller waits, then finds the result), written beside and renamed into place when whole:

    rootfs-KEY/    ``mmdebstrap --variant=minbase`` bookworm with ``PACKAGES``, the guest's settings (host name,
                   static network for QEMU's user-mode net, no getty on the serial console, Mosquitto installed
                   but not started) and a venv in /opt/edgeline holding edgeline's base dependencies: wheels for
                   CPython 3.11 on x86-64 fetched by the host's pip (``pip download``; its cache makes a rebuild
                   cheap), installed offline inside the chroot. Key: the packages, the suite and mirror, the base
                   requirements of pyproject.toml, ``ROOTFS_LAYOUT``.
    image-KEY/     a copy of the rootfs with edgeline's wheel (built from this source tree) installed without its
                   dependencies, ``edgeline@.service`` copied from the installed package to /etc/systemd/system,
                   ``/usr/local/bin/edgeline``, and the guest's side of ``vm.run`` (``GUEST_FILES``); what a
                   boot would load for nothing masked (``MASKED_UNITS``) or blacklisted, and an initrd holding
                   what mounts the root (``update-initramfs``, ``MODULES=list``); then ``mke2fs -t ext4 -d`` into
                   ``disk.img`` (``IMAGE_SIZE``, sparse), with ``vmlinuz`` and ``initrd.img`` from its /boot
                   beside it. Key: the rootfs key and every file of the package folders and pyproject.toml (a
                   source change costs a copy, an initrd and an mke2fs, not a debootstrap).

Older layers are removed once a newer one is in place (a running VM keeps its open image). Building needs root
(mmdebstrap's root mode keeps the owners mke2fs copies) and Debian's mmdebstrap, e2fsprogs and the project's Python
with pip and setuptools. EDGELINE_DEBIAN_MIRROR overrides the mirror, as for scripts/arm64.sh; EDGELINE_VM_CACHE the
cache's place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edgeline.errors import EdgelineError

__all__ = ["GUEST_BROKER", "IMAGE_SIZE", "PACKAGES", "Image", "build_image", "default_cache_dir", "missing_tools"]

SUITE = "bookworm"
PACKAGES = (
    "systemd-sysv", "udev", "linux-image-amd64", "initramfs-tools", "python3", "python3-venv", "e2fsprogs",
    "sqlite3", "mosquitto", "mosquitto-clients", "libstdc++6", "libgomp1", "procps", "iproute2",
)  # fmt: skip
"""Debian's generic kernel, not linux-image-cloud-amd64: the cloud kernel has no 9p file system."""
ROOTFS_LAYOUT = 1
"""Bump when the rootfs hook changes what a rootfs holds."""
IMAGE_SIZE = 2 << 30
VENV = "/opt/edgeline"
PYTHON_TAG = ("3.11", "cp311")
"""Debian 12's CPython: the wheels the guest's pip would pick."""
GUEST_BROKER = "10.0.2.100"
"""Where the guest reaches a forwarded host port (QEMU user-mode networking: the guest is 10.0.2.15)."""
PACKAGE_FOLDERS = ("edge_runtime", "export", "device_profiles", "sim", "firmware_bridge")
TOOLS_HINT = "on Debian: apt-get install mmdebstrap e2fsprogs qemu-utils qemu-system-x86 socat (scripts/setup.sh)"

_ROOTFS_HOOK = r"""set -eu
root="$1"; wheels="$2"
echo edgeline-vm > "$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 edgeline-vm\n' > "$root/etc/hosts"
: > "$root/etc/machine-id"  # made at first boot: each run of the image is another machine
mkdir -p "$root/etc/systemd/network"
cat > "$root/etc/systemd/network/10-vm.network" <<EOF
[Match]
Name=en*
[Network]
Address=10.0.2.15/24
Gateway=10.0.2.2
LinkLocalAddressing=no
IPv6AcceptRA=no
EOF
systemctl --root="$root" enable systemd-networkd.service
systemctl --root="$root" mask serial-getty@ttyS0.service getty@tty1.service e2scrub_reap.service
systemctl --root="$root" disable mosquitto.service
cp -r "$wheels" "$root/tmp/wheels"
chroot "$root" python3 -m venv /opt/edgeline
chroot "$root" /opt/edgeline/bin/python -m pip install --disable-pip-version-check --no-input --no-cache-dir \
    --no-index --find-links /tmp/wheels -r /tmp/wheels/requirements.txt
rm -rf "$root/tmp/wheels" "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*_Packages
"""

UNUSED_DRIVERS = (
    "ahci", "libahci", "lpc_ich", "i2c_i801", "iTCO_wdt", "intel_pmc_bxt", "pcspkr", "psmouse", "serio_raw", "evdev",
    "cfg80211", "qemu_fw_cfg", "kvm_intel", "kvm_amd", "kvm",
)  # fmt: skip
"""Drivers udev would load for the emulated machine's devices that it does not use (its disk is virtio; it has no
SATA disk, display, keyboard, mouse, radio or hardware watchdog): blacklisted in the image, since under plain
emulation each module costs seconds of every boot."""

GUEST_FILES: dict[str, tuple[int, str]] = {
    "usr/local/lib/edgeline-vm/runner": (
        0o755,
        r"""#!/bin/sh
# edgeline.sim.vm, the guest's side: at every boot, run the host's /host/command and, when it ends by itself, write
# its exit status and power off. A command that reboots (vm-reboot) runs again at the next boot, EDGELINE_VM_BOOT=2.
console() { echo "edgeline-vm: $*" > /dev/ttyS0; }
mkdir -p /host
if ! mountpoint -q /host && ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 host /host; then
    console "cannot mount the host's folder (9p, tag host): powering off"
    systemctl poweroff --no-block
    exit 1
fi
mkdir -p /host/.vm
boot=$(( $(cat /host/.vm/boots 2>/dev/null | wc -l) + 1 ))
echo "$boot $(cat /proc/sys/kernel/random/boot_id)" >> /host/.vm/boots
console "boot $boot: running the host's command"
cd /host
EDGELINE_VM_BOOT=$boot /bin/sh /host/command >> /host/.vm/output 2>&1 < /dev/null
status=$?
if [ "$(systemctl is-system-running 2>/dev/null)" = stopping ]; then
    exit 0  # the command rebooted or powered the machine off: it says nothing yet
fi
console "the command exited with status $status: powering off"
echo "$status" > /host/.vm/status.new && mv /host/.vm/status.new /host/.vm/status
sync
systemctl poweroff --no-block
""",
    ),
    "etc/systemd/system/edgeline-vm-command.service": (
        0o644,
        """[Unit]
Description=edgeline VM: the host's command (edgeline.sim.vm)
Wants=network-online.target
After=network-online.target systemd-modules-load.service

[Service]
Type=exec
ExecStart=/usr/local/lib/edgeline-vm/runner

[Install]
WantedBy=multi-user.target
""",
    ),
    "usr/local/sbin/vm-reboot": (
        0o755,
        """#!/bin/sh
# Reboot from the host's command: the command runs again after the boot (EDGELINE_VM_BOOT one more).
systemctl reboot
exec sleep 600
""",
    ),
    "etc/modules-load.d/edgeline-vm.conf": (0o644, "9p\n9pnet_virtio\n"),
    "etc/modprobe.d/edgeline-vm.conf": (0o644, "".join(f"blacklist {name}\n" for name in UNUSED_DRIVERS)),
    # The initrd holds what mounts the root (MODULES=list) rather than most of the kernel's drivers (MODULES=most:
    # 36 MB, unpacked at every boot); update-initramfs runs when the image is made (``_build_image``).
    "etc/initramfs-tools/conf.d/edgeline-vm.conf": (0o644, "MODULES=list\n"),
    "etc/initramfs-tools/modules": (0o644, "virtio_pci\nvirtio_blk\next4\n"),
}
"""The guest's side of ``vm.run``, written into the image (``vm.run`` documents the protocol)."""
MASKED_UNITS = (
    "getty-static.service", "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount",
    "sys-fs-fuse-connections.mount", "sys-kernel-config.mount", "modprobe@configfs.service", "modprobe@loop.service",
    "modprobe@dm_mod.service", "modprobe@fuse.service", "modprobe@efi_pstore.service", "modprobe@drm.service",
)  # fmt: skip
"""Units masked in the image: gettys on virtual consoles it has none of, and the modules of file systems and devices
nothing in it uses (binfmt_misc, FUSE, configfs, loop devices, device-mapper, EFI pstore, DRM): seconds each under
plain emulation, at every boot. systemd, udev, networkd, journald and the project's unit run as on a device."""


@dataclass(frozen=True)
class Image:
    """A built image: ``disk`` (raw ext4, the root file system; never written by a run), the kernel and initrd."""

    directory: Path
    key: str
    built_s: float
    """Seconds this call spent building (0.0: found in the cache)."""

    @property
    def disk(self) -> Path:
        return self.directory / "disk.img"

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    def info(self) -> dict[str, object]:
        """What ``info.json`` says it holds (kernel, packages, edgeline's version, sizes)."""
        return dict(json.loads((self.directory / "info.json").read_text(encoding="utf-8")))


def say_default(line: str) -> None:
    print(f"vm: {line}", file=sys.stderr, flush=True)


def source_tree() -> Path:
    """The repository this module runs from: the image installs edgeline from its sources."""
    tree = Path(__file__).resolve().parents[1]
    if not (tree / "pyproject.toml").is_file():
        raise EdgelineError(f"building the VM image needs edgeline's source tree; {tree} has no pyproject.toml")
    return tree


def default_cache_dir() -> Path:
    """$EDGELINE_VM_CACHE when set (a cache that outlives a clone: CI's), else build/vm of the source tree."""
    configured = os.environ.get("EDGELINE_VM_CACHE")
    return Path(configured) if configured else source_tree() / "build" / "vm"


def missing_tools() -> list[str]:
    """Of the host's programs a build and a boot need, those not found."""
    tools = ("mmdebstrap", "mke2fs", "chroot", "unshare", "qemu-img", "qemu-system-x86_64", "socat")
    return [tool for tool in tools if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]


def _mirror() -> str:
    return os.environ.get("EDGELINE_DEBIAN_MIRROR", "http://deb.debian.org").rstrip("/")


def _base_requirements(tree: Path) -> list[str]:
    from edgeline.device_profiles.toml import tomllib

    with open(tree / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    return [str(requirement) for requirement in project["dependencies"]]


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _sources_digest(tree: Path) -> str:
    """Every file of the package folders and pyproject.toml, by path and content."""
    digest = hashlib.sha256()
    files = [tree / "pyproject.toml"]
    for folder in PACKAGE_FOLDERS:
        files += sorted(p for p in (tree / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        digest.update(str(path.relative_to(tree)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _run(what: str, command: list[str], *, timeout: float, cwd: Path | None = None) -> str:
    """Run ``command``; quiet unless it fails, then an error naming ``what`` with the end of its output."""
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise EdgelineError(f"{what}: no end within {timeout:g} s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
        raise EdgelineError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits here, then finds the layers built
        yield


def _replace_older(cache: Path, prefix: str, keep: Path) -> None:
    for old in cache.glob(f"{prefix}-*"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def _download_wheels(requirements: list[str], wheels: Path) -> None:
    version, abi = PYTHON_TAG
    glibc = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)]  # Debian 12: glibc 2.36
    platforms = [*glibc, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--only-binary=:all:",
        "--python-version",
        version,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
        "--dest",
        str(wheels),
    ]
    for platform in platforms:
        command += ["--platform", platform]
    _run("pip download (the base install's wheels for the guest)", [*command, *requirements], timeout=1200)
    (wheels / "requirements.txt").write_text("\n".join(requirements) + "\n", encoding="utf-8")


def _build_rootfs(target: Path, requirements: list[str], say: Callable[[str], None]) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="vm-rootfs-", dir=target.parent) as scratch:
        wheels = Path(scratch) / "wheels"
        say("fetching the base install's wheels for CPython 3.11 x86-64 (pip download)")
        _download_wheels(requirements, wheels)
        hook = Path(scratch) / "hook.sh"
        hook.write_text(_ROOTFS_HOOK, encoding="utf-8")
        mirror = _mirror()
        sources = [
            f"deb {mirror}/debian {SUITE} main",
            f"deb {mirror}/debian {SUITE}-updates main",
            f"deb {mirror}/debian-security {SUITE}-security main",
        ]
        say(f"mmdebstrap {SUITE} (minbase + {len(PACKAGES)} packages; first build: minutes)")
        _run(
            "mmdebstrap",
            [
                "mmdebstrap",
                "--mode=root",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                '--aptopt=APT::Install-Recommends "false"',
                *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "doc", "info", "locale")),
                f'--customize-hook=sh {hook} "$1" {wheels}',
                SUITE,
                str(partial),
                *sources,
            ],
            timeout=3600,
        )
    partial.rename(target)


def _build_wheel(tree: Path, out: Path) -> Path:
    """edgeline's wheel from a copy of the sources (nothing is written into the tree)."""
    copy = out / "source"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", *PACKAGE_FOLDERS):
        path = tree / name
        if path.is_dir():
            shutil.copytree(path, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy2(path, copy / name)
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    printed = _run("building edgeline's wheel", [sys.executable, "-c", code], timeout=600, cwd=copy)
    return out / printed.strip().splitlines()[-1]


def _in_chroot(root: Path, *command: str) -> list[str]:
    """``command`` chrooted in ``root`` with its own /proc, in a mount namespace that ends with it: no mount is left
    behind, whatever happens."""
    return ["unshare", "--mount", "--pid", "--fork", f"--mount-proc={root / 'proc'}", "chroot", str(root), *command]


def _build_image(rootfs: Path, target: Path, tree: Path, say: Callable[[str], None]) -> None:
    began = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    staging = partial / "root"
    say("installing edgeline's wheel into a copy of the rootfs")
    _run("copying the rootfs", ["cp", "-a", "--reflink=auto", str(rootfs), str(staging)], timeout=900)
    wheel = _build_wheel(tree, partial)
    shutil.copy2(wheel, staging / "tmp" / wheel.name)
    _run(
        "pip install edgeline (in the guest's venv)",
        _in_chroot(
            staging,
            f"{VENV}/bin/python",
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--no-cache-dir",
            "--no-index",
            "--no-deps",
            f"/tmp/{wheel.name}",
        ),
        timeout=600,
    )
    (staging / "tmp" / wheel.name).unlink()
    units = list((staging / VENV.lstrip("/") / "lib").glob("python3*/site-packages/edgeline/systemd/edgeline@.service"))
    if len(units) != 1:
        raise EdgelineError(f"the installed edgeline has no systemd/edgeline@.service (found {units})")
    shutil.copy2(units[0], staging / "etc/systemd/system/edgeline@.service")
    (staging / "usr/local/bin/edgeline").symlink_to(f"{VENV}/bin/edgeline")
    for relative, (mode, text) in GUEST_FILES.items():
        path = staging / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        path.chmod(mode)
    wants = staging / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "edgeline-vm-command.service").symlink_to("/etc/systemd/system/edgeline-vm-command.service")
    for unit in MASKED_UNITS:
        (staging / "etc/systemd/system" / unit).symlink_to("/dev/null")
    kernels = sorted((staging / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise EdgelineError(f"{staging}/boot has no kernel (linux-image-amd64 should have put one there)")
    release = kernels[-1].name.removeprefix("vmlinuz-")
    say("update-initramfs (the modules that mount the root)")
    _run("update-initramfs", _in_chroot(staging, "update-initramfs", "-u", "-k", release), timeout=600)
    shutil.copy2(kernels[-1], partial / "vmlinuz")
    shutil.copy2(staging / "boot" / f"initrd.img-{release}", partial / "initrd.img")
    version = _run(
        "the guest's edgeline version", _in_chroot(staging, f"{VENV}/bin/edgeline", "--version"), timeout=120
    ).strip()
    say(f"mke2fs -t ext4 -d ({IMAGE_SIZE >> 30} GiB, sparse)")
    disk = partial / "disk.img"
    with open(disk, "wb") as handle:
        handle.truncate(IMAGE_SIZE)
    # Inode tables and journal written now: no lazy initialisation writing behind a workload (or a write log).
    _run(
        "mke2fs",
        [
            "mke2fs",
            "-q",
            "-F",
            "-t",
            "ext4",
            "-L",
            "edgeline-root",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            "-d",
            str(staging),
            str(disk),
        ],
        timeout=900,
    )
    used = sum(p.lstat().st_size for p in staging.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(staging)
    wheel.unlink()
    shutil.rmtree(partial / "source", ignore_errors=True)
    info = {
        "suite": SUITE,
        "packages": list(PACKAGES),
        "kernel": release,
        "edgeline": version,
        "rootfs": rootfs.name,
        "files_bytes": used,
        "image_bytes": IMAGE_SIZE,
        "seconds": round(time.monotonic() - began, 1),
    }
    (partial / "info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    partial.rename(target)


def build_image(cache_dir: Path | None = None, *, say: Callable[[str], None] = say_default) -> Image:
    """The image for this source tree: found in ``cache_dir`` (default ``build/vm``), or built there (minutes the
    first time, about half a minute after a source change). Idempotent; concurrent callers wait for one build."""
    if os.geteuid() != 0:
        raise EdgelineError("building the VM image needs root (mmdebstrap's root mode keeps the files' owners)")
    missing = missing_tools()
    if missing:
        raise EdgelineError(f"building the VM image needs {', '.join(missing)}: {TOOLS_HINT}")
    tree = source_tree()
    cache = cache_dir or default_cache_dir()
    began = time.monotonic()
    requirements = _base_requirements(tree)
    rootfs_key = _digest(SUITE, _mirror(), PACKAGES, requirements, PYTHON_TAG, ROOTFS_LAYOUT, _ROOTFS_HOOK)
    image_key = _digest(rootfs_key, _sources_digest(tree), GUEST_FILES, MASKED_UNITS, IMAGE_SIZE)
    image_dir = cache / f"image-{image_key}"
    with _locked(cache):
        if (image_dir / "info.json").is_file():
            return Image(image_dir, image_key, 0.0)
        rootfs = cache / f"rootfs-{rootfs_key}"
        if not rootfs.is_dir():  # renamed into place only when whole
            _build_rootfs(rootfs, requirements, say)
            _replace_older(cache, "rootfs", rootfs)
        _build_image(rootfs, image_dir, tree, say)
        _replace_older(cache, "image", image_dir)
    built = time.monotonic() - began
    say(f"image built in {built:.0f} s: {image_dir}")
    return Image(image_dir, image_key, built)
