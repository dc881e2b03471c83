"""RabbitMQ topology: Evolution's exchanges and queues as Evolution declares them, and ours.

Evolution declares, on every publish, a durable topic exchange and durable quorum
queues bound to it (``x-queue-type: quorum``, nothing else). Declaring them with
other arguments would close the channel with PRECONDITION_FAILED on one side or
the other, so ours are exactly the same:

* global mode: exchange ``RABBITMQ_EXCHANGE``, queue ``<prefix>.<event>`` (or
  ``<event>`` without a prefix), binding key ``<event>``;
* instance mode: exchange ``<instance>``, queue ``<instance>.<event>``;
* own mode: one queue of this service bound to the exchange(s) for every event.

The service's own queues (all durable quorum queues, names under
``RABBITMQ_SERVICE_PREFIX``):

* ``<p>.retry.<n>.<delay>`` — one per retry tier, with a per-queue TTL
  (never a per-message expiration, which waits behind the head of the queue)
  that dead-letters, at least once, into ``<p>.ready``;
* ``<p>.lock-busy.<delay>`` — the same for messages whose event is being
  processed elsewhere;
* ``<p>.ready`` — where delayed messages come back; the worker consumes it;
* ``<p>.parking`` — what could not be delivered after the last tier, or is not
  an Evolution event, with the reason in its headers.

A delay is part of its queue's name: changing it declares a new queue instead of
failing on the old one's arguments, and the old one drains by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import aio_pika
from aio_pika.abc import AbstractChannel

from evolution_ingest.config import RabbitMode, Settings

#: The only argument Evolution gives its queues.
EVOLUTION_QUEUE_ARGUMENTS: Final[dict[str, Any]] = {"x-queue-type": "quorum"}


@dataclass(frozen=True, slots=True)
class Binding:
    exchange: str
    queue: str
    routing_key: str


@dataclass(frozen=True, slots=True)
class DelayQueue:
    queue: str
    delay_seconds: float


def _label(seconds: float) -> str:
    if seconds < 1 or seconds != int(seconds):
        return f"{round(seconds * 1000)}ms"
    return f"{int(seconds)}s"


def evolution_queue(prefix: str, event: str) -> str:
    """The global queue Evolution declares for ``event`` (``RABBITMQ_PREFIX_KEY`` may be empty)."""
    return f"{prefix}.{event}" if prefix else event


class Topology:
    """Names and bindings derived from the settings; :func:`declare` creates them."""

    def __init__(self, settings: Settings) -> None:
        self.mode = settings.rabbitmq_mode
        events = tuple(dict.fromkeys(settings.rabbitmq_events))
        prefix = settings.rabbitmq_service_prefix
        self.exchanges: list[str] = []
        self.sources: list[Binding] = []
        if self.mode is RabbitMode.GLOBAL:
            self.exchanges = [settings.rabbitmq_exchange]
            self.sources = [
                Binding(settings.rabbitmq_exchange, evolution_queue(settings.rabbitmq_prefix, e), e)
                for e in events
            ]
        elif self.mode is RabbitMode.INSTANCE:
            self.exchanges = list(dict.fromkeys(settings.rabbitmq_instances))
            self.sources = [Binding(i, f"{i}.{e}", e) for i in self.exchanges for e in events]
        else:
            self.exchanges = [settings.rabbitmq_exchange, *dict.fromkeys(settings.rabbitmq_instances)]
            self.sources = [Binding(x, settings.rabbitmq_queue, e) for x in self.exchanges for e in events]
        self.ready = f"{prefix}.ready"
        self.parking = f"{prefix}.parking"
        self.tiers = [
            DelayQueue(f"{prefix}.retry.{n}.{_label(delay)}", delay)
            for n, delay in enumerate(settings.retry_delays_seconds, start=1)
        ]
        self.busy = DelayQueue(
            f"{prefix}.lock-busy.{_label(settings.lock_busy_delay_seconds)}", settings.lock_busy_delay_seconds
        )

    @property
    def source_queues(self) -> list[str]:
        """Queues carrying Evolution's messages, each once."""
        return list(dict.fromkeys(binding.queue for binding in self.sources))

    @property
    def consumed_queues(self) -> list[str]:
        return [*self.source_queues, self.ready]

    @property
    def service_queues(self) -> list[str]:
        return [self.ready, self.parking, self.busy.queue, *(tier.queue for tier in self.tiers)]

    def delay_arguments(self, delay: DelayQueue) -> dict[str, Any]:
        return {
            **EVOLUTION_QUEUE_ARGUMENTS,
            "x-message-ttl": max(1, round(delay.delay_seconds * 1000)),
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.ready,
            # Dead-letter only once the ready queue has the message.
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }


async def declare(channel: AbstractChannel, topology: Topology) -> None:
    """Declare everything (idempotent): Evolution's side exactly as Evolution does, then ours."""
    for name in topology.exchanges:
        await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True, auto_delete=False)
    for queue_name in topology.source_queues:
        await channel.declare_queue(
            queue_name, durable=True, auto_delete=False, arguments=EVOLUTION_QUEUE_ARGUMENTS
        )
    for binding in topology.sources:
        queue = await channel.get_queue(binding.queue, ensure=False)
        await queue.bind(binding.exchange, routing_key=binding.routing_key)
    for plain in (topology.ready, topology.parking):
        await channel.declare_queue(
            plain, durable=True, auto_delete=False, arguments=EVOLUTION_QUEUE_ARGUMENTS
        )
    for delay in (*topology.tiers, topology.busy):
        await channel.declare_queue(
            delay.queue, durable=True, auto_delete=False, arguments=topology.delay_arguments(delay)
        )
