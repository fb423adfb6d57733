"""The room a device needs before it downloads an update (``edgeline.updates.policy.room_refusal``), the memory
figure it reads (``edgeline.memory.available_mb``), and signed facts from a newer publisher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeline.memory import available_mb, cgroup_room_mb
from edgeline.updates.policy import MEMORY_MARGIN, Room, Runtime, TargetFacts, room_refusal

pytestmark = [pytest.mark.quick, pytest.mark.device]

MB = 1 << 20


def facts(resident_mb: float | None = None) -> TargetFacts:
    return TargetFacts(
        name="tiny", version=3, profile="rpi5", backend="litert", precision="int8-static",
        runtime=Runtime(package="ai-edge-litert", min_version="1.0"), manifest_sha256="0" * 64,
        resident_mb=resident_mb,
    )  # fmt: skip


def test_the_disk_must_hold_the_archive_and_its_unpacked_bundle_beside_the_outbox_room() -> None:
    length, reserve = 10 * MB, 64 * MB
    enough = 2 * length + reserve
    assert room_refusal(facts(), length, Room(free_bytes=enough, reserve_bytes=reserve, available_mb=None)) is None
    problem = room_refusal(facts(), length, Room(free_bytes=enough - 1, reserve_bytes=reserve, available_mb=None))
    assert problem is not None
    assert "v3 needs 20.0 MB of disk" in problem and "64.0 MB stay free for the outbox" in problem, problem
    assert "has 84.0 MB free" in problem


def test_the_memory_must_hold_the_new_model_beside_the_running_one_with_a_margin() -> None:
    needed = 100 * MEMORY_MARGIN
    assert room_refusal(facts(100.0), 1, Room(free_bytes=None, reserve_bytes=0, available_mb=needed)) is None
    problem = room_refusal(facts(100.0), 1, Room(free_bytes=None, reserve_bytes=0, available_mb=needed - 1))
    assert problem is not None and "adds 100.0 MB when loaded" in problem and "149 MB of memory" in problem


def test_a_figure_unknown_on_either_side_does_not_refuse() -> None:
    unknown = Room(free_bytes=None, reserve_bytes=10**12, available_mb=None)
    assert room_refusal(facts(10**9), 10**12, unknown) is None
    assert room_refusal(facts(None), 1, Room(free_bytes=10**9, reserve_bytes=0, available_mb=0.0)) is None


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  1000 kB\nMemAvailable:   2097152 kB\n")
    assert available_mb(meminfo) == 2048.0
    meminfo.write_text("MemTotal:       24576000 kB\n")  # a kernel before 3.14 has no MemAvailable
    assert available_mb(meminfo) is None
    assert available_mb(tmp_path / "absent") is None
    here = available_mb()
    assert here is None or here > 0  # this machine's, where /proc exists


def test_a_memory_cgroup_limit_is_the_room_when_it_is_tighter(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   8388608 kB\n")  # 8 GB on the machine
    # cgroup v2: the service's MemoryMax=512M, 400 MB of it used; its slice has no limit
    v2 = tmp_path / "v2"
    service = v2 / "system.slice" / "edgeline@pi.service"
    service.mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    (v2 / "system.slice" / "memory.max").write_text("max\n")
    (v2 / "system.slice" / "memory.current").write_text(f"{3 << 30}\n")
    (service / "memory.max").write_text(f"{512 << 20}\n")
    (service / "memory.current").write_text(f"{400 << 20}\n")
    own = tmp_path / "cgroup-v2"
    own.write_text("0::/system.slice/edgeline@pi.service\n")
    assert cgroup_room_mb(own, v2) == 112.0
    assert available_mb(meminfo, own, v2) == 112.0
    (service / "memory.max").write_text("max\n")  # no limit: the machine's figure
    assert cgroup_room_mb(own, v2) is None and available_mb(meminfo, own, v2) == 8192.0

    # cgroup v1 (a hybrid system): the memory controller's hierarchy, a parent's limit the tightest
    v1 = tmp_path / "v1"
    leaf = v1 / "memory" / "fleet" / "edgeline"
    leaf.mkdir(parents=True)
    (v1 / "memory" / "fleet" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (v1 / "memory" / "fleet" / "memory.usage_in_bytes").write_text(f"{(1 << 30) - (64 << 20)}\n")
    (leaf / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (leaf / "memory.usage_in_bytes").write_text(f"{100 << 20}\n")
    hybrid = tmp_path / "cgroup-v1"
    hybrid.write_text("0::/\n4:memory:/fleet/edgeline\n1:cpu,cpuacct:/\n")
    assert cgroup_room_mb(hybrid, v1) == 64.0
    assert cgroup_room_mb(tmp_path / "absent", v1) is None


def test_the_room_of_a_process_in_a_real_memory_cgroup_is_its_limit(tmp_path: Path) -> None:
    """A child process moved into a memory cgroup of this machine (limit 256 MB) reads at most that."""
    cgroup = _writable_memory_cgroup()
    if cgroup is None:
        pytest.skip("no writable memory cgroup here (needs root and a cgroup v1 or v2 memory controller)")
    child, limit_file, procs = cgroup
    child.mkdir()
    try:
        (child / limit_file).write_text(str(256 << 20))
        script = (  # the child moves itself into the cgroup, then reads its room
            "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()))\n"
            "from edgeline.memory import available_mb; print(available_mb())"
        )
        out = subprocess.run(
            [sys.executable, "-c", script, str(child / procs)], capture_output=True, text=True, timeout=60, check=True
        )
        figure = float(out.stdout)
        assert 0 < figure <= 256, out.stdout
    finally:
        for _ in range(50):  # the child has exited; its cgroup empties within moments
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _writable_memory_cgroup() -> tuple[Path, str, str] | None:
    """A new child of this process's memory cgroup (not created yet), its limit file and its procs file."""
    if os.geteuid() != 0:
        return None
    name = f"edgeline-test-{os.getpid()}"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, relative = line.split(":", 2)
        if controllers == "":
            base = Path("/sys/fs/cgroup")
            if (base / "cgroup.controllers").is_file() and "memory" in (base / "cgroup.controllers").read_text():
                here = base / relative.strip("/")
                if (here / "cgroup.subtree_control").is_file() and "memory" in (
                    here / "cgroup.subtree_control"
                ).read_text():
                    return here / name, "memory.max", "cgroup.procs"
        elif "memory" in controllers.split(","):
            here = Path("/sys/fs/cgroup/memory") / relative.strip("/")
            if os.access(here, os.W_OK):
                return here / name, "memory.limit_in_bytes", "cgroup.procs"
    return None


def test_a_field_a_newer_publisher_adds_is_ignored_not_refused() -> None:
    custom = facts(12.5).as_custom()
    custom["edgeline"]["signed_by_a_newer_edgeline"] = {"anything": 1}
    custom["edgeline"]["trial"]["a_new_gate"] = "0.5"
    parsed = TargetFacts.from_custom("tiny/tiny-v3.tar", custom)
    assert parsed == facts(12.5)
