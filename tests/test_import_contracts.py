"""docs/architecture.md's dependency directions, as contracts: every import of the packaged folders is checked
against the tables below, and a wrong one fails naming its file, its line and the rule it breaks.

Which imports count: every ``import`` and ``from ... import`` statement anywhere in a file, found with ``ast``
(nothing is imported): at module level, in class bodies, inside functions and under ``if TYPE_CHECKING:``. An
import inside a function is still a dependency (it runs on the first call), and a type-only one still ties the two
modules together (mypy, the reader, the next refactor), so the directions count all of them. The rules about import
*time* (no torch on the device side until a bundle asks for it) count only what runs when the module is imported:
module level and class bodies, outside ``if TYPE_CHECKING:``.

Not counted, by design: module names written as strings and imported on first use through a registry, the way a
lower folder names a higher one (the CLI's ``COMMAND_MODULES``, the daemon's ``SOURCES``, the backend dicts).

Besides the directions: the library never imports a command module (the commands print what the library knows), and
product code has no import circle. A circle is read from the same imports (every time counts: a type-only or an
on-call import still ties two modules together), as a strongly connected component of more than one module of the
graph whose edges go from the importing module to the module of ours an import names: ``from edgeline.updates.policy
import X`` is an edge to ``edgeline.updates.policy``, ``from edgeline.updates import X`` (a name of the package's
``__init__``) an edge to the package ``edgeline.updates``. Importing a module also runs its packages' ``__init__``
first, but that is no edge: a package's ``__init__`` is in a circle only when it imports, in turn, what imports it.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the base install carries tomli on 3.10
    import tomli as tomllib

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT = 'docs/architecture.md, "Dependency directions"'
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
"""Import package -> folder: ``edgeline`` is ``edge_runtime``, ``edgeline.export`` is ``export``, ..."""


class When(Enum):
    """When an import runs."""

    IMPORT_TIME = "at import time"
    TYPE_CHECKING = "under TYPE_CHECKING"
    ON_CALL = "inside a function"


ANY_TIME = frozenset(When)

# -- the rules -----------------------------------------------------------------------------------------------------

LAYERS: dict[str, frozenset[str]] = {
    "device_profiles": frozenset(),
    "edge_runtime": frozenset({"device_profiles"}),
    "export": frozenset({"edge_runtime", "device_profiles"}),
    "sim": frozenset({"edge_runtime", "device_profiles", "firmware_bridge"}),
    "firmware_bridge": frozenset({"edge_runtime", "device_profiles"}),
}
"""Folder -> the other folders of ours it may import, at any time: the document's arrows, lower layers included."""


@dataclass(frozen=True)
class Rule:
    """Modules of ``scope`` (packages or modules, within the folder each names) never import ``forbidden`` (packages,
    modules or names), at the times ``when`` lists. ``but``: modules of the scope the rule leaves out; ``allowed``:
    the named exceptions, each with the times it may import them."""

    says: str
    scope: tuple[str, ...]
    forbidden: tuple[str, ...]
    when: frozenset[When] = ANY_TIME
    but: tuple[str, ...] = ()
    allowed: Mapping[str, frozenset[When]] = field(default_factory=dict)


TORCH = ("torch", "torchao", "torchvision", "executorch", "coremltools", "litert_torch")
ALL_PACKAGES = tuple(PACKAGE_DIR)


