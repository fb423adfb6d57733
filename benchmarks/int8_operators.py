"""Which operators run in int8, per activation and per target (issue 53): an activation zoo and a LayerNorm model.

The zoo is one small CNN on sklearn's 8x8 digits (two convolutions, a hidden Linear, a Linear head), built with each of
twelve activations after each of its three hidden layers; the LayerNorm model is the same CNN with ReLU and a LayerNorm
before each activation (over the channels after each convolution, as ConvNeXt writes it: permute, normalise the last
dimension, permute back; over the 32 features after the hidden Linear). Each is trained here, deterministically
(``torch.manual_seed(0)``, one thread, 20 epochs of Adam on the first 1,400 digits: a few seconds each, made once per
version of the code by tests/cache.py), then exported once per target with the product's own pipeline
(``run_export``, as ``edgeline export MODEL --profile P --backend B --precision int8-static --no-mixed-precision``
runs it: plain int8, so that the table shows what int8 does; mixed precision would move layers back to float),
calibrated on the first 64 training digits and validated on the 397 held-out digits:

    rpi5            litert int8-static
    cortex-m4       tflite-micro int8-static
    ethos-u55-128   ethos-u int8-static (a microcontroller: TFLite Micro runs what vela leaves to the CPU)
    imx93           ethos-u int8-static (Linux: LiteRT runs what vela leaves to the CPU)
    rpi5            executorch-xnnpack int8-static
    x86-64          openvino int8-static

Per row, from what the export reported (the bundle's manifest: ``placement``, ``fidelity``): the operators computing in
int8 of all operators, the operators left in float by name (for the Ethos-U, read from the int8 model vela compiled),
for the Ethos-U the number of ``ethos-u`` custom operators in vela's model (the NPU's pieces) and the operators vela
left to the CPU, the held-out accuracy of the float model and of the bundle, and whether the profile's budgets
selected the export or why not. An export that fails is a row with its error. A rejected export's folder is removed
with its vela model: the script keeps a copy of each vela model the ethos-u exporter writes, to count its pieces.

    python benchmarks/int8_operators.py --write benchmarks/results/int8_operators.md
    python benchmarks/int8_operators.py --models relu,prelu --targets rpi5-litert,ethos-u55-128   # a part
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table, publish

from edgeline.manifest import percent
from tests.cache import cached

TRAIN = 1400  # the digits before are trained on (the first CALIBRATION calibrate); those after are held out
CALIBRATION = 64
EPOCHS = 20
ACTIVATIONS = ("relu", "prelu", "elu", "selu", "mish", "softplus", "gelu", "silu", "hardswish", "leaky_relu", "tanh",
               "sigmoid")  # fmt: skip
MODELS = (*ACTIVATIONS, "layernorm")
TARGETS = (
    ("rpi5", "litert"), ("cortex-m4", "tflite-micro"), ("ethos-u55-128", "ethos-u"), ("imx93", "ethos-u"),
    ("rpi5", "executorch-xnnpack"), ("x86-64", "openvino"),
)  # fmt: skip
"""(bundled profile, backend), each exported as int8-static: the profile that lists the backend, as a user picks it."""

SOURCE = """\
from pathlib import Path

import torch
from torch import nn

ACTIVATIONS = {
    "relu": nn.ReLU, "prelu": nn.PReLU, "elu": nn.ELU, "selu": nn.SELU, "mish": nn.Mish, "softplus": nn.Softplus,
    "gelu": nn.GELU, "silu": nn.SiLU, "hardswish": nn.Hardswish, "leaky_relu": nn.LeakyReLU, "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
}


