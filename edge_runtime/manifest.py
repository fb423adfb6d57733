"""The bundle manifest, schema version 1: everything a device needs to know and nothing it has to guess.

The manifest is validated data. Every field a device acts on is typed here; export writes it, the
runtime reads it. See ``docs/bundle.md`` for the field-by-field contract.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from edgeline.detection import IOU_THRESHOLD, MAX_DETECTIONS, PRE_NMS_TOP_K, SCORE_THRESHOLD, Head, check_output
from edgeline.device_profiles.schema import Budgets
from edgeline.errors import EdgelineError

__all__ = [
    "SCHEMA_VERSION",
    "Budgets",
    "Detection",
    "Device",
    "Estimates",
    "Fidelity",
    "FileEntry",
    "Firmware",
    "Golden",
    "ImagePreprocess",
    "KeptFloat",
    "LayerFidelity",
    "Manifest",
    "Memory",
    "Placement",
    "Postprocess",
    "Preprocess",
    "Quantization",
    "QuantizationSummary",
    "Rewrite",
    "RuntimeRequirement",
    "TensorSpec",
    "Window",
    "image_axes",
    "percent",
    "worst_layers",
]

SCHEMA_VERSION = 1

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Dtype = Literal["float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"]


def percent(share: float, digits: int = 1) -> str:
    """``share`` (0..1) as a percentage with ``digits`` decimals, never rounded to 100% or 0% when it is not: more
    decimals where that would happen (801,382 of 801,414 MACs is "99.996%", not "100.0%"), at most four."""
    for places in range(digits, 5):
        text = f"{share * 100:.{places}f}"
        if not (0 < share < 1) or 0 < float(text) < 100:
            return f"{text}%"
    return ">99.9999%" if share > 0.5 else "<0.0001%"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Quantization(_Frozen):
    """Affine quantization of a tensor at the model's edge: ``real = (q - zero_point) * scale``."""

    scale: float = Field(gt=0)
    zero_point: int = Field(ge=-(2**63), lt=2**63)  # int64, as in the model file; larger ones overflow float32


class TensorSpec(_Frozen):
    """One model input or output as the model itself sees it (dtype is the model's, not the caller's)."""

    name: str
    dtype: Dtype
    shape: tuple[int, ...]
    quantization: Quantization | None = None
    # The tensor's name inside the model file when it differs from ``name`` (the caller-facing name,
    # e.g. the forward() parameter): how a runtime finds the tensor.
    tensor: str | None = None

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim < 1 for dim in shape):
            raise ValueError(f"every dimension must be >= 1, got {list(shape)}")
        return shape

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class FileEntry(_Frozen):
    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _relative_inside(cls, path: str) -> str:
        parts = path.replace("\\", "/").split("/")
        if path.startswith("/") or ".." in parts or not path or ":" in parts[0]:
            raise ValueError(f"must be a relative path inside the bundle, got {path!r}")
        return path


MAX_IMAGE_SIDE = 65535
"""The largest image side a manifest may name (pixels): a sent bundle cannot make a device allocate without bound."""


def _image_size(size: tuple[int, int]) -> tuple[int, int]:
    if not all(1 <= side <= MAX_IMAGE_SIDE for side in size):
        raise ValueError(f"(height, width) must be 1..{MAX_IMAGE_SIDE} each, got {list(size)}")
    return size


ImageSize = Annotated[tuple[int, int], AfterValidator(_image_size)]
"""(height, width) of an image, each side 1..``MAX_IMAGE_SIDE``."""


