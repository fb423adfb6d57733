"""Whether a bundle runs on a machine, on which runtime and accelerator, with which fallback, or why not: decided by
pure functions of the bundle's manifest and files and the machine's facts (``edgeline.device_facts``), tested with
other machines' facts.

- ``verdict(manifest, files, facts)``: will this bundle run there. ``edgeline.model.load`` asks ``verdict_for`` (the
  same question, on this machine) before it opens a bundle, so ``run``, ``verify`` and ``infer`` refuse what cannot
  run here (a Core ML model on Linux, a vela model with neither an Ethos-U delegate nor a CPU copy, a QNN context
  binary for another SoC with no QDQ copy) with the verdict's reason, exit code 2, before any model byte is parsed;
  a fallback is said once, loudly, by the session that takes it.
- ``runtime_refusal``: the same rule for a runtime alone (a signed update's metadata, before its archive is fetched).
- ``runnable_targets``: which targets of a device profile have bundles that run on the machine.

The rules every backend shares are here (the runtime installed and new enough, an accelerator not checked ahead);
each runtime backend's own (Core ML off macOS, an Ethos-U or HTP bundle's CPU copy, ExecuTorch's delegates,
OpenVINO's devices) are its class's (``edgeline.backends.base.RuntimeBackend``: ``refusal``, ``verdict``,
``target_here``): a bundle is decided from its manifest (its runtime backend and accelerator) and that class alone.
Only ``runnable_targets`` (no bundle: a profile's targets) asks the export side which runtime backend and accelerator
each target's bundles name: its target's class says (``ExportTarget.runs_with``), imported through the registry
named below as a string; none of those modules imports torch.

The verdict is a prediction from the bundle's manifest and files; the session that opens the model then does what
it says (a test holds the two together on every bundle it has).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.backends import RUNTIME_BACKENDS, runtime_backend
from edgeline.backends.base import Asked, Verdict
from edgeline.device_facts import Facts, RuntimeFacts, RuntimeInfo, gather
from edgeline.errors import BackendUnavailableError, EdgelineError
from edgeline.registry import import_optional, resolve

if TYPE_CHECKING:
    from edgeline.backends.base import RuntimeBackend
    from edgeline.device_profiles import Profile
    from edgeline.manifest import Manifest

__all__ = [
    "COREML_ACCELERATORS",  # noqa: F822 - computed by __getattr__ on first use
    "CPU_PROVIDER",
    "ETHOS_U_CPU_MODEL",  # noqa: F822 - computed by __getattr__ on first use
    "EXPORT_TARGETS",
    "QNN_CONTEXT_SUFFIX",  # noqa: F822 - computed by __getattr__ on first use
    "TARGET_RUNTIMES",  # noqa: F822 - computed by __getattr__ on first use
    "Verdict",
    "bundle_verdict",
    "runnable_targets",
    "runtime_refusal",
    "target_runtime",
    "verdict",
    "verdict_for",
]

EXPORT_TARGETS = "edgeline.export.backends:EXPORT_BACKENDS"
"""The export side's registry of targets (a profile's ``[[targets]] backend``), named as a string and imported on
first use: the device side never imports ``edgeline.export`` by name. Only questions without a bundle read it."""

CPU_PROVIDER = "CPUExecutionProvider"

_MOVED = {  # names this module showed before each backend's class held them
    "QNN_CONTEXT_SUFFIX": "edgeline.backends.onnxruntime",
    "ETHOS_U_CPU_MODEL": "edgeline.backends.litert",
    "COREML_ACCELERATORS": "edgeline.backends.executorch",
}


def __getattr__(name: str) -> Any:
    """The per-backend names this module listed before the classes declared them (``QNN_CONTEXT_SUFFIX``,
    ``ETHOS_U_CPU_MODEL``, ``COREML_ACCELERATORS``), and ``TARGET_RUNTIMES``: every export target -> the runtime
    backend and accelerator its bundles name without a profile, from the targets' classes."""
    if name == "TARGET_RUNTIMES":
        return {target: target_runtime(target, None) for target in _export_targets()}
    from edgeline.device_profiles.lazy import load_name

    return load_name(globals(), _MOVED, name)


def _export_targets() -> dict[str, str]:
    module, _, attribute = EXPORT_TARGETS.partition(":")
    registry: dict[str, str] = getattr(import_optional(module, "a profile's export targets"), attribute)
    return registry


def target_runtime(target: str, profile: Profile | None) -> tuple[str, str | None]:
    """The runtime backend and accelerator the bundles of export target ``target`` for ``profile`` name, as its class
    says (``ExportTarget.runs_with``); a target this install does not know (no export side, or a name it does not
    register): its own name as the runtime backend, on the CPU."""
    try:
        found = resolve(_export_targets(), target, "export target", BackendUnavailableError)
    except EdgelineError:
        return target, None
    runs_with: tuple[str, str | None] = found().runs_with(profile)
    return runs_with


