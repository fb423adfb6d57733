"""ExecuTorch without torch: the C++ runtime the executorch wheel ships, driven through a small C shim of ours.

The executorch wheel carries torch-free C++ libraries (``executorch/lib/libexecutorch*.so``: the runtime, the
optimized and quantized kernels, the XNNPACK delegate, the thread pool) and their headers, but installing the wheel
pulls torch, and its Python runtime imports it. edgeline uses the libraries alone:

- **Where they come from** (``runtimes()``, first found wins): ``$EDGELINE_EXECUTORCH_HOME``; the copy
  ``edgeline doctor --install executorch`` unpacked into this environment (``<sys.prefix>/share/edgeline/
  executorch``: ``lib/``, ``include/`` and ``version.py`` of the wheel, fetched with ``pip download --no-deps``, so
  no torch); else an executorch wheel installed here (a workstation with the export extra).
- **The shim** (``executorch_shim.cpp``, a C ABI over Program/Method) is compiled with the host's C++ compiler
  (``$CXX``, else g++, c++ or clang++) against those headers and libraries, with the flags ExecuTorch's cmake
  config names, at install, never at first use: by ``edgeline doctor --install executorch`` (``install``), or on a
  workstation whose executorch wheel came with the export extra by ``scripts/setup.sh`` (``build_for_environment``).
  It is kept under the hash of everything that went into it (next to the libraries when that directory is writable,
  else in ``$XDG_CACHE_HOME/edgeline``). Loading a bundle where no shim was built for the runtime (or only one for an
  older edgeline) is one line naming the remedy; a missing compiler or library is one line saying what and how to
  get it.
- **Running** (``NativeRuntime``, ``NativeProgram``): ctypes; the caller's contiguous numpy arrays are handed over
  by address (the runtime copies them into its planned memory once, as ExecuTorch does for any caller), the outputs
  copied once out of the method's memory (the next run overwrites it).

Nothing here imports torch; ``edgeline.backends.executorch`` falls back to ExecuTorch's Python runtime (which does)
only when no torch-free runtime can be had.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.errors import BackendUnavailableError, BundleError

__all__ = [
    "ABI",
    "DELEGATE_LIBRARIES",
    "EXECUTORCH_VERSION",
    "SCALAR_TYPES",
    "NativeProgram",
    "NativeRuntime",
    "RuntimeDir",
    "build_for_environment",
    "install",
    "install_dir",
    "runtimes",
]

log = logging.getLogger(__name__)

EXECUTORCH_VERSION = "1.5.1"
"""The ExecuTorch release edgeline exports with and tests its shim against: what ``--install`` fetches."""
ABI = 1
"""``edgeline_et_abi()`` of the shim this module speaks to."""
SHIM_SOURCE = Path(__file__).with_name("executorch_shim.cpp")
SHIM_NAME = "libedgeline_executorch.so"
BUILD_TIMEOUT_S = 600.0
"""Compiling the shim (at install): about 2 s on an x86 core, tens of seconds on a Raspberry Pi."""
INSTALL_COMMAND = "edgeline doctor --install executorch"
"""What builds the shim, named by every refusal of a runtime without one."""
DOWNLOAD_TIMEOUT_S = 900.0

RUNTIME_LIBRARIES = (
    "libexecutorch",
    "libexecutorch_threadpool",
    "libexecutorch_kernels_optimized",
    "libexecutorch_kernels_quantized",
)
"""Linked always: the runtime, its thread pool and the kernels of the operators a delegate leaves on the CPU (float
and quantized)."""
DELEGATE_LIBRARIES = {
    "XnnpackBackend": "libexecutorch_backend_xnnpack",
    "CoreMLBackend": "libexecutorch_backend_coreml",
}
"""The delegates edgeline's export targets lower to, by the name a program asks for: linked when the runtime has
their library (the wheel's QNN and OpenVINO delegates need vendor SDKs no edgeline target uses: left out)."""
COMPILE_FLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-DC10_USING_CUSTOM_GENERATED_MACROS",
    "-DET_EVENT_TRACER_ENABLED",
    "-DET_USE_THREADPOOL",
)
"""What ExecuTorch's cmake config (executorch-config.cmake) gives a consumer: C++17, the vendored c10 headers' macro
switch, and the two switches its libraries were compiled with."""

