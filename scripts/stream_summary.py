"""Print what the demo's stream did: each device's answers next to the labels its camera sent.

    python scripts/stream_summary.py SENT.jsonl RESULTS.jsonl

SENT.jsonl holds the sensor messages as mosquitto_sub printed them; RESULTS.jsonl the daemon's answers
(`edgeline run --stdout`). Joined on the message id.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main() -> int:
    sent_path, results_path = (Path(p) for p in sys.argv[1:3])
    expected = {}
    for line in sent_path.read_text().splitlines():
        if line.strip():
            message = json.loads(line)
            expected[message["id"]] = message.get("label")
    results = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    by_device: dict[str, list[dict]] = defaultdict(list)
    for record in results:
        by_device[record["device"]].append(record)
    for device, records in sorted(by_device.items()):
        shown = " ".join(
            f"{r['label']}" + ("" if str(expected.get(r["id"])) == r.get("label") else f"(≠{expected.get(r['id'])})")
            if "error" not in r
            else f"[{r['error']['code']}]"
            for r in records
        )
        print(f"  {device}: {shown}")
    answered = [r for r in results if r["id"] in expected]
    correct = sum(1 for r in answered if "error" not in r and r.get("label") == str(expected[r["id"]]))
    latencies = sorted(r["latency_ms"] for r in answered if "latency_ms" in r)
    p50 = latencies[len(latencies) // 2] if latencies else float("nan")
    print(
        f"{len(expected)} messages sent, {len(answered)} answered ({len(results)} answers in all), "
        f"{correct}/{len(answered)} labels right, median inference {p50:.3f} ms"
    )
    return 0 if len(answered) == len(expected) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
