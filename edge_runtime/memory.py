"""The resident memory a model adds to a process: what ``verify`` measures here and export records in the manifest.

The figure is the process's resident set size (``VmRSS`` in ``/proc/self/status``) after the model was loaded and
run once, minus the same figure before, the model still referenced at the second reading: its weights, arena and
runtime (a runtime library not loaded before counts too: the device's process pays for it as well). Not
``getrusage().ru_maxrss``: that is the process's peak since it started, so in a process that had already peaked
higher (export, after its conversions) loading a model adds nothing to it and the difference reads 0. A transient
peak inside the load, freed before the second reading, is not part of the figure. Linux only (no ``/proc``
elsewhere): None there, and ``UNMEASURABLE`` says why.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

__all__ = ["UNMEASURABLE", "available_mb", "resident_mb", "resident_mb_added"]

STATUS = Path("/proc/self/status")
MEMINFO = Path("/proc/meminfo")
UNMEASURABLE = "this system has no /proc/self/status to read the resident set size from (Linux has)"


def _mb_field(path: Path, key: str) -> float | None:
    """A ``KEY:  N kB`` line of a /proc file, in MB; None where the file or the line cannot be read."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            fields = line.split()
            if len(fields) >= 3 and fields[2].lower() == "kb" and fields[1].isdigit():
                return int(fields[1]) / 1024
    return None


def resident_mb(status: Path = STATUS) -> float | None:
    """The process's resident set size in MB (MiB, as profiles count ``memory_mb``), or None where unreadable."""
    return _mb_field(status, "VmRSS")


def resident_mb_added(load_and_run: Callable[[], object]) -> float | None:
    """MB of resident memory that ``load_and_run()`` (load a model, run it once, return it) adds to this process
    while what it returns is alive; None where the resident set size cannot be read (``UNMEASURABLE``). Never
    negative: memory the collector happened to free meanwhile is not the model's."""
    gc.collect()
    before = resident_mb()
    if before is None:
        return None
    kept = load_and_run()
    after = resident_mb()
    del kept
    return None if after is None else max(0.0, after - before)


def available_mb(meminfo: Path = MEMINFO) -> float | None:
    """The memory this machine can give a new allocation without swapping, in MB (``MemAvailable`` in
    ``/proc/meminfo``: free memory plus the caches the kernel would drop); None where unreadable."""
    return _mb_field(meminfo, "MemAvailable")
