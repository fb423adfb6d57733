"""``edgeline doctor [BUNDLE]``: what this machine is and what it can run, and whether a bundle runs here.

The command prints what the library knows, from facts gathered once (``edgeline.device_facts``) and decided by pure
functions tested with other machines' facts:

- ``report(facts)``: the machine (architecture, CPU and its features, cores, memory, OS, whether an emulator runs
  it), the runtimes that import here with their versions, the accelerators present, the device profiles this
  machine is of the kind of (its figures may be held against their budgets) or can run bundles of, and the state
  directory: its file system (type, mount point), its free space and the outbox budget that leads to
  (``edgeline.disk``: the smaller of ``[outbox] max_bytes`` and a share of the file system).
- with BUNDLE, its verdict (``edgeline.verdicts``): will this bundle run here, on which runtime and accelerator,
  with which fallback, or why not. ``edgeline.model.load`` asks the same question before it opens a bundle, so
  ``run``, ``verify`` and ``infer`` refuse what cannot run here with the verdict's reason, exit code 2, before any
  model byte is parsed.

The names of those library modules that this one showed before they were split out of it are imported from here
too (``from edgeline.doctor import verdict`` keeps working); the library itself never imports this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.backends import RUNTIME_BACKENDS, runtime_backends
from edgeline.device_facts import (
    Facts,
    RuntimeFacts,
    StateFacts,
    cpu_features,
    gather,
    read_cpuinfo,
    state_facts,
)
from edgeline.errors import BackendUnavailableError
from edgeline.verdicts import (
    Verdict,
    bundle_verdict,
    runnable_targets,
    runtime_refusal,
    verdict,
    verdict_for,
)

if TYPE_CHECKING:
    from edgeline.device_profiles import Profile

__all__ = [
    "RUNTIMES",  # noqa: F822 - computed by __getattr__ on first use
    "TARGET_RUNTIMES",  # noqa: F822 - computed by __getattr__ on first use
    "Facts",
    "RuntimeFacts",
    "StateFacts",
    "Verdict",
    "bundle_verdict",
    "camera_report",
    "cpu_features",
    "gather",
    "register",
    "report",
    "runtime_refusal",
    "state_facts",
    "verdict",
    "verdict_for",
]


def __getattr__(name: str) -> Any:
    """``RUNTIMES`` and ``TARGET_RUNTIMES``, which this module showed before they were computed from the backends'
    classes (``edgeline.device_facts``, ``edgeline.verdicts``)."""
    if name == "RUNTIMES":
        from edgeline import device_facts

        return device_facts.RUNTIMES
    if name == "TARGET_RUNTIMES":
        from edgeline import verdicts

        return verdicts.TARGET_RUNTIMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def report(facts: Facts, profiles: list[Profile], cpuinfo: str = "") -> dict[str, Any]:
    """The machine, its runtimes and accelerators, and the profiles it matches or can run: the ``--json``
    document of ``edgeline doctor``."""
    from edgeline.machine import mismatch
    from edgeline.manifest import Device

    machine = facts.machine
    accelerators: dict[str, dict[str, Any]] = {}
    for backend in runtime_backends().values():  # each backend's accelerators, in the registry's order
        accelerators.update(backend.accelerators(facts))
    matches, emulates, runs = [], [], {}
    for profile in profiles:
        device = Device(arch=profile.cpu.arch, cpu=profile.cpu.name)
        if mismatch(device, machine) is None:
            matches.append(profile.id)
        elif machine.emulated is not None:
            from dataclasses import replace

            if mismatch(device, replace(machine, emulated=None)) is None:
                emulates.append(profile.id)
        targets = runnable_targets(profile, facts)
        if targets:
            runs[profile.id] = targets
    return {
        "machine": {
            "arch": machine.arch,
            "cpu": machine.cpu,
            "cores": sorted(machine.cores),
            "cpus": facts.cpu_count,
            "features": cpu_features(machine, cpuinfo),
            "memory_mb": None
            if facts.memory_mb is None
            else {"total": facts.memory_mb[0], "available": facts.memory_mb[1]},
            "os": facts.os_name,
            "system": facts.system,
            "kernel": facts.kernel,
            "python": facts.python,
            "soc": facts.soc,
            "emulated": machine.emulated,
        },
        "runtimes": {name: asdict(runtime) for name, runtime in facts.runtimes.items()},
        "accelerators": accelerators,
        "profiles": {
            "matches": matches,
            "emulates": emulates,
            "runs": runs,
        },
        "state_dir": None if facts.state is None else _state_report(facts.state),
    }


def _state_report(state: StateFacts) -> dict[str, Any]:
    """The state directory's file system and the outbox budget it leads to (a new outbox's, and each one's there)."""
    from edgeline.disk import DISK_SHARE, budget, wal_share

    def outbox_budget(held: int) -> int | None:
        return None if state.max_bytes is None else budget(state.max_bytes, state.free_bytes, held)

    total = outbox_budget(0)
    return {
        "directory": state.directory,
        "mount_point": state.mount_point,
        "fs_type": state.fs_type,
        "device": state.device,
        "total_bytes": state.total_bytes,
        "free_bytes": state.free_bytes,
        "outbox": {
            "in_memory": state.max_bytes is None,
            "max_bytes": state.max_bytes,
            "share": DISK_SHARE,
            "budget_bytes": total,
            "wal_bytes": None if total is None else wal_share(total),
            "existing": {
                name: {"disk_bytes": held, "budget_bytes": outbox_budget(held)}
                for name, held in sorted(state.outboxes.items())
            },
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# The command


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="what this machine is and can run; with BUNDLE, whether that bundle runs here",
        description=(
            "Print this machine's architecture, CPU and features, memory, OS, the runtimes that import, the "
            "accelerators present and the device profiles it matches or can run. With BUNDLE: whether it runs here, "
            "on which runtime and accelerator, with which fallback, or why not (exit code 1: it cannot). "
            "`run`, `verify` and `infer` make the same check before they open a bundle."
        ),
    )
    parser.add_argument(
        "bundle", metavar="BUNDLE", type=Path, nargs="?", help="a bundle directory (written by `edgeline export`)"
    )
    parser.add_argument("--backend", metavar="RUNTIME", choices=sorted(RUNTIME_BACKENDS),
                        help="ask about this runtime backend instead of the bundle's: %(choices)s")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--install", choices=["executorch"], metavar="RUNTIME",
        help="install a runtime into this environment instead: executorch (its torch-free C++ runtime, from the "
        "executorch wheel without its dependencies, and edgeline's shim built against it with the host's g++)",
    )  # fmt: skip
    parser.add_argument(
        "--from", dest="install_from", type=Path, metavar="PATH",
        help="with --install: an executorch wheel file or package directory instead of downloading (pip download "
        "--no-deps)",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", type=Path, metavar="DIR",
        help="the daemon's state directory to measure (default: as `edgeline run`: [daemon] state_dir, "
        "$STATE_DIRECTORY, else ~/.local/state/edgeline)",
    )  # fmt: skip
    parser.add_argument("--config", type=Path, metavar="daemon.toml",
                        help="the daemon's configuration: its [outbox] and [daemon] state_dir")  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from edgeline.device_profiles import list_profiles

    if args.install is not None:
        return _install(args)
    if args.install_from is not None:
        raise BackendUnavailableError("--from goes with --install executorch")

    if args.bundle is not None:
        found = bundle_verdict(args.bundle, backend=args.backend)
        if args.json:
            print(json.dumps({"bundle": str(args.bundle), **found.as_dict()}, indent=2))
        else:
            from edgeline.bundle import read_bundle

            manifest = read_bundle(args.bundle).manifest
            print(f"{manifest.name} v{manifest.version} ({manifest.profile}, {manifest.backend} {manifest.precision})")
            for line in found.describe():
                print(f"  {line}")
        return 0 if found.runs else 1
    facts = gather(state=_state_of(args))
    document = report(facts, list_profiles(), read_cpuinfo())
    document["cameras"] = camera_report()
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    for line in _describe_report(document):
        print(line)
    return 0


