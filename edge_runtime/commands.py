"""``edgeline infer``: run a bundle on this machine, torch-free for LiteRT bundles (on image files:
``edgeline.image_infer``); and what the commands that run a bundle share (``edgeline verify`` is ``edgeline.verify``):
the runtime's own output kept off the terminal, the accelerator fallback said once.

Registering the command imports nothing heavy; numpy, pydantic and the runtimes load when a command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.arguments import add_detection_arguments, bounded_int, detection_overrides
from edgeline.backends import RUNTIME_BACKENDS
from edgeline.errors import EdgelineError, PayloadError

if TYPE_CHECKING:
    from edgeline.image_infer import ImageSet
    from edgeline.model import Model

__all__ = ["answer_summary", "infer_payloads", "register", "runtime_output", "warn_accelerator_fallback"]

PAYLOAD_SUFFIXES = (".json", ".jsonl")
INFER_DEVICE = "infer"
"""The device (stream key) of the messages read from a file, as the daemon names a source's messages."""

log = logging.getLogger(__name__)

RUNTIME_BACKEND_HELP = "runtime backend to run the model with instead of the manifest's: %(choices)s"


def register(subparsers: Any) -> None:
    infer = subparsers.add_parser(
        "infer",
        help="run a bundle on samples from an .npz file, on the daemon's payloads (.json, .jsonl), or on images",
        description="Run a bundle on one or many samples.",
    )
    infer.add_argument("bundle", metavar="BUNDLE", type=Path, help="bundle directory (written by `edgeline export`)")
    infer.add_argument(
        "--input",
        required=True,
        type=Path,
        metavar="FILE|DIR|GLOB",
        help="X.npz: one array per model input (first axis = samples, or one sample), optional `labels`; "
        "or payloads as `edgeline run` takes them (json codec): X.json holds one message, X.jsonl one per line; "
        "or images (PNG, JPEG, ...) for a bundle with an image pre-processing: a file, a folder (its images, "
        "recursively) or a quoted glob pattern ('shots/**/*.jpg')",
    )
    infer.add_argument("--json", action="store_true", help="print JSON lines: one object per sample or image")
    infer.add_argument("--backend", choices=sorted(RUNTIME_BACKENDS), metavar="RUNTIME", help=RUNTIME_BACKEND_HELP)
    infer.add_argument(
        "--threads",
        type=bounded_int(1),
        metavar="N",
        help="threads, at most this machine's CPUs (default: the manifest's)",
    )
    infer.add_argument(
        "--top-k", type=bounded_int(1), default=1, metavar="K", help="classes to report per sample (classifiers)"
    )
    infer.add_argument(
        "--show",
        type=bounded_int(0),
        default=5,
        metavar="N",
        help="samples or images to print without --json (default 5)",
    )
    infer.add_argument(
        "--annotate",
        type=Path,
        metavar="OUTDIR",
        help="images: write a copy of each with its answer drawn (boxes, labels, scores) to OUTDIR (made if missing; "
        "a folder's sub-folders mirrored)",
    )
    add_detection_arguments(infer, "detectors (instead of the manifest's settings)")
    infer.set_defaults(func=run_infer)


@dataclass
class _Outcome:
    failed: bool = False


@contextmanager
def runtime_output() -> Iterator[_Outcome]:
    """What third-party code prints while a model loads and runs (LiteRT's delegate line from C on fd 2,
    ExecuTorch's warnings) is kept off the terminal: logged at debug level (``-v`` shows it), or as a warning
    when the block raises or the caller marks the outcome failed."""
    from edgeline.native_output import CapturedOutput, capture_native_output

    outcome = _Outcome()
    captured = CapturedOutput()
    try:
        with capture_native_output() as captured:
            yield outcome
    except BaseException:
        outcome.failed = True
        raise
    finally:
        text = captured.text.strip()
        if text:  # logged once the file descriptors are back
            log.log(logging.WARNING if outcome.failed else logging.DEBUG, "the runtime printed:\n%s", text)


def warn_accelerator_fallback(model: Model) -> None:
    """One warning line when the model does not run on the accelerator its bundle was built for: a CPU run of an
    accelerator bundle is slower by design, never a silent surprise."""
    if model.accelerator_fallback is not None:
        log.warning("%s: %s", model.name, model.accelerator_fallback)


