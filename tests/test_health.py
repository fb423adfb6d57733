"""Daemon health: counters, per-stage latency, the Prometheus endpoint (real HTTP on loopback, parsed by
prometheus_client's own parser), sd_notify."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgeline.daemon.health import (
    LATENCY_BUCKETS,
    LATENCY_WINDOW,
    MISSING_CLIENT,
    STAGES,
    Metrics,
    MetricsServer,
    SystemdNotifier,
)
from edgeline.errors import EdgelineError

pytestmark = pytest.mark.quick

IDENTITY = {"model": "kws", "version": "3", "daemon": "kitchen"}


def scrape(port: int) -> dict[str, Any]:
    """The endpoint's families by name, parsed the way Prometheus would."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return parse(text)


def parse(text: str) -> dict[str, Any]:
    """Families by name; a family or sample exposed twice would be rejected (or silently merged) by Prometheus."""
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), f"duplicated families in {names}"
    samples = [(s.name, tuple(sorted(s.labels.items()))) for family in families for s in family.samples]
    assert len(samples) == len(set(samples)), "duplicated samples"
    return dict(zip(names, families, strict=True))


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(model="kws", version=3, instance="kitchen")


@pytest.fixture
def server(metrics: Metrics) -> Iterator[MetricsServer]:
    with MetricsServer(metrics, 0) as running:
        yield running


def test_snapshot_counts_errors_gauges_and_percentiles(metrics: Metrics) -> None:
    assert metrics.snapshot()["latency_ms"] == {stage: {"p50": None, "p99": None, "samples": 0} for stage in STAGES}
    for value in range(1, 101):
        metrics.observe("model", value / 1000.0)
    metrics.count("received", 5)
    metrics.count("results", 3)
    metrics.error("malformed")
    metrics.error("malformed")
    metrics.gauges(lambda: {"queue_depth": 7, "connected": True, "outbox_oldest_age_seconds": None})
    status = metrics.snapshot({"batch_size": 4})
    assert status["counts"] == {"received": 5, "results": 3, "errors": 2}
    assert status["errors"] == {"malformed": 2}
    model = status["latency_ms"]["model"]
    assert model["samples"] == 100
    assert model["p50"] == pytest.approx(np.percentile(np.arange(1, 101), 50), abs=1e-4)
    assert model["p99"] == pytest.approx(np.percentile(np.arange(1, 101), 99), abs=1e-4)
    assert status["latency_ms"]["total"] == {"p50": None, "p99": None, "samples": 0}
    assert (status["model"], status["version"], status["instance"]) == ("kws", 3, "kitchen")
    assert (status["queue_depth"], status["connected"], status["batch_size"]) == (7, True, 4)
    assert "outbox_oldest_age_seconds" not in status
    assert status["uptime_s"] >= 0


def test_percentiles_are_seconds_over_the_recent_window(metrics: Metrics) -> None:
    assert metrics.latency_percentiles("publish") == (None, None)
    values = np.arange(LATENCY_WINDOW + 1000, dtype=np.float64) / 1e4
    for value in values:
        metrics.observe("publish", float(value))
    recent = values[-LATENCY_WINDOW:]
    p50, p99 = metrics.latency_percentiles("publish")
    assert p50 == pytest.approx(np.percentile(recent, 50))
    assert p99 == pytest.approx(np.percentile(recent, 99))
    assert metrics.latency_percentiles("queued") == (None, None)
    with pytest.raises(ValueError, match="unknown latency stage"):
        metrics.latency_percentiles("inference")


def test_observe_rejects_unknown_stages_and_non_finite_values(metrics: Metrics) -> None:
    with pytest.raises(ValueError, match="unknown latency stage 'inference'"):
        metrics.observe("inference", 0.1)
    with pytest.raises(ValueError, match="finite"):
        metrics.observe("model", math.nan)
    metrics.observe("total", -0.5)  # a wall-clock step between two stamps: counted, as 0
    assert metrics.latency_percentiles("total") == (0.0, 0.0)