_LIBRARY_NAMES = "|".join(map(re.escape, (*RUNTIME_LIBRARIES, *DELEGATE_LIBRARIES.values())))
_WHEEL_MEMBERS = re.compile(rf"executorch/(lib/({_LIBRARY_NAMES})\.so|include/.+\.(h|hpp|inc)|version\.py)")
"""What ``install`` takes out of the wheel: the libraries the shim links, the headers, the version."""
_MAX_MEMBER_BYTES = 256 * 1024 * 1024
_MAX_TOTAL_BYTES = 1024 * 1024 * 1024

SCALAR_TYPES: dict[int, np.dtype[Any]] = {
    0: np.dtype(np.uint8),
    1: np.dtype(np.int8),
    2: np.dtype(np.int16),
    3: np.dtype(np.int32),
    4: np.dtype(np.int64),
    5: np.dtype(np.float16),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    11: np.dtype(np.bool_),
}
"""ExecuTorch's ScalarType codes (c10's) -> numpy."""
_TYPE_CODES = {dtype: code for code, dtype in SCALAR_TYPES.items()}
ERRORS = {
    0x01: "Internal",
    0x02: "InvalidState",
    0x03: "EndOfMethod",
    0x04: "AlreadyLoaded",
    0x10: "NotSupported",
    0x11: "NotImplemented",
    0x12: "InvalidArgument",
    0x13: "InvalidType",
    0x14: "OperatorMissing",
    0x15: "RegistrationExceedingMaxKernels",
    0x16: "RegistrationAlreadyRegistered",
    0x20: "NotFound",
    0x21: "MemoryAllocationFailed",
    0x22: "AccessFailed",
    0x23: "InvalidProgram",
    0x24: "InvalidExternalData",
    0x25: "OutOfResources",
    0x30: "DelegateInvalidCompatibility",
    0x31: "DelegateMemoryAllocationFailed",
    0x32: "DelegateInvalidHandle",
}
"""ExecuTorch's ``runtime::Error`` codes (runtime/core/error.h)."""
_ERR_LEN = 1024
_MAX_DIMS = 16


def install_dir() -> Path:
    """Where ``edgeline doctor --install executorch`` puts the runtime: ``$EDGELINE_EXECUTORCH_HOME``, else inside
    this Python environment, so the daemon run from it finds it and removing the environment removes it."""
    home = os.environ.get("EDGELINE_EXECUTORCH_HOME")
    return Path(home) if home else Path(sys.prefix) / "share" / "edgeline" / "executorch"


def _cache_dir() -> Path | None:
    """The user's cache for shims built against a runtime this user cannot write to; None without a home (a
    systemd service with ``DynamicUser=``)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:
            return None
    return Path(base) / "edgeline" / "executorch-shim"


@dataclass(frozen=True)
class RuntimeDir:
    """ExecuTorch's C++ runtime on disk: ``lib/`` and ``include/`` as the wheel lays them out."""

    root: Path
    origin: str
    """How it was found: ``EDGELINE_EXECUTORCH_HOME``, ``installed`` (``--install``) or ``executorch wheel``."""

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def version(self) -> str | None:
        """The wheel's version (its ``version.py``, read, never run), e.g. ``1.5.1+cpu``; None when absent."""
        try:
            text = (self.root / "version.py").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
        found = re.search(r"""^__version__\s*=\s*["']([^"']{1,64})["']""", text, re.MULTILINE)
        return found.group(1) if found else None

    def missing(self, *, shim: bool = True) -> str | None:
        """What this directory lacks to run bundles through edgeline's shim (``shim=False``: to build the shim),
        or None: a library or header (its path), or the shim built for it, with the remedy."""
        for name in RUNTIME_LIBRARIES:
            if not (self.lib / f"{name}.so").is_file():
                return f"{self.lib / name}.so"
        header = self.root / "include" / "executorch" / "runtime" / "executor" / "program.h"
        if not header.is_file():
            return str(header)
        if shim and built_shim(self) is None:
            return _no_shim()
        return None

    def delegate_libraries(self) -> dict[str, Path]:
        return {
            backend: self.lib / f"{name}.so"
            for backend, name in DELEGATE_LIBRARIES.items()
            if (self.lib / f"{name}.so").is_file()
        }


