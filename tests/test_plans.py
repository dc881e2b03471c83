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
from evolution_ingest.stores.inbox import Claim
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


async def test_marks_claims_and_seen_updates_never_scan_the_inbox_once_it_has_grown(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    early, late = variants(12), variants(6, start=12)
    async with open_runtime() as runtime:
        inbox = runtime.inbox

        async def go_through(item: dict[str, object]) -> None:
            envelope = parse_envelope(item["webhook_body"])
            row = await inbox.save(envelope, Channel.WEBHOOK, None)
            claimed = await inbox.claim_saved(envelope.dedup_key, Claim.new(60.0))
            assert claimed is not None
            assert claimed.claimed
            assert await inbox.mark_processed(row.id)
            await inbox.record_seen(envelope.dedup_key, Channel.RABBITMQ)

        for item in early:  # more than five runs of each statement, on an inbox of a few rows
            await go_through(item)
        await db.execute(
            "INSERT INTO evolution_ingest_inbox (dedup_key, event, instance, channel, processed_at)"
            " SELECT encode(sha256(('grown-' || n)::bytea), 'hex'), 'messages.upsert', 'acme-sales',"
            " 'WEBHOOK', now() FROM generate_series(1, $1) AS n",
            GROWN_TO,
        )
        scans_before, updates_before = await _scans_and_updates(db)
        for item in late:
            await go_through(item)
        # The service's connections report their counters when idle, within a second or so:
        # wait until this test's updates are counted, then read the scans reported with them.
        deadline = time.monotonic() + 10
        scans, updates = await _scans_and_updates(db)
        while updates < updates_before + 3 * len(late) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # wait-ok: polling the statistics until they are reported
            scans, updates = await _scans_and_updates(db)
    assert updates >= updates_before + 3 * len(late)
    assert scans == scans_before
