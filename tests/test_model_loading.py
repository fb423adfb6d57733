"""``MODEL`` specs load as their users expect from ``module:function`` tools (uvicorn, gunicorn, pytest): a module
from the current folder, and a model file's own imports of the modules beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

HELPER = """\
import torch


def small_net():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
"""


def _write_models(folder: Path, stem: str) -> None:
    """``{stem}.py`` whose model comes from ``{stem}_parts.py`` beside it (unique names: imports are cached)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}_parts.py").write_text(HELPER)
    model = f"from {stem}_parts import small_net\n\n\ndef a_tcn():\n    return small_net()\n"
    (folder / f"{stem}.py").write_text(model)


@pytest.fixture(autouse=True)
def own_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_a_model_file_imports_the_modules_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgeline.export.loading import load_model

    _write_models(tmp_path / "models", "zoo_file")
    monkeypatch.chdir(tmp_path)  # elsewhere than the model's folder
    loaded = load_model(str(tmp_path / "models" / "zoo_file.py") + ":a_tcn")
    assert type(loaded.module).__name__ == "Sequential"


def test_a_module_of_the_current_folder_loads_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgeline.export.errors import ModelLoadError
    from edgeline.export.loading import load_model

    _write_models(tmp_path, "zoo_module")
    monkeypatch.chdir(tmp_path)
    loaded = load_model("zoo_module:a_tcn")
    assert type(loaded.module).__name__ == "Sequential"
    with pytest.raises(ModelLoadError, match="cannot import module 'no_such_zoo'"):
        load_model("no_such_zoo:a_tcn")
