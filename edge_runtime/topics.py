"""MQTT topic filters and templates: which stream (device) a message belongs to, and where its answer goes.

A subscription such as ``sensors/+/accel`` names the stream key by its first ``+`` level: a message on
``sensors/pump-7/accel`` belongs to device ``pump-7``. A filter ending in ``#`` with no ``+`` takes the
remainder; a filter with no wildcard takes the whole topic. Publish templates use ``{device}`` and ``{name}``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from edge_runtime.errors import EdgelineError

__all__ = ["TopicFilter", "render_topic", "validate_template"]

TEMPLATE_FIELDS = ("device", "name")


@dataclass(frozen=True)
class TopicFilter:
    """A validated MQTT subscription filter that can also pull the stream key out of a matching topic."""

    pattern: str

    def __post_init__(self) -> None:
        levels = self.pattern.split("/")
        if not self.pattern or "\x00" in self.pattern:
            raise EdgelineError(f"subscription {self.pattern!r}: a topic filter must be a non-empty string")
        for index, level in enumerate(levels):
            if "#" in level and (level != "#" or index != len(levels) - 1):
                raise EdgelineError(f"subscription {self.pattern!r}: '#' must be a whole, last level")
            if "+" in level and level != "+":
                raise EdgelineError(f"subscription {self.pattern!r}: '+' must be a whole level")

    def device(self, topic: str) -> str | None:
        """The stream key of ``topic`` if it matches this filter, else None."""
        pattern = self.pattern.split("/")
        parts = topic.split("/")
        key: str | None = None
        for index, level in enumerate(pattern):
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
        if len(parts) != len(pattern):
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


def render_topic(template: str, *, device: str, name: str) -> str:
    return template.format(device=device, name=name)
