"""A simulated fleet (``edgeline.sim.fleet``, ``edgeline sim fleet``): real ``edgeline run`` daemons on a real
Mosquitto, checking one signed repository (``tests.update_repo``), fed inputs, observed through the broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgeline.daemon.config import BrokerAddress
from edgeline.errors import EdgelineError
from edgeline.sim.fleet import (
    FleetError,
    SimFleet,
    VersionChange,
    assign_groups,
    fleet_file_text,
    running_version,
    update_phase,
)
from edgeline.updates.policy import Gates
from tests.mqtt_broker import Broker
from tests.tiny_bundle import COMMITTED_BUNDLE
from tests.update_repo import UpdateRepo

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the base install carries tomli on 3.10
    import tomli as tomllib

pytestmark = pytest.mark.device

TIMEOUT_S = 60.0


def children_running(work: Path) -> list[str]:
    """Command lines of this process's children that run a daemon of the fleet in ``work``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if parent == os.getpid() and str(work) in command:
            found.append(command)
    return found


def wait(fleet: SimFleet, condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    """``fleet.wait_until``, failing with the end of every daemon's log besides the fleet's own account."""
    try:
        fleet.wait_until(condition, timeout, what)
    except FleetError as exc:
        logs = "\n".join(f"--- {device}.log\n{fleet.log(device)[-2500:]}" for device in fleet.devices)
        pytest.fail(f"{exc}\n{logs}")


# ---------------------------------------------------------------------------------------------------------------------
# pure parts


@pytest.mark.quick
def test_the_fleet_file_reads_back_as_written() -> None:
    groups = assign_groups(["f-01", "f-02", "f-03", "f-04"], {"canary": 1, "early": 2})
    assert groups == {"f-01": "canary", "f-02": "early", "f-03": "early", "f-04": None}
    text = fleet_file_text("tiny", BrokerAddress("127.0.0.1", 1884), groups)
    assert tomllib.loads(text) == {
        "name": "tiny",
        "broker": {"host": "127.0.0.1", "port": 1884},
        "device": [
            {"id": "f-01", "group": "canary"},
            {"id": "f-02", "group": "early"},
            {"id": "f-03", "group": "early"},
            {"id": "f-04"},
        ],
    }
    with pytest.raises(FleetError, match="groups of 3 devices in a fleet of 2"):
        assign_groups(["a", "b"], {"canary": 3})
    with pytest.raises(FleetError, match="group ''"):
        assign_groups(["a"], {"": 1})
    odd = {"a": 'early "bird" \\ früh 🐤'}  # quotes, a backslash, beyond the BMP: TOML escapes differ from JSON's
    assert tomllib.loads(fleet_file_text("tiny", BrokerAddress("::1"), odd))["device"] == [
        {"id": "a", "group": odd["a"]}
    ]


@pytest.mark.quick
def test_a_status_says_which_version_runs_and_where_it_stands() -> None:
    assert running_version({"version": 1}) == 1 and update_phase({"version": 1}) == "running"
    trial = {"version": 2, "update": {"running": 2, "state": "trial", "trial": {"inputs": 3}, "committed": None}}
    assert running_version(trial) == 2 and update_phase(trial) == "trial"
    committed = {"version": 2, "update": {"running": 2, "state": "committed", "committed": {"version": 2}}}
    assert update_phase(committed) == "committed"
    rolled_back = {"version": 1, "update": {"running": 1, "state": "rolled-back", "last": {"step": "rolled-back"}}}
    assert update_phase(rolled_back) == "rolled back"
    assert str(VersionChange("fleet-03", 1, 2, "committed")) == "fleet-03: v1 -> v2 (committed)"
    assert str(VersionChange("fleet-01", None, 1, "running")) == "fleet-01: v1 (running)"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"count": 0}, "--devices 0: between 1 and 100"),
        ({"updates": "repo"}, "--updates and --trusted-root go together"),
        ({"prefix": "a/b"}, "--prefix 'a/b'"),
        ({"rate_hz": 0.0}, "--rate 0: inputs per second"),
        ({"check_interval_s": -1.0}, "--check-interval -1: seconds above 0"),
        ({"broker": "local host:1"}, "--broker host"),
    ],
)
def test_a_fleet_that_cannot_be_made_is_refused_in_one_line(
    change: dict[str, object], message: str, tmp_path: Path
) -> None:
    arguments: dict[str, object] = {"count": 2, "broker": "127.0.0.1:1", "work": tmp_path / "work", **change}
    count = arguments.pop("count")
    with pytest.raises(EdgelineError, match=message) as raised:  # FleetError, or BrokerAddress's own
        SimFleet(COMMITTED_BUNDLE, count, **arguments)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "work").exists(), "nothing is made before the fleet starts"


