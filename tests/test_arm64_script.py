"""``scripts/arm64.sh``, the emulated Pi: the emulator it uses, the core it pins, the host's files and loopback seen
from inside, and what ``edgeline doctor`` says there.

The first call builds the emulated userland and the device install under build/arm64 (minutes; cached after).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARM64 = REPO / "scripts" / "arm64.sh"
BUILD_TIMEOUT = 1200  # the first call builds everything: pip runs emulated
RUN_TIMEOUT = 300

pytestmark = pytest.mark.emulated

CORES = {"cortex-a72": "0xd08", "cortex-a76": "0xd0b", "cortex-a55": "0xd05"}


def arm64(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ARM64), *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )


@pytest.fixture(scope="module")
def info() -> dict[str, object]:
    done = arm64("--info", timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def copy_of_the_tree(to: Path) -> Path:
    """The repository's files (git's list, as they are in the work tree): a clone of this tree elsewhere."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    for name in listed.stdout.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def test_another_clone_takes_the_installs_dependencies_from_the_cache(tmp_path: Path) -> None:
    """What the emulated pip installs for edgeline (minutes) is made once per content in EDGELINE_ARM64_CACHE:
    another clone asking the same takes it, and installs only edgeline, from its own tree, over it. Shown with the
    tflite-runtime install (the device install adds ExecuTorch's runtime, a minute more of emulated pip)."""
    own = arm64("--tflite-runtime", "--info", timeout=BUILD_TIMEOUT)  # this tree's, made if missing
    assert own.returncode == 0, own.stderr
    packages = json.loads(own.stdout.strip().splitlines()[-1])["packages"]
    cache = Path(os.environ.get("EDGELINE_ARM64_CACHE") or REPO / "build" / "arm64")
    clone = copy_of_the_tree(tmp_path / "clone")
    script = ["bash", str(clone / "scripts" / "arm64.sh"), "--tflite-runtime"]
    env = {**os.environ, "EDGELINE_ARM64_CACHE": str(cache)}
    done = subprocess.run([*script, "--info"], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
                          cwd=clone, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"installing edgeline from {clone} into the emulated venv-tflite install" in done.stderr, done.stderr
    assert "installing edgeline's dependencies" not in done.stderr, done.stderr  # this tree's install made them
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["install"] == str(clone / "build" / "arm64" / "venv-tflite") and found["packages"] == packages
    code = "import edgeline, numpy, tflite_runtime.interpreter; print(edgeline.__file__); print(numpy.__file__)"
    where = subprocess.run([*script, "python", "-c", code], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                           check=False, cwd=clone, env=env)  # fmt: skip
    assert where.returncode == 0, where.stderr
    edgeline, numpy = map(Path, where.stdout.split())
    assert edgeline.is_relative_to(clone) and numpy.is_relative_to(cache), where.stdout


def test_the_emulator_is_qemu_user_10_and_the_install_is_the_device_one(info: dict[str, object]) -> None:
    assert re.match(r"qemu-aarch64 version 10\.", str(info["qemu"])), info["qemu"]
    assert info["machine"] == "aarch64" and info["cpu"] == "cortex-a72"
    packages = info["packages"]
    assert isinstance(packages, dict)
    assert {"edgeline", "ai-edge-litert", "onnxruntime", "numpy"} <= set(packages)
    done = arm64("python", "-c", "import importlib.util as u; print(u.find_spec('torch'))")
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr  # the base install: no torch


@pytest.mark.parametrize("cpu", sorted(CORES))
def test_the_core_is_pinned(info: dict[str, object], cpu: str) -> None:
    done = arm64("--cpu", cpu, "cat", "/proc/cpuinfo")
    assert done.returncode == 0, done.stderr
    parts = set(re.findall(r"CPU part\s*:\s*(0x[0-9a-f]+)", done.stdout))
    assert parts == {CORES[cpu]}, done.stdout[:400]
    features = set(re.search(r"Features\s*:(.*)", done.stdout).group(1).split())  # type: ignore[union-attr]
    # qemu's default (-cpu max) would show these; none of the three cores has them
    assert not features & {"sve", "sve2", "sme", "i8mm", "bf16"}, features
    assert ("asimddp" in features) is (cpu != "cortex-a72")  # dotprod: Armv8.2 (A76, A55), not the A72


def test_an_unknown_core_is_refused(info: dict[str, object]) -> None:
    done = arm64("--cpu", "max", "uname", "-m")
    assert done.returncode == 2 and "--cpu max: choose cortex-a72" in done.stderr


def test_host_files_are_seen_at_their_paths(info: dict[str, object], tmp_path: Path) -> None:
    path = tmp_path / "deep" / "sample.txt"
    path.parent.mkdir()
    path.write_text("from the host\n")
    done = arm64(
        "python", "-c", f"import pathlib, platform; print(platform.machine(), pathlib.Path({str(path)!r}).read_text())"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["aarch64", "from", "the", "host"]
    written = tmp_path / "from-arm64.txt"
    assert arm64("python", "-c", f"open({str(written)!r}, 'w').write('hi')").returncode == 0
    assert written.read_text() == "hi"


def test_the_hosts_loopback_is_reachable(info: dict[str, object]) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(RUN_TIMEOUT)
    port = server.getsockname()[1]
    got: list[bytes] = []

    def accept() -> None:
        with server, server.accept()[0] as conn:
            conn.settimeout(RUN_TIMEOUT)
            got.append(conn.recv(64))
            conn.sendall(b"pong")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (
        f"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=60); s.sendall(b'ping'); "
        "print(s.recv(64).decode())"
    )
    done = arm64("python", "-c", code)
    thread.join(timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "pong", done.stderr
    assert got == [b"ping"]


def test_doctor_under_emulation_says_so_and_names_the_core(info: dict[str, object]) -> None:
    done = arm64("--cpu", "cortex-a72", "edgeline", "doctor", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    machine = report["machine"]
    assert machine["arch"] == "aarch64" and machine["cores"] == ["Cortex-A72"]
    assert machine["emulated"].startswith("qemu-user 10.") and "-cpu cortex-a72" in machine["emulated"]
    assert machine["features"]["neon"] and not machine["features"]["dotprod"] and not machine["features"]["sve"]
    assert report["profiles"]["matches"] == []  # an emulator is never the device
    assert report["profiles"]["emulates"] == ["rpi4"]
    assert report["runtimes"]["litert"]["imports"] and report["runtimes"]["onnxruntime"]["imports"]
    executorch = report["runtimes"]["executorch"]  # the torch-free runtime: the device install has no torch
    assert executorch["kind"] == "torch-free" and executorch["imports"], executorch
    assert "XnnpackBackend" in executorch["delegates"] and executorch["fallback"] is None
    assert "litert int8-static" in report["profiles"]["runs"]["rpi4"]


def test_doctor_on_a_bundle_under_emulation_refuses_what_the_pi_lacks(
    info: dict[str, object], built_litert_bundle: Path, tmp_path: Path
) -> None:
    runs = arm64("--cpu", "cortex-a76", "edgeline", "doctor", str(built_litert_bundle), "--json")
    assert runs.returncode == 0, runs.stderr
    verdict = json.loads(runs.stdout)
    assert verdict["runs"] and verdict["backend"] == "litert" and verdict["accelerator"] is None
    assert verdict["emulated"].startswith("qemu-user 10.") and verdict["device"] is not None
    assert "-cpu cortex-a76" in verdict["device"]  # rpi5's core, emulated: still not the device
    # the same bundle asked of a runtime the emulated Pi lacks: refused by doctor (1) and by verify (2)
    refused = arm64("edgeline", "doctor", str(built_litert_bundle), "--backend", "tflite-runtime")
    assert refused.returncode == 1 and "its runtime tflite-runtime is not installed here" in refused.stdout
    verify = arm64("edgeline", "verify", str(built_litert_bundle), "--backend", "tflite-runtime")
    assert verify.returncode == 2 and "cannot run here: its runtime tflite-runtime is not installed" in verify.stderr
    assert "Traceback" not in verify.stderr


TAKE_UPDATE = """
import json, sys
from pathlib import Path
from edgeline.errors import UpdateRefused
from edgeline.model import load
from edgeline.updates.client import UpdateClient
from edgeline.verify import golden_check
repo, root, work = sys.argv[1:4]
client = UpdateClient(repo, Path(root), Path(work))
choice, updater = client.check(name="tiny", device="pi", running=1)
offer = client.offer(updater, choice.take)
try:
    archive = client.fetch(updater, offer)
except UpdateRefused as exc:
    print(json.dumps({"refused": exc.reason}))
    raise SystemExit(0)
bundle = client.unpack(archive, offer, Path(work) / "v2")
print(json.dumps({"version": bundle.manifest.version, "golden": golden_check(load(bundle.path))["ok"]}))
"""


def test_the_emulated_pi_verifies_and_opens_a_signed_update(info: dict[str, object], tmp_path: Path) -> None:
    """python-tuf and cryptography's ed25519 on the Pi's own wheels: the signed v2 is taken and passes its
    self-test; the same archive with one byte changed is refused as tampered."""
    from tests.update_repo import UpdateRepo

    repo = UpdateRepo(tmp_path / "updates")
    published = repo.publish(2)
    script = tmp_path / "take.py"
    script.write_text(TAKE_UPDATE)
    runs = arm64("python", str(script), str(repo.directory), str(repo.trusted_root), str(tmp_path / "pi"))
    assert runs.returncode == 0, runs.stderr
    assert json.loads(runs.stdout.strip().splitlines()[-1]) == {"version": 2, "golden": True}
    data = bytearray(published.archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    published.archive.write_bytes(bytes(data))
    runs = arm64("python", str(script), str(repo.directory), str(repo.trusted_root), str(tmp_path / "pi-2"))
    assert runs.returncode == 0, runs.stderr
    assert json.loads(runs.stdout.strip().splitlines()[-1]) == {"refused": "tampered"}


RUN_PTE = """
import json, sys
from pathlib import Path
import numpy as np
from edgeline.model import load
answers = {}
for bundle in map(Path, sys.argv[1:]):
    model = load(bundle, threads=1)
    golden = np.load(bundle / "golden.npz")
    inputs = [golden[k] for k in sorted(k for k in golden.files if k.startswith("input_"))]
    outputs = [model.predict(*(x[i] for x in inputs))[0] for i in range(len(inputs[0]))]
    answers[bundle.name] = {"runtime": model.runtime, "outputs": np.concatenate(outputs).tolist()}
print(json.dumps(answers))
"""


@pytest.mark.parametrize("cpu", ["cortex-a72", "cortex-a76"])
def test_the_torch_free_executorch_runs_on_the_pis_cores_as_the_python_runtime_does(
    info: dict[str, object], cpu: str, tmp_path: Path
) -> None:
    """The aarch64 libraries carry dot-product and matrix-multiply paths a Pi 4 lacks: they must pick what the core
    has (no SIGILL) and answer as ExecuTorch's Python runtime did on x86-64: int8 bit for bit; fp32 within float
    rounding (aarch64's kernels fuse multiply-adds the x86 ones do not)."""
    import numpy as np

    from tests.tiny_bundle import COMMITTED_PTE_BUNDLES, PYTHON_RUNTIME_OUTPUTS

    script = tmp_path / "run_pte.py"
    script.write_text(RUN_PTE)
    done = arm64("--cpu", cpu, "python", str(script), *map(str, COMMITTED_PTE_BUNDLES.values()))
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    reference = np.load(PYTHON_RUNTIME_OUTPUTS)
    for name, answer in answers.items():
        assert answer["runtime"] == "torch-free"
        found, expected = np.array(answer["outputs"], np.float32), reference[f"{name}/output_0"]
        if "int8" in name:
            assert np.array_equal(found, expected), f"{name} on {cpu}: max |diff| {np.abs(found - expected).max()}"
        else:
            np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6, err_msg=f"{name} on {cpu}")
