"""The one way benchmarks print their table and commit it with the command that made it."""

from __future__ import annotations

import sys
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
