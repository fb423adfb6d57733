"""Which export figures change with the export machine's CPU, and by how much (issue 47).

One model of each reference (trained once, on this machine as it is) is exported for x86-64 by each target below on
this CPU and as each kind of ``edgeline.sim.cpu_kind`` (instruction sets hidden from CPUID: the runtimes pick the
kernels they would pick there), with the same calibration and validation samples. Printed per export: the manifest's
fidelity (accuracy against the float model's on the validation samples, points lost, the largest output error), what
it names as computed in, and the bundle made on this CPU run as that kind (the device side: the same bundle on
another CPU), its accuracy on the same samples.

    python benchmarks/cpu_kinds.py --write benchmarks/results/cpu_kinds.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table, publish

from edgeline.isa import instruction_set
from edgeline.sim.cpu_kind import KINDS, available, environment

MODELS = ("resnet8", "ds_cnn")
TARGETS = (
    ("openvino", "int8-static"),
    ("openvino", "fp16"),
    ("onnxruntime", "int8-static"),
    ("litert", "int8-static"),
)
HOST = "this CPU"
_RUN = """
import sys, numpy as np, edgeline
model = edgeline.load(sys.argv[1])
data = np.load(sys.argv[2])
found = np.array([int(np.argmax(model.predict(x[None])[0])) for x in data["x"]])
print(float(np.mean(found == data["labels"])), model.computes)
"""


def _edgeline() -> str:
    found = shutil.which("edgeline") or str(Path(sys.executable).with_name("edgeline"))
    return found


def export(kind: str, directory: Path, backend: str, precision: str, out: Path) -> dict[str, object]:
    env = dict(os.environ) if kind == HOST else environment(kind)
    labels = directory / "labels.txt"
    command = [
        _edgeline(), "export", str(directory / "model.pt2"), "--profile", "x86-64", "--backend", backend,
        "--precision", precision, "--calibration", str(directory / "calibration.npz"),
        "--validation", str(directory / "validation.npz"), "--out", str(out), "-q", "--no-mixed-precision",
        *(("--labels", str(labels)) if labels.exists() else ()),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} as {kind}: {done.stderr[-2000:]}")
    fidelity: dict[str, object] = json.loads((out / "manifest.json").read_text())["fidelity"]
    return fidelity


def run_as(kind: str, bundle: Path, samples: Path) -> tuple[float, str]:
    env = dict(os.environ) if kind == HOST else environment(kind)
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(bundle), str(samples)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{bundle} as {kind}: {done.stderr[-2000:]}")
    accuracy, computes = done.stdout.split()[-2:]
    return float(accuracy), computes


_UNPINNED = """
import sys, numpy as np, openvino as ov
data, reference = np.load(sys.argv[2]), np.load(sys.argv[3])
core = ov.Core()
model = core.read_model(sys.argv[1])
config = {"INFERENCE_PRECISION_HINT": "f16", "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 1}
compiled = core.compile_model(model, "CPU", config)
request = compiled.create_infer_request()
found = np.concatenate([np.array(request.infer([x[None]])[compiled.output(0)]) for x in data["x"]])
computes = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
print(computes, float(np.abs(found - reference).max()), float(np.mean(found.argmax(1) == reference.argmax(1))))
"""


def unpinned(kind: str, bundle: Path, samples: Path, reference: Path) -> tuple[str, float, float]:
    """The fp16 IR on OpenVINO's CPU plugin asked for f16 and left to it (what edgeline pins): what it computes in,
    its largest error against the float model and its top-1 agreement with it."""
    env = dict(os.environ) if kind == HOST else environment(kind)
    done = subprocess.run(
        [sys.executable, "-c", _UNPINNED, str(bundle / "model.xml"), str(samples), str(reference)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{bundle} as {kind}: {done.stderr[-2000:]}")
    computes, error, agreement = done.stdout.split()[-3:]
    return computes, float(error), float(agreement)


def float_outputs(directory: Path, out: Path) -> Path:
    import numpy as np
    import torch

    x = np.load(directory / "validation.npz")["x"]
    module = torch.export.load(str(directory / "model.pt2")).module()
    with torch.no_grad():
        np.save(out, np.concatenate([module(torch.from_numpy(x[i : i + 1])).numpy() for i in range(len(x))]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the table (markdown) to this file")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    from tests.cache import cached_reference

    kinds = [HOST, *(kind for kind in KINDS if available(kind) is None)]
    rows: list[tuple[str, ...]] = [
        ("model", "target", "exported as", "instruction set named", "computed in", "accuracy (float)",
         "points lost", "max abs error", "this CPU's bundle run there"),
    ]  # fmt: skip
    loose: list[tuple[str, ...]] = [
        ("model", "run as", "the plugin computes", "max abs error", "top-1 agreement with the float model"),
    ]
    with tempfile.TemporaryDirectory(prefix="cpu-kinds-") as scratch:
        for name in args.models:
            directory = cached_reference(name).directory
            samples = directory / "validation.npz"
            for backend, precision in TARGETS:
                made = {}
                for kind in kinds:
                    out = Path(scratch) / f"{name}-{backend}-{precision}-{kind.replace(' ', '_')}"
                    made[kind] = (out, export(kind, directory, backend, precision, out))
                for kind in kinds:
                    out, fidelity = made[kind]
                    accuracy, accuracy_float = float(fidelity["accuracy"]), float(fidelity["accuracy_float"])
                    there, computes = run_as(kind, made[HOST][0], samples)
                    rows.append((
                        name, f"{backend} {precision}", kind, str(fidelity["instruction_set"]).replace("x86_64 ", ""),
                        str(fidelity["computed_in"]), f"{accuracy * 100:.2f}% ({accuracy_float * 100:.2f}%)",
                        f"{(accuracy_float - accuracy) * 100:.2f}", f"{float(fidelity['max_abs_error']):.4f}",
                        f"{there * 100:.2f}% in {computes}",
                    ))  # fmt: skip
                    print(" | ".join(rows[-1]), flush=True)
                if (backend, precision) == ("openvino", "fp16"):
                    reference = float_outputs(directory, Path(scratch) / f"{name}-float.npy")
                    for kind in kinds:
                        computes, error, agreement = unpinned(kind, made[HOST][0], samples, reference)
                        loose.append((name, kind, computes, f"{error:.4f}", f"{agreement * 100:.2f}%"))
                        print(" | ".join(loose[-1]), flush=True)
    intro = (
        f"This machine: {instruction_set()}. Each kind hides instruction sets from CPUID (edgeline.sim.cpu_kind), "
        "so oneDNN/OpenVINO, MLAS and XNNPACK pick that CPU's kernels; the reference models were trained once, on "
        "this CPU. Accuracy on each model's validation samples (450 ResNet-8 images, 360 DS-CNN clips); points lost "
        "against the float model's accuracy on the same machine; the last column runs the bundle exported on this "
        "CPU as each kind."
    )
    table = (
        markdown_table(rows) + "\n\nThe fp16 IR made on this CPU, on OpenVINO's CPU plugin asked for f16 and left to "
        "it, as each kind (what edgeline's session pins to f32 where the plugin would pick bf16):\n\n"
        + markdown_table(loose)
    )
    publish(table, script=__file__, title="Export figures on four kinds of x86-64 CPU", intro=intro, write=args.write)


if __name__ == "__main__":
    main()
