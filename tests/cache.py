"""Trained reference models and exported bundles, made once and kept by content, shared by every test process.

The suite runs in several processes (pytest-xdist) and again and again on one machine; a conversion or a training
run is minutes of CPU. ``cached`` keys what it makes by everything that decides its bytes: the sources of the
package folders it depends on, the versions of the libraries that convert or train, and the inputs (a file given as
a ``Path`` is keyed by its contents, not its name). The first process to ask makes it under a lock while the others
wait; a half-made entry (a killed run) is never used: an entry counts only once it is renamed into place.

    build/test-cache/<kind>/<key>/        what ``make`` wrote, read-only by agreement: copy before changing it

Bundles are keyed by the sources ``edgeline export`` can import (``EXPORT_FOLDERS``), reference models by
``export/reference``'s. A test that checks the conversion itself still converts: only fixtures that need *a* bundle
use this. Entries of older code are not removed (about 2 MB of bundles per version of the sources; the reference
models change only with ``export/reference``): ``rm -r build/test-cache`` empties it, and the next run makes what it
needs. ``EDGELINE_TEST_CACHE`` moves the cache; ``EDGELINE_TEST_CACHE=off`` makes every entry anew in a temporary
folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from tests.package_tree import REPO, package_dirs
from tests.test_import_contracts import LAYERS

if TYPE_CHECKING:
    from edgeline.export.reference import Prepared

__all__ = ["CACHE_ROOT", "cached", "cached_export", "cached_reference", "code_fingerprint"]

CACHE_ROOT = Path(os.environ.get("EDGELINE_TEST_CACHE") or REPO / "build" / "test-cache")
SOURCE_SUFFIXES = (".py", ".toml", ".ini", ".h", ".c", ".ld", ".json")
LIBRARIES = (
    "torch", "executorch", "litert-torch", "ai-edge-litert", "ai-edge-quantizer", "numpy", "scikit-learn",
    "onnx", "onnxruntime", "onnxscript", "onnxruntime-qnn", "ethos-u-vela", "tflite-micro", "coremltools",
    "openvino", "nncf",
)  # fmt: skip
"""What converts, quantizes or trains: a new version of any may change the bytes. So does the CPU's instruction set
(``edgeline.isa``: training and the runtimes pick their kernels by it), which the key holds too: a run as another
kind of CPU (``edgeline.sim.cpu_kind``) makes its own entries."""


@cache
def code_fingerprint(folders: tuple[str, ...] | None = None) -> str:
    """sha256 of the sources under ``folders`` (repository-relative folders or files; default: every package folder),
    of the versions of ``LIBRARIES`` and of this CPU's instruction set."""
    from edgeline.isa import instruction_set

    roots = [REPO / folder for folder in folders] if folders else sorted(set(package_dirs().values()))
    digest = hashlib.sha256()
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}=={version}\0".encode())
    digest.update(instruction_set().encode())
    return digest.hexdigest()


def _key(kind: str, inputs: Iterable[object], folders: tuple[str, ...] | None) -> str:
    digest = hashlib.sha256(f"{kind}\0{code_fingerprint(folders)}\0".encode())
    for value in inputs:
        if isinstance(value, Path) and value.suffix == ".npz":
            digest.update(b"npz\0" + _arrays_digest(value))  # np.savez stamps the time: key the arrays
        elif isinstance(value, Path):
            digest.update(b"file\0" + hashlib.sha256(value.read_bytes()).digest())
        else:
            digest.update(b"str\0" + str(value).encode() + b"\0")
    return digest.hexdigest()[:32]


def _arrays_digest(path: Path) -> bytes:
    import numpy as np

    digest = hashlib.sha256()
    with np.load(path, allow_pickle=False) as arrays:
        for name in sorted(arrays.files):
            array = np.ascontiguousarray(arrays[name])
            digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode() + array.tobytes())
    return digest.digest()


DETECTION_SOURCES = (
    "export/detection_data.py",
    "export/images.py",
    "edge_runtime/detection.py",
    "edge_runtime/imaging.py",
)
"""Beyond ``export/reference``, what decides a prepared detector's files: what reads its images and measures the mAP
its reference.json holds."""


