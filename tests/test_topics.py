"""Stream keys from MQTT topics, and publish templates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgeline.daemon.topics import TopicFilter, render_topic, validate_template
from edgeline.errors import EdgelineError

pytestmark = [pytest.mark.quick, pytest.mark.device]  # the device tier runs these (scripts/test_device.sh)

level = st.text(alphabet=st.characters(blacklist_characters="/+#\x00", blacklist_categories=("Cs",)), min_size=1)


@pytest.mark.parametrize(
    ("pattern", "topic", "device"),
    [
        ("sensors/+/accel", "sensors/pump-7/accel", "pump-7"),
        ("sensors/+/accel", "sensors/pump-7/temp", None),
        ("sensors/+/accel", "sensors/pump-7/accel/x", None),
        ("sensors/+/+", "sensors/a/b", "a"),
        ("sensors/#", "sensors/a/b", "a/b"),
        ("sensors/+/#", "sensors/a/b/c", "a"),
        ("sensors/#", "sensors", "sensors"),
        ("plant/line1", "plant/line1", "plant/line1"),
        ("plant/line1", "plant/line2", None),
    ],
)
def test_device_from_topic(pattern: str, topic: str, device: str | None) -> None:
    assert TopicFilter(pattern).device(topic) == device


@given(st.lists(level, min_size=1, max_size=5), st.integers(min_value=0, max_value=4))
def test_plus_level_is_the_device(levels: list[str], position: int) -> None:
    position %= len(levels)
    pattern = "/".join("+" if i == position else part for i, part in enumerate(levels))
    assert TopicFilter(pattern).device("/".join(levels)) == levels[position]


@pytest.mark.parametrize("pattern", ["", "a/#/b", "a/b#", "a/+b", "a+/c"])
def test_invalid_filters_are_refused(pattern: str) -> None:
    with pytest.raises(EdgelineError):
        TopicFilter(pattern)


def test_templates() -> None:
    assert render_topic(validate_template("results/{name}/{device}"), device="d1", name="kws") == "results/kws/d1"
    with pytest.raises(EdgelineError, match=r"unknown field\(s\) sensor; valid: \{device\}, \{name\}"):
        validate_template("results/{sensor}")
    for bad in ("results/+", "results/#", "", "results/{device"):
        with pytest.raises(EdgelineError):
            validate_template(bad)
