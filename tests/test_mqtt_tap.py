"""The MQTT tap of ``scripts/vm.sh power-cut`` (``edgeline.sim.mqtt_tap``): every QoS 1 acknowledgement read off a
connection's bytes and matched with the PUBLISH it acknowledges (quick: packets made here, split anywhere), and
the tap in front of a real Mosquitto with a real ``edgeline run`` behind it (integration), in MQTT 3.1.1 and 5.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeline.sim.mqtt_tap import Acknowledged, MqttStreamError, MqttTap, Side, TapSession
from tests import waiting
from tests.mqtt_broker import Broker

TIMEOUT_S = 60.0
wait_until = partial(waiting.wait_until, timeout=TIMEOUT_S)

# -- packets, as a client and a broker write them --------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        value, digit = value >> 7, value & 0x7F
        out.append(digit | (0x80 if value else 0))
        if not value:
            return bytes(out)


def packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([kind << 4 | flags]) + varint(len(body)) + body


def string(text: bytes) -> bytes:
    return struct.pack(">H", len(text)) + text


def connect(level: int) -> bytes:
    properties = varint(0) if level == 5 else b""
    return packet(1, 0, string(b"MQTT") + bytes([level, 2]) + struct.pack(">H", 60) + properties + string(b"dev"))


def connack(level: int) -> bytes:
    return packet(2, 0, b"\x00\x00" + (varint(0) if level == 5 else b""))


def publish(level: int, topic: bytes, payload: bytes, packet_id: int, qos: int = 1, properties: bytes = b"") -> bytes:
    body = string(topic) + (struct.pack(">H", packet_id) if qos else b"")
    body += varint(len(properties)) + properties if level == 5 else b""
    return packet(3, qos << 1, body + payload)


def puback(level: int, packet_id: int, reason: int | None = None) -> bytes:
    tail = bytes([reason]) + varint(0) if level == 5 and reason is not None else b""
    return packet(4, 0, struct.pack(">H", packet_id) + tail)


def conversation(level: int) -> list[tuple[Side, bytes]]:
    """A daemon's connection: an input delivered (packet id 7) and acknowledged once its answer (packet id 1) was
    published; a QoS 0 message; a PINGREQ; the broker's acknowledgement of the answer."""
    properties = b"\x0b\x01" if level == 5 else b""  # a subscription identifier, as MQTT 5 brokers add
    return [
        (Side.CLIENT, connect(level)),
        (Side.BROKER, connack(level)),
        (Side.BROKER, publish(level, b"sensors/a/x", b'{"id": "in-1"}', 7, properties=properties)),
        (Side.CLIENT, publish(level, b"edgeline/a", b'{"id": "in-1", "version": 1}', 1)),
        (Side.CLIENT, puback(level, 7)),
        (Side.BROKER, publish(level, b"sensors/a/x", b"quiet", 0, qos=0)),
        (Side.CLIENT, packet(12, 0, b"")),
        (Side.BROKER, puback(level, 1)),
    ]


EXPECTED = [
    Acknowledged(Side.BROKER, 7, "sensors/a/x", b'{"id": "in-1"}'),
    Acknowledged(Side.CLIENT, 1, "edgeline/a", b'{"id": "in-1", "version": 1}'),
]


def replay(session: TapSession, steps: list[tuple[Side, bytes]]) -> list[Acknowledged]:
    return [ack for side, data in steps for ack in session.received(side, data)]


@pytest.mark.quick
@pytest.mark.parametrize("level", [4, 5])
def test_each_acknowledgement_is_matched_with_the_publish_it_acknowledges(level: int) -> None:
    session = TapSession()
    assert replay(session, conversation(level)) == EXPECTED
    assert (session.protocol, session.unmatched) == (level, 0)
    assert session.received(Side.CLIENT, puback(level, 9)) == [] and session.unmatched == 1, "no PUBLISH 9"


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(st.integers(4, 5), st.lists(st.integers(0, 400), max_size=12))
def test_the_bytes_split_anywhere_give_the_same_acknowledgements(level: int, cuts: list[int]) -> None:
    """TCP delivers a stream, not packets: each side's bytes cut into arbitrary pieces read the same."""
    steps = conversation(level)
    pieces: list[tuple[Side, bytes]] = []
    for side, data in steps:
        points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
        pieces += [(side, data[a:b]) for a, b in itertools.pairwise(points)]
    assert replay(TapSession(), pieces) == EXPECTED


@pytest.mark.quick
def test_a_packet_id_used_again_acknowledges_its_new_message() -> None:
    session = TapSession()
    steps = [(Side.CLIENT, connect(4)), (Side.BROKER, publish(4, b"t", b"first", 3)), (Side.CLIENT, puback(4, 3)),
             (Side.BROKER, publish(4, b"t", b"second", 3)), (Side.CLIENT, puback(4, 3))]  # fmt: skip
    assert [ack.payload for ack in replay(session, steps)] == [b"first", b"second"]


@pytest.mark.quick
def test_an_mqtt5_refusal_is_recorded_with_its_reason() -> None:
    """A PUBACK whose reason code is 0x80 or more did not take the message: the record says which."""
    session = TapSession()
    steps = [(Side.CLIENT, connect(5)), (Side.CLIENT, publish(5, b"t", b"p", 2)), (Side.BROKER, puback(5, 2, 0x97))]
    (ack,) = replay(session, steps)
    assert (ack.reason, ack.accepted) == (0x97, False)
    assert EXPECTED[0].accepted


