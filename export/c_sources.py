"""A microcontroller bundle's C sources (``c/``): what a firmware compiles the bundle in from.

``model_data.c`` holds the bundle's model file as a 16-byte aligned array in its own section (TFLite Micro reads the
flatbuffer in place, and a linker script can put the section where it wants, in flash), and the golden samples as
arrays for an on-board self-test; ``model_data.h`` declares them and states what a firmware must otherwise guess:
the tensors' shapes, types and quantization, the labels, and the tensor arena to reserve.

The arena is TFLite Micro's, measured at export on the model array's own file, plus a margin (``ARENA_MARGIN``);
where TFLite Micro cannot run that file here (a vela model's ``ethos-u`` operator needs the NPU's driver) it is
vela's SRAM figure plus the same margin, and the header and the manifest say it is an estimate. Never a number
made up here.
"""

from __future__ import annotations

import math
import platform
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from edgeline.export.errors import ExportError
from edgeline.manifest import Firmware, Manifest, TensorSpec
from edgeline.quantization import quantize
from edgeline.samples import read_npz

__all__ = [
    "ARENA_MARGIN",
    "C_SOURCES",
    "GOLDEN_C_SAMPLES",
    "MODEL_ARRAY",
    "MODEL_HEADER",
    "MODEL_SECTION",
    "MODEL_SOURCE",
    "ArenaBasis",
    "arena_basis",
    "arena_with_margin",
    "render_c_sources",
    "write_c_sources",
]

C_SOURCES = "c"
MODEL_SOURCE = "model_data.c"
MODEL_HEADER = "model_data.h"
MODEL_ARRAY = "edgeline_model"
MODEL_SECTION = ".edgeline_model"
GOLDEN_C_SAMPLES = 4
"""A self-test, not a fidelity check: a few samples keep the firmware's flash for the model."""

ALIGNMENT = 16
"""TFLite Micro aligns the tensors it places in the arena, and the buffers it reads from the flatbuffer, to 16 bytes."""
ARENA_MARGIN_PERCENT = 10
ARENA_MARGIN_FIXED = 2048
ARENA_MARGIN = f"+{ARENA_MARGIN_PERCENT}%, rounded up to {ALIGNMENT} B, +{ARENA_MARGIN_FIXED} B"
"""Why a margin at all: the figure is taken with TFLite Micro's reference kernels on a 64-bit host. On the board,
CMSIS-NN's optimized kernels ask for scratch buffers the reference kernels do not (a convolution's im2col rows:
they grow with the layer, hence a share), and the firmware's own build may register or allocate a little more
than this host's (a fixed amount, which also covers the arena's start being aligned, and the bookkeeping a vela
estimate does not count). The host's 64-bit pointers make its bookkeeping larger than a Cortex-M's, never smaller.
It is an allowance, not a proof: the on-board self-test is, and TFLite Micro's AllocateTensors names the bytes
missing when it is short."""

_C_TYPES: dict[str, tuple[str, str]] = {
    "int8": ("int8_t", "kTfLiteInt8"),
    "uint8": ("uint8_t", "kTfLiteUInt8"),
    "int16": ("int16_t", "kTfLiteInt16"),
    "int32": ("int32_t", "kTfLiteInt32"),
    "int64": ("int64_t", "kTfLiteInt64"),
    "float32": ("float", "kTfLiteFloat32"),
}
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_PER_LINE = 16


@dataclass(frozen=True)
class ArenaBasis:
    """The arena figure the header's ``EDGELINE_ARENA_BYTES`` grows from, and what measured or estimated it."""

    size: int
    kind: Literal["measured", "estimated"]
    taken_with: str