class Detection(_Frozen):
    """A detector's output 0, read by ``edgeline.detection``: its head's layout (see ``Head``), the input size its
    boxes are in (height, width), and the answers' defaults, which a run may override."""

    head: str = "custom"
    """The ``--head`` it was exported with (``yolov8``, ``yolov5``, ``end2end``), or ``custom``: the fields say."""
    layout: Literal["attributes-first", "boxes-first", "end2end"]
    box_format: Literal["xywh", "xyxy", "yxyx"] = "xywh"
    box_space: Literal["pixels", "normalised"] = "pixels"
    objectness: bool = False
    score_activation: Literal["none", "sigmoid"] = "none"
    has_nms: bool = False
    input_size: ImageSize
    score_threshold: float = Field(default=SCORE_THRESHOLD, ge=0, le=1, allow_inf_nan=False)
    iou_threshold: float = Field(default=IOU_THRESHOLD, ge=0, le=1, allow_inf_nan=False)
    max_detections: int = Field(default=MAX_DETECTIONS, ge=1, le=10_000)
    pre_nms_top_k: int = Field(default=PRE_NMS_TOP_K, ge=1, le=1_000_000)
    box_scaling: str | None = Field(default=None, max_length=1000)
    """What the export did about pixel boxes sharing output 0 with the scores (integer quantization gives a tensor
    one scale): divided by the input size inside the model, or why they were not; None: nothing to do."""

    def as_head(self) -> Head:
        return Head(self.head, self.layout, self.box_format, self.box_space, self.objectness, self.score_activation,
                    self.has_nms)  # fmt: skip


class Postprocess(_Frozen):
    """How to read the outputs: ``classify`` (labels, softmax score), ``anomaly`` (score vs threshold), ``detect``
    (boxes, by ``detection``)."""

    kind: Literal["classify", "regress", "anomaly", "detect", "raw"] = "raw"
    labels: tuple[str, ...] | None = None
    # classify: "softmax" when output 0 holds logits, "identity" when it already holds probabilities.
    score: Literal["softmax", "identity"] = "softmax"
    # anomaly: the score is the mean squared reconstruction error of input 0 by output 0 ("reconstruction"),
    # or output 0 itself ("output"); flagged when score > threshold.
    anomaly_score: Literal["reconstruction", "output"] = "reconstruction"
    threshold: float | None = None
    detection: Detection | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Postprocess:
        if self.kind == "anomaly" and self.threshold is None:
            raise ValueError("postprocess kind 'anomaly' needs a threshold")
        if (self.kind == "detect") != (self.detection is not None):
            raise ValueError("postprocess kind 'detect' needs 'detection', and only it has one")
        return self


class Preprocess(_Frozen):
    """Applied by the runtime to float inputs before the model: ``x * scale + offset``."""

    scale: float = 1.0
    offset: float = 0.0


def image_axes(shape: tuple[int, ...], layout: Literal["nchw", "nhwc"]) -> tuple[int, int, int]:
    """(channels, height, width) of an image input of ``shape`` in ``layout``: (1, C, H, W) or (C, H, W) for
    ``nchw``, (1, H, W, C) or (H, W, C) for ``nhwc``. ``ValueError`` saying why when the shape is not an image's."""
    order = "(1, C, H, W)" if layout == "nchw" else "(1, H, W, C)"
    if len(shape) == 4 and shape[0] != 1:
        raise ValueError(f"shape {list(shape)} has a batch of {shape[0]}; an image input takes one: {order}")
    if len(shape) not in (3, 4):
        raise ValueError(f"shape {list(shape)} is not an image's: {layout} is {order}")
    dims = shape[-3:]
    channels, height, width = dims if layout == "nchw" else (dims[2], dims[0], dims[1])
    if channels not in (1, 3):
        axis = "second" if layout == "nchw" else "last"
        raise ValueError(
            f"shape {list(shape)} has {channels} channels on its {axis} axis ({layout} is {order}); an image has 1 "
            "(gray) or 3 (rgb, bgr)" + (": is the layout nhwc?" if layout == "nchw" and dims[2] in (1, 3) else "")
        )
    return channels, height, width