# ---------------------------------------------------------------------------------------------------------------------
# against real daemons


@pytest.mark.integration
def test_a_published_version_reaches_every_device_while_answers_keep_flowing(broker: Broker, tmp_path: Path) -> None:
    repo = UpdateRepo(tmp_path / "updates")
    changes: list[VersionChange] = []
    work = tmp_path / "work"
    fleet = SimFleet(
        repo.bundle(1), 3, broker=broker.address, work=work, updates=str(repo.directory),
        trusted_root=repo.trusted_root, check_interval_s=0.5, rate_hz=10.0, groups={"canary": 1},
        on_change=changes.append,
    )  # fmt: skip
    with fleet:
        assert fleet.devices == ("fleet-01", "fleet-02", "fleet-03")
        assert fleet.versions() == dict.fromkeys(fleet.devices, 1)
        assert all(fleet.alive(device) for device in fleet.devices)
        wait(fleet, lambda: all(fleet.answered(d) >= 5 for d in fleet.devices), "answers from v1")

        repo.publish(2, gates=Gates(inputs=20, seconds=60))
        wait(fleet, lambda: set(fleet.phases().values()) == {"committed"}, "every device committing v2")
        assert fleet.versions() == dict.fromkeys(fleet.devices, 2)
        for device in fleet.devices:
            update = (fleet.status(device) or {})["update"]
            assert update["running"] == 2 and update["committed"]["version"] == 2, update
            assert update["last_trial"]["inputs"] == 20, update["last_trial"]
        after_commit = {device: fleet.answered(device) for device in fleet.devices}
        wait(
            fleet,
            lambda: all(fleet.answered(d) >= after_commit[d] + 10 for d in fleet.devices),
            "answers after the commit",
        )
        for device in fleet.devices:
            assert fleet.version_sequence(device) == [1, 2], "v1 answered, then only v2"
            by_version = fleet.answers_by_version(device)
            assert by_version[1] >= 5 and by_version[2] >= 30, by_version  # 20 in the trial, 10 after the commit
            assert fleet.errors(device) == 0
            assert "v2 committed" in fleet.log(device)
        assert {str(change) for change in changes} >= {f"{d}: v1 -> v2 (committed)" for d in fleet.devices}

        path = fleet.write_fleet_file(tmp_path / "fleet.toml")
        assert tomllib.loads(path.read_text()) == {
            "name": "tiny",
            "broker": {"host": "127.0.0.1", "port": broker.port},
            "device": [{"id": "fleet-01", "group": "canary"}, {"id": "fleet-02"}, {"id": "fleet-03"}],
        }
        assert children_running(work), "the daemons are this process's children"
    assert children_running(work) == [], "stop() leaves no daemon behind"
    assert not any(fleet.running(device) for device in fleet.devices) and fleet.crashed() == {}
    fleet.stop()  # again: nothing to do
    assert "fleet-02  v2       committed" in fleet.summary()