def _install(args: argparse.Namespace) -> int:
    """``--install executorch``: the torch-free runtime into this environment, then what it is."""
    from edgeline.executorch_native import install

    if args.bundle is not None:
        raise BackendUnavailableError("--install takes no BUNDLE")
    source = args.install_from
    if source is not None and not source.exists():
        raise BackendUnavailableError(f"--from {source}: no such file or directory")
    runtime = install(source=source, say=lambda line: print(f"doctor: {line}", file=sys.stderr))
    delegates = runtime.backends()
    found = {"installed": str(runtime.runtime.root), "version": runtime.version, "delegates": list(delegates),
             "shim": str(runtime.shim)}  # fmt: skip
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print(f"executorch: torch-free C++ runtime {runtime.version} in {runtime.runtime.root}")
        print(f"  delegates: {', '.join(delegates) or 'none'}")
        print(f"  shim: {runtime.shim}")
    return 0


def _state_of(args: argparse.Namespace) -> StateFacts:
    """The state directory ``edgeline run`` would use with the same ``--state-dir`` and ``--config``, measured."""
    from edgeline.daemon.config import load_config
    from edgeline.daemon.state import default_state_dir

    config = load_config(args.config)
    directory = args.state_dir or config.daemon.state_dir or default_state_dir()
    return state_facts(directory, config.outbox.max_bytes if config.outbox.enabled else None)


