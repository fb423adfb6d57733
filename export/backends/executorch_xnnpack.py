"""ExecuTorch programs (.pte) delegated to XNNPACK; int8 through PT2E with the XNNPACK quantizer. The 1-D pools
XNNPACK has no kernel for are expressed as the 2-D ones it has first (``xnnpack_pools``), so they run on it too; for
int8, the activations and LayerNorm its quantizer does not annotate are written in forms it annotates and its
partitioner takes (``xnnpack_int8_forms``).

What XNNPACK computes in int8 is what ExecuTorch's XNNPACK partitioner declares it takes quantized (its configs'
``STATIC_QUANT``) and finds in a quantized pattern (dequantize -> operator -> quantize, the dequantize and quantize
tagged "implicit": the operator reads and writes int8). Every other operator it takes computes in fp32, between a
dequantize and a quantize that it turns into XNNPACK conversions: EXP, LOG, TANH, SIGMOID, RSQRT, ABS, DIV, GELU,
HARDSWISH, LEAKY_RELU, SOFTMAX among them. ``xnnpack_int8_kernel`` reads that back for the placement."""

from __future__ import annotations

import weakref
from functools import cache
from importlib.metadata import version
from typing import Any

from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget
from edgeline.export.errors import ExportError
from edgeline.export.graph import module_path
from edgeline.export.layer_probes import LayerProbe, LayerReading, pt2e_layers
from edgeline.export.placement import executorch_placement
from edgeline.export.xnnpack_forms import xnnpack_int8_forms, xnnpack_pools
from edgeline.manifest import RuntimeRequirement

__all__ = ["XnnpackExporter", "partitioner_configs", "quantized_module", "xnnpack_int8_kernel"]

MODEL_FILE = "model.pte"


def _quantized(request: ExportRequest, *, dynamic: bool) -> Any:
    return quantized_module(
        request.module, request.example_inputs, request.calibration, dynamic=dynamic, keep_float=request.keep_float
    )


def quantized_module(
    module: Any, example_inputs: tuple[Any, ...], calibration: Any, *, dynamic: bool, keep_float: tuple[str, ...] = ()
) -> Any:
    """The PT2E-quantized graph (XNNPACK's quantizer, per-channel symmetric weights) this exporter lowers: also what
    ``edgeline.export.layers`` compares layer by layer. ``keep_float``: module paths left in float, through the
    quantizer's public filter (its ``set_module_name`` refuses a None config)."""
    import torch
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = _quantizer_class(XNNPACKQuantizer)().set_global(
        get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
    )
    if keep_float:

        def quantized(node: Any) -> bool:
            path = module_path(node)
            return path is None or not any(path == kept or path.startswith(kept + ".") for kept in keep_float)

        quantizer.set_filter_function(quantized)
    graph = torch.export.export(module, example_inputs).module()
    xnnpack_pools(graph)
    if not dynamic:
        xnnpack_int8_forms(graph, elu=_elu_config() is not None)
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for sample in calibration if not dynamic else calibration[:1]:
            prepared(*sample)
    return convert_pt2e(prepared)


