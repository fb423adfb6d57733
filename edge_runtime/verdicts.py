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

The verdict is a prediction from the bundle's manifest and files; the session that opens the model then does what
it says (a test holds the two together on every bundle it has).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.device_facts import RUNTIMES, Facts, RuntimeFacts, RuntimeInfo, gather, has_openvino_device

if TYPE_CHECKING:
    from edgeline.device_profiles import Profile
    from edgeline.manifest import Manifest

__all__ = [
    "COREML_ACCELERATORS",
    "CPU_PROVIDER",
    "ETHOS_U_CPU_MODEL",
    "QNN_CONTEXT_SUFFIX",
    "TARGET_RUNTIMES",
    "Verdict",
    "bundle_verdict",
    "runnable_targets",
    "runtime_refusal",
    "verdict",
    "verdict_for",
]

TARGET_RUNTIMES: dict[str, tuple[str, str | None]] = {
    "litert": ("litert", None),
    "executorch-xnnpack": ("executorch", None),
    "executorch-coreml": ("executorch", "coreml"),
    "onnxruntime": ("onnxruntime", None),
    "qnn-htp": ("onnxruntime", "qnn-htp"),
    "ethos-u": ("litert", "ethos-u"),
    "tflite-micro": ("tflite-micro", None),
    "coreml": ("coreml", "coreml"),
    "openvino": ("openvino", None),
    "openvino-gpu": ("openvino", "GPU"),
    "openvino-npu": ("openvino", "NPU"),
}
"""A profile target's export backend -> the runtime backend its bundles name and the accelerator they ask for
(None: the CPU; an onnxruntime target asks for the profile's first provider). The device side cannot import the
exporters; a test holds this table to their ``runtime_backend``."""

QNN_CONTEXT_SUFFIX = "_qnn.bin"
"""The context binary a qnn-htp bundle's EP-context model points at (``model.onnx`` -> ``model_qnn.bin``)."""
ETHOS_U_CPU_MODEL = "model_int8.tflite"  # edgeline.backends.ethos_u.CPU_MODEL, without importing the backend
COREML_ACCELERATORS = frozenset({"neural-engine", "gpu", "coreml"})
CPU_PROVIDER = "CPUExecutionProvider"


def runnable_targets(profile: Profile, facts: Facts) -> list[str]:
    """The targets of ``profile`` whose bundles run here (on their accelerator or with a fallback)."""
    runs = []
    for target in profile.targets:
        backend, accelerator = TARGET_RUNTIMES.get(target.backend, (target.backend, None))
        if target.backend == "onnxruntime" and profile.onnxruntime is not None:
            first = profile.onnxruntime.providers[0]
            accelerator = None if first == CPU_PROVIDER else first
        runtime = facts.runtimes.get(backend)
        if runtime is None or runtime.version is None or runtime.imports is False:
            continue
        if (backend == "coreml" or accelerator == "coreml") and facts.system != "Darwin":
            continue
        if accelerator == "qnn-htp" and facts.qnn_missing is not None:
            continue  # an EP-context model runs only on the HTP (its QDQ copy is a fallback, not this target)
        label = f"{target.backend} {target.precision.value}"
        if accelerator == "ethos-u" and facts.ethos_u_delegate is None:
            label += " (CPU fallback)"
        elif backend == "openvino" and accelerator is not None:
            if not has_openvino_device(runtime, accelerator):
                label += " (CPU fallback)"
        elif accelerator is not None and accelerator.endswith("ExecutionProvider"):
            ort = facts.runtimes["onnxruntime"]
            if accelerator not in ort.providers:
                label += " (CPU fallback)"
        runs.append(label)
    return runs


