"""OpenVINO (.xml + .bin IR): the torch.export program converted by ``openvino.convert_model``, fp32, fp16 or int8
quantized by NNCF on our samples, with its accuracy control when plain int8 misses the accuracy budget.

- **From the exported program, not ONNX.** OpenVINO's PyTorch frontend reads the ``ExportedProgram`` (decomposed to
  core ATen, as every exporter of ours takes it) directly: no ONNX exporter in between, and each IR operator keeps the
  name of the torch.export node it came from (``convolution_1/aten.convolution.default/Convolution``), which says
  which torch module it computes (the layers NNCF's accuracy control reverts, listed by module in ``kept_float``).
- **What stays float, named.** The placement counts the nodes of the CPU plugin's runtime graph, whose kinds are
  often only containers (``Subgraph``: a Snippets kernel of fused element-wise operators): a float one is named by the
  IR's operators it fused (its ``originalLayersNames``: ``Greater+Select+Tanh+Multiply``, Mish as torch.export
  decomposes it), and ``fallback_sources`` names the module and the model's line that made them (``features.1
  (model.py:23)``), from the torch.export node each operator is named after; the IR itself keeps no source lines.
- **PReLU in int8.** torch.export decomposes PReLU into ``where(x > 0, x, weight * x)``, which the CPU plugin ran as
  a float kernel between int8 layers (5 of 9 operators int8 on a digits CNN with three PReLUs); the IR gets
  OpenVINO's PRelu back (``restore_prelu``), which the plugin computes as a post-op of the int8 layer before it (6
  of 6; held-out accuracy unchanged): ``tests/test_openvino_int8_forms.py``.
- **LayerNorm in int8.** The frontend makes a LayerNorm an MVN over the array's last axes, which the CPU plugin's MVN
  does not take on a 4-D array (ConvNeXt's permuted channel norm: a float RMS and Add) and on a 2-D one runs without
  its requantization (a float FakeQuantize); ``row_layer_norms`` makes each an MVN over a [rows, features, 1] array
  with the activation after it moved next to it, which the plugin computes in int8 with the weight, bias, activation
  and requantization fused (a digits CNN with two permuted norms and one over a Linear's features: 13 of 19 operators
  int8 before, 15 of 16 after, the input's quantization the one float; held-out accuracy unchanged).
- **Precision.** ``save_model`` compresses weights to fp16 unless told not to: fp32 bundles are saved with
  ``compress_to_fp16=False``, fp16 ones with it. The precision fidelity was measured with is written into the IR
  (``rt_info`` ``edgeline/inference_precision``) and the runtime sets ``INFERENCE_PRECISION_HINT`` to it, so the CPU
  plugin does not switch to bf16 (or fp16) by itself on a device whose CPU has it.
- **int8.** ``nncf.quantize`` on the calibration samples (8-bit weights per channel, symmetric: NNCF's performance
  preset for the target device), with ``overflow_fix`` on every layer: weights in 7 bits, so AVX2 CPUs without VNNI
  (whose VPMADDUBSW saturates int16 pair sums, as this machine's) compute the same integers as VNNI ones and the
  fidelity measured here holds on the device. Activation ranges: NNCF's histogram, min-max and mean-min-max (its
  default) estimators are each tried, and the one whose outputs on the calibration samples are nearest the float
  model's is kept (``choose_ranges``), said in the manifest (``quantization.activation_ranges``); with labelled
  validation samples that choice is checked on the accuracy the budget judges, and an estimator that scores higher
  there is kept instead (on an unseen digits model the least output error lost 0.56 point where LiteRT gained 0.28).
  None is best on every model. Points lost held out, histogram / min-max / mean-min-max, and what the rule chose
  (by output error): autoencoder 0.0 / 0.0 / 8.0 (histogram), ResNet-8 0.22 each (min-max), DS-CNN 0.28 / 0.0 /
  -0.28 (min-max), VWW -0.67 / 0.0 / 1.67 (histogram), digits 0.0 / 0.22 / 0.0 (histogram); on two models no choice
  was made on, a MobileNetV3-shaped one 5.0 / 6.0 / 2.0 (mean-min-max) and a pooled CNN 0.0 / -0.5 / 5.5 (min-max):
  ``benchmarks/results/openvino_ranges.md``. The histogram alone, the rule before, lost 3 points more on the
  MobileNetV3-shaped model.
- **Accuracy control.** ``nncf.quantize_with_accuracy_control`` against the profile's accuracy budget, measured the way
  edgeline judges it (accuracy against labels, else agreement with the float model's decisions, else cosine) on the
  validation samples; the layers it reverted to float are the manifest's ``kept_float``.
- **Telemetry.** ``convert_model`` and NNCF send usage telemetry to Google Analytics when ``openvino-telemetry`` is
  importable and no opt-out file exists; an export must not talk to the network: the exporter imports both with
  ``openvino_telemetry`` unimportable, which makes each use its own no-op stub.
"""

