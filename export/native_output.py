"""Capture what converters print on the process's file descriptors (absl, C++ logs, progress bars).

The user sees our progress lines; the converter's own chatter goes to a log, shown when a step fails.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CapturedOutput", "capture_native_output"]


@dataclass
class CapturedOutput:
    text: str = field(default="")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.text.strip().splitlines()[-lines:])


@contextlib.contextmanager
def capture_native_output() -> Iterator[CapturedOutput]:
    captured = CapturedOutput()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile(mode="w+b") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                yield captured
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            log.seek(0)
            captured.text = log.read().decode("utf-8", errors="replace")