class ImagePreprocess(_Frozen):
    """How a camera frame or an image becomes input 0 (``edgeline.imaging.FramePrep``, which export and the daemon
    both call): converted to ``color``, resized to ``size`` (height, width) by ``resize`` (bilinear, half-pixel
    centres; ``letterbox`` pads with ``pad``), normalised as ``(x * scale - mean) / std`` per channel, laid out as
    ``layout``. Quantization is the input tensor's, applied after."""

    size: ImageSize
    resize: Literal["letterbox", "squash", "center-crop"] = "letterbox"
    pad: int = Field(default=114, ge=0, le=255)
    color: Literal["rgb", "bgr", "gray"] = "rgb"
    scale: float = Field(default=1 / 255, gt=0, allow_inf_nan=False)
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: Literal["nchw", "nhwc"] = "nchw"

    @property
    def channels(self) -> int:
        return 1 if self.color == "gray" else 3

    @model_validator(mode="after")
    def _per_channel(self) -> ImagePreprocess:
        for key, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, self.channels):
                raise ValueError(
                    f"{key} has {len(values)} values; color {self.color} has {self.channels} channel"
                    f"{'s' if self.channels > 1 else ''}: give 1 (for all) or {self.channels}"
                )
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"{key} must be finite numbers, got {list(values)}")
        if not all(v > 0 for v in self.std):
            raise ValueError(f"std must be > 0 for every channel, got {list(self.std)}")
        return self

    def describe(self) -> str:
        """One line: ``96x96 rgb, center-crop, (x * 0.00392 - 0) / 1, nchw``."""
        resize = f"letterbox (pad {self.pad})" if self.resize == "letterbox" else self.resize
        numbers = "/".join(f"{v:.4g}" for v in self.mean), "/".join(f"{v:.4g}" for v in self.std)
        return (
            f"{self.size[0]}x{self.size[1]} {self.color}, {resize}, (x * {self.scale:.4g} - {numbers[0]}) / "
            f"{numbers[1]}, {self.layout}"
        )


class Window(_Frozen):
    """Time-series windowing of a stream into model inputs (used by the daemon)."""

    size: int = Field(ge=1)
    hop: int = Field(ge=1)
    channels: int = Field(ge=1)


class Golden(_Frozen):
    """The self-test in golden.npz: arrays ``input_<i>`` and ``output_<j>``, first axis = samples.

    ``reference`` says whose outputs they are. "bundle": this bundle's model where it was exported, so a device
    must reproduce them within ``atol``/``rtol``. "float": the float torch model's, shipped when nothing at export
    could run the bundle (Core ML on Linux): ``edgeline verify`` on the device then measures fidelity against them,
    judged by the manifest's budgets (``atol`` is empty: there is no bundle output to be close to).
    """

    path: str = "golden.npz"
    samples: int = Field(ge=1)
    reference: Literal["bundle", "float"] = "bundle"
    atol: tuple[float, ...] = ()
    rtol: float = 1e-3

    @model_validator(mode="after")
    def _tolerance_for_bundle_outputs(self) -> Golden:
        if self.reference == "bundle" and not self.atol:
            raise ValueError("a golden of the bundle's own outputs needs atol (one per output)")
        return self


class Fidelity(_Frozen):
    """How the bundle compares with the float torch model, or why that was not measured."""

    status: Literal["measured", "not-measured"]
    reason: str | None = None
    reference: str
    samples: int = 0
    max_abs_error: float | None = None
    mean_abs_error: float | None = None
    cosine_min: float | None = None
    top1_agreement: float | None = None
    accuracy: float | None = None
    accuracy_float: float | None = None
    macro_f1: float | None = None
    macro_f1_float: float | None = None
    confusion: list[list[int]] | None = None
    confusion_float: list[list[int]] | None = None
    anomaly_agreement: float | None = None
    map50: float | None = Field(default=None, ge=0, le=1)
    """A detector's: COCO mAP@0.5 of the bundle's detections against the validation images' objects."""
    map50_95: float | None = Field(default=None, ge=0, le=1)
    """COCO mAP@0.5:0.95 of the same."""
    map50_float: float | None = Field(default=None, ge=0, le=1)
    map50_95_float: float | None = Field(default=None, ge=0, le=1)
    """The float torch model's, on the same images through the same decoding and NMS."""
    map50_agreement: float | None = Field(default=None, ge=0, le=1)
    """mAP@0.5 of the bundle's detections against the float model's (those over the answers' score threshold) as
    the objects: how closely it finds what the float model finds, labelled images or not."""
    lost_samples: int | None = Field(default=None, ge=0)
    """Against labels: the samples the float model decides right and the bundle wrong."""
    gained_samples: int | None = Field(default=None, ge=0)
    """Against labels: the samples the bundle decides right and the float model wrong (the accuracy drop is
    ``lost_samples - gained_samples`` of ``samples``: the budget is judged on these counts, never on a difference of
    floats)."""
    disagreeing_samples: int | None = Field(default=None, ge=0)
    """The samples whose decision (top-1 class, anomaly flag) differs between the bundle and the float model."""
    drop_interval: tuple[float, float] | None = None
    """The 95% interval of the decisive measure's drop in points (accuracy lost against labels, else disagreement
    with the float model), as far as ``samples`` validation samples can tell it; ``drop_interval_method`` says how.
    A budget inside it is a verdict these samples cannot settle (docs/bundle.md, budgets)."""
    drop_interval_method: str | None = None
    measured_with: str | None = None
    instruction_set: str | None = Field(default=None, max_length=256, pattern=r"^[A-Za-z0-9_. -]*$")
    """The measuring machine's architecture and the CPU features its runtime chose kernels by (``edgeline.isa``):
    ``x86_64 FMA AVX2 AVX512 AVX512-VNNI AVX512-BF16``. Which figures can differ with them: docs/bundle.md."""
    computed_in: Literal["f32", "f16", "bf16"] | None = None
    """The arithmetic the runtime computed the model's floating-point operators in while measuring: ``f32``, ``f16``
    or ``bf16`` (an integer model's integer operators are exact 32-bit sums on every CPU edgeline exports for)."""

    @model_validator(mode="after")
    def _reason_when_not_measured(self) -> Fidelity:
        if self.status == "not-measured" and not self.reason:
            raise ValueError("a fidelity that was not measured must say why (reason)")
        return self


