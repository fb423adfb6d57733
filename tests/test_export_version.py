"""``edgeline export --version N``: the version devices and ``edgeline publish`` compare."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeline.bundle import read_bundle
from edgeline.cli import main
from tests.conftest import needs_torch

pytestmark = [pytest.mark.export, pytest.mark.workstation]


def export(model: Path, samples: dict[str, Path], out: Path, *extra: str) -> int:
    return main(
        ["export", f"{model}:model", "--profile", "rpi5", "--calibration", str(samples["calibration"]),
         "--backend", "litert", "--precision", "fp32", "--out", str(out), *extra]
    )  # fmt: skip


def test_the_version_is_given_or_counts_up_from_one(
    tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    needs_torch("export")
    out = tmp_path / "tiny"
    assert export(tiny_model_file, sample_files, out, "--version", "7") == 0
    assert read_bundle(out).manifest.version == 7
    assert export(tiny_model_file, sample_files, out, "--force") == 0
    assert read_bundle(out).manifest.version == 8, "replacing a bundle without --version: one more"
    assert export(tiny_model_file, sample_files, tmp_path / "fresh") == 0
    assert read_bundle(tmp_path / "fresh").manifest.version == 1
    capsys.readouterr()
    assert export(tiny_model_file, sample_files, tmp_path / "zero", "--version", "0") == 2
    assert "--version: 0 is out of range; valid: 1 or more" in capsys.readouterr().err
