"""``edgeline infer`` and ``edgeline verify``: run a bundle on this machine, torch-free for LiteRT bundles.

Registering the commands imports nothing heavy; numpy, pydantic and the runtimes load when a command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.arguments import bounded_int
from edgeline.backends import RUNTIME_BACKENDS
from edgeline.errors import BackendUnavailableError, BundleError, EdgelineError, PayloadError

if TYPE_CHECKING:
    from edgeline.model import Model

__all__ = ["infer_payloads", "register"]

PAYLOAD_SUFFIXES = (".json", ".jsonl")
INFER_DEVICE = "infer"
"""The device (stream key) of the messages read from a file, as the daemon names a source's messages."""

log = logging.getLogger(__name__)

RUNTIME_BACKEND_HELP = "runtime backend to run the model with instead of the manifest's: %(choices)s"


def register(subparsers: Any) -> None:
    infer = subparsers.add_parser(
        "infer",
        help="run a bundle on samples from an .npz file, or on the daemon's payloads (.json, .jsonl)",
        description="Run a bundle on one or many samples.",
    )
    infer.add_argument("bundle", metavar="BUNDLE", type=Path, help="bundle directory (written by `edgeline export`)")
    infer.add_argument(
        "--input",
        required=True,
        type=Path,
        metavar="FILE",
        help="X.npz: one array per model input (first axis = samples, or one sample), optional `labels`; "
        "or payloads as `edgeline run` takes them (json codec): X.json holds one message, X.jsonl one per line",
    )
    infer.add_argument("--json", action="store_true", help="print JSON lines: one object per sample")
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
        "--show", type=bounded_int(0), default=5, metavar="N", help="samples to print without --json (default 5)"
    )
    infer.set_defaults(func=run_infer)

    verify = subparsers.add_parser(
        "verify",
        help="check a bundle's integrity and run its golden self-test",
        description="Verify sizes and hashes, run golden.npz through the runtime, and time the model here.",
    )
    verify.add_argument("bundle", metavar="BUNDLE", type=Path, help="bundle directory (written by `edgeline export`)")
    verify.add_argument("--backend", choices=sorted(RUNTIME_BACKENDS), metavar="RUNTIME", help=RUNTIME_BACKEND_HELP)
    verify.add_argument("--json", action="store_true", help="print the checks and their figures as one JSON document")
    verify.set_defaults(func=run_verify)


@dataclass
class _Outcome:
    failed: bool = False


@contextmanager
def _runtime_output() -> Iterator[_Outcome]:
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


def _summary(answer: dict[str, Any], output_shapes: list[list[int]]) -> str:
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

    with _runtime_output():
        model = load(args.bundle, backend=args.backend, threads=args.threads)
    warn_accelerator_fallback(model)
    _check_infer_flags(args, model)
    if args.input.suffix in PAYLOAD_SUFFIXES:
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
        answer = model.interpret(inputs, outputs, top_k=args.top_k).as_dict()
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
            summary = _summary(answer, [list(output.shape) for output in outputs])
            print(f"sample {index}: {summary}" + ("" if expected is None else f" (expected {expected})"))
    if args.json:
        return 0
    if len(samples) > args.show:
        print(f"... {len(samples) - args.show} more samples")
    median = statistics.median(latencies) * 1000
    print(
        f"{len(samples)} samples through {model.name} v{model.version} ({model.backend}, "
        f"{model.manifest.precision}), median {median:.3f} ms per sample on this machine"
        + (f" ({model.emulator}: not the device's speed)" if model.emulator else "")
    )
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
                print(f"line {line} ({record['id']}): {_summary(record, shapes)}")
    if not as_json:
        if printed > show:
            print(f"... {printed - show} more answers")
        codes = ", ".join(f"{code} {count}" for code, count in sorted(errors.items()))
        print(
            f"{path}: {results} results, {sum(errors.values())} errors" + (f" ({codes})" if codes else "")
            + f" from {model.name} v{model.version} ({model.backend}, {model.manifest.precision})"
        )  # fmt: skip
    return 1 if errors else 0


