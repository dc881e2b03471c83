"""Retention with short settings, against the real Postgres: bodies leave with their partition,
rows after the dedup horizon, never an unprocessed or failed one; a late copy within the horizon is
still a duplicate; one leader; media stripped after processing; a load alongside loses and
doubles nothing."""

from __future__ import annotations

import asyncio
import copy
import re
import time
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest

from evolution_ingest.config import Settings
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.operate.retention_job import RetentionJob
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores import retention_sql
from evolution_ingest.stores.deliveries import DELIVERIES
from evolution_ingest.stores.inbox import BODIES, TABLE, VIEW
from evolution_ingest.stores.inbox_sql import STRIP_MEDIA
from evolution_ingest.stores.retention import DEFAULT_PARTITION, PARTITION_PREFIX, Partition, Retention
from tests.conftest import DATABASE_URL, OpenRuntime, serving
from tests.support import Recorder, fixture, fixtures, plan_nodes, variants, wait_until
from tests.test_admin import cli
from tests.test_cli import env_for

SHORT: dict[str, Any] = {
    "retention_partition_seconds": 1.0,
    "retention_bodies_seconds": 3.0,
    "retention_rows_seconds": 6.0,
    "retention_interval_seconds": 0.5,
    "retention_batch_size": 2,
    "retention_batch_pause_seconds": 0.0,
}


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return SHORT


def job_for(runtime: Runtime) -> RetentionJob:
    return RetentionJob(runtime.stores.retention, runtime.counters, runtime.settings)


