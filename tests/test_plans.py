"""The hot path's statements stay cheap as the inbox grows, even where nothing analyzes it, and
so does the inbox's figure that every ``/metrics`` scrape and ``status`` reads.

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
from evolution_ingest.stores.inbox_reads import _EXACT_UPTO, _STATS
from tests.conftest import OpenRuntime
from tests.support import plan_nodes, variants

# Enough rows that an index beats a scan by far; few enough to insert in a moment.
GROWN_TO = 20_000


async def _inbox_counters(db: asyncpg.Connection) -> asyncpg.Record:
    """The inbox's scans and row updates, and the blocks its primary key has been read for."""
    await db.execute("SELECT pg_stat_clear_snapshot()")
    row = await db.fetchrow(
        "SELECT t.seq_scan, t.n_tup_upd, i.idx_blks_hit + i.idx_blks_read AS key_blocks"
        " FROM pg_stat_user_tables AS t JOIN pg_statio_user_indexes AS i USING (relid)"
        " WHERE t.relname = 'evolution_ingest_inbox' AND t.schemaname = current_schema()"
        " AND i.indexrelname = 'evolution_ingestion_events_pkey'"
    )
    assert row is not None
    return row


async def _go_through(inbox: PostgresInbox, item: dict[str, object]) -> None:
    """One event the way the hot path takes it: saved, claimed, marked, then seen on RabbitMQ."""
    envelope = parse_envelope(item["webhook_body"])
    row = await inbox.save(envelope, Channel.WEBHOOK, None)
    claimed = await inbox.claim_saved(envelope.dedup_key, Claim.new(60.0))
    assert claimed is not None
    assert claimed.claimed
    assert await inbox.mark_processed(row.id)
    await inbox.record_seen(envelope.dedup_key, Channel.RABBITMQ)


async def _add_processed_rows(db: asyncpg.Connection, prefix: str, count: int) -> None:
    await db.execute(
        "INSERT INTO evolution_ingest_inbox (dedup_key, event, instance, channel, processed_at)"
        " SELECT encode(sha256(($1 || n)::bytea), 'hex'), 'messages.upsert', 'acme-sales',"
        " 'WEBHOOK', now() FROM generate_series(1, $2) AS n",
        prefix,
        count,
    )


async def _counted(
    db: asyncpg.Connection, inbox: PostgresInbox, items: list[dict[str, object]], counter: str
) -> tuple[int, int]:
    """``counter`` of :func:`_inbox_counters` before and after ``items`` go through the hot path."""
    before = await _inbox_counters(db)
    for item in items:
        await _go_through(inbox, item)
    # The service's connections report their counters when idle, within a second or so:
    # wait until these updates are counted, then take the figure reported with them.
    deadline = time.monotonic() + 10
    after = await _inbox_counters(db)
    while after["n_tup_upd"] < before["n_tup_upd"] + 3 * len(items) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # wait-ok: polling the statistics until they are reported
        after = await _inbox_counters(db)
    assert after["n_tup_upd"] >= before["n_tup_upd"] + 3 * len(items)
    return before[counter], after[counter]


async def test_marks_claims_and_seen_updates_never_scan_the_inbox_once_it_has_grown(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    early, late = variants(12), variants(6, start=12)
    async with open_runtime() as runtime:
        for item in early:  # more than five runs of each statement, on an inbox of a few rows
            await _go_through(runtime.inbox, item)
        await _add_processed_rows(db, "grown-", GROWN_TO)
        scans_before, scans = await _counted(db, runtime.inbox, late, "seq_scan")
    assert scans == scans_before


#: Rows deleted at once from the oldest end of an analyzed inbox, as a purge does.
DELETED = 60_000


async def test_marks_and_seen_updates_do_not_step_over_the_entries_of_rows_just_deleted(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    """Until a vacuum, the primary key keeps an entry for each deleted row. Planning a join on
    ``id`` that could be a merge join looks up the key's real lowest and highest values, stepping
    over every dead entry at its low end on each planning: after a purge of 1,000,000 rows that
    made each mark and seen update 2 ms of Postgres's CPU dearer until a vacuum. Joined to a
    materialized set of locked rows, they plan without it."""
    items = variants(8)
    await _add_processed_rows(db, "old-", DELETED + 20_000)
    await db.execute("ANALYZE evolution_ingest_inbox")  # as autovacuum would have
    await db.execute(
        "DELETE FROM evolution_ingest_inbox WHERE id IN (SELECT id FROM evolution_ingest_inbox ORDER BY id LIMIT $1)",
        DELETED,
    )
    async with open_runtime() as runtime:
        blocks_before, blocks = await _counted(db, runtime.inbox, items, "key_blocks")
    # An event's four statements read about 35 of the key's blocks; planned with the joins that
    # step over the dead entries, about 250.
    per_event = (blocks - blocks_before) / len(items)
    assert per_event < 60, per_event


async def test_the_inbox_is_counted_while_small_and_estimated_once_grown_without_reading_it(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    """Below ``_EXACT_UPTO`` rows the figure is exact, analyzed or not. Above it, the planner's
    estimate: counting up to the limit first read 100,000 index entries on every scrape (7 ms of
    Postgres's CPU at 5,000,000 rows) only to fall back on the estimate."""
    async with open_runtime() as runtime:
        await _add_processed_rows(db, "few-", 500)
        assert (await runtime.stores.reads.stats(120))["rows"] == 500  # never analyzed
        await db.execute("ANALYZE evolution_ingest_inbox")
        assert (await runtime.stores.reads.stats(120))["rows"] == 500

        grown = _EXACT_UPTO + 20_000
        await _add_processed_rows(db, "many-", grown - 500)
        await db.execute("ANALYZE evolution_ingest_inbox")  # as autovacuum would have
        rows = (await runtime.stores.reads.stats(120))["rows"]
        assert abs(rows - grown) < grown * 0.02, rows
        explained = await db.fetchval(
            f"EXPLAIN (ANALYZE, FORMAT JSON) {_STATS}", 120.0, "evolution_ingest_inbox"
        )
        limits = [n for n in plan_nodes(explained) if n["Node Type"] == "Limit"]
    assert len(limits) == 1  # the count, under its limit
    assert limits[0]["Actual Loops"] == 0