def runtimes() -> list[RuntimeDir]:
    """Every ExecuTorch C++ runtime this environment can see, in the order they are preferred."""
    found: list[RuntimeDir] = []
    if os.environ.get("EDGELINE_EXECUTORCH_HOME"):
        found.append(RuntimeDir(install_dir(), "EDGELINE_EXECUTORCH_HOME"))
    else:
        found.append(RuntimeDir(install_dir(), "installed"))
    wheel = _wheel_root()
    if wheel is not None:
        found.append(RuntimeDir(wheel, "executorch wheel"))
    return [runtime for runtime in found if runtime.root.is_dir()]


def _wheel_root() -> Path | None:
    """An executorch package installed in this environment (its ``lib/libexecutorch.so``), found on ``sys.path``
    without importing it: its import would load torch."""
    for entry in sys.path:
        package = Path(entry or ".") / "executorch"
        if (package / "lib" / "libexecutorch.so").is_file():
            return package
    return None


def compiler() -> str | None:
    """The C++ compiler the shim is built with: ``$CXX``, else g++, c++ or clang++ on PATH."""
    wanted = os.environ.get("CXX")
    if wanted:
        return shutil.which(wanted) or (wanted if Path(wanted).is_file() else None)
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _link_arguments(runtime: RuntimeDir) -> list[str]:
    libraries = [runtime.lib / f"{name}.so" for name in RUNTIME_LIBRARIES]
    libraries += list(runtime.delegate_libraries().values())
    # Registration-only libraries export nothing the shim calls: --no-as-needed keeps them (and their static
    # registrations of kernels and delegates) in.
    return ["-Wl,--no-as-needed", *map(str, libraries), "-Wl,--as-needed", f"-Wl,-rpath,{runtime.lib}", "-ldl"]


def _shim_key(runtime: RuntimeDir) -> str:
    """What the shim is built from (its source, the flags, the runtime's libraries and version), not by what: a shim
    cross-compiled for this machine is found here as one compiled here."""
    digest = hashlib.sha256()
    digest.update(SHIM_SOURCE.read_bytes())
    facts = {
        "abi": ABI,
        "flags": COMPILE_FLAGS,
        "link": _link_arguments(runtime),
        "version": runtime.version,
        "libraries": sorted((path.name, path.stat().st_size) for path in runtime.lib.glob("*.so")),
    }
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()[:20]


def _shim_dirs(runtime: RuntimeDir) -> list[Path]:
    cache = _cache_dir()
    return [runtime.root / "edgeline-shim", *([cache] if cache is not None else [])]


def built_shim(runtime: RuntimeDir) -> Path | None:
    """The shim already built for ``runtime`` (by this edgeline's source and flags, against its libraries as they
    are now), or None."""
    key = _shim_key(runtime)
    for directory in _shim_dirs(runtime):
        candidate = directory / key / SHIM_NAME
        if candidate.is_file():
            return candidate
    return None


def _no_shim() -> str:
    """What a runtime without a built shim lacks, and the remedy: one clause (``compiler()`` is looked up)."""
    if compiler() is None:
        return (
            "edgeline's shim, and this machine a C++ compiler to build edgeline's shim: apt install g++ (or set CXX), "
            f"then run `{INSTALL_COMMAND}`"
        )
    return f"edgeline's shim, built for it at install: run `{INSTALL_COMMAND}`"