# ---------------------------------------------------------------------------------------------------------------------
# verify: each check is a dict of figures (the --json document); the text lines are made from them


def _golden_check(model: Model) -> dict[str, Any]:
    import numpy as np

    from edgeline.samples import read_npz

    golden = model.manifest.golden
    if golden is None:
        return {"check": "golden", "ok": None, "samples": 0}
    arrays = read_npz(model.bundle.file(golden.path), "golden")
    try:
        inputs = [arrays[f"input_{i}"] for i in range(len(model.inputs))]
        expected = [arrays[f"output_{j}"] for j in range(len(model.outputs))]
    except KeyError as exc:
        raise BundleError(f"{model.bundle.path}: golden.npz lacks {exc.args[0]}") from exc
    if golden.reference == "float":
        return _fidelity_check(model, inputs, expected, golden.samples)
    worst = 0.0
    mismatched = 0
    for i in range(golden.samples):
        outputs = model.predict(*(a[i : i + 1] for a in inputs))
        ok = True
        for j, (got, want) in enumerate(zip(outputs, expected, strict=True)):
            want_i = want[i : i + 1].reshape(got.shape)
            worst = max(worst, float(np.abs(got - want_i).max()))
            ok &= bool(np.allclose(got, want_i, rtol=golden.rtol, atol=golden.atol[j]))
        mismatched += not ok
    return {
        "check": "golden",
        "ok": mismatched == 0,
        "samples": golden.samples,
        "mismatched_samples": mismatched,
        "max_abs_error": worst,
        "atol": list(golden.atol),
        "rtol": golden.rtol,
    }


def _fidelity_check(model: Model, inputs: list[Any], expected: list[Any], samples: int) -> dict[str, Any]:
    """The bundle against the float model's outputs in golden.npz (a bundle nothing at export could run), judged as
    export judges a measured bundle: top-1 disagreement against max_accuracy_drop for a classifier, else the
    cosine similarity against min_cosine; with neither, figures only."""
    import numpy as np

    worst, cosines, agree = 0.0, [], 0
    for i in range(samples):
        outputs = model.predict(*(a[i : i + 1] for a in inputs))
        for got, want in zip(outputs, expected, strict=True):
            want_i = np.asarray(want[i : i + 1], np.float64).reshape(got.shape)
            worst = max(worst, float(np.abs(got - want_i).max()))
            norms = float(np.linalg.norm(got) * np.linalg.norm(want_i))
            cosines.append(float(np.dot(got.ravel(), want_i.ravel()) / norms) if norms else 1.0)
        agree += int(np.argmax(outputs[0]) == np.argmax(expected[0][i]))
    budgets = model.manifest.budgets
    check: dict[str, Any] = {
        "check": "fidelity",
        "reference": "float",
        "samples": samples,
        "max_abs_error": worst,
        "cosine_min": min(cosines),
        "top1_agreement": None,
        "ok": None,
    }
    if model.manifest.postprocess.kind == "classify":
        check["top1_agreement"] = agree / samples
        check["budget"] = f"top-1 disagreement <= {budgets.max_accuracy_drop:g}%"
        check["ok"] = (1.0 - agree / samples) * 100.0 <= budgets.max_accuracy_drop
    elif budgets.min_cosine is not None:
        check["budget"] = f"cosine >= {budgets.min_cosine:g}"
        check["ok"] = check["cosine_min"] >= budgets.min_cosine
    return check


def _latency_check(model: Model) -> dict[str, Any]:
    import numpy as np

    from edgeline.timing import median_latency_ms

    sample = [np.zeros(spec.shape, dtype=np.float32) for spec in model.inputs]
    median = median_latency_ms(model, sample, runs=100)
    budget = model.manifest.budgets.max_latency_ms
    return {
        "check": "latency",
        # an emulator's speed says nothing about the device's: measured, shown, never held against the budget
        "ok": None if budget is None or model.emulator is not None else median <= budget,
        "emulator": model.emulator,
        "median_ms": median,
        "budget_ms": budget,
        "profile": model.manifest.profile,
        "machine": platform.machine(),
        "threads": model.threads,
        "manifest_threads": model.manifest.threads,
    }