from __future__ import annotations

import platform
import re
import sys
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from importlib.metadata import version
from typing import Any

import numpy as np

from edgeline.backends.openvino import CPU, PRECISION_KEY, has_device, import_openvino
from edgeline.device_profiles import Precision
from edgeline.export.backends import AccuracyControl, ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.errors import ExportError
from edgeline.export.graph import module_path
from edgeline.export.layer_probes import LayerProbe, LayerReading, openvino_layers
from edgeline.export.openvino_forms import restore_prelu, row_layer_norms
from edgeline.export.placement import node_source
from edgeline.manifest import KeptFloat, Placement, RuntimeRequirement

__all__ = [
    "OpenVINOExporter",
    "OpenVINOGpuExporter",
    "OpenVINONpuExporter",
    "import_export_tools",
    "int8_operators",
    "openvino_placement",
    "operator_sources",
    "unsupported_operators",
]

MODEL_FILE = "model.xml"
WEIGHTS_FILE = "model.bin"
MIN_VERSION = "2025.0"  # the IR of convert_model's PyTorch frontend on torch.export programs
WEIGHTED = frozenset(
    {"Convolution", "GroupConvolution", "ConvolutionBackpropData", "GroupConvolutionBackpropData", "MatMul"}
)
"""IR operators that multiply by weights: what int8 is for, and what NNCF's accuracy control reverts."""
_PASSING = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "VariadicSplit"})
"""IR operators a quantized tensor crosses unchanged on its way to the operator that reads it."""
_NOT_COMPUTE = frozenset({"Input", "Output", "Const", "Reorder", "Convert"})
"""Nodes of a plugin's runtime graph that compute nothing of the model: its inputs, outputs, constants, and the
layout and type conversions the plugin inserts (as Q/DQ nodes are left out of an ONNX model's count)."""
_INTEGER = frozenset({"i8", "u8"})
_CONTAINERS = frozenset({"Subgraph", "Eltwise", "Math"})
"""Kinds of the CPU plugin's runtime-graph nodes that say only that operators were fused, not what they compute (a
Snippets kernel, a chain of element-wise operators, a unary function): a float one is named by the IR's operators it
computes (``originalLayersNames``). The other kinds name a computation (RMS, MVN, Convolution, FakeQuantize), one the
names it lists may not cover (an RMS node lists only the Multiply it ends with): kept."""
_FX_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)/aten\.")


def import_export_tools() -> tuple[Any, Any]:
    """(openvino, nncf), their telemetry off (see the module's docstring); one error naming the extra otherwise."""
    if "openvino_telemetry" not in sys.modules:
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]  # import fails: the stubs are used
    ov = import_openvino()
    try:
        import nncf
    except ImportError as exc:
        raise ExportError("exporting to OpenVINO int8 needs nncf: pip install 'edgeline[export]'") from exc
    return ov, nncf


def _ov_type(ov: Any, dtype: Any) -> Any:
    import torch

    types = {torch.float32: ov.Type.f32, torch.float16: ov.Type.f16, torch.int64: ov.Type.i64, torch.int32: ov.Type.i32}
    if dtype not in types:
        raise ExportError(f"openvino: an input of dtype {dtype} is not supported (float32, float16, int32, int64)")
    return types[dtype]


