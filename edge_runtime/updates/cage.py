"""A candidate version opened in a cage: a child process loads it and runs its golden self-test before the daemon
ever opens it, so that a signed bundle that crashes, hangs or bloats its runtime costs a refusal, not the device.

A signature says a bundle is *authentic*, not *harmless*: a build that went wrong, a converter bug, a stolen targets
key. What its model file makes a runtime do is only known by running it, so it is run first where that cannot hurt:

    python -m edgeline.updates.cage BUNDLE   a fresh interpreter that imports only edgeline's device side and the
                                             bundle's runtime; nice 10, its own session (killed as a group),
                                             the kernel's first choice when memory runs out (oom_score_adj 1000),
                                             no core dump, its data segment capped (RLIMIT_DATA: the limit an
                                             allocation fails at, not a sampled figure), CPU time capped
                                             (RLIMIT_CPU) as a backstop to the deadline
    open (load + doctor's verdict) ─► golden self-test ─► batched check ─► one JSON line on stdout ─► exit 0

``open_caged`` judges the child: its JSON line and a clean exit is a pass; a refusal it reports keeps its reason
(``incompatible``, ``malformed``, ``self-test``, ``too-big`` for a ``MemoryError``); otherwise the child is
``hung`` (past its deadline: killed with its whole process group; or killed by its CPU limit), ``too-big`` (it died
near its memory cap, as a C++ runtime does when an allocation fails), or ``crashed`` (a signal or an exit without a
verdict; the last lines of its stderr, escaped, say where). Only what the child's verdict says is read from it: one
line of at most ``VERDICT_MAX_BYTES``, and the tail of its stderr; every wait is bounded by one deadline for the
whole. What this costs (a second interpreter and runtime, once per version offered): ``benchmarks/results/updates.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.memory import proc_fields

if TYPE_CHECKING:
    from edgeline.manifest import Manifest
    from edgeline.updates.policy import TargetFacts

__all__ = ["CAGE_REASONS", "CageLimits", "Caged", "cage_limits", "open_caged"]

CAGE_REASONS = ("crashed", "hung", "too-big")
CHILD_REASONS = frozenset({"incompatible", "malformed", "self-test", "too-big"})
"""The refusals a child may report itself (anything else it says is not believed: ``crashed``)."""
VERDICT_MAX_BYTES = 64 * 1024
"""The most of the child's stdout read: its verdict is one JSON line far smaller."""
STDERR_TAIL_BYTES = 4096
NEAR_CAP = 0.9
"""A child that died with its data segment at this share of its cap died of the cap (``too-big``)."""
POLL_S = 0.05
"""How often the child's memory is read while it runs (its peak, for the verdict and the figures)."""
CPU_MARGIN = 2.0
"""RLIMIT_CPU: this many times the deadline in CPU seconds (a runtime's threads may use every core)."""


CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
"""numpy's BLAS on one thread (OpenBLAS reserves a buffer per thread at import): the child runs the
bundle's runtime, not numpy's algebra."""


@dataclass(frozen=True)
class CageLimits:
    seconds: float
    """The whole: start, load, self-test and exit."""
    memory_bytes: int | None
    """What the child's data segment may grow beyond its size when it starts (None: no cap)."""


@dataclass(frozen=True)
class Caged:
    """The child's verdict on a version: ``ok``, or the refusal ``reason`` and its ``message``."""

    ok: bool
    reason: str | None
    message: str
    golden: dict[str, Any] | None = None
    seconds: float = 0.0
    peak_rss_bytes: int | None = None
    """The child's peak resident memory (``VmHWM``), as last read."""


RUNTIME_HEADROOM_MB = 256
"""What a runtime may add beyond the model (its libraries' data, its threads' stacks, its arenas): the tiny bundles
measured 9 (ExecuTorch), 17 (LiteRT) and 77 MB (OpenVINO, 2 cores; 8 MB of stack per thread more elsewhere)."""
AVAILABLE_SHARE = 0.9
"""Of the memory this process can still take (the machine's, or its unit's ``MemoryMax``), what the child may."""


