"""The daemon on a whole machine: Debian 12 booted with QEMU (KVM here), ``edgeline run`` under the project's own
unit (``edgeline@.service``: Type=notify, WatchdogSec=30, StateDirectory, DynamicUser), answering a real Mosquitto
on the host through the one port forwarded into the guest (``edgeline.sim.vm``, ``scripts/vm.sh``).

One run of the machine (two boots) carries every check, in this order, the guest's command (``GUEST_COMMAND``) and
the host stepping through them together over the shared folder (marks the guest writes, go-files the host writes):

1. The unit starts (``systemctl start`` returns once the daemon said READY=1: bundle verified, broker connected) and
   answers inputs published on the host. The bundle given is v1; the signed repository (copied into the guest)
   holds v2, which the daemon fetches, verifies, self-tests, trials on the host's inputs and commits.
2. The daemon is frozen with SIGSTOP: systemd's watchdog (no WATCHDOG=1 within 30 s) kills it and the unit
   restarts it (NRestarts one more, "Failed with result 'watchdog'"); the new process answers.
3. ``systemctl stop``: the daemon drains and exits 0 (ExecMainCode=exited, ExecMainStatus=0, Result=success), having
   published "offline".
4. ``vm-reboot``: after the reboot the enabled unit starts by itself on the committed v2 (its state directory
   survived), and v2 answers.

At the first boot the guest also records its modules and failed units: the image leaves out what a boot would load
for nothing (``edgeline.sim.vm_image``: seconds a module under plain emulation), and no unit failed.

The image is built once (``scripts/vm.sh build``: minutes cold, cached in build/vm); the run takes about a minute
and a half, most of it the watchdog's 30 s and the reboot. Under pytest-xdist the run happens once per test run
whichever worker gets these tests first: its facts are shared with the others through a file (``vm_run``).
Skipped unless root (mmdebstrap and 9p need it; CI runs as root).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from edgeline.sim.vm import GUEST_BROKER, BootOptions, Forward, Image, Machine, build_image, write_command
from edgeline.sim.vm_image import default_cache_dir, missing_tools
from edgeline.updates.policy import Gates
from tests.mqtt_broker import Broker, Collector
from tests.test_daemon_durability import inputs
from tests.update_repo import UpdateRepo
from tests.waiting import wait_until

pytestmark = pytest.mark.vm

TOPIC = "vm"
STEP_TIMEOUT_S = 240.0
"""Each step the host waits for (the first boot, the trial, the watchdog's 30 s and a restart, a reboot)."""
RUN_TIMEOUT_S = 900.0
ANSWER_TIMEOUT_S = 60.0
TRIAL_LATENCY_MS = 1000.0
"""v2's p95 model latency budget in its trial: far over any emulated call, so speed never decides it here."""
ABORT_TIMEOUT_S = 90.0
"""How long a late guest has to write its journal and stop, once told to give up."""
JOURNAL_CHARS = 12_000

CONFIG = f"""\
[daemon]
instance = "vm"
[broker]
host = "{GUEST_BROKER}"
port = 1883
[input]
subscribe = ["{TOPIC}/sensors/+/image"]
[output]
publish = "{TOPIC}/results/{{device}}"
[health]
status_interval_s = 1.0
[updates]
repository = "/srv/edgeline-repo"
trusted_root = "/etc/edgeline/tiny-root.json"
check_interval_s = 1.0
"""

GUEST_COMMAND = r"""
UNIT=edgeline@tiny.service
STATE=/var/lib/edgeline/tiny/tiny/updates/state.json
mkdir -p /host/facts /host/marks
mark() { touch "/host/marks/$1"; echo "mark $1 at $(cut -d' ' -f1 /proc/uptime) s"; }
fact() { cat > "/host/facts/$1.new" && mv "/host/facts/$1.new" "/host/facts/$1"; }
prop() { systemctl show "$UNIT" -p "$1" --value; }
show() {
    systemctl show "$UNIT" -p ActiveState -p SubState -p Result -p MainPID -p NRestarts -p ExecMainCode \
        -p ExecMainStatus -p WatchdogUSec -p StateDirectory -p DynamicUser -p Type -p FragmentPath
}
fail() {  # the unit's journal in the output, the whole boot's in journal-N.log for the host to attach
    echo "FAILED at $(uptime_s) s: $*"
    journalctl -u "$UNIT" -o short-monotonic --no-pager | tail -n 60
    journalctl -b -o short-monotonic --no-pager > "/host/journal-$EDGELINE_VM_BOOT.log" 2>&1
    [ -e "$STATE" ] && cat "$STATE"
    exit 1
}
within() {  # SECONDS COMMAND...: true once COMMAND is, false after SECONDS of the clock (or when the host gave up)
    end=$(( $(date +%s) + $1 )); shift
    until "$@"; do
        [ "$(date +%s)" -lt "$end" ] && [ ! -e /host/go/abort ] || return 1
        sleep 0.5
    done
}
host_said() { [ -e "/host/go/$1" ]; }
committed() { journalctl -u "$UNIT" -o cat --no-pager | grep -q "v2 committed"; }
active() { [ "$(prop ActiveState)" = active ] && [ "$(prop SubState)" = running ]; }
restarted() { [ "$(prop NRestarts)" -gt "$restarts" ] && active && [ "$(prop MainPID)" != "$frozen" ]; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }

case "$EDGELINE_VM_BOOT" in
1)
    mkdir -p /var/lib/edgeline/bundles /etc/edgeline /srv
    cp -r /host/v1 /var/lib/edgeline/bundles/tiny
    cp -r /host/repo /srv/edgeline-repo
    cp /host/tiny.toml /etc/edgeline/tiny.toml
    cp /host/root.json /etc/edgeline/tiny-root.json
    chmod -R a+rX /var/lib/edgeline/bundles /srv/edgeline-repo /etc/edgeline
    systemctl enable "$UNIT" || fail "systemctl enable"
    timeout 120 systemctl start "$UNIT" || fail "systemctl start"
    show | fact started
    { echo "Modules=$(lsmod | awk 'NR > 1 {print $1}' | sort | tr '\n' ' ')"
      echo "Failed=$(systemctl --failed --plain --no-legend | awk '{print $1}' | tr '\n' ' ')"; } | fact machine
    mark started
    within 200 committed || fail "v2 was never committed"
    cat "$STATE" | fact state
    mark committed

    frozen=$(prop MainPID); restarts=$(prop NRestarts); began=$(uptime_s)
    kill -STOP "$frozen"
    within 200 restarted || fail "the frozen daemon (pid $frozen) was not restarted"
    { show; echo "FrozenPID=$frozen"; echo "RestartsBefore=$restarts"; echo "FrozenAt=$began"
      echo "RestartedAt=$(uptime_s)"
      journalctl -u "$UNIT" -o cat --no-pager | grep -iE "watchdog|SIGABRT|restart" | sed 's/^/Journal=/'
    } | fact watchdog
    mark restarted

    within 200 host_said stop || fail "the host never said stop"
    began=$(uptime_s)
    systemctl stop "$UNIT" || fail "systemctl stop"
    { show; echo "StopBegan=$began"; echo "StopEnded=$(uptime_s)"
      journalctl -u "$UNIT" -o cat --no-pager | tail -n 8 | sed 's/^/Journal=/'; } | fact stopped
    mark stopped
    sync
    vm-reboot
    ;;
2)
    within 120 active || fail "the unit is not running after the reboot"
    { show; echo "Enabled=$(systemctl is-enabled "$UNIT")"
      journalctl -b -u "$UNIT" -o cat --no-pager | grep -E "starting on|v[0-9]" | sed 's/^/Journal=/'; } | fact boot2
    mark boot2
    within 200 host_said done || fail "the host never said done"
    systemctl stop "$UNIT"
    ;;
esac
"""


# -- the image and the one run ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vm_image() -> Image:
    if os.geteuid() != 0:
        pytest.skip("the VM tier needs root (mmdebstrap's root mode, QEMU's 9p share; CI runs as root)")
    missing = missing_tools()
    assert not missing, f"missing {', '.join(missing)}: run scripts/setup.sh (it installs them with apt-get)"
    return build_image()


class Run:
    """The host's side of ``GUEST_COMMAND``: waits for the guest's marks, publishes inputs, collects answers."""

    def __init__(self, machine: Machine, share: Path, broker: Broker) -> None:
        self.machine = machine
        self.share = share
        self.broker = broker
        self.answers = Collector(broker, f"{TOPIC}/results/#")
        self.availability = Collector(broker, "edgeline/tiny/vm/availability")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="vm-test-publisher")
        connected = threading.Event()
        self.client.on_connect = lambda *_: connected.set()
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert connected.wait(ANSWER_TIMEOUT_S), "the test's publisher got no CONNACK"
        self.seconds: dict[str, float] = {}
        self.began = time.monotonic()

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
        self.answers.close()
        self.availability.close()

    def wait_mark(self, name: str) -> None:
        """Until the guest has written ``marks/NAME``; fails as soon as its command has ended or QEMU has."""
        mark = self.share / "marks" / name
        status = self.share / ".vm" / "status"
        process = self.machine.process
        assert process is not None
        ended = lambda: mark.exists() or status.exists() or process.poll() is not None  # noqa: E731
        if not wait_until(ended, STEP_TIMEOUT_S, 0.1):
            # the guest's own waits are shorter: it is late (a slow emulated guest), so tell it to give up and say why
            self.go("abort")
            wait_until(lambda: status.exists() or process.poll() is not None, ABORT_TIMEOUT_S, 0.2)
            pytest.fail(f"no mark {name!r} from the guest within {STEP_TIMEOUT_S:g} s\n{self.guest_said()}")
        if not mark.exists():
            pytest.fail(f"the guest stopped before {name!r}:\n{self.guest_said()}")
        self.seconds[name] = round(time.monotonic() - self.began, 1)

    def guest_said(self) -> str:
        """The command's output, the journal of the boot it failed in (``fail`` writes it) and the console's tail."""
        said = [f"the guest's output:\n{self.machine.output()[-4000:]}"]
        for journal in sorted(self.share.glob("journal-*.log")):
            said.append(f"{journal.name}:\n{journal.read_text(errors='replace')[-JOURNAL_CHARS:]}")
        said.append(f"{self.machine.scratch}/console.log:\n{self.machine.console()[-2000:]}")
        return "\n".join(said)

    def until_marked(self, name: str, prefix: str) -> dict[str, list[int]]:
        """Inputs a few at a time, each batch answered before the next, until the guest writes ``marks/NAME`` (the
        trial of v2 counts the inputs v2 answers beside v1, once it has been fetched and verified)."""
        answered: dict[str, list[int]] = {}
        deadline = time.monotonic() + STEP_TIMEOUT_S
        batch = 0
        while not (self.share / "marks" / name).exists() and time.monotonic() < deadline:
            if (self.share / ".vm" / "status").exists():
                break  # wait_mark says why
            answered.update(self.answered(f"{prefix}{batch}-", 5))
            batch += 1
            time.sleep(0.3)
        self.wait_mark(name)
        return answered

    def go(self, name: str) -> None:
        (self.share / "go").mkdir(exist_ok=True)
        (self.share / "go" / name).touch()

    def versions(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for payload in self.answers.payloads:
            answer = json.loads(payload)
            found.setdefault(str(answer["id"]), []).append(int(answer.get("version", 0)))
        return found

    def answered(self, prefix: str, count: int) -> dict[str, list[int]]:
        """Publish ``count`` inputs (QoS 1) and wait until each has an answer: their versions by id."""
        messages = inputs(f"{TOPIC}/sensors/cam0/image", count, prefix=prefix)
        for topic, payload in messages:
            self.client.publish(topic, payload, qos=1).wait_for_publish(ANSWER_TIMEOUT_S)
        ids = {json.loads(payload)["id"] for _, payload in messages}
        wait_until(lambda: ids <= set(self.versions()), ANSWER_TIMEOUT_S, 0.1)
        versions = self.versions()
        missing = sorted(ids - set(versions))
        assert not missing, f"no answer to {missing[:5]} within {ANSWER_TIMEOUT_S:g} s\n{self.machine.output()[-3000:]}"
        return {key: versions[key] for key in sorted(ids)}


def _facts(share: Path) -> dict[str, dict[str, Any]]:
    """``facts/NAME``: systemctl show's KEY=VALUE lines (Journal= lines kept as a list)."""
    facts: dict[str, dict[str, Any]] = {}
    for path in sorted((share / "facts").glob("*")):
        if path.name == "state":
            facts["state"] = json.loads(path.read_text())
            continue
        found: dict[str, Any] = {"Journal": []}
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key == "Journal":
                found["Journal"].append(value)
            elif key:
                found[key] = value
        facts[path.name] = found
    return facts


def run_scenario(image: Image, work: Path) -> dict[str, Any]:
    """The one run of the machine, and what the host and the guest saw, as JSON-ready data."""
    share = work / "share"
    share.mkdir(parents=True)
    repo = UpdateRepo(work / "updates")
    shutil.copytree(repo.bundle(1), share / "v1")
    # An absolute latency budget, not the default comparison with v1: v2 is v1's model, yet under plain emulation
    # on a loaded host their calls, side by side, were timed two to four times apart ("v2 rolled back to v1: median
    # model latency 2.24 ms > twice v1's 0.615 ms (lower quartile 1.25 ms > twice 0.571 ms)", one run in three);
    # this scenario checks the unit, not the trial's judgement of speed (tests/test_updates_trial.py has that)
    repo.publish(2, gates=Gates(inputs=10, seconds=300, max_latency_ms=TRIAL_LATENCY_MS))
    shutil.copytree(repo.directory, share / "repo")
    shutil.copy2(repo.trusted_root, share / "root.json")
    (share / "tiny.toml").write_text(CONFIG, encoding="utf-8")
    write_command(share, GUEST_COMMAND)
    broker = Broker(work / "mosquitto").start()
    answers: dict[str, dict[str, list[int]]] = {}
    try:
        with Machine(image, BootOptions(share, (Forward(broker.port),))) as machine:
            run = Run(machine, share, broker)
            try:
                run.wait_mark("started")
                answers["before-commit"] = run.until_marked("committed", "t")
                run.wait_mark("restarted")
                answers["after-watchdog"] = run.answered("w", 10)
                run.go("stop")
                run.wait_mark("stopped")
                said = wait_until(lambda: run.availability.payloads[-1:] == [b"offline"], ANSWER_TIMEOUT_S, 0.1)
                answers["offline-at-stop"] = {"said": [int(said)]}
                run.wait_mark("boot2")
                answers["after-reboot"] = run.answered("r", 10)
                run.go("done")
                status = machine.wait(RUN_TIMEOUT_S)
                availability = [payload.decode() for payload in run.availability.payloads]
            except BaseException:
                machine.failed = True  # its console log stays, for a look
                raise
            finally:
                run.close()
            return {
                "status": status,
                "boots": machine.boots(),
                "accel": machine.accel.value,
                "facts": _facts(share),
                "answers": answers,
                "availability": availability,
                "seconds": run.seconds,
                "output": machine.output()[-6000:],
            }
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def vm_run(vm_image: Image, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``run_scenario`` once per test run: the first worker to get here runs it (under a lock), the others read
    what it wrote; a failure is shared the same way, so it is reported by every test rather than run again."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return _checked(_attempt(vm_image, tmp_path_factory.mktemp("vm")))
    cache = default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    kept = cache / f"scenario-{run_id}.json"
    with open(cache / ".scenario.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not kept.exists():
            for old in cache.glob("scenario-*.json"):
                old.unlink()
            kept.write_text(json.dumps(_attempt(vm_image, tmp_path_factory.mktemp("vm"))))
    return _checked(json.loads(kept.read_text()))


def _attempt(image: Image, work: Path) -> dict[str, Any]:
    try:
        return run_scenario(image, work)
    except BaseException as exc:  # pytest.fail's Failed too: every test says why the one run failed
        return {"error": "".join(traceback.format_exception_only(type(exc), exc))[-8000:]}


def _checked(found: dict[str, Any]) -> dict[str, Any]:
    if "error" in found:
        pytest.fail(f"the VM run failed:\n{found['error']}", pytrace=False)
    return found


def not_only(version: int, answers: dict[str, list[int]]) -> dict[str, list[int]]:
    """The inputs not answered exactly once, by ``version``."""
    return {key: versions for key, versions in answers.items() if versions != [version]}


# -- the checks ---------------------------------------------------------------------------------------------------


def test_the_unit_starts_and_the_daemon_answers_a_broker_on_the_host(vm_run: dict[str, Any]) -> None:
    started = vm_run["facts"]["started"]
    assert started["ActiveState"] == "active" and started["SubState"] == "running", started
    assert started["Type"] == "notify" and started["WatchdogUSec"] == "30s", "the project's unit, as shipped"
    assert started["FragmentPath"] == "/etc/systemd/system/edgeline@.service" and started["DynamicUser"] == "yes"
    assert started["StateDirectory"] == "edgeline/tiny"
    before = vm_run["answers"]["before-commit"]
    assert before and all(len(versions) == 1 for versions in before.values()), "each input answered once"
    assert set().union(*map(set, before.values())) <= {1, 2}
    state = vm_run["facts"]["state"]
    assert state["committed"] == {"version": 2, "bundle": "bundles/v2"}, "the trial on the host's inputs committed v2"
    assert vm_run["availability"][:1] == ["online"], vm_run["availability"]


UNUSED_MODULES = {
    "ahci", "libata", "lpc_ich", "i2c_i801", "iTCO_wdt", "pcspkr", "psmouse", "evdev", "cfg80211", "qemu_fw_cfg",
    "binfmt_misc", "fuse", "loop", "dm_mod", "configfs", "efi_pstore",
}  # fmt: skip
"""Drivers and file systems the machine has no use for (its disk is virtio; no display, input, radio, SATA disk,
hardware watchdog, FUSE, loop or mapped device): each a module loaded at every boot, seconds under plain emulation."""


def test_the_machine_boots_what_it_uses_and_nothing_fails(vm_run: dict[str, Any]) -> None:
    machine = vm_run["facts"]["machine"]
    modules = set(machine["Modules"].split())
    assert {"virtio_blk", "virtio_net", "ext4", "9p"} <= modules, sorted(modules)
    assert not modules & UNUSED_MODULES, f"loaded for nothing: {sorted(modules & UNUSED_MODULES)}"
    assert machine["Failed"].split() == [], f"failed units: {machine['Failed']}"


def test_the_watchdog_restarts_a_daemon_frozen_with_sigstop(vm_run: dict[str, Any]) -> None:
    watchdog = vm_run["facts"]["watchdog"]
    assert int(watchdog["NRestarts"]) == int(watchdog["RestartsBefore"]) + 1, watchdog
    assert watchdog["MainPID"] != watchdog["FrozenPID"] and watchdog["ActiveState"] == "active", watchdog
    journal = "\n".join(watchdog["Journal"])
    assert "Watchdog timeout" in journal and "Failed with result 'watchdog'" in journal, journal
    waited = float(watchdog["RestartedAt"]) - float(watchdog["FrozenAt"])
    # the last ping came 0-15 s before the SIGSTOP (the daemon pings at half of WatchdogSec=30), then RestartSec=5
    assert 15 <= waited < 90, f"{waited:.0f} s from SIGSTOP to a running daemon again"
    after = vm_run["answers"]["after-watchdog"]
    assert not not_only(2, after), f"the restarted daemon answers, on the committed v2: {after}"


def test_systemctl_stop_ends_it_cleanly(vm_run: dict[str, Any]) -> None:
    stopped = vm_run["facts"]["stopped"]
    assert stopped["ActiveState"] == "inactive" and stopped["Result"] == "success", stopped
    assert stopped["ExecMainCode"] == "1" and stopped["ExecMainStatus"] == "0", f"exited with 0, not killed: {stopped}"
    assert float(stopped["StopEnded"]) - float(stopped["StopBegan"]) < 30, "within TimeoutStopSec, no SIGKILL"
    said = vm_run["answers"]["offline-at-stop"]
    assert said == {"said": [1]}, f"no offline at the stop: {vm_run['availability']}"


def test_a_reboot_brings_it_back_on_its_committed_version(vm_run: dict[str, Any]) -> None:
    assert vm_run["boots"] == 2 and vm_run["status"] == 0, vm_run["output"]
    boot2 = vm_run["facts"]["boot2"]
    assert boot2["Enabled"] == "enabled" and boot2["ActiveState"] == "active", boot2
    journal = "\n".join(boot2["Journal"])
    assert "starting on the committed v2" in journal, journal
    after = vm_run["answers"]["after-reboot"]
    assert not not_only(2, after), f"after the reboot, v2 answers: {after}"