def to_openvino(ov: Any, request: ExportRequest) -> tuple[Any, Any]:
    """(the OpenVINO model, the decomposed torch.export program it was converted from), with static batch-1 shapes
    and the tensors named like forward()'s parameters and ``output_<j>``."""
    import torch

    program = torch.export.export(request.module, request.example_inputs).run_decompositions()
    shapes = [(list(tensor.shape), _ov_type(ov, tensor.dtype)) for tensor in request.example_inputs]
    try:
        model = ov.convert_model(program, input=shapes)
    except Exception as exc:  # its frontend raises OpConversionFailure and others, naming the aten operators
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise ExportError(f"openvino: convert_model failed: {' '.join(lines[-3:])[:600]}") from exc
    restore_prelu(model)
    row_layer_norms(model)
    for port, name in zip(model.inputs, request.input_names, strict=True):
        port.get_tensor().set_names({name})
    for index, port in enumerate(model.outputs):
        port.get_tensor().set_names({f"output_{index}"})
    return model, program


def operator_modules(model: Any, program: Any, module: Any) -> dict[str, str]:
    """IR operator name -> the path of the torch module it computes, where known. An operator keeps the name of the
    torch.export node it came from (``convolution_1/aten.convolution.default/Convolution``), which ``nn_module_stack``
    names the module of. A convolution the frontend rebuilt before a batch norm is named ``Multiply_<n>``: it is the
    module, among those whose output the next named operator reads, whose weight has as many elements as its weights."""
    nodes = {node.name: node for node in program.graph.nodes if node.op == "call_function"}
    paths = {name: path for name, node in nodes.items() if (path := module_path(node)) is not None}
    named = dict(module.named_modules())
    found: dict[str, str] = {}
    for op in model.get_ordered_ops():
        name = op.get_friendly_name()
        match = _FX_NAME.match(name)
        if match is not None:
            if match.group(1) in paths:
                found[name] = paths[match.group(1)]
        elif op.get_type_name() in WEIGHTED:
            owner = _rebuilt_owner(op, nodes, paths, named)
            if owner is not None:
                found[name] = owner
    return found


def operator_sources(program: Any) -> dict[str, str]:
    """torch.export node name -> the model's code that made it: its module and the model's line that called it
    (``act1 (model.py:14)``, ``forward() (model.py:20)`` outside every module; the LiteRT and ExecuTorch placements'
    ``source``). The IR keeps no source lines, but each operator keeps the name of its node (``operator_modules``)."""
    return {
        node.name: where for node in program.graph.nodes if node.op == "call_function" and (where := node_source(node))
    }


def _rebuilt_owner(op: Any, nodes: dict[str, Any], paths: dict[str, str], named: dict[str, Any]) -> str | None:
    weights = op.input(1).get_partial_shape()
    if weights.is_dynamic:
        return None
    size = int(np.prod([int(d) for d in weights.to_shape()], dtype=np.int64))  # grouped: [G, O/G, I/G, k...]
    frontier: list[Any] = [op]
    seen: set[int] = set()
    for _ in range(8):  # bounded walk to the first operator named after a torch.export node
        readers = [t.get_node() for node in frontier for t in node.output(0).get_target_inputs()] if frontier else []
        named_reader = next((r for r in readers if _FX_NAME.match(r.get_friendly_name())), None)
        if named_reader is not None:
            fx = nodes.get(_FX_NAME.match(named_reader.get_friendly_name()).group(1))  # type: ignore[union-attr]
            inputs = [arg for arg in (fx.all_input_nodes if fx is not None else ()) if arg.name in paths]
            owners = {
                paths[arg.name]
                for arg in inputs
                if getattr(getattr(named.get(paths[arg.name]), "weight", None), "numel", lambda: -1)() == size
            }
            return owners.pop() if len(owners) == 1 else None
        frontier = [r for r in readers if id(r) not in seen and r.get_output_size() == 1]
        seen.update(id(r) for r in frontier)
    return None


def _feeds(request: ExportRequest, samples: Sequence[tuple[Any, ...]]) -> list[dict[str, np.ndarray]]:
    return [
        {name: np.asarray(value.numpy() if hasattr(value, "numpy") else value) for name, value in zip(
            request.input_names, sample, strict=True
        )}
        for sample in samples
    ]  # fmt: skip


