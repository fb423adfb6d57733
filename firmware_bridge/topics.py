"""The bridge's default topics, apart so that registering ``edgeline bridge`` imports nothing heavy."""

from __future__ import annotations

__all__ = ["DEFAULT_ANSWERS", "DEFAULT_CONFIG", "DEFAULT_PUBLISH", "DEFAULT_RESULTS"]

DEFAULT_PUBLISH = "sensors/{device}/{stream}"
"""Where samples go: the daemon's default subscription (``sensors/+/+``) takes them, the device first."""
DEFAULT_ANSWERS = "edgeline/+/{device}/result"
"""What the bridge subscribes to for a board: the daemon's default answer topic, whatever the model's name."""
DEFAULT_RESULTS = "boards/{device}/{stream}/result"
"""Where a board's own inferences (RESULT frames) go: a tree of their own, never mistaken for the daemon's."""
DEFAULT_CONFIG = "boards/{device}/config"
"""Where an operator publishes a board's settings (JSON, retained), sent down as a CONFIG frame: at once, and again
whenever the board restarts."""