def build_shim(runtime: RuntimeDir) -> Path:
    """Compile the shim against ``runtime`` (or find it compiled): at install only. Its path; BackendUnavailableError
    names what is missing (a library, a header, a compiler) or the compiler's first error."""
    missing = runtime.missing(shim=False)
    if missing is not None:
        raise BackendUnavailableError(f"the ExecuTorch runtime at {runtime.root} is incomplete: no {missing}")
    found = built_shim(runtime)
    if found is not None:
        return found
    cxx = compiler()
    if cxx is None:
        raise BackendUnavailableError(
            "building edgeline's ExecuTorch shim needs a C++17 compiler: install g++ (apt install g++) or set CXX"
        )
    key = _shim_key(runtime)
    errors: list[str] = []
    for directory in _shim_dirs(runtime):
        target = directory / key
        try:
            target.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=target)
            os.close(handle)
        except OSError as exc:
            errors.append(f"{directory}: {exc.strerror or exc}")
            continue
        include = runtime.root / "include"
        command = [
            cxx,
            *COMPILE_FLAGS,
            f"-I{include}",
            f"-I{include / 'executorch' / 'runtime' / 'core' / 'portable_type' / 'c10'}",
            str(SHIM_SOURCE),
            "-o",
            partial,
            *_link_arguments(runtime),
        ]
        log.info("building edgeline's ExecuTorch shim with %s into %s", cxx, target)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            Path(partial).unlink(missing_ok=True)
            raise BackendUnavailableError(
                f"building edgeline's ExecuTorch shim with {cxx} took more than {BUILD_TIMEOUT_S:g} s"
            ) from None
        except OSError as exc:
            Path(partial).unlink(missing_ok=True)
            raise BackendUnavailableError(f"could not run the C++ compiler {cxx}: {exc}") from exc
        if done.returncode != 0:
            Path(partial).unlink(missing_ok=True)
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[-300:])
            raise BackendUnavailableError(
                f"building edgeline's ExecuTorch shim against {runtime.root} failed ({cxx}): {first.strip()[:300]}"
            )
        final = target / SHIM_NAME
        os.replace(partial, final)  # atomic: a concurrent builder's result is the same file
        return final
    raise BackendUnavailableError(
        f"nowhere to build edgeline's ExecuTorch shim ({'; '.join(errors) or 'no writable directory'}): "
        f"run `{INSTALL_COMMAND}` as the user who installed edgeline"
    )


def build_for_environment(*, say: Callable[[str], None] = print) -> Path:
    """Build the shim against the runtime this environment uses (``runtimes()[0]``) unless it is built; its path.
    For a workstation, whose executorch wheel came with the export extra: its setup (``scripts/setup.sh``) runs this
    after pip. A device gets its runtime and shim together from ``install``."""
    found = runtimes()
    if not found:
        raise BackendUnavailableError(
            f"no ExecuTorch C++ runtime here to build edgeline's shim against: run `{INSTALL_COMMAND}`"
        )
    runtime = found[0]
    shim = built_shim(runtime)
    if shim is None:
        say(f"building edgeline's ExecuTorch shim against {runtime.root} ({runtime.origin})")
        shim = build_shim(runtime)
    return shim


def _error_text(code: int, buffer: ctypes.Array[ctypes.c_char]) -> str:
    said = buffer.value.decode("utf-8", errors="replace").strip()
    name = ERRORS.get(code, f"error {code:#x}")
    return f"{said} ({name})" if said else name


class NativeRuntime:
    """The shim loaded into this process (one per process: ``NativeRuntime.get()``)."""

    _lock = threading.Lock()
    _loaded: NativeRuntime | None = None

    def __init__(self, runtime: RuntimeDir, shim: Path):
        self.runtime = runtime
        self.shim = shim
        try:
            self._lib = ctypes.CDLL(str(shim))
        except OSError as exc:
            raise BackendUnavailableError(f"could not load edgeline's ExecuTorch shim {shim}: {exc}") from exc
        lib = self._lib
        lib.edgeline_et_abi.restype = ctypes.c_int
        if lib.edgeline_et_abi() != ABI:
            raise BackendUnavailableError(f"{shim} speaks ABI {lib.edgeline_et_abi()}, this edgeline {ABI}")
        c_int_p = ctypes.POINTER(ctypes.c_int)
        c_int64_p = ctypes.POINTER(ctypes.c_int64)
        text = ctypes.c_char_p
        lib.edgeline_et_registered_backends.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.edgeline_et_set_threads.argtypes = [ctypes.c_int, c_int_p]
        lib.edgeline_et_open.argtypes = [
            text,
            text,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.edgeline_et_close.argtypes = [ctypes.c_void_p]
        lib.edgeline_et_close.restype = None
        lib.edgeline_et_count.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.edgeline_et_tensor_meta.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            c_int_p,
            c_int_p,
            c_int64_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.edgeline_et_method_backends.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.edgeline_et_run.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            c_int_p,
            c_int_p,
            c_int64_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.edgeline_et_output.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            c_int_p,
            c_int_p,
            c_int64_p,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]

    @classmethod
    def get(cls) -> NativeRuntime:
        """The torch-free runtime of this environment, loaded once (never built here: its shim is built at
        install); BackendUnavailableError says why there is none and how to get one, in one line."""
        with cls._lock:
            if cls._loaded is None:
                cls._loaded = cls._find()
            return cls._loaded

    @classmethod
    def _find(cls) -> NativeRuntime:
        found = runtimes()
        if not found:
            raise BackendUnavailableError(
                "no torch-free ExecuTorch runtime here: install one with `edgeline doctor --install executorch`"
            )
        runtime = found[0]  # the first is the one asked for: a broken one is reported, not skipped
        missing = runtime.missing()
        shim = built_shim(runtime) if missing is None else None
        if shim is None:
            raise BackendUnavailableError(
                f"the torch-free ExecuTorch runtime at {runtime.root} ({runtime.origin}) lacks {missing or _no_shim()}"
            )
        return cls(runtime, shim)

    @property
    def version(self) -> str | None:
        return self.runtime.version

    def backends(self) -> tuple[str, ...]:
        """The delegates this runtime registered (e.g. ``XnnpackBackend``)."""
        buffer = ctypes.create_string_buffer(_ERR_LEN)
        self._lib.edgeline_et_registered_backends(buffer, _ERR_LEN)
        return tuple(name for name in buffer.value.decode().split(",") if name)

    def set_threads(self, threads: int) -> int | None:
        """Size the thread pool the kernels and XNNPACK share (one per process); the size in force, or None when
        this runtime's pool cannot be reached (its functions not where the shim looks: it keeps its own size)."""
        current = ctypes.c_int(0)
        code = self._lib.edgeline_et_set_threads(threads, ctypes.byref(current))
        return current.value if code == 0 else None

    def open(self, path: Path, *, load: bool = True) -> NativeProgram:
        return NativeProgram(self, path, load=load)


