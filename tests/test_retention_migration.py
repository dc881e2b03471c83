"""The move of a populated inbox to partitioned bodies (migration 0006), as docs/retention.md gives
it: no table rewritten, every body still readable, pending events still run once, keys still
decide duplicates, and the bodies saved before it leave by the body retention."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest

from evolution_ingest.config import Settings
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.core.redaction import REDACTED
from evolution_ingest.operate.retention_job import RetentionJob
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores import migrations, run_migrations
from evolution_ingest.stores.inbox import VIEW
from evolution_ingest.stores.postgres import init_connection
from tests.conftest import DATABASE_URL, remove_redis_keys, serving
from tests.support import Recorder, fixtures
from tests.test_reconciler import reconciler_for

OLD_ROWS = 20_000


@pytest.fixture
async def old_layout(
    make_settings: Callable[..., Settings], uid: str
) -> AsyncIterator[tuple[Settings, asyncpg.Connection]]:
    """A schema at migration 0005 (the layout before partitioned bodies); the schema and the
    test's Redis keys are removed after the test."""
    settings = make_settings(retention_bodies_seconds=86_400.0)
    conn = await asyncpg.connect(DATABASE_URL)
    await migrations.migrate(conn, settings.database_schema, upto=5)
    await conn.execute(f'SET search_path TO "{settings.database_schema}"')
    await init_connection(conn)
    try:
        yield settings, conn
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.database_schema}" CASCADE')
        await conn.close()
        await remove_redis_keys(uid)


async def test_a_populated_inbox_moves_without_a_rewrite_and_loses_nothing(
    old_layout: tuple[Settings, asyncpg.Connection], recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    settings, db = old_layout
    items = fixtures()[:4]
    done, pending = items[0], items[1:]
    # 20,000 processed rows two days old, one real processed event, three real pending ones.
    await db.execute(
        "INSERT INTO evolution_ingestion_events (dedup_key, event, instance, channel, payload, received_at, processed_at) "
        "SELECT encode(sha256(n::text::bytea), 'hex'), 'messages.upsert', 'acme', 'WEBHOOK', "
        "jsonb_build_object('event', 'messages.upsert', 'n', n, 'text', repeat('x', 600)), "
        "now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, $1) AS n",
        OLD_ROWS,
    )
    for item, processed in [(done, True), *((p, False) for p in pending)]:
        body = {**item["webhook_body"], "apikey": REDACTED}  # as the service stores it
        await db.execute(
            "INSERT INTO evolution_ingestion_events (dedup_key, event, instance, channel, payload, received_at, processed_at) "
            "VALUES ($1, $2, $3, 'WEBHOOK', $4::jsonb, now() - interval '10 minutes', "
            "CASE WHEN $5 THEN now() - interval '10 minutes' END)",
            parse_envelope(body).dedup_key, body["event"], body["instance"], body, processed,
        )  # fmt: skip
    before_file = await db.fetchval(
        "SELECT relfilenode FROM pg_class WHERE oid = 'evolution_ingestion_events'::regclass"
    )
    before = {
        r["dedup_key"]: r["payload"]
        for r in await db.fetch("SELECT dedup_key, payload FROM evolution_ingestion_events")
    }

    started = time.perf_counter()
    applied = await run_migrations(settings)
    elapsed = time.perf_counter() - started
    print(f"\nmigration 0006 on {len(before):,} rows: {elapsed * 1000:.0f} ms")

    assert [m.version for m in applied] == [6, 7]
    assert (
        await db.fetchval("SELECT relfilenode FROM pg_class WHERE oid = 'evolution_ingest_inbox'::regclass")
        == before_file
    )
    after = {r["dedup_key"]: r["payload"] for r in await db.fetch(f"SELECT dedup_key, payload FROM {VIEW}")}
    assert after == before  # every body, through the view of the stable interface

    async with (
        Runtime.open(settings, pipeline=HandlerPipeline([recorder])) as runtime,
        serving(runtime) as url,
    ):
        async with reconciler_for(runtime, url) as (reconciler, _):
            await reconciler.run_once()  # the three pending events run, from their old-layout bodies
        assert sorted(recorder.calls) == sorted(parse_envelope(p["webhook_body"]).dedup_key for p in pending)
        assert [e.payload for e in sorted(recorder.events, key=lambda e: e.dedup_key)] == [
            before[e.dedup_key] for e in sorted(recorder.events, key=lambda e: e.dedup_key)
        ]
        answers: list[Any] = []
        for body in (done["webhook_body"], fixtures()[6]["webhook_body"]):
            async with http.post(url, data=orjson.dumps(body)) as resp:
                answers.append(await resp.json())
        assert answers[0]["reason"] == "duplicate"  # an old row's key still decides
        assert answers[1]["status"] == "processed"
        new_key = parse_envelope(fixtures()[6]["webhook_body"]).dedup_key
        assert await db.fetchval(
            "SELECT payload IS NULL FROM evolution_ingest_inbox WHERE dedup_key = $1", new_key
        )
        assert (
            await db.fetchval("SELECT count(*) FROM evolution_ingest_bodies") == 1
        )  # new bodies: partitioned

        # Bodies saved before the move leave by the body retention (a day here), rows and keys stay.
        report = await RetentionJob(runtime.stores.retention, runtime.counters, settings).tick()
    assert report["bodies_emptied"] == OLD_ROWS
    assert report["rows_deleted"] == 0
    assert await db.fetchval("SELECT count(*) FROM evolution_ingest_inbox") == len(before) + 1
    assert await db.fetchval(f"SELECT count(*) FROM {VIEW} WHERE payload IS NOT NULL") == 5
