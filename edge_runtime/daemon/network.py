"""The daemon's turn of the MQTT network loop, and the level the intake gate reads.

    every turn (network thread): "online" on a new connection ─► held inputs into the queue once the gate opens
      ─► inputs shed past our Receive Maximum: a reconnection once what was held is answered
      ─► the delivery path fills the in-flight window

Everything here runs on the network thread except ``level``, which the intake gate reads from the submitting
thread (a reading a moment old is fine: each counter it adds up has one writer).
"""

from __future__ import annotations

import logging
import threading

from edgeline.daemon.delivery import Delivery
from edgeline.daemon.intake import Intake
from edgeline.daemon.mqtt import MqttConnection
from edgeline.daemon.sinks import Sinks
from edgeline.lograte import Repeated

__all__ = ["NetworkTick", "flow_level"]

log = logging.getLogger("edgeline.daemon")


def flow_level(delivery: Delivery, intake: Intake) -> tuple[int, int]:
    """The intake gate's level: inputs taken and not answered yet, and the answers the broker does not have."""
    answers, size = delivery.level()
    inputs = intake.pending
    return answers + inputs, size + inputs * delivery.answer_size


class NetworkTick:
    """With a broker: what the daemon does on the network thread between its reads and writes."""

    def __init__(
        self,
        connection: MqttConnection,
        delivery: Delivery,
        intake: Intake,
        sinks: Sinks,
        *,
        availability_topic: str,
        stopping: threading.Event,
    ):
        self.connection = connection
        self.delivery = delivery
        self.intake = intake
        self.sinks = sinks
        self.availability_topic = availability_topic
        self.stopping = stopping
        self.shed_log = Repeated(log, "inputs beyond the broker's window", level=logging.INFO)
        self._announced = 0
        """The connection (``MqttConnection.generation``) "online" was last published on."""

    def tick(self) -> None:
        """Every turn of the network loop: say "online" on a new connection, take held inputs once the gate is
        open again, and let the delivery path fill the in-flight window."""
        connection = self.connection
        if connection.generation != self._announced and connection.connected.is_set() and not self.stopping.is_set():
            # on every connection, not only the first: after a lost link the broker has published our will
            self._announced = connection.generation
            connection.publish(self.availability_topic, b"online", qos=1, retain=True)
        intake = self.intake
        if intake.held:
            intake.release_held()
        if intake.shed and not intake.held and intake.pending == 0 and self.delivery.settled:
            # what the broker sent past our Receive Maximum was left unacknowledged: a new connection has it again
            self.shed_log.happened(
                intake.shed,
                f"{intake.shed} inputs past the {intake.max_held} held (the broker sent more than our Receive "
                "Maximum allows; Mosquitto 2.0.11 does after a reconnection to queued messages): left "
                "unacknowledged, reconnecting to have them sent again",
            )
            intake.shed = 0
            connection.redeliver()
        self.delivery.tick()

    def level(self) -> tuple[int, int]:
        """The intake gate's level (``flow_level``)."""
        return flow_level(self.delivery, self.intake)
