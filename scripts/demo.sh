#!/usr/bin/env bash
# The main job, end to end: train the digits reference model on scikit-learn's real digits data,
# export it for a Raspberry Pi 5, then run the bundle on held-out samples with the device runtime and
# print its accuracy next to the float model's. Idempotent: reruns reuse the trained model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
. .venv/bin/activate
work="artifacts/demo"
mkdir -p "$work"

echo "== 1/3 train the digits reference model (held-out split, fixed seed)"
edgeline reference prepare digits --out "$work"

echo "== 2/3 export it for rpi5 (the profile's targets in order; first within budget wins)"
edgeline export "$work/digits/model.pt2" --profile rpi5 \
    --calibration "$work/digits/calibration.npz" --validation "$work/digits/validation.npz" \
    --labels "$work/digits/labels.txt" --name digits --out "$work/bundles/digits" --force 2>"$work/export.log" \
    || { cat "$work/export.log" >&2; exit 1; }

echo "== 3/3 verify the bundle and run it on the held-out digits with the device runtime (no torch)"
edgeline verify "$work/bundles/digits" 2>/dev/null
edgeline infer "$work/bundles/digits" --input "$work/digits/validation.npz" 2>/dev/null
