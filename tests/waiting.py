"""One bounded wait for the tests: poll ``condition`` until it holds or ``timeout`` seconds pass (a hang guard, never
what decides a test). Modules bind their own default timeout: ``wait_until = partial(waiting.wait_until,
timeout=TIMEOUT_S)``."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(condition: Callable[[], object], timeout: float, every_s: float = 0.02) -> bool:
    """True once ``condition()`` is true; False if it still is not after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
