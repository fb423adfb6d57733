"""ExecuTorch without torch: the executorch wheel's C++ runtime through edgeline's shim (edgeline.executorch_native).

The device tier (no torch) runs the committed ExecuTorch bundles (fp32 and int8 XNNPACK, a model of two inputs) and
compares every output, bit for bit, with what ExecuTorch's Python runtime answered on the same inputs
(tests/data/executorch_python_outputs.npz); the workstation tier checks that file is still what the Python runtime
answers today, and compares the two runtimes side by side on inputs nobody committed, batches included.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import edgeline
from edgeline.backends.executorch import RUNTIME_CHOICE, ExecuTorchSession, NativeSession
from edgeline.doctor import Facts, RuntimeFacts, verdict
from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.executorch_native import (
    DELEGATE_LIBRARIES,
    EXECUTORCH_VERSION,
    RUNTIME_LIBRARIES,
    NativeRuntime,
    compiler,
    install,
    runtimes,
)
from edgeline.machine import this_machine
from edgeline.model import load
from tests.tiny_bundle import COMMITTED_PTE_BUNDLES, PYTHON_RUNTIME_OUTPUTS

pytestmark = pytest.mark.device

BLOCK_TORCH = "import sys; sys.modules.update(dict.fromkeys(('torch', 'executorch', 'torchao')))\n"
"""Prefixed to a subprocess's code: the export extra's packages fail to import, as on a device."""


def golden_inputs(bundle: Path) -> list[np.ndarray]:
    golden = np.load(bundle / "golden.npz")
    return [golden[name] for name in sorted(k for k in golden.files if k.startswith("input_"))]


def one_by_one(run: object, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """``run`` (a session's) on each sample in turn, outputs stacked."""
    answers = [run([x[i : i + 1].copy() for x in inputs]) for i in range(len(inputs[0]))]  # type: ignore[operator]
    return [np.concatenate([answer[j] for answer in answers]) for j in range(len(answers[0]))]


def edgeline_cli(
    *args: str, env: dict[str, str] | None = None, block_torch: bool = True
) -> subprocess.CompletedProcess[str]:
    code = (BLOCK_TORCH if block_torch else "") + "from edgeline.cli import main; sys.exit(main(sys.argv[1:]))"
    if not block_torch:
        code = "import sys\n" + code
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


# -- the device tier: no torch ------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize("name", list(COMMITTED_PTE_BUNDLES))
def test_the_torch_free_runtime_answers_as_the_python_runtime_did(name: str) -> None:
    """Every output of every golden sample equal, bit for bit (the same kernels, the same delegate)."""
    bundle = COMMITTED_PTE_BUNDLES[name]
    reference = np.load(PYTHON_RUNTIME_OUTPUTS)
    session = NativeSession(bundle / "model.pte")
    found = one_by_one(session.run, golden_inputs(bundle))
    for j, output in enumerate(found):
        expected = reference[f"{name}/output_{j}"]
        assert output.dtype == expected.dtype and output.shape == expected.shape
        assert np.array_equal(output, expected), f"{name} output {j}: max |diff| {np.abs(output - expected).max()}"


@pytest.mark.quick
@pytest.mark.parametrize("name", list(COMMITTED_PTE_BUNDLES))
def test_a_pte_bundle_loads_on_the_torch_free_runtime_and_passes_its_self_test(name: str) -> None:
    model = load(COMMITTED_PTE_BUNDLES[name])
    assert model.runtime == "torch-free"
    assert model.accelerator == "xnnpack" and model.accelerator_fallback is None
    inputs = golden_inputs(COMMITTED_PTE_BUNDLES[name])
    answers = [model.predict(*(x[i] for x in inputs)) for i in range(len(inputs[0]))]
    golden = np.load(COMMITTED_PTE_BUNDLES[name] / "golden.npz")
    assert np.array_equal(np.concatenate([a[0] for a in answers]), golden["output_0"])


@pytest.mark.quick
def test_doctor_names_the_torch_free_runtime_its_version_and_delegates() -> None:
    done = edgeline_cli("doctor", "--json")
    assert done.returncode == 0, done.stderr
    executorch = json.loads(done.stdout)["runtimes"]["executorch"]
    assert executorch["kind"] == "torch-free" and executorch["imports"] is True, executorch
    assert executorch["version"].split("+")[0] == EXECUTORCH_VERSION
    assert "XnnpackBackend" in executorch["delegates"]
    text = edgeline_cli("doctor")
    line = next(line for line in text.stdout.splitlines() if line.strip().startswith("executorch"))
    assert "torch-free C++ runtime" in line and "XnnpackBackend" in line


@pytest.mark.quick
def test_the_thread_pool_is_sized_through_the_functions_the_shim_looks_up() -> None:
    """The wheel ships no header for ExecuTorch's thread pool: the shim finds its functions by their C++ names. When
    a new ExecuTorch renames them, this fails (the runtime would keep its own pool size, said as None)."""
    runtime = NativeRuntime.get()
    assert runtime.set_threads(2) == 2
    assert runtime.set_threads(1) == 1


@pytest.mark.quick
def test_a_broken_program_is_one_line_naming_the_file(tmp_path: Path) -> None:
    for label, data in {
        "garbage": b"\x00not a program" * 50,
        "truncated": (COMMITTED_PTE_BUNDLES["tiny-pte-int8"] / "model.pte").read_bytes()[:600],
        "empty": b"",
    }.items():
        path = tmp_path / f"{label}.pte"
        path.write_bytes(data)
        with pytest.raises(BundleError) as caught:
            NativeSession(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: ExecuTorch could not load the program: ") and "\n" not in message


@pytest.mark.quick
def test_a_wrong_input_is_refused_by_the_runtime_with_its_reason() -> None:
    session = NativeSession(COMMITTED_PTE_BUNDLES["tiny-pte-int8"] / "model.pte")
    with pytest.raises(RuntimeError, match=r"input 0 was refused \(runtime said: Attempted to resize a static tensor"):
        session.run([np.zeros((1, 1, 8, 9), np.float32)])
    with pytest.raises(ValueError, match="float64, the program takes float32"):
        session.run([np.zeros((1, 1, 8, 8), np.float64)])
    # and the session still answers
    assert session.run([np.zeros((1, 1, 8, 8), np.float32)])[0].shape == (1, 10)


def _facts(**executorch: object) -> Facts:
    runtime = RuntimeFacts(**{"version": "1.5.1+cpu", "imports": True, "kind": "torch-free", **executorch})  # type: ignore[arg-type]
    return Facts(system="Linux", machine=this_machine(), runtimes={"executorch": runtime})


@pytest.mark.quick
def test_the_verdict_refuses_a_missing_delegate_or_an_old_runtime_before_the_program_is_opened() -> None:
    bundle = edgeline.read_bundle(COMMITTED_PTE_BUNDLES["tiny-pte-int8"])
    files = {entry.path for entry in bundle.manifest.files}
    runs = verdict(bundle.manifest, files, _facts(delegates=("XnnpackBackend",)))
    assert runs.runs and "the torch-free ExecuTorch runtime 1.5.1+cpu with its XnnpackBackend delegate" in runs.reason
    lacking = verdict(bundle.manifest, files, _facts(delegates=("QnnBackend",)))
    assert not lacking.runs
    assert lacking.reason == (
        "the program is delegated to XnnpackBackend, which the torch-free ExecuTorch runtime 1.5.1+cpu lacks "
        "(it has: QnnBackend)"
    )
    old = verdict(bundle.manifest, files, _facts(version="1.4.0", delegates=("XnnpackBackend",)))
    assert not old.runs and old.reason == "it needs executorch >= 1.5.1; this machine has 1.4.0"
    python = verdict(bundle.manifest, files, _facts(kind="python", delegates=("XnnpackBackend",)))
    assert python.runs and "imports torch" in python.reason


@pytest.mark.quick
def test_a_pte_bundle_runs_through_infer_without_torch(tmp_path: Path) -> None:
    bundle = COMMITTED_PTE_BUNDLES["pair-pte-int8"]
    inputs = golden_inputs(bundle)
    np.savez(tmp_path / "pair.npz", image=inputs[0], mask=inputs[1])
    done = edgeline_cli("infer", str(bundle), "--input", str(tmp_path / "pair.npz"), "--json")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    reference = np.load(PYTHON_RUNTIME_OUTPUTS)["pair-pte-int8/output_0"]
    assert np.array_equal(np.array([record["outputs"][0][0] for record in records], np.float32), reference)


# -- installing the runtime ---------------------------------------------------------------------------------------


def the_runtime() -> Path:
    """The directory of the runtime this environment uses (a device's install, or the workstation's wheel)."""
    found = runtimes()
    assert found, "no ExecuTorch C++ runtime here: scripts/test_device.sh installs one (edgeline doctor --install)"
    return found[0].root


def make_wheel(path: Path, *, extra: dict[str, bytes] | None = None, leave_out: str | None = None) -> Path:
    """A wheel-shaped zip of this environment's runtime: what ``pip download executorch --no-deps`` gives, less the
    Python parts (the installer takes nothing else)."""
    root = the_runtime()
    with zipfile.ZipFile(path, "w") as archive:
        for name in (*RUNTIME_LIBRARIES, *DELEGATE_LIBRARIES.values()):
            library = root / "lib" / f"{name}.so"
            if library.is_file() and name != leave_out:
                archive.write(library, f"executorch/lib/{name}.so")
        for header in (root / "include").rglob("*.h"):
            archive.write(header, f"executorch/{header.relative_to(root)}")
        archive.write(root / "version.py", "executorch/version.py")
        for member, data in (extra or {}).items():
            archive.writestr(member, data)
    return path


@pytest.mark.integration
def test_install_from_a_wheel_then_run_a_bundle_without_torch(tmp_path: Path) -> None:
    """``edgeline doctor --install executorch --from WHEEL`` into a directory of its own; a fresh process, torch
    blocked, then finds it there, builds nothing more, and runs a bundle."""
    home = tmp_path / "executorch"
    env = {"EDGELINE_EXECUTORCH_HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    wheel = make_wheel(tmp_path / "executorch-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl")
    done = edgeline_cli("doctor", "--install", "executorch", "--from", str(wheel), "--json", env=env)
    assert done.returncode == 0, done.stderr
    installed = json.loads(done.stdout)
    assert installed["installed"] == str(home) and "XnnpackBackend" in installed["delegates"]
    assert Path(installed["shim"]).is_relative_to(home)
    assert sorted(p.name for p in (home / "lib").iterdir()) == sorted(
        f"{name}.so" for name in (*RUNTIME_LIBRARIES, "libexecutorch_backend_xnnpack")
    )
    doctor = json.loads(edgeline_cli("doctor", "--json", env=env).stdout)["runtimes"]["executorch"]
    assert doctor["location"] == f"{home} (EDGELINE_EXECUTORCH_HOME)" and doctor["imports"] is True
    bundle = COMMITTED_PTE_BUNDLES["tiny-pte-fp32"]
    golden = np.load(bundle / "golden.npz")
    np.savez(tmp_path / "x.npz", image=golden["input_0"])
    ran = edgeline_cli("infer", str(bundle), "--input", str(tmp_path / "x.npz"), "--json", env=env)
    assert ran.returncode == 0, ran.stderr
    outputs = np.array([json.loads(line)["outputs"][0][0] for line in ran.stdout.splitlines()], np.float32)
    assert np.array_equal(outputs, np.load(PYTHON_RUNTIME_OUTPUTS)["tiny-pte-fp32/output_0"])
    assert not (tmp_path / "cache" / "edgeline").exists(), "the shim built at install was not the one used"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("extra", "leave_out", "said"),
    [
        ({"executorch/include/../../../../escaped.h": b"x"}, None, "escapes the package"),
        ({}, "libexecutorch", "carries no executorch/lib/libexecutorch.so"),
        ({}, "libexecutorch_kernels_optimized", "incomplete: no"),
    ],
    ids=["path-escape", "no-runtime", "no-kernels"],
)
def test_a_bad_wheel_is_refused_and_the_runtime_installed_before_stays(
    tmp_path: Path, extra: dict[str, bytes], leave_out: str | None, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path / "bad.whl", extra=extra, leave_out=leave_out)
    home = tmp_path / "executorch"
    home.mkdir()
    (home / "version.py").write_text('__version__ = "1.0.0"\n')
    monkeypatch.setenv("EDGELINE_EXECUTORCH_HOME", str(home))
    with pytest.raises(BackendUnavailableError, match=said):
        install(source=wheel, say=lambda line: None)
    assert sorted(p.name for p in home.iterdir()) == ["version.py"], "the old runtime was touched"
    assert not list(tmp_path.rglob("escaped.h"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".executorch-")] == []


@pytest.mark.quick
def test_a_fifo_or_a_missing_file_given_as_the_wheel_is_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "executorch.whl"
    os.mkfifo(fifo)
    env = {"EDGELINE_EXECUTORCH_HOME": str(tmp_path / "executorch")}
    for source, said in ((fifo, "not an executorch wheel file or package directory"),
                         (tmp_path / "none.whl", "no such file or directory")):  # fmt: skip
        done = edgeline_cli("doctor", "--install", "executorch", "--from", str(source), env=env)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert said in done.stderr
    assert not (tmp_path / "executorch").exists()


@pytest.mark.quick
def test_a_wheel_for_another_machine_is_refused_before_it_replaces_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Pi's wheel copied to an x86 box (or the other way): its libraries' ELF header says so."""
    wheel = make_wheel(tmp_path / "other.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    library = bytearray(members["executorch/lib/libexecutorch.so"])
    ours = int.from_bytes(library[18:20], "little")
    library[18:20] = (183 if ours == 62 else 62).to_bytes(2, "little")
    members["executorch/lib/libexecutorch.so"] = bytes(library)
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    monkeypatch.setenv("EDGELINE_EXECUTORCH_HOME", str(tmp_path / "executorch"))
    with pytest.raises(BackendUnavailableError, match=r"is built for (aarch64|x86-64), this Python for"):
        install(source=wheel, say=lambda line: None)
    assert not (tmp_path / "executorch").exists()


def shimless_runtime(home: Path) -> Path:
    """A copy of this environment's runtime (its libraries, headers and version) at ``home``, no shim built for it."""
    root = the_runtime()
    shutil.copytree(root / "include", home / "include")
    (home / "lib").mkdir()
    for library in (root / "lib").glob("libexecutorch*.so"):
        shutil.copy2(library, home / "lib" / library.name)
    shutil.copy2(root / "version.py", home / "version.py")
    return home


def built_anywhere(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.rglob("libedgeline_executorch.so"))


@pytest.mark.quick
def test_no_compiler_and_no_shim_is_one_line_before_the_bundle_is_opened(tmp_path: Path) -> None:
    """A runtime directory whose shim was never built, on a machine without a C++ compiler: `infer` refuses with
    the reason and the remedy (exit code 2), before parsing the model."""
    home = shimless_runtime(tmp_path / "executorch")
    env = {"EDGELINE_EXECUTORCH_HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": "no-such-c++"}
    bundle = COMMITTED_PTE_BUNDLES["tiny-pte-int8"]
    np.savez(tmp_path / "x.npz", image=np.load(bundle / "golden.npz")["input_0"])
    done = edgeline_cli("infer", str(bundle), "--input", str(tmp_path / "x.npz"), env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "a C++ compiler to build edgeline's shim" in errors[0], done.stderr
    assert "edgeline doctor --install executorch" in errors[0]


@pytest.mark.quick
def test_a_runtime_whose_shim_was_not_built_is_refused_in_one_line_and_nothing_is_compiled(tmp_path: Path) -> None:
    """The shim is built at install, never at first use (it took up to 600 s on a Pi): a runtime without one, a
    compiler at hand, is one line naming the remedy, from `infer` and from the library alike, and nothing is built."""
    home = shimless_runtime(tmp_path / "executorch")
    cxx = compiler()
    assert cxx is not None, "no C++ compiler here: scripts/setup.sh installs g++"
    env = {"EDGELINE_EXECUTORCH_HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": cxx}
    bundle = COMMITTED_PTE_BUNDLES["tiny-pte-int8"]
    np.savez(tmp_path / "x.npz", image=np.load(bundle / "golden.npz")["input_0"])
    done = edgeline_cli("infer", str(bundle), "--input", str(tmp_path / "x.npz"), env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{home} (EDGELINE_EXECUTORCH_HOME) lacks edgeline's shim" in errors[0], done.stderr
    assert "run `edgeline doctor --install executorch`" in errors[0]
    session = (
        "from edgeline.errors import BackendUnavailableError\n"
        "from edgeline.backends.executorch import NativeSession\n"
        "try:\n"
        f"    NativeSession(__import__('pathlib').Path({str(bundle / 'model.pte')!r}))\n"
        "except BackendUnavailableError as exc:\n"
        "    print(exc)\n"
    )
    said = subprocess.run([sys.executable, "-c", BLOCK_TORCH + session], capture_output=True, text=True, timeout=120,
                          check=True, env={**os.environ, **env}).stdout  # fmt: skip
    assert said == (
        f"the torch-free ExecuTorch runtime at {home} (EDGELINE_EXECUTORCH_HOME) lacks edgeline's shim, built for it "
        "at install: run `edgeline doctor --install executorch`\n"
    )
    assert built_anywhere(tmp_path) == [], "a shim was compiled at first use"


@pytest.mark.integration
def test_the_workstation_setup_builds_the_shim_once_and_a_fresh_process_runs_on_it(tmp_path: Path) -> None:
    """scripts/setup.sh builds the shim against the executorch wheel the export extra brought (`build_for_environment`,
    what it runs after pip): once; a second run finds it and says nothing; a process started afterwards runs a bundle
    on it without building anything."""
    home = shimless_runtime(tmp_path / "executorch")
    env = {"EDGELINE_EXECUTORCH_HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    setup = (
        "import sys\n"
        "from edgeline.executorch_native import build_for_environment\n"
        "print(build_for_environment(say=lambda line: print(line, file=sys.stderr)))\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", setup], capture_output=True, text=True, timeout=300, check=True,
                       env={**os.environ, **env})
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0].stderr.startswith(f"building edgeline's ExecuTorch shim against {home} (EDGELINE_EXECUTORCH_HOME)")
    assert runs[1].stderr == "" and runs[0].stdout == runs[1].stdout
    (shim,) = built_anywhere(tmp_path)
    assert Path(runs[0].stdout.strip()) == shim and shim.is_relative_to(home / "edgeline-shim")
    built = shim.stat().st_mtime_ns
    bundle = COMMITTED_PTE_BUNDLES["tiny-pte-fp32"]
    np.savez(tmp_path / "x.npz", image=np.load(bundle / "golden.npz")["input_0"])
    ran = edgeline_cli("infer", str(bundle), "--input", str(tmp_path / "x.npz"), "--json", env=env)
    assert ran.returncode == 0, ran.stderr
    outputs = np.array([json.loads(line)["outputs"][0][0] for line in ran.stdout.splitlines()], np.float32)
    assert np.array_equal(outputs, np.load(PYTHON_RUNTIME_OUTPUTS)["tiny-pte-fp32/output_0"])
    assert built_anywhere(tmp_path) == [shim] and shim.stat().st_mtime_ns == built


# -- the workstation tier: the two runtimes side by side ----------------------------------------------------------


@pytest.mark.export
@pytest.mark.workstation
def test_the_committed_python_runtime_outputs_are_what_it_answers_today() -> None:
    """Regenerate with `python -m tests.tiny_bundle tiny-pte-fp32 tiny-pte-int8 pair-pte-int8`."""
    from tests.tiny_bundle import python_runtime_outputs

    committed = np.load(PYTHON_RUNTIME_OUTPUTS)
    for name, bundle in COMMITTED_PTE_BUNDLES.items():
        for j, output in enumerate(python_runtime_outputs(bundle)):
            assert np.array_equal(committed[f"{name}/output_{j}"], output), f"{PYTHON_RUNTIME_OUTPUTS} is stale"


def python_session(path: Path) -> object:
    from edgeline.backends.executorch import PythonSession

    return PythonSession(path)


@pytest.mark.export
@pytest.mark.workstation
@pytest.mark.parametrize("name", list(COMMITTED_PTE_BUNDLES))
def test_both_runtimes_agree_bit_for_bit_on_inputs_nobody_committed(name: str) -> None:
    bundle = COMMITTED_PTE_BUNDLES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    inputs = [rng.normal(0, 2, size=(32, *x.shape[1:])).astype(np.float32) for x in golden_inputs(bundle)]
    native = one_by_one(NativeSession(bundle / "model.pte").run, inputs)
    python = one_by_one(python_session(bundle / "model.pte").run, inputs)  # type: ignore[attr-defined]
    for a, b in zip(native, python, strict=True):
        assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"


DYNAMIC_BOUND = 16


@pytest.fixture(scope="module")
def dynamic_batch_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A conv + pool + linear program exported with a dynamic batch dimension (1 to 16), delegated to XNNPACK."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch import nn

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1)
            return self.fc(torch.flatten(pooled, 1))

    batch = torch.export.Dim("batch", min=1, max=DYNAMIC_BOUND)
    program = torch.export.export(Pooled().eval(), (torch.rand(2, 3, 8, 8),), dynamic_shapes=({0: batch},))
    lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    path = tmp_path_factory.mktemp("dynamic") / "model.pte"
    path.write_bytes(lowered.buffer)
    return path


@pytest.mark.export
@pytest.mark.workstation
def test_a_program_exported_with_a_dynamic_batch_runs_batches(dynamic_batch_program: Path) -> None:
    session = NativeSession(dynamic_batch_program)
    assert session.input_specs()[0].shape == (1, 3, 8, 8)
    assert session.max_batch is not None and session.max_batch >= DYNAMIC_BOUND - 1
    batched = session.batched(4)
    assert batched is not None and batched.input_specs()[0].shape == (4, 3, 8, 8)
    assert session.batched(session.max_batch + 1) is None
    x = np.random.default_rng(4).random((4, 3, 8, 8), dtype=np.float32)
    together = batched.run([x])[0]
    python = python_session(dynamic_batch_program).run([x])[0]  # type: ignore[attr-defined]
    assert together.shape == (4, 10) and np.array_equal(together, python)
    singly = one_by_one(session.run, [x])[0]
    np.testing.assert_allclose(together, singly, rtol=1e-5, atol=1e-6)
    fixed = NativeSession(COMMITTED_PTE_BUNDLES["tiny-pte-int8"] / "model.pte")
    assert fixed.max_batch is None and fixed.batched(4) is None


@pytest.mark.quick
@pytest.mark.workstation
def test_the_runtime_can_be_chosen_and_the_python_one_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    path = COMMITTED_PTE_BUNDLES["tiny-pte-int8"] / "model.pte"
    monkeypatch.setenv(RUNTIME_CHOICE, "python")
    assert ExecuTorchSession(path).runtime == "python"
    monkeypatch.setenv(RUNTIME_CHOICE, "native")
    assert ExecuTorchSession(path).runtime == "torch-free"
    monkeypatch.setenv(RUNTIME_CHOICE, "fast")
    with pytest.raises(BackendUnavailableError, match="choose native"):
        ExecuTorchSession(path)


@pytest.mark.quick
def test_a_service_without_a_home_builds_nowhere_but_next_to_the_runtime(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """systemd's DynamicUser= with ProtectHome=: no home to cache a shim in. The shim built at install, next to the
    libraries, is the one found; none is looked for or written elsewhere."""
    from edgeline import executorch_native

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    runtime = executorch_native.RuntimeDir(tmp_path / "executorch", "installed")
    assert executorch_native._shim_dirs(runtime) == [tmp_path / "executorch" / "edgeline-shim"]
