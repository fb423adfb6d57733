"""What issue 51 asked to keep in one place, held there:

- **The error names.** ``device_profiles/errors.py``'s ``__all__`` is the one list: it names every public name that
  module defines, and ``edgeline.errors`` re-exports exactly those. The two packages that load their names on first
  use (``edgeline`` and ``edgeline.device_profiles``) list them three times each, because mypy and ``import edgeline``
  (which imports nothing) need them written out: their ``TYPE_CHECKING`` imports, ``_HOMES`` and ``__all__`` agree,
  and every error they name is in the one list and loaded from an errors module.
- **One lazy loader**, ``edgeline.device_profiles.lazy``: no module's ``__getattr__`` imports a module itself (one
  that computes a name, as ``edgeline.export.backends`` does for its old capability sets, is no loader).
- **One tomllib shim**, ``edgeline.device_profiles.toml``: no other module of the package imports ``tomllib`` or
  ``tomli``.

Files are read with ``ast``, as the import contracts read them; ``edgeline.errors`` is also imported, to compare the
objects it re-exports.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.test_import_contracts import ROOT, all_imports, package_files

pytestmark = pytest.mark.quick

ONE_LIST = ROOT / "device_profiles" / "errors.py"
ERROR_MODULES = ("edgeline.errors", "edgeline.device_profiles.errors")
"""Where a package's table may say an error loads from: the tree's module, or ``edgeline.errors`` (its re-export)."""
LAZY_PACKAGES = {"edgeline": ROOT / "edge_runtime" / "__init__.py",
                 "edgeline.device_profiles": ROOT / "device_profiles" / "__init__.py"}  # fmt: skip
TOML_SHIM = "edgeline.device_profiles.toml"


def _literal(node: ast.Module, name: str) -> object:
    for statement in node.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == name for target in statement.targets
        ):
            return ast.literal_eval(statement.value)
    raise AssertionError(f"no literal {name} at the top of the module")


# -- the one list of error names -------------------------------------------------------------------------------------


def defined_names(path: Path) -> list[str]:
    """The public names a module defines at its top: classes, functions and UPPER_CASE constants."""
    names = []
    for statement in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef)):
            names.append(statement.name)
        elif isinstance(statement, ast.Assign):
            names += [target.id for target in statement.targets if isinstance(target, ast.Name) and target.id.isupper()]
    return [name for name in names if not name.startswith("_")]


def one_list() -> tuple[str, ...]:
    listed = _literal(ast.parse(ONE_LIST.read_text(encoding="utf-8")), "__all__")
    assert isinstance(listed, list)
    return tuple(listed)


def list_problems(listed: Collection[str], defined: Collection[str], where: str) -> list[str]:
    problems = []
    if sorted(set(listed)) != sorted(listed):
        problems.append(f"{where}: __all__ names one twice")
    if set(listed) != set(defined):
        problems.append(
            f"{where}: defined but not in __all__: {sorted(set(defined) - set(listed))}; "
            f"in __all__ but not defined: {sorted(set(listed) - set(defined))}"
        )
    return problems


def test_the_one_list_names_every_error_and_reason_its_module_defines() -> None:
    assert list_problems(one_list(), defined_names(ONE_LIST), "device_profiles/errors.py") == []
    export = ROOT / "export" / "errors.py"  # the export subtree's module, which edgeline.errors cannot re-export
    listed = _literal(ast.parse(export.read_text(encoding="utf-8")), "__all__")
    assert isinstance(listed, list)
    assert list_problems(listed, defined_names(export), "export/errors.py") == []


def test_edgeline_errors_re_exports_the_one_list_and_nothing_else() -> None:
    errors = importlib.import_module("edgeline.errors")
    tree = importlib.import_module("edgeline.device_profiles.errors")
    assert list(errors.__all__) == list(one_list()) == list(tree.__all__)
    assert all(getattr(errors, name) is getattr(tree, name) for name in one_list())
    assert defined_names(ROOT / "edge_runtime" / "errors.py") == [], "edgeline.errors defines its own names"


def test_a_name_left_out_of_the_one_list_is_named() -> None:
    defined = defined_names(ONE_LIST)
    assert list_problems([n for n in one_list() if n != "CameraError"], defined, "errors.py") == [
        "errors.py: defined but not in __all__: ['CameraError']; in __all__ but not defined: []"
    ]
    assert list_problems([*one_list(), "Ghost"], defined, "errors.py") == [
        "errors.py: defined but not in __all__: []; in __all__ but not defined: ['Ghost']"
    ]


# -- the tables of the packages that load their names on first use ------------------------------------------------


@dataclass(frozen=True)
class LazyTables:
    where: str
    type_checking: dict[str, str]
    """Name -> the module it is imported from under ``if TYPE_CHECKING:`` (for mypy and readers)."""
    homes: dict[str, str]
    """``_HOMES``: name -> the module it is loaded from on first use."""
    public: tuple[str, ...]
    """``__all__``."""


def lazy_tables(path: Path) -> LazyTables:
    module = ast.parse(path.read_text(encoding="utf-8"))
    type_checking: dict[str, str] = {}
    for statement in module.body:
        if isinstance(statement, ast.If) and ast.unparse(statement.test) == "TYPE_CHECKING":
            for imported in statement.body:
                assert isinstance(imported, ast.ImportFrom) and imported.module, ast.unparse(imported)
                type_checking.update({alias.asname or alias.name: imported.module for alias in imported.names})
    homes, public = _literal(module, "_HOMES"), _literal(module, "__all__")
    assert isinstance(homes, dict) and isinstance(public, list)
    return LazyTables(path.relative_to(ROOT).as_posix(), type_checking, homes, tuple(public))


def _differ(one: Collection[str], other: Collection[str], names: tuple[str, str]) -> str | None:
    if set(one) == set(other):
        return None
    return (
        f"in {names[0]} but not in {names[1]}: {sorted(set(one) - set(other))}; "
        f"in {names[1]} but not in {names[0]}: {sorted(set(other) - set(one))}"
    )


def table_problems(tables: LazyTables, errors: Collection[str]) -> list[str]:
    """Where a package's three tables disagree with each other, or an error in them with the one list."""
    problems = [
        f"{tables.where}: {differ}"
        for differ in (
            _differ(tables.type_checking, tables.homes, ("the TYPE_CHECKING imports", "_HOMES")),
            _differ(tables.homes, tables.public, ("_HOMES", "__all__")),
        )
        if differ is not None
    ]
    for name, home in sorted(tables.homes.items()):
        imported = tables.type_checking.get(name, home)
        if imported != home:
            problems.append(f"{tables.where}: {name} loads from {home}, its TYPE_CHECKING import is from {imported}")
        if home in ERROR_MODULES and name not in errors:
            problems.append(f"{tables.where}: {name} loads from {home}, whose one list (__all__) does not name it")
        if name in errors and home not in ERROR_MODULES:
            problems.append(f"{tables.where}: the error name {name} loads from {home}, not from {ERROR_MODULES[0]}")
    return problems