def int8_operators(model: Any) -> set[str]:
    """The weighted IR operators of a quantized model that compute in int8: their activation input comes from a
    FakeQuantize (through operators that only move values)."""
    found = set()
    for op in model.get_ordered_ops():
        if op.get_type_name() not in WEIGHTED:
            continue
        source = op.input(0).get_source_output().get_node()
        for _ in range(16):  # bounded walk back
            if source.get_type_name() not in _PASSING:
                break
            source = source.input(0).get_source_output().get_node()
        if source.get_type_name() == "FakeQuantize":
            found.add(op.get_friendly_name())
    return found


class OpenVINOExporter(ExportTarget):
    name = "openvino"
    runtime_backend = "openvino"
    device = CPU
    precisions: tuple[Precision, ...] = (Precision.FP32, Precision.FP16, Precision.INT8_STATIC)
    own_accuracy_control = True  # NNCF's quantize_with_accuracy_control

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """The IR with each layer's output added to its outputs, on the CPU plugin in f32 (whatever device runs it)."""
        return openvino_layers(reading)

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            raise ExportError(f"{self.name} cannot export {request.precision.value}")
        ov, nncf = import_export_tools()
        model, program = to_openvino(ov, request)
        modules = operator_modules(model, program, request.module)
        kept: tuple[KeptFloat, ...] = ()
        ranges = None
        if request.precision is Precision.INT8_STATIC:
            model, kept, ranges = self._quantize(ov, nncf, model, request, modules)
        hint = "f16" if request.precision is Precision.FP16 else "f32"
        model.set_rt_info(hint, PRECISION_KEY)
        path = request.out_dir / MODEL_FILE
        ov.save_model(model, str(path), compress_to_fp16=request.precision is Precision.FP16)
        core = ov.Core()
        accelerator = self.accelerator
        here = accelerator is None or has_device(core.available_devices, accelerator)
        saved = core.read_model(str(path))
        placement = openvino_placement(
            core, saved, request.precision, accelerator, here, hint, sources=operator_sources(program)
        )
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="openvino", min_version=MIN_VERSION),
            input_names=tuple(request.input_names),
            extra_files=(WEIGHTS_FILE,),
            placement=placement,
            tool_versions={"torch": version("torch"), "openvino": version("openvino"), "nncf": version("nncf")}
            if request.precision is Precision.INT8_STATIC
            else {"torch": version("torch"), "openvino": version("openvino")},
            verification=_verification(core, request.precision, accelerator, here),
            kept_float=kept,
            activation_ranges=ranges,
        )

    def _quantize(
        self, ov: Any, nncf: Any, model: Any, request: ExportRequest, modules: dict[str, str]
    ) -> tuple[Any, tuple[KeptFloat, ...], str]:
        """The int8 model (with accuracy control when asked), the layers it kept float, and how its activation
        ranges were chosen."""
        feeds = _feeds(request, request.calibration)
        options: dict[str, Any] = dict(
            preset=nncf.QuantizationPreset.PERFORMANCE,
            target_device=getattr(nncf.TargetDevice, self.device),
            subset_size=len(request.calibration),
        )
        control = request.accuracy_control
        judge = request.validation_score or control
        checked = (judge, _feeds(request, judge.samples)) if judge is not None else None
        estimator, plain, ranges = choose_ranges(ov, nncf, model, feeds, options, checked)
        advanced = quantization_parameters(estimator)
        if control is None:
            return plain, (), ranges
        indexed = [(index, feed) for index, feed in enumerate(_feeds(request, control.samples))]

        def validate(compiled: Any, items: Any) -> tuple[float, None]:
            chosen = list(items)
            request_ = compiled.create_infer_request()
            outputs = []
            for _, feed in chosen:
                results = request_.infer(feed)
                outputs.append(tuple(np.array(results[port], copy=True) for port in compiled.outputs))
            return control.score([index for index, _ in chosen], outputs), None

        try:
            quantized = nncf.quantize_with_accuracy_control(
                model,
                nncf.Dataset(feeds),
                nncf.Dataset(indexed, lambda item: item[1]),
                validate,
                max_drop=control.max_drop + NNCF_DROP_SLACK,
                drop_type=nncf.DropType.ABSOLUTE,
                advanced_quantization_parameters=advanced,
                **options,
            )
        except Exception as exc:
            raise ExportError(f"openvino: nncf.quantize_with_accuracy_control failed: {_last_line(exc)}") from exc
        reverted = sorted(int8_operators(plain) - int8_operators(quantized))
        return quantized, _kept(reverted, modules, request.module, control), ranges


