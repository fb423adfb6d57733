#!/usr/bin/env bash
# An emulated Raspberry Pi: run COMMAND inside an arm64 Debian 12 userland under qemu-user, with the CPU pinned.
#
#   scripts/arm64.sh [--cpu cortex-a72|cortex-a76|cortex-a55] [--tflite-runtime] COMMAND [ARG ...]
#   scripts/arm64.sh --cpu cortex-a76 edgeline infer BUNDLE --input VAL.npz --json
#   scripts/arm64.sh --info                  # what it uses, as JSON (builds it first)
#
# COMMAND is `edgeline`, `python`/`python3` or `pip` of the device install, or a program of the arm64 userland
# (`uname -m`, `cat /proc/cpuinfo`). The device install is edgeline's base install (`pip install -e .`: no torch, no
# extras) plus onnxruntime's CPU wheel, installed by the emulated Python's own pip, so pip picks the aarch64 wheels a
# Pi would get, and ExecuTorch's torch-free runtime (`edgeline doctor --install executorch`, its shim cross-compiled
# by the host's g++-aarch64-linux-gnu). `--tflite-runtime` runs in a second install with tflite-runtime 2.14 (built
# against numpy 1.x).
#
# - The emulator is qemu-user 10.0 from Debian's bookworm-backports (qemu-aarch64, a static binary taken out of the
#   qemu-user package: nothing is installed on the host). Debian 12's own qemu-user 7.2 passes the host's x86
#   /proc/cpuinfo through, and LiteRT's and onnxruntime's CPU detection crash on it; the script refuses a qemu older
#   than 10.
# - QEMU_CPU pins the core (default cortex-a72, a Raspberry Pi 4's). qemu's default, `max`, advertises SVE, SME,
#   i8mm and bf16 that a Pi 4 lacks, so a wheel built with them would pass here and die with SIGILL on the Pi.
# - The userland: Debian 12 arm64 packages (python3.11 and the C++ runtime the wheels need), fetched with apt into a
#   private apt state (the host's dpkg is not touched) and unpacked with dpkg -x into build/arm64/rootfs.
# - The host's files are visible at the same paths: qemu looks a path up in the userland first (QEMU_LD_PREFIX) and
#   falls back to the host's, so a bundle or data file named on the command line works unchanged. The network is
#   the host's (qemu-user emulates the CPU, not the kernel), so the host's loopback, and its broker, are reachable.
# - A program the emulated process starts (`sys.executable`, the `edgeline` entry point) runs emulated too: the
#   device install's `python` is a shell script that starts qemu-aarch64, so no binfmt_misc registration is needed.
#
# Built on first use, from Debian's and PyPI's registries only, and cached (stamps of what went into each part;
# locks for concurrent callers). Idempotent. The emulator, the userland and each install's dependencies (what the
# emulated pip installs for edgeline's base install: minutes the first time, pip runs emulated) are kept by
# content in $EDGELINE_ARM64_CACHE (default build/arm64), where they outlive a clone when it is set outside it
# (CI's /var/cache/edgeline/arm64): `deps-NAME-KEY/`, keyed by pyproject.toml's [project] table (not its extras)
# and build requirements, the requirements and the userland, shared by every clone that asks the same. Each
# clone's own install (build/arm64/venv, venv-tflite) is edgeline installed from its tree by the emulated pip
# (`pip install --no-deps -e .`) over those dependencies (a .pth adds their site-packages), plus ExecuTorch's
# runtime for the device install: about a minute of CPU instead of about five.
# EDGELINE_DEBIAN_MIRROR overrides the Debian mirror (default http://deb.debian.org).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="$root/build/arm64"
cache="${EDGELINE_ARM64_CACHE:-$base}"
mirror="${EDGELINE_DEBIAN_MIRROR:-http://deb.debian.org}"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
QEMU_MIN_MAJOR=10
ROOTFS_PACKAGES="python3.11 python3.11-venv libstdc++6 libgcc-s1 libgomp1 coreutils"
DEVICE_REQUIREMENTS='"onnxruntime>=1.24.2"'
INSTALL_LAYOUT=2  # bump when write_python, build_deps or build_venv change what an install holds: rebuilt
TFLITE_REQUIREMENTS='"tflite-runtime==2.14.0" "numpy>=1.24,<2"'

usage() {
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
cpu="${EDGELINE_ARM64_CPU:-cortex-a72}"
flavour=device
info=0
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) [ $# -ge 2 ] || usage; cpu="$2"; shift 2 ;;
        --cpu=*) cpu="${1#--cpu=}"; shift ;;
        --tflite-runtime) flavour=tflite; shift ;;
        --info) info=1; shift ;;
        -h|--help) usage ;;
        --) shift; break ;;
        -*) echo "arm64.sh: error: unrecognized option $1" >&2; usage ;;
        *) break ;;
    esac
