"""Health of a running daemon: counters, per-stage latency, the Prometheus endpoint, and systemd notifications.

The hot path (``count``, ``error``, ``observe``) only updates plain Python state under one lock; prometheus-client
is imported lazily and turns that state into typed metric families at scrape time, so a device that never enables
``prometheus_port`` never pays for it (nor needs it installed).
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import os
import re
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from edgeline.errors import EdgelineError
from edgeline.lograte import Repeated

if TYPE_CHECKING:
    from prometheus_client.registry import Collector, CollectorRegistry

__all__ = [
    "LATENCY_BUCKETS", "LATENCY_WINDOW", "STAGES", "Metrics", "MetricsServer", "SystemdNotifier", "percentiles",
]  # fmt: skip

logger = logging.getLogger(__name__)
MAX_PROVIDERS_SAID = 1024
"""Failing gauge providers remembered as said: far more than a daemon registers."""

STAGES = ("queued", "model", "publish", "total")
"""Latency stages, in seconds: waiting in the queue; in the model call; from the answer being ready to the broker's
PUBACK (or the stdout write); from received to published."""

LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histogram, 1-2.5-5 steps from 50 µs (a tiny model on a Pi 5) to 10 s (a
publish stuck behind a reconnect); anything slower lands in +Inf."""

LATENCY_WINDOW = 4096
"""Samples per stage kept for the p50/p99 of the status message; the histogram covers the whole run."""

MISSING_CLIENT = "the Prometheus endpoint needs prometheus-client: pip install 'edgeline[metrics]'"

GaugeProvider = Callable[[], Mapping[str, float | int | bool | None]]

_LABELS = ("model", "version", "daemon")
"""The daemon's id is the label ``daemon``: Prometheus owns ``instance`` (the scrape target) and would rename ours."""
_INVALID_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(name: str) -> str:
    """``edgeline_<name>`` in Prometheus' alphabet, with a trailing ``_s`` spelled ``_seconds`` (its base unit)."""
    name = _INVALID_NAME.sub("_", name)
    if name.endswith("_s"):
        name = name[:-2] + "_seconds"
    return f"edgeline_{name}"


