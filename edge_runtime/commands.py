"""``edgeline infer`` and ``edgeline verify``: run a bundle on this machine, torch-free for LiteRT bundles."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.bundle import read_bundle
from edgeline.errors import BundleError, PayloadError
from edgeline.model import Model, load
from edgeline.samples import read_npz, sample_set
from edgeline.timing import median_latency_ms

__all__ = ["infer_payloads", "register"]

PAYLOAD_SUFFIXES = (".json", ".jsonl")
INFER_DEVICE = "infer"
"""The device (stream key) of the messages read from a file, as the daemon names a source's messages."""


def register(subparsers: Any) -> None:
    infer = subparsers.add_parser(
        "infer",
        help="run a bundle on samples from an .npz file, or on the daemon's payloads (.json, .jsonl)",
        description="Run a bundle on one or many samples.",
    )
    infer.add_argument("bundle", metavar="BUNDLE", type=Path)
    infer.add_argument(
        "--input",
        required=True,
        type=Path,
        metavar="FILE",
        help="X.npz: one array per model input (first axis = samples, or one sample), optional `labels`; "
        "or payloads as `edgeline run` takes them (json codec): X.json holds one message, X.jsonl one per line",
    )
    infer.add_argument("--json", action="store_true", help="print one JSON object per sample per line")
    infer.add_argument("--backend", help="runtime backend to use instead of the manifest's (e.g. tflite-runtime)")
    infer.add_argument("--threads", type=int, help="threads (default: the manifest's)")
    infer.add_argument("--top-k", type=int, default=1, help="classes to report per sample (classifiers)")
    infer.add_argument("--show", type=int, default=5, help="samples to print without --json (default 5)")
    infer.set_defaults(func=run_infer)

    verify = subparsers.add_parser(
        "verify",
        help="check a bundle's integrity and run its golden self-test",
        description="Verify sizes and hashes, run golden.npz through the runtime, and time the model here.",
    )
    verify.add_argument("bundle", metavar="BUNDLE", type=Path)
    verify.add_argument("--backend", help="runtime backend to use instead of the manifest's")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.set_defaults(func=run_verify)


def _jsonable(array: np.ndarray) -> Any:
    return array.tolist()


def run_infer(args: argparse.Namespace) -> int:
    model = load(args.bundle, backend=args.backend, threads=args.threads)
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
            record: dict[str, Any] = {"sample": index, "outputs": [_jsonable(o) for o in outputs], **answer}
            if expected is not None:
                record["expected"] = expected
            print(json.dumps(record))
        elif index < args.show:
            summary = (
                ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in answer.items() if k != "top_k"
                )
                or f"outputs={[list(o.shape) for o in outputs]}"
            )
            print(f"sample {index}: {summary}" + ("" if expected is None else f" (expected {expected})"))
    if args.json:
        return 0
    if len(samples) > args.show:
        print(f"... {len(samples) - args.show} more samples")
    median = statistics.median(latencies) * 1000
    print(
        f"{len(samples)} samples through {model.name} v{model.version} ({model.backend}, "
        f"{model.manifest.precision}), median {median:.3f} ms per sample on this machine"
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
                print(f"line {line} ({record['id']}): {_answer_summary(record)}")
    if not as_json:
        if printed > show:
            print(f"... {printed - show} more answers")
        codes = ", ".join(f"{code} {count}" for code, count in sorted(errors.items()))
        print(
            f"{path}: {results} results, {sum(errors.values())} errors" + (f" ({codes})" if codes else "")
            + f" from {model.name} v{model.version} ({model.backend}, {model.manifest.precision})"
        )  # fmt: skip
    return 1 if errors else 0


def _answer_summary(record: dict[str, Any]) -> str:
    keys = ("label", "class_index", "score", "anomaly", "anomaly_score")
    shown = [
        f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}" for k in keys if k in record
    ]
    if "top_k" in record:
        shown.append("top-k: " + ", ".join(f"{entry['label']} {entry['score']:.4g}" for entry in record["top_k"]))
    return ", ".join(shown) or f"outputs={[len(output) for output in record['outputs']]}"


def _golden_check(model: Model) -> dict[str, Any]:
    golden = model.manifest.golden
    if golden is None:
        return {
            "check": "golden self-test",
            "ok": None,
            "detail": "not verified: the bundle has no golden.npz",
        }
    arrays = read_npz(model.bundle.file(golden.path), "golden")
    try:
        inputs = [arrays[f"input_{i}"] for i in range(len(model.inputs))]
        expected = [arrays[f"output_{j}"] for j in range(len(model.outputs))]
    except KeyError as exc:
        raise BundleError(f"{model.bundle.path}: golden.npz lacks {exc.args[0]}") from exc
    worst = 0.0
    ok = True
    for i in range(golden.samples):
        outputs = model.predict(*(a[i : i + 1] for a in inputs))
        for j, (got, want) in enumerate(zip(outputs, expected, strict=True)):
            want_i = want[i : i + 1].reshape(got.shape)
            error = float(np.abs(got - want_i).max())
            worst = max(worst, error)
            ok &= bool(np.allclose(got, want_i, rtol=golden.rtol, atol=golden.atol[j]))
    return {
        "check": "golden self-test",
        "ok": ok,
        "detail": f"{golden.samples} samples, max |error| {worst:.3g} (tolerance {max(golden.atol):.3g})",
    }


def _latency_check(model: Model) -> dict[str, Any]:
    sample = [np.zeros(spec.shape, dtype=np.float32) for spec in model.inputs]
    median = median_latency_ms(model, sample, runs=100)
    budget = model.manifest.budgets.max_latency_ms
    threads = f"{model.threads} thread(s), the bundle asks for {model.manifest.threads}"
    where = f"median {median:.3f} ms on this machine ({platform.machine()}, {threads})"
    if budget is None:
        return {"check": "latency", "ok": None, "detail": f"{where}; the profile sets no latency budget"}
    return {
        "check": "latency",
        "ok": median <= budget,
        "detail": f"{where}; {model.manifest.profile} budget {budget:g} ms",
    }


def run_verify(args: argparse.Namespace) -> int:
    bundle = read_bundle(args.bundle)
    checks: list[dict[str, Any]] = [
        {
            "check": "integrity",
            "ok": True,
            "detail": f"{len(bundle.manifest.files)} files match their sizes and sha256",
        }
    ]
    model = load(args.bundle, backend=args.backend)
    checks.append({"check": "load", "ok": True, "detail": f"{model.backend} opened {bundle.manifest.model}"})
    checks.append(_golden_check(model))
    checks.append(_latency_check(model))
    passed = all(check["ok"] is not False for check in checks)
    if args.json:
        print(json.dumps({"bundle": str(args.bundle), "ok": passed, "checks": checks}, indent=2))
    else:
        for check in checks:
            status = {True: "ok", False: "FAIL", None: "n/a"}[check["ok"]]
            print(f"{status:4}  {check['check']}: {check['detail']}")
        print(f"{bundle.manifest.name} v{bundle.manifest.version}: {'verified' if passed else 'FAILED'}")
    return 0 if passed else 1
