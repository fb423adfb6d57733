"""TensorFlow Lite Micro (``tflite-micro``): the microcontroller interpreter, with its reference kernels, on this host.

It runs what a Cortex-M's firmware would (an int8 model, in a fixed tensor arena), so export measures an MCU target's
fidelity with it. TFLite Micro's Python API gives neither tensor names nor per-tensor quantization the way LiteRT does:
those are read from the same file with LiteRT's interpreter, without preparing it. A vela model's ``ethos-u``
operators need the NPU: without it, the bundle's int8 model runs instead, and the session says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeline.backends import ethos_u
from edgeline.backends.base import Asked, RuntimeBackend, Verdict
from edgeline.backends.litert import _spec, ethos_u_verdict
from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import TensorSpec
from edgeline.native_output import capture_native_output

if TYPE_CHECKING:
    from edgeline.backends.base import Facts

__all__ = ["MAX_ARENA_BYTES", "MIN_ARENA_BYTES", "TFLiteMicroBackend", "TFLiteMicroSession"]

MIN_ARENA_BYTES = 16 * 1024
MAX_ARENA_BYTES = 64 * 1024 * 1024
"""The arena grows from MIN to at most MAX: past 64 MiB the model is no
microcontroller's."""

_MISSING = re.compile(r"missing: (\d+)")
_ARENA_TOTAL = re.compile(r"Arena allocation total (\d+) bytes")


def _interpreter_module() -> Any:
    try:
        from tflite_micro import runtime
    except ImportError as exc:
        raise BackendUnavailableError(
            "this bundle needs tflite-micro, which is not installed: pip install 'edgeline[ethos-u]' "
            "(or pip install tflite-micro)"
        ) from exc
    return runtime


def _tensor_bytes(reader: Any) -> int:
    details = reader.get_tensor_details()
    return sum(int(np.prod(d["shape"])) * np.dtype(d["dtype"]).itemsize for d in details if len(d["shape"]))


