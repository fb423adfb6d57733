"""``edgeline rollout``: its waves, its judgement of a device's health, its fleet file; and, against a simulated
fleet of real daemons on a real Mosquitto, a good version reaching every device and a bad canary halting it."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeline.cli import main
from edgeline.errors import UpdateError
from edgeline.sim.fleet import SimFleet
from edgeline.updates.policy import Gates
from edgeline.updates.repository import Repository
from edgeline.updates.rollout import (
    UNJUDGED,
    Fleet,
    FleetDevice,
    Health,
    Rollout,
    load_fleet,
    regression,
    waves,
)
from tests.mqtt_broker import Broker
from tests.update_repo import UpdateRepo

pytestmark = pytest.mark.device


@pytest.mark.quick
def test_waves_start_with_the_canaries_and_double_what_came_before() -> None:
    devices = [f"d{i}" for i in range(10)]
    assert [len(w) for w in waves(devices, 1)] == [1, 1, 2, 4, 2]
    assert [len(w) for w in waves(devices, 3)] == [3, 3, 4]
    assert waves(devices[:2], 5) == [["d0", "d1"]]
    assert [d for w in waves(devices, 2) for d in w] == devices, "every device once, in order"


def health(received: int, errors: int, results: int, anomalies: int, p50: float | None) -> Health:
    return Health(received=received, errors=errors, results=results, anomalies=anomalies, p50_ms=p50, at=0.0)


def judged(before: Health, after: Health) -> str | None:
    return regression(before, after, max_error_increase=0.02, max_anomaly_increase=0.05)


@pytest.mark.quick
def test_a_regression_is_judged_against_the_devices_own_rates_before() -> None:
    before = health(1000, 10, 990, 50, 2.0)  # 1% errors, 5% anomalies
    same = health(1100, 11, 1089, 55, 2.2)
    assert regression(before, same, max_error_increase=0.02, max_anomaly_increase=0.05) is None
    errors = health(1100, 20, 1080, 54, 2.0)  # 10 errors in 100 inputs
    assert "error rate 10.0%" in (regression(before, errors, max_error_increase=0.02, max_anomaly_increase=0.05) or "")
    anomalies = health(1100, 10, 1090, 80, 2.0)  # 30 anomalies in 100 results
    assert "anomaly rate" in (regression(before, anomalies, max_error_increase=0.02, max_anomaly_increase=0.05) or "")
    slow = health(1100, 10, 1090, 55, 5.0)
    assert "median model latency" in (
        regression(before, slow, max_error_increase=0.02, max_anomaly_increase=0.05) or ""
    )
    jitter = health(1100, 10, 1090, 55, 2.9)  # under twice
    assert regression(before, jitter, max_error_increase=0.02, max_anomaly_increase=0.05) is None
    small = health(1100, 10, 1090, 55, 0.9)
    assert (
        regression(health(1000, 10, 990, 50, 0.3), small, max_error_increase=0.02, max_anomaly_increase=0.05) is None
    ), "three times a 0.3 ms call is still under a millisecond more"
    quiet = health(1000, 10, 990, 50, 2.0)
    assert regression(before, quiet, max_error_increase=0.02, max_anomaly_increase=0.05) is None, "no inputs: no rate"


@pytest.mark.quick
@pytest.mark.parametrize(("reason", "state"), [("no-room", "no-room"), ("timeout", "timeout"), ("tampered", "waiting")])
def test_a_device_refusing_the_version_for_now_is_judged_by_why(tmp_path: Path, reason: str, state: str) -> None:
    """A device that has no room for the version, or whose download of it did not finish in time, says nothing of
    the version: left out of the failure rate, as one out of reach is; other refusals for now keep it waiting."""
    fleet = Fleet(device=(FleetDevice(id="d1"),))
    rollout = Rollout(repository=Repository(tmp_path / "repo", tmp_path / "keys"), fleet=fleet, name="tiny", version=2)
    refusal = {"version": 2, "reason": reason, "message": "why"}
    outcome = rollout._outcome("d1", {"update": {"last_refusal": refusal, "refused": {}}}, None, was_reporting=True)
    assert outcome.state == state and outcome.detail == f"refused ({reason}): why"
    assert (state in UNJUDGED) == (reason != "tampered")


@pytest.mark.quick
def test_the_fleet_file_puts_canaries_first_and_refuses_mistakes(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(
        'name = "tiny"\n[broker]\nport = 1884\n'
        '[[device]]\nid = "a"\n[[device]]\nid = "b"\ngroup = "canary"\n[[device]]\nid = "c"\n'
    )
    fleet = load_fleet(path)
    assert fleet.ordered() == ["b", "a", "c"] and fleet.broker.port == 1884
    path.write_text('[[device]]\nid = "a"\n[[device]]\nid = "a"\n')
    with pytest.raises(UpdateError, match="twice"):
        load_fleet(path)
    path.write_text('[[device]]\nid = "a/b"\n')
    with pytest.raises(UpdateError, match=r"device\.0\.id|device"):
        load_fleet(path)
    path.write_text("[broker]\nport = 1883\n")
    with pytest.raises(UpdateError, match="device"):
        load_fleet(path)


@pytest.mark.quick
def test_rollout_refuses_a_version_not_held_for_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = UpdateRepo(tmp_path / "u")
    repo.publish(2)  # offered to every device at once: nothing left to roll out
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('name = "tiny"\n[[device]]\nid = "a"\n')
    args = ["rollout", "tiny", "2", "--repo", str(repo.directory), "--keys", str(repo.keys), "--fleet", str(fleet)]
    assert main(args) == 2
    assert "publish it with --hold" in capsys.readouterr().err
    assert main([*args[:2], "3", *args[3:]]) == 2
    assert "v3 is not published" in capsys.readouterr().err


# -- against a simulated fleet ------------------------------------------------------------------------------------


@pytest.fixture
def fleet_setup(tmp_path: Path, session_broker: Broker) -> Iterator[tuple[UpdateRepo, SimFleet, Path]]:
    repo = UpdateRepo(tmp_path / "updates")
    fleet = SimFleet(
        repo.bundle(1), 4, broker=session_broker.address, work=tmp_path / "fleet", updates=str(repo.directory),
        trusted_root=repo.trusted_root, check_interval_s=0.3, prefix=f"r{uuid.uuid4().hex[:6]}", rate_hz=10.0,
        groups={"canary": 1},
    )  # fmt: skip
    with fleet:
        yield repo, fleet, fleet.write_fleet_file(tmp_path / "fleet.toml")


def rollout_args(repo: UpdateRepo, fleet_file: Path, *extra: str) -> list[str]:
    return ["rollout", "tiny", "2", "--repo", str(repo.directory), "--keys", str(repo.keys), "--fleet", str(fleet_file),
            "--soak", "1", "--wave-timeout", "60", *extra]  # fmt: skip


@pytest.mark.integration
def test_a_good_version_reaches_every_device_wave_by_wave(
    fleet_setup: tuple[UpdateRepo, SimFleet, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, fleet, fleet_file = fleet_setup
    repo.publish(2, gates=Gates(inputs=15, seconds=60), audience=())
    assert main([*rollout_args(repo, fleet_file), "--json"]) == 0
    out = capsys.readouterr().out
    assert "wave 1/3: offered to " + fleet.devices[0] in out and "wave 3/3" in out
    assert repo.repository.versions("tiny")[2].audience is None, "offered to every device at the end"
    fleet.wait_until(lambda: set(fleet.versions().values()) == {2}, 30, "every device on v2")
    for device in fleet.devices:
        assert fleet.version_sequence(device) == [1, 2], fleet.log(device)[-2000:]
    canary_commit = min(fleet.log(d).count("v2 committed") for d in fleet.devices[:1])
    assert canary_commit == 1


@pytest.mark.integration
def test_a_bad_canary_halts_the_rollout_and_the_rest_of_the_fleet_never_sees_the_version(
    fleet_setup: tuple[UpdateRepo, SimFleet, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, fleet, fleet_file = fleet_setup
    repo.publish(2, break_golden=True, audience=())
    assert main(rollout_args(repo, fleet_file)) == 1
    out = capsys.readouterr().out
    canary, rest = fleet.devices[0], fleet.devices[1:]
    assert "HALTED: wave 1: 1 of 1 devices failed" in out and "self-test" in out
    facts = repo.repository.versions("tiny")[2]
    assert facts.revoked is not None and facts.audience == (canary,)
    assert "v2 found" in fleet.log(canary)

    def checks(device: str) -> int:
        return int(((fleet.status(device) or {}).get("counts") or {}).get("update_checks", 0))

    # Counted, not slept for: three more update checks of every other device after the halt.
    after_halt = {device: checks(device) for device in rest}
    fleet.wait_until(
        lambda: all(checks(d) >= after_halt[d] + 3 for d in rest), 60, "three more update checks on every device"
    )
    for device in rest:
        assert "v2" not in fleet.log(device), f"{device} saw v2:\n{fleet.log(device)[-2000:]}"
        assert fleet.version_sequence(device) == [1]
    assert set(fleet.versions().values()) == {1}
    assert all(fleet.alive(d) for d in fleet.devices)


@pytest.mark.integration
def test_a_canary_that_falls_silent_after_committing_halts_the_rollout_and_goes_back_when_it_returns(
    fleet_setup: tuple[UpdateRepo, SimFleet, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The soak: the canary commits v2, then its daemon dies (what a version that crashes it later looks like); the
    rollout halts and revokes v2, the rest never see it, and the canary, back, returns to v1 by itself."""
    repo, fleet, fleet_file = fleet_setup
    canary, rest = fleet.devices[0], fleet.devices[1:]
    repo.publish(2, gates=Gates(inputs=15, seconds=60), audience=())

    def kill_after_commit() -> None:
        fleet.wait_until(lambda: "v2 committed" in fleet.log(canary), 60, "the canary committed v2")
        fleet.kill(canary)

    killer = threading.Thread(target=kill_after_commit, daemon=True)
    killer.start()
    args = rollout_args(repo, fleet_file)
    args[args.index("--soak") + 1] = "8"
    assert main([*args, "--silent-after", "3"]) == 1
    killer.join(5)
    out = capsys.readouterr().out
    assert f"{canary}: failed: silent for" in out and "HALTED: wave 1" in out, out
    assert repo.repository.versions("tiny")[2].revoked is not None
    fleet.restart(canary)
    fleet.wait_until(lambda: "v2 revoked" in fleet.log(canary), 60, "the canary reverts")
    fleet.wait_until(lambda: fleet.versions().get(canary) == 1, 30, "the canary back on v1")
    fleet.wait_until(lambda: fleet.version_sequence(canary)[-1] == 1, 30, "the canary's answers from v1 again")
    for device in rest:
        assert "v2" not in fleet.log(device) and fleet.version_sequence(device) == [1]


