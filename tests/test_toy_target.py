"""A newcomer's path: an export target and the runtime backend that runs its bundles, each one class, registered in
one place each (``EXPORT_BACKENDS``, ``RUNTIME_BACKENDS``: the registries a newcomer's pages name) and nothing else
edited. The toy (tests/toy/) is then listed by ``edgeline profiles``, ``edgeline doctor`` (its runtime, which of a
profile's targets run here, and its bundle's verdict), ``edgeline export --all`` (a real export of a tiny model:
export tier), ``edgeline bundle show``, and passes the import contracts as the two files it would be in the tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeline.backends import RUNTIME_BACKENDS
from edgeline.cli import main
from edgeline.export.backends import EXPORT_BACKENDS
from tests.test_import_contracts import broken, imports_of

TOY = Path(__file__).resolve().parent / "toy"
PROFILE = """\
id = "toy-board"
name = "Toy board"
description = "A board whose one target is the toy."
memory_mb = 1024
os = "any"

[cpu]
name = "Cortex-A76"
arch = "aarch64"
cores = 4
isa_features = ["neon"]

[[targets]]
backend = "toy"
precision = "fp32"
threads = 1

[budgets]
max_model_bytes = 1_048_576
max_accuracy_drop = 1.0
min_cosine = 0.99
"""


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one place each: the toy target's class and its runtime backend's class, by name."""
    monkeypatch.setitem(EXPORT_BACKENDS, "toy", "tests.toy.export_target:ToyTarget")
    monkeypatch.setitem(RUNTIME_BACKENDS, "toy", "tests.toy.runtime_backend:ToyRuntime")


@pytest.fixture
def toy_profile(tmp_path: Path) -> Path:
    path = tmp_path / "toy-board.toml"
    path.write_text(PROFILE, encoding="utf-8")
    return path


@pytest.mark.quick
def test_every_registered_runtime_backend_is_one_class_the_tables_are_read_from() -> None:
    from edgeline.backends import BASE_INSTALL_BACKENDS, RuntimeBackend, runtime_backends
    from edgeline.device_facts import RUNTIMES
    from edgeline.verdicts import TARGET_RUNTIMES

    backends = runtime_backends()
    assert list(backends) == list(RUNTIME_BACKENDS)
    for name, backend in backends.items():
        assert isinstance(backend, RuntimeBackend) and backend.name == name
        assert backend.file_suffixes and all(suffix.startswith(".") for suffix in backend.file_suffixes)
        assert RUNTIMES[name] == backend.info()
    assert {name for name, backend in backends.items() if backend.base_install} == BASE_INSTALL_BACKENDS == {"litert"}
    assert set(TARGET_RUNTIMES) == set(EXPORT_BACKENDS)  # each target's class says what runs it, torch-free
    assert {runtime for runtime, _accelerator in TARGET_RUNTIMES.values()} <= set(RUNTIME_BACKENDS)


@pytest.mark.export
def test_a_toy_target_is_listed_everywhere_once_registered(
    toy_registered: None,
    toy_profile: Path,
    tmp_path: Path,
    tiny_model_file: Path,
    sample_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["profiles", "show", str(toy_profile)]) == 0
    assert "1. toy  fp32  1 threads" in capsys.readouterr().out

    assert main(["doctor", "--json"]) == 0
    runtime = json.loads(capsys.readouterr().out)["runtimes"]["toy"]
    assert runtime["imports"] is True and runtime["version"]  # probed by its class: torch, imported
    from edgeline.device_facts import gather
    from edgeline.device_profiles import load_profile
    from edgeline.verdicts import runnable_targets

    assert runnable_targets(load_profile(toy_profile), gather(["toy"])) == ["toy fp32"]

    out = tmp_path / "tiny"
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", str(toy_profile), "--calibration",
         str(sample_files["calibration"]), "--validation", str(sample_files["validation"]), "--out", str(out),
         "--all", "--json"]
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    (target,) = report["targets"]
    assert (target["backend"], target["precision"], target["status"]) == ("toy", "fp32", "selected")
    assert target["fidelity"]["status"] == "measured"  # the bundle ran on the toy runtime here
    bundle = out / "toy-fp32"

    assert main(["bundle", "show", str(bundle), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["backend"], shown["base_install_runs_it"]) == ("toy", False)

    assert main(["doctor", str(bundle)]) == 0
    said = capsys.readouterr().out
    assert "runs here: toy opens model.pt2 on the CPU" in said, said

    _keeps_the_import_contracts("export_target.py", "export/backends/toy.py", "edgeline.export.backends.toy")
    _keeps_the_import_contracts("runtime_backend.py", "edge_runtime/backends/toy.py", "edgeline.backends.toy")


def _keeps_the_import_contracts(file: str, would_be: str, module: str) -> None:
    """The toy's file, read by the import contracts as the file it would be in the tree: no rule broken."""
    found = list(imports_of((TOY / file).read_text(encoding="utf-8"), would_be, module))
    assert found, "the contracts read the toy's imports"
    assert [problem for each in found for problem in broken(each)] == []
