"""ONNX Runtime: the CPU provider everywhere, a GPU provider where the device has one, Qualcomm's HTP through the
``onnxruntime-qnn`` plugin.

A bundle names the accelerator it was built for (``placement.accelerator``); the session asks onnxruntime for it
and says what really runs the model (``accelerator``, None for the CPU). When the accelerator is missing, the
model runs on the CPU provider where it can, and ``fallback_reason`` says what was missing: ``Model`` and the
daemon turn that into a loud warning, never a silent slowdown.

On the HTP, CPU fallback is disabled inside onnxruntime: an operator QNN refuses fails the session instead of
quietly running on the CPU. A QNN EP-context model (the compiled context binary) cannot run anywhere else; the
export keeps its QDQ model beside it (``<model>.qdq.onnx``) for the CPU.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeline.backends.base import Asked, RuntimeBackend, RuntimeFacts, Verdict
from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import TensorSpec

if TYPE_CHECKING:
    from edgeline.backends.base import Facts

__all__ = [
    "CPU",
    "CPU_COPY_SUFFIX",
    "QNN_CONTEXT_SUFFIX",
    "QNN_EP",
    "QNN_HTP",
    "OnnxRuntimeBackend",
    "OnnxRuntimeSession",
    "cpu_copy_of",
    "import_onnxruntime",
    "qnn_session_options",
    "qnn_unavailable",
]

CPU = "CPUExecutionProvider"
QNN_HTP = "qnn-htp"
"""The accelerator name of bundles compiled for Qualcomm's Hexagon NPU (HTP backend of the QNN provider)."""
QNN_EP = "QNNExecutionProvider"
CPU_COPY_SUFFIX = ".qdq.onnx"
"""The QDQ model an EP-context bundle keeps for the CPU provider, beside the context model: ``model.onnx`` ->
``model.qdq.onnx``."""
QNN_CONTEXT_SUFFIX = "_qnn.bin"
"""The context binary a qnn-htp bundle's EP-context model points at (``model.onnx`` -> ``model_qnn.bin``)."""

# What a GPU accelerator implies, in onnxruntime's order of preference (the CPU provider is always added last).
_PROVIDER_CHAINS: dict[str, tuple[str, ...]] = {
    "TensorrtExecutionProvider": ("TensorrtExecutionProvider", "CUDAExecutionProvider"),
    "CUDAExecutionProvider": ("CUDAExecutionProvider",),
}
_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
}
_QUIET = 3  # onnxruntime's own log: errors only (the QNN plugin warns about Windows-only features on every session)


