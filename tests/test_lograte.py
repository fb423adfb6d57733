"""The one log throttle, ``edgeline.lograte.Repeated``: a condition said when it starts, summarised while it lasts,
said when it ends; and, keyed with ``every_s=math.inf``, each kind said once and counted every time (the update
agent's use)."""

from __future__ import annotations

import logging
import math
import types

import pytest

from edgeline import lograte
from edgeline.lograte import Repeated

pytestmark = [pytest.mark.quick, pytest.mark.device]

log = logging.getLogger("tests.lograte")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(lograte, "time", types.SimpleNamespace(monotonic=clock))
    return clock


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == log.name]


def test_an_episode_is_said_when_it_starts_summarised_while_it_lasts_and_said_when_it_ends(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    full = Repeated(log, "outbox full", every_s=60.0)
    assert full.happened(1, "the oldest answers are dropped") is True
    for _ in range(99):
        clock.now += 0.1
        assert full.happened(1, "the oldest answers are dropped") is False
    clock.now += 60.0
    full.happened(1, "the oldest answers are dropped")  # a summary is due
    full.tick()
    clock.now += 60.0
    full.tick()  # quiet for every_s: over
    assert full.active is False
    assert lines(caplog) == [
        "outbox full: the oldest answers are dropped",
        "outbox full: 100 more in the last 70 s (101 since it started)",
        "outbox full: over (101 in 70 s; 101 since the process started)",
    ]
    assert (full.total, full.lines) == (101, 3)


def test_kinds_said_once_each_remembered_up_to_a_bound(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    said = Repeated(log, "", every_s=math.inf, remember=2)
    outcomes = [
        said.happened(1, "update check: unreachable", key="unreachable", level=logging.WARNING),
        said.happened(1, "update check: unreachable", key="unreachable", level=logging.WARNING),
        said.happened(1, "update refused (tampered): v3", key="v3", level=logging.WARNING),
    ]
    clock.now += 1e6  # never summarised, never over
    said.tick()
    outcomes.append(said.happened(1, "v4 found", key="v4", level=logging.INFO))  # forgets "unreachable"
    outcomes.append(said.happened(1, "update check: unreachable", key="unreachable", level=logging.WARNING))
    assert outcomes == [True, False, True, True, True]
    assert lines(caplog) == [
        "update check: unreachable",
        "update refused (tampered): v3",
        "v4 found",
        "update check: unreachable",
    ]
    assert [record.levelno for record in caplog.records] == [logging.WARNING, logging.WARNING, logging.INFO,
                                                              logging.WARNING]  # fmt: skip
    assert said.total == 5


def test_a_line_can_carry_the_traceback_of_the_exception_being_handled(caplog: pytest.LogCaptureFixture) -> None:
    said = Repeated(log, "", every_s=math.inf, remember=8)
    try:
        raise AttributeError("a bug of ours")
    except AttributeError:
        said.happened(1, "update check failed", level=logging.ERROR, exc_info=True)
    (record,) = caplog.records
    assert record.exc_info is not None and record.exc_info[0] is AttributeError


def test_shown_keeps_an_outsiders_text_on_one_printable_line_and_bounded() -> None:
    forged = "boot ok\n2026-01-01 CRITICAL edgeline: disk wiped\x1b[2J\u2028\x00"
    text = lograte.shown(forged)
    assert "\n" not in text and "\x1b" not in text and "\u2028" not in text and "\x00" not in text
    assert text.startswith("boot ok\\x0a2026-01-01 CRITICAL") and text.endswith("\\x1b[2J\\u2028\\x00")
    assert lograte.shown(b"\xff\xfeok") == "\\xff\\xfeok"
    long = lograte.shown("x" * 1000, limit=10)
    assert long == "x" * 10 + "... (990 more characters)"
    assert lograte.shown("plain text, é and 中文") == "plain text, é and 中文"
