"""``edgeline.sim.vm`` without booting: the QEMU command line it builds shares nothing with the host but the folder
and the forwarded loopback ports, and a write log puts QEMU's blklogwrites driver between the guest and its disk
(what the power-cut replays build on). The booted machine is tests/test_vm.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeline.errors import EdgelineError
from edgeline.sim.vm import GUEST_BROKER, Accel, BootOptions, Forward, Image, Machine, kvm_problem

pytestmark = pytest.mark.quick

IMAGE = Image(Path("/cache/image-k"), "k", 0.0)


def option(line: list[str], flag: str) -> list[str]:
    return [line[i + 1] for i, word in enumerate(line) if word == flag]


def test_the_guest_gets_the_share_the_forwards_and_nothing_else(tmp_path: Path) -> None:
    options = BootOptions(tmp_path, (Forward(41883), Forward(48080, 8080)), accel=Accel.TCG)
    line = Machine(IMAGE, options).command_line(tmp_path / "run")
    (netdev,) = option(line, "-netdev")
    assert netdev.startswith("user,id=net,restrict=on,"), "no route out of the guest but the forwards"
    assert f"guestfwd=tcp:{GUEST_BROKER}:1883-cmd:" in netdev and "TCP:127.0.0.1:41883" in netdev
    assert f"guestfwd=tcp:{GUEST_BROKER}:8080-cmd:" in netdev and "TCP:127.0.0.1:48080" in netdev
    assert option(line, "-virtfs") == [f"local,path={tmp_path},mount_tag=host,security_model=none,id=host"]
    assert "-nodefaults" in line and option(line, "-display") == ["none"]
    assert option(line, "-machine") == ["q35,accel=tcg"] and option(line, "-cpu") == ["max"]
    assert option(line, "-kernel") == ["/cache/image-k/vmlinuz"] and option(line, "-initrd") == [
        "/cache/image-k/initrd.img"
    ]
    (blockdev,) = option(line, "-blockdev")
    assert blockdev.startswith("driver=qcow2,node-name=disk,") and "run/overlay.qcow2" in blockdev, (
        "a throwaway overlay"
    )
    assert "virtio-blk-pci,drive=disk" in option(line, "-device"), "no log: the disk as QEMU offers it"


def test_a_write_log_puts_blklogwrites_between_the_guest_and_its_disk(tmp_path: Path) -> None:
    disk, log = tmp_path / "replayed.img", tmp_path / "writes,1.log"
    options = BootOptions(tmp_path, write_log=log, disk=disk, accel=Accel.TCG)
    blockdevs = option(Machine(IMAGE, options).command_line(tmp_path / "run"), "-blockdev")
    assert blockdevs == [
        f"driver=raw,node-name=disk,file.driver=file,file.filename={disk}",
        f"driver=file,node-name=log,filename={str(log).replace(',', ',,')}",
        "driver=blklogwrites,node-name=root,file=disk,log=log,log-sector-size=512",
    ]
    devices = option(Machine(IMAGE, options).command_line(tmp_path), "-device")
    assert "virtio-blk-pci,drive=root,discard=off,write-zeroes=off" in devices, "plain writes and flushes only"


def test_kvm_when_usable_else_said(tmp_path: Path) -> None:
    said: list[str] = []
    machine = Machine(IMAGE, BootOptions(tmp_path), say=said.append)
    problem = kvm_problem()
    if problem is None:
        assert machine.accel is Accel.KVM and not said
        assert option(machine.command_line(tmp_path), "-cpu") == ["host,-arch-capabilities"]
    else:
        assert machine.accel is Accel.TCG and said and "plain emulation" in said[0]
        with pytest.raises(EdgelineError, match="KVM asked for"):
            Machine(IMAGE, BootOptions(tmp_path, accel=Accel.KVM))


def test_a_port_outside_tcps_range_is_refused() -> None:
    with pytest.raises(EdgelineError, match=r"1\.\.65535"):
        Forward(0)
    with pytest.raises(EdgelineError, match="guest_port"):
        Forward(1883, 70000)
