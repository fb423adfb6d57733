"""Run ``edgeline verify --json`` and ``edgeline infer --json`` over many bundles in ONE Python process, and write
what they printed as one JSON document: the device half of ``tests/test_emulated.py``.

Under qemu-user every Python process costs seconds to start, so the emulated Pi runs this once per CPU and
runtime instead of twice per bundle::

    scripts/arm64.sh --cpu cortex-a72 python -m tests.emulated_runner --validation VAL.npz --out OUT.json BUNDLE...

(from the repository's root: the emulated install has ``edgeline`` installed, not the ``tests`` package). Both
commands go through ``edgeline.cli.main``, the ``edgeline`` command's own entry point, with their stdout captured;
the host runs ``infer_outputs`` in-process on the same bundles for the comparison. Torch-free: nothing here, nor in
what it imports, needs the export extra.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "infer_outputs", "run_cli", "run_many", "verify_report"]

PACKAGES = ("edgeline", "numpy", "ai-edge-litert", "onnxruntime", "tflite-runtime")


def run_cli(args: Sequence[str]) -> tuple[int, str, str]:
    """``edgeline ARGS`` in this process: (exit code, stdout, stderr)."""
    from edgeline.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _backend(backend: str | None) -> list[str]:
    return [] if backend is None else ["--backend", backend]


def verify_report(bundle: Path, backend: str | None = None) -> dict[str, Any]:
    """``edgeline verify BUNDLE --json``: its exit code, its JSON document (None if it printed none) and stderr."""
    code, out, err = run_cli(["verify", str(bundle), "--json", *_backend(backend)])
    try:
        report = json.loads(out)
    except json.JSONDecodeError:
        report = None
    return {"code": code, "report": report, "stdout": out if report is None else "", "stderr": err[-4000:]}


def infer_outputs(bundle: Path, validation: Path, backend: str | None = None) -> dict[str, Any]:
    """``edgeline infer BUNDLE --input VAL --json``: exit code, each sample's ``outputs`` (one list per model output,
    in sample order) and the other fields of each line (label, class_index, score), and stderr."""
    code, out, err = run_cli(["infer", str(bundle), "--input", str(validation), "--json", *_backend(backend)])
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {
        "code": code,
        "outputs": [line.get("outputs") for line in lines],
        "class_index": [line.get("class_index") for line in lines],
        "stderr": err[-4000:],
    }


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def run_many(bundles: Sequence[Path], validation: Path, backend: str | None = None) -> dict[str, Any]:
    """Verify each bundle and infer it on ``validation``; one document for all of them."""
    results: dict[str, Any] = {}
    started = time.monotonic()
    for bundle in bundles:
        began = time.monotonic()
        entry = {"verify": verify_report(bundle, backend), "infer": infer_outputs(bundle, validation, backend)}
        entry["seconds"] = round(time.monotonic() - began, 3)
        results[str(bundle)] = entry
    return {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "emulator": os.environ.get("EDGELINE_EMULATOR"),
        "qemu_cpu": os.environ.get("QEMU_CPU"),
        "backend": backend,
        "packages": _versions(),
        "seconds": round(time.monotonic() - started, 3),
        "bundles": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.emulated_runner", description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path, metavar="BUNDLE")
    parser.add_argument("--validation", required=True, type=Path, metavar="VAL.npz")
    parser.add_argument("--out", required=True, type=Path, metavar="OUT.json")
    parser.add_argument("--backend", default=None, help="runtime backend instead of each manifest's")
    args = parser.parse_args(argv)
    document = run_many(args.bundles, args.validation, args.backend)
    args.out.write_text(json.dumps(document), encoding="utf-8")
    where = f"{document['machine']} ({document['emulator'] or 'not emulated'})"
    print(f"{len(args.bundles)} bundles in {document['seconds']:.1f} s on {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
