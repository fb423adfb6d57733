"""ExecuTorch programs (.pte): on the torch-free C++ runtime when this machine has one (``edgeline.executorch_native``:
what a device runs), else on ExecuTorch's Python runtime, which imports torch (a workstation), said once, loudly.

``EDGELINE_EXECUTORCH_RUNTIME=python`` (or ``native``) asks for one of the two and fails rather than take the other:
for comparing them (``benchmarks/executorch_runtime.py``) and for tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeline.backends.base import Asked, RuntimeBackend, RuntimeFacts, Verdict
from edgeline.backends.coreml import ACCELERATORS as COREML_ACCELERATORS
from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import TensorSpec

if TYPE_CHECKING:
    from edgeline.backends.base import Facts
    from edgeline.executorch_native import NativeProgram

__all__ = [
    "DELEGATE_BACKENDS",
    "RUNTIME_CHOICE",
    "ExecuTorchBackend",
    "ExecuTorchSession",
    "NativeSession",
    "PythonSession",
    "program_specs",
]

log = logging.getLogger(__name__)

RUNTIME_CHOICE = "EDGELINE_EXECUTORCH_RUNTIME"
"""Environment variable: ``native`` or ``python`` takes that runtime or fails; unset, the torch-free one first."""

DELEGATE_BACKENDS = {"xnnpack": "XnnpackBackend", "coreml": "CoreMLBackend"}
"""A bundle's placement.accelerator -> the ExecuTorch backend its delegated parts need at run time."""
_WHY_MISSING = {"coreml": "the Core ML delegate runs on Apple devices only (ExecuTorch built for iOS or macOS)"}


def _lacks(model_path: Path, needed: str, registered: Sequence[str], accelerator: str | None, runtime: str) -> str:
    why = _WHY_MISSING.get(accelerator or "", "install an ExecuTorch build that has it")
    return (
        f"{model_path}: the program is delegated to {needed}, which {runtime} lacks "
        f"(it has: {', '.join(registered) or 'none'}); {why}"
    )


def _choice() -> str | None:
    wanted = os.environ.get(RUNTIME_CHOICE, "").strip().lower() or None
    if wanted not in (None, "native", "python"):
        raise BackendUnavailableError(f"{RUNTIME_CHOICE}={wanted!r}: choose native (torch-free) or python")
    return wanted


# -- the torch-free runtime ---------------------------------------------------------------------------------------


class NativeSession:
    """A ``.pte`` on ExecuTorch's C++ runtime through edgeline's shim: no torch in the process."""

    runtime = "torch-free"

    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
        batch_size: int | None = None,
    ):
        from edgeline.executorch_native import NativeRuntime

        native = NativeRuntime.get()
        self.accelerator = accelerator
        self.computes = "f32" if accelerator in (None, "xnnpack") else None  # XNNPACK: fp32 programs; Core ML: its own
        self.version = native.version
        needed = DELEGATE_BACKENDS.get(accelerator or "")
        registered = native.backends()
        if needed is not None and needed not in registered:
            raise BackendUnavailableError(
                _lacks(model_path, needed, registered, accelerator, "the torch-free ExecuTorch runtime")
            )
        native.set_threads(threads)
        self._model_path, self._threads, self._input_names = model_path, threads, input_names
        program = native.open(model_path)
        self._program = program
        shapes = [meta.shape for meta in program.inputs]
        self.max_batch = self._dynamic_batch(shapes)
        """The largest batch the program was exported for (a dynamic first dimension), or None: fixed shapes."""
        size = 1 if self.max_batch is not None and batch_size is None else batch_size
        if size is not None:
            shapes = [(size, *shape[1:]) for shape in shapes]
        self._inputs, self._outputs = _native_specs(program, model_path, input_names, shapes)
        self.run = program.run

    def _dynamic_batch(self, shapes: list[tuple[int, ...]]) -> int | None:
        """A program exported with a dynamic batch dimension lists its inputs at the dimension's upper bound: if
        every input's first dimension is above 1 and a batch of one runs, that bound is the largest batch."""
        if not shapes or any(not shape or shape[0] <= 1 for shape in shapes):
            return None
        ones = [np.zeros((1, *meta.shape[1:]), meta.dtype) for meta in self._program.inputs]
        try:
            self._program.run(ones)
        except RuntimeError:
            return None  # a program whose inputs really are batches of that size
        return min(shape[0] for shape in shapes)

    def batched(self, size: int) -> NativeSession | None:
        """The same program taking ``size`` samples per call, or None when it was exported for fixed shapes or a
        smaller batch. A program of its own: the single-sample one keeps its planned memory."""
        if self.max_batch is None or size > self.max_batch:
            return None
        return NativeSession(
            self._model_path,
            threads=self._threads,
            input_names=self._input_names,
            accelerator=self.accelerator,
            batch_size=size,
        )

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)


