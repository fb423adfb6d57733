#!/usr/bin/env bash
# The main job, end to end: train the digits reference model on scikit-learn's real digits data, export it
# for a Raspberry Pi 5, check it on held-out samples with the device runtime (accuracy next to the float
# model's), then stream: a local Mosquitto, simulated digit cameras publishing held-out images, and the
# daemon answering each one live; stopped cleanly. Last, a signed update reaches a simulated fleet of three
# daemons: a canary first, then a wave; each device tries the new version beside the one it runs before it commits.
# Idempotent: reruns reuse the trained model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
. .venv/bin/activate
work="artifacts/demo"
mkdir -p "$work"

echo "== 1/5 train the digits reference model (held-out split, fixed seed)"
edgeline reference prepare digits --out "$work"

echo "== 2/5 export it for rpi5 (the profile's targets in order; first within budget wins)"
edgeline export "$work/digits/model.pt2" --profile rpi5 \
    --calibration "$work/digits/calibration.npz" --validation "$work/digits/validation.npz" \
    --labels "$work/digits/labels.txt" --name digits --version 1 --out "$work/bundles/digits" --force 2>"$work/export.log" \
    || { cat "$work/export.log" >&2; exit 1; }

echo "== 3/5 verify the bundle and run it on the held-out digits with the device runtime (no torch)"
edgeline verify "$work/bundles/digits" 2>/dev/null
edgeline infer "$work/bundles/digits" --input "$work/digits/validation.npz" 2>/dev/null

echo "== 4/5 stream: local Mosquitto <- 3 simulated digit cameras; edgeline run answers every image"
port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$port" > "$work/mosquitto.conf"
[ "$(id -u)" -eq 0 ] && echo "user root" >> "$work/mosquitto.conf"
mosquitto_bin="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
"$mosquitto_bin" -c "$work/mosquitto.conf" > "$work/mosquitto.log" 2>&1 & pids+=($!)
python - "$port" <<'PY'
import socket, sys, time
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=0.5).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.05)
sys.exit("mosquitto did not start: see artifacts/demo/mosquitto.log")
PY
: > "$work/results.jsonl"
# No topic flags: run and sim meet on sensors/{device}/{sensor} at QoS 1 by default.
edgeline run "$work/bundles/digits" --broker "127.0.0.1:$port" --publish 'results/{device}' --stdout > "$work/results.jsonl" 2> "$work/daemon.log" & daemon=$!; pids+=($daemon)
mosquitto_sub -h 127.0.0.1 -p "$port" -t 'sensors/+/+' -q 1 > "$work/sent.jsonl" & pids+=($!)
for _ in $(seq 100); do grep -q "subscribed to" "$work/daemon.log" && break; sleep 0.1; done
grep -q "subscribed to" "$work/daemon.log" || { cat "$work/daemon.log" >&2; exit 1; }
sleep 0.3  # mosquitto_sub's own subscription
edgeline sim digits --broker "127.0.0.1:$port" --data "$work" --devices 3 --device camera --count 8 --rate 20
sleep 1  # let the last answers arrive
kill -TERM "$daemon" && wait "$daemon" || { cat "$work/daemon.log" >&2; exit 1; }
python scripts/stream_summary.py "$work/sent.jsonl" "$work/results.jsonl"

echo "== 5/5 a signed update (v2) to a simulated fleet of 3 daemons: canary first, then a wave"
updates="$work/updates"
rm -rf "$updates" "$work/fleet"
edgeline keys generate "$updates/keys" > /dev/null
edgeline export "$work/digits/model.pt2" --profile rpi5 \
    --calibration "$work/digits/calibration.npz" --validation "$work/digits/validation.npz" \
    --labels "$work/digits/labels.txt" --name digits --version 2 --out "$work/bundles/digits-v2" --force \
    > "$work/export-v2.log" 2>&1 || { cat "$work/export-v2.log" >&2; exit 1; }
edgeline publish "$work/bundles/digits-v2" --repo "$updates/repo" --keys "$updates/keys" --hold --trial-inputs 30
edgeline sim fleet "$work/bundles/digits" --devices 3 --canary 1 --broker "127.0.0.1:$port" --work "$work/fleet" \
    --updates "$updates/repo" --trusted-root "$updates/keys/root.json" --check-interval 1 --rate 10 --data "$work" \
    --for 120 2> "$work/fleet.log" & fleet=$!; pids+=($fleet)
for _ in $(seq 300); do [ -f "$work/fleet/fleet.toml" ] && break; sleep 0.1; done
[ -f "$work/fleet/fleet.toml" ] || { cat "$work/fleet.log" >&2; exit 1; }
edgeline rollout digits 2 --repo "$updates/repo" --keys "$updates/keys" --fleet "$work/fleet/fleet.toml" \
    --canary 1 --soak 2 --wave-timeout 60
sleep 1
kill -TERM "$fleet" && wait "$fleet" || { cat "$work/fleet.log" >&2; exit 1; }
