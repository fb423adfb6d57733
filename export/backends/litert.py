"""LiteRT (.tflite) through litert-torch; fp16 weights through ai-edge-quantizer."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from edgeline.device_profiles import Precision, Profile
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget
from edgeline.export.errors import ExportError
from edgeline.export.layer_probes import LayerProbe, LayerReading, litert_layers
from edgeline.export.placement import ModelSources, tflite_placement
from edgeline.export.tflite_operators import LITERT_KERNELS, Int8Kernels
from edgeline.manifest import Rewrite, RuntimeRequirement

__all__ = ["MODEL_FILE", "LiteRTExporter", "Written", "tool_versions", "write_tflite"]

MODEL_FILE = "model.tflite"


def _pt2e(
    request: ExportRequest, *, dynamic: bool, kernels: Int8Kernels = LITERT_KERNELS, int8_edges: bool = True
) -> tuple[Any, Any, list[Rewrite]]:
    """The PT2E-quantized graph, litert-torch's config for it, and what the quantizer changed of the function the
    model computes. Static quantization is full-integer: see ``edgeline.export.full_integer``."""
    import torch
    from litert_torch.quantize import pt2e_quantizer, quant_config
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from edgeline.export.full_integer import FullIntegerQuantizer

    if dynamic:
        quantizer = pt2e_quantizer.PT2EQuantizer().set_global(
            pt2e_quantizer.get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
        )
    else:
        quantizer = FullIntegerQuantizer(kernels=kernels, keep_float=request.keep_float, int8_edges=int8_edges)
    graph = torch.export.export(request.module, request.example_inputs).module()
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        # Dynamic quantization observes nothing, but per-channel weight observers want one pass.
        for sample in request.calibration if not dynamic else request.calibration[:1]:
            prepared(*sample)
    converted = convert_pt2e(prepared, fold_quantize=False)
    return converted, quant_config.QuantConfig(pt2e_quantizer=quantizer), list(getattr(quantizer, "rewrites", ()))


def _cast_weights_to_fp16(path: str) -> None:
    from ai_edge_quantizer import algorithm_manager, qtyping, quantizer

    fp16 = quantizer.Quantizer(path)
    fp16.add_weight_only_config(
        regex=".*",
        operation_name=qtyping.TFLOperationName.ALL_SUPPORTED,
        num_bits=16,
        algorithm_key=algorithm_manager.AlgorithmName.FLOAT_CASTING,
    )
    fp16.quantize().export_model(path, overwrite=True)


def _input_names_in_forward_order(path: str) -> tuple[str, ...]:
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    by_index = {detail["index"]: detail["name"] for detail in interpreter.get_input_details()}
    signature = interpreter.get_signature_runner().get_input_details()

    def position(item: tuple[str, Any]) -> tuple[int, str]:
        found = re.search(r"(\d+)$", item[0])
        return (int(found.group(1)) if found else 1 << 30, item[0])

    return tuple(by_index[detail["index"]] for _, detail in sorted(signature.items(), key=position))


class LiteRTExporter(ExportTarget):
    name = "litert"
    runtime_backend = "litert"
    precisions = (Precision.FP32, Precision.FP16, Precision.INT8_DYNAMIC, Precision.INT8_STATIC)
    keeps_float = True  # the LiteRT quantizer's per-operator annotation

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        return litert_layers(reading)

    def has_every_tflite_kernel(self, profile: Profile | None) -> bool:
        return True

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            raise ExportError(f"litert cannot export {request.precision.value}")
        written = write_tflite(request, request.out_dir / MODEL_FILE)
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="ai-edge-litert", min_version="2.0"),
            input_names=written.input_names,
            rewrites=written.rewrites,
            placement=tflite_placement(request.out_dir / MODEL_FILE, request.precision, written.sources),
            tool_versions=tool_versions(),
        )


def tool_versions() -> dict[str, str]:
    """The converter versions a LiteRT model depends on, for the manifest's ``export``."""
    return {"litert-torch": version("litert-torch"), "ai-edge-quantizer": version("ai-edge-quantizer")}


@dataclass(frozen=True)
class Written:
    input_names: tuple[str, ...]
    """The model file's input tensor names, in forward()'s order."""
    rewrites: tuple[Rewrite, ...] = ()
    """What the export changed of the function the model computes (the manifest's ``quantization.rewrites``)."""
    sources: ModelSources | None = None
    """The graph the integer precisions convert from, to name the model's code behind each operator the model file
    leaves float (``placement.fallback_sources``); None for the float precisions."""


def _kept(request: ExportRequest) -> Callable[[str], bool]:
    """Whether a LiteRT tensor (named after the module that made it) belongs to a layer mixed precision keeps float."""
    from edgeline.export.graph import module_of_location

    def kept(name: str) -> bool:
        for location in name.split(";"):
            path = module_of_location(location, request.module)
            if path is not None and any(path == m or path.startswith(m + ".") for m in request.keep_float):
                return True
        return False

    return kept


def write_tflite(
    request: ExportRequest,
    path: Path,
    *,
    full_integer_for: str | None = None,
    kernels: Int8Kernels = LITERT_KERNELS,
) -> Written:
    """Convert ``request.module`` at ``request.precision`` into the LiteRT model ``path``. int8-static is
    full-integer: int8 inputs and outputs (what TFLite Micro and vela take), unless an operator at an edge has no
    int8 form, or is kept float (``request.keep_float``); ``full_integer_for`` (the backend that needs it) makes the
    first a ``LoweringError`` naming the operators and the model's lines, and keeps the edges of the second int8.
    ``kernels``: what runs the int8 model (``Int8Kernels``), which decides the form of the operators whose int8
    form differs between targets (GELU, ELU, Mish). PReLU and ELU become TFLite's own int8 PRELU and ELU
    (``edgeline.export.tflite_operators``). Shared by the exporters that start from a LiteRT model (ethos-u,
    tflite-micro)."""
    import litert_torch

    from edgeline.export.tflite_operators import fuse_int8_islands, operator_forms

    module = request.module
    config = None
    rewrites: list[Rewrite] = []
    static = request.precision is Precision.INT8_STATIC
    if request.precision in (Precision.INT8_STATIC, Precision.INT8_DYNAMIC):
        module, config, rewrites = _pt2e(
            request,
            dynamic=request.precision is Precision.INT8_DYNAMIC,
            kernels=kernels,
            int8_edges=full_integer_for is not None,
        )
    with operator_forms(elu=kernels.elu) if static else contextlib.nullcontext():
        litert_torch.convert(module, request.example_inputs, quant_config=config).export(str(path))
    if static:
        fuse_int8_islands(
            path,
            select_v2=full_integer_for is not None,
            float_only=kernels.float_only,
            kept_float=_kept(request),
        )
    if static and full_integer_for is not None:
        from edgeline.export.full_integer import check_full_integer, float_edges

        check_full_integer(path, full_integer_for, float_edges(module))
    if request.precision is Precision.FP16:
        _cast_weights_to_fp16(str(path))
    sources = ModelSources.of(module, request.module) if config is not None else None
    return Written(_input_names_in_forward_order(str(path)), tuple(rewrites), sources)
