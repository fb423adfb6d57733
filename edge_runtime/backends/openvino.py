"""OpenVINO (.xml + .bin IR): the CPU plugin everywhere, an Intel GPU or NPU where the bundle asks for one and the
device has it; a loud fallback to the CPU otherwise, as for ONNX Runtime's providers.

- **Precision.** The CPU plugin computes in bf16 by itself on CPUs that have it (AMX, AVX-512 BF16), and the GPU in
  fp16: fidelity measured at export would not hold. The session sets ``INFERENCE_PRECISION_HINT`` to what the
  bundle's IR says it was measured with (``rt_info`` ``edgeline/inference_precision``, written by the exporter; f32
  when absent). A CPU without that arithmetic does not compute it: asked for f16, a CPU with AVX512-FP16 (Xeon of
  the 4th generation on) computes f16, one with AVX-512 BF16 and no FP16 (Zen 4, Cooper Lake) would compute bf16,
  coarser than f16 (8 bits of mantissa against 11) and never measured, so the session compiles again in f32 (said
  once); one with neither computes f32 by itself. ``computes`` says what runs: f16 or f32, never bf16 unless the
  bundle asks for it.
- **Compiled-model cache.** ``CACHE_DIR`` (``set_cache_dir``: the daemon points it into its state directory) so a
  restart loads the compiled blob instead of compiling again (seconds on a GPU or NPU).
- **One thread and int8 fully connected layers.** On one inference thread, OpenVINO 2026's CPU plugin (2026.0 to
  2026.4.1, measured) fuses a chain of int8 fully connected layers into one Snippets kernel (a ``Subgraph`` node of
  its runtime graph); on a Xeon with AMX that kernel computes wrong results (an int8 autoencoder's anomaly decisions:
  50% right, against 99% for the same IR on two threads, and for 2025.4 on one). A session asked for one thread that
  finds such a node compiles again on two threads, where the plugin keeps the layers apart, and says so once
  (``fused_int8_matmuls``). Such a model (int8, two fully connected layers or more) is compiled afresh at every
  start, never from the cache: a cached compilation keeps its fusion whatever thread count loads it, and a loaded
  one's runtime graph does not say.
- **Batches.** ``batched(size)`` reshapes the model's first dimension, where its graph allows (the NPU plugin needs
  static shapes: each batch size is a model of its own, compiled once).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
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
    "CACHE_KEEP",
    "CPU",
    "DEVICES",
    "PRECISIONS",
    "PRECISION_KEY",
    "OpenVINOBackend",
    "OpenVINOSession",
    "import_openvino",
    "set_cache_dir",
]

CPU = "CPU"
DEVICES = ("CPU", "GPU", "NPU")
"""OpenVINO's device plugins edgeline names in a bundle's ``placement.accelerator`` (None or ``CPU``: the CPU)."""
PRECISION_KEY = ["edgeline", "inference_precision"]
"""Where the exporter writes, in the IR's ``rt_info``, the precision its fidelity was measured with (f32, f16)."""

log = logging.getLogger(__name__)

PRECISIONS = ("f32", "f16", "bf16")
"""The inference precisions a bundle may ask the plugin for (``INFERENCE_PRECISION_HINT``)."""
_DTYPES = {
    "f32": "float32",
    "f16": "float16",
    "i8": "int8",
    "u8": "uint8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "boolean": "bool",
}
CACHE_KEEP = 8
"""Compiled models kept in the cache directory, newest first: the running version's (for single samples and for the
daemon's batches), and a few others an update may roll back to; older ones are deleted when the directory is set."""
_cache: dict[str, str | None] = {"dir": None}
_lock = threading.Lock()


def has_device(available: Sequence[str], device: str) -> bool:
    """Whether OpenVINO's ``available_devices`` (``CPU``, ``GPU.0``, ``GPU.1``, ``NPU``) hold a ``device``."""
    return any(found.split(".")[0] == device for found in available)


def set_cache_dir(directory: Path | None) -> None:
    """Where compiled models are cached from now on (None: not cached). The directory is made, and its compiled
    models beyond the ``CACHE_KEEP`` newest deleted (each update compiles one more); a directory that cannot be made
    or written leaves caching off, said once in the log: a restart then compiles again, nothing else is lost."""
    if directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for entry in directory.iterdir():  # a blob that is not a regular file (a FIFO would block the compiler)
                if entry.suffix == ".blob" and (entry.is_symlink() or not entry.is_file()) and not entry.is_dir():
                    entry.unlink()
            blobs = sorted(
                (entry for entry in directory.iterdir() if entry.is_file() and entry.suffix == ".blob"),
                key=lambda entry: entry.stat().st_mtime,
                reverse=True,
            )
            for old in blobs[CACHE_KEEP:]:
                old.unlink(missing_ok=True)
            probe = directory / ".edgeline-write-check"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            log.warning("openvino: compiled models are not cached (%s: %s); every start compiles again", directory, exc)
            directory = None
    with _lock:
        _cache["dir"] = None if directory is None else str(directory)