async def ticks_until(job: RetentionJob, condition: Any, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "retention did not get there in time"
        await job.tick()
        await asyncio.sleep(0.25)  # wait-ok: a poll with a deadline, one retention pass per round


async def forget_redis(runtime: Runtime, settings: Settings) -> None:
    """No Redis marks left: Postgres alone decides whether a copy is a duplicate."""
    metrics = settings.metrics_prefix.encode()
    keys = [
        k
        async for k in runtime.redis.scan_iter(match=settings.redis_key_prefix + "*")
        if not k.startswith(metrics)
    ]
    if keys:
        await runtime.redis.delete(*keys)


async def test_old_bodies_then_old_rows_go_but_never_an_unprocessed_or_failed_one(
    open_runtime: OpenRuntime,
    recorder: Recorder,
    db: asyncpg.Connection,
    settings: Settings,
    http: aiohttp.ClientSession,
) -> None:
    items = fixtures()[:5]
    done, unfinished = items[:3], items[3:]
    async with open_runtime() as runtime, serving(runtime) as url:
        job = job_for(runtime)
        for item in done:
            async with http.post(url, data=orjson.dumps(item["webhook_body"])) as resp:
                assert (await resp.json())["status"] == "processed"
        for item in unfinished:  # saved, never processed (as after a crash); bodies in this span's partition
            await runtime.inbox.save(parse_envelope(item["rabbitmq_body"]), Channel.RABBITMQ, None)
        await db.execute(
            f"UPDATE {TABLE} SET failed_at = now(), attempts = 5 WHERE id = (SELECT max(id) FROM {TABLE})"
        )
        first = await db.fetchval(f"SELECT min(id) FROM {TABLE}")
        await db.execute(
            f"INSERT INTO {DELIVERIES} (event_id, destination, status) VALUES ($1, 'crm', 'delivered')", first
        )
        bodies_before = {r["id"]: r["payload"] for r in await db.fetch(f"SELECT id, payload FROM {VIEW}")}

        async def partitions_of_these_bodies_gone() -> bool:
            return not await db.fetchval(f"SELECT count(*) FROM {BODIES}")

        await ticks_until(job, partitions_of_these_bodies_gone)
        assert not await db.fetchval(
            f"SELECT count(*) FROM {VIEW} WHERE payload IS NOT NULL AND processed_at IS NOT NULL"
        )
        rows = await db.fetch(f"SELECT id, payload, processed_at FROM {VIEW} ORDER BY id")
        assert len(rows) == 5  # rows (keys) outlive bodies
        kept = [r for r in rows if r["processed_at"] is None]
        assert [r["payload"] for r in kept] == [bodies_before[r["id"]] for r in kept]  # rescued, exact
        assert await db.fetchval(f"SELECT count(*) FROM {TABLE} WHERE payload IS NOT NULL") == 2

    # A fresh process (nothing in memory) and no Redis marks: Postgres alone decides.
    async with open_runtime() as runtime, serving(runtime) as url:
        job = job_for(runtime)
        await forget_redis(runtime, settings)
        async with http.post(url, data=orjson.dumps(done[0]["webhook_body"])) as resp:
            assert (await resp.json())["reason"] == "duplicate"  # within the horizon, body gone or not

        async def processed_rows_gone() -> bool:
            return await db.fetchval(f"SELECT count(*) FROM {TABLE}") == 2

        await ticks_until(job, processed_rows_gone)
        left = await db.fetch(f"SELECT processed_at, failed_at, payload FROM {VIEW}")
        assert all(r["processed_at"] is None and r["payload"] is not None for r in left)
        assert sum(r["failed_at"] is not None for r in left) == 1
        assert await db.fetchval(f"SELECT count(*) FROM {DELIVERIES}") == 0  # went with their event
        counted = await runtime.counters.read()
    async with open_runtime() as runtime, serving(runtime) as url:
        await forget_redis(runtime, settings)
        async with http.post(url, data=orjson.dumps(done[0]["webhook_body"])) as resp:
            assert (await resp.json())["status"] == "processed"  # past the horizon it runs again
    key = parse_envelope(done[0]["webhook_body"]).dedup_key
    assert recorder.calls[key] == 2
    assert counted["retention:rows_deleted"] == 3
    assert counted["retention:bodies_rescued"] == 2
    assert counted["retention:partitions_dropped"] >= 1
    assert counted["retention:bodies_dropped"] >= 3


async def test_partitions_are_made_ahead_and_a_stray_body_in_the_default_partition_is_stepped_over(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    async with open_runtime() as runtime:
        retention = runtime.stores.retention
        for partition in await retention.partitions():
            await db.execute(f'DROP TABLE "{partition.name}"')
        now = time.time()
        # A save while no partition exists lands in the default partition.
        await db.execute(
            f"INSERT INTO {TABLE} (dedup_key, event, instance, channel) VALUES ($1, 'x', 'i', 'WEBHOOK')",
            "a" * 64,
        )
        row = await db.fetchrow(f"SELECT id, received_at FROM {TABLE}")
        await db.execute(
            f"INSERT INTO {BODIES} (event_id, received_at, payload) VALUES ($1, $2, '{{}}')",
            row["id"],
            row["received_at"],
        )
        created = await retention.ensure_partitions(now, 1.0, 3.0)
        assert created
        assert created[0].start > row["received_at"].timestamp()
        assert created[-1].end >= now + 3.0
        assert [p.end for p in created[:-1]] == [p.start for p in created[1:]]  # contiguous
        assert await db.fetchval(f"SELECT count(*) FROM {DEFAULT_PARTITION}") == 1
        assert await retention.ensure_partitions(now, 1.0, 3.0) == []  # idempotent
    assert Partition.named(created[0].name) == created[0]
    assert Partition.named("evolution_ingest_bodies_default") is None


async def test_one_replica_applies_retention(open_runtime: OpenRuntime) -> None:
    async with open_runtime() as runtime:
        replicas = [job_for(runtime) for _ in range(2)]
        try:
            held = [await r._leadership.acquire() for r in replicas]
        finally:
            for replica in replicas:
                await replica._leadership.release()
    assert held == [True, False]


async def test_media_leave_a_body_once_processed_when_asked(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection, http: aiohttp.ClientSession
) -> None:
    body = copy.deepcopy(fixture("messages_upsert_image_incoming_with_base64")["webhook_body"])
    body["data"]["message"]["base64"] = "iVBORw0KGgo" + "A" * 200_000  # a 150 KB image
    async with open_runtime(retention_strip_media=True) as runtime, serving(runtime) as url:
        async with http.post(url, data=orjson.dumps(body)) as resp:
            assert (await resp.json())["status"] == "processed"
        await runtime.counters.flush()
        counted = await runtime.counters.read(["retention:media_stripped"])
    assert recorder.events[0].data["message"]["base64"].startswith("iVBORw0KGgo")  # the handler had them
    stored = await db.fetchval(f"SELECT payload FROM {VIEW}")
    assert "base64" not in stored["data"]["message"]
    assert stored["data"]["message"]["imageMessage"] == body["data"]["message"]["imageMessage"]
    assert counted["retention:media_stripped"] == 1


def scanned(plan: str) -> list[str]:
    """The partitions of bodies an ``EXPLAIN (FORMAT JSON)`` plan scans (with ANALYZE: that ran)."""
    return [
        node["Relation Name"]
        for node in plan_nodes(plan)
        if "Scan" in node["Node Type"]
        and node.get("Relation Name", "").startswith(BODIES)
        and node.get("Actual Loops", 1) > 0
    ]


async def test_a_read_and_the_stripping_visit_only_the_partition_that_holds_the_body(
    open_runtime: OpenRuntime, db: asyncpg.Connection, http: aiohttp.ClientSession
) -> None:
    """Many partitions (a short span): the view finds a body by its event id and its partition
    key, so a page of rows (as the reconciler and replay read) runs the scan of the partition
    that holds each body, not one per partition; the stripping names the span of its batch's
    saves, so Postgres plans the partitions of that span alone."""
    body = fixture("messages_upsert_image_incoming_with_base64")["webhook_body"]
    async with open_runtime(retention_strip_media=True) as runtime, serving(runtime) as url:
        await runtime.stores.retention.ensure_partitions(time.time(), 1.0, 40.0)
        assert len(await runtime.stores.retention.partitions()) > 40
        async with http.post(url, data=orjson.dumps(body)) as resp:
            assert (await resp.json())["status"] == "processed"
    row = await db.fetchrow(f"SELECT id, received_at FROM {TABLE}")
    holding = await db.fetchval(f"SELECT tableoid::regclass::text FROM {BODIES}")
    assert holding.startswith(PARTITION_PREFIX)
    page = f"SELECT id, payload FROM {VIEW} WHERE received_at > now() - interval '1 hour' ORDER BY received_at, id"
    # On tables this small the planner may hash the whole bodies table; on large ones it loops
    # over the page's rows (measured in docs/retention.md): plan that loop, as there.
    async with db.transaction():
        await db.execute("SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off")
        read = await db.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {page}")
    assert scanned(read) == [holding], read
    assert [r["payload"]["event"] for r in await db.fetch(page)] == [body["event"]]
    at = row["received_at"]
    strip = await db.fetchval(f"EXPLAIN (FORMAT JSON) {STRIP_MEDIA}", [row["id"]], at, at)
    assert scanned(strip) == [holding], strip


async def test_retention_alongside_a_load_loses_and_doubles_nothing(
    open_runtime: OpenRuntime,
    recorder: Recorder,
    db: asyncpg.Connection,
    http: aiohttp.ClientSession,
) -> None:
    """Partitions made and dropped, bodies rescued, while events arrive twice (both channels'
    copies, as the webhook sees them); the rows' horizon is longer than the load."""
    bodies = [item["webhook_body"] for item in variants(240)]
    async with open_runtime(retention_rows_seconds=60.0) as runtime, serving(runtime) as url:
        job = job_for(runtime)
        stop = asyncio.Event()
        running = asyncio.create_task(job.run(stop))

        async def send(body: dict[str, Any]) -> None:
            for _ in range(2):
                async with http.post(url, data=orjson.dumps(body)) as resp:
                    assert resp.status == 200

        started = time.monotonic()
        for start in range(0, len(bodies), 20):  # bounded: 240 events, about 5 s
            await asyncio.gather(*(send(b) for b in bodies[start : start + 20]))
            await asyncio.sleep(0.4)  # wait-ok: pacing the load so that partitions drop during it
        elapsed = time.monotonic() - started

        async def every_body_dropped() -> bool:  # the load's last partition too
            return not await db.fetchval(f"SELECT count(*) FROM {BODIES}")

        await wait_until(every_body_dropped, within=20, interval=0.1, message="the last partition dropped")
        stop.set()
        await running
        counted = await runtime.counters.read()
    keys = {parse_envelope(b).dedup_key for b in bodies}
    assert elapsed > SHORT["retention_bodies_seconds"]  # partitions were dropped during the load
    assert set(recorder.calls) == keys  # nothing lost
    assert max(recorder.calls.values()) == 1  # nothing doubled
    assert await db.fetchval(f"SELECT count(*) FROM {TABLE} WHERE processed_at IS NOT NULL") == len(keys)
    assert counted["retention:partitions_dropped"] >= 2
    assert counted.get("retention:errors", 0) == 0


async def test_status_shows_the_size_and_the_retention_in_force(
    open_runtime: OpenRuntime, settings: Settings, http: aiohttp.ClientSession
) -> None:
    async with open_runtime() as runtime, serving(runtime) as url:
        async with http.post(url, data=orjson.dumps(fixtures()[0]["webhook_body"])) as resp:
            assert resp.status == 200
        async with http.get(url.removesuffix("/api/internal/webhook") + "/metrics") as resp:
            metrics = await resp.text()
    report = orjson.loads((await cli(env_for(settings), "status", "--json")).stdout)["inbox"]
    human = (await cli(env_for(settings), "status")).stdout
    assert report["retention"] == {
        "enabled": True, "bodies_seconds": 3.0, "rows_seconds": 6.0, "partition_seconds": 1.0, "strip_media": False,
    }  # fmt: skip
    assert report["size"]["rows_bytes"] > 0
    assert report["size"]["bodies_bytes"] > 0
    assert report["size"]["partitions"] >= 3
    assert "retention: bodies 3s, rows (the dedup horizon) 6s" in human
    for line in ('evolution_ingest_inbox_bytes{part="bodies"}', "evolution_ingest_inbox_rows 1.0",
                 "evolution_ingest_inbox_body_partitions", "evolution_ingest_inbox_oldest_row_age_seconds"):  # fmt: skip
        assert line in metrics


async def test_check_warns_of_a_horizon_under_a_day_and_sees_the_partitions(
    open_runtime: OpenRuntime, settings: Settings
) -> None:
    # Partitions a minute ahead, as a running leader keeps them: the 1-s partitions made at
    # migration (3 s ahead) may all be past by the time the command has started.
    async with open_runtime() as runtime:
        await runtime.stores.retention.ensure_partitions(time.time(), 1.0, 60.0)
    result = await cli(env_for(settings), "check", "--json")
    lines = {r["check"]: r for r in orjson.loads(result.stdout)}
    assert lines["retention"]["state"] == "warn"
    assert "under a day" in lines["retention"]["detail"]
    assert "EVOLUTION_INGEST_RETENTION_ROWS_SECONDS" in lines["retention"]["detail"]
    assert lines["partitions"]["state"] == "ok"


@pytest.mark.parametrize("statement", ["DELETE_ROWS", "EMPTY_BODIES", "EMPTY_LEGACY_BODIES"])
async def test_a_step_reads_its_rows_by_their_ids_never_by_a_scan_of_the_inbox(
    db: asyncpg.Connection, statement: str
) -> None:
    """Each step must cost what it removes: on a large inbox, a join with the batch could be planned
    as a scan of the whole table (it was, from a few tens of thousands of rows), once per step."""
    await db.execute(
        f"""INSERT INTO {TABLE} (dedup_key, event, instance, channel, received_at, processed_at)
            SELECT md5(i::text) || md5((-i)::text), 'x', 'i', 'WEBHOOK',
                   now() - interval '3 days', now() - interval '3 days'
              FROM generate_series(1, 60000) AS i"""
    )
    await db.execute(f"ANALYZE {TABLE}")
    query = getattr(retention_sql, statement)
    plan = "\n".join(r[0] for r in await db.fetch(f"EXPLAIN (COSTS OFF) {query}", 0, 5000, 86400.0))
    assert f"Seq Scan on {TABLE}" not in plan, plan
    assert re.search(r"Index Cond: \(\(id > .+\) AND \(id <= \$\d+\)\)", plan), plan


async def test_a_partitions_bodies_leave_under_its_own_lock_before_the_table_is_dropped(
    open_runtime: OpenRuntime, db: asyncpg.Connection, settings: Settings, http: aiohttp.ClientSession
) -> None:
    """A DROP locks the parent table too, until the partition's files are gone: every save waits
    that long. The bodies go first under a lock of the partition alone, so a save holding the
    parent (here: a transaction that locked it as an insert does) does not keep them."""
    async with open_runtime() as runtime, serving(runtime) as url:
        for item in fixtures()[:3]:
            async with http.post(url, data=orjson.dumps(item["webhook_body"])) as resp:
                assert (await resp.json())["status"] == "processed"
        # The saves land in the partition of their second (maybe two); the ones before it go now,
        # so that the first the drop meets holds bodies.
        holding = await db.fetch(
            f"SELECT tableoid::regclass::text AS name, count(*) FROM {BODIES} GROUP BY 1 ORDER BY 1"
        )
        oldest = Partition.named(holding[0]["name"])
        assert oldest is not None, holding
        retention = Retention(runtime.stores.db, lock_timeout_seconds=0.2)
        await retention.drop_partitions(oldest.start + 3.0, 3.0)
        assert (await retention.partitions())[0] == oldest
        held = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": settings.database_schema})
        try:
            async with held.transaction():
                await held.execute(f"LOCK TABLE ONLY {BODIES} IN ROW EXCLUSIVE MODE")
                with pytest.raises(asyncpg.LockNotAvailableError):
                    await retention.drop_partitions(time.time() + 60, 3.0)
                assert await db.fetchval(f"SELECT count(*) FROM {BODIES}") == 3 - holding[0]["count"]
            dropped = await retention.drop_partitions(time.time() + 60, 3.0)
        finally:
            await held.close()
        assert oldest in [d.partition for d in dropped]
        assert oldest not in await retention.partitions()
        assert await db.fetchval(f"SELECT count(*) FROM {TABLE}") == 3  # rows (keys) stay
