"""The one way benchmarks print their table and commit it with the command that made it."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    """Rows (the first one the header) as a markdown table, each column padded to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def publish(table: str, *, script: str, title: str, intro: str, write: Path | None) -> None:
    """Print ``table``; with ``write``, also save it under ``title`` with the exact command line and ``intro``.

    The file is rewritten whole: a hand-written reading of the numbers below the table must be redone after a run.
    """
    print(table)
    if write is None:
        return
    command = " ".join(["python", f"benchmarks/{Path(script).name}", *sys.argv[1:]])
    write.parent.mkdir(parents=True, exist_ok=True)
    write.write_text(f"# {title}\n\nCommand: `{command}`\n\n{intro}\n\n{table}\n")


def fresh_process_probe(code: str, bundle: Path, seconds: float, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``code`` (a probe that prints one JSON line with ``first_s``, measured from its own first line) on
    ``bundle`` in a fresh interpreter, as a device's daemon starts; its figures, plus ``spawn_to_first_s``: the
    interpreter's own start added to ``first_s``."""
    done = subprocess.run(
        [sys.executable, "-c", code, str(bundle), str(seconds)],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{bundle}: {done.stderr[-2000:]}")
    found: dict[str, float] = json.loads(lines[-1])
    found["spawn_to_first_s"] = found["first_s"] + _interpreter_start()
    return found


_START: list[float] = []


def _interpreter_start() -> float:
    """A bare ``python -c pass``: added to what each probe measured from its first line (median of 5, once)."""
    if not _START:
        samples = []
        for _ in range(5):
            begin = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            samples.append(time.perf_counter() - begin)
        _START.append(statistics.median(samples))
    return _START[0]