def _quantizer_class(base: Any) -> Any:
    """XNNPACK's quantizer that also annotates the one-input activations it leaves to their neighbours, within its
    filter (the layers mixed precision keeps float): ELU, which XNNPACK computes in int8, and those it
    computes in fp32 between conversions, so that what reads them (a flatten before a linear layer) reads int8. An
    ELU, TANH or SIGMOID before a flatten left the flatten, and the ELU, in fp32."""
    import torch
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

    aten = torch.ops.aten
    activations = {aten.elu.default, aten.tanh.default, aten.sigmoid.default, aten.gelu.default}
    activations |= {aten.hardswish.default, aten.leaky_relu.default}

    class XnnpackInt8Quantizer(base):  # type: ignore[misc]  # executorch ships no type information
        def annotate(self, model: Any) -> Any:
            model = super().annotate(model)
            config = getattr(self, "global_config", None)
            activation = getattr(config, "input_activation", None)
            output = getattr(config, "output_activation", None)
            if activation is None or output is None or activation.is_dynamic:
                return model
            keep = getattr(self, "filter_fn", None)
            annotated = False
            for node in model.graph.nodes:
                if node.op != "call_function" or node.target not in activations:
                    continue
                if "quantization_annotation" in node.meta or not isinstance(node.args[0], torch.fx.Node):
                    continue
                if keep is not None and not keep(node):
                    continue
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: activation},
                    output_qspec=output,
                    _annotated=True,
                )
                annotated = True
            if annotated:  # the reshapes after them share their quantization, as after any annotated operator
                self.propagate(model)
            return model

        @staticmethod
        def propagate(model: Any) -> None:
            """The quantizer's own propagation to the operators that share their input's quantization (reshapes,
            pools); where its module no longer has it, they stay as the quantizer left them (fp32 around those)."""
            try:
                from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import propagate_annotation
            except ImportError:
                return
            propagate_annotation(model)

    return XnnpackInt8Quantizer


def _elu_config() -> Any:
    """ExecuTorch's XNNPACK ELU config (int8 and fp32), which its partitioner's default list leaves out ("waiting for
    PyTorch pin update"); None where it is not there."""
    try:
        from executorch.backends.xnnpack.partition.config.generic_node_configs import EluConfig
    except ImportError:
        return None
    return EluConfig


