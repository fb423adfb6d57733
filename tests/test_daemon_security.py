"""The daemon against a broker that is locked down as in production: TLS with certificates made by the test, a
password file and an ACL, on a real Mosquitto; and several daemons sharing one stream.

    TLS + password + ACL   answers arrive over the secure listener and equal ``predict`` (what `edgeline infer` runs)
    refused at start       a wrong password, an untrusted CA, no client certificate or one from another CA: exit 2
                           within seconds, one line on stderr that names the cause, no traceback
    ACL-refused publish    mosquitto 2.0.11 answers an MQTT 5 PUBACK with 135 "Not authorized": the daemon counts
                           it (``publish_refused`` in its status message), logs it, and goes on answering
    shared subscription    three instances in one ``$share`` group: every input answered exactly once, by one of
                           them, each answer naming its instance, each instance its own status topic

Observers and publishers use the broker's plain anonymous listener; only the daemon goes through the secure one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edgeline
from tests.faults import DurablePublisher, Pki, make_pki
from tests.mqtt_broker import Broker, BrokerFactory, Collector
from tests.test_daemon import then_nothing_more

pytestmark = [pytest.mark.integration, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

TIMEOUT_S = 30.0
EXIT_WITHIN_S = 15.0
USER, PASSWORD = "edge", "correct horse battery"


def bundle_name(bundle: Path) -> str:
    return edgeline.read_bundle(bundle).manifest.name


def toml_config(path: Path, sections: dict[str, dict[str, object]]) -> Path:
    """A daemon.toml with these sections (values: str, Path, bool or numbers)."""

    def value(item: object) -> str:
        if isinstance(item, bool):
            return str(item).lower()
        return json.dumps(str(item)) if isinstance(item, (str, Path)) else str(item)

    text = "".join(
        f"[{name}]\n" + "".join(f"{key} = {value(item)}\n" for key, item in body.items())
        for name, body in sections.items()
    )
    path.write_text(text, encoding="utf-8")
    return path


def start_daemon(
    bundle: Path,
    port: int,
    config: Path,
    *,
    subscribe: str,
    publish: str,
    instance: str = "t",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--config", str(config)]
    flags = ["--broker", f"127.0.0.1:{port}", "--subscribe", subscribe, "--publish", publish, "--instance", instance]
    args = [*command, *flags, *extra]
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )


def await_subscription(broker: Broker, process: subprocess.Popen[str], client_id: str, topic_filter: str) -> None:
    if not broker.wait_for_subscription(client_id, topic_filter, timeout=TIMEOUT_S):
        process.kill()
        pytest.fail(f"{client_id} did not subscribe: {process.communicate(timeout=10)[1][-3000:]}")


def connections(broker: Broker, client_id: str) -> int:
    """How often ``client_id`` connected: once, unless its session broke (over TLS: a corrupted record)."""
    return broker.log_text().count(f" as {client_id} (")


def stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate(timeout=10)
    return process.returncode, stderr


@pytest.fixture
def daemons() -> Iterator[list[subprocess.Popen[str]]]:
    """Daemons a test starts; any still running at teardown is killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


def image_payloads(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"m{index}": rng.random(64, dtype=np.float32) for index in range(count)}


def publish_json(broker: Broker, topic: str, payloads: list[bytes]) -> None:
    """QoS 1 on the plain listener; returns once the broker has acknowledged every message."""
    with DurablePublisher(broker) as publisher:
        publisher.publish_all((topic, payload) for payload in payloads)
        assert publisher.wait_acknowledged(TIMEOUT_S), f"{len(publisher.pending)} inputs not acknowledged"


def secure_acl(topic: str, results: str) -> str:
    """The daemon's user reads its inputs, writes ``results``, its error topic and its health topics."""
    return (
        f"user {USER}\ntopic read {topic}/sensors/#\ntopic write {topic}/{results}/#\n"
        f"topic write {topic}/errors/#\ntopic write edgeline/#\n"
    )


def broker_section(pki: Pki, tmp_path: Path, *, password: str | None = PASSWORD, **tls: Path) -> dict[str, object]:
    """``[broker]`` for the secure listener: our CA, the client certificate, user and password file (or none)."""
    section: dict[str, object] = {"tls_ca_file": pki.ca_cert, "tls_cert_file": pki.client_cert,
                                  "tls_key_file": pki.client_key, "username": USER}  # fmt: skip
    if password is not None:
        secret = tmp_path / "password"
        secret.write_text(password + "\n", encoding="utf-8")
        section["password_file"] = secret
    section.update(tls)
    return section


