"""The documents name what exists: the paths they point at, every backend, every file kind and every manifest field.

A path counts when it is in backticks (or is a word of a fenced code block) and starts with a folder of the
repository (``edge_runtime/config.py``), or ends in a source extension (``daemon/mqtt.py``: then it is read inside the
``edgeline`` package, through pyproject's package-dir, as ``edgeline/...`` is). Paths with wildcards or templates
(``sensors/+/+``, ``work/{model.pt2,...}``), absolute paths and generated folders (``build/``) are not the
repository's and are left alone. A Markdown file named anywhere in the text must be in the repository: the documents
stand on their own.
"""

from __future__ import annotations

import ast
import re
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from edgeline.backends import RUNTIME_BACKENDS
from edgeline.backends.ethos_u import CPU_MODEL
from edgeline.backends.onnxruntime import CPU_COPY_SUFFIX
from edgeline.bundle import MANIFEST_FILE, SIGNATURE_FILE
from edgeline.errors import PAYLOAD_CODES
from edgeline.export.backends import EXPORT_BACKENDS
from edgeline.manifest import Golden, Manifest

pytestmark = pytest.mark.quick

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the base install carries tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BUNDLE = ROOT / "docs" / "bundle.md"
DOCUMENTS = sorted({ROOT / "README.md", ARCHITECTURE, *(ROOT / "docs").glob("*.md")})

PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
"""Import package -> folder: ``edgeline`` is ``edge_runtime``, ``edgeline.export`` is ``export``, ..."""
FOLDERS = frozenset(PACKAGE_DIR.values()) | {"tests", "benchmarks", "docs", "scripts"}
"""The repository's own top-level folders (the generated ones, build/ and .venv/, are not)."""
SOURCE_SUFFIXES = frozenset({".py", ".md", ".toml", ".sh", ".ini", ".service", ".h", ".c"})
NOT_A_PATH = re.compile(r"[\s{}<>*?+#|=,;:'\"$]|\.\.\.")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
MARKDOWN_FILE = re.compile(r"[\w./-]*\w\.md\b")
WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _code_spans(text: str) -> list[str]:
    return CODE_SPAN.findall(FENCE.sub("", text))


def _named_paths(text: str) -> Iterator[str]:
    """What looks like a repository path: code spans, and the words of fenced blocks that start with a folder."""
    yield from _code_spans(text)
    for block in FENCE.findall(text):
        for word in block.split():
            word = word.strip("()[],;'\"")
            if word.split("/", 1)[0] in FOLDERS:
                yield word


def _in_package(path: str) -> Path:
    """``edgeline/daemon/x.py`` (or ``daemon/x.py``, inside the ``edgeline`` package) as a file of the repository."""
    parts = path.split("/")
    if parts[0] != "edgeline":
        parts = ["edgeline", *parts]
    for cut in range(len(parts), 0, -1):
        folder = PACKAGE_DIR.get(".".join(parts[:cut]))
        if folder is not None:
            return ROOT.joinpath(folder, *parts[cut:])
    raise AssertionError(f"{path} maps to no package")  # "edgeline" is always in package-dir


def _repository_path(token: str) -> Path | None:
    """The file or folder ``token`` names in the repository, or None when it is not a repository path."""
    if "/" not in token or token.startswith(("/", "~", ".")) or NOT_A_PATH.search(token):
        return None
    first = token.split("/", 1)[0]
    if first in FOLDERS:
        return ROOT / token
    if Path(token.rstrip("/")).suffix in SOURCE_SUFFIXES:
        return _in_package(token)
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_path_a_document_names_exists(document: Path) -> None:
    assert document.is_file(), f"{document.relative_to(ROOT)} is missing"
    text = document.read_text(encoding="utf-8")
    missing = sorted(
        {token for token in _named_paths(text) if (path := _repository_path(token)) is not None and not path.exists()}
    )
    assert not missing, f"{document.relative_to(ROOT)} names paths that do not exist: {', '.join(missing)}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_markdown_file_a_document_names_is_in_the_repository(document: Path) -> None:
    assert document.is_file(), f"{document.relative_to(ROOT)} is missing"
    missing = []
    for name in sorted(set(MARKDOWN_FILE.findall(document.read_text(encoding="utf-8")))):
        places = [(ROOT / name).resolve(), (document.parent / name).resolve()]
        if not any(place.is_file() and place.is_relative_to(ROOT) for place in places):
            missing.append(name)
    assert not missing, f"{document.relative_to(ROOT)} points outside the repository: {', '.join(missing)}"