def _size(count: int | None) -> str:
    if count is None:
        return "unknown"
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def _describe_state(state: dict[str, Any]) -> list[str]:
    where = state["fs_type"] or "file system of unknown type"
    if state["device"]:
        where += f" {state['device']}"
    if state["mount_point"]:
        where += f" mounted at {state['mount_point']}"
    lines = [
        f"state dir:    {state['directory']} ({where}): {_size(state['free_bytes'])} free of "
        f"{_size(state['total_bytes'])}"
    ]
    outbox = state["outbox"]
    if outbox["in_memory"]:
        lines.append("outbox:       in memory ([outbox] enabled = false): no budget on the disk")
        return lines
    share = f"{outbox['share']:.0%}"
    lines.append(
        f"outbox:       a budget of {_size(outbox['budget_bytes'])} on the disk, its WAL at most "
        f"{_size(outbox['wal_bytes'])} of it (the smaller of [outbox] max_bytes, {_size(outbox['max_bytes'])}, and "
        f"{share} of the free space and the outbox's own, at least {_size(_min_budget(outbox['max_bytes']))})"
    )
    for name, existing in outbox["existing"].items():
        lines.append(
            f"  {name:15} its outbox takes {_size(existing['disk_bytes'])}: a budget of "
            f"{_size(existing['budget_bytes'])}"
        )
    return lines


def _min_budget(max_bytes: int) -> int:
    from edgeline.disk import MIN_BUDGET

    return min(MIN_BUDGET, max_bytes)


def camera_report() -> dict[str, Any]:
    """The camera extra (PyAV) and the cameras this machine shows (``/dev/video*``, picamera2)."""
    from edgeline.video import camera_extra, cameras_seen

    version = camera_extra()
    return {
        "extra": version,
        "install": None if version is not None else "pip install 'edgeline[camera]'",
        "devices": cameras_seen(),
    }


def _describe_cameras(cameras: dict[str, Any]) -> list[str]:
    extra = cameras["extra"]
    lines = [f"cameras:      camera extra {'PyAV ' + extra if extra else 'not installed: ' + cameras['install']}"]
    devices = [device for device in cameras["devices"] if device.get("kind") == "v4l2"]
    for device in devices:
        lines.append(f"  {device['source']:15} {device.get('name') or 'V4L2 device'}")
    if not devices:
        lines.append("  no /dev/video* device")
    for device in cameras["devices"]:
        if device.get("kind") == "picamera2":
            state = "importable" if device.get("importable") else "not installed (Raspberry Pi OS: python3-picamera2)"
            lines.append(f"  {'picamera2':15} {state}")
    return lines


def _describe_report(document: dict[str, Any]) -> list[str]:
    machine = document["machine"]
    features = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in machine["features"].items())
    memory = machine["memory_mb"]
    lines = [
        f"machine:      {machine['arch']}, {machine['cpu']}",
        f"emulated:     {machine['emulated'] or 'no'}",
        f"features:     {features or 'not known for this architecture'}",
        f"cpus:         {machine['cpus']} usable by this process",
        "memory:       "
        + ("unknown" if memory is None else f"{memory['total']} MiB ({memory['available']} available)"),
        f"os:           {machine['os']} (kernel {machine['kernel']}, Python {machine['python']})",
    ]
    if machine["soc"]:
        lines.append(f"soc:          {machine['soc']}")
    lines.append("runtimes:")
    backends = runtime_backends()
    for name, runtime in document["runtimes"].items():
        package = backends[name].package
        if runtime.get("kind") == "torch-free" and runtime["imports"] is not False:
            state = f"torch-free C++ runtime {runtime['version'] or '(version unknown)'} at {runtime['location']}"
            if runtime["delegates"] is not None:
                state += f"; delegates: {', '.join(runtime['delegates']) or 'none'}"
            if runtime["fallback"]:
                state += f"; fallback: {runtime['fallback']}"
        elif runtime["imports"]:
            state = f"{package} {runtime['version']}"
            if runtime["providers"]:
                state += f" ({', '.join(runtime['providers'])})"
            if runtime.get("devices"):
                state += f" (devices: {', '.join(runtime['devices'])})"
            if runtime.get("kind") == "python":
                state += f" (Python runtime, imports torch; delegates: {', '.join(runtime['delegates'] or ())}; "
                state += runtime.get("location") or "the torch-free one: edgeline doctor --install executorch"
                state += ")"
        elif runtime["version"] is None and runtime["imports"] is False:
            state = f"not installed: {backends[name].install}"
        else:
            state = f"{package} {runtime['version']} does not import: {runtime['error']}"
        lines.append(f"  {name:15} {state}")
    lines.append("accelerators:")
    for name, accelerator in document["accelerators"].items():
        lines.append(f"  {name:15} {'present' if accelerator['present'] else 'absent'}: {accelerator['detail']}")
    profiles = document["profiles"]
    lines.append(
        "profiles:     this machine is of the kind of "
        + (", ".join(profiles["matches"]) or "none of the profiles")
        + " (a profile's device budgets are checked only on its kind)"
    )
    if profiles["emulates"]:
        lines.append(f"              it emulates the CPU of {', '.join(profiles['emulates'])} (timings are not theirs)")
    for profile_id, targets in profiles["runs"].items():
        lines.append(f"  runs {profile_id:20} {', '.join(targets)}")
    if document.get("cameras"):
        lines += _describe_cameras(document["cameras"])
    if document.get("state_dir"):
        lines += _describe_state(document["state_dir"])
    return lines
