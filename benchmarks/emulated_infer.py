"""`edgeline infer` as a whole process, side by side: natively on this x86-64 host and emulated (scripts/arm64.sh:
qemu-user with the CPU pinned to a Cortex-A72, a Raspberry Pi 4's core, and a Cortex-A76, a Pi 5's), on the same
bundles of the reference models: rpi5 litert int8-static, rpi5 litert fp32 and jetson-orin-nano onnxruntime fp32.

Each cell is ``edgeline infer BUNDLE --input VALIDATION.npz --json`` started ``--repeats`` times (stdout drained from
a pipe, its JSON lines counted); per start: the wall clock from spawn to exit, and the child's ``ru_maxrss`` and CPU
time from ``os.wait4`` on its pid. The emulated chain (bash -> sh -> qemu-aarch64) is all ``exec``, so that pid is
qemu at the end and its figures include qemu's own memory and work. One more start per cell without ``--json`` gives
the per-sample median latency ``infer`` prints itself (``--no-latency`` leaves it out).

    python benchmarks/emulated_infer.py --work artifacts/bench --write benchmarks/results/emulated_infer.md

Bundles are taken from WORK/bundles/MODEL-PROFILE-BACKEND-PRECISION when one is there (``--fresh`` exports again),
else exported as benchmarks/accelerators.py does; reference models are prepared under WORK/MODEL. Emulated figures
are qemu's speed on this host: never a device timing, never compared with a device budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerators import export_target, single_target_profile  # benchmarks/accelerators.py, next to this script
from report import markdown_table, publish  # benchmarks/report.py, next to this script

REPO = Path(__file__).resolve().parents[1]
ARM64 = REPO / "scripts" / "arm64.sh"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
BUNDLES = (
    ("rpi5", "litert", "int8-static"),
    ("rpi5", "litert", "fp32"),
    ("jetson-orin-nano", "onnxruntime", "fp32"),
)
CPUS = {"cortex-a72": "Raspberry Pi 4's core", "cortex-a76": "Raspberry Pi 5's core"}
RUN_TIMEOUT_S = 1200.0
"""No single start runs longer than this: it is killed and reported as a timeout."""
QUIET_POLL_S = 30.0
MEDIAN_LINE = re.compile(r"median ([0-9.]+) ms per sample")


# -- the machine ---------------------------------------------------------------------------------------------


def machine_busy_s() -> float:
    """Busy CPU seconds of all CPUs since boot (``/proc/stat``: everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return (sum(values) - values[3] - values[4]) / CLOCK_TICKS


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def other_emulations() -> list[str]:
    """Command lines of qemu-aarch64 processes that are not ours (``pgrep -af qemu-aarch64``)."""
    found = subprocess.run(["pgrep", "-af", "qemu-aarch64"], capture_output=True, text=True, check=False).stdout
    return [line[:160] for line in found.splitlines() if line.strip()]


def wait_quiet(limit_s: float) -> tuple[float, list[str]]:
    """Poll every 30 s until no qemu-aarch64 runs, at most ``limit_s``: (seconds waited, what still ran)."""
    began = time.monotonic()
    while True:
        others = other_emulations()
        waited = time.monotonic() - began
        if not others or waited >= limit_s:
            return waited, others
        print(f"waiting for another emulation to end ({waited:.0f} s): {others[0]}", file=sys.stderr, flush=True)
        time.sleep(QUIET_POLL_S)


# -- one start -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Platform:
    key: str
    label: str
    prefix: tuple[str, ...]
    emulated: bool


@dataclass(frozen=True)
class Run:
    wall_s: float
    maxrss_kib: int
    cpu_s: float
    others_cores: float
    exit_code: int
    lines: int
    stdout_tail: str
    stderr_tail: str
    timed_out: bool


def start(argv: list[str], scratch: Path, keep_stdout: bool = False) -> Run:
    """Spawn ``argv`` (stdout a pipe drained here), wait for it with ``os.wait4``; wall clock from spawn to exit."""
    err_path = scratch / "stderr.log"
    timed_out = threading.Event()
    with open(err_path, "wb") as err:
        busy0, own0 = machine_busy_s(), own_cpu_s()
        t0 = time.perf_counter()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, cwd=REPO)

        def kill() -> None:
            timed_out.set()
            process.kill()  # our own child, by its pid

        timer = threading.Timer(RUN_TIMEOUT_S, kill)
        timer.start()
        assert process.stdout is not None
        lines = 0
        kept = bytearray()
        while chunk := process.stdout.read1(1 << 20):
            lines += chunk.count(b"\n")
            if keep_stdout:
                kept += chunk
            else:
                kept = kept[-2000:] + chunk[-2000:]
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - t0
        timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        process.stdout.close()
        busy, own = machine_busy_s() - busy0, own_cpu_s() - own0
    cpu = usage.ru_utime + usage.ru_stime
    return Run(
        wall_s=wall,
        maxrss_kib=usage.ru_maxrss,
        cpu_s=cpu,
        others_cores=max(0.0, (busy - cpu - own) / wall),
        exit_code=process.returncode,
        lines=lines,
        stdout_tail=kept.decode(errors="replace")[-4000:],
        stderr_tail=err_path.read_text(errors="replace")[-1500:],
        timed_out=timed_out.is_set(),
    )


