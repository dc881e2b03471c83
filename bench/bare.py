"""The ceilings of the transport: an endpoint that only parses the JSON body, on the same stack,
and (with ``--amqp``) a consumer of Evolution's queues that parses each message and acks it.

    python -m bench.bare PORT [--amqp URL --prefix PREFIX --events a,b,...] [--lean]

Nothing is stored. ``GET /consumed`` says how many RabbitMQ messages were acked so far.

Two receivers:

* the default one is what a bare receiver usually looks like: a Starlette route on uvicorn, and
  aio-pika's queue consumer acking each message;
* ``--lean`` receives the way the service does: a raw ASGI callable on uvicorn, and pika's
  consumer (the worker's own, :mod:`evolution_ingest.channels.consumer`) with one multiple ack
  per turn of the event loop. It is the stricter ceiling: what receiving costs with nothing
  wasted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import aio_pika
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from evolution_ingest.channels.consumer import Consumer
from evolution_ingest.channels.delivery import Delivery

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


async def lean_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The same three routes as a raw ASGI callable (how the service takes its webhook calls)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/bare":
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        answer = orjson.dumps({"status": "ok", "keys": len(orjson.loads(b"".join(chunks)))})
    else:
        answer = orjson.dumps({"consumed": consumed}) if scope["path"] == "/consumed" else b"{}"
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def _queues(connection: aio_pika.abc.AbstractConnection, prefix: str, events: list[str]) -> list[str]:
    """The ``<prefix>.<event>`` queues that exist (nothing is published to the others)."""
    found = []
    for event in events:
        probe = await connection.channel()  # a missing queue closes the channel that asked
        try:
            await probe.declare_queue(f"{prefix}.{event}", passive=True)
        except aio_pika.exceptions.ChannelClosed:
            continue
        await probe.close()
        found.append(f"{prefix}.{event}")
    return found


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
        for name in await _queues(connection, prefix, events):
            queue = await channel.declare_queue(name, passive=True)
            await queue.consume(on_message)
        ready.set()
        await asyncio.Future()  # until cancelled


async def consume_lean(url: str, prefix: str, events: list[str], ready: asyncio.Event) -> None:
    """The same with the worker's pika consumer and one multiple ack per loop turn."""
    loop = asyncio.get_running_loop()
    connection = await aio_pika.connect(url)
    async with connection:
        names = await _queues(connection, prefix, events)
    consumer = await Consumer.open(url, prefetch=PREFETCH, name="bench bare receiver")
    assert consumer.channel is not None
    channel = consumer.channel
    highest: list[int] = []

    def ack() -> None:
        channel.basic_ack(highest.pop(), multiple=True)

    def on_message(message: Delivery) -> None:
        global consumed  # noqa: PLW0603 - the one figure this process reports
        orjson.loads(message.body)
        consumed += 1
        assert message.delivery_tag is not None
        if not highest:  # handled in order, one at a time: the latest tag acks every one before it
            loop.call_soon(ack)
            highest.append(message.delivery_tag)
        else:
            highest[0] = message.delivery_tag

    try:
        for name in names:
            await consumer.consume(name, on_message)
        ready.set()
        await asyncio.Future()  # until cancelled
    finally:
        await consumer.close()


async def main(args: argparse.Namespace) -> None:
    server = uvicorn.Server(
        uvicorn.Config(
            lean_app if args.lean else app,
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
        receive = consume_lean if args.lean else consume
        consumer = asyncio.create_task(receive(args.amqp, args.prefix, args.events.split(","), ready))
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
    parser.add_argument("--lean", action="store_true", help="receive as the service does (see above)")
    uvloop.run(main(parser.parse_args()))