class RuntimeRequirement(_Frozen):
    package: str
    min_version: str


class Placement(_Frozen):
    """How much of the model runs where and in what precision, as the converted model file says.

    ``ops`` counts the model's operators, leaving out the quantize/dequantize conversions at its edges and around
    quantized operators. ``fallback`` names the operators left on the CPU (when there is an accelerator) or in
    float (when the precision is an integer one), with their counts. A figure that cannot be known is null and
    ``unknown`` says why, keyed by the field's name.
    """

    accelerator: str | None = None
    ops: int | None = Field(default=None, ge=0)
    accelerator_ops: int | None = Field(default=None, ge=0)
    quantized_ops: int | None = Field(default=None, ge=0)
    macs: int | None = Field(default=None, ge=0)
    """The model's work: multiply-accumulates of convolutions, fully connected layers and matrix products, plus one
    per output element of every other operator (the same operators ``ops`` counts)."""
    accelerator_macs: int | None = Field(default=None, ge=0)
    quantized_macs: int | None = Field(default=None, ge=0)
    fallback: dict[str, int] = Field(default_factory=dict)
    fallback_sources: dict[str, list[str]] = Field(default_factory=dict)
    """Per operator in ``fallback``, the model's code that made those left there: its module and source line
    (``pool1 (model.py:14)``, ``forward() (model.py:20)`` outside every module), where the converted model keeps
    them (ExecuTorch's programs do): a share is never the only place an operator left out shows."""
    unknown: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_first_layout(cls, data: object) -> object:
        """Bundles written before schema 1 gained these fields said delegate/delegated/not_delegated."""
        if isinstance(data, dict) and "delegated" in data:
            delegated = dict(data.get("delegated") or {})
            other = dict(data.get("not_delegated") or {})
            return {
                "accelerator": data.get("delegate"),
                "ops": sum(delegated.values()) + sum(other.values()),
                "accelerator_ops": sum(delegated.values()),
                "fallback": other,
                "unknown": {"quantized_ops": "written by an older edgeline that did not count them"},
            }
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Placement:
        for key, total in (
            ("accelerator_ops", "ops"),
            ("quantized_ops", "ops"),
            ("accelerator_macs", "macs"),
            ("quantized_macs", "macs"),
        ):
            value, whole = getattr(self, key), getattr(self, total)
            if value is not None and whole is not None and value > whole:
                raise ValueError(f"{key} ({value}) is more than {total} ({whole})")
        return self

    @property
    def accelerator_share(self) -> float | None:
        if self.accelerator is None or self.accelerator_ops is None or not self.ops:
            return None
        return self.accelerator_ops / self.ops

    @property
    def quantized_share(self) -> float | None:
        if self.quantized_ops is None or not self.ops:
            return None
        return self.quantized_ops / self.ops

    @property
    def accelerator_macs_share(self) -> float | None:
        """The share of the model's work on the accelerator (what a share budget judges when it is known)."""
        if self.accelerator is None or self.accelerator_macs is None or not self.macs:
            return None
        return self.accelerator_macs / self.macs

    @property
    def quantized_macs_share(self) -> float | None:
        if self.quantized_macs is None or not self.macs:
            return None
        return self.quantized_macs / self.macs

    def describe(self) -> str:
        """One line: the shares, the fallback, and why any figure is unknown."""

        def share(count: int | None, key: str, what: str) -> str:
            if count is None:
                return f"{what} unknown ({self.unknown.get(key, 'not recorded')})"
            text = f"{what} {count}/{self.ops} ops" + (f" ({percent(count / self.ops, 0)})" if self.ops else "")
            work = getattr(self, key.replace("_ops", "_macs"))
            if work is not None and self.macs:
                text += f", {percent(work / self.macs)} of the work"
            return text

        if self.ops is None:
            parts = [f"operators unknown ({self.unknown.get('ops', 'not recorded')})"]
        else:
            parts = [f"{self.ops} ops" + (f", {_count(self.macs)} MACs" if self.macs is not None else "")]
            if self.accelerator is None:
                parts.append("no accelerator (the CPU runs them)")
            else:
                parts.append(share(self.accelerator_ops, "accelerator_ops", f"on {self.accelerator}"))
            if self.quantized_ops is not None or "quantized_ops" in self.unknown:
                parts.append(share(self.quantized_ops, "quantized_ops", "quantized"))
        if self.fallback:
            items = sorted(self.fallback.items(), key=lambda item: (-item[1], item[0]))
            shown = ", ".join(f"{op} x{count}" for op, count in items[:8])
            parts.append(f"fallback: {shown}" + (f" and {len(items) - 8} more" if len(items) > 8 else ""))
        return "; ".join(parts)

    def describe_sources(self) -> str | None:
        """One line naming where each fallback operator comes from (``fallback_sources``), e.g. ``float: CUMSUM x2
        in spread (model.py:7), forward() (model.py:20); EXP in ...``; "off ethos-u" with an accelerator. None when
        no source is recorded."""
        if not self.fallback_sources:
            return None
        items = sorted(self.fallback.items(), key=lambda item: (-item[1], item[0]))
        named = []
        for op, count in items[:12]:
            found = self.fallback_sources.get(op, [])
            where = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            named.append(f"{op}{f' x{count}' if count > 1 else ''} " + (f"in {where}" if found else "(not recorded)"))
        more = f"; and {len(items) - 12} more operators" if len(items) > 12 else ""
        return f"{'off ' + self.accelerator if self.accelerator else 'float'}: " + "; ".join(named) + more