@pytest.mark.integration
def test_a_canary_without_room_for_the_version_stops_the_rollout_without_revoking_it(
    fleet_setup: tuple[UpdateRepo, SimFleet, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A version no device has the memory for (64 TB, by its signed measured figure): the canary says no-room,
    which says nothing of the version; the rollout stops, revokes nothing, and the rest never see it."""
    repo, fleet, fleet_file = fleet_setup
    canary, rest = fleet.devices[0], fleet.devices[1:]
    source = json.loads((repo.bundle(1) / "manifest.json").read_text())
    repo.publish(2, manifest={"memory": {**source["memory"], "resident_mb": 64 * 1024 * 1024}}, audience=())
    assert main([*rollout_args(repo, fleet_file), "--json"]) == 1
    out = capsys.readouterr().out
    document = json.loads(out[out.index("{\n") :])
    assert document["halted"] is None and document["stopped"].startswith("wave 1: no device of it could judge")
    assert document["devices"] == [{"device": canary, "state": "no-room", "detail": document["devices"][0]["detail"]}]
    assert "refused (no-room)" in document["devices"][0]["detail"] and "memory" in document["devices"][0]["detail"]
    facts = repo.repository.versions("tiny")[2]
    assert facts.revoked is None and facts.audience == (canary,), "nothing revoked; offered to the canary only"
    for device in rest:
        assert "v2" not in fleet.log(device), f"{device} saw v2:\n{fleet.log(device)[-2000:]}"
    assert set(fleet.versions().values()) == {1}
