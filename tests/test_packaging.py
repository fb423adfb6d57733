"""The wheel holds one import package, `edgeline`, mapped from the folders; nothing of ours under a generic name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.package_tree import REPO, package_dirs

pytestmark = pytest.mark.integration

SOURCES = ("pyproject.toml", "README.md", "edge_runtime", "export", "device_profiles", "sim", "firmware_bridge")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel as `pip install edgeline` would get it, built from a copy of the sources (nothing written here)."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    out = tmp_path_factory.mktemp("dist")
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return zipfile.ZipFile(out / result.stdout.strip().splitlines()[-1])


def test_the_only_top_level_package_is_edgeline(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"edgeline"}


def test_every_module_of_every_folder_is_in_the_wheel_where_the_mapping_puts_it(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    mapping = package_dirs()
    expected = set()
    for package, folder in mapping.items():
        nested = [Path(mapping[other]) for other in mapping if other.startswith(package + ".")]
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or any(path.is_relative_to(n) for n in nested):
                continue
            expected.add("/".join([*package.split("."), *path.relative_to(folder).parts]))
    assert expected - names == set(), "folders with modules missing from [tool.setuptools] packages"
    assert len(expected) > 50


def test_data_files_and_the_command_ship(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "edgeline/py.typed" in names
    assert "edgeline/systemd/edgeline@.service" in names
    profiles = {n for n in names if n.startswith("edgeline/device_profiles/profiles/") and n.endswith(".toml")}
    assert len(profiles) == len(list((REPO / "device_profiles" / "profiles").glob("*.toml"))) > 0
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "edgeline = edgeline.cli:main" in wheel.read(entry_points).decode()


def test_a_users_export_py_and_sim_py_do_not_shadow_ours(tmp_path: Path) -> None:
    """YOLOv5's checkout has an export.py: run from such a folder, edgeline still has its own commands."""
    for name in ("export", "sim", "device_profiles", "edge_runtime"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('the user file was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for command in ("export", "sim", "profiles", "run"):
        assert f"    {command}" in result.stdout, result.stdout


def test_importing_edgeline_imports_nothing_of_ours_or_heavy() -> None:
    code = (
        "import sys, edgeline\n"
        "print(sorted(m for m in sys.modules if m.startswith('edgeline.') or m.split('.')[0] in "
        "{'numpy', 'pydantic', 'torch'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"
