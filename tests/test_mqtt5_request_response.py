"""MQTT 5 request/response as its clients use it: an input with a Response Topic and Correlation Data is answered
there too, carrying the data back, and every answer says what its payload is (Content Type, Payload Format
Indicator). Checked with Debian's mosquitto_pub and mosquitto_sub, clients we did not write."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from edgeline.daemon.service import Daemon
from tests.mqtt_broker import Broker
from tests.test_daemon_backpressure import config_for

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 20.0


def test_a_request_is_answered_on_its_response_topic_with_its_correlation_data(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    daemon = Daemon(built_litert_bundle, config_for(broker, unique_topic, tmp_path / "state"))
    daemon.start()
    reply_topic, results = f"{unique_topic}/reply/app-1", f"{unique_topic}/out/#"
    since = broker.log_size()
    listener = subprocess.Popen(
        ["mosquitto_sub", *broker.client_args, "-V", "5", "-q", "1", "-i", "rr-listener", "-t", reply_topic,
         "-t", results, "-C", "3", "-W", str(int(TIMEOUT_S)), "-F", "%t\t%C\t%F\t%D\t%p"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert broker.wait_for_subscription("rr-listener", results, timeout=TIMEOUT_S, since=since)
        request = json.dumps({"id": "req-1", "data": [0.5] * 64})
        subprocess.run(
            ["mosquitto_pub", *broker.client_args, "-V", "5", "-q", "1", "-t", f"{unique_topic}/in/cam",
             "-m", request, "-D", "publish", "response-topic", reply_topic,
             "-D", "publish", "correlation-data", "corr-42"],
            check=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        plain = json.dumps({"id": "plain-1", "data": [0.25] * 64})  # no response topic: the template only
        subprocess.run(
            ["mosquitto_pub", *broker.client_args, "-V", "5", "-q", "1", "-t", f"{unique_topic}/in/cam", "-m", plain],
            check=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        out, err = listener.communicate(timeout=TIMEOUT_S + 5)
    finally:
        if listener.poll() is None:
            listener.kill()
        daemon.stop()
    lines = [line.split("\t") for line in out.splitlines() if line]
    assert len(lines) == 3, (out, err)  # the request's answer twice (response topic, template), the plain one once
    by_topic = {(topic, json.loads(body)["id"]): (ctype, fmt, corr) for topic, ctype, fmt, corr, body in lines}
    assert by_topic[(reply_topic, "req-1")] == ("application/json", "1", "corr-42")
    assert by_topic[(f"{unique_topic}/out/cam", "req-1")] == ("application/json", "1", "")
    assert by_topic[(f"{unique_topic}/out/cam", "plain-1")] == ("application/json", "1", "")
