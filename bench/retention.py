"""Retention: bytes per event before and after partitioned bodies, a soak with retention on (the
inbox's size over time), and webhook latency while a large backlog of old events is removed.

    .venv/bin/python -m bench.retention [--events 20000] [--soak-seconds 180] [--rate 200]
                                        [--backlog 500000]

1. Bytes per event: the same ``--events`` bodies stored in the layout before migration 0006 (one
   table, bodies in it) and through ``up`` in the current one (rows + partitioned bodies).
2. Soak: ``up`` with retention in seconds (partitions of 5 s, bodies 15 s, rows 30 s) under an
   open-loop webhook load of ``--rate`` events/s; the inbox's bytes sampled every 10 s.
3. Removal under load: ``--backlog`` processed events two days old (bodies in their day's
   partition), removed by one retention pass (run here, as the leader) while ``up`` takes
   ``--rate`` events/s; webhook p50/p99 before and during, and how long the removal took.
Every load is bounded in count and time; only loopback addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aiohttp
import asyncpg
import orjson

from bench.events import unique_event
from bench.harness import DATABASE_URL, Inflight, Isolation, cli, free_port, frozen, process, table, wait_http
from bench.measure import percentile
from bench.service import service_env
from evolution_ingest.config import Settings
from evolution_ingest.core.redaction import REDACTED, Redactor
from evolution_ingest.operate.retention_job import RetentionJob
from evolution_ingest.stores import Stores, migrations, run_migrations
from evolution_ingest.stores.retention import Partition

DAY = 86_400


def body(n: int) -> bytes:
    webhook = unique_event(n)[0]
    return orjson.dumps({**webhook, "apikey": "bench-fake-apikey"})


async def paced(
    url: str, rate: float, seconds: float, offset: int, stop: asyncio.Event | None = None
) -> list[tuple[float, float, int]]:
    """(sent at, latency ms, status) of each POST, at ``rate``/s for ``seconds`` or until ``stop``."""
    results: list[tuple[float, float, int]] = []
    count = int(rate * seconds)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as http:

        async def send(n: int) -> None:
            sent = time.time()
            began = time.perf_counter()
            async with http.post(
                url, data=body(offset + n), headers={"content-type": "application/json"}
            ) as r:
                await r.read()
            results.append((sent, (time.perf_counter() - began) * 1000, r.status))

        started, inflight = time.perf_counter(), Inflight()
        with frozen():
            for n in range(count):
                if stop is not None and stop.is_set():
                    break
                delay = started + n / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                inflight.start(send(n))
            await inflight.wait()
    return results


async def sizes(schema: str) -> dict[str, int]:
    conn = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": schema})
    try:
        row = await conn.fetchrow(
            "SELECT pg_total_relation_size(to_regclass('evolution_ingest_inbox')) AS rows, "
            "COALESCE((SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits "
            "WHERE inhparent = to_regclass('evolution_ingest_bodies')), 0)::bigint AS bodies, "
            "(SELECT count(*) FROM evolution_ingest_inbox) AS count"
        )
        assert row is not None
        return {"rows": int(row["rows"]), "bodies": int(row["bodies"]), "count": int(row["count"])}
    finally:
        await conn.close()


async def bytes_per_event(events: int) -> tuple[float, float, float]:
    """(before: one table; after: rows + bodies; after the bodies went: rows only), bytes per event."""
    before = Isolation()
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        await migrations.migrate(conn, before.schema, upto=5)
        bodies = [orjson.dumps({**orjson.loads(body(n)), "apikey": REDACTED}).decode() for n in range(events)]
        keys = [f"{n:064x}" for n in range(events)]
        await conn.execute(
            f'INSERT INTO "{before.schema}".evolution_ingestion_events (dedup_key, event, instance, channel, payload, '
            "webhook_seen_at, processed_at, attempts, last_attempt_at) "
            "SELECT k, 'messages.upsert', 'acme-sales', 'WEBHOOK', p::jsonb, now(), now(), 1, now() "
            "FROM unnest($1::text[], $2::text[]) AS u(k, p)",
            keys, bodies,
        )  # fmt: skip
        await conn.execute(f'VACUUM FULL "{before.schema}".evolution_ingestion_events')
        old = await conn.fetchval(
            f"SELECT pg_total_relation_size('\"{before.schema}\".evolution_ingestion_events')"
        )
    finally:
        await conn.close()
        await before.cleanup()
    after = Isolation()
    port = free_port()
    try:
        async with process(cli("up"), service_env(after, PORT=str(port)), "up"):
            await wait_http(f"http://127.0.0.1:{port}/healthz")
            await paced(f"http://127.0.0.1:{port}/api/internal/webhook", 1000, events / 1000, 0)
            written = await sizes(after.schema)
            await compact(after.schema)
            now = await sizes(after.schema)
    finally:
        await after.cleanup()
    print(f"as written (before vacuum, with the dead row versions of 'processed' marks): "
          f"{(written['rows'] + written['bodies']) / written['count']:,.0f} bytes per event")  # fmt: skip
    return old / events, (now["rows"] + now["bodies"]) / now["count"], now["rows"] / now["count"]


async def compact(schema: str) -> None:
    """VACUUM FULL both layouts before measuring them, so that they compare compact to compact."""
    conn = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": schema})
    try:
        await conn.execute("VACUUM FULL evolution_ingest_inbox")
        for record in await conn.fetch(
            "SELECT inhrelid::regclass::text AS name FROM pg_inherits WHERE inhparent = 'evolution_ingest_bodies'::regclass"
        ):
            await conn.execute(f"VACUUM FULL {record['name']}")
    finally:
        await conn.close()


async def soak(rate: float, seconds: float) -> list[tuple[int, int, int, int]]:
    """(second, rows, rows bytes, bodies bytes) every 10 s of a load with short retention."""
    iso, port = Isolation(), free_port()
    short = {"RETENTION_PARTITION_SECONDS": "5", "RETENTION_BODIES_SECONDS": "15", "RETENTION_ROWS_SECONDS": "30",
             "RETENTION_INTERVAL_SECONDS": "2"}  # fmt: skip
    samples: list[tuple[int, int, int, int]] = []
    try:
        async with process(cli("up"), service_env(iso, PORT=str(port), **short), "up"):
            await wait_http(f"http://127.0.0.1:{port}/healthz")
            load = asyncio.create_task(
                paced(f"http://127.0.0.1:{port}/api/internal/webhook", rate, seconds, 0)
            )
            began = time.monotonic()
            while not load.done():
                await asyncio.sleep(10)
                now = await sizes(iso.schema)
                samples.append((round(time.monotonic() - began), now["count"], now["rows"], now["bodies"]))
            await load
    finally:
        await iso.cleanup()
    return samples


async def removal_under_load(rate: float, backlog: int) -> dict[str, Any]:
    iso, port = Isolation(), free_port()
    env = service_env(iso, PORT=str(port), RETENTION_ENABLED="false")
    settings = Settings(
        _env_file=None,
        database_url=DATABASE_URL, database_schema=iso.schema, redis_key_prefix=iso.prefix,
        metrics_prefix=iso.prefix + "metrics:", retention_batch_size=5000, retention_batch_pause_seconds=0.05,
        retention_bodies_seconds=DAY, retention_rows_seconds=DAY,
    )  # fmt: skip
    await run_migrations(settings)
    conn = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": iso.schema})
    try:
        day = int(time.time() // DAY * DAY) - 2 * DAY
        old = Partition(day, day + DAY)
        await conn.execute(f'CREATE TABLE "{old.name}" (LIKE evolution_ingest_bodies INCLUDING DEFAULTS)')
        await conn.execute(
            f'ALTER TABLE evolution_ingest_bodies ATTACH PARTITION "{old.name}" FOR VALUES FROM '
            f"('{old.bound(old.start)}') TO ('{old.bound(old.end)}')"
        )
        sample = orjson.dumps({**orjson.loads(body(0)), "apikey": REDACTED}).decode()
        filled = time.perf_counter()
        for start in range(0, backlog, 100_000):
            rows = min(100_000, backlog - start)
            await conn.execute(
                "WITH made AS (INSERT INTO evolution_ingest_inbox (dedup_key, event, instance, channel, received_at, "
                "webhook_seen_at, processed_at, attempts) SELECT encode(sha256(('old' || n)::bytea), 'hex'), "
                "'messages.upsert', 'acme-sales', 'WEBHOOK', to_timestamp($3::bigint + n % 86000), now(), "
                "to_timestamp($3::bigint + n % 86000), 1 FROM generate_series($1::bigint, $2::bigint) AS n RETURNING id, received_at) "
                "INSERT INTO evolution_ingest_bodies (event_id, received_at, payload) SELECT id, received_at, $4::jsonb FROM made",
                start, start + rows - 1, day, sample,
            )  # fmt: skip
        await conn.execute("VACUUM ANALYZE evolution_ingest_inbox")
        filled = time.perf_counter() - filled
        size = await sizes(iso.schema)
        async with process(cli("up"), env, "up"):
            await wait_http(f"http://127.0.0.1:{port}/healthz")
            url = f"http://127.0.0.1:{port}/api/internal/webhook"
            await paced(url, rate, 5, 9_000_000)  # warm-up, not counted
            baseline = await paced(url, rate, 15, 10_000_000)
            async with Stores.open(settings, Redactor(secrets=[])) as stores:
                job = RetentionJob(stores.retention, stores.counters, settings)
                stop = asyncio.Event()
                load = asyncio.create_task(paced(url, rate, 900, 20_000_000, stop))
                began = time.time()
                report = await job.tick()
                ended = time.time()
                stop.set()
                during = [r for r in await load if began <= r[0] <= ended]
    finally:
        await conn.close()
        await iso.cleanup()
    return {"filled_seconds": filled, "size": size, "baseline": baseline, "during": during,
            "seconds": ended - began, "report": report}  # fmt: skip


def latency(results: list[tuple[float, float, int]]) -> str:
    ms = [r[1] for r in results]
    return (
        f"p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms ({len(ms)} requests)"
        if ms
        else "-"
    )


async def main(args: argparse.Namespace) -> None:
    if args.only != "removal":
        await sizes_and_soak(args)
    result = await removal_under_load(args.rate, args.backlog)
    print(
        f"\nremoval of {args.backlog:,} old events ({result['size']['bodies'] / 1e6:,.0f} MB of bodies, "
        f"{result['size']['rows'] / 1e6:,.0f} MB of rows; filled in {result['filled_seconds']:.0f} s) "
        f"under {args.rate:g} events/s:"
    )
    print(f"  removal took {result['seconds']:.1f} s: {result['report']}")
    print(f"  webhook before: {latency(result['baseline'])}")
    print(f"  webhook during: {latency(result['during'])}")


async def sizes_and_soak(args: argparse.Namespace) -> None:
    before, after, slim = await bytes_per_event(args.events)
    print(f"bytes per event ({args.events:,} fixture events, compacted): before (one table) {before:,.0f}; "
          f"now {after:,.0f} (rows {slim:,.0f} + bodies {after - slim:,.0f}); once the body is gone {slim:,.0f}")  # fmt: skip
    per_day = 100 * DAY  # events a day at 100 events/s
    bodies_days = Settings.model_fields["retention_bodies_seconds"].default / DAY
    rows_days = Settings.model_fields["retention_rows_seconds"].default / DAY
    # Bodies: their days, and the partition being filled; rows: their days.
    steady = per_day * ((bodies_days + 1) * (after - slim) + rows_days * slim)
    print(
        f"100 events/s with the defaults (bodies {bodies_days:g} d, rows {rows_days:g} d): {steady / 1e9:,.0f} GB "
        f"on disk from day {rows_days:g} on, "
        f"the same after a year (without retention: {per_day * 365 * before / 1e12:,.1f} TB after a year)"
    )
    samples = await soak(args.rate, args.soak_seconds)
    print(
        f"\nsoak at {args.rate:g} events/s for {args.soak_seconds:g} s (partitions 5 s, bodies 15 s, rows 30 s):"
    )
    print(table([(s, f"{n:,}", f"{r / 1e6:.1f}", f"{b / 1e6:.1f}", f"{(r + b) / 1e6:.1f}") for s, n, r, b in samples],
                ["second", "rows", "rows MB", "bodies MB", "total MB"]))  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--soak-seconds", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--backlog", type=int, default=500_000)
    parser.add_argument("--only", choices=["removal"], help="only the removal under load")
    asyncio.run(main(parser.parse_args()))