def arena_with_margin(basis: int) -> int:
    """``basis`` plus ``ARENA_MARGIN``, in integers (no float rounding): a multiple of 16."""
    grown = -(-basis * (100 + ARENA_MARGIN_PERCENT) // 100)
    return -(-grown // ALIGNMENT) * ALIGNMENT + ARENA_MARGIN_FIXED


def arena_basis(manifest: Manifest, measured_file: str) -> ArenaBasis:
    """TFLite Micro's arena when it was measured on the model array's own file (``measured_file`` is the file the
    export ran), else the compiler's SRAM estimate for it; an ``ExportError`` naming both when there is neither."""
    memory = manifest.memory
    if measured_file == manifest.model and memory is not None and memory.arena_bytes is not None:
        host = f"{platform.machine()} ({platform.system()})"
        version = manifest.export.get("tflite-micro", "")
        return ArenaBasis(
            memory.arena_bytes,
            "measured",
            f"TFLite Micro {version} on {host}: the arena its recording allocator reported for {manifest.model} "
            "loaded and run once",
        )
    estimates = manifest.estimates
    if measured_file != manifest.model and estimates is not None and estimates.sram_bytes is not None:
        return ArenaBasis(
            estimates.sram_bytes,
            "estimated",
            f"{estimates.tool}'s SRAM estimate for {manifest.model} ({estimates.target}): TFLite Micro cannot run "
            f"its operators here, so the arena is not measured",
        )
    why = (memory.unknown.get("arena_bytes") if memory else None) or "not measured"
    raise ExportError(
        f"C sources for {manifest.model}: no tensor arena to reserve: TFLite Micro's arena for {measured_file} is "
        f"{why}, and no compiler estimated one for {manifest.model}"
    )


def write_c_sources(bundle_dir: Path, manifest: Manifest, measured_file: str) -> Firmware:
    """Write ``C_SOURCES/`` into the bundle at ``bundle_dir`` (its model file and golden.npz, as ``manifest``
    lists them) and give the manifest's ``firmware``."""
    basis = arena_basis(manifest, measured_file)
    model = (bundle_dir / manifest.model).read_bytes()
    golden = read_npz(bundle_dir / manifest.golden.path, "golden") if manifest.golden else {}
    folder = bundle_dir / C_SOURCES
    folder.mkdir(exist_ok=True)
    for name, text in render_c_sources(model, manifest, golden, basis).items():
        (folder / name).write_text(text, encoding="utf-8")
    return Firmware(
        sources=C_SOURCES,
        model_bytes=len(model),
        arena_bytes=arena_with_margin(basis.size),
        arena_basis=basis.kind,
        arena_basis_bytes=basis.size,
        arena_basis_with=basis.taken_with,
        arena_margin=ARENA_MARGIN,
    )


def render_c_sources(
    model: bytes, manifest: Manifest, golden: Mapping[str, np.ndarray], basis: ArenaBasis
) -> dict[str, str]:
    """The C files' texts, by file name: a pure function of the bundle's model bytes, manifest and golden arrays."""
    for spec in (*manifest.inputs, *manifest.outputs):
        if spec.dtype not in _C_TYPES:
            raise ExportError(
                f"C sources: tensor {spec.name} is {spec.dtype}, which the header cannot type; "
                f"valid: {', '.join(_C_TYPES)}"
            )
    samples = min(GOLDEN_C_SAMPLES, manifest.golden.samples) if manifest.golden and golden else 0
    labels = _labels(manifest)
    header, source = _banner(manifest, len(model)), _banner(manifest, len(model))
    header += "#ifndef EDGELINE_MODEL_DATA_H\n#define EDGELINE_MODEL_DATA_H\n\n#include <stdint.h>\n\n"
    header += '#ifdef __cplusplus\nextern "C" {\n#endif\n\n'
    header += f"#define EDGELINE_MODEL_BYTES {len(model)}u\nextern const unsigned char {MODEL_ARRAY}[];\n"
    header += f"extern const unsigned int {MODEL_ARRAY}_len;\n\n"
    header += _arena(basis) + _tensors("INPUT", manifest.inputs) + _tensors("OUTPUT", manifest.outputs)
    header += _postprocess(manifest, labels)
    source += f'#include <math.h>\n#include <stdalign.h>\n#include <stdint.h>\n\n#include "{MODEL_HEADER}"\n\n'
    source += f"alignas({ALIGNMENT}) const unsigned char {MODEL_ARRAY}[]"
    source += f' __attribute__((section("{MODEL_SECTION}"))) = {{\n'
    source += _hex_rows(model) + f"}};\nconst unsigned int {MODEL_ARRAY}_len = {len(model)}u;\n"
    if labels:
        source += "\nconst char *const edgeline_labels[EDGELINE_LABEL_COUNT] = {\n"
        source += "".join(f"    {_c_string(label)},\n" for label in labels) + "};\n"
    if samples:
        header += _golden_declarations(manifest, samples)
        source += _golden_arrays(manifest, golden, samples)
    header += "\n#ifdef __cplusplus\n}\n#endif\n\n#endif /* EDGELINE_MODEL_DATA_H */\n"
    return {MODEL_HEADER: header, MODEL_SOURCE: source}


def _banner(manifest: Manifest, size: int) -> str:
    model = next(e for e in manifest.files if e.path == manifest.model)
    made = f"{manifest.name} version {manifest.version} for the {manifest.profile} profile"
    text = (
        f"Bundle {made} ({manifest.backend}, {manifest.precision}), generated by edgeline export from "
        f"{manifest.model} ({size} bytes, sha256 {model.sha256}). Export again rather than edit."
    )
    return _block_comment(text) + "\n"


def _arena(basis: ArenaBasis) -> str:
    if basis.kind == "measured":
        what, covers = "measured at export", "what the board's kernels (CMSIS-NN's scratch buffers) and build add"
    else:
        what, covers = "ESTIMATED, not measured", "TFLite Micro's own allocations, which the estimate does not count"
    return _block_comment(
        f"Tensor arena to reserve, {ALIGNMENT}-byte aligned: {basis.size} B {what} ({basis.taken_with}), plus a "
        f"margin of {ARENA_MARGIN} for {covers}. The self-test (the golden samples) shows it suffices."
    ) + (
        f"#define EDGELINE_ARENA_BYTES {arena_with_margin(basis.size)}u\n"
        f"#define EDGELINE_ARENA_BASIS_BYTES {basis.size}u\n"
        f"#define EDGELINE_ARENA_MEASURED {int(basis.kind == 'measured')}\n\n"
    )


def _tensors(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    text = f"/* {kind.lower()}s as the model sees them; quantized: real = (q - ZERO_POINT) * SCALE */\n"
    text += f"#define EDGELINE_{kind}_COUNT {len(specs)}\n"
    for index, spec in enumerate(specs):
        c_type, tflite_type = _C_TYPES[spec.dtype]
        name = f"EDGELINE_{kind}_{index}"
        text += f"#define {name}_NAME {_c_string(spec.name)}\n"
        text += f"#define {name}_TYPE {c_type}\n#define {name}_TFLITE_TYPE {tflite_type}\n"
        text += f"#define {name}_RANK {len(spec.shape)}\n"
        text += f"#define {name}_SHAPE {{{', '.join(map(str, spec.shape))}}}\n"
        text += f"#define {name}_ELEMENTS {spec.size}\n"
        if spec.quantization is None:
            text += f"#define {name}_QUANTIZED 0\n"
        else:
            text += f"#define {name}_QUANTIZED 1\n#define {name}_SCALE {_c_float(spec.quantization.scale)}\n"
            text += f"#define {name}_ZERO_POINT ({spec.quantization.zero_point})\n"
    return text + "\n"


def _labels(manifest: Manifest) -> list[str]:
    """A classifier's labels: the manifest's, else each class's index as edgeline's answers name it ("3")."""
    post = manifest.postprocess
    if post.kind != "classify":
        return []
    return list(post.labels) if post.labels else [str(i) for i in range(manifest.outputs[0].shape[-1])]


def _postprocess(manifest: Manifest, labels: list[str]) -> str:
    post, pre = manifest.postprocess, manifest.preprocess
    text = f"/* How edgeline reads the outputs: {post.kind}. */\n#define EDGELINE_TASK {_c_string(post.kind)}\n"
    text += f"#define EDGELINE_LABEL_COUNT {len(labels)}\n"
    if labels:
        text += "extern const char *const edgeline_labels[EDGELINE_LABEL_COUNT];\n"
    if post.threshold is not None:
        text += f"#define EDGELINE_ANOMALY_THRESHOLD {_c_float(post.threshold)}\n"
    if pre is not None:
        text += "/* Inputs are x * SCALE + OFFSET before quantizing. */\n"
        text += f"#define EDGELINE_PREPROCESS_SCALE {_c_float(pre.scale)}\n"
        text += f"#define EDGELINE_PREPROCESS_OFFSET {_c_float(pre.offset)}\n"
    return text + "\n"


def _golden_declarations(manifest: Manifest, samples: int) -> str:
    text = (
        f"/* Self-test: {samples} golden samples of golden.npz. Inputs as the input tensors take them (preprocessed,\n"
        " * quantized); outputs as export's run of the bundle gave them, as the output tensors hold them. The board's\n"
        " * outputs must be within TOLERANCE of them (quantization steps, or real units for a float output). */\n"
        f"#define EDGELINE_GOLDEN_SAMPLES {samples}\n"
    )
    for kind, specs in (("input", manifest.inputs), ("output", manifest.outputs)):
        for index, spec in enumerate(specs):
            elements = f"EDGELINE_{kind.upper()}_{index}_ELEMENTS"
            text += f"extern const {_C_TYPES[spec.dtype][0]} edgeline_golden_{kind}_{index}"
            text += f"[EDGELINE_GOLDEN_SAMPLES][{elements}];\n"
    assert manifest.golden is not None
    for index, spec in enumerate(manifest.outputs):
        atol = manifest.golden.atol[index] if index < len(manifest.golden.atol) else 0.0
        if spec.quantization is not None and spec.dtype != "float32":
            tolerance = str(math.ceil(atol / spec.quantization.scale - 1e-6))
        else:
            tolerance = _c_float(atol)
        text += f"#define EDGELINE_GOLDEN_OUTPUT_{index}_TOLERANCE {tolerance}\n"
    return text


def _golden_arrays(manifest: Manifest, golden: Mapping[str, np.ndarray], samples: int) -> str:
    text = ""
    for kind, specs in (("input", manifest.inputs), ("output", manifest.outputs)):
        for index, spec in enumerate(specs):
            values = np.asarray(golden[f"{kind}_{index}"][:samples], dtype=np.float32).reshape(samples, spec.size)
            native = _as_model_sees(values, spec, manifest if kind == "input" else None)
            rows = [_wrapped([_c_value(v, spec.dtype) for v in row.tolist()], "        ") for row in native]
            text += f"\nconst {_C_TYPES[spec.dtype][0]} edgeline_golden_{kind}_{index}"
            text += f"[EDGELINE_GOLDEN_SAMPLES][EDGELINE_{kind.upper()}_{index}_ELEMENTS] = {{\n"
            text += "".join(f"    {{\n{row}    }},\n" for row in rows) + "};\n"
    return text


def _as_model_sees(values: np.ndarray, spec: TensorSpec, preprocessed_by: Manifest | None) -> np.ndarray:
    """Float golden values as the tensor holds them: an input preprocessed, then quantized as the runtime does at the
    model's edge; an output, dequantized when golden.npz was written, quantized back (exactly: it was on the grid)."""
    pre = preprocessed_by.preprocess if preprocessed_by is not None else None
    if pre is not None:
        values = values * np.float32(pre.scale) + np.float32(pre.offset)
    if spec.quantization is not None and spec.dtype != "float32":
        return quantize(values, spec.quantization, np.dtype(spec.dtype))
    return values.astype(np.dtype(spec.dtype))


def _hex_rows(data: bytes) -> str:
    """``    0x1c, 0x00, ...`` lines of 16 bytes, built as one array of characters: a model of megabytes takes
    milliseconds, where formatting byte by byte in Python takes seconds."""
    values = np.frombuffer(data, dtype=np.uint8)
    rows = -(-values.size // _PER_LINE)
    padded = np.zeros(rows * _PER_LINE, dtype=np.uint8)
    padded[: values.size] = values
    cells = np.empty((rows * _PER_LINE, 6), dtype=np.uint8)
    cells[:, 0], cells[:, 1] = ord("0"), ord("x")
    cells[:, 2] = _HEX_DIGITS[padded >> 4]
    cells[:, 3] = _HEX_DIGITS[padded & 0x0F]
    cells[:, 4], cells[:, 5] = ord(","), ord(" ")
    lines = np.full((rows, 4 + _PER_LINE * 6), ord(" "), dtype=np.uint8)
    lines[:, 4:] = cells.reshape(rows, -1)
    lines[:, -1] = ord("\n")
    last = lines[-1, : 4 + 6 * (values.size - (rows - 1) * _PER_LINE)].copy()  # the last line: its bytes only
    last[-1] = ord("\n")
    return (lines[:-1].tobytes() + last.tobytes()).decode("ascii")


def _wrapped(values: list[str], indent: str) -> str:
    lines = [", ".join(values[i : i + _PER_LINE]) for i in range(0, len(values), _PER_LINE)]
    return "".join(f"{indent}{line},\n" for line in lines)


def _c_value(value: float, dtype: str) -> str:
    return _c_float(value) if dtype == "float32" else str(int(value))


def _c_float(value: float) -> str:
    """A float literal that reads back as the same float32 (9 significant digits)."""
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = format(float(np.float32(value)), ".9g")
    return f"{text}{'' if any(c in text for c in '.e') else '.0'}f"


def _c_string(text: str) -> str:
    """A C string literal of ``text`` in UTF-8: printable ASCII as it is, everything else (and the quote, backslash
    and question mark, which trigraphs read) as octal escapes, which never run into the next character."""
    out = []
    for byte in text.encode("utf-8"):
        char = chr(byte)
        out.append(char if 32 <= byte < 127 and char not in '"\\?' else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _block_comment(text: str) -> str:
    """``text`` as a C comment wrapped to 116 columns (a ``*/`` inside it cannot end the comment early)."""
    lines = textwrap.wrap(text.replace("*/", "* /"), width=113, break_long_words=False, break_on_hyphens=False)
    return "/* " + "\n * ".join(lines) + " */\n"