class _Stage:
    """One stage's latency: histogram counts per bucket (not cumulative, so observing touches one slot) and a window."""

    __slots__ = ("buckets", "recent", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.recent: deque[float] = deque(maxlen=LATENCY_WINDOW)


class Metrics:
    """Thread-safe health state of one daemon, read by the status message and the Prometheus endpoint."""

    def __init__(self, *, model: str, version: int, instance: str = "") -> None:
        self.model = model
        self.version = version
        self.instance = instance
        self.started = time.time()
        # Uptime from the monotonic clock: a Pi without an RTC steps its wall clock when NTP syncs after boot.
        self._started_monotonic = time.monotonic()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._stages = {stage: _Stage() for stage in STAGES}
        self._providers: list[GaugeProvider] = []
        self._counter_providers: list[GaugeProvider] = []
        self._labelled: list[tuple[str, tuple[str, ...], str, Callable[[], Mapping[Any, float | None]], bool]] = []
        self._failed_providers = Repeated(logger, "", every_s=math.inf, remember=MAX_PROVIDERS_SAID)
        """A provider that raises is said once (with its traceback), whatever it raises next."""
        self._registry: CollectorRegistry | None = None
        self.accelerator: Mapping[str, str | None] | None = None
        """``{"wanted", "in_use", "fallback"}`` when the bundle was built for an accelerator (the daemon sets it),
        exposed as the ``edgeline_accelerator_fallback`` gauge; None for a CPU bundle."""
        self.emulated: str | None = None
        """What emulates this machine (``edgeline.machine``), exposed as the ``edgeline_emulated`` gauge: latency
        figures taken under an emulator are not the device's."""

    # -- hot path ----------------------------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def error(self, code: str) -> None:
        """One coded error answer; it also counts towards ``errors``."""
        with self._lock:
            self._errors[code] += 1
            self._counts["errors"] += 1

    def observe(self, stage: str, seconds: float) -> None:
        """One latency sample. A negative one (a wall-clock step between two stamps) counts as 0 rather than
        making ``_sum`` go backwards; a non-finite one is a bug of the caller and raises."""
        record = self._stages.get(stage)
        if record is None:
            raise ValueError(f"unknown latency stage {stage!r}; expected one of {', '.join(STAGES)}")
        if not math.isfinite(seconds):
            raise ValueError(f"latency of stage {stage!r} must be finite, got {seconds}")
        seconds = max(float(seconds), 0.0)
        slot = bisect.bisect_left(LATENCY_BUCKETS, seconds)  # first bound >= seconds: Prometheus' "le"
        with self._lock:
            record.buckets[slot] += 1
            record.sum += seconds
            record.recent.append(seconds)

    def declare(self, *names: str) -> None:
        """Counters that exist from the start, at zero (a scrape before the first event sees them)."""
        with self._lock:
            for name in names:
                self._counts.setdefault(name, 0)

    def counters(self, provider: GaugeProvider) -> None:
        """Register a callable of counters kept elsewhere (monotonic totals: the outbox's drops, reconnections),
        read at snapshot/scrape time and exposed as counters (``_total``), in the status message's ``counts``."""
        with self._lock:
            self._counter_providers.append(provider)

    def labelled_counters(
        self, name: str, label: str | tuple[str, ...], help_text: str, provider: Callable[[], Mapping[Any, int]]
    ) -> None:
        """Register counters of one family told apart by ``label`` (updates refused, by reason; a camera's drops, by
        camera and reason: a tuple of labels, and tuples as keys), exposed as ``edgeline_<name>_total{<label>=...}``;
        the status message shows them where their owner puts them."""
        labels = (label,) if isinstance(label, str) else tuple(label)
        with self._lock:
            self._labelled.append((name, labels, help_text, provider, True))

    def labelled_gauges(
        self, name: str, labels: tuple[str, ...], help_text: str, provider: Callable[[], Mapping[Any, float | None]]
    ) -> None:
        """Register gauges of one family told apart by ``labels`` (a camera's state, its frame age by quantile);
        keys are tuples of label values; a None value is omitted."""
        with self._lock:
            self._labelled.append((name, labels, help_text, provider, False))

    # -- gauges ------------------------------------------------------------------------------------------------
    def gauges(self, provider: GaugeProvider) -> None:
        """Register a callable read at snapshot/scrape time (queue depth, connected...); its None values are
        omitted. It runs outside our lock, so it may take locks of its own."""
        with self._lock:
            self._providers.append(provider)

    def _read_gauges(self, counters: bool = False) -> dict[str, float | int | bool]:
        """Every provider's current values; a provider that raises is skipped (and logged once) so that one broken
        gauge cannot take the status message or the whole scrape down."""
        with self._lock:
            providers = list(self._counter_providers if counters else self._providers)
        values: dict[str, float | int | bool] = {}
        for provider in providers:
            try:
                current = provider()
            except Exception:
                self._failed_providers.happened(
                    1, f"gauge provider {provider!r} failed; its gauges are omitted", key=id(provider), exc_info=True
                )
                continue
            values.update((key, value) for key, value in current.items() if value is not None)
        return values

    # -- readers -----------------------------------------------------------------------------------------------
    def latency_percentiles(self, stage: str) -> tuple[float | None, float | None]:
        """(p50, p99) in seconds over the last ``LATENCY_WINDOW`` samples of ``stage``; None before any."""
        return percentiles(self._window(stage))

    def _window(self, stage: str) -> np.ndarray:
        record = self._stages.get(stage)
        if record is None:
            raise ValueError(f"unknown latency stage {stage!r}; expected one of {', '.join(STAGES)}")
        with self._lock:
            return np.fromiter(record.recent, dtype=np.float64, count=len(record.recent))

    def uptime(self) -> float:
        return time.monotonic() - self._started_monotonic

    def snapshot(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The periodic JSON status message: counts, errors by code, per-stage p50/p99 in ms (None before any
        sample; ``samples`` is the window's size), the gauges, then ``extra``."""
        gauges = self._read_gauges()
        with self._lock:
            counts = dict(self._counts)
            errors = dict(self._errors)
        counts.update((name, int(value)) for name, value in self._read_gauges(counters=True).items())
        latency: dict[str, dict[str, Any]] = {}
        for stage in STAGES:
            window = self._window(stage)
            p50, p99 = percentiles(window)
            latency[stage] = {
                "p50": None if p50 is None else round(p50 * 1000.0, 4),
                "p99": None if p99 is None else round(p99 * 1000.0, 4),
                "samples": int(window.size),
            }
        status: dict[str, Any] = {
            "model": self.model,
            "version": self.version,
            "instance": self.instance,
            "uptime_s": round(self.uptime(), 3),
            "counts": counts,
            "errors": errors,
            "latency_ms": latency,
        }
        status.update(gauges)
        if extra:
            status.update(extra)
        return status

    def _state(self) -> tuple[dict[str, int], dict[str, int], dict[str, tuple[list[int], float]]]:
        """A consistent copy of the counters and histograms, for the collector."""
        kept_elsewhere = self._read_gauges(counters=True)
        with self._lock:
            histograms = {stage: (list(record.buckets), record.sum) for stage, record in self._stages.items()}
            counts = dict(self._counts)
            errors = dict(self._errors)
        counts.update((name, int(value)) for name, value in kept_elsewhere.items())
        return counts, errors, histograms

    # -- Prometheus --------------------------------------------------------------------------------------------
    def registry(self) -> CollectorRegistry:
        """This daemon's private registry (ours, process and platform collectors), made on first use; private so
        that two ``Metrics`` in one process (tests, several models) never clash in the global one."""
        with self._lock:
            if self._registry is None:
                client = _client()
                registry = client.CollectorRegistry(auto_describe=False)
                registry.register(_collector_class()(self))
                client.ProcessCollector(registry=registry)
                client.PlatformCollector(registry=registry)
                self._registry = registry
            return self._registry

    def prometheus(self) -> str:
        """The text exposition of ``registry()``; raises EdgelineError when prometheus-client is missing."""
        return _client().generate_latest(self.registry()).decode()

    def collect(self) -> Iterator[Any]:
        """Metric families of our own state, built at scrape time: counters, errors by code, the latency
        histogram, the gauges and uptime. A name already taken is skipped rather than exposed twice (a gauge
        called ``received_total`` would otherwise make Prometheus reject the whole scrape)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        gauges = self._read_gauges()
        counts, errors, histograms = self._state()
        labels = [self.model, str(self.version), self.instance]
        taken: set[str] = set()
        _claim(taken, "edgeline_errors", _COUNTER_SUFFIXES)
        _claim(taken, "edgeline_latency_seconds", _HISTOGRAM_SUFFIXES)
        _claim(taken, "edgeline_uptime_seconds", ("",))
        _claim(taken, "edgeline_accelerator_fallback", ("",))
        _claim(taken, "edgeline_emulated", ("",))
        with self._lock:
            labelled = list(self._labelled)
        for name, label_names, help_text, provider, is_counter in labelled:
            metric = _metric_name(name)
            if not _claim(taken, metric, _COUNTER_SUFFIXES if is_counter else ("",)):
                continue
            try:
                values = dict(provider())
            except Exception:
                logger.warning("counter provider %r failed; its counters are omitted", provider, exc_info=True)
                continue
            kind = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = kind(metric, help_text, labels=[*_LABELS, *label_names])
            for key, value in sorted(values.items(), key=lambda item: str(item[0])):
                if value is None:
                    continue
                keys = [key] if isinstance(key, str) else [str(part) for part in key]
                family.add_metric([*labels, *keys], float(value))
            yield family

        if self.emulated is not None:
            emulated = GaugeMetricFamily(
                "edgeline_emulated",
                "1: an emulator runs this daemon; its latencies are the emulator's, not the device's.",
                labels=[*_LABELS, "emulator"],
            )
            emulated.add_metric([*labels, self.emulated], 1.0)
            yield emulated

        if self.accelerator is not None:
            fallback = GaugeMetricFamily(
                "edgeline_accelerator_fallback",
                "1 when the model does not run on the accelerator its bundle was built for (0 when it does).",
                labels=[*_LABELS, "wanted", "in_use"],
            )
            state = self.accelerator
            in_use = state.get("in_use") or "cpu"
            fallback.add_metric([*labels, str(state.get("wanted")), in_use], 1.0 if state.get("fallback") else 0.0)
            yield fallback

        # "errors" is the sum over codes, so it is exposed once, by code; errors counted without one are "uncoded".
        family = CounterMetricFamily("edgeline_errors", "Coded error answers.", labels=[*_LABELS, "code"])
        uncoded = counts.pop("errors", 0) - sum(errors.values())
        for code, value in sorted({**errors, **({"uncoded": uncoded} if uncoded > 0 else {})}.items()):
            family.add_metric([*labels, code], value)
        yield family

        for name, value in sorted(counts.items()):
            metric = _metric_name(name.removesuffix("_total"))
            if not _claim(taken, metric, _COUNTER_SUFFIXES):
                continue
            family = CounterMetricFamily(metric, f"Count of {name}.", labels=_LABELS)
            family.add_metric(labels, value)
            yield family

        histogram = HistogramMetricFamily(
            "edgeline_latency_seconds",
            "Seconds by stage: queued, model (the call), publish (answer to PUBACK), total (received to published).",
            labels=[*_LABELS, "stage"],
        )
        for stage, (buckets, total) in histograms.items():
            cumulative = 0
            points: list[tuple[str, float]] = []
            for bound, n in zip((*LATENCY_BUCKETS, math.inf), buckets, strict=True):
                cumulative += n
                points.append((floatToGoString(bound), cumulative))
            histogram.add_metric([*labels, stage], points, total)
        yield histogram

        for name, reading in sorted(gauges.items()):
            metric = _metric_name(name)
            if not isinstance(reading, (int, float)) or not _claim(taken, metric, ("",)):
                continue
            gauge = GaugeMetricFamily(metric, f"Current {name}.", labels=_LABELS)
            gauge.add_metric(labels, float(reading))  # bools as 0/1
            yield gauge

        uptime = GaugeMetricFamily("edgeline_uptime_seconds", "Seconds since the daemon started.", labels=_LABELS)
        uptime.add_metric(labels, self.uptime())
        yield uptime


_COUNTER_SUFFIXES = ("", "_total", "_created")
_HISTOGRAM_SUFFIXES = ("", "_bucket", "_count", "_sum", "_created")


def _claim(taken: set[str], metric: str, suffixes: tuple[str, ...]) -> bool:
    """Reserve the family name and every sample name it exposes; False if any is already someone else's."""
    names = {metric + suffix for suffix in suffixes}
    if names & taken:
        return False
    taken.update(names)
    return True


def percentiles(samples: np.ndarray) -> tuple[float | None, float | None]:
    """(p50, p99) of ``samples``; None before any (the status message's, and each camera's)."""
    if not samples.size:
        return None, None
    p50, p99 = np.percentile(samples, [50, 99]).tolist()
    return float(p50), float(p99)


def _client() -> Any:
    """prometheus_client, imported on first use; its absence is a one-line EdgelineError."""
    try:
        import prometheus_client
    except ImportError:
        raise EdgelineError(MISSING_CLIENT) from None
    return prometheus_client


@functools.cache
def _collector_class() -> Callable[[Metrics], Collector]:
    """A prometheus_client Collector over one ``Metrics``; defined on first use to keep the import lazy."""
    from prometheus_client.registry import Collector

    class MetricsCollector(Collector):
        def __init__(self, metrics: Metrics) -> None:
            self.metrics = metrics

        def collect(self) -> Iterator[Any]:
            return self.metrics.collect()

    return MetricsCollector


class MetricsServer:
    """``/metrics`` over HTTP on its own daemon thread; loopback unless told otherwise, since it is unauthenticated.

    Binds in the constructor so that a busy port fails ``edgeline run`` at start-up, as one line."""

    def __init__(self, metrics: Metrics, port: int, host: str = "127.0.0.1") -> None:
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, not {type(host).__name__}; register gauges with Metrics.gauges()")
        client = _client()
        content_type = str(client.CONTENT_TYPE_LATEST)

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a client that stops mid-request holds a thread this long at most

            def do_GET(self) -> None:
                if urlsplit(self.path).path != "/metrics":
                    self.send_error(404)
                    return
                body = metrics.prometheus().encode()
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                """Nothing per request: a scrape every 15 s would fill a Pi's journal."""

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        try:
            self._server = Server((host, port), Handler)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()
            raise EdgelineError(f"prometheus_port {port} on {host}: {reason}") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="edgeline-metrics", daemon=True
        )
        self._stopped = False

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving within ~0.1 s and frees the port; safe to call twice, or without ``start()``."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            self._server.shutdown()  # blocks until serve_forever returns, which would hang if it never ran
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


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
