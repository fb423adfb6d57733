"""The suite's own rules (tests/tiers.py): every test has exactly one cost tier, no quick test starts a broker or
converts a model, and every test is bounded in time by its tier. Run on small suites written here, with pytester."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import HAVE_TORCH
from tests.tiers import TIERS, TIMEOUT_S

pytestmark = pytest.mark.quick

INI = "[pytest]\naddopts = -p no:cacheprovider --strict-markers\nmarkers =\n" + "".join(f"    {t}: x\n" for t in TIERS)
CONFTEST = """
import pytest

pytest_plugins = ["tests.tiers"]


@pytest.fixture
def broker():
    return "a broker would start here"
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    return pytester


def test_a_test_without_a_tier_stops_the_run_naming_it(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_one="import pytest\n\n@pytest.mark.quick\ndef test_tiered(): pass\n\ndef test_bare(): pass\n")
    result = suite.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*tests without a proper cost tier*", "*test_one.py::test_bare: no tier*"])
    assert "test_tiered" not in result.stderr.str()


def test_two_tiers_are_refused_even_at_different_levels(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_two="import pytest\n\npytestmark = pytest.mark.quick\n\n@pytest.mark.integration\ndef test_both(): pass\n"
    )
    result = suite.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_two.py::test_both: two tiers (integration, quick)*"])


def test_a_quick_test_that_starts_a_broker_is_refused(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_three="import pytest\n\n@pytest.mark.quick\ndef test_cheap(broker): pass\n")
    result = suite.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_three.py::test_cheap: marked quick but uses broker (integration)*"])


def test_the_check_runs_before_selection_so_m_quick_cannot_hide_an_untiered_test(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_four="import pytest\n\n@pytest.mark.quick\ndef test_a(): pass\n\ndef test_b(): pass\n")
    result = suite.runpytest_inprocess("-m", "quick")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_four.py::test_b: no tier*"])


def test_each_tier_bounds_its_tests_unless_a_test_sets_its_own_timeout(suite: pytest.Pytester) -> None:
    quick, export = TIMEOUT_S["quick"], TIMEOUT_S["export"]
    suite.makepyfile(
        test_five=f"""
import pytest

@pytest.mark.quick
def test_quick(request):
    assert request.node.get_closest_marker("timeout").args == ({quick},)

@pytest.mark.export
def test_export(request):
    assert request.node.get_closest_marker("timeout").args == ({export},)

@pytest.mark.integration
@pytest.mark.timeout(7)
def test_own(request):
    assert request.node.get_closest_marker("timeout").args == (7,)
"""
    )
    result = suite.runpytest_inprocess()
    result.assert_outcomes(passed=3)


def test_markers_select_exactly_their_tier(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_six="import pytest\n\npytestmark = pytest.mark.integration\n\ndef test_a(): pass\n\ndef test_b(): pass\n",
        test_seven="import pytest\n\n@pytest.mark.quick\ndef test_c(): pass\n",
    )
    result = suite.runpytest_inprocess("-m", "quick")
    result.assert_outcomes(passed=1, deselected=2)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is absent (the device tier), and with it every conversion")
def test_a_quick_test_whose_body_converts_a_model_fails_naming_it_and_an_export_test_may(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = """
import pytest
import torch


@pytest.fixture
def shared_bundle():
    return torch.export.export(torch.nn.Flatten(), (torch.zeros(1, 2, 2),))  # a fixture may: made once, shared


def convert():
    torch.export.export(torch.nn.ReLU(), (torch.zeros(2),))


@pytest.mark.quick
def test_cheap_in_name_only():
    convert()


@pytest.mark.quick
def test_cheap(shared_bundle):
    assert shared_bundle is not None


@pytest.mark.export
def test_dear():
    assert torch.export.export.__name__ == "export"  # handed back after the quick tests, and not watched here
    convert()
"""
    suite.makepyfile(test_eight=body)
    # In a process of its own: this test's body is watched too (it is quick), and the inner suite converts.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    result = suite.runpytest_subprocess("-p", "no:xdist", timeout=100)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_eight.py::test_cheap_in_name_only: marked quick but converts a model"
            " (torch.export.export of ReLU, 1 time(s))*"
        ]
    )
