"""The daemon is up only once the broker has taken its subscriptions, against a real Mosquitto behind a relay that
holds or refuses them.

A session new to the broker holds nothing for a filter the broker has not taken yet: a daemon that said it was up
on the broker's CONNACK, with its SUBSCRIBE still on the way, lost what was published in between (the whole suite
lost the first inputs of two daemon tests on a loaded machine). And a daemon whose subscription the broker refuses
is deaf: it must exit non-zero naming the filter, not run on reporting healthy. Mosquitto 2.0's ACLs refuse reads at
delivery, not at SUBSCRIBE, so the relay answers the SUBSCRIBE with "Not authorized" as a broker that checks them
there does (MQTT 5 reason code 0x87)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeline.daemon.service import Daemon
from tests.mqtt_broker import Broker, Collector
from tests.test_daemon_backpressure import PacketRelay, answered, config_for, publish_all

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

HOLD_S = 2.0  # how long the relay holds the daemon's SUBSCRIBE (and everything the daemon sends after it)
TIMEOUT_S = 60.0
SUBSCRIBE, SUBACK = 8, 9
NOT_AUTHORIZED = 0x87


class SubscriptionRelay(PacketRelay):
    """Holds the daemon's first SUBSCRIBE ``hold_s`` seconds (the bytes after it wait behind it), or answers every
    SUBSCRIBE's SUBACK with "Not authorized" (``refuse``); every other packet passes as it is."""

    def __init__(self, broker: Broker, *, hold_s: float = 0.0, refuse: bool = False) -> None:
        self.hold_s, self.refuse = hold_s, refuse
        self.held = 0  # SUBSCRIBEs held
        self.refused = 0  # SUBACKs rewritten
        super().__init__(broker)

    def up(self, packet: bytes) -> bytes:
        if packet[0] >> 4 == SUBSCRIBE and self.hold_s and not self.held:
            self.held += 1
            time.sleep(self.hold_s)
        return packet

    def down(self, packet: bytes) -> bytes:
        if packet[0] >> 4 != SUBACK or not self.refuse:
            return packet
        # MQTT 5 SUBACK: fixed header, packet id, properties (length first), one reason code per filter
        at = len(packet) - len(_body(packet)) + 2
        length, shift = 0, 0
        while True:
            digit = packet[at]
            length |= (digit & 127) << shift
            at, shift = at + 1, shift + 7
            if digit < 128:
                break
        codes = at + length
        self.refused += 1
        return packet[:codes] + bytes([NOT_AUTHORIZED]) * (len(packet) - codes)


def _body(packet: bytes) -> bytes:
    """What follows a packet's fixed header (its type byte and remaining length)."""
    index = 1
    while packet[index] & 128:
        index += 1
    return packet[index + 1 :]


@pytest.mark.integration
def test_the_daemon_is_up_only_once_the_broker_has_taken_its_subscription(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """The relay holds the SUBSCRIBE 2 s; inputs published the moment ``start`` returns are every one answered
    (``start`` returned on the CONNACK, and the 20 inputs reached a broker with no subscriber: none answered)."""
    count = 20
    relay = SubscriptionRelay(broker, hold_s=HOLD_S)
    config = config_for(("127.0.0.1", relay.port), unique_topic, tmp_path / "state")
    results = Collector(broker, f"{unique_topic}/out/#", timeout=TIMEOUT_S)
    daemon = Daemon(built_litert_bundle, config)
    try:
        daemon.start()
        assert relay.held == 1, "the relay never saw the daemon's SUBSCRIBE"
        publish_all(broker, unique_topic, range(count))
        answers = answered(results, count, timeout=TIMEOUT_S)
    finally:
        daemon.stop()
        relay.close()
        results.close()
    missing = sorted({f"m{i}" for i in range(count)} - set(answers))
    assert not missing, f"{len(missing)} of {count} inputs published after start never answered: {missing}"


@pytest.mark.integration
def test_a_refused_subscription_ends_the_daemon_naming_the_filter(
    broker: Broker, built_litert_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """``edgeline run`` through a broker that refuses its subscription exits 2, saying which filter and why,
    without a traceback (it logged the refusal and ran on, deaf, reporting ready)."""
    relay = SubscriptionRelay(broker, refuse=True)
    subscribe = f"{unique_topic}/in/+"
    command = [sys.executable, "-m", "edgeline.cli", "run", str(built_litert_bundle), "--broker",
               f"127.0.0.1:{relay.port}", "--subscribe", subscribe, "--publish", f"{unique_topic}/out/{{device}}",
               "--instance", "t", "--state-dir", str(tmp_path / "state")]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate(timeout=10)
        pytest.fail(f"the daemon ran on with its subscription refused: {stderr[-3000:]}")
    finally:
        relay.close()
    assert relay.refused >= 1, stderr[-3000:]
    assert process.returncode == 2, stderr[-3000:]  # the broker refused us at start (docs/design.md)
    assert f"refused the subscription {subscribe!r}: Not authorized" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
