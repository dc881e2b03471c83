"""Declaring the RabbitMQ topology (idempotent): Evolution's side exactly as Evolution does, then ours.

The names and arguments are in :mod:`evolution_ingest.stores.queues`.
"""

from __future__ import annotations

import aio_pika
from aio_pika.abc import AbstractChannel

from evolution_ingest.stores.queues import EVOLUTION_QUEUE_ARGUMENTS, Topology


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
