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
# The integration tests start a real Mosquitto and drive it with its own clients: Debian's packages; the TLS
# tests make their certificates with the openssl command; the completion tests run the zsh script in zsh; the
# firmware bridge's C side is built with the host's gcc and with arm-none-eabi-gcc, and run on QEMU's emulated
# Cortex-M boards; the VM tier (scripts/vm.sh) builds a Debian image with mmdebstrap and mke2fs and boots it with
# qemu-system-x86_64 (overlays by qemu-img, port forwards by socat); ExecuTorch's torch-free runtime builds edgeline's
# shim with g++ (and, for the emulated Pi of scripts/arm64.sh, with g++-aarch64-linux-gnu). (/usr/sbin, where the
# broker and mke2fs live, is not on a normal user's PATH.) `edgeline sim camera` serves RTSP with GStreamer's RTSP
# server through PyGObject, run by the system python3 (sim/camera_rtsp.py): Debian has openh264enc (plugins-bad), not
# x264enc; jpegenc and rtpjpegpay are in plugins-good.
PACKAGES="mosquitto mosquitto-clients openssl zsh gcc gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-system-arm"
PACKAGES+=" mmdebstrap e2fsprogs qemu-system-x86 qemu-utils socat g++ g++-aarch64-linux-gnu"
PACKAGES+=" python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-rtsp gir1.2-gst-plugins-base-1.0"
PACKAGES+=" gstreamer1.0-plugins-good gstreamer1.0-plugins-bad"
have_rtsp_server() {
    [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import gi
gi.require_version("Gst", "1.0"); gi.require_version("GstRtspServer", "1.0")
from gi.repository import Gst, GstRtspServer
Gst.init(None)
missing = [n for n in ("appsrc", "videoconvert", "openh264enc", "h264parse", "rtph264pay", "jpegenc", "rtpjpegpay")
           if Gst.ElementFactory.find(n) is None]
raise SystemExit(1 if missing else 0)' >/dev/null 2>&1
}
have_mosquitto() {
    { command -v mosquitto || [ -x /usr/sbin/mosquitto ]; } >/dev/null 2>&1 \
        && command -v mosquitto_pub >/dev/null 2>&1 && command -v mosquitto_sub >/dev/null 2>&1 \
        && command -v openssl >/dev/null 2>&1 && command -v zsh >/dev/null 2>&1 \
        && command -v gcc >/dev/null 2>&1 && command -v arm-none-eabi-gcc >/dev/null 2>&1 \
        && command -v qemu-system-arm >/dev/null 2>&1 && command -v mmdebstrap >/dev/null 2>&1 \
        && { command -v mke2fs || [ -x /usr/sbin/mke2fs ] || [ -x /sbin/mke2fs ]; } >/dev/null 2>&1 \
        && command -v qemu-system-x86_64 >/dev/null 2>&1 && command -v qemu-img >/dev/null 2>&1 \
        && command -v socat >/dev/null 2>&1 \
        && command -v g++ >/dev/null 2>&1 && command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 \
        && have_rtsp_server
}
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}
if ! have_mosquitto; then
    if ! command -v apt-get >/dev/null 2>&1 || { [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; }; then
        echo "setup: Debian packages are missing and cannot be installed here (needs apt-get, as root or with sudo);" \
            "install these yourself: $PACKAGES" >&2
        exit 2
    fi
    echo "setup: installing Debian's $PACKAGES (apt-get)" >&2
    apt_log="$(mktemp)"
    if ! { as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
        && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PACKAGES; } \
        >"$apt_log" 2>&1 || ! have_mosquitto; then
        cat "$apt_log" >&2
        rm -f "$apt_log"
        echo "setup: could not install $PACKAGES with apt-get (output above)" >&2
        exit 2
    fi
    rm -f "$apt_log"
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pip' >/dev/null 2>&1; then
    echo "setup: creating $venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
fi
stamp="$venv/.edgeline-install-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing edgeline with the export, dev and camera extras (first time: a few minutes)" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # torch first, pinned exactly: the CPU build. A looser pin could pull the CUDA build (several GB).
    "$venv/bin/python" -m pip install --quiet "torch==2.13.0"
    "$venv/bin/python" -m pip install --quiet -e "$root[export,dev,camera]"
    echo "$want" > "$stamp"
fi
# ExecuTorch's torch-free runtime: the export extra's executorch wheel carries its C++ libraries, and edgeline's shim
# over them is built here, at install, never at first use (a device gets both from `edgeline doctor --install
# executorch`). Rebuilt when the shim's source or its builder changes, or pip ran again; a stamp of those and the
# shim's path skips Python when nothing did.
shim_stamp="$venv/.edgeline-executorch-shim"
shim_want="$(cat "$root/edge_runtime/executorch_native.py" "$root/edge_runtime/executorch_shim.cpp" "$stamp" \
    | sha256sum | cut -d' ' -f1)"
if [ ! -f "$shim_stamp" ] || [ "$(sed -n 1p "$shim_stamp")" != "$shim_want" ] \
    || [ ! -f "$(sed -n 2p "$shim_stamp")" ]; then
    if ! shim="$("$venv/bin/python" - <<'PY'
import sys

from edgeline.errors import EdgelineError
from edgeline.executorch_native import build_for_environment

try:
    print(build_for_environment(say=lambda line: print(f"setup: {line}", file=sys.stderr)))
except EdgelineError as exc:
    sys.exit(f"setup: {exc}")
PY
)"; then
        exit 2
    fi
    printf '%s\n%s\n' "$shim_want" "$shim" > "$shim_stamp"
fi
