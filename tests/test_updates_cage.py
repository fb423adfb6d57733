"""A new version is opened in a cage (``edgeline.updates.cage``): signed bundles whose model crashes, hangs or bloats
its runtime (``tests.hostile_models``), and golden files that lie about their size, against the cage alone and
against `edgeline run --updates` as its own process with a real Mosquitto.

Each hostile version, before the cage: a SIGSEGV loop the device never counted, an update thread wedged for good, a
GiB inflated inside the daemon. After: a refusal with its reason, the device answering throughout.
"""

from __future__ import annotations

import json
import os
import re
import resource
import zipfile
from pathlib import Path

import numpy as np
import pytest

from edgeline.errors import BundleError
from edgeline.manifest import Golden, TensorSpec
from edgeline.samples import read_golden
from edgeline.updates.cage import CageLimits, open_caged
from edgeline.updates.policy import Gates
from tests.faults import DurableCollector, DurablePublisher
from tests.mqtt_broker import Broker
from tests.test_daemon_durability import inputs, missing_answers, publish_in_background
from tests.test_updates_daemon import (
    TIMEOUT_S,
    UpdatingDaemon,
    daemon,
    repo,
    started_on,
    status_when,
    ten_more_answered_by,
    versions_by_id,
)
from tests.update_repo import UpdateRepo, versioned

__all__ = ["daemon", "repo"]  # fixtures

MiB = 2**20


