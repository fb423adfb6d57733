"""The error tree drawn in docs/architecture.md ("Errors and exit codes") and in ``device_profiles/errors.py`` is the
tree of ``EdgelineError`` subclasses in the code: every public subclass, under its own parent, in the module the
drawing names. Private subclasses (a leading underscore) are left out of the drawings and of the check.

The code is read with ``ast`` (nothing is imported, so export's classes count without torch): a class is in the tree
when one of its bases, by name or ``module.Name``, is.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_import_contracts import PACKAGE_DIR, ROOT, module_of, package_files

pytestmark = pytest.mark.quick

ROOT_ERROR = "EdgelineError"
LINE = re.compile(r"^(?P<indent>(?:│   |    )*)(?:(?P<branch>[├└]── ))?(?P<name>[A-Z]\w*)\b(?P<rest>.*)$")
DOC_HOME = re.compile(r"\(([\w/]+\.py)\)")
DOCSTRING_HOME = re.compile(r"\[(edgeline[\w.]*)\]")


@dataclass(frozen=True)
class Drawn:
    parent: str | None
    home: str | None  # the module the drawing names (or its ancestors'), e.g. edgeline.daemon.mqtt; None: the root's


@functools.cache
def code_tree() -> dict[str, tuple[str | None, str]]:
    """Public subclass of ``EdgelineError`` (and the root) -> (its parent, its module)."""
    classes: dict[str, list[tuple[list[str], str]]] = {}
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute))
                ]
                classes.setdefault(node.name, []).append((bases, module_of(path)))
    tree: dict[str, tuple[str | None, str]] = {}
    (root_module,) = [module for _, module in classes[ROOT_ERROR]]
    tree[ROOT_ERROR] = (None, root_module)
    grew = True
    while grew:
        grew = False
        for name, definitions in classes.items():
            for bases, module in definitions:
                parents = [b for b in bases if b in tree]
                if name in tree or not parents or name.startswith("_"):
                    continue
                assert len(definitions) == 1, f"{name} is defined twice: the tree could not tell them apart"
                assert len(parents) == 1, f"{name} has two parents in the tree: {parents}"
                tree[name] = (parents[0], module)
                grew = True
    return tree


def drawn_tree(block: list[str], home: re.Pattern[str]) -> dict[str, Drawn]:
    """Name -> (parent, the module it names) of a box-drawn tree, one class a line."""
    tree: dict[str, Drawn] = {}
    stack: list[str] = []
    for line in block:
        match = LINE.match(line)
        assert match, f"not a line of the tree: {line!r}"
        depth = len(match["indent"]) // 4 + (1 if match["branch"] else 0)
        assert depth <= len(stack), f"{line!r}: deeper than its parent"
        del stack[depth:]
        parent = stack[-1] if stack else None
        named = home.search(match["rest"])
        if named is None:  # a class lives where the drawing last said its ancestors do
            module = tree[parent].home if parent is not None else None
        elif named[1].endswith(".py"):  # docs/architecture.md names a path: daemon/mqtt.py
            module = module_of(_path_in_package(named[1]))
        else:
            module = named[1]
        assert match["name"] not in tree, f"{match['name']} is drawn twice"
        tree[match["name"]] = Drawn(parent, module)
        stack.append(match["name"])
    return tree


def _path_in_package(path: str) -> Path:
    """``daemon/mqtt.py`` (inside ``edge_runtime/``) or ``export/errors.py`` (a folder of its own) as a file."""
    first = path.split("/", 1)[0]
    return ROOT / path if first in PACKAGE_DIR.values() else ROOT / "edge_runtime" / path


def _block(text: str, first: str) -> list[str]:
    """The indented lines from the one that starts with ``first`` to the first blank line, without their indent."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first) and line.startswith("    "))
    block = []
    for line in lines[start:]:
        if not line.strip():
            break
        block.append(line[4:])
    return block


def _compare(drawn: dict[str, Drawn], where: str) -> None:
    code = code_tree()
    missing = sorted(set(code) - set(drawn))
    extra = sorted(set(drawn) - set(code))
    assert not missing and not extra, f"{where}: not drawn: {missing}; drawn but not in the code: {extra}"
    for name, (parent, module) in code.items():
        assert drawn[name].parent == parent, (
            f"{where}: {name} is drawn under {drawn[name].parent}, its base is {parent}"
        )
        home = drawn[name].home or code[ROOT_ERROR][1]
        assert home == module, f"{where}: {name} is drawn in {home}, defined in {module}"


def test_the_documented_error_tree_is_the_code_s() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Errors and exit codes") :]
    _compare(drawn_tree(_block(section, ROOT_ERROR), DOC_HOME), "docs/architecture.md")


def test_the_error_module_draws_the_same_tree() -> None:
    docstring = ast.get_docstring(ast.parse((ROOT / "device_profiles" / "errors.py").read_text(encoding="utf-8")))
    assert docstring is not None
    _compare(drawn_tree(_block(docstring, ROOT_ERROR), DOCSTRING_HOME), "device_profiles/errors.py")


def test_a_class_missing_from_a_drawing_is_named() -> None:
    section = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Errors")[1]
    drawn = drawn_tree(_block(section, ROOT_ERROR), DOC_HOME)
    del drawn["FleetError"]
    with pytest.raises(AssertionError, match=r"not drawn: \['FleetError'\]"):
        _compare(drawn, "docs/architecture.md")
    drawn = drawn_tree(_block(section, ROOT_ERROR), DOC_HOME)
    drawn["UpdateRefused"] = Drawn("EdgelineError", None)
    with pytest.raises(AssertionError, match="UpdateRefused is drawn under EdgelineError, its base is UpdateError"):
        _compare(drawn, "docs/architecture.md")
