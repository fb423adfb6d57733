"""`edgeline export --all`: every target of the profile is tried, each that passes is written next to the others,
and the one the profile's order picks is marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import edgeline
from edgeline.cli import main
from edgeline.export.report import ExportReport, TargetOutcome, format_report

pytestmark = pytest.mark.export

REPO = Path(__file__).resolve().parents[1]


def litert_only_profile(tmp_path: Path) -> Path:
    """rpi5 without its ExecuTorch target (each ExecuTorch export costs tens of seconds here)."""
    text = (REPO / "device_profiles" / "profiles" / "rpi5.toml").read_text()
    block = '[[targets]]\nbackend = "executorch-xnnpack"\nprecision = "int8-static"\nthreads = 4\n\n'
    assert block in text
    path = tmp_path / "board.toml"
    path.write_text(text.replace(block, "").replace('id = "rpi5"', 'id = "board"'))
    return path


def test_every_passing_target_is_written_and_the_first_is_picked(
    tmp_path: Path, tiny_model_file: Path, sample_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "stale").write_text("from an earlier run")
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", str(litert_only_profile(tmp_path)),
         "--calibration", str(sample_files["calibration"]), "--validation", str(sample_files["validation"]),
         "--out", str(out), "--all", "--force", "--json"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    targets = {f"{t['backend']}-{t['precision']}": t for t in report["targets"]}
    assert list(targets) == ["litert-int8-static", "litert-fp16", "litert-fp32"]
    assert [t["status"] for t in targets.values()] == ["selected", "passed", "passed"]
    assert report["bundle"] == str(out / "litert-int8-static")
    assert sorted(p.name for p in out.iterdir()) == sorted(targets)  # the stale file went with --force
    for key, target in targets.items():
        assert target["bundle"] == str(out / key)
        model = edgeline.load(out / key)  # each verifies as a device would read it
        assert model.manifest.precision == target["precision"] and model.manifest.version == 1
        assert target["fidelity"]["status"] == "measured" and target["size_bytes"] > 0


def test_without_force_an_existing_folder_is_refused_before_any_work(
    tmp_path: Path, tiny_model_file: Path, sample_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "keep").write_text("mine")
    code = main(
        ["export", f"{tiny_model_file}:model", "--profile", "rpi5", "--calibration", str(sample_files["calibration"]),
         "--out", str(out), "--all"]
    )  # fmt: skip
    assert code == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (out / "keep").read_text() == "mine"


def test_the_table_marks_the_pick_when_others_passed_too(tmp_path: Path) -> None:
    report = ExportReport(name="m", profile="rpi5", out=tmp_path / "m" / "litert-int8-static")
    picked = TargetOutcome("litert", "int8-static", 4, "selected", bundle=tmp_path / "m" / "litert-int8-static")
    other = TargetOutcome("litert", "fp32", 4, "passed", bundle=tmp_path / "m" / "litert-fp32")
    report.outcomes = [picked, other, TargetOutcome("executorch-xnnpack", "int8-static", 4, "failed", "no torch")]
    lines = format_report(report).splitlines()
    assert lines[2].endswith("<- the profile's order picks this one") and "litert-int8-static" in lines[2]
    assert lines[3].endswith(str(tmp_path / "m" / "litert-fp32")) and "passed" in lines[3]
    assert lines[4].endswith("no torch")
