"""Send one Evolution event to a running container on both channels, as Evolution does, and wait
until it is processed and seen on both; print its dedup key. Used by scripts/container-check.sh."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

import aio_pika
import aiohttp
import asyncpg
import orjson

from evolution_ingest.core.identity import parse_envelope

WITHIN = 90.0


async def ready(http: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + WITHIN
    while True:
        try:
            async with http.get(f"{base}/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready within {WITHIN:g} s")
        await asyncio.sleep(0.5)


def event() -> tuple[dict[str, object], dict[str, object]]:
    data = {
        "key": {"remoteJid": "5511999990001@s.whatsapp.net", "fromMe": False, "id": uuid.uuid4().hex.upper()},
        "pushName": "Container Check",
        "message": {"conversation": "container check"},
        "messageType": "conversation",
        "messageTimestamp": int(time.time()),
    }
    rabbit = {"event": "messages.upsert", "instance": "container-check", "data": data,
              "server_url": "http://evolution.example.test", "date_time": "2026-01-01T00:00:00.000Z",
              "sender": "5511999990000@s.whatsapp.net", "apikey": None}  # fmt: skip
    return {**rabbit, "destination": "http://evolution.example.test/hook"}, rabbit


async def main(args: argparse.Namespace) -> str:
    base = f"http://127.0.0.1:{args.port}"
    webhook, rabbit = event()
    key = parse_envelope(webhook).dedup_key
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        await ready(http, base)
        connection = await aio_pika.connect(args.rabbitmq_url, timeout=10)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(
                "evolution_exchange", aio_pika.ExchangeType.TOPIC, durable=True
            )
            queue = await channel.declare_queue(
                "evolution.messages.upsert", durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(exchange, routing_key="messages.upsert")
            await exchange.publish(aio_pika.Message(body=orjson.dumps(rabbit)), routing_key="messages.upsert")
        async with http.post(
            f"{base}/api/internal/webhook/t/{args.token}", data=orjson.dumps(webhook)
        ) as resp:
            if resp.status != 200:
                raise SystemExit(f"the webhook answered {resp.status}: {await resp.text()}")
    conn = await asyncpg.connect(args.database_url)
    try:
        deadline = time.monotonic() + WITHIN
        while True:
            row = await conn.fetchrow(
                "SELECT processed_at, webhook_seen_at, rabbitmq_seen_at FROM evolution_ingestion_events WHERE dedup_key = $1",
                key,
            )
            if row is not None and all(row.values()):
                return key
            if time.monotonic() > deadline:
                raise SystemExit(f"not processed and seen on both channels within {WITHIN:g} s: {row}")
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    for option in ("--port", "--token", "--database-url", "--rabbitmq-url"):
        parser.add_argument(option, required=True)
    sys.stdout.write(asyncio.run(main(parser.parse_args())) + "\n")