@pytest.mark.integration
def test_a_daemon_that_crashes_goes_stale_and_the_others_keep_answering(broker: Broker, tmp_path: Path) -> None:
    samples = tmp_path / "digits.npz"
    np.savez(samples, x=np.random.default_rng(1).random((32, 1, 8, 8), dtype=np.float32))
    work = tmp_path / "work"
    with SimFleet(
        COMMITTED_BUNDLE, 3, broker=broker.address, work=work, data=samples, rate_hz=10.0, status_interval_s=0.5
    ) as fleet:
        assert "the samples of" in fleet.inputs
        wait(fleet, lambda: all(fleet.answered(d) >= 5 for d in fleet.devices), "first answers")
        os.kill(fleet.pids()["fleet-02"], signal.SIGKILL)  # not fleet.kill(): a crash the fleet did not ask for

        wait(fleet, lambda: not fleet.alive("fleet-02"), "the broker saying fleet-02 is offline", 10.0)
        wait(fleet, lambda: fleet.crashed() == {"fleet-02": -signal.SIGKILL}, "the crash seen", 10.0)
        wait(
            fleet, lambda: (fleet.status_age("fleet-02") or 0.0) > fleet.stale_after_s, "fleet-02's status stale", 10.0
        )
        answered = {device: fleet.answered(device) for device in fleet.devices}
        wait(
            fleet,
            lambda: all(fleet.answered(d) >= answered[d] + 10 for d in ("fleet-01", "fleet-03")),
            "the others answering",
        )
        assert fleet.alive("fleet-01") and fleet.alive("fleet-03")
        assert fleet.answered("fleet-02") == answered["fleet-02"]
        assert "exited -9" in fleet.summary()

        fleet.restart("fleet-02")  # its session kept what was sent meanwhile
        assert fleet.alive("fleet-02") and fleet.crashed() == {}
        wait(fleet, lambda: fleet.answered("fleet-02") >= answered["fleet-02"] + 10, "fleet-02 answering again")
    assert children_running(work) == []


@pytest.mark.integration
def test_a_daemon_that_cannot_start_is_named_with_its_log(broker: Broker, tmp_path: Path) -> None:
    work = tmp_path / "work"
    fleet = SimFleet(
        COMMITTED_BUNDLE, 2, broker=broker.address, work=work, updates=str(tmp_path / "repo"),
        trusted_root=tmp_path / "missing-root.json", start_timeout_s=TIMEOUT_S,
    )  # fmt: skip
    with pytest.raises(FleetError, match=r"fleet-0[12]: its daemon exited \(2\) while starting: .*missing-root") as err:
        fleet.start()
    assert "\n" not in str(err.value) and str(work) in str(err.value)
    assert children_running(work) == []


@pytest.mark.integration
def test_sim_fleet_runs_for_a_while_and_prints_its_devices(broker: Broker, tmp_path: Path) -> None:
    work, fleet_file = tmp_path / "work", tmp_path / "devices.toml"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", "sim", "fleet", str(COMMITTED_BUNDLE), "--devices", "2",
         "--broker", broker.address, "--work", str(work), "--canary", "1", "--fleet-file", str(fleet_file),
         "--for", "3"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started < TIMEOUT_S
    lines = done.stdout.splitlines()
    assert lines[0].startswith("fleet of 2 tiny devices on 127.0.0.1:"), done.stdout
    assert "fleet-01: v1 (running)" in lines and "fleet-02: v1 (running)" in lines
    table = lines[lines.index(next(line for line in lines if line.startswith("device "))) :]
    assert table[0].split() == ["device", "version", "phase", "answered", "by", "version"]
    rows = {row.split()[0]: row.split() for row in table[1:]}
    assert set(rows) == {"fleet-01", "fleet-02"}
    assert all(row[1] == "v1" and int(row[3]) > 0 for row in rows.values()), table
    assert tomllib.loads(fleet_file.read_text())["device"][0] == {"id": "fleet-01", "group": "canary"}
    assert (work / "fleet-01.log").is_file() and (work / "fleet-02" / "tiny").is_dir()


@pytest.mark.integration
def test_sim_fleet_stops_on_sigterm_and_its_daemons_with_it(broker: Broker, tmp_path: Path) -> None:
    work = tmp_path / "work"
    command = [sys.executable, "-m", "edgeline.cli", "sim", "fleet", str(COMMITTED_BUNDLE), "--devices", "1",
               "--broker", broker.address, "--work", str(work), "--prefix", "term"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            lines = [process.stdout.readline() for _ in range(2)]  # the fleet's line, then its device's version
            assert lines[1] == "term-01: v1 (running)\n", lines
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=TIMEOUT_S)
        finally:
            process.kill()
    assert process.returncode == 0, err[-3000:]
    assert out.splitlines()[-1].startswith("term-01  v1"), out
    assert not any(str(work) in line for line in _all_command_lines()), "no daemon left behind"


def _all_command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return lines
