"""Twins across bridges: two boards that say the same ``device`` (a cloned firmware image), each on its own bridge.

Each bridge claims the boards it serves on ``edgeline/board-claims/{device}``, retained: ``{"instance", "port",
"boot", "n"}``, again at every status message while the board is heard (``n`` counts up). A retained claim may be
a bridge's that is gone (the board moved); a claim that *changes* is a live bridge's. ``Claims.received`` says
whether another bridge's claim makes the board served here a twin; the bridge counts and says it. Neither bridge
serves the other's answers in any case: the input ids name the bridge (``link.input_id``). A bridge that stops
clears (an empty retained message) each claim that is still its own, so a board that moves to another bridge is
not met by a claim of one gone.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

__all__ = ["CLAIMS", "Claims"]

CLAIMS = "edgeline/board-claims/{device}"


class Claims:
    def __init__(self, instance: str, publish: Callable[[str, bytes], object]):
        """``publish(topic, payload)``: retained, QoS 1."""
        self.instance = instance
        self.publish = publish
        self.prefix = CLAIMS.format(device="")
        self.topic_filter = CLAIMS.format(device="+")
        self._number = 0
        self._seen: dict[tuple[str, str], int] = {}
        """The last claim number seen from another bridge, by (device, its instance)."""
        self._holder: dict[str, str] = {}
        """The instance of the last claim the broker sent, by device: this bridge's own claims included."""

    def claim(self, device: str, port: str, boot: int | None) -> None:
        self._number += 1
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
        if not isinstance(claim, dict) or not isinstance(claim.get("instance"), str):
            self._holder.pop(device, None)  # cleared (an empty message), or not a claim
            return None
        self._holder[device] = claim["instance"]
        if claim["instance"] == self.instance:
            return None
        other, number = str(claim["instance"]), claim.get("n")
        seen = self._seen.get((device, other))
        self._seen[(device, other)] = number if isinstance(number, int) else 0
        if seen is None or seen == number:
            return None  # the first one may be retained (a bridge gone since); the next one, changed, is live
        return device, other, str(claim.get("port"))

    def release(self) -> int:
        """Clear every claim the broker last said is this bridge's (at a clean stop); how many."""
        mine = [device for device, holder in self._holder.items() if holder == self.instance]
        for device in mine:
            self.publish(CLAIMS.format(device=device), b"")
        return len(mine)