def import_onnxruntime() -> Any:
    """The ``onnxruntime`` module, or the error naming the extra that installs it."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError(
            "onnxruntime is not installed (the onnxruntime backend's bundles need it): pip install 'edgeline[onnx]'"
        ) from exc
    return onnxruntime


def cpu_copy_of(model_path: Path) -> Path:
    return model_path.with_name(model_path.name.removesuffix(".onnx") + CPU_COPY_SUFFIX)


@functools.cache
def _qnn_devices() -> tuple[tuple[Any, ...], str] | str:
    """The QNN provider's devices and its HTP backend library, or why there are none. Registering the plugin
    library is process-wide and allowed once, hence the cache (and the check for a registration made elsewhere)."""
    ort = import_onnxruntime()
    try:
        import onnxruntime_qnn
    except ImportError:
        return "onnxruntime-qnn is not installed (pip install 'edgeline[qnn]')"
    try:
        if not any(device.ep_name == QNN_EP for device in ort.get_ep_devices()):
            ort.register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
        devices = tuple(device for device in ort.get_ep_devices() if device.ep_name == QNN_EP)
    except Exception as exc:  # onnxruntime's errors derive from Exception only
        return f"the QNN provider library did not load: {exc}"
    if not devices:
        return "the QNN provider found no device"
    return devices, onnxruntime_qnn.get_qnn_htp_path()


def qnn_unavailable() -> str | None:
    """Why the QNN HTP provider cannot be used here, or None when it can."""
    found = _qnn_devices()
    return found if isinstance(found, str) else None


def qnn_session_options(threads: int = 1, **provider_options: str) -> Any:
    """Session options that put the whole model on the HTP, CPU fallback disabled: an operator QNN refuses
    fails the session, naming no CPU run. Raises BackendUnavailableError when QNN is not usable here."""
    ort = import_onnxruntime()
    found = _qnn_devices()
    if isinstance(found, str):
        raise BackendUnavailableError(f"the QNN HTP provider is not usable here: {found}")
    devices, htp_library = found
    options = _options(ort, threads)
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    options.add_provider_for_devices(list(devices), {"backend_path": htp_library, **provider_options})
    return options


def _options(ort: Any, threads: int) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = _QUIET
    return options


def _spec(node_arg: Any, model_path: Path) -> TensorSpec:
    dtype = _DTYPES.get(node_arg.type)
    if dtype is None:
        raise BundleError(
            f"{model_path}: tensor {node_arg.name!r} has the type {node_arg.type}, which edgeline does not run"
        )
    if not all(isinstance(dim, int) and dim > 0 for dim in node_arg.shape):
        raise BundleError(
            f"{model_path}: tensor {node_arg.name!r} has the shape {node_arg.shape}: edgeline runs fixed shapes"
        )
    # A QDQ model takes and gives floats: its quantization is inside the graph, so the spec has none.
    return TensorSpec(name=node_arg.name, dtype=dtype, shape=tuple(node_arg.shape))


class OnnxRuntimeSession:
    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
    ):
        ort = import_onnxruntime()
        self.accelerator: str | None = None
        self.fallback_reason: str | None = None
        self.emulator: str | None = None
        """Set when the accelerator is emulated here: the x86-64 QNN wheel's HTP backend is an emulator."""
        if accelerator == QNN_HTP:
            session = self._open_qnn(ort, model_path, threads)
        else:
            session = self._open_providers(ort, model_path, threads, accelerator)
        session.disable_fallback()  # a failed run must fail, never re-run silently on the CPU provider
        self.computes: str | None = {None: "f32", QNN_HTP: "f16"}.get(self.accelerator)
        """The float operators' arithmetic: f32 on the CPU provider, f16 on Qualcomm's HTP (its emulator too); another
        provider's is not known here."""
        inputs = session.get_inputs()
        if input_names is not None:
            by_name = {arg.name: arg for arg in inputs}
            if sorted(by_name) != sorted(input_names) or len(input_names) != len(inputs):
                raise BundleError(
                    f"{model_path}: model inputs {sorted(by_name)} differ from the manifest's {list(input_names)}"
                )
            inputs = [by_name[name] for name in input_names]
        self._inputs = [_spec(arg, model_path) for arg in inputs]
        self._outputs = [_spec(arg, model_path) for arg in session.get_outputs()]
        self._input_names = [spec.name for spec in self._inputs]
        self._output_names = [spec.name for spec in self._outputs]
        self._session = session

    def _open_qnn(self, ort: Any, model_path: Path, threads: int) -> Any:
        missing = qnn_unavailable()
        if missing is None:
            self.accelerator = QNN_HTP
            if platform.machine().lower() in ("x86_64", "amd64"):
                self.emulator = "the QNN HTP emulator (x86-64)"
            return _session(ort, model_path, qnn_session_options(threads), "the QNN HTP provider (CPU fallback off)")
        copy = cpu_copy_of(model_path)
        if copy.is_file():
            self.fallback_reason = f"{missing}; running the bundle's QDQ model {copy.name} on the CPU provider"
            return _session(ort, copy, _options(ort, threads), "the CPU provider", providers=[CPU])
        self.fallback_reason = missing
        try:
            return _session(ort, model_path, _options(ort, threads), "the CPU provider", providers=[CPU])
        except BundleError as exc:
            raise BundleError(
                f"{model_path}: the model is compiled for Qualcomm's HTP and cannot run here ({missing}), and the "
                f"bundle keeps no QDQ copy ({copy.name}) for the CPU: {exc}"
            ) from exc

    def _open_providers(self, ort: Any, model_path: Path, threads: int, accelerator: str | None) -> Any:
        wanted = () if accelerator in (None, CPU) else _PROVIDER_CHAINS.get(accelerator, (accelerator,))
        available = ort.get_available_providers()
        providers = [name for name in wanted if name in available]
        session = _session(ort, model_path, _options(ort, threads), "onnxruntime", providers=[*providers, CPU])
        in_use = session.get_providers()[0]
        self.accelerator = None if in_use == CPU else in_use
        if accelerator is not None and self.accelerator != accelerator:
            missing = [name for name in wanted if name not in available]
            self.fallback_reason = (
                f"{', '.join(missing)} not in this onnxruntime (it has {', '.join(available)})"
                if missing
                else f"onnxruntime put the model on {in_use}"
            )
        return session

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        feed = dict(zip(self._input_names, inputs, strict=True))
        outputs: list[np.ndarray] = self._session.run(self._output_names, feed)
        return outputs


def _session(ort: Any, model_path: Path, options: Any, on: str, providers: list[str] | None = None) -> Any:
    try:
        return ort.InferenceSession(str(model_path), options, providers=providers)
    except Exception as exc:  # onnxruntime's errors derive from Exception only
        if "EPContext" in str(exc):
            raise BundleError(
                f"{model_path}: a compiled EP-context model (a QNN context binary for Qualcomm's HTP) cannot run on "
                f"{on}; open it with accelerator {QNN_HTP!r} where onnxruntime-qnn is installed"
            ) from exc
        raise BundleError(f"{model_path}: onnxruntime could not open the model on {on}: {exc}") from exc


