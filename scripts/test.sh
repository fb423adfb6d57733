#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), then every test (pytest). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
. .venv/bin/activate
echo "== ruff" && ruff check . && ruff format --check .
echo "== mypy" && python -m tests.package_tree >/dev/null && mypy
echo "== pytest" && pytest "$@"