# -- ExecuTorch's Python runtime (imports torch) ------------------------------------------------------------------


def _spec(info: Any, name: str) -> TensorSpec:
    from edgeline.executorch_native import SCALAR_TYPES

    dtype = SCALAR_TYPES.get(info.dtype())
    if dtype is None:
        raise BundleError(f"tensor {name}: unsupported ExecuTorch dtype code {info.dtype()}")
    return TensorSpec(name=name, dtype=dtype.name, shape=tuple(info.sizes()))


def _native_specs(
    program: NativeProgram, model_path: Path, input_names: Sequence[str] | None, shapes: Sequence[tuple[int, ...]]
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The specs of a program opened by the shim, its inputs at ``shapes``."""
    count = len(program.inputs)
    names = list(input_names) if input_names else [f"input_{i}" for i in range(count)]
    if len(names) != count:
        raise BundleError(f"{model_path}: program takes {count} inputs, manifest lists {len(names)}")
    inputs = [
        TensorSpec(name=name, dtype=meta.dtype.name, shape=shape)
        for name, meta, shape in zip(names, program.inputs, shapes, strict=True)
    ]
    outputs = [
        TensorSpec(name=f"output_{i}", dtype=meta.dtype.name, shape=meta.shape)
        for i, meta in enumerate(program.outputs)
    ]
    return inputs, outputs


def _specs(meta: Any, model_path: Path, input_names: Sequence[str] | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    names = list(input_names) if input_names else [f"input_{i}" for i in range(meta.num_inputs())]
    if len(names) != meta.num_inputs():
        raise BundleError(f"{model_path}: program takes {meta.num_inputs()} inputs, manifest lists {len(names)}")
    inputs = [_spec(meta.input_tensor_meta(i), names[i]) for i in range(meta.num_inputs())]
    return inputs, [_spec(meta.output_tensor_meta(i), f"output_{i}") for i in range(meta.num_outputs())]


def program_specs(model_path: Path, input_names: Sequence[str] | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The forward method's inputs and outputs, read from the program without loading the method: this works for
    a program delegated to a backend this runtime lacks. On the torch-free runtime when there is one."""
    try:
        if _choice() != "python":
            from edgeline.executorch_native import NativeRuntime

            program = NativeRuntime.get().open(model_path, load=False)
            return _native_specs(program, model_path, input_names, [meta.shape for meta in program.inputs])
    except BackendUnavailableError:
        if _choice() == "native":
            raise
    from executorch.runtime import Runtime

    try:
        meta = Runtime.get().load_program(model_path).metadata("forward")
    except (RuntimeError, ValueError) as exc:
        raise BundleError(f"{model_path}: ExecuTorch could not read the program: {exc}") from exc
    return _specs(meta, model_path, input_names)


class PythonSession:
    """A ``.pte`` on ExecuTorch's Python runtime (pybindings: links libtorch, imports torch)."""

    runtime = "python"

    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
    ):
        # Delegated parts are compiled into the program: they run on what they were lowered for, or not at all.
        self.accelerator = accelerator
        self.computes = "f32" if accelerator in (None, "xnnpack") else None  # XNNPACK: fp32 programs; Core ML: its own
        try:
            import torch
            from executorch.extension.pybindings import portable_lib
            from executorch.runtime import Runtime
        except ImportError as exc:
            raise BackendUnavailableError(
                "ExecuTorch's Python runtime is not installed (pip install 'edgeline[executorch]', which brings torch)"
            ) from exc
        from importlib.metadata import version

        self.version = version("executorch")
        self._torch: Any = torch
        if portable_lib._threadpool_get_thread_count() != threads:
            portable_lib._unsafe_reset_threadpool(threads)
        runtime = Runtime.get()
        needed = DELEGATE_BACKENDS.get(accelerator or "")
        if needed is not None and not runtime.backend_registry.is_available(needed):
            registered = list(runtime.backend_registry.registered_backend_names)
            raise BackendUnavailableError(
                _lacks(model_path, needed, registered, accelerator, "this ExecuTorch runtime")
            )
        try:
            program = runtime.load_program(model_path)
            method = program.load_method("forward")
        except (RuntimeError, ValueError) as exc:
            raise BundleError(f"{model_path}: ExecuTorch could not load the program: {exc}") from exc
        if method is None:
            raise BundleError(f"{model_path}: the program has no 'forward' method")
        self._inputs, self._outputs = _specs(method.metadata, model_path, input_names)
        self._execute = method.execute
        self._from_numpy = torch.from_numpy

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        outputs = self._execute([self._from_numpy(array) for array in inputs])
        return [output.numpy() for output in outputs]