def _registered_commands() -> tuple[str, ...]:
    """``edgeline.cli.COMMAND_MODULES``, read from the source (nothing is imported)."""
    for node in ast.parse((ROOT / "edge_runtime" / "cli.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        else:
            continue
        if name == "COMMAND_MODULES" and value is not None:
            modules = ast.literal_eval(value)
            assert isinstance(modules, tuple) and all(isinstance(m, str) for m in modules), modules
            return modules
    raise AssertionError("edge_runtime/cli.py has no COMMAND_MODULES")


COMMANDS = ("edgeline.cli", *_registered_commands())
"""The command modules: the ``edgeline`` command and every module it registers a subcommand from (all folders)."""

RULES = (
    Rule(
        "the library half of edgeline (bundle, manifest, model, backends and the rest outside daemon/ and updates/) "
        "imports neither edgeline.daemon nor edgeline.updates; the commands infer and bundle show borrow the "
        "daemon's codecs and processor inside their functions, and doctor its configuration and state directory",
        scope=("edgeline",),
        but=("edgeline.daemon", "edgeline.updates"),
        forbidden=("edgeline.daemon", "edgeline.updates"),
        allowed={
            "edgeline.commands": frozenset({When.ON_CALL}),
            "edgeline.bundle_cli": frozenset({When.ON_CALL}),
            "edgeline.doctor": frozenset({When.ON_CALL}),
        },
    ),
    Rule(
        "edgeline.updates never imports edgeline.daemon: the daemon imports updates, and hands the swap its "
        "processor as a protocol",
        scope=("edgeline.updates",),
        forbidden=("edgeline.daemon",),
    ),
    Rule(
        "paho is imported only by the daemon's MQTT layer (edgeline.daemon.mqtt, and its lean client "
        "edgeline.daemon.paho_lean) and, inside a function, by edgeline rollout's status watch "
        "(edgeline.updates.rollout, which may not import the daemon); everything else speaks MQTT through "
        "MqttConnection",
        scope=ALL_PACKAGES,
        forbidden=("paho",),
        allowed={
            "edgeline.daemon.mqtt": ANY_TIME,
            "edgeline.daemon.paho_lean": ANY_TIME,
            "edgeline.updates.rollout": frozenset({When.ON_CALL}),
        },
    ),
    Rule(
        "the device side never imports torch, coremltools or executorch at import time",
        scope=("edgeline",),
        forbidden=TORCH,
        when=frozenset({When.IMPORT_TIME}),
    ),
    Rule(
        "only export/ and the runtime backends (edgeline.backends, when a bundle asks for one) import torch, "
        "coremltools or executorch",
        scope=("edgeline", "edgeline.device_profiles", "edgeline.sim", "edgeline.firmware_bridge"),
        but=("edgeline.backends",),
        forbidden=TORCH,
    ),
    Rule(
        "the library never imports a command module (edgeline.cli and the modules of its COMMAND_MODULES): "
        "commands print what the library knows and the library (load, run, update) asks the library, never a "
        "command; a command may import another",
        scope=ALL_PACKAGES,
        but=COMMANDS,
        forbidden=COMMANDS,
    ),
)


# -- reading the imports -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository
    line: int
    importer: str  # the importing module, e.g. edgeline.daemon.mqtt
    imported: str  # a module, or module.name for ``from module import name``
    when: When

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.imported} ({self.when.value})"


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def folder_of(module: str) -> str | None:
    """The repository folder a module of ours lives in (pyproject's package-dir, longest match); None if not ours."""
    best = max((p for p in PACKAGE_DIR if within(module, p)), key=len, default=None)
    return PACKAGE_DIR[best] if best is not None else None


def module_of(path: Path) -> str:
    """``edge_runtime/daemon/mqtt.py`` -> ``edgeline.daemon.mqtt``; a package's ``__init__.py`` is the package."""
    relative = path.relative_to(ROOT)
    package = next(p for p, folder in PACKAGE_DIR.items() if folder == relative.parts[0])
    parts = [package, *relative.parts[1:-1]]
    if relative.stem != "__init__":
        parts.append(relative.stem)
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, path: str, importer: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every import statement of ``source``, absolute (relative imports resolved against ``importer``)."""

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def visit(nodes: list[ast.stmt], when: When) -> Iterator[Import]:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(path, node.lineno, importer, alias.name, when)
            elif isinstance(node, ast.ImportFrom):
                module = absolute(node)
                for alias in node.names:
                    name = module if alias.name == "*" else f"{module}.{alias.name}"
                    yield Import(path, node.lineno, importer, name, when)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(node.body, When.ON_CALL)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from visit(node.body, When.TYPE_CHECKING)
                yield from visit(node.orelse, when)
            else:  # classes, if/try/with/for/while/match bodies: they run when their enclosing block runs
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        yield from visit([child], when)
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        yield from visit(child.body, when)

    yield from visit(ast.parse(source, path).body, When.IMPORT_TIME)


def package_files() -> list[Path]:
    return sorted(path for folder in PACKAGE_DIR.values() for path in (ROOT / folder).rglob("*.py"))


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """Every import of every file of the packaged folders (read once per test run)."""
    found: list[Import] = []
    for path in package_files():
        relative = path.relative_to(ROOT).as_posix()
        found += imports_of(
            path.read_text(encoding="utf-8"), relative, module_of(path), is_package=path.stem == "__init__"
        )
    return tuple(found)


# -- checking ------------------------------------------------------------------------------------------------------


def _in_scope(module: str, rule: Rule) -> bool:
    return any(within(module, s) and folder_of(module) == folder_of(s) for s in rule.scope) and not any(
        within(module, b) for b in rule.but
    )


def broken(found: Import) -> list[str]:
    """The rules ``found`` breaks, each as one line naming the file, the line and the rule."""
    problems = []
    here, there = folder_of(found.importer), folder_of(found.imported)
    assert here is not None
    if there is not None and there != here and there not in LAYERS[here]:
        may = ", ".join(f"{f}/" for f in sorted(LAYERS[here])) or "nothing of ours"
        problems.append(f"{found}: {here}/ may import {may}, never {there}/ ({DOCUMENT})")
    for rule in RULES:
        if found.when not in rule.when or not _in_scope(found.importer, rule):
            continue
        if not any(within(found.imported, f) for f in rule.forbidden):
            continue
        if found.when in rule.allowed.get(found.importer, frozenset()):
            continue
        problems.append(f"{found}: {rule.says} ({DOCUMENT})")
    return problems


def test_every_import_of_the_package_follows_the_documented_directions() -> None:
    problems = [problem for found in all_imports() for problem in broken(found)]
    if problems:
        pytest.fail("imports against docs/architecture.md:\n" + "\n".join(problems), pytrace=False)


def test_the_check_reads_every_folder_and_every_kind_of_import() -> None:
    """A contract that reads nothing passes: every folder of package-dir has its files read, and all three kinds of
    import are met in the code (so a change of the reader that loses one fails here)."""
    found = all_imports()
    assert {folder_of(i.importer) for i in found} == set(LAYERS) == set(PACKAGE_DIR.values())
    assert {i.when for i in found} == set(When)


def test_the_named_exceptions_still_exist() -> None:
    """An exception for a module that is gone, or that no longer needs it, is a hole: remove it from the table."""
    imports = all_imports()
    for rule in RULES:
        for module, times in rule.allowed.items():
            used = {
                i.when for i in imports if i.importer == module and any(within(i.imported, f) for f in rule.forbidden)
            }
            assert used, f"{module} is a named exception of {rule.says!r} but imports none of {rule.forbidden}"
            assert used <= times, f"{module}: {used - times} is not among its allowed times"


# -- circles -------------------------------------------------------------------------------------------------------


def modules_of_ours() -> frozenset[str]:
    return frozenset(module_of(path) for path in package_files())


def named_module(imported: str, modules: frozenset[str]) -> str | None:
    """The module of ours an import names (``edgeline.updates.policy.X`` -> ``edgeline.updates.policy``,
    ``edgeline.updates.X`` -> the package ``edgeline.updates``): the longest of ``modules`` it is within."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


@dataclass(frozen=True)
class Circle:
    """Modules that import each other, through the imports that tie them (``path:line``)."""

    modules: tuple[str, ...]
    edges: tuple[tuple[str, Import], ...]
    """(the module imported, the import), for every import from one module of the circle to another."""

    def __str__(self) -> str:
        return f"a circle of {', '.join(self.modules)}:" + "".join(
            f"\n    {found.importer} -> {there}: {found}" for there, found in self.edges
        )


def strongly_connected(graph: Mapping[str, frozenset[str]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> the nodes it points to), without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []

    def enter(node: str) -> Iterator[str]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(graph.get(node, frozenset())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, enter(root))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    work.append((child, enter(child)))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = {stack.pop()}
                while node not in members:
                    members.add(stack.pop())
                on_stack -= members
                components.append(frozenset(members))
    return components


def circles(imports: tuple[Import, ...], modules: frozenset[str]) -> list[Circle]:
    """The import circles among ``modules``: every strongly connected component of more than one module."""
    edges: dict[str, list[tuple[str, Import]]] = defaultdict(list)
    for found in imports:
        there = named_module(found.imported, modules)
        if there is not None and there != found.importer:
            edges[found.importer].append((there, found))
    graph = {module: frozenset(there for there, _ in edges[module]) for module in modules}
    return [
        Circle(
            tuple(sorted(component)),
            tuple(
                (there, found) for module in sorted(component) for there, found in edges[module] if there in component
            ),
        )
        for component in strongly_connected(graph)
        if len(component) > 1
    ]


def test_product_code_has_no_import_circle() -> None:
    found = circles(all_imports(), modules_of_ours())
    if found:
        pytest.fail("import circles in product code:\n" + "\n".join(map(str, found)), pytrace=False)


def test_a_planted_circle_is_named_with_its_modules_and_the_file_and_line_of_each_import() -> None:
    source = "import json\ndef f():\n    import edgeline.bundle"
    planted = tuple(imports_of(source, "edge_runtime/errors.py", "edgeline.errors"))
    assert not [c for c in circles(all_imports(), modules_of_ours()) if "edgeline.errors" in c.modules]
    found = [c for c in circles(all_imports() + planted, modules_of_ours()) if "edgeline.errors" in c.modules]
    assert len(found) == 1 and {"edgeline.errors", "edgeline.bundle"} <= set(found[0].modules), found
    text = str(found[0])
    assert "edgeline.errors -> edgeline.bundle: edge_runtime/errors.py:3: imports edgeline.bundle" in text, text
    assert "edgeline.bundle -> edgeline.errors: edge_runtime/bundle.py:" in text, text


def _sample_imports(sources: dict[str, str]) -> tuple[Import, ...]:
    found: list[Import] = []
    for module, source in sources.items():
        found += imports_of(source, module.replace(".", "/") + ".py", module, is_package=module == "edgeline.updates")
    return tuple(found)


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        # a module of a package importing its sibling runs the package's __init__ first: no edge to it
        (
            {
                "edgeline.updates": "",
                "edgeline.updates.agent": "from edgeline.updates.policy import X",
                "edgeline.updates.policy": "import edgeline.updates.cage",
            },
            [],
        ),
        # the package's __init__ imports a module that imports a name of that __init__: truly circular
        (
            {
                "edgeline.updates": "from .agent import Agent",
                "edgeline.updates.agent": "from edgeline.updates import X",
                "edgeline.updates.policy": "",
            },
            [("edgeline.updates", "edgeline.updates.agent")],
        ),
        # ``from package import module`` names the module, not the package's __init__
        (
            {
                "edgeline.updates": "from .agent import Agent",
                "edgeline.updates.agent": "def f():\n    from edgeline.updates import policy",
                "edgeline.updates.policy": "",
            },
            [],
        ),
        # type-only and on-call imports count: three modules, one circle
        (
            {
                "edgeline.updates": "",
                "edgeline.updates.agent": "def f():\n    from . import policy",
                "edgeline.updates.policy": "if TYPE_CHECKING:\n    from edgeline.updates.cage import Cage",
                "edgeline.updates.cage": "import edgeline.updates.agent",
            },
            [("edgeline.updates.agent", "edgeline.updates.cage", "edgeline.updates.policy")],
        ),
    ],
)
def test_a_circle_is_a_strongly_connected_set_of_modules(
    sources: dict[str, str], expected: list[tuple[str, ...]]
) -> None:
    assert [c.modules for c in circles(_sample_imports(sources), frozenset(sources))] == expected