def import_openvino() -> Any:
    """The ``openvino`` module, or the error naming the extra that installs it."""
    try:
        import openvino
    except ImportError as exc:
        raise BackendUnavailableError(
            "openvino is not installed (the openvino backend's bundles need it): pip install 'edgeline[openvino]'"
        ) from exc
    return openvino


def _one_line(exc: BaseException) -> str:
    """OpenVINO's exceptions open with where in its sources they were raised, then the check that failed: the
    message is the last line that is neither."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("Exception from", "Check '"))]
    return (said or lines or [type(exc).__name__])[-1]


def _type_name(value: Any) -> str:
    """An OpenVINO element type (or its string) as its short name: ``<Type: 'float32'>`` -> f32."""
    name = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(name, name)


def _spec(port: Any, model_path: Path) -> TensorSpec:
    name = port.get_any_name()
    dtype = _DTYPES.get(port.get_element_type().get_type_name())
    if dtype is None:
        raise BundleError(f"{model_path}: tensor {name!r} is {port.get_element_type()}, which edgeline does not run")
    shape = port.get_partial_shape()
    if shape.is_dynamic:
        raise BundleError(f"{model_path}: tensor {name!r} has the shape {shape}: edgeline runs fixed shapes")
    return TensorSpec(name=name, dtype=dtype, shape=tuple(int(dim) for dim in shape.to_shape()))


def _property(compiled: Any, name: str, default: Any) -> Any:
    """A compiled model's property, or ``default`` where its plugin does not have it."""
    try:
        return compiled.get_property(name)
    except Exception:  # openvino raises RuntimeError subclasses for an unsupported property
        return default


def _config(core: Any, device: str, precision: str, threads: int) -> dict[str, Any]:
    """What a session asks of ``device``'s plugin: the bundle's precision, latency first, and on the CPU the thread
    count; another plugin gets only what it supports (an NPU computes in its own precision and takes no hint)."""
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
    if device == CPU:
        return {**config, "INFERENCE_NUM_THREADS": threads}
    try:
        supported = set(core.get_property(device, "SUPPORTED_PROPERTIES"))
    except Exception:  # a plugin that cannot say: the hints are left to it
        supported = set()
    return {key: value for key, value in config.items() if key in supported}


def _compile(core: Any, model: Any, device: str, config: dict[str, Any], cache: str | None) -> Any:
    """The model compiled for ``device``, loaded from (or stored in) the compiled-model cache when there is one. A
    cache that fails (its directory gone since it was set) costs a compilation, never the model."""
    if cache is not None:
        try:
            compiled = core.compile_model(model, device, {**config, "CACHE_DIR": cache})
        except Exception as exc:
            log.warning("openvino: compiling without the cache %s (%s)", cache, _one_line(exc))
        else:
            return compiled
    return core.compile_model(model, device, config)


def _fusable(model: Any) -> bool:
    """An int8 model (FakeQuantize) with two MatMul operators or more: what the CPU plugin may fuse (see the module)."""
    kinds = Counter(op.get_type_name() for op in model.get_ops())
    return kinds["MatMul"] >= 2 and kinds["FakeQuantize"] > 0


def _compile_cpu(
    core: Any, model: Any, precision: str, threads: int, cache: str | None, model_path: Path
) -> tuple[Any, int]:
    """The model compiled for the CPU, and on how many threads: two where one would fuse its int8 fully connected
    layers (see the module); in f32 where the plugin would compute another precision than the bundle's."""
    compiled = _compile(core, model, CPU, _config(core, CPU, precision, threads), cache)
    if threads == 1 and cache is None and fused_int8_matmuls(model, compiled):
        _say_fused_once(model_path)
        threads = 2
        compiled = _compile(core, model, CPU, _config(core, CPU, precision, threads), None)
    computes = _type_name(_property(compiled, "INFERENCE_PRECISION_HINT", precision))
    if computes not in (precision, "f32"):
        _say_pinned_once(model_path, precision, computes)
        compiled = _compile(core, model, CPU, _config(core, CPU, "f32", threads), cache)
    return compiled, threads


