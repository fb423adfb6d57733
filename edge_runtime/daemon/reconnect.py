"""When to try again: the one back-off of the daemon and the firmware bridge, pure, the clock passed in.

``Retry`` is the delay arithmetic every reconnecting part uses (the broker, a serial port, a board's link): a step
that doubles from ``first_s`` up to a cap, with or without full jitter. ``Backoff`` is the broker's policy on top of
it, which also tells whether another client is taking our session:

    attempt fails, or a connection ends ──► the next delay: full jitter, uniform in [step/2, step], the step
                                            doubling from 0.5 s up to ``[broker] reconnect_max_s``
    a connection that lived ≥ SHORT_LIVED_S ──► starts afresh at 0.5 s
    connections the broker ends within SHORT_LIVED_S of accepting them, each accepted at the first attempt
    after the last, TAKEOVER_AFTER times in a row (or MQTT 5's reason 142)
        ──► our session is being taken over (a cloned device, two daemons with one instance): said once,
            counted, and the step grows up to a minute instead

Mosquitto 2.0.11 closes the older of two connections with one client id without sending reason 142, so the
pattern is what tells a takeover; without it two clones took turns about once a second, for ever. A broker that
restarts ends connections soon after accepting them too, but between them our attempts are refused for a while:
a connection that took more than one attempt does not count.
"""

from __future__ import annotations

import random
from enum import Enum

__all__ = ["SHORT_LIVED_S", "TAKEOVER_AFTER", "TAKEOVER_BACKOFF_S", "Backoff", "Lost", "Retry"]

SHORT_LIVED_S = 5.0
"""A connection the broker ends within this long after accepting it is short-lived."""
TAKEOVER_AFTER = 3
"""Short-lived connections in a row that say another client uses our client id (when no reason code says so)."""
TAKEOVER_BACKOFF_S = 60.0
"""The longest wait between attempts while our session is being taken over."""


class Retry:
    """Capped exponential delays: ``first_s``, doubling at each attempt, at most ``max_s``.

    With ``jitter`` a delay is uniform in [step/2, step] (full jitter, halved): many clients that lost one broker
    at once do not come back at once. Without it the step itself, for a port only this process opens (a serial
    device), where a predictable retry reads better in the log.
    """

    def __init__(self, first_s: float, max_s: float, *, jitter: bool):
        self.first_s = first_s
        self.max_s = max_s
        self.jitter = jitter
        self.attempt = 0
        """Attempts since the last ``reset``: the next delay is the one of attempt ``attempt + 1``."""

    def delay(self, attempt: int, cap_s: float | None = None) -> float:
        """The delay after failed attempt number ``attempt`` (from 1), at most ``cap_s`` (default ``max_s``)."""
        step = min(self.max_s if cap_s is None else cap_s, self.first_s * 2 ** max(attempt - 1, 0))
        return random.uniform(step / 2, step) if self.jitter else step

    def next_delay(self) -> float:
        """One more failed attempt: how long to wait before the next."""
        self.attempt += 1
        return self.delay(self.attempt)

    def reset(self) -> None:
        """It worked: the next failure waits ``first_s`` again."""
        self.attempt = 0


class Lost(Enum):
    LINK = "link"
    """An ordinary loss: say it, reconnect."""
    TAKEOVER = "takeover"
    """Our session is being taken over, first seen now: say it once, as an error."""
    TAKEOVER_AGAIN = "takeover-again"
    """The same, again: counted, not said."""


class Backoff:
    """The broker's reconnection policy (see the module): ``Retry`` with jitter from 0.5 s, its cap raised while
    our session is being taken over."""

    def __init__(self, max_s: float):
        self.max_s = max_s
        self._retry = Retry(0.5, max_s, jitter=True)
        self.attempt = 0
        self.short_lived = 0
        """Connections in a row that the broker ended soon after accepting them."""
        self.takeovers = 0
        """Connections ended in a way that says another client took our session."""
        self._connected_at: float | None = None
        self._in_takeover = False
        self._refused = False
        """An attempt failed since the last connection was accepted (the broker was away)."""
        self._at_first_attempt = False

    @property
    def cap_s(self) -> float:
        return max(self.max_s, TAKEOVER_BACKOFF_S) if self._in_takeover else self.max_s

    def connected(self, now: float) -> None:
        self._connected_at = now
        self._at_first_attempt, self._refused = not self._refused, False

    def lost(self, now: float, *, taken_over: bool = False) -> Lost:
        """A connection the broker had accepted ended (not by us)."""
        lived = now - self._connected_at if self._connected_at is not None else SHORT_LIVED_S
        self._connected_at = None
        if lived < SHORT_LIVED_S and self._at_first_attempt:
            self.short_lived += 1
        else:
            self.short_lived = 0
            self._in_takeover = False
        if not (taken_over or self.short_lived >= TAKEOVER_AFTER):
            return Lost.TAKEOVER_AGAIN if self._in_takeover else Lost.LINK
        self.takeovers += 1
        first, self._in_takeover = not self._in_takeover, True
        return Lost.TAKEOVER if first else Lost.TAKEOVER_AGAIN

    def next_delay(self, *, accepted: bool) -> float:
        """After an attempt or a connection: how long to wait. ``accepted``: the broker had accepted it (a
        connection that was accepted and lived starts the back-off afresh; one that never got a CONNACK, or a
        short-lived one, goes on with it)."""
        if not accepted:
            self._refused = True
        self.attempt = 1 if accepted and not self.short_lived else self.attempt + 1
        return self._retry.delay(self.attempt, self.cap_s)
