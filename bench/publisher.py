"""Publish benchmark events to RabbitMQ as Evolution does, from a process of its own.

    python -m bench.publisher URL EXCHANGE PREFIX START COUNT TIMES_FILE [--rate R]

Evolution publishes to a topic exchange with the event name as routing key, into
quorum queues it declares, without publisher confirms; so does this. Each message's
send time is written to TIMES_FILE (``<index> <unix time>``) for end-to-end latency.
Running apart from the HTTP load generator keeps one from slowing the other. It
prepares every message first, prints ``ready``, and starts when a line arrives on
its standard input, so that only publishing falls in the measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aio_pika
import orjson

from bench.events import unique_event


async def publish(
    url: str, exchange_name: str, prefix: str, start: int, count: int, times: str, rate: float
) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=False)
        exchange = await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.TOPIC, durable=True)
        messages = []
        for i in range(count):  # prepared before the clock starts: only publishing is measured
            _, body, key = unique_event(start + i)
            messages.append((orjson.dumps(body), key))
        for key in {key for _, key in messages}:  # Evolution asserts its queue on every publish; once here
            queue = await channel.declare_queue(
                f"{prefix}.{key}", durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(exchange, routing_key=key)
        print(f"ready {time.process_time():.6f}", flush=True)  # the CPU spent preparing, not to be counted
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        interval = 1 / rate if rate > 0 else 0.0
        began = time.perf_counter()
        with open(times, "w", encoding="ascii") as out:
            for i, (raw, key) in enumerate(messages):
                if interval:
                    delay = began + i * interval - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                out.write(f"{i} {time.time():.6f}\n")
                await exchange.publish(aio_pika.Message(body=raw), routing_key=key)
                if i % 256 == 255:
                    await asyncio.sleep(0)  # let the connection write
        # Without confirms, a round trip proves the broker has read everything before it.
        await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.TOPIC, durable=True, passive=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url")
    parser.add_argument("exchange")
    parser.add_argument("prefix")
    parser.add_argument("start", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("times")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="messages per second (0: as fast as possible)"
    )
    args = parser.parse_args()
    asyncio.run(publish(args.url, args.exchange, args.prefix, args.start, args.count, args.times, args.rate))
