#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv. Idempotent: a stamp of pyproject.toml
# skips pip when nothing changed. Sourced by demo.sh and test.sh; safe to run on its own.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "edgeline needs Python >= 3.10 (found $("$python" --version 2>&1))" >&2
    exit 2
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pip' >/dev/null 2>&1; then
    echo "setup: creating $venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
fi
stamp="$venv/.edgeline-install-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing edgeline with the export and dev extras (first time: a few minutes)" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # torch first, pinned exactly: the CPU build. A looser pin could pull the CUDA build (several GB).
    "$venv/bin/python" -m pip install --quiet "torch==2.13.0"
    "$venv/bin/python" -m pip install --quiet -e "$root[export,dev]"
    echo "$want" > "$stamp"
fi