# --- TLS, password and ACL: answered --------------------------------------------------------------------------


def test_answers_over_tls_with_a_password_and_an_acl_equal_predict(
    broker_factory: BrokerFactory, pki: Pki, built_litert_bundle: Path, unique_topic: str, tmp_path: Path,
    daemons: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    """Client certificate required, password from $EDGELINE_MQTT_PASSWORD: every input answered once, correctly."""
    broker = broker_factory(
        tls=pki.broker_tls, require_certificate=True, users={USER: PASSWORD}, acl=secure_acl(unique_topic, "results")
    )
    config = toml_config(tmp_path / "daemon.toml", {"broker": broker_section(pki, tmp_path, password=None)})
    subscribe = f"{unique_topic}/sensors/+/image"
    daemon = start_daemon(
        built_litert_bundle, broker.tls_port, config, subscribe=subscribe, publish=f"{unique_topic}/results/{{device}}",
        env={"EDGELINE_MQTT_PASSWORD": PASSWORD},
    )  # fmt: skip
    daemons.append(daemon)
    client_id = f"edgeline-{bundle_name(built_litert_bundle)}-t"
    await_subscription(broker, daemon, client_id, subscribe)
    results = Collector(broker, f"{unique_topic}/results/#", timeout=TIMEOUT_S)
    images = image_payloads(8, seed=5)
    publish_json(broker, f"{unique_topic}/sensors/cam/image",
                 [json.dumps({"id": key, "data": x.tolist()}).encode() for key, x in images.items()])  # fmt: skip
    results.wait_for(len(images))
    sentinel = json.dumps({"id": "sentinel", "data": [0.5] * 64}).encode()
    answers = [  # exactly one answer per input: an extra one would have come before the sentinel's
        json.loads(payload)
        for _, payload, _ in then_nothing_more(
            results, len(images), lambda: publish_json(broker, f"{unique_topic}/sensors/cam/image", [sentinel])
        )
    ]
    by_id = {answer["id"]: answer for answer in answers}
    assert sorted(by_id) == sorted(images)
    model = edgeline.load(built_litert_bundle)
    for key, x in images.items():
        assert by_id[key]["device"] == "cam" and by_id[key]["instance"] == "t"
        np.testing.assert_allclose(by_id[key]["outputs"][0], model.predict(x.reshape(1, 1, 8, 8))[0], rtol=1e-6)
    code, stderr = stop(daemon)
    assert code == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert connections(broker, client_id) == 1, broker.log_text()[-3000:]
    results.close()


# --- refused at start -------------------------------------------------------------------------------------------


def refused_case(case: str, pki: Pki, tmp_path: Path) -> dict[str, object]:
    if case == "wrong-password":
        return broker_section(pki, tmp_path, password="wrong")
    if case == "untrusted-ca":
        return broker_section(pki, tmp_path, tls_ca_file=pki.other_ca_cert)
    if case == "foreign-client-certificate":
        foreign = make_pki(tmp_path / "foreign")
        return broker_section(pki, tmp_path, tls_cert_file=foreign.client_cert, tls_key_file=foreign.client_key)
    section = broker_section(pki, tmp_path)
    del section["tls_cert_file"], section["tls_key_file"]
    return section


REFUSALS = {
    "wrong-password": ("refused the connection", ("not authorized", "bad user name or password")),
    "untrusted-ca": ("TLS", ("certificate was not accepted", "certificate verify failed")),
    "no-client-certificate": ("TLS", ("client certificate", "certificate required")),
    "foreign-client-certificate": ("TLS", ("client certificate", "unknown ca")),
}
"""Case → (a word the line must hold, words of which one must name the cause)."""
RUNTIME_BANNER = "INFO: Created TensorFlow Lite XNNPACK delegate for CPU."
"""What the LiteRT runtime itself prints on stderr when the model loads: not the daemon's."""


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_connection_exits_2_with_one_line_naming_the_cause(
    broker_factory: BrokerFactory, pki: Pki, built_litert_bundle: Path, unique_topic: str, tmp_path: Path,
    daemons: list[subprocess.Popen[str]], case: str,
) -> None:  # fmt: skip
    broker = broker_factory(
        tls=pki.broker_tls, require_certificate=True, users={USER: PASSWORD}, acl=secure_acl(unique_topic, "results")
    )
    config = toml_config(tmp_path / "daemon.toml", {"broker": refused_case(case, pki, tmp_path)})
    daemon = start_daemon(
        built_litert_bundle, broker.tls_port, config, subscribe=f"{unique_topic}/sensors/+/image",
        publish=f"{unique_topic}/results/{{device}}",
    )  # fmt: skip
    daemons.append(daemon)
    _, stderr = daemon.communicate(timeout=EXIT_WITHIN_S)
    lines = [line for line in stderr.splitlines() if line.strip() and line != RUNTIME_BANNER]
    assert daemon.returncode == 2 and len(lines) == 1, stderr[-3000:]
    (line,) = lines
    where, causes = REFUSALS[case]
    assert line.startswith(f"edgeline run: error: broker 127.0.0.1:{broker.tls_port}: ") and where in line, line
    assert any(cause in line.lower() for cause in causes), line
    assert "no answer within" not in line and "time-out" not in line, line
    assert "Traceback" not in stderr


# --- a publish the ACL refuses ----------------------------------------------------------------------------------


def wait_for_status(watcher: Collector, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The first status message (JSON) on ``watcher`` that satisfies ``done``, within ``TIMEOUT_S``."""
    deadline = time.monotonic() + TIMEOUT_S
    seen = 0
    while time.monotonic() < deadline:
        messages = watcher.wait_for(seen + 1, timeout=1.0)
        for _, payload, _ in messages[seen:]:
            status = json.loads(payload)
            if done(status):
                return status
        seen = len(messages)
    return None


def test_a_publish_the_acl_refuses_is_counted_logged_and_the_daemon_goes_on(
    broker_factory: BrokerFactory, pki: Pki, built_litert_bundle: Path, unique_topic: str, tmp_path: Path,
    daemons: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    """The user may read its inputs and write its error and health topics, not its result topic. Under MQTT 5,
    mosquitto 2.0.11 answers each result's PUBACK with 135 "Not authorized" (under 3.1.1 it drops it silently and
    acknowledges success): counted as ``publish_refused``, logged, not retried; the error mirror still goes out."""
    broker = broker_factory(tls=pki.broker_tls, users={USER: PASSWORD}, acl=secure_acl(unique_topic, "allowed"))
    sections: dict[str, dict[str, object]] = {
        "broker": broker_section(pki, tmp_path),
        "output": {"error_topic": f"{unique_topic}/errors/{{device}}"},
        "health": {"status_interval_s": 0.5},
    }
    subscribe = f"{unique_topic}/sensors/+/image"
    daemon = start_daemon(
        built_litert_bundle, broker.tls_port, toml_config(tmp_path / "daemon.toml", sections), subscribe=subscribe,
        publish=f"{unique_topic}/results/{{device}}",
    )  # fmt: skip
    daemons.append(daemon)
    name = bundle_name(built_litert_bundle)
    await_subscription(broker, daemon, f"edgeline-{name}-t", subscribe)
    results = Collector(broker, f"{unique_topic}/results/#", timeout=TIMEOUT_S)
    errors = Collector(broker, f"{unique_topic}/errors/#", timeout=TIMEOUT_S)
    valid = [json.dumps({"id": key, "data": x.tolist()}).encode() for key, x in image_payloads(3, seed=6).items()]
    publish_json(broker, f"{unique_topic}/sensors/cam/image", [*valid, b'{"id": "late", "data": [1.0]}'])
    mirrored = [json.loads(payload) for _, payload, _ in errors.wait_for(1)]
    assert [(m["id"], m["error"]["code"]) for m in mirrored] == [("late", "wrong-shape")]

    status_topic = f"edgeline/{name}/t/status"
    watcher = Collector(broker, status_topic, timeout=TIMEOUT_S)
    status = wait_for_status(watcher, lambda s: s["counts"].get("publish_refused") == 4 and s["outbox_depth"] == 0)
    assert status is not None, watcher.payloads[-1:]
    assert status["connected"] and status["counts"]["published"] >= 1  # the error mirror, and the availability
    newcomer = Collector(broker, status_topic, timeout=TIMEOUT_S)
    assert newcomer.wait_for(1)[0][2], "the status message is retained: a newcomer gets the latest at once"
    assert results.messages == []  # the broker dropped every refused result
    code, stderr = stop(daemon)
    assert code == 0 and "Traceback" not in stderr, stderr[-3000:]
    # four refusals, counted above; said once with the reason (a refusing ACL must not fill the journal)
    assert stderr.count("answers the broker refused (not retried): Not authorized") == 1, stderr[-3000:]
    assert connections(broker, f"edgeline-{name}-t") == 1, broker.log_text()[-3000:]
    for collector in (results, errors, watcher, newcomer):
        collector.close()


# --- a shared subscription ------------------------------------------------------------------------------------


def test_three_daemons_in_a_share_group_answer_each_input_exactly_once(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path,
    daemons: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    """``$share/g1/...``: the broker gives each input to one daemon of the group. Each instance has its own state
    directory (the state lives in DIR/<bundle name>, locked: two daemons of one bundle cannot share it), client
    id, status topic, and names itself in every answer."""
    instances = ("a", "b", "c")
    subscribe = f"$share/g1/{unique_topic}/sensors/+/x"
    config = toml_config(tmp_path / "daemon.toml", {"health": {"status_interval_s": 0.5}})
    name = bundle_name(built_litert_bundle)
    for instance in instances:
        daemon = start_daemon(
            built_litert_bundle, broker.port, config, subscribe=subscribe, publish=f"{unique_topic}/results/{{device}}",
            instance=instance, extra=("--state-dir", str(tmp_path / instance)),
        )  # fmt: skip
        daemons.append(daemon)
    for instance, daemon in zip(instances, daemons, strict=True):
        await_subscription(broker, daemon, f"edgeline-{name}-{instance}", subscribe)
    results = Collector(broker, f"{unique_topic}/results/#", timeout=TIMEOUT_S)
    statuses = Collector(broker, f"edgeline/{name}/+/status", timeout=TIMEOUT_S)
    count = 600
    publish_json(
        broker, f"{unique_topic}/sensors/dev/x",
        [json.dumps({"id": f"m{index}", "data": [(index % 97) / 97] * 64}).encode() for index in range(count)],
    )  # fmt: skip
    results.wait_for(count, timeout=120)
    # A barrier per daemon instead of a pause: sentinels one at a time until each instance has answered one (the
    # group hands them round); a duplicate from any daemon would have come before its sentinel's answer.
    sentinels: list[str] = []
    while {json.loads(payload)["instance"] for _, payload, _ in results.messages[count:]} != set(instances):
        assert len(sentinels) < 10 * len(instances), "the share group never handed a sentinel to every instance"
        sentinels.append(f"sentinel{len(sentinels)}")
        sentinel = json.dumps({"id": sentinels[-1], "data": [0.5] * 64}).encode()
        publish_json(broker, f"{unique_topic}/sensors/dev/x", [sentinel])
        got = results.wait_for(count + len(sentinels))
        assert len(got) == count + len(sentinels), f"{len(got)} answers to {count} inputs and {sentinels}"
        assert json.loads(got[-1][1])["id"] == sentinels[-1], "an answer came after everything else was answered"
    answers = [json.loads(payload) for _, payload, _ in results.messages[:count]]
    assert Counter(answer["id"] for answer in answers) == Counter(f"m{index}" for index in range(count))
    assert all("error" not in answer for answer in answers)
    assert set(Counter(answer["instance"] for answer in answers)) == set(instances)  # each answered some
    by_instance = Counter(json.loads(payload)["instance"] for _, payload, _ in results.messages)  # and sentinels
    assert set(by_instance) == set(instances), by_instance  # nobody else answered

    def caught_up(status: dict[str, Any]) -> bool:
        latest[status["instance"]] = status
        return all(latest.get(i, {}).get("counts", {}).get("results") == by_instance[i] for i in instances)

    latest: dict[str, dict[str, Any]] = {}
    assert wait_for_status(statuses, caught_up) is not None, {i: s["counts"] for i, s in latest.items()}
    for topic, payload, _ in statuses.messages:
        assert topic == f"edgeline/{name}/{json.loads(payload)['instance']}/status"
    for daemon in daemons:
        code, stderr = stop(daemon)
        assert code == 0 and "Traceback" not in stderr, stderr[-3000:]
    results.close()
    statuses.close()