def _check_infer_flags(args: argparse.Namespace, model: Model) -> None:
    """Ranges that depend on the model and the machine: refused with the valid range, never quietly narrowed."""
    from edgeline.model import usable_threads

    cpus = usable_threads(args.threads) if args.threads is not None else None
    if cpus is not None and cpus < args.threads:
        raise EdgelineError(f"--threads {args.threads}: this process may use {cpus} CPUs here; valid: 1 to {cpus}")
    kind = model.manifest.postprocess.kind
    given = [f"--{key.replace('_', '-')}" for key in detection_overrides(args)]
    if given and kind != "detect":
        raise EdgelineError(f"{', '.join(given)}: for detectors; {model.name} is a {kind} model")
    if args.top_k == 1:
        return
    if model.manifest.postprocess.kind != "classify":
        raise EdgelineError(
            f"--top-k applies to classifiers; {model.name} is a {model.manifest.postprocess.kind} model"
        )
    classes = math.prod(model.outputs[0].shape)
    if args.top_k > classes:
        raise EdgelineError(f"--top-k {args.top_k}: {model.name} has {classes} classes; valid: 1 to {classes}")


ANSWER_FIELDS = ("label", "class_index", "score", "top_k", "anomaly_score", "anomaly")
"""What ``Interpretation.as_dict`` gives, in an infer result or a daemon's answer record."""


def answer_summary(answer: dict[str, Any], output_shapes: list[list[int]]) -> str:
    """One text line of an answer: its interpretation, or the output shapes of a model that has none."""
    fields = ", ".join(
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in answer.items()
        if key in ANSWER_FIELDS and key != "top_k"
    )
    if "top_k" in answer:
        fields += "; top " + ", ".join(f"{entry['label']} {entry['score']:.4g}" for entry in answer["top_k"])
    return fields or f"outputs={output_shapes}"


def run_infer(args: argparse.Namespace) -> int:
    from edgeline.model import load
    from edgeline.samples import read_npz, sample_set

    with runtime_output():
        model = load(args.bundle, backend=args.backend, threads=args.threads)
    warn_accelerator_fallback(model)
    _check_infer_flags(args, model)
    from edgeline.image_infer import resolve_images

    images = resolve_images(args.input)
    if images is not None:
        return _infer_images(args, model, images)
    if args.annotate is not None:
        raise EdgelineError(f"--annotate draws on images; --input {args.input} is not an image, folder or pattern")
    if args.input.suffix in PAYLOAD_SUFFIXES:
        if detection_overrides(args):
            raise EdgelineError(
                f"--input {args.input}: payloads are answered as `edgeline run` answers them, with the manifest's "
                "detection settings; the threshold flags apply to images and .npz samples"
            )
        return infer_payloads(model, args.input, top_k=args.top_k, as_json=args.json, show=args.show)
    samples = sample_set(read_npz(args.input, "input"), model.inputs, str(args.input))
    post = model.manifest.postprocess
    labels = samples.labels
    correct = 0
    latencies = []
    for index in range(len(samples)):
        inputs = samples.sample(index)
        start = time.perf_counter()
        outputs = model.predict(*inputs)
        latencies.append(time.perf_counter() - start)
        answer = model.interpret(
            inputs, outputs, top_k=args.top_k, overrides=detection_overrides(args) or None
        ).as_dict()
        expected = None if labels is None else labels[index].item()
        if post.kind == "classify" and expected is not None:
            correct += int(answer["class_index"] == expected)
        elif post.kind == "anomaly" and expected is not None:
            correct += int(bool(answer["anomaly"]) == bool(expected))
        if args.json:
            record: dict[str, Any] = {"sample": index, "outputs": [o.tolist() for o in outputs], **answer}
            if expected is not None:
                record["expected"] = expected
            print(json.dumps(record))
        elif index < args.show:
            summary = answer_summary(answer, [list(output.shape) for output in outputs])
            print(f"sample {index}: {summary}" + ("" if expected is None else f" (expected {expected})"))
    if args.json:
        return 0
    if len(samples) > args.show:
        print(f"... {len(samples) - args.show} more samples")
    print(f"{len(samples)} samples through {_timing(model, latencies, 'sample')}")
    fidelity = model.manifest.fidelity
    if labels is not None and post.kind in ("classify", "anomaly"):
        line = f"accuracy: bundle {correct / len(samples) * 100:.2f}%"
        if fidelity.accuracy_float is not None:
            line += (
                f"  |  float model at export: {fidelity.accuracy_float * 100:.2f}% "
                f"(bundle at export: {(fidelity.accuracy or 0) * 100:.2f}%, {fidelity.samples} samples)"
            )
        print(line)
    return 0