done
case "$cpu" in
    cortex-a72|cortex-a76|cortex-a55) ;;
    *) echo "arm64.sh: error: --cpu $cpu: choose cortex-a72 (Raspberry Pi 4), cortex-a76 (Pi 5) or cortex-a55 (i.MX 93)" >&2; exit 2 ;;
esac
[ $# -gt 0 ] || [ "$info" = 1 ] || usage

say() { echo "arm64.sh: $*" >&2; }
die() { echo "arm64.sh: error: $*" >&2; exit 1; }
run_logged() {  # WHAT COMMAND...: quiet unless it fails
    local log
    log="$(mktemp)"
    if ! "${@:2}" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        rm -f "$log"
        die "$1 failed (output above)"
    fi
    rm -f "$log"
}
stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

# A private apt: its own sources, state and cache under build/arm64/apt/ARCH; the host's apt and dpkg are not touched.
apt_private() {  # ARCH SUITES... -- APT-GET ARGS...
    local arch="$1"; shift
    local dir="$cache/apt/$arch" suites=()
    while [ "$1" != "--" ]; do suites+=("$1"); shift; done
    shift
    mkdir -p "$dir/lists/partial" "$dir/archives/partial"
    : > "$dir/sources.list"
    local suite
    for suite in "${suites[@]}"; do
        case "$suite" in
            *-security) echo "deb [signed-by=$keyring] $mirror/debian-security $suite main" ;;
            *) echo "deb [signed-by=$keyring] $mirror/debian $suite main" ;;
        esac >> "$dir/sources.list"
    done
    [ -f "$dir/status" ] || : > "$dir/status"
    local sandbox=()
    [ "$(id -u)" -ne 0 ] || sandbox=(-o APT::Sandbox::User=root)
    apt-get -q -o Dir::Etc::SourceList="$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null \
        -o Dir::State="$dir" -o Dir::State::Lists="$dir/lists" -o Dir::State::status="$dir/status" \
        -o Dir::Cache="$dir" -o Dir::Cache::Archives="$dir/archives" \
        -o APT::Architecture="$arch" -o APT::Architectures="$arch" -o APT::Install-Recommends=false \
        -o Debug::NoLocking=1 "${sandbox[@]}" "$@"
}

build_qemu() {
    local want="qemu-user bookworm-backports $mirror"
    if ! stamp_ok "$cache/qemu/.stamp" "$want" || [ ! -x "$cache/qemu/qemu-aarch64" ]; then
        [ -r "$keyring" ] || die "$keyring is missing (Debian's debian-archive-keyring package)"
        say "fetching qemu-user from Debian's bookworm-backports (first use)"
        rm -rf "$cache/qemu" "$cache/apt/amd64/archives"
        run_logged "apt-get update (amd64, bookworm-backports)" apt_private amd64 bookworm-backports -- update
        run_logged "apt-get download qemu-user" apt_private amd64 bookworm-backports -- \
            install -y --download-only --no-install-recommends -t bookworm-backports qemu-user
        local deb
        deb="$(ls "$cache"/apt/amd64/archives/qemu-user_*.deb 2>/dev/null | head -n 1)"
        [ -n "$deb" ] || die "apt did not download qemu-user"
        local unpack="$cache/qemu.unpack"
        rm -rf "$unpack" && mkdir -p "$unpack" "$cache/qemu"
        dpkg -x "$deb" "$unpack"
        cp "$unpack/usr/bin/qemu-aarch64" "$cache/qemu/qemu-aarch64"
        rm -rf "$unpack" "$cache/apt/amd64/archives"
        echo "$want" > "$cache/qemu/.stamp"
    fi
    qemu="$cache/qemu/qemu-aarch64"
    qemu_version="$("$qemu" --version | head -n 1)"
    local major
    major="$(echo "$qemu_version" | sed -n 's/^qemu-aarch64 version \([0-9]*\)\..*/\1/p')"
    [ -n "$major" ] && [ "$major" -ge "$QEMU_MIN_MAJOR" ] \
        || die "$qemu is '$qemu_version'; need qemu-user >= $QEMU_MIN_MAJOR (7.2 passes the host's /proc/cpuinfo through)"
}

