"""The hot path's statements stay cheap as the inbox grows, even where nothing analyzes it.

A statement prepared while the inbox is nearly empty, and run a few times there, may otherwise
keep a generic plan that scans the whole table (the cheapest on one page) until an ANALYZE
replaces it: without autovacuum the cost of every mark, claim and seen update would then grow
with the inbox. Each test's schema is new and never analyzed, as a fresh deployment's is.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.stores.inbox import Claim, PostgresInbox
from tests.conftest import OpenRuntime
from tests.support import variants

# Enough rows that an index beats a scan by far; few enough to insert in a moment.
GROWN_TO = 20_000


async def _scans_and_updates(db: asyncpg.Connection) -> tuple[int, int]:
    await db.execute("SELECT pg_stat_clear_snapshot()")
    row = await db.fetchrow(
        "SELECT seq_scan, n_tup_upd FROM pg_stat_user_tables"
        " WHERE relname = 'evolution_ingest_inbox' AND schemaname = current_schema()"
    )
    assert row is not None
    return row["seq_scan"], row["n_tup_upd"]


async def _go_through(inbox: PostgresInbox, item: dict[str, object]) -> None:
    """One event the way the hot path takes it: saved, claimed, marked, then seen on RabbitMQ."""
    envelope = parse_envelope(item["webhook_body"])
    row = await inbox.save(envelope, Channel.WEBHOOK, None)
    claimed = await inbox.claim_saved(envelope.dedup_key, Claim.new(60.0))
    assert claimed is not None
    assert claimed.claimed
    assert await inbox.mark_processed(row.id)
    await inbox.record_seen(envelope.dedup_key, Channel.RABBITMQ)


async def test_marks_claims_and_seen_updates_never_scan_the_inbox_once_it_has_grown(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    early, late = variants(12), variants(6, start=12)
    async with open_runtime() as runtime:
        for item in early:  # more than five runs of each statement, on an inbox of a few rows
            await _go_through(runtime.inbox, item)
        await db.execute(
            "INSERT INTO evolution_ingest_inbox (dedup_key, event, instance, channel, processed_at)"
            " SELECT encode(sha256(('grown-' || n)::bytea), 'hex'), 'messages.upsert', 'acme-sales',"
            " 'WEBHOOK', now() FROM generate_series(1, $1) AS n",
            GROWN_TO,
        )
        scans_before, updates_before = await _scans_and_updates(db)
        for item in late:
            await _go_through(runtime.inbox, item)
        # The service's connections report their counters when idle, within a second or so:
        # wait until this test's updates are counted, then read the scans reported with them.
        deadline = time.monotonic() + 10
        scans, updates = await _scans_and_updates(db)
        while updates < updates_before + 3 * len(late) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # wait-ok: polling the statistics until they are reported
            scans, updates = await _scans_and_updates(db)
    assert updates >= updates_before + 3 * len(late)
    assert scans == scans_before


#: Rows deleted at once from the oldest end of an analyzed inbox, as a purge does.
DELETED = 60_000


async def _primary_key_blocks_and_updates(db: asyncpg.Connection) -> tuple[int, int]:
    await db.execute("SELECT pg_stat_clear_snapshot()")
    row = await db.fetchrow(
        "SELECT i.idx_blks_hit + i.idx_blks_read AS blocks, t.n_tup_upd"
        " FROM pg_statio_user_indexes AS i JOIN pg_stat_user_tables AS t USING (relid)"
        " WHERE i.indexrelname = 'evolution_ingestion_events_pkey' AND i.schemaname = current_schema()"
    )
    assert row is not None
    return row["blocks"], row["n_tup_upd"]


async def test_marks_and_seen_updates_do_not_step_over_the_entries_of_rows_just_deleted(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    """Until a vacuum, the primary key keeps an entry for each deleted row. Planning a join on
    ``id`` that could be a merge join looks up the key's real lowest and highest values, stepping
    over every dead entry at its low end on each planning: after a purge of 1,000,000 rows that
    made each mark and seen update 2 ms of Postgres's CPU dearer until a vacuum. Joined to a
    materialized set of locked rows, they plan without it."""
    items = variants(8)
    await db.execute(
        "INSERT INTO evolution_ingest_inbox (dedup_key, event, instance, channel, processed_at)"
        " SELECT encode(sha256(('old-' || n)::bytea), 'hex'), 'messages.upsert', 'acme-sales',"
        " 'WEBHOOK', now() FROM generate_series(1, $1) AS n",
        DELETED + 20_000,
    )
    await db.execute("ANALYZE evolution_ingest_inbox")  # as autovacuum would have
    await db.execute(
        "DELETE FROM evolution_ingest_inbox WHERE id IN (SELECT id FROM evolution_ingest_inbox ORDER BY id LIMIT $1)",
        DELETED,
    )
    async with open_runtime() as runtime:
        blocks_before, updates_before = await _primary_key_blocks_and_updates(db)
        for item in items:
            await _go_through(runtime.inbox, item)
        deadline = time.monotonic() + 10
        blocks, updates = await _primary_key_blocks_and_updates(db)
        while updates < updates_before + 3 * len(items) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # wait-ok: polling the statistics until they are reported
            blocks, updates = await _primary_key_blocks_and_updates(db)
    assert updates >= updates_before + 3 * len(items)
    # An event's four statements read about 35 of the key's blocks; planned with the joins that
    # step over the dead entries, about 250.
    per_event = (blocks - blocks_before) / len(items)
    assert per_event < 60, per_event