@dataclass(frozen=True)
class TensorMeta:
    dtype: np.dtype
    shape: tuple[int, ...]


class NativeProgram:
    """One ``.pte``'s ``forward`` method, opened by the shim (``load=False``: its metadata only, which needs none
    of the delegates it was lowered to)."""

    def __init__(self, runtime: NativeRuntime, path: Path, *, load: bool = True):
        self._lib = runtime._lib
        self.path = path
        self._err = ctypes.create_string_buffer(_ERR_LEN)
        handle = ctypes.c_void_p()
        code = self._lib.edgeline_et_open(
            os.fsencode(path), b"forward", 1 if load else 0, ctypes.byref(handle), self._err, _ERR_LEN
        )
        if code != 0:
            raise BundleError(f"{path}: ExecuTorch could not load the program: {_error_text(code, self._err)}")
        self._handle = handle
        self._close = self._lib.edgeline_et_close
        self.inputs = [self._meta(0, index) for index in range(self._lib.edgeline_et_count(handle, 0))]
        self.outputs = [self._meta(1, index) for index in range(self._lib.edgeline_et_count(handle, 1))]
        buffer = ctypes.create_string_buffer(_ERR_LEN)
        self._lib.edgeline_et_method_backends(handle, buffer, _ERR_LEN)
        self.delegates = tuple(dict.fromkeys(name for name in buffer.value.decode().split(",") if name))
        count = len(self.inputs)
        self._data = (ctypes.c_void_p * max(count, 1))()
        self._types = (ctypes.c_int * max(count, 1))(*[_TYPE_CODES[meta.dtype] for meta in self.inputs])
        self._ranks = (ctypes.c_int * max(count, 1))(*[len(meta.shape) for meta in self.inputs])
        self._sizes = (ctypes.c_int64 * max(sum(len(meta.shape) for meta in self.inputs), 1))()
        self._run = self._lib.edgeline_et_run
        self._output = self._lib.edgeline_et_output
        self._out_data = ctypes.c_void_p()
        self._out_type = ctypes.c_int()
        self._out_rank = ctypes.c_int()
        self._out_sizes = (ctypes.c_int64 * _MAX_DIMS)()
        self._out_bytes = ctypes.c_size_t()

    def _meta(self, outputs: int, index: int) -> TensorMeta:
        dtype, rank, sizes = ctypes.c_int(), ctypes.c_int(), (ctypes.c_int64 * _MAX_DIMS)()
        code = self._lib.edgeline_et_tensor_meta(
            self._handle, outputs, index, ctypes.byref(dtype), ctypes.byref(rank), sizes, self._err, _ERR_LEN
        )
        if code != 0:
            raise BundleError(f"{self.path}: {_error_text(code, self._err)}")
        if dtype.value not in SCALAR_TYPES:
            kind = "output" if outputs else "input"
            raise BundleError(f"{self.path}: {kind} {index} has ExecuTorch dtype code {dtype.value}, not supported")
        return TensorMeta(SCALAR_TYPES[dtype.value], tuple(int(size) for size in sizes[: rank.value]))

    def close(self) -> None:
        handle, self._handle = self._handle, ctypes.c_void_p()
        if handle:
            self._close(handle)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self._close(handle)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The method on ``inputs`` (their dtypes the program's; any C-contiguous layout is passed as is, others
        made contiguous first); fresh output arrays. RuntimeError carries what the runtime said."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{len(inputs)} inputs for a method of {len(self.inputs)}")
        held = []
        position = 0
        for index, (array, meta) in enumerate(zip(inputs, self.inputs, strict=True)):
            if array.dtype != meta.dtype:
                raise ValueError(f"input {index} is {array.dtype}, the program takes {meta.dtype}")
            if array.ndim != len(meta.shape):
                raise ValueError(f"input {index} has rank {array.ndim}, the program takes {len(meta.shape)}")
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
            held.append(array)
            self._data[index] = array.__array_interface__["data"][0]
            for size in array.shape:
                self._sizes[position] = size
                position += 1
        code = self._run(
            self._handle, len(held), self._data, self._types, self._ranks, self._sizes, self._err, _ERR_LEN
        )
        if code != 0:
            raise RuntimeError(f"ExecuTorch: {_error_text(code, self._err)}")
        return [self._take(index) for index in range(len(self.outputs))]

    def _take(self, index: int) -> np.ndarray:
        code = self._output(
            self._handle,
            index,
            ctypes.byref(self._out_data),
            ctypes.byref(self._out_type),
            ctypes.byref(self._out_rank),
            self._out_sizes,
            ctypes.byref(self._out_bytes),
            self._err,
            _ERR_LEN,
        )
        if code != 0:
            raise RuntimeError(f"ExecuTorch: {_error_text(code, self._err)}")
        dtype = SCALAR_TYPES.get(self._out_type.value)
        if dtype is None:
            raise RuntimeError(f"ExecuTorch: output {index} has dtype code {self._out_type.value}, not supported")
        shape = tuple(self._out_sizes[: self._out_rank.value])
        nbytes = self._out_bytes.value
        if self._out_data.value is None or nbytes == 0:
            return np.zeros(shape, dtype)
        view = memoryview((ctypes.c_char * nbytes).from_address(self._out_data.value)).cast("B")
        return np.frombuffer(view, dtype=dtype).reshape(shape).copy()