@pytest.mark.quick
@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([(Side.CLIENT, b"\x10\xff\xff\xff\xff\x01")], r"client's bytes, byte 1: a remaining length of more than 4"),
        ([(Side.CLIENT, b"\x10" + varint(2 << 20))], r"client's bytes, byte 0: a packet of 2097152 bytes, over"),
        ([(Side.CLIENT, connect(4)), (Side.BROKER, packet(3, 2, string(b"topic")[:4]))],
         r"broker's bytes, byte 0: a PUBLISH of 4 bytes cut short"),
        ([(Side.BROKER, publish(4, b"t", b"p", 1))], r"broker's bytes, byte 0: a PUBLISH before the client's CONNECT"),
        ([(Side.CLIENT, packet(1, 0, string(b"MQTT") + b"\x09\x02\x00\x3c"))], r"protocol level 9"),
    ],
)  # fmt: skip
def test_a_stream_that_is_not_mqtt_is_refused_naming_the_side_and_the_byte(
    steps: list[tuple[Side, bytes]], expected: str
) -> None:
    session = TapSession()
    with pytest.raises(MqttStreamError, match=expected):
        replay(session, steps)
    with pytest.raises(MqttStreamError, match="already refused"):
        session.received(Side.CLIENT, b"")


@pytest.mark.quick
@settings(max_examples=300, deadline=None)
@given(st.integers(4, 5), st.integers(0, 300), st.binary(min_size=1, max_size=32), st.sampled_from(list(Side)))
def test_damaged_bytes_are_read_or_refused_never_a_traceback(level: int, at: int, junk: bytes, side: Side) -> None:
    """Bytes overwritten anywhere in one side's stream (the other's as it was, the client's CONNECT first):
    acknowledgements, or an ``MqttStreamError`` naming the side and a byte."""
    steps = conversation(level)
    damaged = bytearray(b"".join(data for s, data in steps if s is side))
    damaged[at : at + len(junk)] = junk
    other = b"".join(data for s, data in steps[1:] if s is not side)
    session = TapSession()
    try:
        if side is Side.BROKER:
            session.received(Side.CLIENT, steps[0][1])
        session.received(side, bytes(damaged))
        session.received(side.other, other)
    except MqttStreamError as exc:
        assert re.search(r"the (client|broker)'s bytes, byte \d+: ", str(exc)), exc


# -- a real broker and a real daemon (integration) ------------------------------------------------------------------


@pytest.fixture
def tap(broker: Broker) -> Iterator[MqttTap]:
    with MqttTap(broker.port) as tap:
        yield tap


@pytest.mark.integration
@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_daemon_s_acknowledgements_through_the_tap(
    protocol: str, tap: MqttTap, broker: Broker, sqrt_bundle: Path, unique_topic: str, tmp_path: Path
) -> None:
    """``edgeline run`` connects through the tap: the tap records both kinds of acknowledgement on its connection,
    the daemon's of each input (sent once the input's answer is committed) and the broker's of each answer, each
    with the id its payload carries; nothing unmatched, nothing refused, the records in the order they came."""
    config = tmp_path / "daemon.toml"
    config.write_text(f'[broker]\nprotocol = "{protocol}"\n')
    command = [sys.executable, "-m", "edgeline.cli", "run", str(sqrt_bundle), "--broker", f"127.0.0.1:{tap.port}",
               "--subscribe", f"{unique_topic}/sensors/+/x", "--publish", f"{unique_topic}/results/{{device}}",
               "--qos", "1", "--state-dir", str(tmp_path / "state"), "--instance", "tap",
               "--config", str(config)]  # fmt: skip
    log = (tmp_path / "daemon.log").open("wb")
    daemon = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        assert broker.wait_for_subscription("edgeline-sqrt-tap", f"{unique_topic}/sensors/+/x", timeout=TIMEOUT_S)
        ids = [f"in-{i}" for i in range(20)]
        lines = "".join(json.dumps({"id": i, "data": [1.0, 2.0, 3.0, 4.0]}) + "\n" for i in ids)
        subprocess.run(["mosquitto_pub", *broker.client_args, "-q", "1", "-t", f"{unique_topic}/sensors/d/x", "-l"],
                       input=lines.encode(), check=True, timeout=TIMEOUT_S)  # fmt: skip

        def taken() -> tuple[list[str], list[str]]:
            records = [r for r in tap.records() if r.ack.topic.startswith(unique_topic)]  # not its status ("online")
            inputs = [json.loads(r.ack.payload)["id"] for r in records if r.ack.publisher is Side.BROKER]
            return inputs, [json.loads(r.ack.payload)["id"] for r in records if r.ack.publisher is Side.CLIENT]

        wait_until(lambda: sorted(taken()[0]) == sorted(ids) and sorted(taken()[1]) == sorted(ids))
        inputs, answers = taken()
        assert sorted(inputs) == sorted(answers) == sorted(ids), (inputs, answers, tap.problems)
        records = tap.records()
        assert all(r.ack.accepted and r.connection == records[0].connection for r in records), records
        assert [r.at for r in records] == sorted(r.at for r in records), "stamped in the order they came"
        assert tap.problems == [] and tap.unmatched == 0
    finally:
        daemon.terminate()
        daemon.wait(TIMEOUT_S)
        log.close()