# -- cells ---------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    model: str
    bundle: str
    platform: Platform
    samples: int
    runs: list[Run] = field(default_factory=list)
    latency_ms: float | None = None
    latency_note: str = ""

    def ok(self) -> list[Run]:
        return [r for r in self.runs if r.exit_code == 0 and not r.timed_out and r.lines == self.samples]

    def failures(self) -> list[Run]:
        return [r for r in self.runs if r not in self.ok()]

    def median_wall(self) -> float | None:
        ok = self.ok()
        return statistics.median(r.wall_s for r in ok) if ok else None


def describe_failure(run: Run, samples: int) -> str:
    if run.timed_out:
        what = f"killed after {RUN_TIMEOUT_S:.0f} s"
    elif run.exit_code != 0:
        what = f"exit code {run.exit_code}"
    else:
        what = f"{run.lines} JSON lines for {samples} samples"
    last = " / ".join(line.strip() for line in run.stderr_tail.strip().splitlines()[-3:])
    return f"{what} after {run.wall_s:.1f} s; stderr ends: {last or '(empty)'}"


def infer_argv(platform: Platform, bundle: Path, validation: Path, *, as_json: bool) -> list[str]:
    return [*platform.prefix, "infer", str(bundle), "--input", str(validation), *(["--json"] if as_json else [])]


def latency_start(cell: Cell, bundle: Path, validation: Path, scratch: Path) -> float:
    """One start without ``--json``: ``infer``'s own per-sample median into ``cell``; the child's CPU seconds."""
    run = start(infer_argv(cell.platform, bundle, validation, as_json=False), scratch, keep_stdout=True)
    found = MEDIAN_LINE.search(run.stdout_tail)
    if run.exit_code == 0 and not run.timed_out and found:
        cell.latency_ms = float(found.group(1))
    else:
        cell.latency_note = describe_failure(run, cell.samples) if run.exit_code != 0 else "no median line"
    return run.cpu_s


# -- bundles -------------------------------------------------------------------------------------------------


def bundle_for(name: str, profile_id: str, backend: str, precision: str, work: Path, fresh: bool) -> Path:
    """WORK/bundles/NAME-PROFILE-BACKEND-PRECISION: the one there, or exported now as accelerators.py does."""
    out = work / "bundles" / f"{name}-{profile_id}-{backend}-{precision}"
    if (out / "manifest.json").is_file() and not fresh:
        return out
    from edgeline.export.reference import prepare

    ref = prepare(name, work / name)
    profile = single_target_profile(profile_id, backend, precision, work)
    print(f"[{name}] exporting {profile_id} {backend} {precision}", file=sys.stderr, flush=True)
    outcome: Any = export_target(ref, profile, out)
    if outcome.status != "selected" or not (out / "manifest.json").is_file():
        raise RuntimeError(f"{name} {profile_id} {backend} {precision}: {outcome.status}: {outcome.reason}")
    return out