@pytest.mark.parametrize("package", list(LAZY_PACKAGES))
def test_a_package_s_lazy_tables_agree_with_each_other_and_the_one_list(package: str) -> None:
    assert table_problems(lazy_tables(LAZY_PACKAGES[package]), one_list()) == []
    loaded = importlib.import_module(package)
    for name, home in lazy_tables(LAZY_PACKAGES[package]).homes.items():
        assert getattr(loaded, name) is getattr(importlib.import_module(home), name)


def test_a_disagreement_between_the_tables_is_named() -> None:
    tables = lazy_tables(LAZY_PACKAGES["edgeline"])
    homes = {name: home for name, home in tables.homes.items() if name != "IntegrityError"}
    assert table_problems(replace(tables, homes=homes), one_list()) == [
        "edge_runtime/__init__.py: in the TYPE_CHECKING imports but not in _HOMES: ['IntegrityError']; "
        "in _HOMES but not in the TYPE_CHECKING imports: []",
        "edge_runtime/__init__.py: in _HOMES but not in __all__: []; in __all__ but not in _HOMES: ['IntegrityError']",
    ]
    assert table_problems(tables, [name for name in one_list() if name != "PayloadError"]) == [
        "edge_runtime/__init__.py: PayloadError loads from edgeline.errors, whose one list (__all__) does not name it"
    ]
    moved = replace(tables, homes={**tables.homes, "BundleError": "edgeline.bundle"})
    assert table_problems(moved, one_list()) == [
        "edge_runtime/__init__.py: BundleError loads from edgeline.bundle, its TYPE_CHECKING import is from "
        "edgeline.errors",
        "edge_runtime/__init__.py: the error name BundleError loads from edgeline.bundle, not from edgeline.errors",
    ]


# -- one lazy loader, one tomllib shim -------------------------------------------------------------------------------


def own_loaders() -> list[str]:
    """Module ``__getattr__`` functions that import modules themselves instead of asking the one loader."""
    found = []
    for path in package_files():
        for statement in ast.parse(path.read_text(encoding="utf-8")).body:
            if not (isinstance(statement, ast.FunctionDef) and statement.name == "__getattr__"):
                continue
            calls = [node.func for node in ast.walk(statement) if isinstance(node, ast.Call)]
            names = {call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "") for call in calls}
            if names & {"import_module", "__import__"}:
                found.append(f"{path.relative_to(ROOT).as_posix()}:{statement.lineno}")
    return found


def test_every_package_loads_its_names_through_the_one_lazy_loader() -> None:
    assert own_loaders() == [], "a __getattr__ of its own: use edgeline.device_profiles.lazy.load_name"


def test_the_lazy_loader_keeps_what_it_loaded_and_words_a_missing_name_as_python_does() -> None:
    from edgeline.device_profiles.lazy import load_name, names

    namespace: dict[str, object] = {"__name__": "edgeline.somewhere"}
    homes = {"Precision": "edgeline.device_profiles.precision"}
    loaded = load_name(namespace, homes, "Precision")
    assert namespace["Precision"] is loaded is importlib.import_module(homes["Precision"]).Precision
    with pytest.raises(AttributeError, match=r"^module 'edgeline.somewhere' has no attribute 'Ghost'$"):
        load_name(namespace, homes, "Ghost")
    assert names(namespace, homes) == ["Precision", "__name__"]


def test_tomllib_is_chosen_in_one_module() -> None:
    """Python 3.10 has no tomllib (the base install brings tomli): one module chooses, every reader imports it."""
    elsewhere = [
        str(found)
        for found in all_imports()
        if found.imported.split(".")[0] in ("tomllib", "tomli") and found.importer != TOML_SHIM
    ]
    assert elsewhere == [], f"import tomllib from {TOML_SHIM} instead"
    from edgeline.device_profiles.toml import tomllib

    assert tomllib.loads('id = "rpi5"') == {"id": "rpi5"}