def cage_limits(
    manifest: Manifest, facts: TargetFacts, *, seconds: float, memory_mb: float | None = None,
    available_mb: float | None = None,
) -> CageLimits:  # fmt: skip
    """The cage for a version: ``memory_mb`` when the configuration sets it; else what the runtime may add
    (``RUNTIME_HEADROOM_MB``), the model's own (its signed ``resident_mb`` with the policy's margin, else the
    profile's ``max_memory_mb``, else four times its files) and twice its golden arrays; never more than
    ``AVAILABLE_SHARE`` of ``available_mb``, so that the device itself never runs out for a version."""
    from edgeline.samples import GOLDEN_MAX_BYTES
    from edgeline.updates.policy import MEMORY_MARGIN

    if memory_mb is None:
        if facts.resident_mb is not None:
            model_mb = facts.resident_mb * MEMORY_MARGIN
        elif manifest.budgets.max_memory_mb is not None:
            model_mb = float(manifest.budgets.max_memory_mb)
        else:
            model_mb = 4 * sum(entry.size for entry in manifest.files) / 2**20
        golden_bytes = 0
        if manifest.golden is not None:
            per_sample = sum(math.prod(spec.shape) for spec in (*manifest.inputs, *manifest.outputs))
            golden_bytes = min(GOLDEN_MAX_BYTES, manifest.golden.samples * per_sample * 8)
        memory_mb = RUNTIME_HEADROOM_MB + model_mb + 2 * golden_bytes / 2**20
        if available_mb is not None:
            memory_mb = min(memory_mb, AVAILABLE_SHARE * available_mb)
    return CageLimits(seconds=seconds, memory_bytes=int(memory_mb * 2**20))


def open_caged(bundle: Path, *, backend: str | None, max_batch: int, limits: CageLimits) -> Caged:
    """Open ``bundle`` and run its golden self-test (and the batched check ``max_batch`` asks for) in a child
    process under ``limits``; never raises for anything the bundle makes the child do."""
    command = [sys.executable, "-m", "edgeline.updates.cage", str(bundle), "--max-batch", str(max_batch)]
    if backend is not None:
        command += ["--backend", backend]
    if limits.memory_bytes is not None:
        command += ["--memory-bytes", str(int(limits.memory_bytes))]
    command += ["--cpu-seconds", str(max(1, int(limits.seconds * CPU_MARGIN * (os.cpu_count() or 1))))]
    started = time.monotonic()
    deadline = started + limits.seconds
    child = subprocess.Popen(
        command,
        env={**os.environ, **CHILD_ENV},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its threads and anything it starts are killed with it
        close_fds=True,
    )
    ooms = _oom_kills()
    watch = _Watch(child)
    try:
        out, err, timed_out = watch.run(deadline)
    finally:
        _kill_group(child.pid)
    code = watch.reap()
    seconds = time.monotonic() - started
    peak = watch.peak_rss
    if timed_out:
        return Caged(
            False, "hung", f"did not open and answer its golden inputs within {limits.seconds:g} s (killed)",
            seconds=seconds, peak_rss_bytes=peak,
        )  # fmt: skip
    verdict = _verdict(out)
    if verdict is not None and code == 0:
        golden = verdict.get("golden") if isinstance(verdict.get("golden"), dict) else None
        if verdict["ok"]:
            return Caged(True, None, "opened and self-tested in a cage", golden, seconds, peak)
        reason = verdict.get("reason")
        if reason not in CHILD_REASONS:
            reason = "crashed"
        elif reason in ("malformed", "self-test") and watch.near_cap:  # an allocation refused, said another way
            reason = "too-big"
        return Caged(False, reason, _printable(str(verdict.get("message")))[:500], golden, seconds, peak)
    where = _tail(err)
    if code < 0 and -code == signal.SIGXCPU:
        return Caged(False, "hung", f"used up its CPU time{where}", seconds=seconds, peak_rss_bytes=peak)
    if watch.near_cap or (ooms is not None and (_oom_kills() or 0) > ooms):
        cap = f"the {limits.memory_bytes / 2**20:.0f} MiB it may take" if limits.memory_bytes else "the memory"
        return Caged(False, "too-big", f"ran out of {cap} ({_death(code)}){where}", seconds=seconds,
                     peak_rss_bytes=peak)  # fmt: skip
    return Caged(False, "crashed", f"{_death(code)} while it was opened and tested{where}", seconds=seconds,
                 peak_rss_bytes=peak)  # fmt: skip


