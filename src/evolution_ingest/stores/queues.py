"""RabbitMQ as a store: the queues of Evolution and of this service, by name, and what they hold.

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

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import aio_pika
import aiormq
import pika.exceptions
from aio_pika.abc import AbstractConnection

from evolution_ingest.config import RabbitMode, Settings

#: Errors meaning "the broker connection or channel is gone".
BROKER_ERRORS: Final = (
    OSError,
    TimeoutError,
    aiormq.exceptions.AMQPError,
    aio_pika.exceptions.AMQPException,
    aio_pika.exceptions.ChannelInvalidStateError,
    pika.exceptions.AMQPError,  # the worker's consumer (channels/consumer.py)
)

# Headers the service puts on the messages it republishes (attempts are counted here, not in x-death).
HEADER_ATTEMPTS: Final = "x-evolution-ingest-attempts"
HEADER_BUSY: Final = "x-evolution-ingest-lock-busy"
HEADER_ERROR: Final = "x-evolution-ingest-error"
HEADER_ORIGIN: Final = "x-evolution-ingest-origin"
HEADER_ROUTING_KEY: Final = "x-evolution-ingest-routing-key"
HEADER_PARKED_REASON: Final = "x-evolution-ingest-parked-reason"
HEADER_PARKED_AT: Final = "x-evolution-ingest-parked-at"
HEADER_REPLAYED_AT: Final = "x-evolution-ingest-replayed-at"

#: How long closing a connection may take before it is left to the operating system.
_CLOSE_SECONDS: Final = 5.0

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


@asynccontextmanager
async def broker(settings: Settings) -> AsyncIterator[AbstractConnection]:
    """A connection of its own (an operator command's), closed on exit."""
    connection = await aio_pika.connect(settings.rabbitmq_url, timeout=10)
    try:
        yield connection
    finally:
        await _close(connection)


async def queue_states(connection: AbstractConnection, names: list[str]) -> dict[str, dict[str, Any]]:
    """Depth and consumers of each queue (``exists: False`` when it is not declared)."""
    states: dict[str, dict[str, Any]] = {}
    channel = await connection.channel(publisher_confirms=False)
    for name in names:
        try:
            declared = await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelClosed:  # NOT_FOUND closes the channel
            states[name] = {"exists": False}
            channel = await connection.channel(publisher_confirms=False)
            continue
        result = declared.declaration_result
        states[name] = {"exists": True, "messages": result.message_count, "consumers": result.consumer_count}
    with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
        await channel.close()
    return states


class QueueReads:
    """What a process reads of RabbitMQ for its operator (is it there, how deep is each queue),
    over one connection of its own: opened on the first read, opened again after it broke or did
    not answer in time, closed with the stores. A readiness probe then costs RabbitMQ a channel,
    not a connection (which it logs three lines for). A read that takes longer than ``within``
    seconds raises ``TimeoutError``."""

    def __init__(self, settings: Settings, within: float = 10.0) -> None:
        self._settings = settings
        self._within = within
        self._connection: AbstractConnection | None = None
        self._opening = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    async def ping(self) -> None:
        """Return once RabbitMQ has opened (and closed) a channel; raise a broker error otherwise."""
        async with self._connected() as connection:
            channel = await connection.channel(publisher_confirms=False)
            await channel.close()

    async def status(self) -> dict[str, Any]:
        """Every queue of the topology with its depth and consumers; raises a broker error when unreachable."""
        topology = Topology(self._settings)
        async with self._connected() as connection:
            sources = await queue_states(connection, topology.source_queues)
            service = await queue_states(connection, topology.service_queues)
        return {
            "mode": topology.mode.value,
            "retry_tiers": {tier.queue: service[tier.queue] for tier in topology.tiers},
            "lock_busy": service[topology.busy.queue],
            "ready": service[topology.ready],
            "parking": service[topology.parking],
            "evolution_queues": sources,
        }

    async def close(self) -> None:
        if self._connection is not None:
            self._drop(self._connection)
        await asyncio.gather(*self._closing)

    @asynccontextmanager
    async def _connected(self) -> AsyncIterator[AbstractConnection]:
        """The connection, for one read that connecting included takes at most ``within`` seconds."""
        connection: AbstractConnection | None = None
        try:
            async with asyncio.timeout(self._within):
                async with self._opening:
                    if self._connection is None or self._connection.is_closed:
                        self._connection = await aio_pika.connect(self._settings.rabbitmq_url)
                    connection = self._connection
                yield connection
        except BaseException as exc:  # an error or a read given up on: the next read starts afresh
            if connection is not None:
                self._drop(connection)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"RabbitMQ did not answer within {self._within:g} s") from None
            raise

    def _drop(self, connection: AbstractConnection) -> None:
        """Forget ``connection`` and close it in the background: a broker that stopped answering
        must not hold up the read that gave up on it."""
        if self._connection is connection:
            self._connection = None
        task = asyncio.create_task(_close(connection))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def _close(connection: AbstractConnection) -> None:
    with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
        await asyncio.wait_for(connection.close(), _CLOSE_SECONDS)
