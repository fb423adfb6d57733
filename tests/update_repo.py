"""Signed update repositories for the tests: keys, bundles of any version made from a committed bundle (no torch),
a bundle whose golden self-test fails, and one whose runtime fails on every input."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.errors import REFUSAL_REASONS, UpdateRefused
from edgeline.updates.keys import generate
from edgeline.updates.policy import Gates
from edgeline.updates.repository import Published, Repository
from tests.tiny_bundle import COMMITTED_BUNDLE

__all__ = ["UpdateRepo", "refused", "versioned"]


def _rewrite_manifest(bundle: Path, change: dict[str, Any]) -> None:
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(change)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def _failing_at_every_input(model_file: Path) -> None:
    """Rewrite a LiteRT model so that its runtime fails on every input: its output is gathered at an index out of
    range (index 99 of 10 classes), which the interpreter checks only when it runs, not when it loads."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(model_file.read_bytes(), 0))
    graph = model.subgraphs[0]
    (output,) = graph.outputs
    code = schema.OperatorCodeT()
    code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.GATHER
    code.version = 1
    model.operatorCodes.append(code)
    positions = schema.BufferT()
    positions.data = np.array([*range(9), 99], np.int32).view(np.uint8)
    model.buffers.append(positions)
    indices = schema.TensorT()
    indices.shape, indices.type, indices.buffer = [10], schema.TensorType.INT32, len(model.buffers) - 1
    gathered = copy.deepcopy(graph.tensors[output])  # the output's name, type and quantization
    model.buffers.append(schema.BufferT())
    gathered.buffer = len(model.buffers) - 1
    graph.tensors[output].name += b";before-gather"
    graph.tensors += [indices, gathered]
    gather = schema.OperatorT()
    gather.opcodeIndex = len(model.operatorCodes) - 1
    gather.inputs, gather.outputs = [output, len(graph.tensors) - 2], [len(graph.tensors) - 1]
    gather.builtinOptionsType = schema.BuiltinOptions.GatherOptions
    gather.builtinOptions = schema.GatherOptionsT()
    gather.builtinOptions.axis = 1
    graph.operators.append(gather)
    graph.outputs = [len(graph.tensors) - 1]
    for signature in model.signatureDefs or []:
        for named in signature.outputs:
            named.tensorIndex = len(graph.tensors) - 1 if named.tensorIndex == output else named.tensorIndex
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    model_file.write_bytes(bytes(builder.Output()))


def _add_zeros(npz: Path, arrays: dict[str, tuple[int, ...]]) -> None:
    import io
    import math
    import zipfile

    chunk = bytes(1 << 20)
    with zipfile.ZipFile(npz, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, shape in arrays.items():
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
            left = math.prod(shape) * 4
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                member.write(header.getvalue())
                while left > 0:
                    member.write(chunk[: min(left, len(chunk))])
                    left -= len(chunk)


def versioned(
    destination: Path,
    version: int,
    *,
    source: Path = COMMITTED_BUNDLE,
    break_golden: bool = False,
    fail_every_input: bool = False,
    hostile: str | None = None,
    golden_zeros: dict[str, tuple[int, ...]] | None = None,
    golden_rows: int | None = None,
    manifest: dict[str, Any] | None = None,
) -> Path:
    """A copy of ``source`` as ``version``; ``break_golden``: its golden outputs moved by 1.0, so the bundle is
    intact and signed but fails its self-test on any machine; ``fail_every_input``: its LiteRT model fails on every
    input when it runs (``_failing_at_every_input``; it fails its self-test too); ``manifest``: other fields to
    set; ``hostile``: its model rewritten as one of ``tests.hostile_models.HOSTILE``; ``golden_zeros``: float32
    arrays of zeros of these shapes added to its golden.npz, deflated (a GiB is a MB in the file; streamed, never in
    memory); ``golden_rows``: a golden.npz of zeros this many samples long, as the manifest then says."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination)
    change: dict[str, Any] = {"version": version, **(manifest or {})}
    changed = []
    if break_golden:
        golden = destination / "golden.npz"
        with np.load(golden, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        for key in arrays:
            if key.startswith("output"):
                arrays[key] = arrays[key] + 1.0
        with golden.open("wb") as handle:
            np.savez(handle, **arrays)
        changed.append(golden)
    if fail_every_input:
        (model_file,) = destination.glob("*.tflite")
        _failing_at_every_input(model_file)
        changed.append(model_file)
    if hostile is not None:
        from tests.hostile_models import rewrite

        (model_file,) = destination.glob("*.tflite")
        rewrite(model_file, hostile)
        changed.append(model_file)
    if golden_rows is not None:
        manifest_now = json.loads((destination / "manifest.json").read_text())
        (destination / "golden.npz").unlink()
        shapes = {f"input_{i}": (golden_rows, *t["shape"][1:]) for i, t in enumerate(manifest_now["inputs"])}
        shapes |= {f"output_{j}": (golden_rows, *t["shape"][1:]) for j, t in enumerate(manifest_now["outputs"])}
        _add_zeros(destination / "golden.npz", shapes)
        changed.append(destination / "golden.npz")
        change["golden"] = {**manifest_now["golden"], "samples": golden_rows}
    if golden_zeros:
        _add_zeros(destination / "golden.npz", golden_zeros)
        changed.append(destination / "golden.npz")
    if changed:
        files = json.loads((destination / "manifest.json").read_text())["files"]
        for entry in files:
            for path in changed:
                if entry["path"] == path.name:
                    entry["size"] = path.stat().st_size
                    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        change["files"] = files
    _rewrite_manifest(destination, change)
    return destination


class UpdateRepo:
    """Keys and a repository in ``root``; bundles are made under ``root/bundles``."""

    def __init__(self, root: Path):
        self.root = root
        self.keys = root / "keys"
        self.directory = root / "repo"
        self.trusted_root = generate(self.keys)
        self.repository = Repository(self.directory, self.keys)

    def bundle(self, version: int, **kwargs: Any) -> Path:
        return versioned(self.root / "bundles" / f"v{version}", version, **kwargs)

    def publish(self, version: int, *, gates: Gates | None = None, audience: tuple[str, ...] | None = None,
                expires_days: float | None = None, **kwargs: Any) -> Published:  # fmt: skip
        return self.repository.publish(
            self.bundle(version, **kwargs), gates=gates, audience=audience, expires_days=expires_days
        )


def refused(reason: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> UpdateRefused:
    """What ``call(*args, **kwargs)`` raised: an ``UpdateRefused`` for ``reason`` (one of the refusal reasons)."""
    assert reason in REFUSAL_REASONS
    with pytest.raises(UpdateRefused) as caught:
        call(*args, **kwargs)
    assert caught.value.reason == reason, f"refused as {caught.value.reason!r}, not {reason!r}: {caught.value}"
    return caught.value
