"""Health of a running daemon: counters, latency percentiles, Prometheus text, and systemd notifications."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

__all__ = ["Metrics", "MetricsServer", "SystemdNotifier"]

LATENCY_WINDOW = 4096


class Metrics:
    """Thread-safe counters of one daemon; latencies kept for the last ``LATENCY_WINDOW`` inferences."""

    def __init__(self, *, model: str, version: int):
        self.model = model
        self.version = version
        self.started = time.time()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._latencies_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def error(self, code: str) -> None:
        with self._lock:
            self._errors[code] += 1
            self._counts["errors"] += 1

    def latency(self, milliseconds: float) -> None:
        with self._lock:
            self._latencies_ms.append(milliseconds)

    def snapshot(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The periodic status message: counts, errors by code, latency p50/p99 (None before any inference)."""
        with self._lock:
            counts = dict(self._counts)
            errors = dict(self._errors)
            latencies = np.fromiter(self._latencies_ms, dtype=np.float64)
        p50, p99 = np.percentile(latencies, [50, 99]).tolist() if latencies.size else (None, None)
        status: dict[str, Any] = {
            "model": self.model,
            "version": self.version,
            "uptime_s": round(time.time() - self.started, 3),
            "counts": counts,
            "errors": errors,
            "latency_ms": {"p50": p50, "p99": p99, "samples": int(latencies.size)},
        }
        if extra:
            status.update(extra)
        return status

    def prometheus(self, extra: Mapping[str, Any] | None = None) -> str:
        status = self.snapshot(extra)
        model = f'model="{self.model}",version="{self.version}"'
        lines = [f"# TYPE edgeline_{name}_total counter" + f"\nedgeline_{name}_total{{{model}}} {value}"
                 for name, value in sorted(status["counts"].items())]  # fmt: skip
        lines += [f'edgeline_errors_by_code_total{{{model},code="{code}"}} {value}'
                  for code, value in sorted(status["errors"].items())]  # fmt: skip
        for quantile in ("p50", "p99"):
            value = status["latency_ms"][quantile]
            if value is not None:
                q = "0.5" if quantile == "p50" else "0.99"
                lines.append(f'edgeline_inference_latency_ms{{{model},quantile="{q}"}} {value}')
        for key, value in sorted((extra or {}).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines.append(f"edgeline_{key}{{{model}}} {value}")
        lines.append(f"edgeline_uptime_seconds{{{model}}} {status['uptime_s']}")
        return "\n".join(lines) + "\n"


class MetricsServer:
    """Prometheus text at http://127.0.0.1:PORT/metrics, loopback only, on its own thread."""

    def __init__(self, metrics: Metrics, port: int, extra: Any = None):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = metrics.prometheus(owner.extra() if owner.extra else None).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.extra = extra
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="edgeline-metrics", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SystemdNotifier:
    """sd_notify(3) without libsystemd: datagrams to $NOTIFY_SOCKET. A no-op when not run by systemd."""

    def __init__(self, address: str | None = None, watchdog_usec: str | None = None):
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        usec = watchdog_usec if watchdog_usec is not None else os.environ.get("WATCHDOG_USEC")
        # Ping at half the watchdog period, as sd_watchdog_enabled(3) recommends.
        self.watchdog_interval_s = int(usec) / 2e6 if usec and usec.isdigit() and int(usec) > 0 else None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, state: str) -> bool:
        if not self.address:
            return False
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(state.encode(), address)
            except OSError:
                return False
        return True
