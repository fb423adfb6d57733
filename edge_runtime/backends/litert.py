"""LiteRT (``ai-edge-litert``) and the legacy ``tflite-runtime``: the same interpreter API, two packages.

Both run a vela model on an Arm Ethos-U NPU through its external delegate where the device has one, and the bundle's
int8 copy on the CPU where it has none (``edgeline.backends.ethos_u``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgeline.backends import ethos_u
from edgeline.backends.base import Asked, RuntimeBackend, Verdict
from edgeline.backends.ethos_u import ETHOS_U
from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import Quantization, TensorSpec

if TYPE_CHECKING:
    from edgeline.backends.base import Facts

__all__ = ["LiteRTBackend", "LiteRTSession", "TFLiteRuntimeBackend", "TFLiteRuntimeSession", "ethos_u_verdict"]


def _spec(detail: dict[str, Any], name: str) -> TensorSpec:
    scale, zero_point = detail["quantization"]
    if scale and not (np.isfinite(scale) and scale > 0):
        raise BundleError(f"tensor {name!r} of the model has the quantization scale {scale}: it must be positive")
    quantization = Quantization(scale=float(scale), zero_point=int(zero_point)) if scale else None
    return TensorSpec(
        name=name,
        dtype=np.dtype(detail["dtype"]).name,
        shape=tuple(int(d) for d in detail["shape"]),
        quantization=quantization,
    )


class _InterpreterSession:
    package: ClassVar[str]
    module: ClassVar[str]
    extra: ClassVar[str]

    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        batch_size: int = 1,
        accelerator: str | None = None,
    ):
        self.accelerator: str | None = None  # the CPU (LiteRT's kernels or XNNPACK) runs every operator
        self.computes = "f32"
        """The float operators' arithmetic: f32 (an fp16 model's weights are dequantized; an NPU computes integers)."""
        self.fallback_reason: str | None = None
        try:
            interpreter_module = importlib.import_module(self.module)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"this bundle needs {self.package}, which is not installed: {self.extra}"
            ) from exc
        self._model_path = model_path
        self._wanted = accelerator
        delegates: list[Any] = []
        if accelerator == ETHOS_U:
            model_path, delegates = self._on_ethos_u(interpreter_module, model_path)
        self.model_path = model_path
        """The file the interpreter runs (``model_int8.tflite`` in place of a vela model without the NPU)."""
        try:
            self._interpreter = interpreter_module.Interpreter(
                model_path=str(model_path), num_threads=threads, experimental_delegates=delegates or None
            )
            if batch_size != 1:  # before the calls are bound: resizing needs the interpreter unreferenced
                for detail in self._interpreter.get_input_details():
                    self._interpreter.resize_tensor_input(detail["index"], [batch_size, *detail["shape"][1:]])
            self._interpreter.allocate_tensors()
            # a tensor name that is not UTF-8 fails here (UnicodeDecodeError is a ValueError)
            inputs = self._interpreter.get_input_details()
            outputs = self._interpreter.get_output_details()
        except (ValueError, RuntimeError) as exc:
            raise BundleError(f"{model_path}: {self.package} could not load the model: {exc}") from exc
        try:
            for detail in [*inputs, *outputs]:
                _spec(detail, detail["name"])
        except BundleError as exc:
            raise BundleError(f"{model_path}: {exc}") from exc
        # The manifest orders inputs like the model's forward(); match by tensor name when it gives names.
        if input_names is not None:
            by_name = {detail["name"]: detail for detail in inputs}
            missing = [name for name in input_names if name not in by_name]
            if missing or len(input_names) != len(inputs):
                raise BundleError(
                    f"{model_path}: model inputs {sorted(by_name)} differ from the manifest's {list(input_names)}"
                )
            inputs = [by_name[name] for name in input_names]
        self._threads = threads
        self._input_names = input_names
        self._input_details = inputs
        self._output_details = outputs
        self._input_indices = [detail["index"] for detail in inputs]
        self._output_indices = [detail["index"] for detail in outputs]
        self._reported = ""
        """What the interpreter's error reporter said last (``_news``)."""
        self._bind_calls()

    def _on_ethos_u(self, interpreter_module: Any, model_path: Path) -> tuple[Path, list[Any]]:
        """A vela model runs through the Ethos-U external delegate (an i.MX 93's NPU); without it, the bundle's int8
        model runs on the CPU, loudly (see ``edgeline.backends.ethos_u``). A plain int8 model is the CPU's."""
        if not ethos_u.is_vela_model(model_path):
            return model_path, []
        library, why = ethos_u.find_delegate()
        if library is not None:
            try:
                delegate = interpreter_module.load_delegate(str(library))
            except (ValueError, RuntimeError, OSError) as exc:
                why = f"the Ethos-U delegate {library} did not load ({exc})"
            else:
                self.accelerator = ETHOS_U
                return model_path, [delegate]
        self.fallback_reason = f"{why}; running {ethos_u.CPU_MODEL} on the CPU"
        return ethos_u.cpu_model_for(model_path, why), []

    def _bind_calls(self) -> None:
        """Bind the interpreter's native calls once, skipping the Python wrapper's per-call checks.

        The public ``invoke()`` first checks (through a reference count) that no numpy view into the
        interpreter's memory is alive; edgeline never creates one (it copies with set/get), so the check
        is ~0.4 µs of pure overhead per inference. Builds without the native wrapper use the public API.
        """
        native = getattr(self._interpreter, "_interpreter", None)
        if native is not None and all(hasattr(native, n) for n in ("SetTensor", "Invoke", "GetTensor")):
            native_get = native.GetTensor
            self._set = native.SetTensor
            self._invoke = native.Invoke

            def get(index: int) -> np.ndarray:
                return native_get(index, 0)

            self._get = get
        else:  # pragma: no cover - every interpreter build we ship has the native wrapper
            self._set = self._interpreter.set_tensor
            self._get = self._interpreter.get_tensor
            self._invoke = self._interpreter.invoke
        if len(self._input_indices) == 1 and len(self._output_indices) == 1:
            self.run = self._run_single  # type: ignore[method-assign]

    def _run_single(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        self._set(self._input_indices[0], inputs[0])
        try:
            self._invoke()
        except RuntimeError as exc:
            raise self._news(exc) from None
        return [self._get(self._output_indices[0])]

    def _news(self, exc: RuntimeError) -> RuntimeError:
        """The interpreter's error reporter keeps every message it was given and says them all at each failure
        (its buffer is never emptied): the fourth failure would quote the first three too. Only the new part."""
        text = str(exc)
        said, self._reported = self._reported, text
        if said and len(text) > len(said) and text.startswith(said):
            return RuntimeError(text[len(said) :])
        return exc

    def batched(self, size: int) -> _InterpreterSession | None:
        """The same model taking ``size`` samples per call (every input's first dimension resized), or None when
        the model cannot: a graph that reshapes to a fixed batch of 1 fails to prepare at the new size."""
        try:
            return type(self)(
                self._model_path,
                threads=self._threads,
                input_names=self._input_names,
                batch_size=size,
                accelerator=self._wanted,
            )
        except BundleError:
            return None

    def input_specs(self) -> list[TensorSpec]:
        return [_spec(detail, detail["name"]) for detail in self._input_details]

    def output_specs(self) -> list[TensorSpec]:
        return [_spec(detail, detail["name"]) for detail in self._output_details]

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        for index, array in zip(self._input_indices, inputs, strict=True):
            self._set(index, array)
        try:
            self._invoke()
        except RuntimeError as exc:
            raise self._news(exc) from None
        return [self._get(index) for index in self._output_indices]


class LiteRTSession(_InterpreterSession):
    package = "ai-edge-litert"
    module = "ai_edge_litert.interpreter"
    extra = "pip install ai-edge-litert (part of edgeline's base install)"


class TFLiteRuntimeSession(_InterpreterSession):
    package = "tflite-runtime"
    module = "tflite_runtime.interpreter"
    extra = "pip install tflite-runtime 'numpy<2' (the legacy package is built against numpy 1.x)"


# -- the backends ---------------------------------------------------------------------------------------------------

ETHOS_U_CPU_MODEL = ethos_u.CPU_MODEL
"""The int8 model an Ethos-U bundle keeps for a CPU without the NPU's driver."""


def ethos_u_verdict(name: str, asked: Asked, missing: str) -> Verdict:
    """A bundle built for the Ethos-U NPU: on it through the external delegate where this machine has one, else its
    int8 copy on the CPU (``missing`` says why), else refused. For every backend that reads LiteRT's flatbuffers."""
    model, files, facts = asked.model, asked.files, asked.facts
    if facts.ethos_u_delegate is not None:
        why = f"the Ethos-U delegate {facts.ethos_u_delegate} runs the NPU's operators"
        return asked.runs(name, model, ETHOS_U, None, why)
    cpu_model = ETHOS_U_CPU_MODEL
    if cpu_model in files and model != cpu_model:
        why = f"{missing}: the int8 model {cpu_model} runs on the CPU instead (slower)"
        return asked.runs(name, cpu_model, None, why, "vela's model needs the Ethos-U NPU")
    return asked.refused(name, f"a vela model for the Ethos-U NPU, {missing}, and no {cpu_model} to run on the CPU")


class _InterpreterBackend(RuntimeBackend):
    file_suffixes = (".tflite",)
    session: ClassVar[type[_InterpreterSession]]

    def verdict(self, asked: Asked) -> Verdict | None:
        if asked.accelerator == ETHOS_U:
            return ethos_u_verdict(self.name, asked, asked.facts.ethos_u_missing)
        return None

    def target_here(self, accelerator: str | None, facts: Facts) -> bool | None:
        return not (accelerator == ETHOS_U and facts.ethos_u_delegate is None)

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> _InterpreterSession:
        return self.session(model_path, threads=threads, input_names=input_names, accelerator=accelerator)


class LiteRTBackend(_InterpreterBackend):
    name = "litert"
    package = "ai-edge-litert"
    module = "ai_edge_litert.interpreter"
    install = "the base install (pip install edgeline)"
    base_install = True
    session = LiteRTSession

    def accelerators(self, facts: Facts) -> dict[str, dict[str, Any]]:
        return {ETHOS_U: {"present": facts.ethos_u_delegate is not None,
                          "detail": facts.ethos_u_delegate or facts.ethos_u_missing}}  # fmt: skip


class TFLiteRuntimeBackend(_InterpreterBackend):
    name = "tflite-runtime"
    package = "tflite-runtime"
    module = "tflite_runtime.interpreter"
    install = "pip install tflite-runtime (2.14: Python <= 3.11, numpy < 2)"
    session = TFLiteRuntimeSession