def _timing(model: Model, latencies: list[float], unit: str) -> str:
    """ "NAME vV (backend, precision), median X ms per UNIT on this machine", emulation said."""
    from edgeline.machine import this_machine

    emulated = model.emulator or this_machine().emulated
    backend = f"{model.backend} {model.runtime} runtime" if model.runtime else model.backend
    median = f", median {statistics.median(latencies) * 1000:.3f} ms per {unit} on this machine" if latencies else ""
    return f"{model.name} v{model.version} ({backend}, {model.manifest.precision}){median}" + (
        f" (emulated: {emulated}: not the device's speed)" if emulated else ""
    )


def _infer_images(args: argparse.Namespace, model: Model, images: ImageSet) -> int:
    """Images through the bundle (``edgeline.image_infer``): exit code 1 when any failed."""
    from edgeline.image_infer import infer_images

    failed, latencies = infer_images(
        model,
        images,
        top_k=args.top_k,
        as_json=args.json,
        show=args.show,
        annotate=args.annotate,
        overrides=detection_overrides(args) or None,
        summary=answer_summary,
    )
    if not args.json:
        count = len(images.images)
        print(
            f"{count} image{'' if count == 1 else 's'}" + (f" ({failed} failed)" if failed else "")
            + f" through {_timing(model, latencies, 'image')}"
            + (f"; annotated copies in {args.annotate}" if args.annotate is not None else "")
        )  # fmt: skip
    return 1 if failed else 0


def _payloads(path: Path) -> list[tuple[int, bytes]]:
    """(line number, payload): a .json file is one message, a .jsonl file one per line (blank lines skipped)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PayloadError(f"input file {path}: {exc.strerror or exc}") from exc
    messages = [(1, data)] if path.suffix == ".json" else list(enumerate(data.splitlines(), 1))
    messages = [(line, payload) for line, payload in messages if payload.strip()]
    if not messages:
        raise PayloadError(f"input file {path}: no messages")
    return messages


def infer_payloads(model: Model, path: Path, *, top_k: int = 1, as_json: bool = False, show: int = 5) -> int:
    """Answer each message of ``path`` as ``edgeline run`` would (its json codec and processor): a result or a coded
    error per input. Exit code 1 when any input got an error."""
    import numpy as np

    from edgeline.daemon.codecs import get_codec
    from edgeline.daemon.health import Metrics
    from edgeline.daemon.messages import Message
    from edgeline.daemon.processor import Processor

    processor = Processor(
        model, get_codec("json"), Metrics(model=model.name, version=model.version), publish="{device}", top_k=top_k
    )
    errors: Counter[str] = Counter()
    results = 0
    printed = 0
    for line, payload in _payloads(path):
        for answer in processor.process(Message(topic="", payload=payload, device=INFER_DEVICE)):
            record = {"line": line, **answer.record}
            if answer.is_error:
                errors[record["error"]["code"]] += 1
            else:
                results += 1
            if as_json:
                print(json.dumps(record))
                continue
            printed += 1
            if printed > show:
                continue
            if answer.is_error:
                print(f"line {line} ({record['id']}): error {record['error']['code']}: {record['error']['message']}")
            else:
                shapes = [list(np.shape(output)) for output in record["outputs"]]
                print(f"line {line} ({record['id']}): {answer_summary(record, shapes)}")
    if not as_json:
        if printed > show:
            print(f"... {printed - show} more answers")
        codes = ", ".join(f"{code} {count}" for code, count in sorted(errors.items()))
        print(
            f"{path}: {results} results, {sum(errors.values())} errors" + (f" ({codes})" if codes else "")
            + f" from {model.name} v{model.version} ({model.backend}, {model.manifest.precision})"
        )  # fmt: skip
    return 1 if errors else 0
