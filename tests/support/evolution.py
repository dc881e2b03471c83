"""Evolution API as seen from RabbitMQ: publish exactly as it does, and look at queues."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import aiohttp
import orjson
from aio_pika.abc import AbstractChannel, AbstractConnection

from evolution_ingest.stores.queues import Topology, evolution_queue
from tests.support import wait_until

QUORUM = {"x-queue-type": "quorum"}


class EvolutionPublisher:
    """Mimics Evolution's RabbitmqController.emit: assert exchange, assert queue, bind, publish.

    No message properties, no publisher confirms on Evolution's side; this test double
    waits for confirms only so that a test knows the broker has the message.
    """

    def __init__(self, channel: AbstractChannel, exchange: str, prefix: str) -> None:
        self._channel = channel
        self._exchange = exchange
        self._prefix = prefix

    async def publish_global(self, body: dict[str, Any] | bytes, event: str) -> None:
        exchange = await self._channel.declare_exchange(
            self._exchange, aio_pika.ExchangeType.TOPIC, durable=True, auto_delete=False
        )
        queue = await self._channel.declare_queue(
            evolution_queue(self._prefix, event), durable=True, auto_delete=False, arguments=QUORUM
        )
        await queue.bind(exchange, routing_key=event)
        await exchange.publish(_message(body), routing_key=event)

    async def publish_instance(self, body: dict[str, Any] | bytes, event: str, instance: str) -> None:
        exchange = await self._channel.declare_exchange(
            instance, aio_pika.ExchangeType.TOPIC, durable=True, auto_delete=False
        )
        queue = await self._channel.declare_queue(
            f"{instance}.{event}", durable=True, auto_delete=False, arguments=QUORUM
        )
        await queue.bind(exchange, routing_key=event)
        await exchange.publish(_message(body), routing_key=event)


def _message(body: dict[str, Any] | bytes) -> aio_pika.Message:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return aio_pika.Message(body=raw)


@asynccontextmanager
async def broker(url: str) -> AsyncIterator[tuple[AbstractConnection, AbstractChannel]]:
    connection = await aio_pika.connect(url, timeout=10)
    try:
        yield connection, await connection.channel(publisher_confirms=True)
    finally:
        with contextlib.suppress(Exception):
            await connection.close()


async def depth(channel: AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    count = declared.declaration_result.message_count
    return int(count or 0)


async def consumers(channel: AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.consumer_count or 0)


async def consumer_count(url: str, queue: str) -> int:
    """Consumers on ``queue``; 0 when it does not exist yet."""
    try:
        async with broker(url) as (_, channel):
            return await consumers(channel, queue)
    except aio_pika.exceptions.AMQPException:
        return 0


async def take_all(channel: AbstractChannel, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message of ``queue`` (acknowledged, so it leaves the queue)."""
    declared = await channel.get_queue(queue, ensure=False)
    taken = []
    while (message := await declared.get(fail=False, no_ack=False)) is not None:
        await message.ack()
        taken.append(message)
    return taken


async def remove(url: str, topology: Topology, extra_queues: list[str] | None = None) -> None:
    """Delete a test's queues and exchanges."""
    await delete(
        url, [*topology.consumed_queues, *topology.service_queues, *(extra_queues or [])], topology.exchanges
    )


async def delete(url: str, queues: Sequence[str], exchanges: Sequence[str] = ()) -> None:
    """Delete queues and exchanges, each on its own channel (a miss closes it)."""
    connection = await aio_pika.connect(url, timeout=10)
    try:
        for kind, names in (("queue", queues), ("exchange", exchanges)):
            for name in names:
                with contextlib.suppress(Exception):
                    channel = await connection.channel()
                    await (channel.queue_delete(name) if kind == "queue" else channel.exchange_delete(name))
                    await channel.close()
    finally:
        await connection.close()


async def send_both(
    http: aiohttp.ClientSession, webhook_url: str, publisher: EvolutionPublisher, items: list[dict[str, Any]]
) -> None:
    """Each fixture by webhook, then by RabbitMQ (global), as Evolution sends one event on both."""
    for item in items:
        async with http.post(webhook_url, data=orjson.dumps(item["webhook_body"])):
            pass
        await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])


# Names that only this suite gives: a test's 12-hex-digit id after a fixed prefix.
STALE = re.compile(r"^(ei|p)-?[0-9a-f]{12}\.")


async def sweep_stale_queues(url: str) -> int:
    """Delete idle queues left by an interrupted earlier run (hundreds slow a broker restart).

    Needs ``rabbitmqctl`` (AMQP cannot list queues); without it, nothing is swept.
    """
    if shutil.which("rabbitmqctl") is None:
        return 0
    try:
        lister = await asyncio.create_subprocess_exec(
            "rabbitmqctl", "-q", "list_queues", "name", "consumers",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(lister.communicate(), 60)
    except (OSError, TimeoutError):
        return 0
    listing = output.decode()
    stale = [
        name
        for name, consumers in (line.rsplit("\t", 1) for line in listing.splitlines() if "\t" in line)
        if STALE.match(name) and consumers.strip() == "0"
    ]
    if stale:
        connection = await aio_pika.connect(url, timeout=10)
        try:
            channel = await connection.channel()
            for name in stale:
                await channel.queue_delete(name)
        finally:
            await connection.close()
    return len(stale)


async def restart_rabbitmq(url: str) -> None:
    """Restart the broker application (the node keeps running) and wait until it answers."""
    for command in (["rabbitmqctl", "stop_app"], ["rabbitmqctl", "start_app"]):
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        assert await asyncio.wait_for(proc.wait(), 120) == 0

    async def answers() -> bool:
        try:
            async with broker(url):
                return True
        except Exception:
            return False

    await wait_until(answers, within=60, message="RabbitMQ to answer again")
