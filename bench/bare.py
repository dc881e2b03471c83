"""The ceilings of the transport: an endpoint that only parses the JSON body, on the same stack,
and (with ``--amqp``) a consumer of Evolution's queues that parses each message and acks it.

    python -m bench.bare PORT [--amqp URL --prefix PREFIX --events a,b,...]

Nothing is stored. ``GET /consumed`` says how many RabbitMQ messages were acked so far.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import aio_pika
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

#: The service's default prefetch per queue (RABBITMQ_PREFETCH), for a like-for-like consumer.
PREFETCH = 32
consumed = 0


async def parse_only(request: Request) -> Response:
    body = orjson.loads(await request.body())
    return Response(orjson.dumps({"status": "ok", "keys": len(body)}), media_type="application/json")


async def healthz(_: Request) -> Response:
    return Response(b"{}", media_type="application/json")


async def consumed_count(_: Request) -> Response:
    return Response(orjson.dumps({"consumed": consumed}), media_type="application/json")


app = Starlette(
    routes=[
        Route("/bare", parse_only, methods=["POST"]),
        Route("/healthz", healthz),
        Route("/consumed", consumed_count),
    ]
)


async def consume(url: str, prefix: str, events: list[str], ready: asyncio.Event) -> None:
    """Consume every existing ``<prefix>.<event>`` queue: parse, ack; until cancelled."""

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        global consumed  # noqa: PLW0603 - the one figure this process reports
        orjson.loads(message.body)
        await message.ack()
        consumed += 1

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        for event in events:
            probe = await connection.channel()  # a missing queue closes the channel that asked
            try:
                await probe.declare_queue(f"{prefix}.{event}", passive=True)
            except aio_pika.exceptions.ChannelClosed:  # no such queue: nothing is published there
                continue
            await probe.close()
            queue = await channel.declare_queue(f"{prefix}.{event}", passive=True)
            await queue.consume(on_message)
        ready.set()
        await asyncio.Future()  # until cancelled


async def main(args: argparse.Namespace) -> None:
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=args.port,
            http="httptools",
            loop="none",
            access_log=False,
            log_level="warning",
        )
    )
    consumer = None
    if args.amqp:
        ready = asyncio.Event()
        consumer = asyncio.create_task(consume(args.amqp, args.prefix, args.events.split(","), ready))
        await ready.wait()  # healthz answers once every queue is consumed
    try:
        await server.serve()
    finally:
        if consumer is not None:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer


if __name__ == "__main__":
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--amqp")
    parser.add_argument("--prefix")
    parser.add_argument("--events", default="")
    uvloop.run(main(parser.parse_args()))
