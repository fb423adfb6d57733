"""A device against a hostile update server: how long a trickling download keeps a check, and what the room check
counts for an archive of many tiny files (issue 33).

1. A real HTTP server on 127.0.0.1 serves a signed repository, but sends each archive one byte every ``--every``
   seconds (the metadata at full speed). For each ``download_timeout_s`` of ``--deadlines``, the device's
   ``UpdateClient`` checks, is offered the new version, and fetches it: the time from the fetch's start to its
   refusal (``timeout``), against the bytes it received. Before issue 33 the fetch waited only for each byte (30 s
   socket timeout), so such a server held a check for ever (about 17 hours for a 30 KB archive at a byte every 2 s).
2. The tests' tiny bundle with ``--files`` listed one-byte files, published: its archive's length, the unpacked size
   signed with it, and the disk the room check asks for, beside the twice-the-length budget it used before.

    .venv/bin/python benchmarks/update_limits.py --write benchmarks/results/update_limits.md

About 30 s on a 2-core machine (most of it publishing the 10,000-file bundle). Host figures: a device's disk and link
are slower, the times are the deadlines' all the same.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edgeline.errors import UpdateRefused  # noqa: E402
from edgeline.updates.client import UpdateClient  # noqa: E402
from edgeline.updates.policy import disk_needed  # noqa: E402
from tests.update_repo import UpdateRepo  # noqa: E402

MB = 1 << 20


class _Trickle(http.server.SimpleHTTPRequestHandler):
    every_s = 0.5
    stopping = threading.Event()
    sent = 0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if "/targets/" not in self.path:
            super().do_GET()
            return
        data = Path(self.translate_path(self.path)).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        type(self).sent = 0
        try:
            for byte in data:
                if self.stopping.wait(self.every_s):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                type(self).sent += 1
        except OSError:
            pass  # the device hung up: what it should do


def trickle(every_s: float, deadlines: list[float]) -> list[str]:
    rows = [
        "| a byte every | download_timeout_s | refused as | after | bytes received | archive |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        repo = UpdateRepo(Path(scratch) / "pub")
        length = repo.publish(2).length
        _Trickle.every_s = every_s
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(_Trickle, directory=str(repo.directory))
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            for deadline in deadlines:
                work = Path(scratch) / f"device-{deadline:g}"
                client = UpdateClient(url, repo.trusted_root, work, download_timeout_s=deadline)
                choice, updater = client.check(name="tiny", device="bench", running=1, refused=set())
                assert choice.take is not None, "v2 not offered"
                offer = client.offer(updater, choice.take)
                start = time.monotonic()
                try:
                    client.fetch(updater, offer)
                    outcome = "taken"
                except UpdateRefused as exc:
                    outcome = exc.reason
                elapsed = time.monotonic() - start
                rows.append(
                    f"| {every_s:g} s | {deadline:g} s | {outcome} | {elapsed:.2f} s | {_Trickle.sent} | {length} B |"
                )
        finally:
            _Trickle.stopping.set()
            server.shutdown()
            server.server_close()
            _Trickle.stopping.clear()
    return rows


def many_files(count: int) -> list[str]:
    with tempfile.TemporaryDirectory() as scratch:
        repo = UpdateRepo(Path(scratch) / "pub")
        bundle = repo.bundle(2)
        names = [f"f{n:05d}" for n in range(count)]
        for name in names:
            (bundle / name).write_bytes(b"x")
        manifest = json.loads((bundle / "manifest.json").read_text())
        entry = {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
        manifest["files"] += [{"path": name, **entry} for name in names]
        (bundle / "manifest.json").write_text(json.dumps(manifest, separators=(",", ":")))
        published = repo.repository.publish(bundle)
        facts, length = published.facts, published.length
        return [
            "| listed one-byte files | archive | signed unpacked_bytes | signed unpacked_entries | room asked now | "
            "room asked before (2 x length) |",
            "|---|---|---|---|---|---|",
            f"| {count:,} | {length / MB:.2f} MiB | {facts.unpacked_bytes:,} B | {facts.unpacked_entries:,} | "
            f"{disk_needed(facts, length) / MB:.1f} MiB | {2 * length / MB:.1f} MiB |",
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, nargs="+", default=[0.5, 2.0], help="seconds between two bytes")
    parser.add_argument("--deadlines", type=float, nargs="+", default=[1.0, 2.0, 5.0], help="download_timeout_s")
    parser.add_argument("--files", type=int, default=10_000, help="one-byte files in the many-files bundle")
    parser.add_argument("--write", type=Path, help="also write the markdown here")
    args = parser.parse_args()
    lines = ["# A device against a hostile update server", "", "Command: `.venv/bin/python benchmarks/update_limits.py "
             "--write benchmarks/results/update_limits.md` (this host, loopback).", "",
             "## A server that trickles the archive", ""]  # fmt: skip
    for index, every in enumerate(args.every):
        rows = trickle(every, args.deadlines)
        lines += rows if index == 0 else rows[2:]
    lines += ["", "## An archive of many tiny files", "", *many_files(args.files), ""]
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