def test_endpoint_serves_typed_counters_with_identity_labels(metrics: Metrics, server: MetricsServer) -> None:
    metrics.count("received", 4)
    metrics.count("invalid-topic")
    metrics.error("non-finite")
    metrics.error("malformed")
    metrics.error("malformed")
    families = scrape(server.port)

    received = families["edgeline_received"]
    assert received.type == "counter"
    assert [(s.name, s.labels, s.value) for s in received.samples] == [("edgeline_received_total", IDENTITY, 4)]
    assert families["edgeline_invalid_topic"].samples[0].name == "edgeline_invalid_topic_total"

    errors = families["edgeline_errors"]
    assert errors.type == "counter"
    by_code = {s.labels["code"]: s.value for s in errors.samples}
    assert by_code == {"non-finite": 1, "malformed": 2}
    assert all({k: v for k, v in s.labels.items() if k != "code"} == IDENTITY for s in errors.samples)

    uptime = families["edgeline_uptime_seconds"]
    assert uptime.type == "gauge" and uptime.samples[0].value >= 0
    assert not [name for name in families if name.endswith("_s") or name.endswith("_ms")]


def test_errors_counted_without_a_code_are_exposed_as_uncoded(metrics: Metrics, server: MetricsServer) -> None:
    metrics.error("malformed")
    metrics.count("errors", 2)
    by_code = {s.labels["code"]: s.value for s in scrape(server.port)["edgeline_errors"].samples}
    assert by_code == {"malformed": 1, "uncoded": 2}


def test_endpoint_histogram_matches_what_was_observed(metrics: Metrics, server: MetricsServer) -> None:
    observed: dict[str, list[float]] = {
        "queued": [0.00002, 0.0004, 0.003],
        "model": [0.0003, 0.0003, 0.07, 12.0],  # 12 s: beyond the last bound, only in +Inf
        "publish": [],
        "total": [1.0],
    }
    for stage, values in observed.items():
        for value in values:
            metrics.observe(stage, value)
    histogram = scrape(server.port)["edgeline_latency_seconds"]
    assert histogram.type == "histogram"

    for stage, values in observed.items():
        samples = [s for s in histogram.samples if s.labels["stage"] == stage]
        assert all({k: v for k, v in s.labels.items() if k not in ("stage", "le")} == IDENTITY for s in samples)
        buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
        assert [bound for bound, _ in buckets] == [*LATENCY_BUCKETS, math.inf]
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), f"{stage}: buckets must be cumulative"
        for bound, count in buckets:
            assert count == sum(value <= bound for value in values), (stage, bound)
        (total,) = [s.value for s in samples if s.name == "edgeline_latency_seconds_count"]
        (seconds,) = [s.value for s in samples if s.name == "edgeline_latency_seconds_sum"]
        assert total == len(values) == counts[-1]
        assert seconds == pytest.approx(sum(values))


