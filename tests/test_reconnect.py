"""The reconnection policy (``edgeline.daemon.reconnect``): pure, so its clock is the test's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgeline.daemon.reconnect import SHORT_LIVED_S, TAKEOVER_AFTER, TAKEOVER_BACKOFF_S, Backoff, Lost, Retry

pytestmark = [pytest.mark.quick, pytest.mark.device]


def test_failed_attempts_back_off_exponentially_up_to_the_cap() -> None:
    backoff = Backoff(max_s=10.0)
    steps = [backoff.next_delay(accepted=False) for _ in range(10)]
    for attempt, delay in enumerate(steps, start=1):
        step = min(10.0, 0.5 * 2 ** (attempt - 1))
        assert step / 2 <= delay <= step


def test_a_connection_that_lived_starts_afresh() -> None:
    backoff = Backoff(max_s=10.0)
    for _ in range(6):
        backoff.next_delay(accepted=False)
    backoff.connected(0.0)
    assert backoff.lost(SHORT_LIVED_S + 1) is Lost.LINK
    assert backoff.next_delay(accepted=True) <= 0.5


def test_connections_the_broker_keeps_ending_are_a_takeover_said_once_and_backed_off() -> None:
    backoff, now, verdicts, delays = Backoff(max_s=10.0), 0.0, [], []
    for _ in range(12):
        backoff.connected(now)
        now += 0.3  # the other clone connects and the broker closes us
        verdicts.append(backoff.lost(now))
        delays.append(backoff.next_delay(accepted=True))
        now += delays[-1]
    assert verdicts[: TAKEOVER_AFTER - 1] == [Lost.LINK] * (TAKEOVER_AFTER - 1)
    assert verdicts[TAKEOVER_AFTER - 1] is Lost.TAKEOVER
    assert set(verdicts[TAKEOVER_AFTER:]) == {Lost.TAKEOVER_AGAIN}
    assert backoff.takeovers == 12 - TAKEOVER_AFTER + 1
    assert delays[-1] >= TAKEOVER_BACKOFF_S / 2  # beyond reconnect_max_s: the clones stop taking turns
    assert now > 200  # twelve turns took minutes, not seconds


def test_reason_142_is_a_takeover_at_once_and_a_stable_connection_ends_it() -> None:
    backoff = Backoff(max_s=10.0)
    backoff.connected(0.0)
    assert backoff.lost(100.0, taken_over=True) is Lost.TAKEOVER
    backoff.connected(200.0)
    assert backoff.lost(200.0 + SHORT_LIVED_S + 1) is Lost.LINK  # it lived: over
    assert backoff.next_delay(accepted=True) <= 0.5


@given(st.lists(st.tuples(st.floats(0, 20), st.booleans(), st.booleans()), max_size=40))
def test_delays_stay_within_their_cap(events: list[tuple[float, bool, bool]]) -> None:
    backoff, now = Backoff(max_s=10.0), 0.0
    for lived, accepted, taken_over in events:
        backoff.connected(now)
        now += lived
        backoff.lost(now, taken_over=taken_over)
        delay = backoff.next_delay(accepted=accepted)
        assert 0 < delay <= backoff.cap_s <= TAKEOVER_BACKOFF_S
        now += delay


def test_a_broker_that_restarts_again_and_again_is_no_takeover() -> None:
    """Killed every few seconds: our connections end soon after they start, but attempts fail in between."""
    backoff, now = Backoff(max_s=10.0), 0.0
    for _ in range(10):
        backoff.connected(now)
        now += 3.0
        assert backoff.lost(now) is Lost.LINK
        now += backoff.next_delay(accepted=True)
        now += backoff.next_delay(accepted=False)  # refused while the broker starts again
    assert backoff.takeovers == 0


def test_retry_without_jitter_doubles_to_its_cap_and_starts_afresh_after_a_reset() -> None:
    retry = Retry(1.0, 30.0, jitter=False)  # the serial source's: 1, 2, 4, ... at most 30 s
    assert [retry.next_delay() for _ in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    retry.reset()
    assert retry.next_delay() == 1.0


def test_retry_with_jitter_stays_within_half_a_step_and_the_step() -> None:
    retry = Retry(0.5, 10.0, jitter=True)
    for attempt in range(1, 12):
        step = min(10.0, 0.5 * 2 ** (attempt - 1))
        assert step / 2 <= retry.next_delay() <= step