def fused_int8_matmuls(model: Any, compiled: Any) -> bool:
    """Whether the CPU plugin fused the weighted (MatMul) operators of an int8 model (one with FakeQuantize) into a
    ``Subgraph`` node of its runtime graph (its Snippets kernels): see the module. Read from the runtime graph's
    ``layerType`` and ``originalLayersNames`` (what ``get_runtime_model`` documents for every node)."""
    ops = model.get_ops()
    matmuls = {op.get_friendly_name() for op in ops if op.get_type_name() == "MatMul"}
    if not matmuls or not any(op.get_type_name() == "FakeQuantize" for op in ops):
        return False
    for node in compiled.get_runtime_model().get_ordered_ops():
        info = node.get_rt_info()
        if "layerType" not in info or info["layerType"].astype(str) != "Subgraph":
            continue
        fused = info["originalLayersNames"].astype(str) if "originalLayersNames" in info else ""
        if matmuls & set(fused.split(",")):
            return True
    return False


def _say_once(model_path: Path, what: str, level: int, message: str, *args: object) -> None:
    """Log ``message`` (about ``model_path``, its first argument) once per model and ``what``."""
    with _lock:
        if (model_path, what) in _said:
            return
        _said.add((model_path, what))
    log.log(level, message, model_path, *args)


def _say_fused_once(model_path: Path) -> None:
    _say_once(
        model_path,
        "fused",
        logging.WARNING,
        "openvino: %s runs on 2 CPU threads, not 1: on one, this OpenVINO fuses its int8 fully connected layers into "
        "one kernel, which computes wrong results on some CPUs (AMX)",
    )


def _say_pinned_once(model_path: Path, precision: str, computes: str) -> None:
    _say_once(
        model_path,
        "pinned",
        logging.INFO,
        "openvino: %s computes in f32 here: asked for %s, this CPU's plugin would compute %s (it has no %s "
        "arithmetic), which the bundle's fidelity was not measured in",
        precision,
        computes,
        precision,
    )


_said: set[tuple[Path, str]] = set()
"""What was said once per model: ``fused`` (two threads, not one), ``pinned`` (f32, not the plugin's choice)."""


