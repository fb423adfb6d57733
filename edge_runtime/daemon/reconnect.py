"""When to try the broker again, and whether another client is taking our session: pure, the clock passed in.

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

__all__ = ["SHORT_LIVED_S", "TAKEOVER_AFTER", "TAKEOVER_BACKOFF_S", "Backoff", "Lost"]

SHORT_LIVED_S = 5.0
"""A connection the broker ends within this long after accepting it is short-lived."""
TAKEOVER_AFTER = 3
"""Short-lived connections in a row that say another client uses our client id (when no reason code says so)."""
TAKEOVER_BACKOFF_S = 60.0
"""The longest wait between attempts while our session is being taken over."""


class Lost(Enum):
    LINK = "link"
    """An ordinary loss: say it, reconnect."""
    TAKEOVER = "takeover"
    """Our session is being taken over, first seen now: say it once, as an error."""
    TAKEOVER_AGAIN = "takeover-again"
    """The same, again: counted, not said."""


class Backoff:
    def __init__(self, max_s: float):
        self.max_s = max_s
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
        step = min(self.cap_s, 0.5 * 2 ** max(self.attempt - 1, 0))
        return random.uniform(step / 2, step)
