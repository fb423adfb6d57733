#!/usr/bin/env bash
# The device tier: edgeline's base install (`pip install edgeline`: what a device runs) with the torch-free runtimes a
# device adds (the openvino extra, ExecuTorch's C++ runtime) in a venv of its own, build/device-venv, without torch, and the tests marked `device` (but not `workstation`) run in it. A device dependency that only the
# workstation happens to have fails here. Idempotent: a stamp of pyproject.toml and this script skips pip when
# nothing changed. Needs Debian's mosquitto and clients (scripts/setup.sh installs them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/build/device-venv"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pip' >/dev/null 2>&1; then
    echo "test_device: creating $venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
fi
stamp="$venv/.edgeline-install-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/test_device.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "test_device: installing edgeline (its openvino and camera extras), pytest (xdist, timeout) and hypothesis" >&2
    pip_log="$venv/pip.log"
    if ! { "$venv/bin/python" -m pip install --quiet --upgrade pip \
        && "$venv/bin/python" -m pip install --quiet -e "$root[openvino,camera]" "pytest>=8" "pytest-xdist>=3.5" "pytest-timeout>=2.3" "hypothesis>=6"; } >"$pip_log" 2>&1; then
        cat "$pip_log" >&2
        echo "test_device: pip could not install the base install (output above)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
# The point of the tier: the base install must not bring torch (nor anything of the export extra) along.
if ! "$venv/bin/python" - <<'PY'
import importlib.util, sys
found = [name for name in ("torch", "executorch", "litert_torch", "ai_edge_quantizer", "sklearn")
         if importlib.util.find_spec(name) is not None]
if found:
    sys.exit(f"test_device: the base install brought {', '.join(found)} (export extra) into {sys.prefix}")
PY
then
    exit 1
fi
# ExecuTorch's torch-free runtime, as a device gets it: the command the README names (the executorch wheel's C++
# libraries, fetched without dependencies, and edgeline's shim built against them). Idempotent: kept while its
# libraries and the shim's source are unchanged.
et_stamp="$venv/.edgeline-executorch-stamp"
et_want="$(cat "$root/edge_runtime/executorch_native.py" "$root/edge_runtime/executorch_shim.cpp" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$et_stamp" ] || [ "$(cat "$et_stamp")" != "$et_want" ]; then
    echo "test_device: installing ExecuTorch's torch-free runtime (edgeline doctor --install executorch)" >&2
    if ! "$venv/bin/edgeline" doctor --install executorch >"$venv/executorch-install.log" 2>&1; then
        cat "$venv/executorch-install.log" >&2
        echo "test_device: edgeline doctor --install executorch failed (output above)" >&2
        exit 1
    fi
    echo "$et_want" > "$et_stamp"
fi
echo "== pytest (device tier: no torch)"
"$venv/bin/python" -m pytest -m "device and not workstation" -p no:cacheprovider \
    -n "${EDGELINE_TEST_WORKERS:-auto}" --dist worksteal "$@"
