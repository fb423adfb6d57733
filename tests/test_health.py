"""Daemon health: counters and percentiles, the Prometheus endpoint (real HTTP on loopback), sd_notify."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.health import Metrics, MetricsServer, SystemdNotifier


def test_snapshot_counts_errors_and_percentiles() -> None:
    metrics = Metrics(model="kws", version=3)
    assert metrics.snapshot()["latency_ms"] == {"p50": None, "p99": None, "samples": 0}
    for value in range(1, 101):
        metrics.latency(float(value))
    metrics.count("received", 5)
    metrics.count("results", 3)
    metrics.error("malformed")
    metrics.error("malformed")
    status = metrics.snapshot({"queue_depth": 7})
    assert status["counts"] == {"received": 5, "results": 3, "errors": 2}
    assert status["errors"] == {"malformed": 2}
    assert status["latency_ms"]["p50"] == pytest.approx(np.percentile(np.arange(1, 101), 50))
    assert status["latency_ms"]["p99"] == pytest.approx(np.percentile(np.arange(1, 101), 99))
    assert (status["model"], status["version"], status["queue_depth"]) == ("kws", 3, 7)


def test_prometheus_endpoint_serves_the_metrics_on_loopback() -> None:
    metrics = Metrics(model="kws", version=1)
    metrics.count("received", 4)
    metrics.error("non-finite")
    metrics.latency(2.5)
    server = MetricsServer(metrics, 0, extra=lambda: {"queue_depth": 2}).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert 'edgeline_received_total{model="kws",version="1"} 4' in text
        assert 'edgeline_errors_by_code_total{model="kws",version="1",code="non-finite"} 1' in text
        assert 'edgeline_inference_latency_ms{model="kws",version="1",quantile="0.5"} 2.5' in text
        assert 'edgeline_queue_depth{model="kws",version="1"} 2' in text
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
    finally:
        server.stop()


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
    unit.read_string(files("edge_runtime").joinpath("systemd/edgeline@.service").read_text())
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["KillSignal"] == "SIGTERM"
    assert " run " in service["ExecStart"] and "--config" in service["ExecStart"]