def cached_reference(name: str, *, seed: int = 0) -> Prepared:
    """Reference model ``name`` trained with ``seed`` (``edgeline reference prepare``), once for this code."""
    from edgeline.export.reference import CATALOGUE, find_prepared, prepare

    def train(directory: Path) -> None:
        prepare(name, directory / name, seed=seed)

    detector = CATALOGUE[name].task == "detect"
    entry = cached("reference", [name, seed], train, folders=("export/reference", *(DETECTION_SOURCES * detector)))
    prepared = find_prepared(name, entry / name, seed=seed)
    assert prepared is not None, f"the cached reference model {entry / name} is incomplete"
    return prepared


def cached_export(model: str | Path, *args: str | Path) -> Path:
    """``edgeline export MODEL ARGS... --out DIR -q``, once for this code and these libraries: the bundle's
    directory (named ``bundle``). ``model`` is a file, ``FILE:ATTRIBUTE``, or ``MODULE:ATTRIBUTE`` of a module inside
    ``EXPORT_FOLDERS`` (e.g. ``edgeline.export.reference.resnet8:build``, whose source the key holds); a ``Path``
    among ``args`` (a profile, samples, labels) is keyed by its contents. Never modify what it returns."""
    from edgeline.cli import main

    file, _, attribute = str(model).partition(":")
    source: Path | str = Path(file)
    if Path(file).suffix != ".py":  # a whole file (a .pt2), else a module's attribute
        source, attribute = (Path(model), "") if Path(model).exists() else (_export_module(str(model)), "")

    def make(directory: Path) -> None:
        code = main(["export", str(model), *map(str, args), "--out", str(directory / "bundle"), "-q"])
        assert code == 0, f"edgeline export {model} {' '.join(map(str, args))} failed (exit {code})"

    return cached("bundle", [source, attribute, *args], make, folders=EXPORT_FOLDERS) / "bundle"


def _export_module(model: str) -> str:
    """``MODULE:ATTRIBUTE`` as its key: the name, once the module is known to lie in ``EXPORT_FOLDERS`` (whose sources
    the key holds). Another module's changes would not make its bundle again: refused."""
    import importlib.util

    module = model.partition(":")[0]
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is None or not any(origin.is_relative_to(REPO / folder) for folder in EXPORT_FOLDERS):
        raise ValueError(f"cached_export({model!r}): not a file, nor a module in {', '.join(EXPORT_FOLDERS)}")
    return f"module {model}"


EXPORT_FOLDERS = ("export", *sorted(LAYERS["export"]))
"""What ``edgeline export`` runs: the export folder and those it may import (the import contracts' arrows, checked by
``tests/test_import_contracts.py``). A change to ``sim`` or ``firmware_bridge`` does not make every bundle again."""


def cached(
    kind: str,
    inputs: Sequence[object],
    make: Callable[[Path], None],
    *,
    folders: tuple[str, ...] | None = None,
) -> Path:
    """The directory ``make(directory)`` fills for these ``inputs``, made at most once for this code and these
    libraries. ``make``'s own source is part of the key (the seeds and shapes written in it); what it reads from
    outside (a file, a variable of the caller) must be in ``inputs``. ``make`` raises (or fails an assert) when it
    cannot: nothing is kept then."""
    if os.environ.get("EDGELINE_TEST_CACHE") == "off":
        directory = Path(tempfile.mkdtemp(prefix=f"edgeline-{kind}-"))
        make(directory)
        return directory
    entry = CACHE_ROOT / kind / _key(kind, [inspect.getsource(make), *inputs], folders)
    if _intact(entry):
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making the same entry: wait for it
        if _intact(entry):
            return entry
        shutil.rmtree(entry, ignore_errors=True)  # changed by a test that should have copied it: made again
        partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            make(partial)
            (partial / SEAL).write_text(_contents(partial), encoding="utf-8")
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.replace(partial, entry)
    return entry


SEAL = ".cache-contents"
"""Each entry's file list with sizes and hashes, written once it is made: an entry a test changed is not reused."""


def _contents(directory: Path) -> str:
    lines = []
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != SEAL:
            lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(directory)}")
    return "\n".join(lines) + "\n"


def _intact(entry: Path) -> bool:
    try:
        return (entry / SEAL).read_text(encoding="utf-8") == _contents(entry)
    except OSError:
        return False