def _describe(check: dict[str, Any]) -> str:
    """One line of text for a check."""
    kind = check["check"]
    if kind == "integrity":
        return f"integrity: {check['files']} files ({check['bytes']} bytes) match their sizes and sha256"
    if kind == "load":
        where = f" on {check['accelerator']}" if check.get("accelerator") else ""
        fallback = (
            f" (WARNING: accelerator fallback: {check['accelerator_fallback']})"
            if check.get("accelerator_fallback")
            else ""
        )
        return f"load: {check['backend']} opened {check['model']}{where}{fallback}"
    if kind == "fidelity":
        agreement = f", top-1 agreement {check['top1_agreement']:.1%}" if check["top1_agreement"] is not None else ""
        judged = f"budget {check['budget']}" if "budget" in check else "no budget applies (raw outputs, no min_cosine)"
        return (
            f"fidelity against the float model (golden.npz): {check['samples']} samples, max |error| "
            f"{check['max_abs_error']:.3g}, cosine min {check['cosine_min']:.4f}{agreement}; {judged}"
        )
    if kind == "golden":
        if check["ok"] is None:
            return "golden self-test: not verified: the bundle has no golden.npz"
        mismatched = f", {check['mismatched_samples']} outside it" if check["mismatched_samples"] else ""
        return (
            f"golden self-test: {check['samples']} samples, max |error| {check['max_abs_error']:.3g} "
            f"(tolerance {max(check['atol']):.3g}{mismatched})"
        )
    where = (
        f"latency: median {check['median_ms']:.3f} ms on this machine ({check['machine']}, {check['threads']} "
        f"thread(s), the bundle asks for {check['manifest_threads']})"
    )
    if check.get("emulator"):
        return f"{where} on {check['emulator']}: not the device's speed, not checked against the budget"
    if check["budget_ms"] is None:
        return f"{where}; the profile sets no latency budget"
    return f"{where}; {check['profile']} budget {check['budget_ms']:g} ms"


def run_verify(args: argparse.Namespace) -> int:
    from edgeline.bundle import read_bundle
    from edgeline.model import load

    bundle = read_bundle(args.bundle)
    manifest = bundle.manifest
    integrity = {
        "check": "integrity",
        "ok": True,
        "files": len(manifest.files),
        "bytes": sum(entry.size for entry in manifest.files),
    }
    with _runtime_output() as outcome:
        try:
            model = load(args.bundle, backend=args.backend)
        except BackendUnavailableError as exc:  # e.g. a Core ML bundle on Linux: say what was checked, then why not
            raise BackendUnavailableError(
                f"{integrity['files']} files match their sizes and sha256, but the model cannot run here: {exc}"
            ) from exc
        checks = [
            integrity,
            {
                "check": "load",
                "ok": True,
                "backend": model.backend,
                "model": manifest.model,
                "accelerator": model.accelerator,
                "accelerator_fallback": model.accelerator_fallback,
            },
            _golden_check(model),
            _latency_check(model),
        ]
        passed = all(check["ok"] is not False for check in checks)
        outcome.failed = not passed
    warn_accelerator_fallback(model)
    if args.json:
        report = {
            "bundle": str(args.bundle),
            "name": manifest.name,
            "version": manifest.version,
            "backend": model.backend,
            "precision": manifest.precision,
            "ok": passed,
            "checks": checks,
        }
        print(json.dumps(report, indent=2))
    else:
        for check in checks:
            status = {True: "ok", False: "FAIL", None: "n/a"}[check["ok"]]
            print(f"{status:4}  {_describe(check)}")
        print(f"{manifest.name} v{manifest.version}: {'verified' if passed else 'FAILED'}")
    return 0 if passed else 1