@dataclass(frozen=True)
class Verdict:
    """Will a bundle run here, and how."""

    runs: bool
    backend: str
    model: str
    """The bundle's file the runtime will open."""
    accelerator: str | None
    """What will run it (None: the CPU)."""
    fallback: str | None
    """Why it will not run on the accelerator it was built for, or None."""
    reason: str
    """Why it runs as it does, or why it cannot run here."""
    emulated: str | None = None
    """What emulates the accelerator or the machine here: its timings are not the device's."""
    device: str | None = None
    """Why this machine's figures are not the device's (``edgeline.machine.mismatch``), or None when they are."""
    runtime: dict[str, str | None] = field(default_factory=dict)
    cpu_instead: bool = False
    """Open ``model`` on the CPU: a fallback the session cannot see for itself (a context binary for another SoC
    would be handed to the HTP)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> list[str]:
        on = self.accelerator or "the CPU"
        first = (
            f"runs here: {self.backend} opens {self.model} on {on}" if self.runs else f"cannot run here: {self.reason}"
        )
        lines = [first]
        if self.runs:
            lines.append(f"why: {self.reason}")
        if self.fallback:
            lines.append(f"FALLBACK: {self.fallback}")
        if self.runtime:
            needs = self.runtime.get("needs")
            lines.append(
                f"runtime: {self.runtime.get('package')} {self.runtime.get('version') or 'not installed'}"
                + (f" (the bundle needs >= {needs})" if needs else "")
            )
        if self.emulated:
            lines.append(f"emulated: {self.emulated}: timings here are not the device's")
        lines.append(
            "device: this machine is of the bundle's device kind: its budgets are checked here"
            if self.device is None
            else f"device: budgets not checked here: {self.device}"
        )
        return lines


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


def runtime_refusal(backend: str, package: str, min_version: str | None, *, try_import: bool = False) -> str | None:
    """Why a bundle for runtime ``backend`` (needing ``package`` >= ``min_version``) cannot run on this machine, as
    far as its runtime alone tells; None when it can. The rule ``verdict`` applies, for a signed update's metadata
    before its archive is fetched."""
    info = RUNTIMES.get(backend)
    if info is None:
        return f"unknown runtime backend {backend!r}; valid: {', '.join(sorted(RUNTIMES))}"
    facts = gather([backend], try_import=try_import, qnn=False)
    if backend == "coreml" and facts.system != "Darwin":
        return f"Core ML runs on macOS only (this is {facts.system})"
    if backend == "tflite-micro" and facts.machine.arch != "x86_64":
        return "tflite-micro's Python wheel exists for x86-64 Linux only"
    runtime = facts.runtimes.get(backend) or RuntimeFacts(None, None)
    return _runtime_problem(info, runtime, min_version if package == info.package else None)


def _refused(backend: str, model: str, reason: str, **extra: Any) -> Verdict:
    return Verdict(runs=False, backend=backend, model=model, accelerator=None, fallback=None, reason=reason, **extra)


def verdict(
    manifest: Manifest,
    files: Collection[str],
    facts: Facts,
    *,
    backend: str | None = None,
    profile: Profile | None = None,
) -> Verdict:
    """Whether the bundle of ``manifest`` (holding ``files``) runs on the machine of ``facts``, with ``backend``
    instead of its own runtime if given. ``profile``: the bundle's profile where this install knows it (its QNN SoC)."""
    from edgeline.machine import mismatch

    name = backend or manifest.backend
    model = manifest.model
    machine = facts.machine
    device = "the bundle does not name its device" if manifest.device is None else mismatch(manifest.device, machine)
    info = RUNTIMES.get(name)
    if info is None:
        return _refused(name, model, f"unknown runtime backend {name!r}; valid: {', '.join(sorted(RUNTIMES))}")
    runtime = facts.runtimes.get(name) or RuntimeFacts(version=None, imports=None)
    needs = manifest.runtime.min_version if backend is None and manifest.runtime.package == info.package else None
    described = {"package": info.package, "version": runtime.version, "needs": needs}
    common: dict[str, Any] = {"runtime": described, "device": device, "emulated": machine.emulated}
    accelerator = manifest.placement.accelerator if manifest.placement else None

    if (name == "coreml" or accelerator in COREML_ACCELERATORS) and facts.system != "Darwin":
        return _refused(name, model, f"Core ML runs on macOS only (this is {facts.system})", **common)
    problem = _runtime_problem(info, runtime, needs)
    if problem is not None:
        return _refused(name, model, problem, **common)
    if name == "tflite-micro" and machine.arch != "x86_64":
        return _refused(name, model, "tflite-micro's Python wheel exists for x86-64 Linux only", **common)

    if accelerator == "ethos-u":
        if facts.ethos_u_delegate is not None:
            why = f"the Ethos-U delegate {facts.ethos_u_delegate} runs the NPU's operators"
            return Verdict(True, name, model, "ethos-u", None, why, **common)
        missing = "the Python TFLite Micro has no Ethos-U driver" if name == "tflite-micro" else facts.ethos_u_missing
        if ETHOS_U_CPU_MODEL in files and model != ETHOS_U_CPU_MODEL:
            why = f"{missing}: the int8 model {ETHOS_U_CPU_MODEL} runs on the CPU instead (slower)"
            return Verdict(True, name, ETHOS_U_CPU_MODEL, None, why, "vela's model needs the Ethos-U NPU", **common)
        return _refused(
            name, model, f"a vela model for the Ethos-U NPU, {missing}, and no {ETHOS_U_CPU_MODEL} "
            "to run on the CPU", **common,
        )  # fmt: skip
    if accelerator == "qnn-htp" and name == "onnxruntime":
        htp_missing = facts.qnn_missing
        other_soc = htp_missing is None and profile and facts.soc and facts.soc.lower() not in profile.name.lower()
        if other_soc:
            assert profile is not None
            soc = f"soc_model {profile.qnn.soc_model}, " if profile.qnn is not None else ""
            htp_missing = f"the context binary is for {soc}{profile.name}; this SoC is {facts.soc}"
        if htp_missing is None:
            emulated = "the QNN HTP emulator (x86-64)" if machine.arch == "x86_64" else machine.emulated
            common["emulated"] = emulated
            return Verdict(True, name, model, "qnn-htp", None, "the QNN provider runs the context binary", **common)
        stem = model.removesuffix(".onnx")
        copy = f"{stem}.qdq.onnx"
        if copy in files:
            why = f"{htp_missing}; the QDQ model {copy} runs on the CPU provider instead"
            common["cpu_instead"] = bool(other_soc)
            return Verdict(True, name, copy, None, why, "the context binary runs only on Qualcomm's HTP", **common)
        if any(path.endswith(QNN_CONTEXT_SUFFIX) for path in files):
            return _refused(
                name, model, f"a QNN context binary for Qualcomm's HTP ({htp_missing}), and the bundle keeps no QDQ "
                f"copy ({copy}) for the CPU", **common,
            )  # fmt: skip
        return Verdict(True, name, model, None, htp_missing, "a QDQ model the CPU provider runs too", **common)
    if accelerator is not None and accelerator.endswith("ExecutionProvider") and name == "onnxruntime":
        providers = runtime.providers
        if accelerator in providers:
            return Verdict(True, name, model, accelerator, None, f"onnxruntime has {accelerator}", **common)
        why = f"{accelerator} is not in this onnxruntime (it has {', '.join(providers) or 'no providers listed'})"
        return Verdict(True, name, model, None, why, "the CPU provider runs any ONNX model", **common)
    if name == "executorch":
        return _executorch_verdict(model, accelerator, runtime, common)
    if name == "openvino" and accelerator is not None:
        if has_openvino_device(runtime, accelerator):
            return Verdict(True, name, model, accelerator, None, f"OpenVINO has its {accelerator} device", **common)
        if runtime.imports:  # devices known: the plugin found none
            has = ", ".join(runtime.devices) or "no device"
            why = f"OpenVINO has no {accelerator} device here (it has {has})"
            return Verdict(True, name, model, None, why, "the CPU plugin runs any IR", **common)
    if accelerator is not None and accelerator not in COREML_ACCELERATORS:
        return Verdict(
            True, name, model, accelerator, None, f"{info.package} is installed; the accelerator {accelerator} is "
            "not checked ahead (the runtime says at load)", **common,
        )  # fmt: skip
    on = "on macOS" if name == "coreml" else "on the CPU"
    installed = f"{info.package} {runtime.version}" if runtime.version else info.package
    return Verdict(True, name, model, accelerator, None, f"{installed} runs it {on}", **common)


def _executorch_verdict(model: str, accelerator: str | None, runtime: RuntimeFacts, common: dict[str, Any]) -> Verdict:
    """A .pte runs where the runtime that will open it carries the delegate it was lowered to."""
    from edgeline.backends.executorch import DELEGATE_BACKENDS

    needed = DELEGATE_BACKENDS.get(accelerator or "")
    which = "the torch-free ExecuTorch runtime" if runtime.kind == "torch-free" else "ExecuTorch's Python runtime"
    label = f"{which} {runtime.version or ''}".rstrip()
    if needed is not None and runtime.delegates is not None and needed not in runtime.delegates:
        has = ", ".join(runtime.delegates) or "none"
        return _refused("executorch", model, f"the program is delegated to {needed}, which {label} lacks (it has: "
                        f"{has})", **common)  # fmt: skip
    why = label + (f" with its {needed} delegate" if needed else "") + " runs it"
    if runtime.kind == "python":
        why += " (it imports torch: `edgeline doctor --install executorch` gives the torch-free one)"
    return Verdict(True, "executorch", model, accelerator, None, why, **common)


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
