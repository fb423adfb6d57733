"""Start-up checks of a configuration against the bundle it runs: refused with both sides named, before the
daemon says it is ready, instead of failing on every message later (or never stopping)."""

from __future__ import annotations

import math

from edgeline.daemon.config import DaemonConfig
from edgeline.daemon.topics import TopicFilter, overlapping
from edgeline.errors import EdgelineError
from edgeline.manifest import TensorSpec, Window

__all__ = ["check_topics", "check_window"]


def check_topics(config: DaemonConfig, *, name: str, instance: str, filters: list[TopicFilter]) -> None:
    """No answer, error, status or availability topic may match a subscription: the daemon would take its own
    answers as input, each producing another, without end."""
    if config.source.kind != "mqtt":
        return
    templates = {
        "output.publish (--publish)": config.output.publish,
        "output.error_topic": config.output.error_topic,
        "health.availability_topic": config.health.availability_topic,
        "health.status_topic": config.health.status_topic,
    }
    for key, template in templates.items():
        if template is None:
            continue
        for topic_filter in filters:
            if overlapping(template, topic_filter, name=name, instance=instance):
                raise EdgelineError(
                    f"{key} {template!r} can match the subscription {topic_filter.pattern!r}: the daemon would "
                    "answer its own answers; publish under another prefix, e.g. 'results/{device}'"
                )


def check_window(window: Window | None, inputs: tuple[TensorSpec, ...] | list[TensorSpec]) -> None:
    """A window must fill the model's one input exactly: size x channels values."""
    if window is None:
        return
    if len(inputs) != 1:
        raise EdgelineError(f"[window] needs a model with one input; this one has {len(inputs)}")
    spec = inputs[0]
    wanted = math.prod(spec.shape)
    if window.size * window.channels != wanted:
        raise EdgelineError(
            f"[window] size {window.size} x channels {window.channels} = {window.size * window.channels} values "
            f"does not fit the model input {spec.name!r} of shape {list(spec.shape)} ({wanted} values)"
        )
