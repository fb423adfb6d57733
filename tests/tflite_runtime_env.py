"""A separate virtualenv with the legacy ``tflite-runtime`` package, for ``tests/test_tflite_runtime.py``.

tflite-runtime 2.14.0 is the package's last release. It is built against numpy 1.x (its Interpreter fails with
numpy 2) and has Python 3.11 wheels only for manylinux x86-64 (manylinux2014) and aarch64 (manylinux_2_34), none for
3.12+. It cannot share the main environment, so the test builds its own once and reuses it:

    .venv-tflite/            (repo root; ignored by git)
        lock                 flock'd while the environment is checked or built
        venv/                python -m venv + tflite-runtime, numpy<2, pydantic: no torch, no ai-edge-litert
        ready.json           written last: what was asked for and what got installed; absent = rebuild

The repository is made importable through PYTHONPATH (``edgeline`` as a tree of links in build/, see
``tests/package_tree.py``), so nothing is built or installed from the work tree.

    python -m tests.tflite_runtime_env      # build or check it ahead of the tests (e.g. a CI cache step)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.package_tree import package_tree

__all__ = ["CACHE_DIR", "FORBIDDEN_MODULES", "REPO", "REQUIREMENTS", "TFLiteEnv", "TFLiteEnvError", "ensure_env"]

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".venv-tflite"
REQUIREMENTS: tuple[str, ...] = (
    "tflite-runtime==2.14.0",
    "numpy>=1.24,<2",
    "pydantic>=2.6,<3",
    "tomli>=2.0; python_version < '3.11'",
)
# What the environment must not have: the point is to prove the tflite-runtime-only path.
FORBIDDEN_MODULES: tuple[str, ...] = ("torch", "ai_edge_litert")

VENV_TIMEOUT = 180
PIP_TIMEOUT = 900
PROBE_TIMEOUT = 120

_PROBE = """\
import importlib.metadata as md, importlib.util, json, sys
import numpy, tflite_runtime.interpreter
print(json.dumps({
    "python": sys.version.split()[0],
    "numpy": numpy.__version__,
    "tflite-runtime": md.version("tflite-runtime"),
    "pydantic": md.version("pydantic"),
    "forbidden_installed": [n for n in sys.argv[1:] if importlib.util.find_spec(n) is not None],
}))
"""


class TFLiteEnvError(RuntimeError):
    """The tflite-runtime environment could not be built or is unusable."""


@dataclass(frozen=True)
class TFLiteEnv:
    python: Path
    env: dict[str, str]  # for subprocesses: this repository on PYTHONPATH, nothing of the caller's environment
    versions: dict[str, str]
    built: bool  # False when an existing environment was reused
    seconds: float  # time spent in ensure_env (building or checking)

    def run(self, args: Sequence[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``python ARGS`` in the environment; raises ``subprocess.TimeoutExpired`` past ``timeout``."""
        return subprocess.run(
            [str(self.python), *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )


def subprocess_env() -> dict[str, str]:
    """The caller's environment without its virtualenv or Python path, with this repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(package_tree()), str(REPO)])  # edgeline, and tests
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(what: str, command: Sequence[str], timeout: float, env: dict[str, str], hint: str = "") -> str:
    try:
        proc = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise TFLiteEnvError(f"{what} did not finish in {timeout} s{hint}: {' '.join(command)}") from None
    if proc.returncode != 0:
        raise TFLiteEnvError(
            f"{what} failed (exit {proc.returncode}){hint}: {' '.join(command)}\n{_tail(proc.stderr or proc.stdout)}"
        )
    return proc.stdout


def _spec() -> dict[str, object]:
    return {
        "requirements": list(REQUIREMENTS),
        "base_python": os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
        "python_version": sys.version.split()[0],
    }


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _probe(python: Path, env: dict[str, str]) -> dict[str, str]:
    out = _run(
        "checking the tflite-runtime environment", [str(python), "-c", _PROBE, *FORBIDDEN_MODULES], PROBE_TIMEOUT, env
    )
    versions = json.loads(out.strip().splitlines()[-1])
    forbidden = versions.pop("forbidden_installed")
    if forbidden:
        raise TFLiteEnvError(f"the tflite-runtime environment must not have {', '.join(forbidden)}")
    return versions


def _build(venv: Path, env: dict[str, str]) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    # sys.executable may itself be a venv's python; venv then uses the base interpreter, without its packages.
    _run("creating the virtualenv", [sys.executable, "-m", "venv", str(venv)], VENV_TIMEOUT, env)
    pip = [str(_venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    hint = (
        f" (installing {', '.join(REQUIREMENTS[:3])} into {venv}; is the package index reachable? "
        "CI installs from PyPI too, so this is a failure, not a skip)"
    )
    _run("pip install", [*pip, "--retries", "2", "--timeout", "60", *REQUIREMENTS], PIP_TIMEOUT, env, hint)


def ensure_env(cache_dir: Path = CACHE_DIR) -> TFLiteEnv:
    """The tflite-runtime environment, built on first use and reused while its requirements stay the same."""
    started = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    venv = cache_dir / "venv"
    marker = cache_dir / "ready.json"
    env = subprocess_env()
    spec = _spec()
    with open(cache_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; concurrent sessions wait here
        built = False
        versions: dict[str, str] | None = None
        try:
            ready = json.loads(marker.read_text())
        except (OSError, ValueError):
            ready = None
        if isinstance(ready, dict) and ready.get("spec") == spec and _venv_python(venv).exists():
            try:
                versions = _probe(_venv_python(venv), env)
            except TFLiteEnvError:
                versions = None  # e.g. its base interpreter went away: rebuild
        if versions is None:
            marker.unlink(missing_ok=True)  # a half-built environment never looks ready
            _build(venv, env)
            versions = _probe(_venv_python(venv), env)
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"spec": spec, "versions": versions}, indent=2) + "\n")
            os.replace(tmp, marker)
            built = True
    return TFLiteEnv(_venv_python(venv), env, versions, built, time.perf_counter() - started)


if __name__ == "__main__":
    try:
        result = ensure_env()
    except TFLiteEnvError as error:
        sys.exit(f"error: {error}")
    action = "built" if result.built else "reused"
    print(f"{action} {result.python} in {result.seconds:.1f} s: {json.dumps(result.versions)}")
