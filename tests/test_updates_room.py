"""The room a device needs before it downloads an update (``edgeline.updates.policy.room_refusal``), the memory
figure it reads (``edgeline.memory.available_mb``), and signed facts from a newer publisher."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeline.memory import available_mb
from edgeline.updates.policy import MEMORY_MARGIN, Room, Runtime, TargetFacts, room_refusal

pytestmark = pytest.mark.device

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


def test_a_field_a_newer_publisher_adds_is_ignored_not_refused() -> None:
    custom = facts(12.5).as_custom()
    custom["edgeline"]["signed_by_a_newer_edgeline"] = {"anything": 1}
    custom["edgeline"]["trial"]["a_new_gate"] = "0.5"
    parsed = TargetFacts.from_custom("tiny/tiny-v3.tar", custom)
    assert parsed == facts(12.5)
