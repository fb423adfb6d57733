"""Moved to ``edgeline.lograte`` (the one log throttle, now below the daemon so the update agent and the firmware
bridge share it). Kept only for ``edgeline.daemon.service``, which another change is splitting: remove this module
once it imports ``edgeline.lograte``."""

from edgeline.lograte import SUMMARY_EVERY_S, Repeated

__all__ = ["SUMMARY_EVERY_S", "Repeated"]
