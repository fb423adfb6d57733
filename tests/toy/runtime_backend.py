"""The toy runtime backend: what ``edge_runtime/backends/<name>.py`` holds for a real one. It runs the toy target's
``.pt2`` programs with torch, on the CPU (a real device-side backend would import no torch at import time either:
torch is imported when a model is opened)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.backends.base import RuntimeBackend
from edgeline.errors import BundleError
from edgeline.manifest import TensorSpec

SPECS = "edgeline_specs.json"


class ToySession:
    def __init__(self, model_path: Path, *, input_names: Sequence[str] | None):
        import torch

        extra = {SPECS: ""}
        try:
            self._module = torch.export.load(model_path, extra_files=extra).module()
            specs = json.loads(extra[SPECS])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise BundleError(f"{model_path}: not a toy program: {exc}") from exc
        self._inputs = [TensorSpec(name=s["name"], dtype=s["dtype"], shape=tuple(s["shape"])) for s in specs["inputs"]]
        self._outputs = [
            TensorSpec(name=s["name"], dtype=s["dtype"], shape=tuple(s["shape"])) for s in specs["outputs"]
        ]
        if input_names is not None and list(input_names) != [spec.name for spec in self._inputs]:
            raise BundleError(f"{model_path}: inputs {[s.name for s in self._inputs]}, the manifest's {input_names}")
        self._torch: Any = torch
        self.accelerator: str | None = None

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        with self._torch.no_grad():
            outputs = self._module(*(self._torch.from_numpy(np.ascontiguousarray(a)) for a in inputs))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return [output.numpy() for output in outputs]


class ToyRuntime(RuntimeBackend):
    name = "toy"
    package = "torch"
    module = "torch"
    install = "pip install torch (the toy runtime)"
    file_suffixes = (".pt2",)

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> ToySession:
        return ToySession(model_path, input_names=input_names)