# -- installing a runtime (edgeline doctor --install executorch) ------------------------------------------------


def _download_wheel(version: str, into: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"executorch=={version}",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--dest",
        str(into),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise BackendUnavailableError(
            f"pip download executorch=={version} took more than {DOWNLOAD_TIMEOUT_S:g} s"
        ) from None
    wheels = sorted(into.glob("executorch-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BackendUnavailableError(f"pip could not download executorch=={version} (no dependencies): {last[:300]}")
    return wheels[0]


def _unpack_wheel(wheel: Path, into: Path) -> None:
    """The wheel's libraries, headers and version into ``into`` (``lib/``, ``include/``, ``version.py``). Every
    member is checked before a byte is written: its name (no escape from ``into``) and its declared size."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise BackendUnavailableError(f"{wheel} is not a wheel (zip) file: {exc}") from exc
    with archive:
        members = [info for info in archive.infolist() if _WHEEL_MEMBERS.fullmatch(info.filename)]
        total = 0
        for info in members:
            parts = Path(info.filename).parts
            if ".." in parts or info.filename.startswith("/"):
                raise BackendUnavailableError(f"{wheel}: member {info.filename!r} escapes the package")
            if info.file_size > _MAX_MEMBER_BYTES:
                raise BackendUnavailableError(f"{wheel}: member {info.filename} declares {info.file_size} bytes")
            total += info.file_size
        if total > _MAX_TOTAL_BYTES:
            raise BackendUnavailableError(f"{wheel}: its runtime files declare {total} bytes")
        if not any(info.filename == "executorch/lib/libexecutorch.so" for info in members):
            raise BackendUnavailableError(f"{wheel} carries no executorch/lib/libexecutorch.so (not a 1.x wheel?)")
        for info in members:
            destination = into / Path(info.filename).relative_to("executorch")
            destination.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, destination.open("wb") as sink:
                copied = 0
                while chunk := source.read(1 << 20):
                    copied += len(chunk)
                    if copied > info.file_size:
                        raise BackendUnavailableError(f"{wheel}: {info.filename} is longer than it declares")
                    sink.write(chunk)
            if info.filename.startswith("executorch/lib/"):
                destination.chmod(0o755)


def install(
    *,
    source: Path | None = None,
    version: str = EXECUTORCH_VERSION,
    prefix: Path | None = None,
    say: Callable[[str], None] = print,
) -> NativeRuntime:
    """Put ExecuTorch's C++ runtime in ``prefix`` (default ``install_dir()``) and build the shim against it.

    ``source``: an executorch wheel file, or an executorch package directory (a workstation's installed wheel),
    instead of ``pip download executorch==VERSION --no-deps`` (pip's index and cache, nothing of torch). The new
    runtime replaces an old one only once it is complete. Returns the runtime, loaded.
    """
    if source is not None and not (source.is_dir() or source.is_file()):
        # a FIFO or a device would block the reader, or never end
        raise BackendUnavailableError(f"{source}: not an executorch wheel file or package directory")
    prefix = prefix or install_dir()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".executorch-", dir=prefix.parent))
    try:
        if source is not None and source.is_dir():
            say(f"copying ExecuTorch's C++ runtime from {source}")
            _copy_package(source, staging)
        else:
            wheel = source
            if wheel is None:
                say(f"downloading executorch=={version} (the wheel alone: its libraries, not torch)")
                wheel = _download_wheel(version, staging / "download")
            _unpack_wheel(wheel, staging)
            shutil.rmtree(staging / "download", ignore_errors=True)
        staged = RuntimeDir(staging, "installed")
        missing = staged.missing(shim=False)
        if missing is not None:
            raise BackendUnavailableError(f"the ExecuTorch runtime from {source or 'PyPI'} is incomplete: no {missing}")
        theirs, ours = _elf_machine(staged.lib / "libexecutorch.so"), _MACHINES.get(platform.machine().lower())
        if ours is not None and theirs != ours:
            raise BackendUnavailableError(
                f"the ExecuTorch runtime from {source or 'PyPI'} is built for {_machine_name(theirs)}, "
                f"this Python for {_machine_name(ours)}"
            )
        old = prefix.with_name(prefix.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if prefix.exists():
            prefix.rename(old)
        staging.rename(prefix)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    runtime = RuntimeDir(prefix, "installed")
    say(f"building edgeline's ExecuTorch shim against {prefix} ({runtime.version or 'version unknown'})")
    loaded = NativeRuntime(runtime, build_shim(runtime))
    with NativeRuntime._lock:
        NativeRuntime._loaded = None  # found again on next use: the install may not be the preferred runtime
    return loaded


_ELF_MACHINES = {3: "x86", 40: "arm", 62: "x86-64", 183: "aarch64", 243: "riscv"}
_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "armv7l": 40, "armv6l": 40, "i686": 3,
             "riscv64": 243}  # fmt: skip
"""``platform.machine()`` -> the ELF machine its libraries are built for: what this Python runs as (under qemu-user
the interpreter's own file may be a wrapper script, and the process's executable is qemu)."""


def _elf_machine(path: Path) -> int | None:
    """An ELF file's e_machine (the architecture it runs on), None when it is not one."""
    try:
        with path.open("rb") as file:
            header = file.read(20)
    except OSError:
        return None
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    return int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")


def _machine_name(machine: int | None) -> str:
    return "no ELF machine" if machine is None else _ELF_MACHINES.get(machine, f"ELF machine {machine}")


def _copy_package(package: Path, into: Path) -> None:
    if not (package / "lib" / "libexecutorch.so").is_file():
        raise BackendUnavailableError(f"{package} is not an executorch package directory (no lib/libexecutorch.so)")
    into.mkdir(parents=True, exist_ok=True)
    (into / "lib").mkdir()
    for name in (*RUNTIME_LIBRARIES, *DELEGATE_LIBRARIES.values()):
        library = package / "lib" / f"{name}.so"
        if library.is_file():
            shutil.copy2(library, into / "lib" / library.name)
    shutil.copytree(package / "include", into / "include")
    if (package / "version.py").is_file():
        shutil.copy2(package / "version.py", into / "version.py")