def test_bucket_bounds_are_inclusive(metrics: Metrics) -> None:
    """Prometheus' ``le``: a sample equal to a bound belongs to that bound's bucket."""
    metrics.observe("model", 0.001)
    families = parse(metrics.prometheus())
    buckets = {
        s.labels["le"]: s.value
        for s in families["edgeline_latency_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["stage"] == "model"
    }
    assert (buckets["0.0005"], buckets["0.001"]) == (0, 1)


def test_endpoint_serves_provider_gauges_and_process_metrics(metrics: Metrics, server: MetricsServer) -> None:
    metrics.gauges(lambda: {"queue_depth": 3, "connected": True, "outbox_oldest_age_seconds": None})
    metrics.gauges(lambda: {"outbox_depth": 10, "link_age_s": 1.5})
    families = scrape(server.port)
    values = {}
    for name in ("queue_depth", "connected", "outbox_depth", "link_age_seconds"):
        family = families[f"edgeline_{name}"]
        assert family.type == "gauge"
        ((labels, values[name]),) = [(s.labels, s.value) for s in family.samples]
        assert labels == IDENTITY
    assert values == {"queue_depth": 3, "connected": 1, "outbox_depth": 10, "link_age_seconds": 1.5}
    assert "edgeline_outbox_oldest_age_seconds" not in families
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert families["process_cpu_seconds"].type == "counter"
    assert "python_info" in families


def test_a_failing_gauge_provider_does_not_break_the_scrape(metrics: Metrics, server: MetricsServer) -> None:
    def broken() -> dict[str, int]:
        raise RuntimeError("client gone")

    metrics.gauges(broken)
    metrics.gauges(lambda: {"queue_depth": 1})
    assert scrape(server.port)["edgeline_queue_depth"].samples[0].value == 1
    assert metrics.snapshot()["queue_depth"] == 1


def test_a_gauge_named_like_another_metric_is_not_exposed_twice(metrics: Metrics, server: MetricsServer) -> None:
    metrics.count("received")
    metrics.count("latency_seconds")
    metrics.gauges(lambda: {"received_total": 5, "uptime_s": 1.0, "latency_seconds_count": 2, "queue_depth": 1})
    families = scrape(server.port)  # parse() fails on any family or sample exposed twice
    assert families["edgeline_received"].type == "counter"
    assert families["edgeline_uptime_seconds"].type == "gauge"
    assert families["edgeline_latency_seconds"].type == "histogram"
    assert families["edgeline_queue_depth"].type == "gauge"


def test_endpoint_answers_404_elsewhere(server: MetricsServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
    assert raised.value.code == 404


def test_counts_from_many_threads_all_arrive(metrics: Metrics) -> None:
    def work() -> None:
        for _ in range(1000):
            metrics.count("received")
            metrics.observe("model", 0.002)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    families = parse(metrics.prometheus())
    assert families["edgeline_received"].samples[0].value == 4000
    (count,) = [
        s.value
        for s in families["edgeline_latency_seconds"].samples
        if s.name == "edgeline_latency_seconds_count" and s.labels["stage"] == "model"
    ]
    assert count == 4000


def test_a_busy_port_is_one_edgeline_error_naming_it(metrics: Metrics) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EdgelineError) as raised:
            MetricsServer(metrics, port)
    message = str(raised.value)
    assert message == f"prometheus_port {port} on 127.0.0.1: address already in use"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_stop_frees_the_port_and_is_safe_without_start(metrics: Metrics) -> None:
    server = MetricsServer(metrics, 0).start()
    port = server.port
    assert scrape(port)
    server.stop()
    server.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    again = MetricsServer(metrics, port)  # the port is free again
    stopper = threading.Thread(target=again.stop, daemon=True)  # never started: stop() must not wait for serve_forever
    stopper.start()
    stopper.join(timeout=10)
    assert not stopper.is_alive(), "stop() without start() hung"


def test_without_prometheus_client_the_endpoint_says_what_to_install(
    metrics: Metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` now raises ImportError
    metrics.count("received")
    with pytest.raises(EdgelineError) as raised:
        MetricsServer(metrics, 0)
    assert str(raised.value) == MISSING_CLIENT
    assert "pip install 'edgeline[metrics]'" in MISSING_CLIENT
    with pytest.raises(EdgelineError):
        metrics.prometheus()
    assert metrics.snapshot()["counts"] == {"received": 1}


def test_importing_health_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, edgeline.daemon.health as h\n"
        "m = h.Metrics(model='m', version=1)\n"
        "m.count('received'); m.error('x'); m.observe('model', 0.001); m.snapshot()\n"
        "print(sorted(n for n in sys.modules if n.startswith('prometheus_client')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_systemd_notifications_reach_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        receiver.settimeout(5)
        notifier = SystemdNotifier(address=path, watchdog_usec="4000000")
        assert notifier.enabled
        assert notifier.watchdog_interval_s == 2.0
        assert notifier.notify("READY=1")
        assert receiver.recv(64) == b"READY=1"
        assert notifier.notify("WATCHDOG=1")
        assert receiver.recv(64) == b"WATCHDOG=1"


def test_systemd_notifier_is_a_no_op_outside_systemd() -> None:
    notifier = SystemdNotifier(address="", watchdog_usec="")
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert notifier.notify("READY=1") is False


def test_systemd_unit_is_notify_with_watchdog_and_runs_the_daemon() -> None:
    import configparser
    from importlib.resources import files

    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(files("edgeline").joinpath("systemd/edgeline@.service").read_text())
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["KillSignal"] == "SIGTERM"
    assert " run " in service["ExecStart"] and "--config" in service["ExecStart"]
    # SIGTERM drains first: systemd must not SIGKILL before the daemon's own drain timeout is over
    from edgeline.daemon.config import DaemonSection

    assert float(service["TimeoutStopSec"]) > DaemonSection().drain_timeout_s
    # a serial sensor's device node belongs to dialout, which DynamicUser= does not give
    assert service["DynamicUser"] == "yes" and "dialout" in service["SupplementaryGroups"].split()