NNCF_DROP_SLACK = 1e-9
"""Added to the budget NNCF's accuracy control compares its drop with, in floats (``drop <= max_drop``): the score's
difference for a drop of exactly the budget can come out a few ulps over it (1.0000000000000142 for 1 point). A
drop counted in samples is a multiple of 100 / samples points, so this admits nothing over the budget below 10^11
samples; the budget's own verdict on the result is edgeline's, on counts (``budgets.fidelity_violations``)."""

RANGE_ESTIMATORS = ("histogram", "min-max", "mean-min-max")
"""NNCF's activation range estimators an int8 export tries, the first winning a tie: ``histogram`` (the range whose
quantization error is least over the calibration samples' histogram), ``min-max`` (every calibration sample's range
whole), ``mean-min-max`` (NNCF's default: the mean of each sample's range)."""


def quantization_parameters(estimator: str) -> Any:
    """NNCF's advanced parameters of an int8 export: ``overflow_fix`` on, the activations' ranges by ``estimator``."""
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix
    from nncf.quantization.range_estimator import RangeEstimatorParametersSet

    ranges = {
        "histogram": RangeEstimatorParametersSet.HISTOGRAM,
        "min-max": RangeEstimatorParametersSet.MINMAX,
        "mean-min-max": RangeEstimatorParametersSet.MEAN_MINMAX,
    }
    return AdvancedQuantizationParameters(
        overflow_fix=OverflowFix.ENABLE, activations_range_estimator_params=ranges[estimator]
    )


