"""How long the test suite takes: the quick tier, the whole suite, and runs of it in a row (one beside a CPU hog).

    python benchmarks/test_suite.py --quick --whole 3 --hog-run 3 --write benchmarks/results/test_suite.md
    python benchmarks/test_suite.py --ci-clone          # a fresh clone's .ci/run, in a temporary directory

Each run is a real ``bash scripts/test.sh`` (ruff, mypy and pytest on every core) in this work tree; the table gives
its wall time, the CPU it took (user + system of every process it started), the cores that kept busy
(CPU / wall), and pytest's own count of passed, failed, skipped and errors. The hog is one busy-looping process
per core at the same priority (``stress --cpu N``), started before the run and stopped after it. A run that fails
is reported as failed, with the tail of its output; nothing is retried.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^(?:=+ )?(?P<body>\d+ (?:passed|failed|error|errors|skipped)[^=\n]*) in [\d.]+s", re.MULTILINE)
"""pytest's last line, with or without its ``=`` rule (``-q`` drops it)."""


@dataclass
class Run:
    name: str
    wall_s: float
    cpu_s: float
    code: int
    summary: str
    tail: str

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(name: str, command: list[str], cwd: Path, log: Path) -> Run:
    """``command`` to the end, its output in ``log``; the CPU of every process it waited for."""
    before = _children_cpu()
    start = time.monotonic()
    with open(log, "wb") as out:
        code = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - start
    cpu = _children_cpu() - before
    text = log.read_text(encoding="utf-8", errors="replace")
    summaries = [match.group("body") for match in SUMMARY.finditer(text)]
    return Run(name, wall, cpu, code, " / ".join(summaries) or "(no pytest summary)", text[-3000:])


class Hog:
    """One busy loop per core at the suite's own priority, like ``stress --cpu N``: the tests get half the machine."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hog:
        for _ in range(os.cpu_count() or 1):
            self.processes.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def fresh_clone_ci(work: Path, log_dir: Path) -> Run:
    """``git clone`` of this repository's HEAD into ``work`` and its ``.ci/run``, from nothing (its own venvs, its
    own emulated installs and test cache)."""
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    return run("fresh clone: .ci/run", ["bash", ".ci/run"], clone, log_dir / "ci-clone.log")


def table(runs: list[Run]) -> str:
    lines = [
        "| run | wall | CPU | cores busy | exit | pytest |",
        "|---|---|---|---|---|---|",
    ]
    for item in runs:
        lines.append(
            f"| {item.name} | {item.wall_s / 60:.1f} min | {item.cpu_s / 60:.1f} min | {item.cores:.2f} | "
            f"{item.code} | {item.summary} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="time bash scripts/test.sh --quick")
    parser.add_argument("--whole", type=int, default=0, metavar="N", help="time N whole-suite runs in a row")
    parser.add_argument("--hog-run", type=int, default=0, metavar="K", help="run K of --whole beside a CPU hog")
    parser.add_argument("--ci-clone", action="store_true", help="time .ci/run in a fresh clone of HEAD")
    parser.add_argument("--logs", type=Path, default=REPO / "build" / "test-suite-logs")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) to this file")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    if args.quick:
        runs.append(run("quick tier", ["bash", "scripts/test.sh", "--quick"], REPO, args.logs / "quick.log"))
    for number in range(1, args.whole + 1):
        name = f"whole suite, run {number} of {args.whole}"
        command = ["bash", "scripts/test.sh"]
        if number == args.hog_run:
            with Hog():
                runs.append(run(name + " (beside a CPU hog)", command, REPO, args.logs / f"whole-{number}.log"))
        else:
            runs.append(run(name, command, REPO, args.logs / f"whole-{number}.log"))
    if args.ci_clone:
        work = Path(tempfile.mkdtemp(prefix="edgeline-ci-clone-"))
        try:
            runs.append(fresh_clone_ci(work, args.logs))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for item in runs:
        if item.code != 0:
            print(f"--- {item.name} failed (exit {item.code}); its output ends:\n{item.tail}\n", file=sys.stderr)
    text = table(runs)
    print(text)
    if args.write:
        args.write.write_text(text, encoding="utf-8")
    return 0 if all(item.code == 0 for item in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
