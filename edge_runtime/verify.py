"""``edgeline verify``: integrity, the golden self-test, and this machine's latency and memory figures.

Each check is a dict of figures (the ``--json`` document), its text line made from it. ``ok`` is True or False only
for what was checked; a figure measured but not held against its budget says ``"ok": null`` and why in ``reason``.
Latency and memory budgets are the device's: they are checked only on a machine of the bundle's device kind
(``edgeline.machine``), run by the bundle's runtime and not on an emulator. Elsewhere the figure is this machine's,
shown as such, and the summary line names what was not checked.

The checks a library may ask for too (the golden self-test, whether a figure measured here may be held against the
device's budgets) are ``edgeline.bundle_checks``; this module is the command that runs and prints them. Registering
it imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.backends import RUNTIME_BACKENDS
from edgeline.bundle_checks import device_budget_refusal, golden_check
from edgeline.commands import RUNTIME_BACKEND_HELP, runtime_output, warn_accelerator_fallback
from edgeline.errors import BackendUnavailableError

if TYPE_CHECKING:
    from edgeline.bundle import Bundle
    from edgeline.manifest import Manifest
    from edgeline.model import Model

__all__ = ["device_budget_refusal", "golden_check", "register", "run_verify"]
"""``device_budget_refusal`` and ``golden_check`` live in ``edgeline.bundle_checks`` (imported from here too, as
before)."""


def register(subparsers: Any) -> None:
    verify = subparsers.add_parser(
        "verify",
        help="check a bundle's integrity and run its golden self-test",
        description="Verify sizes and hashes, run golden.npz through the runtime, and time the model here.",
    )
    verify.add_argument("bundle", metavar="BUNDLE", type=Path, help="bundle directory (written by `edgeline export`)")
    verify.add_argument("--backend", choices=sorted(RUNTIME_BACKENDS), metavar="RUNTIME", help=RUNTIME_BACKEND_HELP)
    verify.add_argument("--json", action="store_true", help="print the checks and their figures as one JSON document")
    verify.set_defaults(func=run_verify)


def _zeros(model: Model) -> list[Any]:
    import numpy as np

    return [np.zeros(spec.shape, dtype=np.float32) for spec in model.inputs]


def _judged(check: dict[str, Any], figure: float | None, budget: float | None, what: str, refusal: str | None) -> None:
    """``ok`` and ``reason`` of a device figure: checked against its budget only when nothing refuses it."""
    if figure is None:
        check["ok"] = None  # the reason is set by the caller: why the figure is missing
    elif budget is None:
        check.update(ok=None, reason=f"the profile sets no {what} budget")
    elif refusal is not None:
        check.update(ok=None, reason=refusal)
    else:
        check.update(ok=figure <= budget, reason=None)


def _latency_check(model: Model, refusal: str | None) -> dict[str, Any]:
    from edgeline.machine import this_machine
    from edgeline.timing import median_latency_ms

    manifest = model.manifest
    check: dict[str, Any] = {
        "check": "latency",
        "ok": None,
        "reason": None,
        "median_ms": median_latency_ms(model, _zeros(model), runs=100),
        "budget_ms": manifest.budgets.max_latency_ms,
        "profile": manifest.profile,
        "device": None if manifest.device is None else manifest.device.model_dump(),
        "machine": platform.machine(),
        "host": this_machine().describe(),
        "emulator": model.emulator or this_machine().emulated,  # the accelerator's emulator, or the machine's
        "threads": model.threads,
        "manifest_threads": manifest.threads,
    }
    _judged(check, check["median_ms"], check["budget_ms"], "latency", refusal)
    return check


def _arena_check(model: Model) -> dict[str, Any]:
    """A microcontroller's bundle (its firmware's C sources): its memory is the tensor arena the firmware reserves,
    judged against the profile's ``max_arena_bytes``, and the arena the model needs when TFLite Micro runs the model
    array here, which must fit in what is reserved. No process runs on the device: no resident memory."""
    from edgeline.machine import this_machine

    manifest = model.manifest
    assert manifest.firmware is not None
    reserved, budget = manifest.firmware.arena_bytes, manifest.budgets.max_arena_bytes
    needed = model.arena_bytes if model.model_file == manifest.model else None
    problems = []
    if needed is not None and needed > reserved:
        problems.append(f"the model needs {needed:,} B, more than the {reserved:,} B the firmware reserves")
    if budget is not None and reserved > budget:
        problems.append(f"the firmware reserves {reserved:,} B, over the {manifest.profile} budget of {budget:,} B")
    return {
        "check": "memory",
        "ok": not problems if needed is not None or budget is not None else None,
        "reason": "; ".join(problems) or None,
        "resident_mb": None,
        "arena_bytes": needed,
        "firmware_arena_bytes": reserved,
        "budget_arena_bytes": budget,
        "budget_mb": None,
        "export_resident_mb": None,
        "profile": manifest.profile,
        "host": this_machine().describe(),
        "emulator": model.emulator or this_machine().emulated,
    }


def _memory_check(
    manifest: Manifest, resident_mb: float | None, refusal: str | None, emulator: str | None = None
) -> dict[str, Any]:
    from edgeline.machine import this_machine
    from edgeline.memory import UNMEASURABLE

    check: dict[str, Any] = {
        "check": "memory",
        "ok": None,
        "reason": f"not measured: {UNMEASURABLE}" if resident_mb is None else None,
        "resident_mb": resident_mb,
        "budget_mb": manifest.budgets.max_memory_mb,
        "export_resident_mb": None if manifest.memory is None else manifest.memory.resident_mb,
        "profile": manifest.profile,
        "host": this_machine().describe(),
        "emulator": emulator or this_machine().emulated,  # the accelerator's emulator, or the machine's
    }
    _judged(check, resident_mb, check["budget_mb"], "memory", refusal)
    return check


def _judgement(check: dict[str, Any], unit: str) -> str:
    budget = check.get("budget_ms", check.get("budget_mb"))
    if check["ok"] is not None:
        return f"; {check['profile']} budget {budget:g} {unit}"
    if budget is None:
        return f"; {check['reason']}"
    return f"; not checked against the {check['profile']} budget of {budget:g} {unit}: {check['reason']}"


def _describe(check: dict[str, Any]) -> str:
    """One line of text for a check."""
    from edgeline.manifest import percent

    kind = check["check"]
    if kind == "integrity":
        return f"integrity: {check['files']} files ({check['bytes']} bytes) match their sizes and sha256"
    if kind == "load":
        where = f" on {check['accelerator']}" if check.get("accelerator") else ""
        instead = f" in place of {check['bundle_model']}" if check["model"] != check["bundle_model"] else ""
        fallback = (
            f" (WARNING: accelerator fallback: {check['accelerator_fallback']})"
            if check.get("accelerator_fallback")
            else ""
        )
        backend = f"{check['backend']} ({check['runtime']} runtime)" if check.get("runtime") else check["backend"]
        apart = f" (NOTE: {check['computed_apart']})" if check.get("computed_apart") else ""
        return f"load: {backend} opened {check['model']}{instead}{where}{fallback}{apart}"
    if kind == "fidelity":
        top1 = check["top1_agreement"]
        agreement = f", top-1 agreement {percent(top1)}" if top1 is not None else ""
        judged = f"budget {check['budget']}" if "budget" in check else check["reason"]
        return (
            f"fidelity against the float model (golden.npz): {check['samples']} samples, max |error| "
            f"{check['max_abs_error']:.3g}, cosine min {check['cosine_min']:.4f}{agreement}; {judged}"
        )
    if kind == "golden":
        if check["ok"] is None:
            return f"golden self-test: not verified: {check['reason']}"
        mismatched = f", {check['mismatched_samples']} outside it" if check["mismatched_samples"] else ""
        return (
            f"golden self-test: {check['samples']} samples, max |error| {check['max_abs_error']:.3g} "
            f"(tolerance {max(check['atol']):.3g}{mismatched})"
        )
    if kind == "memory":
        if check.get("firmware_arena_bytes") is not None:
            needed = check["arena_bytes"]
            measured = (
                "" if needed is None else f"the model needs {needed:,} B here (TFLite Micro on {check['host']}), "
            )
            budget = check["budget_arena_bytes"]
            judged = "no arena budget" if budget is None else f"budget {budget:,} B"
            verdict = "ok" if check["ok"] else ("not checked" if check["ok"] is None else f"FAILED: {check['reason']}")
            return (
                f"memory: tensor arena: {measured}the firmware reserves {check['firmware_arena_bytes']:,} B "
                f"({judged}): {verdict}"
            )
        if check["resident_mb"] is None:
            budget = check["budget_mb"]
            unchecked = "" if budget is None else f"; the {check['profile']} budget of {budget:g} MB is not checked"
            return f"memory: {check['reason']}{unchecked}"
        at_export = check["export_resident_mb"]
        export = "" if at_export is None else f", {at_export:.1f} MB on the export machine"
        return (
            f"memory: loading the model and running it once adds {check['resident_mb']:.1f} MB resident on this "
            f"machine ({check['host']}{export}){_judgement(check, 'MB')}"
        )
    return (
        f"latency: median {check['median_ms']:.3f} ms on this machine ({check['host']}, {check['threads']} "
        f"thread(s), the bundle asks for {check['manifest_threads']}){_judgement(check, 'ms')}"
    )


def _summary(name: str, version: int, checks: list[dict[str, Any]]) -> str:
    """Verified names only what was checked: what was measured but not checked is listed."""
    if any(check["ok"] is False for check in checks):
        return f"{name} v{version}: FAILED"
    unchecked = [check["check"] for check in checks if check["ok"] is None]
    return f"{name} v{version}: verified" + (f" (not checked: {', '.join(unchecked)})" if unchecked else "")


def _load_measured(path: Path, bundle: Bundle, backend: str | None) -> tuple[Model, float | None]:
    """The model, loaded and run once, and the resident memory that added (None where it cannot be read)."""
    from edgeline.memory import resident_mb_added
    from edgeline.model import load

    loaded: list[Model] = []

    def load_and_run() -> Model:
        model = load(path, backend=backend)
        model.predict(*_zeros(model))
        loaded.append(model)
        return model

    try:
        resident = resident_mb_added(load_and_run)
    except BackendUnavailableError as exc:  # e.g. a Core ML bundle on Linux: say what was checked, then why not
        raise BackendUnavailableError(
            f"{len(bundle.manifest.files)} files match their sizes and sha256, but {exc}"
        ) from exc
    return loaded[0], resident


def run_verify(args: argparse.Namespace) -> int:
    from edgeline.bundle import read_bundle
    from edgeline.isa import instruction_set

    bundle = read_bundle(args.bundle)
    manifest = bundle.manifest
    integrity = {
        "check": "integrity",
        "ok": True,
        "files": len(manifest.files),
        "bytes": sum(entry.size for entry in manifest.files),
    }
    with runtime_output() as outcome:
        model, resident = _load_measured(args.bundle, bundle, args.backend)
        refusal = device_budget_refusal(model, args.backend)
        loaded: dict[str, Any] = {
            "check": "load",
            "ok": True,
            "backend": model.backend,
            "model": model.model_file,
            "bundle_model": manifest.model,
            "accelerator": model.accelerator,
            "accelerator_fallback": model.accelerator_fallback,
            "computes": model.computes,
            "instruction_set": instruction_set(),
        }
        measured = manifest.fidelity
        if None not in (measured.computed_in, model.computes) and measured.computed_in != model.computes:
            loaded["computed_apart"] = (
                f"the bundle's fidelity was computed in {measured.computed_in}"
                f"{' on ' + measured.instruction_set if measured.instruction_set else ''}; this machine computes "
                f"its float operators in {model.computes}"
            )
        if model.runtime:
            loaded["runtime"] = model.runtime
        checks = [
            integrity,
            loaded,
            golden_check(model),
            _latency_check(model, refusal),
            _arena_check(model)
            if manifest.firmware is not None
            else _memory_check(manifest, resident, refusal, model.emulator),
        ]
        passed = all(check["ok"] is not False for check in checks)
        outcome.failed = not passed
    warn_accelerator_fallback(model)
    if args.json:
        report = {
            "bundle": str(args.bundle),
            "name": manifest.name,
            "version": manifest.version,
            "backend": model.backend,
            "precision": manifest.precision,
            "ok": passed,
            "not_checked": [check["check"] for check in checks if check["ok"] is None],
            "checks": checks,
        }
        print(json.dumps(report, indent=2))
    else:
        for check in checks:
            status = {True: "ok", False: "FAIL", None: "n/a"}[check["ok"]]
            print(f"{status:4}  {_describe(check)}")
        print(_summary(manifest.name, manifest.version, checks))
    return 0 if passed else 1
