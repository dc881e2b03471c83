"""Both channels: RabbitMQ only (a backlog drained through the worker), and every event on both.

    .venv/bin/python -m bench.channels [--events 10000] [--layout up|split]

``up`` runs the webhook app and the worker in one process (`evolution-ingest up`);
``split`` runs `serve` and `worker` as two processes. Events are the fixtures with unique ids,
published as Evolution publishes them and POSTed as Evolution posts them. A counting handler
records every business-logic run, so the table shows events lost and processed twice.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aio_pika
import orjson

from bench.events import unique_event
from bench.harness import (
    RABBITMQ_URL,
    Isolation,
    cli,
    free_port,
    peak_rss_mb,
    post_all,
    process,
    table,
    wait_http,
)

EVENTS_HEADER = [
    "scenario",
    "events",
    "events/s",
    "webhook p50 ms",
    "webhook p99 ms",
    "lost",
    "doubled",
    "peak RSS MiB",
]


async def publish(url: str, exchange_name: str, prefix: str, messages: Sequence[tuple[bytes, str]]) -> None:
    """Publish like Evolution (topic exchange, its quorum queues), confirms pipelined 256 at a time."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.TOPIC, durable=True)
        for event in {key for _, key in messages}:
            queue = await channel.declare_queue(
                f"{prefix}.{event}", durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(exchange, routing_key=event)
        for start in range(0, len(messages), 256):
            await asyncio.gather(
                *(
                    exchange.publish(aio_pika.Message(body=b), routing_key=k)
                    for b, k in messages[start : start + 256]
                )
            )


@asynccontextmanager
async def service(iso: Isolation, layout: str, port: int) -> AsyncIterator[list[int]]:
    env = iso.env(
        PORT=str(port),
        HANDLERS="bench.handlers:trace",
        RABBITMQ_EXCHANGE=f"bench-{iso.run_id}",
        RABBITMQ_PREFIX=f"bench{iso.run_id}",
        RABBITMQ_SERVICE_PREFIX=f"bench-{iso.run_id}",
    )
    env["BENCH_TRACE_DIR"] = str(iso.trace_dir)
    env["PYTHONPATH"] = "."
    async with AsyncExitStack() as stack:
        if layout == "up":
            procs = [await stack.enter_async_context(process(cli("up"), env, "up"))]
        else:
            migrate = await asyncio.create_subprocess_exec(*cli("migrate"), env=env)
            await migrate.wait()
            procs = [
                await stack.enter_async_context(process(cli("serve"), env, "serve")),
                await stack.enter_async_context(process(cli("worker"), env, "worker")),
            ]
        await wait_http(f"http://127.0.0.1:{port}/healthz")
        await asyncio.sleep(1.0)  # the worker declares and starts consuming
        yield [p.pid for p in procs]


def calls(iso: Isolation) -> dict[str, int]:
    counted: dict[str, int] = {}
    for path in iso.trace_dir.glob("trace-*.txt"):
        for line in path.read_text(encoding="ascii").splitlines():
            key = line.split(" ", 1)[0]
            counted[key] = counted.get(key, 0) + 1
    return counted


async def wait_processed(iso: Isolation, expected: int, max_seconds: float) -> float:
    started = time.perf_counter()
    deadline = time.monotonic() + max_seconds
    while iso.traced() < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def scenario(
    name: str, layout: str, events: int, offset: int, *, dual: bool, max_seconds: float
) -> list[Any]:
    iso = Isolation()
    port = free_port()
    items = [unique_event(offset + n) for n in range(events)]
    messages = [(orjson.dumps(rabbit), key) for _, rabbit, key in items]
    bodies = [orjson.dumps(webhook) for webhook, _, _ in items]
    try:
        if not dual:  # a backlog waiting when the worker starts
            await publish(RABBITMQ_URL, f"bench-{iso.run_id}", f"bench{iso.run_id}", messages)
        async with service(iso, layout, port) as pids:
            started = time.perf_counter()
            webhook = None
            if dual:
                url = f"http://127.0.0.1:{port}/api/internal/webhook"
                webhook, _ = await asyncio.gather(
                    post_all(url, bodies, 64, max_seconds),
                    publish(RABBITMQ_URL, f"bench-{iso.run_id}", f"bench{iso.run_id}", messages),
                )
            await wait_processed(iso, events, max_seconds)
            elapsed = time.perf_counter() - started
            await asyncio.sleep(2.0)  # late doubles would show up here
            counted = calls(iso)
            rss = sum(peak_rss_mb(pid) for pid in pids)
        lost = events - len(counted)
        doubled = sum(1 for v in counted.values() if v > 1)
        return [
            f"{name} ({layout})",
            events,
            len(counted) / elapsed,
            webhook.percentile(50) if webhook else "-",
            webhook.percentile(99) if webhook else "-",
            lost,
            doubled,
            rss,
        ]
    finally:
        await iso.cleanup()
        await _delete_queues(iso)


async def _delete_queues(iso: Isolation) -> None:
    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        for queue in await _queues_named(iso):
            channel = await connection.channel()
            await channel.queue_delete(queue)
        channel = await connection.channel()
        await channel.exchange_delete(f"bench-{iso.run_id}")


async def _queues_named(iso: Isolation) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        "list_queues",
        "name",
        "-q",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    return [q for q in out.decode().split() if iso.run_id in q]


async def main(events: int, layouts: list[str], max_seconds: float) -> None:
    rows = []
    for offset, layout in enumerate(layouts):
        rows.append(
            await scenario(
                "RabbitMQ only, backlog",
                layout,
                events,
                offset * 10 * events,
                dual=False,
                max_seconds=max_seconds,
            )
        )
        rows.append(
            await scenario(
                "both channels",
                layout,
                events,
                (offset * 10 + 5) * events,
                dual=True,
                max_seconds=max_seconds,
            )
        )
    print(table(rows, EVENTS_HEADER))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--layout", choices=["up", "split", "both"], default="both")
    parser.add_argument("--max-seconds", type=float, default=180)
    args = parser.parse_args()
    layouts = ["up", "split"] if args.layout == "both" else [args.layout]
    asyncio.run(main(args.events, layouts, args.max_seconds))
