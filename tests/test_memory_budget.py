"""A profile's ``max_memory_mb`` is checked against what was measured, never only printed: export measures the
resident memory the bundle's model adds to a fresh process (loaded and run once, with its own runtime), or TFLite
Micro's arena for a microcontroller, records it in the manifest's ``memory``, and rejects a target over the budget.
Where it cannot be measured (Core ML off macOS) the manifest says why. Real exports of a model trained on digits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from edgeline.cli import main

pytestmark = pytest.mark.export

REPO = Path(__file__).resolve().parents[1]

MODEL = """\
import torch
from torch import nn


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("memory")
    (root / "model.py").write_text(MODEL, encoding="utf-8")
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    np.savez(root / "cal.npz", images[:64])  # unnamed: arr_0, taken by position
    np.savez(root / "val.npz", images[64:128])
    return root


def _profile(root: Path, profile_id: str, **budgets: int) -> Path:
    text = (REPO / "device_profiles" / "profiles" / f"{profile_id}.toml").read_text()
    for key, value in budgets.items():
        text, found = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.MULTILINE)
        if not found:
            text = text.replace("[budgets]\n", f"[budgets]\n{key} = {value}\n")
    path = root / f"{profile_id}-{'-'.join(f'{k}{v}' for k, v in budgets.items())}.toml"
    path.write_text(text)
    return path


def _export(root: Path, profile: str | Path, out: Path, *extra: str) -> tuple[int, dict]:
    code = main(["export", f"{root / 'model.py'}:mlp", "--profile", str(profile), "--calibration",
                 str(root / "cal.npz"), "--validation", str(root / "val.npz"), "--out", str(out), "--json",
                 *extra])  # fmt: skip
    return code, json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else {}


def test_the_resident_memory_is_measured_recorded_and_within_the_budget(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, manifest = _export(workspace, "rpi5", tmp_path / "b", "--backend", "litert", "--precision", "fp32")
    assert code == 0
    memory = manifest["memory"]
    # a LiteRT interpreter and its model: more than nothing, far less than the rpi5's 1,024 MB budget
    assert 0.5 < memory["resident_mb"] < 200
    assert memory["measured_with"].startswith("litert on ")
    report = json.loads(capsys.readouterr().out)
    assert report["targets"][0]["memory"]["resident_mb"] == memory["resident_mb"]


def test_a_target_over_the_memory_budget_is_rejected_and_the_next_one_tried(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tight = _profile(tmp_path, "rpi5", max_memory_mb=1)  # less than any runtime needs
    code, _ = _export(workspace, tight, tmp_path / "b")
    assert code != 0  # every target of the profile needs more than 1 MB: none is written
    assert not (tmp_path / "b").exists()
    targets = json.loads(capsys.readouterr().out)["targets"]
    assert len(targets) == 4
    assert all(t["status"] == "rejected" and "> budget 1 MB" in t["reason"] for t in targets)


def test_the_memory_budget_names_the_figure_and_what_measured_it(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tight = _profile(tmp_path, "rpi5", max_memory_mb=1)
    code, _ = _export(workspace, tight, tmp_path / "b", "--backend", "litert", "--precision", "fp32")
    assert code != 0
    captured = capsys.readouterr()
    assert re.search(r"resident memory \d+\.\d MB \(litert on \S+ .*\) > budget 1 MB", captured.out + captured.err)


def test_a_microcontroller_bundle_records_tflite_micro_s_arena(workspace: Path, tmp_path: Path) -> None:
    code, manifest = _export(workspace, "ethos-u55-128", tmp_path / "b", "--backend", "tflite-micro",
                             "--precision", "int8-static")  # fmt: skip
    assert code == 0
    memory = manifest["memory"]
    # the arena holds at least the largest activation (the 64-value input, int8) and fits the session's reservation
    assert 64 <= memory["arena_bytes"] <= 64 * 1024 * 1024
    assert memory["resident_mb"] is None and "microcontroller" in memory["unknown"]["resident_mb"]


def test_where_nothing_here_runs_the_model_the_manifest_says_so(workspace: Path, tmp_path: Path) -> None:
    code, manifest = _export(workspace, "iphone-15-pro", tmp_path / "b", "--backend", "coreml", "--precision", "fp16")
    assert code == 0
    memory = manifest["memory"]
    assert memory["resident_mb"] is None and memory["arena_bytes"] is None
    assert "does not run here" in memory["unknown"]["resident_mb"]


def test_an_executorch_bundle_is_judged_by_the_torch_free_runtime_that_runs_it_on_the_device(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .pte on the torch-free runtime takes a few MB, as a LiteRT model does: within a small board's budget. The
    same bundle on ExecuTorch's Python runtime (torch loaded) would take hundreds: the budget refuses it."""
    small = _profile(tmp_path, "rpi5", max_memory_mb=64)
    target = ("--backend", "executorch-xnnpack", "--precision", "int8-static")
    code, manifest = _export(workspace, small, tmp_path / "native", *target)
    assert code == 0
    memory = manifest["memory"]
    assert 0.1 < memory["resident_mb"] < 64
    assert memory["measured_with"].startswith("executorch on ") and ", torch-free runtime: " in memory["measured_with"]
    capsys.readouterr()
    monkeypatch.setenv("EDGELINE_EXECUTORCH_RUNTIME", "python")  # what a machine without the torch-free one measures
    code, _ = _export(workspace, small, tmp_path / "python", *target)
    assert code != 0
    captured = capsys.readouterr()
    assert re.search(r"resident memory \d+\.\d MB \(executorch on .*Python runtime \(torch imported.*> budget 64 MB",
                     captured.out + captured.err), captured.out  # fmt: skip
