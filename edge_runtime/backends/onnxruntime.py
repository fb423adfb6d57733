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
from typing import Any, ClassVar

import numpy as np

from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import TensorSpec

__all__ = [
    "CPU",
    "CPU_COPY_SUFFIX",
    "QNN_EP",
    "QNN_HTP",
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
    file_suffixes: ClassVar[tuple[str, ...]] = (".onnx",)

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
