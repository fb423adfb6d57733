"""Keep converters and runtimes from touching the process: what they print on the file descriptors (absl, C++
logs, LiteRT's delegate line, progress bars) goes to a log, shown when a step fails (or with ``-v``), and any
root-logger setup they do is undone (executorch calls ``logging.basicConfig()`` on import and module-level
``logging.debug()`` while lowering, which would configure the caller's root logger).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CapturedOutput", "capture_native_output"]


@dataclass
class CapturedOutput:
    text: str = field(default="")


@contextlib.contextmanager
def capture_native_output() -> Iterator[CapturedOutput]:
    captured = CapturedOutput()
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
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
            root.handlers[:] = root_handlers
            root.setLevel(root_level)