class Memory(_Frozen):
    """What the bundle's model needs at run time, measured at export where it can be (never estimated).

    ``resident_mb``: the resident memory (RSS) loading the model and running it once adds to a process, on the
    export machine with the bundle's runtime; ``arena_bytes``: TFLite Micro's tensor arena (what a microcontroller
    reserves in SRAM). A figure that cannot be measured is null and ``unknown`` says why, keyed by the field's name.
    """

    resident_mb: float | None = Field(default=None, ge=0)
    arena_bytes: int | None = Field(default=None, ge=0)
    measured_with: str | None = None
    unknown: dict[str, str] = Field(default_factory=dict)


class Device(_Frozen):
    """The kind of machine the bundle was exported for, as its profile names it: what ``verify`` compares the machine
    it runs on with before holding a figure against a device budget (latency)."""

    arch: str  # the profile's cpu.arch: uname -m, or a microcontroller's ("armv8.1-m", "armv7e-m")
    cpu: str  # the profile's cpu.name, e.g. "Cortex-A76"


def _count(value: int) -> str:
    """1234567 -> "1.23 M": the size of a figure at a glance."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g} {suffix}"
    return str(value)


class Estimates(_Frozen):
    """Figures a compiler estimated for hardware that is not here (vela for Ethos-U): never measurements."""

    tool: str  # e.g. "ethos-u-vela 5.2.0"
    target: str  # e.g. "ethos-u55-128, system config Ethos_U55_High_End_Embedded, memory mode Shared_Sram"
    clock_mhz: float | None = None
    cycles: int | None = Field(default=None, ge=0)
    inference_ms: float | None = Field(default=None, ge=0)
    sram_bytes: int | None = Field(default=None, ge=0)
    flash_bytes: int | None = Field(default=None, ge=0)
    dram_bytes: int | None = Field(default=None, ge=0)
    macs: int | None = Field(default=None, ge=0)
    covers: str | None = None
    """What the figures cover, and what they leave out (vela's: the NPU's part, not the operators left to the CPU)."""


class Firmware(_Frozen):
    """The C sources a microcontroller's firmware builds the bundle in from (``sources``, in a ``tflite-micro``
    bundle): the model as a C array of ``model_bytes``, and the tensor arena its header reserves.

    ``arena_bytes`` (the header's ``EDGELINE_ARENA_BYTES``) is ``arena_basis_bytes`` plus ``arena_margin``. The basis
    is TFLite Micro's arena for the model array's own file, ``measured`` at export; where TFLite Micro cannot run
    that file here (a vela model: only the NPU's driver runs its ``ethos-u`` operator) it is vela's SRAM figure,
    ``estimated``. ``arena_basis_with`` says what measured or estimated it.
    """

    sources: str  # the folder of the C sources, e.g. "c"
    model_bytes: int = Field(ge=1)
    arena_bytes: int = Field(ge=0)
    arena_basis: Literal["measured", "estimated"]
    arena_basis_bytes: int = Field(ge=0)
    arena_basis_with: str
    arena_margin: str  # the rule from the basis to arena_bytes, e.g. "+10%, rounded up to 16 B, +2048 B"


class Rewrite(_Frozen):
    """A change the export made to the function the model computes, so that a target can run it: stated, and judged
    by the fidelity check like quantization is."""

    operator: str  # the torch operator replaced, e.g. "aten.gelu"
    replacement: str  # what computes in its place
    reason: str
    count: int = Field(default=1, ge=1)  # how many of them


class LayerFidelity(_Frozen):
    """How far one torch layer's output in the deployed model is from the float model's (``quantization.layers``).

    Accumulated: the layer computes from the deployed model's own inputs, so its figures include what every layer
    before it lost. ``sqnr_db`` is the whole tensor's, ``channel_sqnr_db`` its worst channel's (axis 1): an outlier
    channel that takes the quantization range crushes the others, which the whole tensor's SQNR hides.
    ``added_sqnr_db`` is the SQNR of the noise the layer adds itself: its worst channel's relative noise less the
    largest of the layers it computes from (None: it adds none, or the signal was already lost in one of them:
    worst-channel SQNR under 3 dB). The lowest names the layer that lost accuracy.
    ``None`` SQNRs: no difference at all; -999: the float values are all zero and the deployed ones not."""

    module: str  # the torch module's path in the model, e.g. "features.2"
    operator: str  # its class, e.g. "Conv2d"
    shape: tuple[int, ...]  # the float model's output shape
    sqnr_db: float | None
    channel_sqnr_db: float | None = None
    cosine: float = Field(ge=-1.0, le=1.0)
    added_sqnr_db: float | None = None
    isolated_sqnr_db: float | None = None
    """The SQNR of its worst channel computed from the float model's values at its inputs: its own quantization
    alone, where the runtime lets edgeline cut the model there (ONNX Runtime's QDQ models); None elsewhere."""


class KeptFloat(_Frozen):
    """A layer left in float in an int8 model, because int8 missed the accuracy budget (``quantization.kept_float``)."""

    module: str  # e.g. "features.2"
    operator: str  # e.g. "Conv2d"
    added_bytes: int = Field(ge=0)  # its weights in float rather than int8: 3 bytes more per parameter (float32)
    precision: Literal["float32", "float16"] = "float32"
    """What it computes in: float16 on Qualcomm's HTP, which computes float operators in fp16 (onnxruntime's QNN
    provider, ``enable_htp_fp16_precision``)."""
    accelerator_macs_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """The share of the model's multiply-accumulates it takes off the accelerator; None: the target has none."""
    reason: str  # why this layer: its output's rank by the noise int8 adds, or that it reads such an output


def worst_layers(layers: tuple[LayerFidelity, ...], count: int = 5) -> list[LayerFidelity]:
    """The layers that added the most noise (the lowest ``added_sqnr_db``), worst first."""
    adding = [layer for layer in layers if layer.added_sqnr_db is not None]
    return sorted(adding, key=lambda layer: (layer.added_sqnr_db, layer.module))[:count]


class QuantizationSummary(_Frozen):
    """What quantizing the model changed beyond the numbers' precision, and where it lost accuracy."""

    rewrites: tuple[Rewrite, ...] = ()
    layers: tuple[LayerFidelity, ...] = ()
    """Per torch layer, in execution order: the deployed model against the float model on ``layers_samples``
    validation samples, read with ``layers_measured_with``; none, and why in ``layers_unknown``, where they were
    not measured."""
    kept_float: tuple[KeptFloat, ...] = ()
    """Mixed precision: the layers left in float, in the order they were chosen."""
    int8_missed: str | None = None
    """With ``kept_float``: the budget the model missed with every layer int8."""
    activation_ranges: str | None = None
    """How the activations' int8 ranges were chosen, where the exporter chose among several ways (OpenVINO: NNCF's
    estimator whose outputs on the calibration samples were nearest the float model's, with each one's error)."""
    layers_samples: int = Field(default=0, ge=0)
    layers_measured_with: str | None = None
    layers_unknown: str | None = None


class Manifest(_Frozen):
    schema_version: Literal[1] = 1
    name: str = Field(pattern=NAME_PATTERN)
    version: int = Field(ge=1)
    created: str
    profile: str
    backend: str
    precision: str
    model: str
    threads: int = Field(default=1, ge=1)
    files: tuple[FileEntry, ...]
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    postprocess: Postprocess = Postprocess()
    preprocess: Preprocess | None = None
    image: ImagePreprocess | None = None
    """How a camera frame or an image becomes input 0 (an image model's); None: not an image model."""
    window: Window | None = None
    fidelity: Fidelity
    golden: Golden | None = None
    budgets: Budgets
    """The profile's budgets (one class with the profiles'), so the device can check its own share (latency)."""
    runtime: RuntimeRequirement
    placement: Placement | None = None
    estimates: Estimates | None = None
    memory: Memory | None = None
    firmware: Firmware | None = None
    device: Device | None = None
    quantization: QuantizationSummary | None = None
    export: dict[str, str] = Field(default_factory=dict)

    @property
    def model_entries(self) -> tuple[FileEntry, ...]:
        """The files of the model: one, or every file inside a directory model (a Core ML .mlpackage)."""
        return tuple(e for e in self.files if e.path == self.model or e.path.startswith(f"{self.model}/"))

    @model_validator(mode="after")
    def _files_cover_model(self) -> Manifest:
        listed = {entry.path for entry in self.files}
        if len(listed) != len(self.files):
            raise ValueError("files lists a path twice")
        # A directory model (a Core ML .mlpackage) is covered by the files listed inside it.
        missing = [self.model] if not self.model_entries else []
        if self.golden is not None and self.golden.path not in listed:
            missing.append(self.golden.path)
        if missing:
            raise ValueError(f"files does not cover {', '.join(missing)}")
        if self.postprocess.labels is not None and self.postprocess.kind == "classify":
            classes = self.outputs[0].shape[-1] if self.outputs[0].shape else 1  # a scalar output: one score
            if len(self.postprocess.labels) != classes:
                raise ValueError(
                    f"postprocess.labels has {len(self.postprocess.labels)} labels but output 0 has {classes} classes"
                )
        detection = self.postprocess.detection
        if detection is not None:
            labels = self.postprocess.labels
            try:
                check_output(detection.as_head(), self.outputs[0].shape, None if labels is None else len(labels))
            except EdgelineError as exc:
                raise ValueError(f"postprocess.detection: {exc}") from None
        if self.image is not None:
            spec = self.inputs[0]
            try:
                channels, height, width = image_axes(spec.shape, self.image.layout)
            except ValueError as exc:
                raise ValueError(f"image: input 0 ({spec.name}) {exc}") from None
            if (height, width) != self.image.size or channels != self.image.channels:
                raise ValueError(
                    f"image: size {self.image.size[0]}x{self.image.size[1]} {self.image.color} does not fit input 0 "
                    f"({spec.name}) of shape {list(spec.shape)}, {channels} channel(s) of {height}x{width}"
                )
        return self
