"""What a bundle needs in memory at run time, measured at export (the manifest's ``memory``).

The resident memory is measured in a fresh Python process that has imported only ``edgeline`` (as the device's
daemon does, without torch): its resident set size before the bundle is loaded and run once on a golden sample, and
after (``edgeline.memory.resident_mb_added``). TFLite Micro's arena is the one its recording allocator reports for
the model (what a firmware reserves in SRAM). A figure that cannot be measured is null and ``unknown`` says why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgeline.backends import goes_into_firmware
from edgeline.manifest import Memory

__all__ = ["TIMEOUT_S", "measure_memory", "not_measured"]

TIMEOUT_S = 120.0

_PROBE = """
import json, sys
import numpy as np
from edgeline.memory import UNMEASURABLE, resident_mb_added
from edgeline.model import load
from edgeline.native_output import capture_native_output

bundle, backend, model_file = sys.argv[1], sys.argv[2], sys.argv[3] or None
golden = np.load(f"{bundle}/golden.npz")
sample = [golden[f"input_{i}"][:1] for i in range(sum(k.startswith("input_") for k in golden.files))]
held = {}

def load_and_run():
    held["model"] = load(bundle, backend=backend, model_file=model_file, threads=1)
    held["model"].predict(*sample)
    return held["model"]

with capture_native_output():
    added = resident_mb_added(load_and_run)
arena = held["model"].arena_bytes
print(json.dumps({"resident_mb": added, "unmeasurable": UNMEASURABLE, "arena_bytes": arena,
                  "runtime": held["model"].runtime}))
"""


def not_measured(reason: str) -> Memory:
    return Memory(unknown={"resident_mb": reason})


def measure_memory(bundle: Path, backend: str, model_file: str | None, measured_on: str) -> Memory:
    """The memory the bundle at ``bundle`` needs, loaded with ``backend`` (its model or ``model_file``) and run once
    on its first golden sample, in a process of its own; ``measured_on`` says what ran it (for ``measured_with``)."""
    command = [sys.executable, "-c", _PROBE, str(bundle), backend, model_file or ""]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return not_measured(f"loading and running the model once took more than {TIMEOUT_S:g} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return not_measured(f"the measuring process failed (exit {done.returncode}): {last[:200]}")
    found = json.loads(lines[-1])
    unknown = {}
    if found["resident_mb"] is None:
        unknown["resident_mb"] = found["unmeasurable"]
    arena = goes_into_firmware(backend)  # its memory is TFLite Micro's tensor arena
    if arena and found["arena_bytes"] is None:
        unknown["arena_bytes"] = "TFLite Micro's allocator did not report the arena it used"
    runtime = found.get("runtime")
    if runtime == "python":
        measured_on += ", ExecuTorch's Python runtime (torch imported: no torch-free runtime here)"
    elif runtime is not None:
        measured_on += f", {runtime} runtime"
    return Memory(
        resident_mb=None if found["resident_mb"] is None else round(found["resident_mb"], 2),
        arena_bytes=found["arena_bytes"],
        measured_with=(
            f"{measured_on}: the tensor arena TFLite Micro's recording allocator reported, the model loaded and run "
            "once"
            if arena
            else f"{measured_on}: resident memory a fresh process gains loading the model and running it once"
        ),
        unknown=unknown,
    )
