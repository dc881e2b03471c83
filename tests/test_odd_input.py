"""Odd input on both channels: one bad event never harms another, and every valid one is kept."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import asyncpg
import pytest

from evolution_ingest.core import codec
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.runtime import Runtime
from tests.conftest import RABBITMQ_URL, OpenRuntime, Service, running_service
from tests.support import Recorder, stored_form, variants, wait_until
from tests.support.evolution import EvolutionPublisher, broker, depth
from tests.support.fuzz import node_json

BATCH = 64


async def post(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=raw, headers={"content-type": "application/json"}) as resp:
        return resp.status, codec.loads(await resp.read())


async def counted(runtime: Runtime, *names: str) -> dict[str, int]:
    await runtime.counters.flush()
    return await runtime.counters.read(names)


async def on_both_channels(
    runtime: Runtime, service: Service, http: aiohttp.ClientSession, items: list[dict[str, Any]]
) -> list[tuple[int, dict[str, Any]]]:
    """Every item at once: all webhook calls concurrently, while all RabbitMQ copies are published;
    returns the webhook answers once every RabbitMQ message is settled."""
    settings = runtime.settings
    async with broker(RABBITMQ_URL) as (_, channel):
        publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)

        async def publish() -> None:
            for item in items:
                await publisher.publish_global(node_json(item["rabbitmq_body"]), item["routing_key"])

        *answers, _ = await asyncio.gather(
            *(post(http, service.url, node_json(item["webhook_body"])) for item in items), publish()
        )

        async def settled() -> bool:
            done = await counted(
                runtime, "rabbitmq:forward_ok", "rabbitmq:skipped_duplicate", "rabbitmq:invalid",
                "rabbitmq:busy_gave_up",
            )  # fmt: skip
            return sum(done.values()) >= len(items)

        await wait_until(settled, within=30, message="every RabbitMQ copy settled")
        for queue in service.worker.topology.consumed_queues + service.worker.topology.service_queues:
            assert await depth(channel, queue) == 0, queue
    return list(answers)


@pytest.mark.parametrize("field", ["instance", "event"])
async def test_a_nul_in_one_event_among_63_good_ones_on_both_channels_harms_none_and_is_kept(
    field: str, open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: Any
) -> None:
    items = variants(BATCH)
    odd = items[17]
    for form in ("webhook_body", "rabbitmq_body"):
        odd[form][field] = odd[form][field][:4] + "\u0000" + odd[form][field][4:]
    keys = {parse_envelope(item["webhook_body"]).dedup_key for item in items}
    async with open_runtime() as runtime, running_service(runtime) as service:
        answers = await on_both_channels(runtime, service, http, items)
        sizes = runtime.inbox.batch_sizes()
        totals = await counted(runtime, "rabbitmq:retried", "rabbitmq:parked", "refusals:recorded")
    assert [status for status, _ in answers] == [200] * BATCH  # every one at its first try
    assert sizes["save"] > 1  # saves were batched: the odd row shared statements with good ones
    assert set(recorder.calls) == keys
    assert not recorder.doubled()
    assert totals == {"rabbitmq:retried": 0, "rabbitmq:parked": 0, "refusals:recorded": 0}
    odd_key = parse_envelope(odd["webhook_body"]).dedup_key
    row = await db.fetchrow("SELECT * FROM evolution_ingestion_events WHERE dedup_key = $1", odd_key)
    assert "\ufffd" in row[field]  # the column shows it; the exact text keeps it
    assert row["payload_text"] is not None
    assert codec.from_storage(row["payload"], row["payload_text"]) == stored_form(
        odd[{"WEBHOOK": "webhook_body", "RABBITMQ": "rabbitmq_body"}[row["channel"]]]
    )
    assert row["webhook_seen_at"] is not None
    assert row["rabbitmq_seen_at"] is not None
    assert row["processed_at"] is not None
    (seen,) = [event for event in recorder.events if event.dedup_key == odd_key]
    assert "\u0000" in getattr(seen, field)


async def test_a_row_postgres_rejects_fails_alone_and_is_kept_as_a_refusal_on_both_channels(
    open_runtime: OpenRuntime,
    recorder: Recorder,
    http: aiohttp.ClientSession,
    db: asyncpg.Connection,
) -> None:
    """A constraint this test adds stands for any row Postgres refuses: its batch is split until it
    fails alone, and every other event of the batch is answered as if it had been alone."""
    await db.execute(
        "ALTER TABLE evolution_ingest_inbox ADD CONSTRAINT test_poison CHECK (instance <> 'poison-row')"
    )
    items = variants(BATCH)
    odd = items[40]
    for form in ("webhook_body", "rabbitmq_body"):
        odd[form]["instance"] = "poison-row"
    good = {parse_envelope(item["webhook_body"]).dedup_key for item in items if item is not odd}
    async with open_runtime() as runtime, running_service(runtime) as service:
        answers = await on_both_channels(runtime, service, http, items)
        splits = runtime.inbox._saves.splits
        totals = await counted(runtime, "rabbitmq:retried", "rabbitmq:parked", "rabbitmq:invalid")
    refused = [answer for status, answer in answers if status != 200]
    assert [status for status, _ in answers].count(200) == BATCH - 1
    assert [(a["code"], "check constraint" in a["error"]) for a in refused] == [("unstorable", True)]
    assert splits >= 1
    assert set(recorder.calls) == good
    assert not recorder.doubled()
    assert totals == {"rabbitmq:retried": 0, "rabbitmq:parked": 0, "rabbitmq:invalid": 1}
    kept = await db.fetch("SELECT source, status, code FROM evolution_ingest_refusals ORDER BY source")
    assert [tuple(r) for r in kept] == [("rabbitmq", None, "unstorable"), ("webhook", 422, "unstorable")]
    assert await db.fetchval("SELECT count(*) FROM evolution_ingestion_events") == BATCH - 1


async def test_a_lone_surrogate_is_stored_exactly_and_both_channels_meet(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    """WhatsApp text cut in the middle of an emoji: Node writes the lone half as an escape."""
    (item,) = variants(1)
    for form in ("webhook_body", "rabbitmq_body"):
        item[form]["data"]["message"] = {"conversation": "cut emoji \ud83d", "key\udc00": "😀"}
    raw = node_json(item["webhook_body"])
    assert b"\\ud83d" in raw
    async with open_runtime() as runtime, running_service(runtime) as service:
        answers = await on_both_channels(runtime, service, http, [item])
        await wait_until(lambda: recorder.total == 1, message="the business logic to run")
    # Whichever channel's copy wins runs it; the webhook's answer says processed or skipped.
    assert [(status, answer["status"]) for status, answer in answers] in (
        [(200, "processed")],
        [(200, "skipped")],
    )
    (event,) = recorder.events
    assert event.data["message"]["conversation"] == "cut emoji \ud83d"
    (row,) = await db.fetch("SELECT * FROM evolution_ingestion_events")
    assert row["payload"]["data"]["message"]["conversation"] == "cut emoji \ufffd"
    assert codec.from_storage(row["payload"], row["payload_text"]) == stored_form(item["webhook_body"])
    assert row["webhook_seen_at"] is not None
    assert row["rabbitmq_seen_at"] is not None
