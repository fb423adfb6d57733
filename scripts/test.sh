#!/usr/bin/env bash
# The test suite: lint (ruff), types (mypy), then the tests (pytest, on every core). Idempotent.
#
#   bash scripts/test.sh            the whole suite, every tier (README's test command, and CI's)
#   bash scripts/test.sh --quick    the quick tier only: what a developer runs between two edits (tests/tiers.py)
#   bash scripts/test.sh --no-vm    every tier but the vm tier's whole machines (docs/vm.md: minutes of CPU under
#                                   plain emulation); --vm, which added them when they were not the default, is kept
#
# Other arguments go to pytest after ours (`-n 0` runs in one process; `-k NAME`, `-x`, ...).
# EDGELINE_TEST_WORKERS sets how many test processes run (default: one per core).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tier=()
vm=1
args=()
for arg in "$@"; do
    case "$arg" in
        --quick) tier=(-m quick) vm=0 ;;
        --vm) ;;
        --no-vm) tier=(-m "not vm") vm=0 ;;
        *) args+=("$arg") ;;
    esac
done
bash scripts/setup.sh
. .venv/bin/activate
echo "== ruff" && ruff check . && ruff format --check .
echo "== mypy" && python -m tests.package_tree >/dev/null && mypy
prebuild=""
vm_prebuild=""
if [ "${tier[*]}" != "-m quick" ]; then
    # The emulated tier's installs (build/arm64: minutes under emulation the first time, seconds when up to date)
    # are built beside the other tiers rather than in front of the emulated tests, which tests/tiers.py runs last
    # and which wait for the build's lock. A failed build fails those tests, naming it.
    mkdir -p build
    { bash scripts/arm64.sh --info && bash scripts/arm64.sh --tflite-runtime --info; } >build/arm64-prebuild.log 2>&1 &
    prebuild=$!
    # The VM tier's image likewise (build/vm: minutes the first time, seconds when up to date); it needs root, as
    # its tests do (they are skipped otherwise).
    if [ "$vm" -eq 1 ] && [ "$(id -u)" -eq 0 ]; then
        bash scripts/vm.sh build >build/vm-prebuild.log 2>&1 &
        vm_prebuild=$!
    fi
fi
status=0
echo "== pytest"
pytest -n "${EDGELINE_TEST_WORKERS:-auto}" --dist worksteal "${tier[@]}" "${args[@]}" || status=$?
if [ -n "$prebuild" ] && ! wait "$prebuild"; then
    echo "test: building the emulated installs failed; see build/arm64-prebuild.log" >&2
fi
if [ -n "$vm_prebuild" ] && ! wait "$vm_prebuild"; then
    echo "test: building the VM image failed; see build/vm-prebuild.log" >&2
fi
exit "$status"
