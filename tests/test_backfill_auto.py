"""Backfill by itself: at start-up for the time away, on a schedule, for a silent instance; one
active backfiller across replicas; and ``check`` when Evolution stores nothing to backfill from."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import aiohttp
import asyncpg
import orjson
from pydantic import SecretStr

from evolution_ingest.channels.backfill_schedule import BackfillScheduler, api_for
from tests.conftest import OpenRuntime
from tests.support import Recorder, wait_until
from tests.test_admin import cli
from tests.test_backfill import World, recent, world
from tests.test_connect import API_KEY
from tests.test_evolution_checks import check, only


def _automatic(w: World) -> dict[str, object]:
    return {"evolution_url": w.evolution_url, "evolution_api_key": SecretStr(API_KEY)}


async def _runs(db: asyncpg.Connection, reason: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT instance, ingested, already, finished_at FROM evolution_ingest_backfill_runs WHERE reason = $1 "
        "ORDER BY id",
        reason,
    )


async def _total(recorder: Recorder, count: int) -> bool:
    return recorder.total >= count


async def test_start_up_schedule_and_silent_instances_are_backfilled_by_one_active_backfiller(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    timings = {
        "backfill_settle_seconds": 0.0,
        "backfill_overlap_seconds": 900.0,
        "gap_alert_after_seconds": 1.0,
    }
    async with world(open_runtime, http, ("acme-sales", "acme-new"), **timings) as w:
        await w.emit("acme-sales", 1)  # the service heard from acme-sales, never from acme-new
        await wait_until(lambda: _total(recorder, 1), within=20, message="message 1")
        for n in (2, 3):  # then it was away: both channels missed these
            w.drop("acme-sales", n)
        w.drop("acme-new", 4)
        settings = w.runtime.settings.model_copy(update=_automatic(w))
        replicas = [BackfillScheduler(w.runtime.ingestion, w.runtime.stores, settings) for _ in range(2)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(r.run(stop)) for r in replicas]
        try:
            await wait_until(lambda: _total(recorder, 3), within=20, message="the start-up backfill")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        startup = await _runs(db, "startup")
        leader = next(r for r in replicas if r._started)
        api = api_for(settings)
        assert api is not None
        try:
            # The schedule: every instance, its window from before the previous one's end.
            leader._next_schedule = 0.0
            w.drop("acme-new", 5)
            scheduled = await leader.tick(api)
            # acme-sales connected, both channels silent past GAP_ALERT_AFTER_SECONDS, Evolution storing.
            await w.runtime.stores.connections.record("acme-sales", datetime.now(UTC), "open", 200, "event")
            w.fake.store(
                "acme-sales", {**recent(6), "messageTimestamp": int(time.time())}
            )  # newer than heard
            await asyncio.sleep(1.2)  # wait-ok: the channels' silence has to last GAP_ALERT_AFTER_SECONDS
            silent = await leader.tick(api)
            quiet = await leader.tick(api)  # the same silence is not backfilled twice
        finally:
            await api.close()
    assert [(r["instance"], r["ingested"]) for r in startup] == [("acme-sales", 2)]
    assert sum(1 for r in replicas if r._started) == 1
    assert sorted((r.instance, r.ingested) for r in scheduled) == [("acme-new", 2), ("acme-sales", 0)]
    assert [(r.instance, r.ingested) for r in silent] == [("acme-sales", 1)]
    assert quiet == []
    assert [r["instance"] for r in await _runs(db, "silent")] == ["acme-sales"]
    assert recorder.total == 6
    assert recorder.doubled() == []
    counted = await w.runtime.counters.read(
        ["backfill:received", "backfill:runs", "backfill:silent_instances"]
    )
    assert counted == {"backfill:received": 5, "backfill:runs": 4, "backfill:silent_instances": 1}


async def test_status_and_metrics_show_backfill_and_check_says_when_evolution_stores_nothing(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    async with world(open_runtime, http, ("acme-sales",)) as w:
        env = w.env()
        await w.emit("acme-sales", 1)
        w.drop("acme-sales", 2)
        await w.runtime.stores.connections.record("acme-sales", datetime.now(UTC), "open", 200, "event")
        await wait_until(lambda: _total(recorder, 1), within=20, message="message 1")
        _, stores_them = await check(env)
        assert (await cli(env, "backfill", "--since", "1h")).returncode == 0
        status = await cli(env, "status", "--json")
        human = await cli(env, "status")
        async with http.get(w.service.url.removesuffix("/api/internal/webhook") + "/metrics") as answer:
            metrics = await answer.text()
        w.fake.save_messages = False
        w.fake.instances["acme-sales"].messages.clear()
        await w.emit("acme-sales", 3)
        await wait_until(lambda: _total(recorder, 3), within=20, message="message 3")
        _, stores_nothing = await check(env)
    section = orjson.loads(status.stdout)["backfill"]
    assert section["counters"]["received"] == 1
    assert section["recent_runs"][0]["ingested"] == 1
    assert "Backfill (automatic): 2 stored message(s) read, 1 already received, 1 ingested" in human.stdout
    assert 'evolution_ingest_events_received_total{channel="backfill"} 1.0' in metrics
    assert only(stores_them, "backfill")["state"] == "ok"
    assert (
        "Evolution stores messages (2 of acme-sales in the last 24 h)"
        in only(stores_them, "backfill")["detail"]
    )
    nothing = only(stores_nothing, "backfill")
    assert nothing["state"] == "warn"
    assert "DATABASE_SAVE_DATA_NEW_MESSAGE=true" in nothing["detail"]