# -- the registry's entry ------------------------------------------------------------------------------------------


class _Factory:
    """What ``ExecuTorchBackend.open`` opens with: the torch-free runtime when there is one, else the Python
    runtime."""

    _fallback_said = False

    def __call__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
    ) -> NativeSession | PythonSession:
        wanted = _choice()
        native_missing = f"{RUNTIME_CHOICE}=python"
        if wanted != "python":
            try:
                return NativeSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
            except BackendUnavailableError as exc:
                if wanted == "native":
                    raise
                native_missing = str(exc)
        try:
            session = PythonSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
        except BackendUnavailableError as exc:
            if wanted == "python":
                raise
            raise BackendUnavailableError(f"{native_missing}; and {exc}") from exc
        if wanted is None and not _Factory._fallback_said:
            _Factory._fallback_said = True
            log.warning("ExecuTorch: running on the Python runtime (torch, ~300 MB more memory): %s", native_missing)
        return session


ExecuTorchSession = _Factory()


class ExecuTorchBackend(RuntimeBackend):
    """ExecuTorch programs: the torch-free C++ runtime when this machine has one, else ExecuTorch's Python runtime;
    a program runs where the runtime that opens it carries the delegate it was lowered to."""

    name = "executorch"
    package = "executorch"
    module = "executorch.runtime"
    install = "edgeline doctor --install executorch (its C++ runtime, no torch)"
    file_suffixes = (".pte",)

    def probe(self, *, try_import: bool) -> RuntimeFacts:
        """The runtime ``open`` will take: the torch-free one when there is one (loaded, with ``try_import``), the
        Python runtime's facts otherwise, each naming the other when both are here; ``EDGELINE_EXECUTORCH_RUNTIME``
        chooses one, as it does for ``open``."""
        import importlib.util

        from edgeline.executorch_native import NativeRuntime, built_shim, compiler, runtimes

        python = super().probe(try_import=False)
        try:
            wanted = _choice()
        except BackendUnavailableError as exc:
            return replace(python, imports=False, error=str(exc))
        python_there = python.version is not None and importlib.util.find_spec("torch") is not None
        if wanted == "python":
            return self._python_chosen(python, python_there, try_import=try_import)
        also = f"ExecuTorch's Python runtime {python.version} (imports torch)" if python_there else None
        if wanted == "native":
            also = None  # asked for by name: ``open`` fails rather than take the Python runtime
        found = runtimes()
        if not found:
            if wanted == "native":
                error = f"{RUNTIME_CHOICE}=native: no torch-free ExecuTorch runtime here ({self.install})"
                return RuntimeFacts(python.version, False, error, kind="torch-free")
            if python.version is None:
                return python
            python = super().probe(try_import=try_import)
            return replace(python, kind="python", fallback=None)
        runtime = found[0]
        where = f"{runtime.root} ({runtime.origin})"
        missing = runtime.missing()
        if missing is None and built_shim(runtime) is None and compiler() is None:
            missing = "a C++ compiler to build edgeline's shim (apt install g++, or set CXX)"
        if missing is not None:
            error = f"the torch-free runtime at {where} lacks {missing}"
            return RuntimeFacts(runtime.version, False, error, kind="torch-free", location=where, fallback=also)
        if not try_import:
            delegates = tuple(runtime.delegate_libraries())
            return RuntimeFacts(
                runtime.version, None, kind="torch-free", location=where, delegates=delegates, fallback=also
            )
        try:
            loaded = NativeRuntime.get()
        except Exception as exc:  # a library that does not load (another architecture, a missing libstdc++) is a fact
            return RuntimeFacts(runtime.version, False, f"{exc}", kind="torch-free", location=where, fallback=also)
        return RuntimeFacts(
            loaded.version, True, kind="torch-free", location=where, delegates=loaded.backends(), fallback=also
        )

    def _python_chosen(self, python: RuntimeFacts, torch_there: bool, *, try_import: bool) -> RuntimeFacts:
        """``EDGELINE_EXECUTORCH_RUNTIME=python``: ExecuTorch's Python runtime or nothing, as ``open`` takes it."""
        chosen = f"chosen by {RUNTIME_CHOICE}=python"
        if python.version is None:
            return replace(python, kind="python", error=f"{RUNTIME_CHOICE}=python: {python.error}")
        if not torch_there:
            error = f"{RUNTIME_CHOICE}=python: ExecuTorch's Python runtime imports torch, which is not installed"
            return RuntimeFacts(python.version, False, error, kind="python", location=chosen)
        if try_import:
            python = super().probe(try_import=True)
        return replace(python, kind="python", location=chosen, fallback=None)

    def imported(self, module: Any, version: str | None) -> RuntimeFacts:
        registry = module.Runtime.get().backend_registry
        return RuntimeFacts(version, True, kind="python", delegates=tuple(registry.registered_backend_names))

    def refusal(self, accelerator: str | None, facts: Facts) -> str | None:
        if accelerator in COREML_ACCELERATORS and facts.system != "Darwin":
            return f"Core ML runs on macOS only (this is {facts.system})"
        return None

    def target_here(self, accelerator: str | None, facts: Facts) -> bool | None:
        return self.refusal(accelerator, facts) is None or None

    def verdict(self, asked: Asked) -> Verdict | None:
        """A .pte runs where the runtime that will open it carries the delegate it was lowered to."""
        runtime, accelerator = asked.runtime, asked.accelerator
        needed = DELEGATE_BACKENDS.get(accelerator or "")
        which = "the torch-free ExecuTorch runtime" if runtime.kind == "torch-free" else "ExecuTorch's Python runtime"
        label = f"{which} {runtime.version or ''}".rstrip()
        if needed is not None and runtime.delegates is not None and needed not in runtime.delegates:
            has = ", ".join(runtime.delegates) or "none"
            lacks = f"the program is delegated to {needed}, which {label} lacks (it has: {has})"
            return asked.refused(self.name, lacks)
        why = label + (f" with its {needed} delegate" if needed else "") + " runs it"
        if runtime.kind == "python" and runtime.location:
            why += f" (it imports torch; {runtime.location})"
        elif runtime.kind == "python":
            why += " (it imports torch: `edgeline doctor --install executorch` gives the torch-free one)"
        return asked.runs(self.name, asked.model, accelerator, None, why)

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> NativeSession | PythonSession:
        return ExecuTorchSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
