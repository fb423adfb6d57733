#!/usr/bin/env bash
# A whole emulated machine: Debian 12 (x86-64) booted with QEMU, systemd, Mosquitto and edgeline's device install
# (the base install, no torch) inside, with the project's unit (edgeline@.service). edgeline.sim.vm does the work.
#
#   scripts/vm.sh build                  # the disk image, cached under build/vm by its inputs (root: mmdebstrap)
#   scripts/vm.sh run [--forward HOST_PORT[:GUEST_PORT]] [--share DIR] [--timeout S] [--write-log FILE] COMMAND
#   scripts/vm.sh run 'systemctl is-system-running --wait; edgeline --version'
#   scripts/vm.sh power-cut [--cuts N] [--seed S] [--seconds S] [--rate HZ] [--boot K]   # edgeline.sim.powercut_vm
#
# `run` boots the image (KVM when /dev/kvm is usable, else plain emulation, said) on a throwaway overlay, runs
# COMMAND (shell text, as root, in /host: the shared folder) at boot, prints its output and exits with its status.
# The guest reaches the host's 127.0.0.1:HOST_PORT at 10.0.2.100:GUEST_PORT (default 1883), and nothing else.
# The first build takes minutes (mmdebstrap, pip download); a source change rebuilds the top layer only (seconds).
# Runs in the project's Python (.venv, from scripts/setup.sh, or the one on PATH): it needs pip and setuptools.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python=python3
if [ -x "$root/.venv/bin/python" ]; then
    python="$root/.venv/bin/python"
fi
export PATH="$PATH:/usr/sbin:/sbin"  # mke2fs, chroot
if [ "${1:-}" = power-cut ]; then  # a recording with the disk's writes logged, cut N times, checked (issue 35)
    shift
    exec "$python" -m edgeline.sim.powercut_vm "$@"
fi
exec "$python" -m edgeline.sim.vm "$@"