def _printable(text: str) -> str:
    """A runtime's words, quoted in one log line: control characters (newlines, escapes) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _death(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    if code == 0:
        return "exited without a verdict"
    return f"exited {code} without a verdict"


def _verdict(out: bytes) -> dict[str, Any] | None:
    line = out.split(b"\n", 1)[0]
    try:
        verdict = json.loads(line)
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("ok"), bool) else None


def _tail(err: bytes) -> str:
    """Where the child died, from its stderr, escaped, on one line: faulthandler's report (the fatal error and the
    innermost frame), else its last lines (a runtime's message)."""
    lines = [line.strip() for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        return ""
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is not None:
        frame = next((line for line in lines[fatal + 1 :] if line.startswith("File ")), "")
        text = f"{lines[fatal]} {frame}".strip()[:300]
    else:
        text = " | ".join(lines[-3:])[-300:]
    return ": " + text.encode("unicode_escape").decode("ascii")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _Watch:
    """Reads the child's pipes (bounded) and its memory until it exits or the deadline passes."""

    def __init__(self, child: subprocess.Popen[bytes]):
        self.child = child
        self.peak_rss: int | None = None
        self.near_cap = False
        """Whether its data segment was seen at ``NEAR_CAP`` of the limit it set itself (RLIMIT_DATA)."""
        self._proc = f"/proc/{child.pid}"

    def run(self, deadline: float) -> tuple[bytes, bytes, bool]:
        out, err = bytearray(), bytearray()
        selector = selectors.DefaultSelector()
        assert self.child.stdout is not None and self.child.stderr is not None
        for pipe in (self.child.stdout, self.child.stderr):
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(out), bytes(err), True
                for key, _ in selector.select(min(left, POLL_S)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                    elif key.fileobj is self.child.stdout:
                        out += chunk[: max(0, VERDICT_MAX_BYTES - len(out))]
                    else:
                        err = (err + chunk)[-STDERR_TAIL_BYTES:]
                self._sample()
            # both pipes closed: the child is exiting; its exit is bounded by the same deadline. Not reaped here:
            # its process group is killed first, while its number cannot yet be another's (``reap``).
            while os.waitid(os.P_PID, self.child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.monotonic() >= deadline:
                    return bytes(out), bytes(err), True
                self._sample()
                time.sleep(POLL_S / 5)
            return bytes(out), bytes(err), False
        finally:
            selector.close()
            for pipe in (self.child.stdout, self.child.stderr):
                pipe.close()

    def _sample(self) -> None:
        fields = proc_fields(f"{self._proc}/status")
        rss, data = fields.get("VmHWM"), fields.get("VmData")
        if rss is not None:
            self.peak_rss = max(self.peak_rss or 0, rss)
        if data is not None and not self.near_cap:
            cap = _data_limit(f"{self._proc}/limits")
            self.near_cap = cap is not None and data >= NEAR_CAP * cap

    def reap(self) -> int:
        """The child's exit code, negative for a signal (it was killed with its group: this does not wait long;
        a process the kernel cannot kill at once, in an uninterruptible wait, raises after 30 s)."""
        return self.child.wait(timeout=30)


def _data_limit(path: str) -> int | None:
    """A process's RLIMIT_DATA (soft) from /proc/PID/limits, in bytes; None: unlimited or gone."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            for line in handle.read(8192).splitlines():
                if line.startswith("Max data size"):
                    value = line[len("Max data size") :].split()[0]
                    return int(value) if value.isdigit() else None
    except OSError:
        pass
    return None


def _oom_kills() -> int | None:
    """The kernel's OOM kills in this process's cgroup (v2 ``memory.events``), None where it cannot be read: a child
    killed by the cgroup's limit (a unit's ``MemoryMax``) before reaching its own."""
    try:
        with open("/proc/self/cgroup", encoding="ascii", errors="replace") as handle:
            relative = next((line[3:].strip() for line in handle if line.startswith("0::")), None)
        if relative is None:
            return None
        with open(f"/sys/fs/cgroup{relative}/memory.events", encoding="ascii") as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


# -- the child -------------------------------------------------------------------------------------------------------


def _confine(memory_bytes: int | None, cpu_seconds: int) -> None:
    """The child's own limits, set before the bundle is touched."""
    with contextlib.suppress(OSError):
        os.nice(10)  # the serving daemon's worker comes first
    try:
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as handle:
            handle.write("1000")  # when memory runs out, the kernel kills this child, not the daemon
    except OSError:
        pass
    _lower(resource.RLIMIT_CORE, 0)
    _lower(resource.RLIMIT_CPU, cpu_seconds)
    if memory_bytes is not None:
        data = proc_fields("/proc/self/status").get("VmData")
        if data is not None:
            _lower(resource.RLIMIT_DATA, data + memory_bytes)


def _lower(limit: int, value: int) -> None:
    _soft, hard = resource.getrlimit(limit)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(limit, (value, value))


def _test(bundle: str, backend: str | None, max_batch: int) -> dict[str, Any]:
    from edgeline.bundle_checks import golden_check
    from edgeline.errors import BackendUnavailableError, EdgelineError
    from edgeline.model import load

    try:
        model = load(bundle, backend=backend)
    except BackendUnavailableError as exc:
        return {"ok": False, "reason": "incompatible", "message": f"cannot run here: {exc}"}
    except EdgelineError as exc:
        return _failed("malformed", f"cannot be opened: {exc}", exc)
    try:
        golden = golden_check(model)
    except MemoryError:
        raise
    except Exception as exc:  # the version's model failed on its own golden inputs
        return _failed("self-test", f"failed its golden self-test here: {type(exc).__name__}: {exc}"[:500], exc)
    if golden["ok"] is None:
        return {"ok": False, "reason": "self-test", "message": f"cannot test itself here: {golden.get('reason')}"}
    if not golden["ok"]:
        return {
            "ok": False, "reason": "self-test", "golden": golden,
            "message": f"failed its golden self-test here: {golden.get('mismatched_samples')} of "
            f"{golden.get('samples')} samples off (max |error| {golden.get('max_abs_error')})",
        }  # fmt: skip
    model.enable_batching(max_batch)  # what the daemon will run: a batch that hangs or crashes does it here
    return {"ok": True, "golden": golden, "batching": model.batching}


OUT_OF_MEMORY = ("bad_alloc", "cannot allocate memory", "resource temporarily unavailable", "out of memory")
"""What runtimes say when an allocation (or a thread's stack) was refused: under the cap, that is the cap."""


def _failed(reason: str, message: str, exc: BaseException) -> dict[str, Any]:
    cap = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if cap == resource.RLIM_INFINITY:
        return {"ok": False, "reason": reason, "message": message}
    text = f"{exc} {exc.__cause__ or ''}".lower()
    if any(words in text for words in OUT_OF_MEMORY):
        return {"ok": False, "reason": "too-big", "message": f"ran out of the memory it may take: {message}"}
    # a runtime whose allocation was refused may say nothing of it (LiteRT's arena): the cap is named
    return {"ok": False, "reason": reason, "message": f"{message} (with its data capped at {cap / 2**20:.0f} MiB)"}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import faulthandler

    parser = argparse.ArgumentParser(prog="python -m edgeline.updates.cage", description=__doc__.split("\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--backend")
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--memory-bytes", type=int)
    parser.add_argument("--cpu-seconds", type=int, default=600)
    args = parser.parse_args(argv)
    faulthandler.enable()  # a crash says where, on stderr, which the parent keeps the tail of
    sys.stdout.flush()
    verdict_fd = os.dup(1)  # the verdict's own descriptor: what a runtime prints goes to stderr, not into it
    os.dup2(2, 1)
    for module in ("numpy", "edgeline.model", "edgeline.bundle_checks"):  # loaded before the cap: the version's
        importlib.import_module(module)

    start = proc_fields("/proc/self/status").get("VmData", 0)
    _confine(args.memory_bytes, args.cpu_seconds)
    try:
        verdict = _test(args.bundle, args.backend, args.max_batch)
    except MemoryError:
        verdict = {"ok": False, "reason": "too-big", "message": "ran out of the memory it may take (MemoryError)"}
    end = proc_fields("/proc/self/status")
    verdict["memory"] = {"data_start": start, "data_end": end.get("VmData"), "peak_rss": end.get("VmHWM")}
    sys.stdout.flush()
    with os.fdopen(verdict_fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(verdict, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
