"""The daemon's configuration file and flags: validated, with errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeline.daemon.config import DaemonConfig, load_config
from edgeline.errors import EdgelineError

pytestmark = pytest.mark.device  # the device tier runs these (scripts/test_device.sh)

GOOD = """
[broker]
host = "127.0.0.1"
port = 18830

[input]
subscribe = ["plant/+/vibration"]
codec = "msgpack"
qos = 0

[queue]
capacity = 64
policy = "block"

[window]
size = 5
hop = 1
channels = 128
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    return path


@pytest.mark.quick
def test_defaults_without_a_file() -> None:
    config = load_config(None)
    assert config == DaemonConfig()
    assert config.queue.policy is None and config.queue_policy == "block"  # MQTT at QoS 1: the broker holds the backlog


@pytest.mark.quick
def test_file_is_read(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert (config.broker.port, config.input.subscribe, config.input.codec) == (
        18830,
        ("plant/+/vibration",),
        "msgpack",
    )
    assert config.queue.policy == "block"
    assert config.window is not None and config.window.channels == 128


@pytest.mark.quick
def test_flags_override_the_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD)).with_overrides(
        broker="localhost:1884", subscribe=["a/+/b", "c/+"], publish="out/{device}", codec="json", qos=1
    )
    assert (config.broker.host, config.broker.port) == ("localhost", 1884)
    assert config.input.subscribe == ("a/+/b", "c/+")
    assert (config.output.publish, config.input.codec, config.input.qos, config.output.qos) == (
        "out/{device}",
        "json",
        1,
        1,
    )
    assert config.queue.capacity == 64  # untouched by flags


@pytest.mark.quick
@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[input]\nqos = 2\n", "input.qos"),
        ("[input]\ncodec = 'xml'\n", "input.codec"),
        ("[queue]\npolicy = 'drop-newest'\n", "queue.policy"),
        ("[queue]\ncapacity = 0\n", "queue.capacity"),
        ("[broker]\nprot = 1883\n", "broker.prot"),
        ("[input]\nsubscribe = ['a/#/b']\n", "input.subscribe"),
        ("[output]\npublish = 'r/{sensor}'\n", "output.publish"),
        ("[window]\nsize = 4\n", "window.hop"),
        ("[source]\nkind = 'serial'\n", "source.url"),
        ("[source]\nkind = 'replay'\n", "source.path"),
        ("[source]\nkind = 'sim'\n", "source.sim"),
        ("[source]\nkind = 'usb'\n", "source.kind"),
        ("[source]\nkind = 'serial'\nurl = '/dev/ttyUSB0'\nbaudrate = 7\n", "source.baudrate"),
        ("[source]\ndevice = 'a/b'\n", "source.device"),
        ("[output]\nmqtt = false\n", "output.mqtt"),
        ("[source]\nkind = 'serial'\nurl = '/dev/ttyUSB0'\n[input]\ncodec = 'cbor'\n", "input.codec"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(EdgelineError) as error:
        load_config(path)
    assert str(path) in str(error.value)
    assert named in str(error.value)


@pytest.mark.quick
def test_valid_values_are_listed(tmp_path: Path) -> None:
    with pytest.raises(EdgelineError, match=r"queue\.policy: 'drop-newest' is not valid; valid: drop-oldest, block"):
        load_config(write(tmp_path, "[queue]\npolicy = 'drop-newest'\n"))


@pytest.mark.quick
def test_an_unknown_key_lists_the_valid_keys_of_its_table(tmp_path: Path) -> None:
    """The same wording as a profile's (one formatter for profiles, manifests and daemon configurations)."""
    expected = r"queue\.max_batches: unknown key; valid keys: capacity, policy, max_batch$"
    with pytest.raises(EdgelineError, match=expected):
        load_config(write(tmp_path, "[queue]\nmax_batches = 4\n"))


@pytest.mark.quick
def test_broken_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(EdgelineError, match="not valid TOML"):
        load_config(write(tmp_path, "[input\n"))
    with pytest.raises(EdgelineError, match=r"--config .*nope\.toml"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.integration
@pytest.mark.parametrize("broker", [":1883", "host:port", "host:x", "::1:1883", "[::1", "host:70000"])
def test_bad_broker_flag(broker: str) -> None:
    with pytest.raises(EdgelineError, match="--broker"):
        DaemonConfig().with_overrides(broker=broker)


@pytest.mark.quick
def test_each_source_has_its_stated_queue_policy_and_sink() -> None:
    mqtt = DaemonConfig()
    assert (mqtt.queue_policy, mqtt.uses_broker) == ("block", True)
    at_most_once = DaemonConfig.model_validate({"input": {"qos": 0}})
    assert at_most_once.queue_policy == "drop-oldest"
    serial = mqtt.with_overrides(source={"kind": "serial", "url": "/dev/ttyUSB0"})
    assert (serial.queue_policy, serial.uses_broker) == ("drop-oldest", False)
    replay = mqtt.with_overrides(source={"kind": "replay", "path": "-"})
    assert (replay.queue_policy, replay.uses_broker) == ("block", False)
    # --broker with another source: publish its answers there
    assert mqtt.with_overrides(broker="127.0.0.1:1884", source={"kind": "sim", "sim": "digits"}).uses_broker
    explicit = DaemonConfig.model_validate(
        {"source": {"kind": "replay", "path": "-"}, "queue": {"policy": "drop-oldest"}}
    )
    assert explicit.queue_policy == "drop-oldest"


@pytest.mark.quick
def test_a_source_flag_replaces_the_files_source(tmp_path: Path) -> None:
    path = write(tmp_path, "[source]\nkind = 'serial'\nurl = '/dev/ttyACM0'\ndevice = 'bench'\n")
    config = load_config(path).with_overrides(source={"kind": "replay", "path": "rec.jsonl"})
    assert (config.source.kind, config.source.path, config.source.url, config.source.device) == (
        "replay",
        "rec.jsonl",
        None,
        "bench",
    )
    assert load_config(path).with_overrides(source={"baudrate": 9600}).source.url == "/dev/ttyACM0"


@pytest.mark.quick
def test_updates_are_configured_by_the_file_or_the_flags_and_need_their_trusted_root(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[updates]\nrepository = "https://updates.example/fleet"\ntrusted_root = "/etc/root.json"\n')
    config = load_config(path)
    assert config.updates.enabled and config.updates.check_interval_s == 300.0
    flagged = DaemonConfig().with_overrides(updates="/media/usb/repo", trusted_root=Path("root"), check_interval_s=5)
    assert flagged.updates.repository == "/media/usb/repo" and flagged.updates.check_interval_s == 5
    assert not DaemonConfig().updates.enabled
    path.write_text('[updates]\nrepository = "/media/usb/repo"\n')
    with pytest.raises(EdgelineError, match=r"updates\.repository is set alone"):
        load_config(path)
    with pytest.raises(EdgelineError, match="check_interval_s"):
        DaemonConfig().with_overrides(updates="r", trusted_root=Path("t"), check_interval_s=0)