def _details(model_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The model's input and output tensors (name, dtype, shape, quantization), read with LiteRT's interpreter."""
    from ai_edge_litert.interpreter import Interpreter

    try:
        reader = Interpreter(model_path=str(model_path))
        return reader.get_input_details(), reader.get_output_details(), _tensor_bytes(reader)
    except (ValueError, RuntimeError) as exc:
        raise BundleError(f"{model_path}: not a readable LiteRT model: {exc}") from exc


class TFLiteMicroSession:
    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
    ):
        del threads  # TFLite Micro runs on one core
        self.accelerator: str | None = None  # this host's CPU, with TFLite Micro's reference kernels
        self.computes = "f32"  # its float kernels
        self.fallback_reason: str | None = None
        if accelerator is not None:
            self.fallback_reason = f"{accelerator} is not here: TFLite Micro's reference kernels run on this CPU"
        runtime = _interpreter_module()
        if ethos_u.is_vela_model(model_path):
            why = "the Ethos-U NPU is not here (TFLite Micro without its Ethos-U driver)"
            model_path = ethos_u.cpu_model_for(model_path, why)
            self.fallback_reason = f"{why}; running {ethos_u.CPU_MODEL} on the CPU"
        inputs, outputs, tensor_bytes = _details(model_path)
        for detail in [*inputs, *outputs]:
            try:
                _spec(detail, detail["name"])
            except BundleError as exc:
                raise BundleError(f"{model_path}: {exc}") from exc
        positions = {detail["index"]: position for position, detail in enumerate(inputs)}
        if input_names is not None:
            by_name = {detail["name"]: detail for detail in inputs}
            if sorted(by_name) != sorted(input_names):
                raise BundleError(
                    f"{model_path}: model inputs {sorted(by_name)} differ from the manifest's {list(input_names)}"
                )
            inputs = [by_name[name] for name in input_names]
        self._positions = [positions[detail["index"]] for detail in inputs]
        self._inputs = inputs
        self._outputs = outputs
        self.model_path = model_path
        self._interpreter, self.arena_bytes = self._open(runtime, model_path, tensor_bytes)

    @staticmethod
    def _open(runtime: Any, model_path: Path, tensor_bytes: int) -> tuple[Any, int]:
        """Open with an arena grown until the model fits (by what TFLite Micro says is missing, else doubled): about
        the figure a firmware would reserve, recorded as ``arena_bytes``."""
        # Start above every tensor's size (weights included): TFLite Micro 0.dev2026 crashes (SIGSEGV) instead of
        # failing cleanly on some models given a far too small arena (seen on the VWW and autoencoder references).
        size = min(MAX_ARENA_BYTES, max(MIN_ARENA_BYTES, 2 * tensor_bytes + MIN_ARENA_BYTES))
        while True:
            with capture_native_output() as captured:  # TFLite Micro reports on the C-level stderr
                try:
                    return runtime.Interpreter.from_file(str(model_path), arena_size=size), size
                except RuntimeError as exc:
                    error: RuntimeError = exc
            text = f"{error}\n{captured.text}"
            if "registration" in text or "available" not in text:  # an operator it lacks, or a broken model
                lines = [line.strip() for line in captured.text.splitlines() if line.strip()] or [str(error)]
                raise BundleError(f"{model_path}: TFLite Micro could not load the model: {lines[0]}") from error
            if size >= MAX_ARENA_BYTES:
                raise BundleError(
                    f"{model_path}: TFLite Micro could not fit the model in a {MAX_ARENA_BYTES // 2**20} MiB arena"
                ) from error
            missing = [int(n) for n in _MISSING.findall(text)]
            grown = size + -(-max(missing) // 1024) * 1024 if missing else 2 * size
            size = min(MAX_ARENA_BYTES, grown)

    def arena_used_bytes(self) -> int | None:
        """The bytes of the arena the model's tensors and kernels took (TFLite Micro's recording allocator reports
        them): what a firmware must reserve at least. None when it reports nothing."""
        with capture_native_output() as captured:
            self._interpreter.print_allocations()
        found = _ARENA_TOTAL.search(captured.text)
        return int(found.group(1)) if found else None

    def input_specs(self) -> list[TensorSpec]:
        return [_spec(detail, detail["name"]) for detail in self._inputs]

    def output_specs(self) -> list[TensorSpec]:
        return [_spec(detail, detail["name"]) for detail in self._outputs]

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        for position, array in zip(self._positions, inputs, strict=True):
            self._interpreter.set_input(np.ascontiguousarray(array), position)
        self._interpreter.invoke()
        return [np.array(self._interpreter.get_output(j)) for j in range(len(self._outputs))]


class TFLiteMicroBackend(RuntimeBackend):
    """A microcontroller's interpreter, on this host: what export measures an MCU target's fidelity with, and what
    the firmware of such a bundle links (``firmware``: its memory is a tensor arena)."""

    name = "tflite-micro"
    package = "tflite-micro"
    module = "tflite_micro"
    install = "pip install 'edgeline[ethos-u]' (an x86-64 Linux wheel only)"
    file_suffixes = (".tflite",)
    firmware = True

    def refusal(self, accelerator: str | None, facts: Facts) -> str | None:
        if facts.machine.arch != "x86_64":
            return "tflite-micro's Python wheel exists for x86-64 Linux only"
        return None

    def verdict(self, asked: Asked) -> Verdict | None:
        if asked.accelerator == ethos_u.ETHOS_U:
            return ethos_u_verdict(self.name, asked, "the Python TFLite Micro has no Ethos-U driver")
        return None

    def target_here(self, accelerator: str | None, facts: Facts) -> bool | None:
        return not (accelerator == ethos_u.ETHOS_U and facts.ethos_u_delegate is None)

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> TFLiteMicroSession:
        return TFLiteMicroSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