build_rootfs() {
    local want="$ROOTFS_PACKAGES bookworm $mirror"
    if stamp_ok "$cache/rootfs/.stamp" "$want" && [ -x "$cache/rootfs/usr/bin/python3.11" ]; then
        return
    fi
    say "fetching Debian 12 arm64 packages for the userland (first use): $ROOTFS_PACKAGES"
    rm -rf "$cache/rootfs" "$cache/apt/arm64/archives"
    run_logged "apt-get update (arm64)" apt_private arm64 bookworm bookworm-updates bookworm-security -- update
    # An empty dpkg status: apt downloads every dependency, as for an empty system.
    run_logged "apt-get download (arm64)" apt_private arm64 bookworm bookworm-updates bookworm-security -- \
        install -y --download-only $ROOTFS_PACKAGES
    mkdir -p "$cache/rootfs"
    local deb
    for deb in "$cache"/apt/arm64/archives/*.deb; do
        dpkg -x "$deb" "$cache/rootfs"
    done
    rm -rf "$cache/apt/arm64/archives"
    echo "$want" > "$cache/rootfs/.stamp"
}

write_python() {  # VENV: its bin/python, a host shell script that starts the emulated interpreter
    local venv="$1"
    mkdir -p "$venv/bin" "$venv/lib/python3.11/site-packages"
    printf 'home = %s\ninclude-system-site-packages = false\nversion = 3.11\n' "$cache/rootfs/usr/bin" > "$venv/pyvenv.cfg"
    cat > "$venv/bin/python" <<EOF
#!/bin/sh
# The emulated Python of this install (scripts/arm64.sh): qemu-aarch64 runs Debian's arm64 python3.11.
export QEMU_LD_PREFIX="$cache/rootfs"
export QEMU_CPU="\${QEMU_CPU:-cortex-a72}"
export EDGELINE_EMULATOR="qemu-user \$("$qemu" --version | sed -n '1s/^qemu-aarch64 version \([^ ]*\).*/\1/p') -cpu \$QEMU_CPU"
exec "$qemu" -0 "\$0" "$cache/rootfs/usr/bin/python3.11" "\$@"
EOF
    chmod +x "$venv/bin/python"
    ln -sf python "$venv/bin/python3"
    ln -sf python "$venv/bin/python3.11"
}

pip_emulated() {  # VENV WHAT PIP-INSTALL-ARGS...: the emulated pip of VENV installs, quiet unless it fails
    local venv="$1" what="$2"
    shift 2
    run_logged "$what" env QEMU_CPU=cortex-a72 "$venv/bin/python" -m pip install \
        --disable-pip-version-check --no-input --retries 2 --timeout 60 "$@"
}

build_deps() {  # NAME REQUIREMENTS: sets $deps, the dependencies of edgeline's base install plus REQUIREMENTS as the
    # emulated pip installs them, kept by content in the cache (a venv whose edgeline was installed, then removed:
    # what pip picked for it stays)
    local name="$1" requirements="$2" key building
    # What edgeline's own build needs (pyproject's [build-system] requires, e.g. "setuptools>=77"), installed with
    # them: each clone installs edgeline without an isolated build environment (no emulated pip fetching setuptools).
    building="$(sed -n '/^\[build-system\]$/,/^\[/s/^requires = \[\(.*\)\]$/\1/p' "$root/pyproject.toml" \
        | tr ',' ' ')"
    # What they depend on: pyproject's [project] table (its dependencies; not the extras, scripts or tool settings),
    # its build requirements, the requirements, the userland and how an install is laid out.
    key="$({ sed -n '/^\[project\]$/,/^\[/p' "$root/pyproject.toml"; echo "$INSTALL_LAYOUT $requirements $building"
        cat "$cache/rootfs/.stamp"; } | sha256sum | cut -c1-20)"
    deps="$cache/deps-$name-$key"
    if [ -f "$deps/.complete" ]; then
        return
    fi
    exec 7>"$deps.lock"
    flock 7  # another clone building the same: wait for it, then take it
    if [ ! -f "$deps/.complete" ]; then
        say "installing edgeline's dependencies into the emulated $name install ($deps; first use: minutes," \
            "pip runs emulated)"
        rm -rf "$deps"
        write_python "$deps"
        run_logged "ensurepip (emulated)" env QEMU_CPU=cortex-a72 "$deps/bin/python" -m ensurepip --default-pip
        # shellcheck disable=SC2086  # the requirements are quoted words
        eval "set -- $requirements $building"
        pip_emulated "$deps" "pip install (emulated)" -e "$root" "$@"
        run_logged "pip uninstall edgeline (emulated)" env QEMU_CPU=cortex-a72 "$deps/bin/python" -m pip uninstall \
            --disable-pip-version-check --no-input -y edgeline
        echo "$key" > "$deps/.complete"
    fi
    flock -u 7
    exec 7>&-
}