def output_error(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """The root mean square over the samples of each sample's relative L2 error (all its outputs together): what a
    range costs where the model's outputs are, whatever they mean."""
    errors = []
    for found, wanted in zip(outputs, reference, strict=True):
        scale = max(float(np.linalg.norm(wanted)), float(np.finfo(np.float64).tiny))
        errors.append(float(np.linalg.norm((found - wanted).astype(np.float64))) / scale)
    return float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0


def _outputs(ov: Any, model: Any, feeds: Sequence[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """Every output of each sample, flattened into one vector (computed in fp32 on the CPU, on two threads: on one,
    OpenVINO 2026 fuses int8 fully connected layers into a kernel that is wrong on AMX CPUs, ``edgeline.backends.
    openvino``)."""
    compiled = ov.Core().compile_model(model, CPU, {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})
    request = compiled.create_infer_request()
    found = []
    for feed in feeds:
        results = request.infer(feed)
        parts = [np.asarray(results[port], dtype=np.float64).reshape(-1) for port in compiled.outputs]
        found.append(np.concatenate(parts))
    return found


def _sample_outputs(ov: Any, model: Any, feeds: Sequence[dict[str, np.ndarray]]) -> list[tuple[np.ndarray, ...]]:
    """Each sample's outputs as the model gives them (computed as ``_outputs`` computes them)."""
    compiled = ov.Core().compile_model(model, CPU, {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})
    request = compiled.create_infer_request()
    found = []
    for feed in feeds:
        results = request.infer(feed)
        found.append(tuple(np.array(results[port], dtype=np.float32, copy=True) for port in compiled.outputs))
    return found


def choose_ranges(
    ov: Any,
    nncf: Any,
    model: Any,
    feeds: Sequence[dict[str, np.ndarray]],
    options: dict[str, Any],
    validation: tuple[AccuracyControl, Sequence[dict[str, np.ndarray]]] | None = None,
) -> tuple[str, Any, str]:
    """Quantize with each of ``RANGE_ESTIMATORS`` and keep the one whose outputs on the calibration samples are
    nearest the float model's (``output_error``): no estimator is best on every model (see the module). With
    ``validation`` (the budget's score on the labelled validation samples, and those samples as feeds) the choice is
    checked on the budget's own measure: each estimator's model scored, and the best kept; the one nearest on the
    calibration samples wins a tie. (Chosen among three on the samples that then measure it, the fidelity figure can
    be a little optimistic; the sentence says it was chosen there.) (name, int8 model, a sentence for the manifest's
    ``quantization.activation_ranges``)."""
    reference = _outputs(ov, model, feeds)
    tried: dict[str, tuple[float, Any]] = {}
    for estimator in RANGE_ESTIMATORS:
        try:
            advanced = quantization_parameters(estimator)
            quantized = nncf.quantize(model.clone(), nncf.Dataset(feeds), advanced_parameters=advanced, **options)
        except Exception as exc:
            raise ExportError(f"openvino: nncf.quantize ({estimator} ranges) failed: {_last_line(exc)}") from exc
        tried[estimator] = (output_error(_outputs(ov, quantized, feeds), reference), quantized)
    nearest = min(RANGE_ESTIMATORS, key=lambda name: tried[name][0])  # min keeps the first of equals
    errors = "root mean square of each sample's relative error: " + ", ".join(
        f"{name} {tried[name][0]:.4g}" for name in RANGE_ESTIMATORS
    )
    if validation is None:
        others = ", ".join(f"{name} {tried[name][0]:.4g}" for name in RANGE_ESTIMATORS if name != nearest)
        said = (
            f"NNCF's {nearest} estimator: the least output error on the {len(feeds)} calibration samples (root mean "
            f"square of each sample's relative error {tried[nearest][0]:.4g}; {others})"
        )
        return nearest, tried[nearest][1], said
    judge, validation_feeds = validation
    indices = list(range(len(validation_feeds)))
    scores = {name: judge.score(indices, _sample_outputs(ov, tried[name][1], validation_feeds)) for name in tried}
    best = max(RANGE_ESTIMATORS, key=lambda name: (scores[name], name == nearest))  # max keeps the first of equals
    scored = ", ".join(f"{name} {scores[name]:.2f}" for name in RANGE_ESTIMATORS)
    why = (
        "the least output error on the calibration samples, and no other scores higher"
        if best == nearest
        else f"it scores higher than {nearest}, which had the least output error on the calibration samples"
    )
    said = (
        f"NNCF's {best} estimator: {why} ({judge.measure} on the {len(validation_feeds)} validation samples: "
        f"{scored}; on the {len(feeds)} calibration samples, {errors})"
    )
    return best, tried[best][1], said


def _kept(reverted: list[str], modules: dict[str, str], module: Any, control: AccuracyControl) -> tuple[KeptFloat, ...]:
    """The modules whose weighted operators accuracy control reverted to float, in the manifest's terms."""
    named = dict(module.named_modules())
    found: dict[str, list[str]] = {}
    for op in reverted:  # an operator no module is known for is listed by its own name
        path = modules.get(op)
        found.setdefault(path if path is not None else op, []).append(op.split("/")[-1] if path is not None else "")
    kept = []
    for path, ops in found.items():
        leaf = named.get(path)
        params = sum(p.numel() for p in leaf.parameters()) if leaf is not None else 0
        ops = [op for op in ops if op]
        kept.append(
            KeptFloat(
                module=path,
                operator=type(leaf).__name__ if leaf is not None else "IR operator",
                added_bytes=3 * params,
                reason=f"NNCF's accuracy control reverted {'its ' + ', '.join(ops) if ops else 'it'} to float to hold "
                f"the {control.measure} "
                f"budget (a drop of at most {control.max_drop:g})",
            )
        )
    return tuple(kept)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines or [type(exc).__name__])[-1][:400]


def _runtime_graph(core: Any, model: Any, device: str, hint: str) -> list[Any]:
    compiled = core.compile_model(model, device, {"INFERENCE_PRECISION_HINT": hint})
    return [op for op in compiled.get_runtime_model().get_ordered_ops()]


def _info(op: Any, key: str) -> str:
    info = op.get_rt_info()
    return str(info[key].astype(str)) if key in info else ""


def _elements(shape: Any) -> int | None:
    if shape.is_dynamic:
        return None
    return int(np.prod([int(d) for d in shape.to_shape()], dtype=np.int64))


def _macs(op: Any) -> int | None:
    """Multiply-accumulates of one runtime-graph node from its shapes: convolutions and fully connected layers by their
    reduction, every other node one per output element."""
    kind = _info(op, "layerType")
    out = _elements(op.get_output_partial_shape(0)) if op.get_output_size() else 0
    if out is None:
        return None
    if kind in ("Convolution", "FullyConnected") and op.get_input_size() > 1:
        weights = _elements(op.input(1).get_partial_shape())
        shape = op.get_output_partial_shape(0)
        channels = int(shape[1].get_length() if kind == "Convolution" else shape[len(shape) - 1].get_length())
        return None if weights is None or not channels else out * (weights // channels)
    if kind == "MatMul" and op.get_input_size() > 1:
        left = op.input(0).get_partial_shape()
        return None if left.is_dynamic else out * int(left[len(left) - 1].get_length())
    return out


def unsupported_operators(core: Any, model: Any, device: str) -> Counter[str]:
    """The IR's operators, by type, that ``device``'s plugin does not support (``query_model``), its parameters,
    results and constants aside."""
    return Counter(op.get_type_name() for op in _unsupported(core, model, device))


def _unsupported(core: Any, model: Any, device: str) -> list[Any]:
    supported = core.query_model(model, device)
    return [
        op
        for op in model.get_ordered_ops()
        if op.get_type_name() not in ("Parameter", "Result", "Constant") and op.get_friendly_name() not in supported
    ]


def _float_kernel(op: Any, types: Mapping[str, str]) -> tuple[str, list[str]]:
    """How ``fallback`` names a runtime-graph node left in float, and the IR operators it computes (their names):
    the node's kind, or for a fusion container (``_CONTAINERS``) the types of the IR operators it fused, in its order
    (``Greater+Multiply+Select``: PReLU as torch.export decomposes it). A FakeQuantize fused into a node is the
    requantization of its result or input, not its work: left out where the node computes anything else. Names the
    IR lacks (operators the plugin made while compiling) say nothing: a container none of whose names the IR has
    keeps its kind."""
    kind = _info(op, "layerType")
    fused = [name for name in _info(op, "originalLayersNames").split(",") if name]
    known = [name for name in fused if name in types]
    computed = [name for name in known if types[name] != "FakeQuantize"] or known
    if kind in _CONTAINERS and computed:
        kind = "+".join(dict.fromkeys(types[name] for name in computed))
    return kind, computed or fused


def _named(operators: Iterable[str], sources: Mapping[str, str], inputs: Container[str]) -> list[str]:
    """The model's code that made IR operators, by the torch.export node each is named after, each said once; the
    quantization of a model input NNCF added (``x/fq_output_0``) as ``input x``."""
    found: list[str] = []
    for name in operators:
        match = _FX_NAME.match(name)
        where = sources.get(match.group(1)) if match is not None else None
        if match is None and name.partition("/")[0] in inputs:
            where = f"input {name.partition('/')[0]}"
        if where is not None and where not in found:
            found.append(where)
    return found


def openvino_placement(
    core: Any,
    model: Any,
    precision: Precision,
    accelerator: str | None,
    here: bool,
    hint: str,
    sources: Mapping[str, str] | None = None,
) -> Placement:
    """Placement read from the runtime graph of the plugin that compiles the model here (its nodes are fused
    operators: a convolution with its bias, activation and requantization is one), each node's ``runtimePrecision``
    saying whether it computes in int8. An accelerator's plugin present here is asked first which operators it
    supports (``query_model``): it compiles the whole model or nothing (no fallback without HETERO), so one it lacks
    puts the model on the CPU, the missing operators in ``fallback``. An accelerator absent here leaves its share
    unknown, said so.

    ``fallback`` counts runtime-graph nodes, as ``ops`` does, each named by what it computes (``_float_kernel``:
    ``Greater+Multiply+Select`` rather than the plugin's ``Subgraph``); with ``sources`` (``operator_sources`` of the
    program the IR was converted from), ``fallback_sources`` names the model's code that made each: a node's
    ``originalLayersNames`` lists the IR operators it fused, each named after its torch.export node."""
    code = sources or {}
    inputs = {op.get_friendly_name() for op in model.get_parameters()}
    missing = _unsupported(core, model, accelerator) if accelerator is not None and here else []
    device = accelerator if accelerator is not None and here and not missing else CPU
    graph = _runtime_graph(core, model, device, hint)
    constant = {id(op) for op in graph if _info(op, "layerType") == "Const"}
    for op in graph:  # nodes that compute on constants alone (weights' reshapes) are the weights' preparation
        feeding = [op.input(i).get_source_output().get_node() for i in range(op.get_input_size())]
        if feeding and all(id(source) in constant for source in feeding):
            constant.add(id(op))
    nodes = [op for op in graph if _info(op, "layerType") not in _NOT_COMPUTE and id(op) not in constant]
    quantized = [op for op in nodes if _info(op, "runtimePrecision") in _INTEGER]
    work = {id(op): _macs(op) for op in nodes}
    counted = all(value is not None for value in work.values())
    unknown: dict[str, str] = {}
    if not counted:
        unknown["macs"] = "the plugin's runtime graph has dynamic shapes"
    fallback: Counter[str] = Counter()
    where: dict[str, list[str]] = {}

    def left(kind: str, operators: list[str]) -> None:
        fallback[kind] += 1
        named = where.setdefault(kind, [])
        named.extend(found for found in _named(operators, code, inputs) if found not in named)

    for op in missing:
        left(op.get_type_name(), [op.get_friendly_name()])
    if precision.integer:
        types = {op.get_friendly_name(): op.get_type_name() for op in model.get_ordered_ops()}
        for op in nodes:
            if op not in quantized:
                left(*_float_kernel(op, types))
    accelerator_ops = None
    if accelerator is not None:
        if here:
            accelerator_ops = 0 if missing else len(nodes)
        else:
            unknown["accelerator_ops"] = (
                f"OpenVINO's {accelerator} plugin compiles the model on the device; there is no {accelerator} here, so "
                "the operators are counted on the CPU plugin's runtime graph"
            )
    return Placement(
        accelerator=accelerator,
        ops=len(nodes),
        accelerator_ops=accelerator_ops,
        quantized_ops=len(quantized) if precision.integer else None,
        macs=sum(work[id(op)] or 0 for op in nodes) if counted else None,
        quantized_macs=sum(work[id(op)] or 0 for op in quantized) if counted and precision.integer else None,
        fallback=dict(sorted(fallback.items())),
        fallback_sources={kind: found for kind, found in sorted(where.items()) if found},
        unknown=unknown,
    )


def _verification(core: Any, precision: Precision, accelerator: str | None, here: bool) -> Verification | None:
    """None (the bundle on its own runtime backend here, the usual check) unless what runs here is not what the
    device runs: an accelerator absent here, or an fp16 model whose fp16 this CPU does not compute."""
    notes = []
    if accelerator is not None and not here:
        notes.append(f"the bundle is built for OpenVINO's {accelerator} plugin, which was not measured")
    if precision is Precision.FP16 and "FP16" not in core.get_property(CPU, "OPTIMIZATION_CAPABILITIES"):
        notes.append("this CPU computes no fp16: the fp16 weights were computed in fp32")
    if not notes:
        return None
    return Verification(
        backend="openvino",
        measured_with=f"openvino {version('openvino')} CPU plugin on this {platform.machine()} machine; "
        + "; ".join(notes),
    )


class OpenVINOGpuExporter(OpenVINOExporter):
    """An Intel integrated GPU (OpenVINO's GPU plugin): it computes in fp16 (fp32 costs it twice the time)."""

    name = "openvino-gpu"
    device = "GPU"
    accelerator = "GPU"


class OpenVINONpuExporter(OpenVINOExporter):
    """An Intel NPU (Core Ultra's; OpenVINO's NPU plugin): static shapes only, int8 or fp16."""

    name = "openvino-npu"
    device = "NPU"
    accelerator = "NPU"
    precisions = (Precision.FP16, Precision.INT8_STATIC)