def validation_for(name: str, work: Path) -> tuple[Path, int]:
    """WORK/NAME/validation.npz (prepared if missing) and its number of samples."""
    import numpy as np

    path = work / name / "validation.npz"
    if not path.is_file():
        from edgeline.export.reference import prepare

        path = Path(prepare(name, work / name).validation_path)
    with np.load(path) as data:
        first = next(k for k in data.files if k != "labels")
        return path, int(data[first].shape[0])


# -- the run -------------------------------------------------------------------------------------------------


def platforms(qemu: str) -> list[Platform]:
    found = [Platform("x86", "x86-64 native (host)", (sys.executable, "-m", "edgeline.cli"), emulated=False)]
    for cpu, core in CPUS.items():
        label = f"emulated: {qemu} -cpu {cpu} ({core})"
        found.append(Platform(cpu, label, (str(ARM64), "--cpu", cpu, "edgeline"), emulated=True))
    return found


def emulated_install() -> dict[str, object]:
    """Warm-up (builds the emulated install on first use), then what it holds (``scripts/arm64.sh --info``)."""
    print("warm-up: scripts/arm64.sh python -c pass", file=sys.stderr, flush=True)
    began = time.monotonic()
    subprocess.run([str(ARM64), "python", "-c", "pass"], check=True, stdin=subprocess.DEVNULL)
    print(f"warm-up took {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    info = subprocess.run([str(ARM64), "--info"], check=True, capture_output=True, text=True).stdout
    return json.loads(info.strip().splitlines()[-1])


def host_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in ("edgeline", "numpy", "ai-edge-litert", "onnxruntime"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def main() -> int:
    parser = argparse.ArgumentParser(
        description="edgeline infer as a whole process: x86-64 native and emulated Cortex-A72/A76, time and memory"
    )
    parser.add_argument("--work", type=Path, help="reference models and bundles (default: a temporary dir)")
    parser.add_argument("--models", nargs="+", default=["digits", "resnet8", "ds_cnn"], help="reference models")
    parser.add_argument("--repeats", type=int, default=3, help="starts of each --json cell (default 3)")
    parser.add_argument("--cpus", nargs="+", choices=sorted(CPUS), default=list(CPUS), help="emulated cores")
    parser.add_argument("--no-latency", dest="latency", action="store_false",
                        help="leave out the start without --json that gives infer's per-sample median")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="export the bundles again even when WORK has them")
    parser.add_argument("--quiet-wait", type=float, default=900.0,
                        help="seconds to wait for other qemu-aarch64 processes to end first (default 900)")  # fmt: skip
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    began = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="edgeline-emuinfer-"))
    work.mkdir(parents=True, exist_ok=True)

    plan: list[tuple[str, str, Path, Path, int]] = []  # model, bundle label, bundle, validation, samples
    for name in args.models:
        validation, samples = validation_for(name, work)
        for profile_id, backend, precision in BUNDLES:
            bundle = bundle_for(name, profile_id, backend, precision, work, args.fresh)
            plan.append((name, f"{profile_id} {backend} {precision}", bundle, validation, samples))

    install = emulated_install()
    qemu_match = re.match(r"qemu-aarch64 version (\S+)", str(install.get("qemu", "")))
    qemu = f"qemu-user {qemu_match.group(1)}" if qemu_match else "qemu-user"
    chosen = [p for p in platforms(qemu) if not p.emulated or p.key in args.cpus]
    waited, still = wait_quiet(args.quiet_wait)
    seen_others: set[str] = set(still)
    print(f"timing starts (waited {waited:.0f} s for quiet; still running: {len(still)})", file=sys.stderr)
    busy0, own0, wall0 = machine_busy_s(), own_cpu_s(), time.monotonic()
    children_cpu = 0.0

    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="edgeline-emuinfer-scratch-") as tmp:
        scratch = Path(tmp)
        floor = {p.key: [] for p in chosen}  # interpreter start through the same launcher: python -c pass
        for platform in chosen:
            argv = (
                [*platform.prefix[:-1], "python", "-c", "pass"] if platform.emulated else [sys.executable, "-c", "pass"]
            )
            for _ in range(args.repeats):
                run = start(argv, scratch)
                children_cpu += run.cpu_s
                floor[platform.key].append(run)
        for name, label, bundle, validation, samples in plan:
            row = {p.key: Cell(name, label, p, samples) for p in chosen}
            for repeat in range(args.repeats):
                for platform in chosen:  # interleaved: a slow spell of the machine is spread over the platforms
                    run = start(infer_argv(platform, bundle, validation, as_json=True), scratch)
                    children_cpu += run.cpu_s
                    row[platform.key].runs.append(run)
                    seen_others.update(other_emulations())
                    print(f"[{name}] {label} | {platform.key} #{repeat + 1}: {run.wall_s:.2f} s, "
                          f"{run.maxrss_kib / 1024:.0f} MiB, exit {run.exit_code}, {run.lines} lines",
                          file=sys.stderr, flush=True)  # fmt: skip
            for platform in chosen if args.latency else ():
                children_cpu += latency_start(row[platform.key], bundle, validation, scratch)
            cells.extend(row.values())
    elapsed = time.monotonic() - wall0
    others_share = max(0.0, (machine_busy_s() - busy0 - children_cpu - (own_cpu_s() - own0)) / elapsed)

    header = ("model", "bundle", "platform", "ok runs", "wall s median (min)", "× x86 (wall)",
              "peak RSS MiB median (max)", "CPU s median", "infer's median ms / sample", "others' load")  # fmt: skip
    table: list[tuple[str, ...]] = [header]
    for platform in chosen:
        runs = floor[platform.key]
        x86 = statistics.median(r.wall_s for r in floor["x86"])
        wall = statistics.median(r.wall_s for r in runs)
        table.append((
            "(floor)", "`python -c pass`", platform.label, f"{sum(r.exit_code == 0 for r in runs)}/{len(runs)}",
            f"{wall:.2f} ({min(r.wall_s for r in runs):.2f})", "-" if not platform.emulated else f"{wall / x86:.1f}×",
            f"{statistics.median(r.maxrss_kib for r in runs) / 1024:.0f} "
            f"({max(r.maxrss_kib for r in runs) / 1024:.0f})",
            f"{statistics.median(r.cpu_s for r in runs):.2f}", "-",
            f"{max(r.others_cores for r in runs):.2f}",
        ))  # fmt: skip
    notes: list[str] = []
    for index in range(0, len(cells), len(chosen)):
        group = cells[index : index + len(chosen)]
        x86_wall = group[0].median_wall()
        for cell in group:
            ok = cell.ok()
            wall = cell.median_wall()
            ratio = "-"
            if cell.platform.emulated and wall is not None and x86_wall:
                ratio = f"{wall / x86_wall:.1f}×"
            runs = cell.runs
            latency = "-" if cell.latency_ms is None else f"{cell.latency_ms:.3f}"
            table.append((
                cell.model, cell.bundle, cell.platform.label, f"{len(ok)}/{len(runs)}",
                "failed" if wall is None else f"{wall:.2f} ({min(r.wall_s for r in ok):.2f})", ratio,
                f"{statistics.median(r.maxrss_kib for r in runs) / 1024:.0f} "
                f"({max(r.maxrss_kib for r in runs) / 1024:.0f})",
                f"{statistics.median(r.cpu_s for r in runs):.2f}", latency,
                f"{max(r.others_cores for r in runs):.2f}",
            ))  # fmt: skip
            for run in cell.failures():
                notes.append(f"{cell.model} {cell.bundle} on {cell.platform.label}: "
                             + describe_failure(run, cell.samples))  # fmt: skip
            if cell.latency_note:
                notes.append(f"{cell.model} {cell.bundle} on {cell.platform.label}, the start without --json: "
                             + cell.latency_note)  # fmt: skip

    total = time.monotonic() - began
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    packages = install.get("packages", {})
    assert isinstance(packages, dict)
    emulated_versions = ", ".join(f"{k} {v}" for k, v in packages.items())
    host = ", ".join(f"{k} {v}" for k, v in host_versions().items())
    sizes = ", ".join(f"{name} {samples}" for name, _, _, _, samples in plan[:: len(BUNDLES)])
    if still:
        quiet = (f"Another emulation was still running when timing began, after {waited:.0f} s of waiting "
                 f"(`pgrep -af qemu-aarch64`: {still[0]}): another job shared the 2 cores.")  # fmt: skip
    else:
        quiet = f"No other qemu-aarch64 process ran when timing began (waited {waited:.0f} s for that)."
    seen_during = sorted(seen_others - set(still))
    if seen_during:
        quiet += (f" Another one appeared during the run ({len(seen_during)} seen between starts, e.g. "
                  f"{seen_during[0]}): its cells carry it in 'others' load'.")  # fmt: skip
    intro = (
        f"Run finished {time.strftime('%Y-%m-%d %H:%M %Z')} on {os.cpu_count()} cores ({cpu}), a shared VM; "
        f"{total:.0f} s for the whole script ({elapsed:.0f} s of timed starts). {quiet} Other processes used "
        f"{others_share:.2f} cores on average over the timed part (the machine's busy CPU less ours).\n\n"
        '**Every row whose platform says "emulated" is qemu-user\'s speed on this x86-64 host, not a device '
        "timing**: qemu translates each Arm instruction into x86 code (floating-point and NEON ones through "
        "helper calls, which is why fp32 suffers far more than int8 here), so neither the wall times nor the "
        "per-sample medians say how fast a Raspberry Pi 4 or 5 is, and they are never compared with a device "
        "profile's latency budget. They say what a test or a demo under scripts/arm64.sh costs on this machine. "
        "The x86-64 rows are this host's own speed, not a device's either.\n\n"
        f"What ran: `edgeline infer BUNDLE --input VALIDATION.npz --json` (validation sets: {sizes} samples, one "
        "`predict` each; the manifest's 1 thread), stdout a pipe drained by this script (its JSON lines counted: "
        "a run counts as ok when it exits 0 with one line per sample). x86-64: "
        f"`{Path(sys.executable).name} -m edgeline.cli infer ...` of the project venv ({host}). Emulated: "
        f"`scripts/arm64.sh --cpu CPU edgeline infer ...` ({install.get('qemu')}; Debian 12 arm64 userland, "
        f"Python {install.get('python')}; {emulated_versions}). Bundles: {work / 'bundles'}/MODEL-PROFILE-"
        "BACKEND-PRECISION, exported by edgeline on this host; the jetson-orin-nano bundle asks for TensorRT and "
        "runs on onnxruntime's CPU provider here and under emulation (infer warns of the fallback).\n\n"
        "Columns:\n\n"
        f"- ok runs / wall s median (min): {args.repeats} starts per cell, interleaved across the platforms; the "
        "wall clock from spawn (before fork) to the exit reaped by `os.wait4`: interpreter start, imports, the "
        "doctor's check and the bundle load, reading the .npz, every sample, JSON printing, exit. Emulated rows "
        "also carry scripts/arm64.sh's own work before its final `exec` (bash, flock, the install's stamp checks, "
        "a `qemu-aarch64 --version` for EDGELINE_EMULATOR). The (floor) rows start `python -c pass` through the "
        "same launcher: what every start costs before edgeline does anything.\n"
        "- × x86 (wall): median emulated wall time / median x86-64 wall time of the same bundle.\n"
        "- peak RSS MiB: `ru_maxrss` of the child from `os.wait4` (the largest resident set it, or a child it "
        "waited for, had). For emulated rows that process is qemu-aarch64: the figure includes qemu's own "
        "memory (its translated-code buffer, its own heap and mappings) besides the emulated Python's, so it is "
        "not what the same command would take on a Pi.\n"
        "- CPU s median: user + system CPU of the child (`ru_utime + ru_stime`).\n"
        "- infer's median ms / sample: one more start without `--json` per cell (not counted in the wall "
        "columns): the median of `predict` over the samples that `infer` prints itself (`time.perf_counter` "
        "around each call, in the emulated process's own clock for emulated rows).\n"
        "- others' load: the largest, over the cell's starts, of the machine's busy CPU during a start less the "
        "child's and this script's, in cores (2 = both cores busy with something else): a cell with a high "
        "figure shared the machine."
    )
    if notes:
        intro += "\n\nFailed starts:\n\n" + "\n".join(f"- {note}" for note in notes)
    publish(markdown_table(table), script=__file__, title="`edgeline infer`: x86-64 native and emulated Arm, "
            "whole-process time and peak memory", intro=intro, write=args.write)  # fmt: skip
    print(f"whole run: {total:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
