"""Reliable mode on one stream of one board session, without I/O: which frame is taken, and where the stream starts.

The host takes a stream's reliable frames in order from its start, and acknowledges (``ACK``) only frames taken and
made safe: an ``ACK`` covers every earlier frame too, so a start set one frame too late acknowledges a frame nobody
took, and the board forgets it. The start is the ``seq`` the board's ``HELLO`` gives for the stream (the oldest frame
it holds unacknowledged). Without it, the start is *learned*, never assumed from the first frame seen (that one may
come after a frame the wire damaged, or out of order):

- The board resends its whole window, in order, right after it answers a ``HELLO_REQUEST`` (go-back-N). So the first
  reliable frame of the stream after a ``HELLO`` the host asked for is the window's oldest, provided nothing was
  refused on the wire in between (a damaged frame may have been it): that is a *candidate*.
- A candidate is confirmed by asking again: when the first frame after the next ``HELLO`` asked for is the same
  ``seq``, the start is known and that frame is taken. Nothing is acknowledged meanwhile, so the board's window
  cannot move under the host.
- Anything else (a refusal in between, a disagreement, a frame behind the candidate) starts over: ``admit`` says
  ``ask`` when the host should ask for a ``HELLO`` (the link paces and bounds how often).

Until then every reliable frame of the stream is ``unknown``: not taken, not acknowledged (the board keeps it and
resends it)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from edgeline.firmware_bridge.protocol import SEQ_MODULO

__all__ = ["ReliableStream", "Verdict", "not_after"]

Verdict = Literal["take", "resend", "ahead", "unknown", "ask"]
"""What to do with a reliable frame: ``take`` it (the next one); a ``resend`` of one taken; ``ahead`` of one lost
(not taken: the board goes back to it); ``unknown``: the stream's start is not learned yet (not taken); ``ask``: the
same, and the host should ask for a ``HELLO`` to learn it."""


@dataclass
class ReliableStream:
    """Reliable-mode state of one stream in one session: what is taken and not yet safe, how far it is safe, and,
    while its start is not known, what was learned of it (see the module)."""

    expected: int | None
    """The next frame to take; None while the start is not known."""
    pending: deque[list[int]] = field(default_factory=deque)
    """[seq, samples not safe yet], oldest first."""
    safe_through: int | None = None
    listening: bool = False
    """A HELLO the host asked for came, and no reliable frame of this stream since."""
    clean_since_hello: bool = False
    """Nothing was refused on the wire since that HELLO (set by the link as bytes come)."""
    candidate: int | None = None
    """The start the last go-back said, waiting to be confirmed by the next."""

    def heard_hello(self, clean: bool = True) -> None:
        """A HELLO the host asked for: the next reliable frame of this stream is the board's go-back. ``clean``: the
        host cannot tell of a refusal after the HELLO (bytes it decoded at once with it refused nothing)."""
        if self.expected is None:
            self.listening = True
            self.clean_since_hello = clean

    def admit(self, seq: int) -> Verdict:
        if self.expected is None:
            return self._learn(seq)
        ahead = (seq - self.expected) % SEQ_MODULO
        if ahead == 0:
            self.expected = (seq + 1) % SEQ_MODULO
            return "take"
        return "ahead" if ahead < SEQ_MODULO // 2 else "resend"

    def _learn(self, seq: int) -> Verdict:
        if self.listening:
            self.listening = False
            if not self.clean_since_hello:  # the go-back's first frame may be the one refused
                self.candidate = None
                return "ask"
            if self.candidate == seq:  # two go-backs agree: the start
                self.expected, self.candidate = seq, None
                return self.admit(seq)
            self.candidate = seq
            return "ask"  # to confirm it
        if self.candidate is None:
            return "ask"
        behind = (self.candidate - seq) % SEQ_MODULO
        if 0 < behind < SEQ_MODULO // 2:  # the board holds an older frame than the candidate: not its start
            self.candidate = None
            return "ask"
        return "unknown"


def not_after(seq: int, reference: int) -> bool:
    return (reference - seq) % SEQ_MODULO < SEQ_MODULO // 2