build_venv() {  # NAME REQUIREMENTS: this clone's install, edgeline from this tree over the cached dependencies
    local venv="$base/$1" want
    build_deps "$1" "$2"
    want="$deps $root $INSTALL_LAYOUT"
    if stamp_ok "$venv/.stamp" "$want" && [ -x "$venv/bin/python" ]; then
        return
    fi
    say "installing edgeline from $root into the emulated $1 install ($venv) over the dependencies in $deps"
    rm -rf "$venv"
    write_python "$venv"
    printf "import site; site.addsitedir('%s')\n" "$deps/lib/python3.11/site-packages" \
        > "$venv/lib/python3.11/site-packages/_edgeline_dependencies.pth"
    pip_emulated "$venv" "pip install --no-deps -e (emulated)" --no-deps --no-build-isolation -e "$root"
    echo "$want" > "$venv/.stamp"
}

install_executorch() {  # VENV: ExecuTorch's torch-free runtime, installed as on a Pi (the emulated `edgeline doctor
    # --install executorch`: pip downloads the aarch64 executorch wheel alone), its shim compiled by the host's
    # aarch64 cross g++ (Debian's g++-aarch64-linux-gnu): a Pi compiles it with its own g++, which qemu-user cannot
    # run here (g++'s own subprocesses would need binfmt_misc). A stamp of the shim's sources keeps it.
    local venv="$1" want
    want="$(cat "$root/edge_runtime/executorch_native.py" "$root/edge_runtime/executorch_shim.cpp" | sha256sum | cut -d' ' -f1)"
    if stamp_ok "$venv/.executorch-stamp" "$want"; then
        return
    fi
    command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 \
        || die "aarch64-linux-gnu-g++ is missing: apt-get install g++-aarch64-linux-gnu (scripts/setup.sh installs it)"
    say "installing ExecuTorch's torch-free runtime into the emulated install (edgeline doctor --install executorch)"
    run_logged "edgeline doctor --install executorch (emulated)" env QEMU_CPU=cortex-a72 CXX=aarch64-linux-gnu-g++ \
        "$venv/bin/python" -m edgeline.cli doctor --install executorch
    echo "$want" > "$venv/.executorch-stamp"
}

mkdir -p "$base" "$cache"
exec 9>"$cache/.lock"
flock 9  # concurrent callers wait for one build of what every install shares
build_qemu
build_rootfs
flock -u 9
# Each install has a lock of its own: a caller of the device install never waits for the tflite-runtime install that
# scripts/test.sh builds beside the tests (minutes of emulated pip on a fresh clone).
exec 8>"$base/.lock-$flavour"
flock 8
case "$flavour" in
    device) build_venv venv "$DEVICE_REQUIREMENTS"; install_executorch "$base/venv" ;;
    tflite) build_venv venv-tflite "$TFLITE_REQUIREMENTS" ;;
esac
flock -u 8
venv="$base/$([ "$flavour" = device ] && echo venv || echo venv-tflite)"

export QEMU_CPU="$cpu"
export QEMU_LD_PREFIX="$cache/rootfs"
# Emulated, numpy's OpenBLAS worker thread spins for the whole life of the process, BLAS call or not, and takes a
# second host core (benchmarks/results/emulated_infer.md). edgeline's inference makes no BLAS call: one thread.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export PATH="$venv/bin:$PATH"
unset PYTHONHOME PYTHONPATH VIRTUAL_ENV
export VIRTUAL_ENV="$venv"

if [ "$info" = 1 ]; then
    exec "$venv/bin/python" - "$qemu_version" "$cpu" "$cache/rootfs" "$venv" <<'PY'
import json, platform, sys
from importlib import metadata
names = ("edgeline", "numpy", "ai-edge-litert", "onnxruntime", "tflite-runtime")
versions = {}
for name in names:
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps({"qemu": sys.argv[1], "cpu": sys.argv[2], "rootfs": sys.argv[3], "install": sys.argv[4],
                  "machine": platform.machine(), "python": platform.python_version(), "packages": versions}))
PY
fi

command="$1"
shift
case "$command" in
    edgeline) exec "$venv/bin/python" -m edgeline.cli "$@" ;;
    python|python3|python3.11) exec "$venv/bin/python" "$@" ;;
    pip|pip3) exec "$venv/bin/python" -m pip "$@" ;;
esac
for entry in "$venv/bin/$command" "$deps/bin/$command"; do
    if [ -f "$entry" ]; then
        exec "$venv/bin/python" "$entry" "$@"  # another entry point of the install or of its dependencies
    fi
done
for dir in usr/bin bin usr/sbin sbin; do
    if [ -x "$cache/rootfs/$dir/$command" ]; then
        exec "$qemu" -0 "$command" "$cache/rootfs/$dir/$command" "$@"
    fi
done
case "$command" in
    */*) [ -x "$command" ] && exec "$qemu" "$command" "$@" ;;
esac
die "no program '$command' in the emulated userland: edgeline, python, pip, or one of $cache/rootfs/usr/bin"
