"""Batched acknowledgements (channels/acks.py) on the worker's consumer, against the real RabbitMQ."""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
from aio_pika.abc import AbstractChannel

from evolution_ingest.channels.acks import Acks
from evolution_ingest.channels.consumer import Consumer
from evolution_ingest.channels.delivery import Delivery
from tests.conftest import RABBITMQ_URL
from tests.support import eventually, wait_until
from tests.support.evolution import broker, depth


class _Counts:
    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def incr(self, name: str, amount: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + amount


async def _has_messages(channel: AbstractChannel, queue: str) -> bool:
    return await depth(channel, queue) > 0


async def _consume(count: int, prefetch: int, slow: set[int]) -> tuple[Acks, list[int], int]:
    """Publish ``count`` messages, consume them with ``Acks``; the bodies in ``slow`` finish only
    once all the others have (they never do if the slow ones hold back the prefetch window).

    Returns the acks, the order the bodies finished in, and the queue's ready depth after the
    consumer's connection closed (unacknowledged messages go back to it).
    """
    queue_name = f"test-acks-{uuid.uuid4().hex[:8]}"
    finished: list[int] = []
    others_done = asyncio.Event()
    async with broker(RABBITMQ_URL) as (_, setup):
        await setup.declare_queue(queue_name, durable=False, auto_delete=False)
        for n in range(count):
            await setup.default_exchange.publish(
                aio_pika.Message(body=str(n).encode()), routing_key=queue_name
            )
        try:
            consumer = await Consumer.open(RABBITMQ_URL, prefetch=prefetch, name="test-acks")
            assert consumer.channel is not None
            acks = Acks(consumer.channel, _Counts(), hold=0.2)  # type: ignore[arg-type]
            tasks: set[asyncio.Task[None]] = set()

            async def handle(message: Delivery) -> None:
                n = int(message.body)
                if n in slow:
                    await asyncio.wait_for(others_done.wait(), 20)
                finished.append(n)
                if len(finished) == count - len(slow):
                    others_done.set()
                assert acks.owns(message)
                assert message.delivery_tag is not None
                acks.settled(message.delivery_tag)

            def delivered(message: Delivery) -> None:
                task = asyncio.create_task(handle(message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            await consumer.consume(queue_name, delivered)
            await wait_until(lambda: len(finished) == count, within=30, message="every message handled")
            await acks.flush()
            assert consumer.channel.is_open, "an acknowledgement closed the channel"
            await consumer.close()
            # Unacknowledged messages go back to the queue as the channel closes: give them time.
            await eventually(lambda: _has_messages(setup, queue_name), within=0.5)
            left = await depth(setup, queue_name)
        finally:
            await setup.queue_delete(queue_name)
    return acks, finished, left


async def test_acks_go_in_batches_and_none_is_lost() -> None:
    acks, finished, left = await _consume(400, prefetch=64, slow=set())
    assert sorted(finished) == list(range(400))
    assert acks.acked == 400
    assert left == 0, "messages came back to the queue: their acks never reached the broker"
    assert acks.frames < 400 / 2, f"{acks.frames} ack frames for 400 messages: not batched"


async def test_a_slow_message_holds_back_neither_the_others_acks_nor_the_prefetch_window() -> None:
    # Prefetch 8: if the slow message (body 3) held back the acks above it, the broker would
    # stop delivering after 8 messages and the other 59 could not finish before it.
    acks, finished, left = await _consume(60, prefetch=8, slow={3})
    assert finished[-1] == 3, "the others waited for the slow message"
    assert sorted(finished) == list(range(60))
    assert acks.acked == 60
    assert left == 0