class ChannelNorm(nn.Module):
    \"\"\"LayerNorm over the channels of an NCHW tensor, as ConvNeXt writes it.\"\"\"

    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ZooCNN(nn.Module):
    def __init__(self, activation, norm=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.norm1 = ChannelNorm(8) if norm else nn.Identity()
        self.act1 = ACTIVATIONS[activation]()
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.norm2 = ChannelNorm(16) if norm else nn.Identity()
        self.act2 = ACTIVATIONS[activation]()
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.norm3 = nn.LayerNorm(32) if norm else nn.Identity()
        self.act3 = ACTIVATIONS[activation]()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = x / 16.0
        x = self.act1(self.norm1(self.conv1(x)))
        x = self.act2(self.norm2(self.conv2(x)))
        x = self.act3(self.norm3(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


def build(name):
    model = ZooCNN("relu", norm=True) if name == "layernorm" else ZooCNN(name)
    weights = Path(__file__).with_name(f"{name}.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()


""" + "".join(f"def {name}():\n    return build({name!r})\n\n\n" for name in MODELS)


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32)[:, None], data.target.astype(np.int64)


def trained_models() -> Path:
    """The zoo's source file, each model's trained weights beside it (``<name>.pt``): made once for this code
    (tests/cache.py)."""
    images, labels = digits()

    def make(directory: Path) -> None:
        import torch

        from edgeline.export.loading import load_model

        source = directory / "zoo.py"
        source.write_text(SOURCE, encoding="utf-8")
        x, y = torch.from_numpy(images[:TRAIN]), torch.from_numpy(labels[:TRAIN])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # batches this small train faster on one thread of a shared machine
        try:
            for name in MODELS:
                torch.manual_seed(0)
                module = load_model(f"{source}:{name}").module
                optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
                module.train()
                for _ in range(EPOCHS):
                    for start in range(0, len(x), 64):
                        optimizer.zero_grad()
                        loss = torch.nn.functional.cross_entropy(module(x[start : start + 64]), y[start : start + 64])
                        loss.backward()
                        optimizer.step()
                torch.save(module.state_dict(), directory / f"{name}.pt")
        finally:
            torch.set_num_threads(threads)

    data = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    inputs = [SOURCE, TRAIN, EPOCHS, data, inspect.getsource(trained_models), inspect.getsource(digits)]
    return cached("trained", inputs, make) / "zoo.py"


# -- one row per (model, target) ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One export's figures; None where the export did not get that far."""

    model: str
    profile: str
    backend: str
    verdict: str
    """selected, or rejected / failed with the first clause of the reason."""
    ops: int | None = None
    quantized_ops: int | None = None
    quantized_work: float | None = None
    """The share of the model's multiply-accumulates computed in int8 (what the share budgets judge)."""
    left_float: dict[str, int] | None = None
    npu_pieces: int | None = None
    npu_work: float | None = None
    """The share of the multiply-accumulates vela placed on the NPU (what ``min_accelerator_share`` judges)."""
    left_to_cpu: dict[str, int] | None = None
    accuracy_float: float | None = None
    accuracy: float | None = None


def counted(operators: dict[str, int] | None) -> str:
    """``{"MUL": 2, "SUB": 1}`` as ``MUL x2, SUB``; ``none`` for none, ``-`` for unknown."""
    if operators is None:
        return "-"
    if not operators:
        return "none"
    return ", ".join(f"{name} x{count}" if count > 1 else name for name, count in sorted(operators.items()))


def short_reason(status: str, reason: str | None, backend: str, limit: int = 160) -> str:
    """``status``, with the first clause of ``reason`` (up to ``limit`` characters, without the ``backend`` the
    target column names) after a colon."""
    if not reason:
        return status
    first = reason.strip().splitlines()[0]
    depth = 0
    for index, char in enumerate(first):  # the first "; " outside parentheses ends the first clause
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and first.startswith("; ", index):
            first = first[:index]
            break
    first = first.removeprefix(f"{backend}: ").removeprefix(f"{backend} ")
    if len(first) > limit:
        first = first[: limit - 1].rstrip() + "…"
    return f"{status}: {first}"


HEADER = ("model", "target", "int8 ops / all", "int8 work", "left float", "NPU pieces", "vela left to the CPU",
          "accuracy float → bundle", "export")  # fmt: skip


def cells(row: Row, ethos_u: bool) -> tuple[str, ...]:
    """The table's cells for ``row`` (``ethos_u``: the NPU columns apply)."""
    share = "-" if row.ops is None or row.quantized_ops is None else f"{row.quantized_ops}/{row.ops}"
    if row.accuracy is None or row.accuracy_float is None:
        accuracy = "-"
    else:
        accuracy = f"{row.accuracy_float:.1%} → {row.accuracy:.1%}"
    work = "-" if row.quantized_work is None else percent(row.quantized_work)
    pieces = "-" if not ethos_u or row.npu_pieces is None else str(row.npu_pieces)
    if ethos_u and row.npu_work is not None:
        pieces += f" ({percent(row.npu_work)} of the work)"
    cpu = counted(row.left_to_cpu) if ethos_u else "-"
    return (row.model, f"{row.profile} {row.backend}", share, work, counted(row.left_float), pieces, cpu, accuracy,
            row.verdict)  # fmt: skip


@contextlib.contextmanager
def vela_models_kept(folder: Path) -> Iterator[None]:
    """Copy the int8 model and the vela model of every ethos-u export into ``folder`` as it ends: a rejected
    target's folder is removed with them, and its NPU pieces are counted from its vela model (also when the export
    failed after vela, e.g. on an operator TFLite Micro lacks). Observes only: the export is unchanged."""
    from edgeline.backends.ethos_u import CPU_MODEL
    from edgeline.export.backends.ethos_u import MODEL_FILE, EthosUExporter

    original = EthosUExporter.export

    def export(self: Any, request: Any) -> Any:
        try:
            return original(self, request)
        finally:
            for name in (MODEL_FILE, CPU_MODEL):
                if (request.out_dir / name).is_file():
                    shutil.copy2(request.out_dir / name, folder / name)

    EthosUExporter.export = export  # type: ignore[method-assign]
    try:
        yield
    finally:
        EthosUExporter.export = original  # type: ignore[method-assign]


def ethos_u_figures(folder: Path) -> tuple[int | None, dict[str, int] | None, dict[str, int] | None]:
    """From the models kept in ``folder``: the ``ethos-u`` operators in the vela model, the operators it leaves to
    the CPU, and the int8 model's operators left float (None: not written)."""
    from collections import Counter

    from ai_edge_litert.interpreter import Interpreter

    from edgeline.backends.ethos_u import CPU_MODEL, ETHOS_U, operator_names
    from edgeline.device_profiles import Precision
    from edgeline.export.backends.ethos_u import MODEL_FILE
    from edgeline.export.placement import TFLITE_CONVERSIONS, tflite_records

    vela, int8 = folder / MODEL_FILE, folder / CPU_MODEL
    if not vela.is_file() or not int8.is_file():
        return None, None, None
    operators = operator_names(vela)
    on_cpu = Counter(op for op in operators if op != ETHOS_U and op not in TFLITE_CONVERSIONS)
    records = tflite_records(Interpreter(model_path=str(int8)), Precision.INT8_STATIC)
    return operators.count(ETHOS_U), dict(on_cpu), dict(Counter(r.name for r in records if not r.quantized))


def export_row(source: Path, model: str, profile: str, backend: str, samples: tuple[Path, Path], work: Path) -> Row:
    """``model`` exported for ``profile`` by ``backend`` at int8-static, plain int8: its row."""
    from edgeline.device_profiles import Precision
    from edgeline.export.pipeline import ExportOptions, run_export

    kept = work / "kept"
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    options = ExportOptions(
        model=f"{source}:{model}", profile=profile, calibration=samples[0], validation=samples[1], backend=backend,
        precision=Precision.INT8_STATIC, out=work / "bundle", force=True, mixed_precision=False,
    )  # fmt: skip
    report = None
    error = None
    started = time.perf_counter()
    try:
        with vela_models_kept(kept):
            report = run_export(options)
    except Exception as exc:  # a rejected or failing export is a row with its reason, not the end of the run
        report = getattr(exc, "report", None)
        error = str(exc).strip() or type(exc).__name__
    outcome = report.outcomes[0] if report is not None and report.outcomes else None
    if outcome is None:
        row = Row(model, profile, backend, short_reason("failed", error, backend))
    else:
        verdict = "selected" if outcome.status in ("selected", "passed") else outcome.status
        row = Row(model, profile, backend, short_reason(verdict, outcome.reason or error, backend))
        placement, fidelity = outcome.placement, outcome.fidelity
        if placement is not None:
            row.ops, row.quantized_ops = placement.ops, placement.quantized_ops
            row.quantized_work = placement.quantized_macs_share
            row.left_float = dict(placement.fallback)
            if placement.accelerator == "ethos-u":
                row.left_to_cpu = dict(placement.fallback)
                row.npu_work = placement.accelerator_macs_share
        if fidelity is not None:
            row.accuracy, row.accuracy_float = fidelity.accuracy, fidelity.accuracy_float
    if backend == "ethos-u":
        # the float operators are the int8 model's (the placement's fallback is what vela left to the CPU)
        row.npu_pieces, on_cpu, row.left_float = ethos_u_figures(kept)
        row.left_to_cpu = row.left_to_cpu if row.left_to_cpu is not None else on_cpu
    print(f"[{time.strftime('%H:%M:%S')}] {model} {profile} {backend}: {row.verdict} "
          f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    return row


def _chosen(text: str | None, known: Sequence[str], what: str) -> list[str]:
    if text is None:
        return list(known)
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"--{what}: unknown {', '.join(unknown)}; valid: {', '.join(known)}")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    names = [f"{p}-{b}" if p == "rpi5" else p for p, b in TARGETS]
    parser.add_argument("--targets", help=f"comma-separated, of {', '.join(names)} (default: all)")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    models = _chosen(args.models, MODELS, "models")
    targets = [TARGETS[names.index(name)] for name in _chosen(args.targets, names, "targets")]
    import torch

    torch.set_num_threads(1)
    source = trained_models()
    images, labels = digits()
    rows = [HEADER]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="int8-operators-") as scratch:
        work = Path(scratch)
        samples = (work / "calibration.npz", work / "validation.npz")
        np.savez(samples[0], x=images[:CALIBRATION])
        np.savez(samples[1], x=images[TRAIN:], labels=labels[TRAIN:])
        for model in models:
            for profile, backend in targets:
                row = export_row(source, model, profile, backend, samples, work)
                rows.append(cells(row, ethos_u=backend == "ethos-u"))
    minutes = (time.perf_counter() - started) / 60
    publish(
        markdown_table(rows),
        script=__file__,
        title="int8 operators per activation and target: an activation zoo and a LayerNorm model",
        intro=f"One CNN on sklearn's 8x8 digits (conv 1→8, conv 8→16 stride 2, Linear 256→32, Linear 32→10), with "
        "each activation after each of its three hidden layers; `layernorm` is the ReLU one with a LayerNorm before "
        "each activation (over the channels after each convolution, permuted as ConvNeXt does; over the 32 features "
        f"after the hidden Linear). Trained here (seed 0, {EPOCHS} epochs on the first {TRAIN} digits); each "
        "exported once per target, `--backend B --precision int8-static --no-mixed-precision` on the profile named "
        f"(plain int8: mixed precision would move layers to float), calibrated on {CALIBRATION} training digits, "
        f"accuracy on the {len(images) - TRAIN} held-out digits (the manifest's fidelity: float model → bundle). "
        "`int8 ops / all`, `int8 work` (the share of the multiply-accumulates in int8, which the profiles' "
        "`min_quantized_share` judges) and `left float`: the manifest's placement (ExecuTorch: its fallback, which "
        "also names what XNNPACK does not take; Ethos-U: the float operators of the int8 model vela compiled). "
        "`NPU pieces`: "
        "the `ethos-u` custom operators in vela's model (1: the NPU runs the graph in one piece), and the share of the "
        "multiply-accumulates on the NPU (what `min_accelerator_share` judges); `vela left to the "
        "CPU`: the placement's fallback. `export`: the profile's budgets' verdict (selected, or rejected and the "
        f"first reason), or the error of an export that failed. {len(rows) - 1} exports in {minutes:.0f} minutes "
        "on this 2-core machine.",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
