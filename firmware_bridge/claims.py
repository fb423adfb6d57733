"""Twins across bridges: two boards that say the same ``device`` (a cloned firmware image), each on its own bridge.

Each bridge claims the boards it serves on ``edgeline/board-claims/{device}``, retained: ``{"instance", "port",
"boot", "n"}``, again at every status message while the board is heard (``n`` counts up). A retained claim may be
a bridge's that is gone (the board moved); a claim that *changes* is a live bridge's. ``Claims.received`` says
whether another bridge's claim makes the board served here a twin; the bridge counts and says it. Neither bridge
serves the other's answers in any case: the input ids name the bridge (``link.input_id``). A bridge clears (an
empty retained message) each claim that is still its own when it stops, and a name's claim when no port of it
serves that name any more (``forget``: a board renamed), so that a board that moves to another bridge is not met by
a claim of one gone, and a board that says a new name at every HELLO leaves no claim behind on the broker.

What it keeps is bounded by the names the bridge serves (``serves``): claims of other names, which every bridge
sees on its subscription, are not kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import orjson

__all__ = ["CLAIMS", "Claims"]

CLAIMS = "edgeline/board-claims/{device}"
MAX_SEEN = 1024
"""Claims of other bridges remembered, at most (the oldest forgotten first): one per twin of a name served here."""


class Claims:
    def __init__(
        self, instance: str, publish: Callable[[str, bytes], object], serves: Callable[[str], bool] | None = None
    ):
        """``publish(topic, payload)``: retained, QoS 1. ``serves(device)``: whether the bridge serves that name (by
        default every name: nothing is left out)."""
        self.instance = instance
        self.publish = publish
        self.serves = serves
        self.prefix = CLAIMS.format(device="")
        self.topic_filter = CLAIMS.format(device="+")
        self._lock = threading.Lock()
        """``received`` runs on the MQTT thread, the rest on the bridge's."""
        self._number = 0
        self._seen: dict[tuple[str, str], int] = {}
        """The last claim number seen from another bridge, by (device, its instance)."""
        self._holder: dict[str, str] = {}
        """The instance of the last claim the broker sent, by device: this bridge's own claims included."""
        self._claimed: set[str] = set()
        """The names this bridge claimed and has not cleared: what it clears when it stops or lets a name go."""

    @property
    def tracked(self) -> int:
        """Entries kept, all names together."""
        return len(self._seen) + len(self._holder) + len(self._claimed)

    def claim(self, device: str, port: str, boot: int | None) -> None:
        with self._lock:
            self._number += 1
            self._claimed.add(device)
            claim = {"instance": self.instance, "port": port, "boot": boot, "n": self._number}
        self.publish(CLAIMS.format(device=device), orjson.dumps(claim))

    def received(self, topic: str, payload: bytes) -> tuple[str, str, str] | None:
        """(device, the other bridge's instance, its port) when this claim is another bridge's live claim (it
        changed since the last one seen); None otherwise (ours, the first one seen, or not a claim)."""
        device = topic[len(self.prefix) :]
        try:
            claim = orjson.loads(payload)
        except orjson.JSONDecodeError:
            claim = None
        with self._lock:
            if self.serves is not None and not self.serves(device) and device not in self._holder:
                return None  # a name not served here: nothing to keep
            if not isinstance(claim, dict) or not isinstance(claim.get("instance"), str):
                self._holder.pop(device, None)  # cleared (an empty message), or not a claim
                return None
            self._holder[device] = claim["instance"]
            if claim["instance"] == self.instance:
                return None
            other, number = str(claim["instance"]), claim.get("n")
            seen = self._seen.pop((device, other), None)
            self._seen[(device, other)] = number if isinstance(number, int) else 0
            while len(self._seen) > MAX_SEEN:
                del self._seen[next(iter(self._seen))]
        if seen is None or seen == number:
            return None  # the first one may be retained (a bridge gone since); the next one, changed, is live
        return device, other, str(claim.get("port"))

    def forget(self, device: str) -> bool:
        """No port of this bridge serves ``device`` any more: its claim is cleared if it is still this bridge's (or
        the broker has not said whose it is yet), and nothing of the name is kept. Whether it was cleared."""
        with self._lock:
            holder = self._holder.pop(device, None)
            for key in [key for key in self._seen if key[0] == device]:
                del self._seen[key]
            mine = device in self._claimed and holder in (None, self.instance)
            self._claimed.discard(device)
        if mine:
            self.publish(CLAIMS.format(device=device), b"")
        return mine

    def release(self) -> int:
        """Clear every claim the broker last said is this bridge's (at a clean stop); how many."""
        with self._lock:
            mine = [device for device, holder in self._holder.items() if holder == self.instance]
            mine += [device for device in self._claimed if device not in self._holder]  # not echoed yet
            self._claimed.difference_update(mine)
        for device in mine:
            self.publish(CLAIMS.format(device=device), b"")
        return len(mine)
