"""Cost tiers: every test carries exactly one, so a developer can run the cheap part between two edits.

    quick        cheap: no broker, no daemon or bridge process, no conversion of its own (a short subprocess that
                 checks an import or a ``--help`` is fine): the tier a developer runs between two edits
                 (``bash scripts/test.sh --quick``). It may use the session's shared tiny bundles
                 (``built_litert_bundle``, ``sqrt_bundle``): converted once, cached by content.
    integration  a real Mosquitto, a daemon or bridge process, a pseudo-terminal, an emulated board: waits more
                 than it computes
    export       a real conversion (torch export, a quantizer, a compiler) or a reference model trained
    emulated     the device side on an emulated arm64 CPU (qemu-user, ``scripts/arm64.sh``)
    vm           a whole Debian machine booted with QEMU (KVM when usable), the project's systemd unit inside
                 (``scripts/vm.sh``); its image is built once and cached (build/vm)

A module whose tests all cost the same says so once (``pytestmark``); otherwise each test or class says its own.
Markers never override each other: ``-m quick`` selects exactly the tests marked quick. The tiers are orthogonal
to ``device`` and ``workstation`` (which install a test needs); all are registered in pyproject.toml.

This plugin refuses to run a collection in which a test has no tier or two, or is marked quick while it asks for a
fixture that starts a broker or converts a model; fails a quick test whose body converts a model all the same
(``torch.export.export``, where every exporter of ours starts, is watched while a quick test runs; the session's
shared tiny bundles are made in fixtures, before); each tier also bounds its tests' time (pytest-timeout), unless a
test sets its own ``timeout``.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any

import pytest

__all__ = ["COSTLY_FIXTURES", "TIERS", "TIMEOUT_S", "tier_problems"]

TIERS = ("quick", "integration", "export", "emulated", "vm")
TIMEOUT_S = {"quick": 120, "integration": 300, "export": 1200, "emulated": 1800, "vm": 1800}
"""Per test, fixtures included: a hang fails its own test rather than the whole run. The quick tier's bound leaves
room for the session's tiny bundles being converted once on a cold cache."""

COSTLY_FIXTURES = {
    "broker": "integration",
    "session_broker": "integration",
    "stock_broker": "integration",
    "broker_factory": "integration",
    "durable_broker": "integration",
    "answers": "integration",
    "publisher": "integration",
    "camera_server": "integration",
    "batchable_bundle": "export",
    "lookup_bundle": "export",
    "vm_image": "vm",
    "vm_run": "vm",
}
"""Fixtures a quick test must not use, and the tier their cost puts a test in."""

_HELP = "mark it with one of pytest.mark." + ", pytest.mark.".join(TIERS) + " (tests/tiers.py says which is which)"


def tier_problems(items: list[pytest.Item]) -> list[str]:
    """One line per test whose tier is missing, doubled, or cheaper than a fixture it uses."""
    problems = []
    for item in items:
        tiers = sorted({marker.name for marker in item.iter_markers() if marker.name in TIERS})
        if not tiers:
            problems.append(f"{item.nodeid}: no tier: {_HELP}")
        elif len(tiers) > 1:
            problems.append(f"{item.nodeid}: two tiers ({', '.join(tiers)}): keep the one its cost puts it in")
        elif tiers[0] == "quick":
            costly = sorted(
                f"{name} ({COSTLY_FIXTURES[name]})"
                for name in getattr(item, "fixturenames", ())
                if name in COSTLY_FIXTURES
            )
            if costly:
                problems.append(f"{item.nodeid}: marked quick but uses {', '.join(costly)}")
    return problems


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before ``-m`` deselects anything: every collected test has one tier; each gets its tier's time bound; the
    collection is put in the order that keeps every core busy (``START_ORDER``)."""
    problems = tier_problems(items)
    if problems:
        raise pytest.UsageError("tests without a proper cost tier:\n  " + "\n  ".join(problems))
    module_rank: dict[str, int] = {}
    for item in items:
        tier = next(marker.name for marker in item.iter_markers() if marker.name in TIERS)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[tier]))
        module = item.nodeid.split("::", 1)[0]
        module_rank[module] = max(module_rank.get(module, 0), COST_ORDER.index(tier))
    items.sort(key=lambda item: START_ORDER.index(COST_ORDER[module_rank[item.nodeid.split("::", 1)[0]]]))


COST_ORDER = ("quick", "integration", "export", "emulated", "vm")
"""A module costs what its dearest test costs."""
START_ORDER = ("export", "integration", "quick", "emulated", "vm")
"""Whole modules, in this order (a stable sort: modules stay whole, so their fixtures are made once per process):
conversions first, while every core is free for them; the emulated and VM tiers last, so the emulated installs and
the VM image that scripts/test.sh starts building at once are ready when they come (their tests wait for
the builds' locks otherwise)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """A quick test's body that converts a model fails, naming what it traced: its cost is the export tier's.
    ``torch.export.export`` is where every exporter of ours starts (export/conversion.py); it is watched, and called
    through, only while a quick test's body runs and only where torch is imported (not in the device tier)."""
    export = sys.modules.get("torch.export")
    if export is None or item.get_closest_marker("quick") is None:
        return (yield)
    original = export.export
    traced: list[str] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        traced.append(type(args[0]).__name__ if args else "a module")
        return original(*args, **kwargs)

    export.export = watched
    try:
        result = yield
    finally:
        export.export = original
    if traced:
        what = ", ".join(sorted(set(traced)))
        pytest.fail(
            f"{item.nodeid}: marked quick but converts a model (torch.export.export of {what}, {len(traced)} time(s)):"
            " mark it export, or use a session's shared bundle",
            pytrace=False,
        )
    return result