def runnable_targets(profile: Profile, facts: Facts) -> list[str]:
    """The targets of ``profile`` whose bundles run here (on their accelerator or with a fallback)."""
    runs = []
    for target in profile.targets:
        name, accelerator = target_runtime(target.backend, profile)
        runtime = facts.runtimes.get(name)
        if name not in RUNTIME_BACKENDS or runtime is None or runtime.version is None or runtime.imports is False:
            continue
        backend = runtime_backend(name)
        if backend.refusal(accelerator, facts) is not None:
            continue
        here = backend.target_here(accelerator, facts)
        if here is None:
            continue
        label = f"{target.backend} {target.precision.value}"
        runs.append(label if here else f"{label} (CPU fallback)")
    return runs


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _runtime_problem(info: RuntimeInfo, runtime: RuntimeFacts, needs: str | None) -> str | None:
    if runtime.version is None and runtime.imports is not True:
        return f"its runtime {info.package} is not installed here: {info.install}"
    if runtime.imports is False:
        return f"its runtime {info.package} does not import here ({runtime.error}): {info.install}"
    if needs and runtime.version and _version_tuple(runtime.version) < _version_tuple(needs):
        return f"it needs {info.package} >= {needs}; this machine has {runtime.version}"
    return None


def _known_backend(name: str) -> RuntimeBackend | None:
    return runtime_backend(name) if name in RUNTIME_BACKENDS else None


def _unknown(name: str) -> str:
    return f"unknown runtime backend {name!r}; valid: {', '.join(sorted(RUNTIME_BACKENDS))}"


def runtime_refusal(backend: str, package: str, min_version: str | None, *, try_import: bool = False) -> str | None:
    """Why a bundle for runtime ``backend`` (needing ``package`` >= ``min_version``) cannot run on this machine, as
    far as its runtime alone tells; None when it can. The rule ``verdict`` applies, for a signed update's metadata
    before its archive is fetched."""
    found = _known_backend(backend)
    if found is None:
        return _unknown(backend)
    facts = gather([backend], try_import=try_import, qnn=False)
    refusal = found.refusal(None, facts)
    if refusal is not None:
        return refusal
    info = found.info()
    runtime = facts.runtimes.get(backend) or RuntimeFacts(None, None)
    return _runtime_problem(info, runtime, min_version if package == info.package else None)


def verdict(
    manifest: Manifest,
    files: Collection[str],
    facts: Facts,
    *,
    backend: str | None = None,
    profile: Profile | None = None,
) -> Verdict:
    """Whether the bundle of ``manifest`` (holding ``files``) runs on the machine of ``facts``, with ``backend``
    instead of its own runtime if given. ``profile``: the bundle's profile where this install knows it (its QNN SoC).
    The backend's class decides what is its own; the rules below are every backend's."""
    from edgeline.machine import mismatch

    name = backend or manifest.backend
    model = manifest.model
    machine = facts.machine
    device = "the bundle does not name its device" if manifest.device is None else mismatch(manifest.device, machine)
    found = _known_backend(name)
    if found is None:
        return Verdict(False, name, model, None, None, _unknown(name))
    info = found.info()
    runtime = facts.runtimes.get(name) or RuntimeFacts(version=None, imports=None)
    needs = manifest.runtime.min_version if backend is None and manifest.runtime.package == info.package else None
    described = {"package": info.package, "version": runtime.version, "needs": needs}
    common: dict[str, Any] = {"runtime": described, "device": device, "emulated": machine.emulated}
    accelerator = manifest.placement.accelerator if manifest.placement else None
    asked = Asked(model=model, files=files, accelerator=accelerator, facts=facts, runtime=runtime, common=common,
                  profile=profile)  # fmt: skip

    problem = found.refusal(accelerator, facts) or _runtime_problem(info, runtime, needs)
    if problem is not None:
        return asked.refused(name, problem)
    own = found.verdict(asked)
    if own is not None:
        return own
    if accelerator is not None:
        return asked.runs(name, model, accelerator, None, f"{info.package} is installed; the accelerator "
                          f"{accelerator} is not checked ahead (the runtime says at load)")  # fmt: skip
    installed = f"{info.package} {runtime.version}" if runtime.version else info.package
    return asked.runs(name, model, accelerator, None, f"{installed} runs it {found.runs_on}")


def bundle_verdict(path: Path, *, backend: str | None = None, try_import: bool = True) -> Verdict:
    """``verdict`` for the bundle at ``path`` on this machine (its integrity checked first)."""
    from edgeline.bundle import read_bundle

    bundle = read_bundle(path)
    return verdict_for(bundle.manifest, backend=backend, try_import=try_import)


def verdict_for(manifest: Manifest, *, backend: str | None = None, try_import: bool = False) -> Verdict:
    """``verdict`` for a bundle already read, on this machine: the check ``edgeline.model.load`` makes first."""
    name = backend or manifest.backend
    wants_htp = manifest.placement is not None and manifest.placement.accelerator == "qnn-htp"
    facts = gather([name], try_import=try_import, qnn=wants_htp)
    profile = _known_profile(manifest.profile) if wants_htp else None
    return verdict(manifest, {entry.path for entry in manifest.files}, facts, backend=backend, profile=profile)


def _known_profile(profile_id: str) -> Profile | None:
    from edgeline.device_profiles import ProfileError, load_profile

    try:
        return load_profile(profile_id)
    except ProfileError:
        return None