def test_the_readme_points_to_the_architecture_document() -> None:
    assert ARCHITECTURE.is_file(), "docs/architecture.md is missing"
    assert "docs/architecture.md" in _code_spans((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_lists_exactly_the_error_codes_of_the_code() -> None:
    """The README's table of error codes is a copy of ``PAYLOAD_CODES`` for readers: held equal to it, in order."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| code | when |", 1)[1].split("\n\n", 1)[0]
    codes = re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.MULTILINE)
    assert codes == list(PAYLOAD_CODES), "README.md's error codes differ from edgeline.errors.PAYLOAD_CODES"


def _words(spans: list[str]) -> set[str]:
    """The names in code spans: ``placement.macs`` gives itself, ``placement`` and ``macs``."""
    found = set()
    for span in spans:
        for word in WORD.findall(span):
            found.add(word)
            found.update(word.split("."))
    return found


def test_the_architecture_document_names_every_folder_package_and_backend() -> None:
    assert ARCHITECTURE.is_file(), "docs/architecture.md is missing"
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    for package, folder in PACKAGE_DIR.items():
        assert any(f"`{folder}/`" in row and f"`{package}`" in row for row in rows), (
            f"docs/architecture.md has no table row with `{folder}/` beside `{package}`"
        )
    words = _words(_code_spans(text))
    unnamed = sorted((set(EXPORT_BACKENDS) | set(RUNTIME_BACKENDS)) - words)
    assert not unnamed, f"docs/architecture.md does not name the backends {', '.join(unnamed)}"


def test_the_bundle_page_names_every_backend_and_file_kind() -> None:
    words = _words(_code_spans(BUNDLE.read_text(encoding="utf-8")))
    model_files = set()
    for module in sorted((ROOT / "export" / "backends").glob("*.py")):
        for node in ast.parse(module.read_text(encoding="utf-8")).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(target, ast.Name) and target.id == "MODEL_FILE" for target in node.targets)
                and isinstance(node.value, ast.Constant)
            ):
                model_files.add(node.value.value)
    assert model_files, "no MODEL_FILE found in export/backends"
    golden = Golden.model_fields["path"].default
    kinds = model_files | {CPU_MODEL, f"model{CPU_COPY_SUFFIX}", MANIFEST_FILE, SIGNATURE_FILE, golden}
    unnamed = sorted((set(EXPORT_BACKENDS) | set(RUNTIME_BACKENDS) | kinds) - words)
    assert not unnamed, f"docs/bundle.md does not name {', '.join(unnamed)}"


def _models(annotation: object) -> Iterator[type[BaseModel]]:
    """The pydantic models inside a field's type: ``Placement | None``, ``tuple[FileEntry, ...]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for argument in typing.get_args(annotation):
        yield from _models(argument)


def _fields(model: type[BaseModel], parent: str | None = None) -> Iterator[tuple[str | None, str]]:
    """(the field that holds it, the field's name) for every field of ``model``, nested models included."""
    for name, info in model.model_fields.items():
        yield parent, name
        for nested in _models(info.annotation):
            yield from _fields(nested, name)


def _units(text: str) -> list[str]:
    """Table rows one by one, other text paragraph by paragraph: where a field and its parent are named together."""
    units: list[str] = []
    for block in re.split(r"\n\s*\n", FENCE.sub("", text)):
        lines = block.strip().splitlines()
        if lines and all(line.startswith("|") for line in lines):
            units.extend(lines)
        else:
            units.append(block)
    return units


def test_the_bundle_page_names_every_manifest_field() -> None:
    text = BUNDLE.read_text(encoding="utf-8")
    units = [_words(_code_spans(unit)) for unit in _units(text)]
    unnamed = []
    for parent, name in sorted(set(_fields(Manifest)), key=lambda item: (item[0] or "", item[1])):
        if parent is None:
            named = any(name in words for words in units)
        else:  # the field beside its parent (``placement``: ``{accelerator, ops, ...}``), or ``parent.field``
            named = any((parent in words and name in words) or f"{parent}.{name}" in words for words in units)
        if not named:
            unnamed.append(f"{parent}.{name}" if parent else name)
    assert not unnamed, f"docs/bundle.md does not document the manifest fields {', '.join(unnamed)}"
