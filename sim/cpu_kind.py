"""Another kind of x86-64 CPU, on this one: a command run with instruction sets hidden from CPUID, so the runtimes it
loads pick the kernels they would pick on that CPU. How the suite checks figures on CPUs it does not have (issue 47).

    python -m edgeline.sim.cpu_kind avx512-vnni-bf16 -- bash scripts/test.sh
    python -m edgeline.sim.cpu_kind --list

``sim/cpu_kind.c``, built here with the system's gcc (cached under ``build/cpu-kind``), is preloaded into the
command and every dynamically linked program it starts (``LD_PRELOAD``): it makes CPUID fault (Linux's
``ARCH_SET_CPUID``, where the CPU or hypervisor has CPUID faulting) and answers each CPUID with the features of the
kind. What that covers and what not (glibc's own choice, static programs, XGETBV): the C file's header.

Why not a virtual machine: QEMU's ``-cpu Cooperlake`` model needs KVM with hardware virtualisation (here, /dev/kvm is
kvm-pvm, whose guests need a PVM kernel), and QEMU's own emulator (TCG) implements no AVX-512 at all. Why not the
runtimes' own switches: ONNX Runtime's MLAS and XNNPACK have none; oneDNN's ``ONEDNN_MAX_CPU_ISA`` reaches neither.
A kind can only hide what this CPU has: ``available`` says whether this machine can run one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edgeline.errors import EdgelineError

__all__ = ["KINDS", "CpuKind", "available", "build_library", "environment", "main"]

SOURCE = Path(__file__).with_name("cpu_kind.c")
KIND_ENV = "EDGELINE_CPU_KIND"
VENDOR_ENV = "EDGELINE_CPU_VENDOR"


@dataclass(frozen=True)
class CpuKind:
    name: str
    like: str
    """The CPUs of this kind, for people."""
    features: tuple[str, ...]
    """What ``edgeline.isa.instruction_set`` names on it (the kind's features; the host must have them all)."""


KINDS: dict[str, CpuKind] = {
    kind.name: kind
    for kind in (
        CpuKind("avx2", "Haswell to Comet Lake, Zen 1 to 3", ("FMA", "AVX2")),
        CpuKind("avx512-vnni", "Cascade Lake, Ice Lake server", ("FMA", "AVX2", "AVX512", "AVX512-VNNI")),
        CpuKind(
            "avx512-vnni-bf16",
            "Zen 4 (EPYC Genoa), Cooper Lake",
            ("FMA", "AVX2", "AVX512", "AVX512-VNNI", "AVX512-BF16"),
        ),
    )
}
"""The kinds the library can make of a CPU that has every feature of theirs (a Xeon with AMX has them all)."""


def default_cache_dir() -> Path:
    """``build/cpu-kind`` of the source tree this runs from; installed, the user's cache."""
    tree = Path(__file__).resolve().parents[1]
    if (tree / "pyproject.toml").is_file():
        return tree / "build" / "cpu-kind"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeline" / "cpu-kind"


def build_library(cache_dir: Path | None = None) -> Path:
    """The preload library, from the cache or compiled into it (renamed into place when whole)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise EdgelineError("building the CPU kind library needs gcc, not found on PATH (apt-get install gcc)")
    source = SOURCE.read_bytes()
    root = cache_dir or default_cache_dir()
    library = root / f"cpu_kind-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if library.is_file():
        return library
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".building-", dir=root) as scratch:
        built = Path(scratch) / library.name
        command = [compiler, "-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-o", str(built), str(SOURCE), "-ldl"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise EdgelineError(f"{compiler} could not build {SOURCE}:\n{done.stderr[-2000:]}")
        os.replace(built, library)
    return library


def environment(kind: str, base: dict[str, str] | None = None, vendor: str | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the library preloaded as ``kind``; ``vendor="amd"``
    also says AuthenticAMD, family 19h (Zen 4), where a runtime chooses by vendor."""
    if kind not in KINDS:
        raise EdgelineError(f"unknown CPU kind {kind!r}: one of {', '.join(KINDS)}")
    env = dict(os.environ if base is None else base)
    library = str(build_library())
    preload = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = library if not preload else f"{library} {preload}"
    env[KIND_ENV] = kind
    if vendor is not None:
        env[VENDOR_ENV] = vendor
    return env


def _features_as(env: dict[str, str]) -> tuple[list[str], int]:
    probe = "import ctypes, edgeline.isa as i; print(ctypes.CDLL(None).edgeline_cpu_kind(), i.instruction_set())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise EdgelineError(f"the CPU kind probe failed: {done.stderr.strip()[-500:]}")
    active, *named = done.stdout.split()
    return named[1:], int(active)


def available(kind: str) -> str | None:
    """Why this machine cannot run as ``kind`` (None: it can, and a process run so names exactly its features)."""
    import platform

    from edgeline.isa import instruction_set
    from edgeline.machine import normalise_arch

    if normalise_arch(platform.machine()) != "x86_64":
        return f"CPU kinds are x86-64 ones; this machine is {platform.machine()}"
    here = set(instruction_set().split()[1:])
    missing = [feature for feature in KINDS[kind].features if feature not in here]
    if missing:
        return f"this CPU lacks {', '.join(missing)}: a kind can only hide what the CPU has"
    try:
        named, active = _features_as(environment(kind))
    except EdgelineError as exc:
        return str(exc)
    if not active:
        return "CPUID faulting is not available here (no cpuid_fault: ARCH_SET_CPUID refused)"
    if tuple(named) != KINDS[kind].features:
        return f"run as {kind}, the CPU still said {' '.join(named)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edgeline.sim.cpu_kind",
        description="Run a command as on another kind of x86-64 CPU (instruction sets hidden from CPUID).",
    )
    parser.add_argument("kind", nargs="?", choices=list(KINDS), help="the kind of CPU")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    parser.add_argument("--amd", action="store_true", help="say AuthenticAMD, family 19h (Zen 4), too")
    parser.add_argument("--list", action="store_true", help="list the kinds, and whether this machine can run each")
    args = parser.parse_args(argv)
    if args.list or args.kind is None:
        for kind in KINDS.values():
            problem = available(kind.name)
            state = "yes" if problem is None else f"no: {problem}"
            print(f"{kind.name:18} {' '.join(kind.features):45} like {kind.like}; here: {state}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run: -- COMMAND [ARG...]")
    problem = available(args.kind)
    if problem is not None:
        print(f"cpu_kind: error: cannot run as {args.kind}: {problem}", file=sys.stderr)
        return 2
    env = environment(args.kind, vendor="amd" if args.amd else None)
    return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