SAMPLE = """
from __future__ import annotations
import json
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from edgeline.daemon.processor import Processor
else:
    import edgeline.errors
try:
    import paho.mqtt.client as mqtt
except ImportError:
    from . import lean
class Thing:
    import edgeline.manifest
    def method(self):
        if TYPE_CHECKING:
            import edgeline.sim
        from ..export import cli
"""


def test_the_reader_sees_imports_where_they_hide() -> None:
    found = [(i.line, i.imported, i.when) for i in imports_of(SAMPLE, "x.py", "edgeline.updates.swap")]
    assert found == [
        (2, "__future__.annotations", When.IMPORT_TIME),
        (3, "json", When.IMPORT_TIME),
        (4, "typing.TYPE_CHECKING", When.IMPORT_TIME),
        (6, "edgeline.daemon.processor.Processor", When.TYPE_CHECKING),
        (8, "edgeline.errors", When.IMPORT_TIME),
        (10, "paho.mqtt.client", When.IMPORT_TIME),
        (12, "edgeline.updates.lean", When.IMPORT_TIME),
        (14, "edgeline.manifest", When.IMPORT_TIME),
        (17, "edgeline.sim", When.TYPE_CHECKING),
        (18, "edgeline.export.cli", When.ON_CALL),
    ]


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("edge_runtime/model.py", "from edgeline.export import pipeline", "edge_runtime/ may import device_profiles/"),
        ("edge_runtime/model.py", "def f():\n    import edgeline.daemon.codecs", "the library half of edgeline"),
        (
            "edge_runtime/updates/swap.py",
            "if TYPE_CHECKING:\n    import edgeline.daemon",
            "never imports edgeline.daemon",
        ),
        ("edge_runtime/daemon/processor.py", "import paho.mqtt.client", "paho is imported only"),
        ("edge_runtime/updates/rollout.py", "import paho.mqtt.client", "paho is imported only"),
        ("edge_runtime/backends/executorch.py", "import torch", "never imports torch"),
        ("edge_runtime/verify.py", "def f():\n    import torch", "only export/ and the runtime backends"),
        ("sim/fleet.py", "from edgeline.export.reference import registry", "sim/ may import"),
        ("firmware_bridge/link.py", "import edgeline.sim.board", "firmware_bridge/ may import"),
        ("device_profiles/schema.py", "from edgeline.errors import EdgelineError", "nothing of ours"),
        ("edge_runtime/model.py", "def f():\n    from edgeline.doctor import verdict_for", "never imports a command"),
        ("edge_runtime/updates/policy.py", "from edgeline import doctor", "never imports a command"),
        (
            "edge_runtime/updates/agent.py",
            "if TYPE_CHECKING:\n    from edgeline.verify import golden_check",
            "never imports a command",
        ),
        ("edge_runtime/manifest.py", "def f():\n    from edgeline.cli import main", "never imports a command"),
        ("sim/source.py", "from edgeline.sim.cli import make_sensors", "never imports a command"),
        ("export/pipeline.py", "from edgeline.export.reference.cli import register", "never imports a command"),
    ],
)
def test_a_wrong_import_is_named_with_its_file_line_and_rule(path: str, source: str, expected: str) -> None:
    importer = module_of(ROOT / path)
    problems = [p for i in imports_of(source, path, importer) for p in broken(i)]
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith(f"{path}:{source.count(chr(10)) + 1}: imports ")


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("edge_runtime/commands.py", "def f():\n    from edgeline.daemon.processor import Processor"),
        ("edge_runtime/daemon/service.py", "from edgeline.updates.agent import UpdateAgent"),
        ("edge_runtime/daemon/mqtt.py", "import paho.mqtt.client"),
        ("edge_runtime/updates/rollout.py", "def f():\n    import paho.mqtt.client"),
        ("edge_runtime/backends/executorch.py", "def f():\n    import torch"),
        ("sim/board.py", "from edgeline.firmware_bridge.protocol import Frame"),
        ("export/pipeline.py", "import torch\nfrom edgeline.model import load"),
        ("edge_runtime/verify.py", "from edgeline.commands import runtime_output"),
        ("edge_runtime/completion.py", "def f():\n    from edgeline.cli import build_parser"),
        ("edge_runtime/model.py", "def f():\n    from edgeline.verdicts import verdict_for"),
        ("edge_runtime/updates/agent.py", "def f():\n    from edgeline.bundle_checks import golden_check"),
    ],
)
def test_what_the_document_allows_passes(path: str, source: str) -> None:
    importer = module_of(ROOT / path)
    assert [p for i in imports_of(source, path, importer) for p in broken(i)] == []