def partitioner_configs() -> list[Any]:
    """The XNNPACK partitioner's public config list, with its ELU config (see ``_elu_config``): for a graph
    ``xnnpack_int8_forms`` rewrote, whose every ELU has an explicit alpha and no scales (XNNPACK's ELU node reads its
    alpha and ignores the rest)."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS

    elu = _elu_config()
    return [*ALL_PARTITIONER_CONFIGS, *([elu] if elu is not None and elu not in ALL_PARTITIONER_CONFIGS else [])]


# -- what XNNPACK computes in int8 -------------------------------------------------------------------------------------


def xnnpack_int8_kernel(node: Any) -> bool:
    """Whether XNNPACK computes a delegated operator (a node of a lowered module's graph) on int8 tensors: each
    dequantize it reads and each quantize it feeds is one the partitioner tagged implicit (its node visitors emit no
    conversion for those: the operator takes and gives int8). Otherwise they are conversions and it computes in fp32.
    Where the tags cannot be read (an ExecuTorch that no longer keeps them in the lowered module's graph, or moved the
    function that reads them), whether the partitioner's config for the operator declares ``STATIC_QUANT``."""
    tagged = _implicit_tags(node.graph)
    if tagged is None:
        return _static_quant_targets().get(_target_name(node), False)
    dequantized = [arg for arg in node.all_input_nodes if _is_conversion(arg, "dequantize")]
    quantized = [user for user in node.users if _is_conversion(user, "quantize")]
    return all(tagged(n) for n in dequantized) and all(tagged(n) for n in quantized)


def _is_conversion(node: Any, kind: str) -> bool:
    name = _target_name(node)
    if kind == "quantize":
        return node.op == "call_function" and name.startswith("quantize_per_")
    return node.op == "call_function" and name.startswith("dequantize_per_")


def _target_name(node: Any) -> str:
    """``exp.default`` for ``aten.exp.default`` (as the partitioner's configs name their targets)."""
    name = str(getattr(node.target, "__name__", node.target))
    parts = name.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else name


_TAG_READERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _implicit_tags(graph: Any) -> Any:
    """The partitioner's reader of its "implicit" tag on quantize and dequantize nodes, when ``graph`` (a lowered
    module's) shows any: a quantized graph XNNPACK took has at least its weights' dequantizations tagged. None when
    the reader is gone or the graph shows no tag (its conversions then read from the configs)."""
    if graph not in _TAG_READERS:
        try:
            from executorch.backends.xnnpack.utils.quant_utils import is_tagged_as_implicit_q_dq
        except ImportError:
            is_tagged_as_implicit_q_dq = None
        conversions = [n for n in graph.nodes if _is_conversion(n, "quantize") or _is_conversion(n, "dequantize")]
        visible = is_tagged_as_implicit_q_dq is not None and any(is_tagged_as_implicit_q_dq(n) for n in conversions)
        _TAG_READERS[graph] = is_tagged_as_implicit_q_dq if visible else None
    return _TAG_READERS[graph]


@cache
def _static_quant_targets() -> dict[str, bool]:
    """Per target the partitioner's configs name (``exp.default``): whether it takes it in int8 (``STATIC_QUANT``);
    none where the configs no longer say (then nothing counts as int8 on XNNPACK: the placement never overclaims)."""
    try:
        from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
    except ImportError:
        return {}

    found: dict[str, bool] = {}
    for config in partitioner_configs():
        try:
            precisions = config().supported_precision_types()
        except TypeError:  # a config that needs arguments: not counted as int8
            continue
        name = str(getattr(config, "target_name", ""))
        found[name] = found.get(name, False) or ConfigPrecisionType.STATIC_QUANT in precisions
    return found


class XnnpackExporter(ExportTarget):
    name = "executorch-xnnpack"
    runtime_backend = "executorch"
    accelerator = "xnnpack"  # the ExecuTorch delegate its program is lowered to
    precisions = (Precision.FP32, Precision.INT8_DYNAMIC, Precision.INT8_STATIC)
    keeps_float = True  # the XNNPACK quantizer's filter function

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """The PT2E graph the ``.pte`` was lowered from, read with torchao's numeric debugger: the export's own
        (``reading.quantized_graph``), else quantized again on the calibration samples (the same graph: the quantizer
        is deterministic); none without either."""
        if reading.quantized_graph is not None:
            return pt2e_layers(reading, reading.quantized_graph)
        if reading.calibration is None:
            return None
        import torch

        calibration = reading.calibration
        tensors = [tuple(torch.from_numpy(a) for a in calibration.sample(i)) for i in range(len(calibration))]
        converted = quantized_module(
            reading.module, tensors[0], tensors, dynamic=reading.dynamic, keep_float=reading.keep_float
        )
        return pt2e_layers(reading, converted)

    def export(self, request: ExportRequest) -> ExportedModel:
        import torch
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        if request.precision not in self.precisions:
            valid = ", ".join(p.value for p in self.precisions)
            raise ExportError(f"executorch-xnnpack cannot export {request.precision.value}; valid: {valid}")
        quantized = None
        if request.precision is not Precision.FP32:
            quantized = _quantized(request, dynamic=request.precision is Precision.INT8_DYNAMIC)
        if quantized is None:
            program = torch.export.export(request.module, request.example_inputs)
            graph = program.module()
            if xnnpack_pools(graph):  # the 1-D pools as 2-D ones: traced again from the rewritten graph
                program = torch.export.export(graph, request.example_inputs)
        else:
            program = torch.export.export(quantized, request.example_inputs)
        # XNNPACK's ELU node reads alpha alone: only a graph whose ELUs xnnpack_int8_forms wrote may go to it
        configs = partitioner_configs() if request.precision is Precision.INT8_STATIC else None
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner(configs=configs)])
        placement = executorch_placement(
            edge.exported_program().graph_module, request.precision, self.accelerator, xnnpack_int8_kernel
        )
        executorch_program = edge.to_executorch()
        (request.out_dir / MODEL_FILE).write_bytes(executorch_program.buffer)
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="executorch", min_version=version("executorch")),
            input_names=request.input_names,
            placement=placement,
            tool_versions={"executorch": version("executorch"), "torch": version("torch")},
            quantized_graph=quantized,  # what the layer probe reads: the export's, not quantized a second time
        )