def _providers_detail(providers: Sequence[str]) -> str:
    return "onnxruntime providers: " + (", ".join(providers) or "onnxruntime not installed")


class OnnxRuntimeBackend(RuntimeBackend):
    """ONNX Runtime: its CPU provider runs any ONNX model; a GPU provider or Qualcomm's HTP where the bundle asks."""

    name = "onnxruntime"
    package = "onnxruntime"
    module = "onnxruntime"
    install = "pip install 'edgeline[onnx]'"
    file_suffixes = (".onnx",)

    def probe(self, *, try_import: bool) -> RuntimeFacts:
        return super().probe(try_import=True)  # its providers are what it offers: always imported

    def imported(self, module: Any, version: str | None) -> RuntimeFacts:
        try:
            providers = tuple(module.get_available_providers())
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            return RuntimeFacts(version=version, imports=False, error=f"get_available_providers: {exc}")
        return RuntimeFacts(version=version, imports=True, providers=providers)

    def accelerators(self, facts: Facts) -> dict[str, dict[str, Any]]:
        found = facts.runtimes.get(self.name)
        providers = found.providers if found is not None else ()
        on_x86 = facts.machine.arch == "x86_64"
        return {
            QNN_HTP: {
                "present": facts.qnn_missing is None,
                "detail": facts.qnn_missing
                or ("the HTP emulator of the x86-64 wheel" if on_x86 else "Qualcomm's HTP libraries"),
            },
            "cuda": {"present": "CUDAExecutionProvider" in providers, "detail": _providers_detail(providers)},
            "tensorrt": {"present": "TensorrtExecutionProvider" in providers, "detail": _providers_detail(providers)},
        }

    def target_here(self, accelerator: str | None, facts: Facts) -> bool | None:
        if accelerator == QNN_HTP:  # an EP-context model runs only on the HTP (its QDQ copy is a fallback)
            return True if facts.qnn_missing is None else None
        if accelerator is not None and accelerator.endswith("ExecutionProvider"):
            found = facts.runtimes.get(self.name)
            return found is not None and accelerator in found.providers
        return True

    def verdict(self, asked: Asked) -> Verdict | None:
        if asked.accelerator == QNN_HTP:
            return self._htp_verdict(asked)
        accelerator = asked.accelerator
        if accelerator is None or not accelerator.endswith("ExecutionProvider"):
            return None
        providers = asked.runtime.providers
        if accelerator in providers:
            return asked.runs(self.name, asked.model, accelerator, None, f"onnxruntime has {accelerator}")
        why = f"{accelerator} is not in this onnxruntime (it has {', '.join(providers) or 'no providers listed'})"
        return asked.runs(self.name, asked.model, None, why, "the CPU provider runs any ONNX model")

    def _htp_verdict(self, asked: Asked) -> Verdict:
        """An EP-context model runs on the HTP it was compiled for; elsewhere the bundle's QDQ copy on the CPU."""
        name, model, files, facts, profile = self.name, asked.model, asked.files, asked.facts, asked.profile
        htp_missing = facts.qnn_missing
        other_soc = htp_missing is None and profile and facts.soc and facts.soc.lower() not in profile.name.lower()
        if other_soc:
            assert profile is not None
            soc = f"soc_model {profile.qnn.soc_model}, " if profile.qnn is not None else ""
            htp_missing = f"the context binary is for {soc}{profile.name}; this SoC is {facts.soc}"
        if htp_missing is None:
            emulated = "the QNN HTP emulator (x86-64)" if facts.machine.arch == "x86_64" else facts.machine.emulated
            return asked.runs(name, model, QNN_HTP, None, "the QNN provider runs the context binary", emulated=emulated)
        copy = model.removesuffix(".onnx") + CPU_COPY_SUFFIX
        if copy in files:
            why = f"{htp_missing}; the QDQ model {copy} runs on the CPU provider instead"
            return asked.runs(name, copy, None, why, "the context binary runs only on Qualcomm's HTP",
                              cpu_instead=bool(other_soc))  # fmt: skip
        if any(path.endswith(QNN_CONTEXT_SUFFIX) for path in files):
            return asked.refused(name, f"a QNN context binary for Qualcomm's HTP ({htp_missing}), and the bundle keeps "
                                 f"no QDQ copy ({copy}) for the CPU")  # fmt: skip
        return asked.runs(name, model, None, htp_missing, "a QDQ model the CPU provider runs too")

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> OnnxRuntimeSession:
        return OnnxRuntimeSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
