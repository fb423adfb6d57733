"""The ``edgeline`` import package laid out as the wheel installs it, made of symbolic links to the folders.

pyproject.toml maps the folders into one package (``edge_runtime/`` is ``edgeline``, ``export/`` is
``edgeline.export``, ...). An editable install follows that mapping through an import hook, which two users of
the work tree cannot see: mypy, and the tflite-runtime tier, which imports the work tree through PYTHONPATH
without installing anything. Both use this tree instead: ``build/package-tree/edgeline``, rebuilt when the
folders' entries change. Nothing is copied, so an edit shows at once.

    python -m tests.package_tree        # prints the directory to put on PYTHONPATH or mypy's path
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (the floor): tomli, a base dependency there
    import tomli as tomllib

__all__ = ["REPO", "package_dirs", "package_tree"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "build" / "package-tree"


def package_dirs() -> dict[str, Path]:
    """``[tool.setuptools.package-dir]``: import package -> folder."""
    with open(REPO / "pyproject.toml", "rb") as file:
        mapping = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items()}


def _wanted() -> dict[Path, Path]:
    """Relative link path -> its target, for every entry of the mapped folders."""
    links: dict[Path, Path] = {}
    for name, folder in sorted(package_dirs().items()):
        base = Path(*name.split("."))
        nested = {Path(*other.split(".")).relative_to(base) for other in package_dirs() if other.startswith(name + ".")}
        for entry in folder.iterdir():
            if entry.name == "__pycache__" or Path(entry.name) in nested:
                continue
            links[base / entry.name] = entry
    return links


def package_tree(dest: Path = DEFAULT) -> Path:
    """Make (or keep) the tree under ``dest``; returns ``dest``, the directory that holds ``edgeline``."""
    links = _wanted()
    current = {p.relative_to(dest): p.resolve() for p in dest.rglob("*") if p.is_symlink()} if dest.exists() else {}
    if current == {link: target.resolve() for link, target in links.items()}:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    for link, target in sorted(links.items()):
        path = dest / link
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
    return dest


if __name__ == "__main__":
    print(package_tree(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