class OpenVINOSession:
    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
        batch_size: int | None = None,
    ):
        ov = import_openvino()
        self._model_path, self._threads, self._wanted = model_path, threads, accelerator
        self._input_names_asked = input_names
        core = ov.Core()
        with _lock:
            cache = _cache["dir"]
        try:
            model = core.read_model(str(model_path))
        except Exception as exc:  # openvino raises RuntimeError subclasses of its own
            raise BundleError(f"{model_path}: OpenVINO could not read the model: {_one_line(exc)}") from exc
        if batch_size is not None:
            try:
                model.reshape({port.get_any_name(): [batch_size, *port.get_shape()[1:]] for port in model.inputs})
            except Exception as exc:
                raise BundleError(
                    f"{model_path}: the model does not take a batch of {batch_size}: {_one_line(exc)}"
                ) from exc
        self.precision = "f32"
        if model.has_rt_info(PRECISION_KEY):
            self.precision = str(model.get_rt_info(PRECISION_KEY).astype(str))
            if self.precision not in PRECISIONS:
                raise BundleError(
                    f"{model_path}: its rt_info {'/'.join(PRECISION_KEY)} is {self.precision[:40]!r}, not one of "
                    f"{', '.join(PRECISIONS)}"
                )
        self.accelerator: str | None = None
        self.fallback_reason: str | None = None
        device = CPU
        wanted = None if accelerator in (None, CPU) else accelerator
        if wanted is not None:
            available = core.available_devices
            if has_device(available, wanted):
                device = wanted
            else:
                self.fallback_reason = f"OpenVINO has no {wanted} plugin device here (it has {', '.join(available)})"
        cpu_cache = None if _fusable(model) else cache
        try:
            if device == CPU:
                compiled, threads = _compile_cpu(core, model, self.precision, threads, cpu_cache, model_path)
            else:
                compiled = _compile(core, model, device, _config(core, device, self.precision, threads), cache)
        except Exception as exc:
            if device == CPU:
                raise BundleError(
                    f"{model_path}: OpenVINO could not compile the model for the CPU: {_one_line(exc)}"
                ) from exc
            self.fallback_reason = f"the {device} plugin could not compile the model: {_one_line(exc)}"
            try:
                compiled, threads = _compile_cpu(core, model, self.precision, threads, cpu_cache, model_path)
            except Exception as again:
                raise BundleError(
                    f"{model_path}: OpenVINO could not compile the model for {device} nor the CPU: {_one_line(again)}"
                ) from again
            device = CPU
        self.threads = threads
        """The CPU plugin's inference threads (two where one would fuse int8 fully connected layers)."""
        self.accelerator = None if device == CPU else device
        self.computes = _type_name(_property(compiled, "INFERENCE_PRECISION_HINT", "unknown"))
        """What the plugin computes the float parts in here (f32, f16, bf16): the hint where the device has it."""
        self.from_cache = cache is not None and bool(_property(compiled, "LOADED_FROM_CACHE", False))
        """Whether the compiled model came from the compiled-model cache (``set_cache_dir``) rather than a compiler."""
        log.debug(
            "openvino: %s %s on %s", model_path.name, "loaded from the cache" if self.from_cache else "compiled", device
        )
        inputs = list(compiled.inputs)
        if input_names is not None:
            by_name = {port.get_any_name(): port for port in inputs}
            if sorted(by_name) != sorted(input_names) or len(input_names) != len(inputs):
                raise BundleError(
                    f"{model_path}: model inputs {sorted(by_name)} differ from the manifest's {list(input_names)}"
                )
            inputs = [by_name[name] for name in input_names]
        self._inputs = [_spec(port, model_path) for port in inputs]
        self._outputs = [_spec(port, model_path) for port in compiled.outputs]
        positions = {port.get_any_name(): index for index, port in enumerate(compiled.inputs)}
        self._input_indices = [positions[port.get_any_name()] for port in inputs]
        self._tensor = ov.Tensor
        self._request = compiled.create_infer_request()

    def batched(self, size: int) -> OpenVINOSession | None:
        """The same model taking ``size`` samples per call, or None when its graph fixes the batch or the NPU runs
        it (one static shape: the one it was compiled for)."""
        if self.accelerator == "NPU":
            return None
        try:
            return OpenVINOSession(
                self._model_path,
                threads=self._threads,
                input_names=self._input_names_asked,
                accelerator=self._wanted,
                batch_size=size,
            )
        except BundleError:
            return None

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The inputs handed over without a copy (tensors over the arrays' memory, alive through the call), the
        outputs copied once out of the request's tensors, which its next run overwrites: half the time per call of
        ``infer(dict)``, which converts both ways (70 -> 35 us on the digits model)."""
        request = self._request
        for index, spec, array in zip(self._input_indices, self._inputs, inputs, strict=True):
            own = np.ascontiguousarray(array, dtype=spec.dtype)  # a no-op for the model's own arrays
            request.set_input_tensor(index, self._tensor(own, shared_memory=True))
        request.infer()
        return [np.array(request.get_output_tensor(j).data, copy=True) for j in range(len(self._outputs))]


class OpenVINOBackend(RuntimeBackend):
    """OpenVINO: the CPU plugin runs any IR; an Intel GPU or NPU where the bundle asks and the plugin finds one."""

    name = "openvino"
    package = "openvino"
    module = "openvino"
    install = "pip install 'edgeline[openvino]'"
    file_suffixes = (".xml",)

    def imported(self, module: Any, version: str | None) -> RuntimeFacts:
        try:
            devices = tuple(module.Core().available_devices)
        except Exception as exc:  # a plugin that fails to load is reported, not raised
            return RuntimeFacts(version=version, imports=False, error=f"Core().available_devices: {exc}")
        return RuntimeFacts(version=version, imports=True, devices=devices)

    def accelerators(self, facts: Facts) -> dict[str, dict[str, Any]]:
        return {"intel-gpu": self._device(facts, "GPU"), "intel-npu": self._device(facts, "NPU")}

    def _device(self, facts: Facts, device: str) -> dict[str, Any]:
        runtime = facts.runtimes.get(self.name)
        if runtime is None or not runtime.imports:
            return {"present": False, "detail": f"openvino is not installed ({self.install})"}
        return {
            "present": has_device(runtime.devices, device),
            "detail": "OpenVINO devices: " + (", ".join(runtime.devices) or "none"),
        }

    def target_here(self, accelerator: str | None, facts: Facts) -> bool | None:
        runtime = facts.runtimes.get(self.name)
        return accelerator is None or (runtime is not None and has_device(runtime.devices, accelerator))

    def verdict(self, asked: Asked) -> Verdict | None:
        accelerator, runtime = asked.accelerator, asked.runtime
        if accelerator is None:
            return None
        if has_device(runtime.devices, accelerator):
            return asked.runs(self.name, asked.model, accelerator, None, f"OpenVINO has its {accelerator} device")
        if runtime.imports:  # devices known: the plugin found none
            has = ", ".join(runtime.devices) or "no device"
            why = f"OpenVINO has no {accelerator} device here (it has {has})"
            return asked.runs(self.name, asked.model, None, why, "the CPU plugin runs any IR")
        return None

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> OpenVINOSession:
        return OpenVINOSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)

    def cache_compiled_models(self, directory: Path | None) -> None:
        set_cache_dir(directory)