def _process_alive(needle: str) -> list[int]:
    """Processes whose command line holds ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


# -- the cage alone ----------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.device
def test_a_version_that_crashes_its_runtime_is_judged_crashed_saying_where(tmp_path: Path) -> None:
    bundle = versioned(tmp_path / "v2", 2, hostile="recursive")
    caged = open_caged(bundle, backend=None, max_batch=8, limits=CageLimits(60, 512 * MiB))
    assert (caged.ok, caged.reason) == (False, "crashed"), caged
    assert "SIGSEGV" in caged.message and "allocate_tensors" in caged.message, caged.message


@pytest.mark.integration
@pytest.mark.device
def test_a_version_that_never_answers_is_judged_hung_at_its_deadline_and_leaves_no_process(tmp_path: Path) -> None:
    bundle = versioned(tmp_path / "v2", 2, hostile="endless")
    caged = open_caged(bundle, backend=None, max_batch=8, limits=CageLimits(3, 512 * MiB))
    assert (caged.ok, caged.reason) == (False, "hung"), caged
    assert "within 3 s" in caged.message
    assert not _process_alive(str(bundle)), "the child and its group were killed"


@pytest.mark.integration
@pytest.mark.device
def test_a_version_that_takes_more_memory_than_it_may_is_judged_too_big_and_never_takes_it(tmp_path: Path) -> None:
    bundle = versioned(tmp_path / "v2", 2, golden_rows=800_000)  # 237 MB of golden arrays, a 64 MiB cap
    caged = open_caged(bundle, backend=None, max_batch=8, limits=CageLimits(60, 64 * MiB))
    assert (caged.ok, caged.reason) == (False, "too-big"), caged
    assert caged.peak_rss_bytes is not None and caged.peak_rss_bytes < 200 * MiB
    huge = versioned(tmp_path / "v3", 3, hostile="huge")  # a 1 GiB tensor in its arena
    caged = open_caged(huge, backend=None, max_batch=8, limits=CageLimits(60, 128 * MiB))
    assert not caged.ok and caged.reason in ("too-big", "malformed"), caged
    assert caged.peak_rss_bytes is not None and caged.peak_rss_bytes < 400 * MiB, "the GiB was never taken"


@pytest.mark.integration
@pytest.mark.device
def test_a_good_version_passes_its_cage_with_its_golden_figures(tmp_path: Path) -> None:
    bundle = versioned(tmp_path / "v2", 2)
    caged = open_caged(bundle, backend=None, max_batch=8, limits=CageLimits(60, 512 * MiB))
    assert caged.ok and caged.reason is None, caged
    assert caged.golden is not None and caged.golden["ok"] is True and caged.golden["samples"] == 8
    broken = versioned(tmp_path / "v3", 3, break_golden=True)
    caged = open_caged(broken, backend=None, max_batch=8, limits=CageLimits(60, 512 * MiB))
    assert (caged.ok, caged.reason) == (False, "self-test") and "8 of 8 samples off" in caged.message, caged


# -- golden.npz, member by member --------------------------------------------------------------------------------

SPEC_IN = TensorSpec(name="x", dtype="float32", shape=(1, 1, 8, 8))
SPEC_OUT = TensorSpec(name="y", dtype="float32", shape=(1, 10))
GOLDEN = Golden(samples=8, atol=(0.01,))


def _golden(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _good() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"input_0": rng.random((8, 1, 8, 8), np.float32), "output_0": rng.random((8, 10), np.float32)}


@pytest.mark.quick
def test_golden_arrays_are_read_as_the_manifest_says_and_nothing_else_is_inflated(tmp_path: Path) -> None:
    path = _golden(tmp_path / "golden.npz", **_good())
    from tests.update_repo import _add_zeros

    _add_zeros(path, {"extra": (64 * MiB // 4,)})  # 64 MiB of zeros nobody asked for
    assert path.stat().st_size < MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (inputs_, outputs_) = read_golden(path, GOLDEN, [SPEC_IN], [SPEC_OUT])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 32 * MiB, f"{grown / MiB:.0f} MiB: the extra member was inflated"
    np.testing.assert_array_equal(inputs_[0], _good()["input_0"])
    np.testing.assert_array_equal(outputs_[0], _good()["output_0"])


@pytest.mark.quick
@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"input_0": np.zeros((8, 1, 8, 9), np.float32)},
            "input_0: shape [8, 1, 8, 9], the manifest says [8, 1, 8, 8]",
        ),
        ({"output_0": np.zeros((800, 10), np.float32)}, "output_0: shape [800, 10], the manifest says [8, 10]"),
        ({"output_0": np.zeros((8, 10), np.complex64)}, "output_0: dtype complex64"),
        ({"input_0": np.zeros((8, 1, 8, 8), "U4")}, "input_0: dtype <U4"),
        ({"output_0": None}, "lacks output_0"),
    ],
)
def test_a_golden_member_unlike_the_manifest_is_refused_naming_it(
    tmp_path: Path, change: dict[str, np.ndarray | None], says: str
) -> None:
    arrays = {**_good(), **change}
    path = _golden(tmp_path / "golden.npz", **{k: v for k, v in arrays.items() if v is not None})
    with pytest.raises(BundleError, match=re.escape(says)):
        read_golden(path, GOLDEN, [SPEC_IN], [SPEC_OUT])


@pytest.mark.quick
def test_a_golden_member_whose_data_ends_early_or_whose_file_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "golden.npz"
    good = _good()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("input_0.npy", _npy(good["input_0"])[:-100])  # its header says more than it holds
        archive.writestr("output_0.npy", _npy(good["output_0"]))
    with pytest.raises(BundleError, match=r"input_0: .* bytes \(the member ends early\)"):
        read_golden(path, GOLDEN, [SPEC_IN], [SPEC_OUT])
    path.write_bytes(b"not a zip" * 10)
    with pytest.raises(BundleError, match=r"not a readable \.npz file"):
        read_golden(path, GOLDEN, [SPEC_IN], [SPEC_OUT])
    too_many = Golden(samples=2_000_000, atol=(0.01,))
    _golden(path, **_good())
    with pytest.raises(BundleError, match="shape"):
        read_golden(path, too_many, [SPEC_IN], [SPEC_OUT])


def _npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.mark.quick
def test_a_golden_larger_than_any_device_takes_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = TensorSpec(name="x", dtype="float32", shape=(1, 3, 1024, 1024))
    golden = Golden(samples=32, atol=(0.01,))  # 32 x 12 MiB: more than GOLDEN_MAX_BYTES
    path = tmp_path / "golden.npz"
    from tests.update_repo import _add_zeros

    _add_zeros(path, {"input_0": (32, 3, 1024, 1024)})
    with pytest.raises(BundleError, match=r"come to more than 256 MiB \(at input_0\)"):
        read_golden(path, golden, [big], [SPEC_OUT])


# -- the daemon ----------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.device
@pytest.mark.parametrize(("hostile", "reason"), [("recursive", "crashed"), ("endless", "hung")])
def test_a_version_that_crashes_or_hangs_is_refused_once_while_the_device_answers_and_a_later_one_is_taken(
    repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher, answers: DurableCollector,
    unique_topic: str, tmp_path: Path, hostile: str, reason: str,
) -> None:  # fmt: skip
    daemon = UpdatingDaemon(repo, durable_broker, unique_topic, tmp_path / "state", updates="open_timeout_s = 5\n")
    try:
        daemon.start(durable_broker)
        pid = daemon.process.pid if daemon.process else None
        messages = inputs(f"{unique_topic}/sensors/cam0/image", 300)
        sender = publish_in_background(publisher, messages, rate=30.0)
        repo.publish(2, hostile=hostile)
        daemon.wait_logged(f"update refused ({reason})")
        sender.join(TIMEOUT_S)
        assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages})
        assert {v[0] for v in versions_by_id(answers).values()} == {1}, "v2 never answered"
        assert daemon.process is not None and daemon.process.poll() is None and daemon.process.pid == pid
        state = daemon.update_state()
        assert state["refused"]["2"]["reason"] == reason and state["trying"] is None, state
        update = status_when(durable_broker, daemon, lambda s: reason in s["update"]["refusals"], "the refusal")
        assert update["update"]["refusals"] == {reason: 1}
        repo.publish(3, gates=Gates(inputs=20, seconds=120))  # the update thread is not wedged: v3 is taken
        daemon.wait_logged("v3 answers from now on")
        trial = inputs(f"{unique_topic}/sensors/cam0/image", 40, prefix="trial")
        publisher.publish_all(trial)
        daemon.wait_logged("v3 committed")
        assert ten_more_answered_by(publisher, answers, unique_topic, "late") == {3}
        assert daemon.log_text().count("v2 found") == 1, "a refused version is not fetched again"
    finally:
        daemon.kill()


@pytest.mark.integration
@pytest.mark.device
def test_a_golden_with_a_gib_more_inside_costs_the_daemon_nothing(
    daemon: UpdatingDaemon, repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher,
    answers: DurableCollector, unique_topic: str,
) -> None:  # fmt: skip
    daemon.start(durable_broker)
    assert daemon.process is not None
    daemon.wait_logged("edgeline run: tiny v1")
    before = _vm_hwm(daemon.process.pid)
    repo.publish(2, golden_zeros={"extra": (2**28,)}, gates=Gates(inputs=20, seconds=120))
    messages = inputs(f"{unique_topic}/sensors/cam0/image", 100)
    sender = publish_in_background(publisher, messages, rate=20.0)
    daemon.wait_logged("v2 committed")
    sender.join(TIMEOUT_S)
    assert not missing_answers(answers, {json.loads(p)["id"] for _, p in messages})
    grown = _vm_hwm(daemon.process.pid) - before
    assert grown < 128 * MiB, f"the daemon's peak memory grew by {grown / MiB:.0f} MiB"


@pytest.mark.integration
@pytest.mark.device
def test_without_the_cage_a_version_that_kills_the_daemon_as_it_opens_is_refused_after_two_deaths(
    repo: UpdateRepo, durable_broker: Broker, publisher: DurablePublisher, answers: DurableCollector,
    unique_topic: str, tmp_path: Path,
) -> None:  # fmt: skip
    """The attempt is recorded before the daemon itself opens a version: a death in any phase counts."""
    daemon = UpdatingDaemon(repo, durable_broker, unique_topic, tmp_path / "state", updates="cage = false\n")
    try:
        daemon.start(durable_broker)
        repo.publish(2, hostile="recursive")
        for start in (1, 2):
            assert daemon.process is not None
            assert daemon.process.wait(TIMEOUT_S) == -11, "the daemon itself dies opening v2"
            assert daemon.update_state()["trying"] == {"version": 2, "attempts": start}
            daemon.start(durable_broker)
            assert started_on(daemon, start + 1) == 1
        daemon.wait_logged("the process ended 2 times during its trial")
        state = daemon.update_state()
        assert state["refused"]["2"]["reason"] == "trial" and state["trying"] is None, state
        assert ten_more_answered_by(publisher, answers, unique_topic, "after") == {1}
        assert daemon.process is not None and daemon.process.poll() is None
        assert os.path.isdir(daemon.state)
    finally:
        daemon.kill()
