"""MQTT topic filters and templates: which stream (device) a message belongs to, and where its answer goes.

A subscription such as ``sensors/+/accel`` names the stream key by its first ``+`` level: a message on
``sensors/pump-7/accel`` belongs to device ``pump-7``. A filter ending in ``#`` with no ``+`` takes the
remainder; a filter with no wildcard takes the whole topic. ``$share/GROUP/sensors/+/accel`` is an MQTT 5
shared subscription: the broker splits the stream between the daemons of the group, and the device still comes
from the ``+`` level after the prefix. Publish templates use ``{device}``, ``{name}`` and ``{instance}``.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

from edgeline.errors import EdgelineError

__all__ = [
    "MAX_TOPIC_BYTES",
    "SENSOR_SUBSCRIPTION",
    "SENSOR_TOPIC",
    "TopicFilter",
    "overlapping",
    "render_topic",
    "topic_problem",
    "validate_template",
]

TEMPLATE_FIELDS = ("device", "name", "instance")
MAX_TOPIC_BYTES = 65535
"""MQTT's limit on a topic's UTF-8 length (a two-byte length prefix)."""
_REFUSED_BY_BROKERS = re.compile(
    "[\x01-\x1f\x7f-\x9f\ufdd0-\ufdef"
    + "".join(chr(plane | 0xFFFE) + chr(plane | 0xFFFF) for plane in range(0, 0x110000, 0x10000))
    + "]"
)
"""MQTT 5's 1.5.4 (SHOULD NOT): control characters U+0001-U+001F and U+007F-U+009F, and Unicode's non-characters."""
SHARE_PREFIX = "$share/"
SENSOR_TOPIC = "sensors/{device}/{sensor}"
"""The default topic scheme of sensor messages: where ``edgeline sim`` publishes (and a sensor should)."""
SENSOR_SUBSCRIPTION = "sensors/+/+"
"""What ``edgeline run`` subscribes to by default: every topic of ``SENSOR_TOPIC``, the device from the first +."""


@dataclass(frozen=True)
class TopicFilter:
    """A validated MQTT subscription filter that can also pull the stream key out of a matching topic."""

    pattern: str
    group: str | None = field(init=False, default=None)
    """The share group of a ``$share/GROUP/...`` subscription, else None."""
    levels: tuple[str, ...] = field(init=False, default=())
    """The levels that topics are matched against (without the share prefix)."""

    def __post_init__(self) -> None:
        if not self.pattern or "\x00" in self.pattern:
            raise EdgelineError(f"subscription {self.pattern!r}: a topic filter must be a non-empty string")
        matched = self.pattern
        if self.pattern.startswith(SHARE_PREFIX):
            group, slash, matched = self.pattern[len(SHARE_PREFIX) :].partition("/")
            if not group or not slash or not matched or "+" in group or "#" in group:
                raise EdgelineError(
                    f"subscription {self.pattern!r}: a shared subscription is $share/GROUP/FILTER, "
                    "e.g. $share/kws/sensors/+/audio"
                )
            object.__setattr__(self, "group", group)
        levels = matched.split("/")
        for index, level in enumerate(levels):
            if "#" in level and (level != "#" or index != len(levels) - 1):
                raise EdgelineError(f"subscription {self.pattern!r}: '#' must be a whole, last level")
            if "+" in level and level != "+":
                raise EdgelineError(f"subscription {self.pattern!r}: '+' must be a whole level")
        if len(self.pattern.encode()) > MAX_TOPIC_BYTES:
            raise EdgelineError(f"subscription of {len(self.pattern.encode())} bytes: MQTT allows {MAX_TOPIC_BYTES}")
        object.__setattr__(self, "levels", tuple(levels))

    def device(self, topic: str) -> str | None:
        """The stream key of ``topic`` if it matches this filter, else None."""
        parts = topic.split("/")
        key: str | None = None
        for index, level in enumerate(self.levels):
            if level == "#":
                # '#' also matches the parent level itself ("a/#" matches "a").
                return key if key is not None else ("/".join(parts[index:]) or topic)
            if index >= len(parts):
                return None
            if level == "+":
                if key is None:
                    key = parts[index]
            elif level != parts[index]:
                return None
        if len(parts) != len(self.levels):
            return None
        return key if key is not None else topic


def validate_template(
    template: str, fields: tuple[str, ...] = TEMPLATE_FIELDS, *, what: str = "publish template"
) -> str:
    """Refuse a topic template with fields other than ``fields``, or with MQTT wildcards."""
    try:
        used = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as exc:
        raise EdgelineError(f"{what} {template!r}: {exc}") from exc
    unknown = sorted(set(used) - set(fields))
    if unknown:
        valid = ", ".join("{" + field + "}" for field in fields)
        raise EdgelineError(f"{what} {template!r}: unknown field(s) {', '.join(unknown)}; valid: {valid}")
    if not template or "+" in template or "#" in template or "\x00" in template:
        raise EdgelineError(f"{what} {template!r}: a topic cannot be empty or contain + or #")
    return template


def render_topic(template: str, *, device: str, name: str, instance: str = "") -> str:
    return template.format(device=device, name=name, instance=instance)


def topic_problem(topic: str) -> str | None:
    """Why ``topic`` cannot be published to (wildcards, NUL, a control character, empty, too long), or None when it
    can."""
    if not topic:
        return "an empty topic"
    if "+" in topic or "#" in topic:
        return "a topic with an MQTT wildcard (+ or #)"
    if "\x00" in topic:
        return "a topic with a NUL character"
    try:
        size = len(topic.encode("utf-8"))
    except UnicodeEncodeError:
        return "a topic that is not valid UTF-8"
    refused = _REFUSED_BY_BROKERS.search(topic)
    if refused is not None:  # MQTT says SHOULD NOT; Mosquitto closes the connection of a client that sends one
        return f"a topic with a control character or a Unicode non-character (U+{ord(refused.group()):04X})"
    if size > MAX_TOPIC_BYTES:
        return f"a topic of {size} bytes (MQTT allows {MAX_TOPIC_BYTES})"
    return None


def _template_levels(template: str, *, name: str, instance: str) -> list[str | None]:
    """The template's levels with ``{name}``/``{instance}`` filled in; a level holding ``{device}`` is None
    (it can become any text)."""
    levels: list[str | None] = []
    for level in template.split("/"):
        if "{device}" in level:
            levels.append(None)
        else:
            levels.append(render_topic(level, device="", name=name, instance=instance))
    return levels


def overlapping(template: str, topic_filter: TopicFilter, *, name: str, instance: str) -> bool:
    """Whether a topic rendered from ``template`` can match ``topic_filter``: a daemon publishing there would
    answer its own answers, without end. A level holding ``{device}`` is taken to be one or more levels of any
    text (a device read from a file may contain ``/``)."""
    return _can_match(tuple(_template_levels(template, name=name, instance=instance)), topic_filter.levels)


def _can_match(template: tuple[str | None, ...], pattern: tuple[str, ...]) -> bool:
    if not pattern:
        return not template
    if pattern[0] == "#":
        return True
    if not template:
        return False
    if template[0] is None:  # the device: it ends at this level, or spans the next one too
        return _can_match(template[1:], pattern[1:]) or _can_match(template, pattern[1:])
    if pattern[0] in ("+", template[0]):
        return _can_match(template[1:], pattern[1:])
    return False
