"""The answer path's transport: what the sinks and the delivery path need of a broker connection, and nothing more.

    Sinks ──call_soon(acks)──┐
    Delivery ──call_soon(hand-over), room, connected──┼──► Transport ◄── MqttConnection (``edgeline.daemon.mqtt``)
    MqttSink ──publish(qos, done), connected──────────┘                   or a test's in-memory transport

One small interface, as httpx puts one between its client and the network: the answer path's logic (the in-flight
window, the broker's acknowledgements, refusals, expiry, the inputs' acknowledgements after their answers are
stored) can be driven without a broker by a transport written in a test, and the real connection is one
implementation among others. The real-broker tests stay: they test the connection.

The contract, as ``MqttConnection`` keeps it:

- ``call_soon(task)`` runs ``task()`` on the transport's own thread (the network thread), soon, in the order
  posted, from any thread.
- ``publish(...)`` hands one message over and returns False when it cannot take it now (try later). ``done(ok,
  reason)`` fires once: when the broker acknowledges (QoS 1: ``ok``), refuses (``reason`` says why), or the message
  expired before it could be sent again (``reason == "expired"``); at once for QoS 0.
- ``room`` is how many more QoS 1 publishes the in-flight window takes now; ``connected`` is set while connected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["AnswerFormat", "PublishDone", "Transport"]

PublishDone = Callable[[bool, str | None], None]
"""Called once per publish: (accepted by the broker, the reason when not)."""


@dataclass(frozen=True)
class AnswerFormat:
    """What an answer's payload is, said in MQTT 5's Content Type and Payload Format Indicator."""

    content_type: str
    utf8: bool


@runtime_checkable
class Transport(Protocol):
    """What the answer path needs of a broker connection (see the module)."""

    connected: threading.Event

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int,
        retain: bool = False,
        expiry_at: float | None = None,
        form: AnswerFormat | None = None,
        correlation: bytes | None = None,
        done: PublishDone | None = None,
    ) -> bool: ...

    def call_soon(self, task: Callable[[], None]) -> None: ...

    @property
    def room(self) -> int: ...
