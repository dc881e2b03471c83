"""Operator commands, run as an operator runs them: status, inspect, replay, purge, check, reconcile --once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import aio_pika
import aiohttp
import asyncpg
import orjson
import pytest

from evolution_ingest.config import Settings
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.stores.inbox import TABLE
from evolution_ingest.stores.inbox_sql import BODIES, VIEW
from evolution_ingest.stores.queues import Topology
from evolution_ingest.stores.retention import Partition
from tests.conftest import RABBITMQ_URL, OpenRuntime, running_service, serving, worker_for
from tests.support import Recorder, dead_port, fixture, fixtures, wait_until
from tests.support.evolution import EvolutionPublisher, broker, depth, remove
from tests.test_cli import env_for
from tests.test_reconciler import backdate, reconciler_for, stuck_events


async def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run a command without blocking the event loop (the webhook app under test lives in it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "evolution_ingest", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def cli_json(env: dict[str, str], *args: str) -> Any:
    result = await cli(env, *args, "--json")
    assert result.returncode == 0, result.stderr
    return orjson.loads(result.stdout)


async def test_a_failed_event_is_listed_by_status_and_processed_once_by_replay_after_the_fix(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection, settings: Settings
) -> None:
    broken = Recorder(failures=10**6)
    item = fixture("messages_update_read")
    async with open_runtime(broken, reconcile_max_attempts=2) as runtime, serving(runtime) as url:
        (key,) = await stuck_events(runtime, db, [item])
        async with reconciler_for(runtime, url) as (reconciler, _):
            for _ in range(3):
                await reconciler.run_once()
    env = env_for(settings)
    status = await cli_json(env, "status")
    assert status["inbox"]["failed"] == 1
    assert status["inbox"]["pending"] == 0
    assert status["inbox"]["rows"] == 1
    human = await cli(env, "status")
    assert human.returncode == 0
    assert "Inbox" in human.stdout
    assert "failed" in human.stdout

    dry = await cli_json(
        env_for(settings, FORWARD_URL="http://127.0.0.1:9/x"), "replay", "--dry-run", "--no-parked"
    )
    assert dry["failed_events"] == 1
    assert await db.fetchval(f"SELECT failed_at IS NOT NULL AND processed_at IS NULL FROM {TABLE}")

    async with open_runtime() as runtime, serving(runtime) as url:  # the handler is fixed
        report = await cli_json(
            env_for(settings, FORWARD_URL=url), "replay", "--no-parked", "--event", "MESSAGES_UPDATE"
        )
        again = await cli_json(env_for(settings, FORWARD_URL=url), "replay", "--no-parked")
    assert report["failed_events"] == 1
    assert report["recovered"] == 1
    assert again["failed_events"] == 0
    assert recorder.calls == {key: 1}
    row = await db.fetchrow(f"SELECT * FROM {TABLE}")
    assert row["processed_at"] is not None
    assert row["failed_at"] is not None  # kept as history: it had been given up on
    assert (await cli_json(env, "status"))["inbox"]["failed"] == 0


async def test_replay_filters_by_instance_and_time(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection, settings: Settings
) -> None:
    async with open_runtime() as runtime, serving(runtime) as url:
        await stuck_events(runtime, db, fixtures()[:3])
        await db.execute(f"UPDATE {TABLE} SET failed_at = now(), attempts = 10")
        await db.execute(f"UPDATE {TABLE} SET instance = 'other' WHERE id = (SELECT min(id) FROM {TABLE})")
        env = env_for(settings, FORWARD_URL=url)
        none_yet = await cli_json(env, "replay", "--no-parked", "--since", "1m")  # they are 10 minutes old
        other = await cli_json(env, "replay", "--no-parked", "--instance", "other")
    assert none_yet["failed_events"] == 0
    assert other["failed_events"] == 1
    assert recorder.total == 1


async def test_a_parked_message_is_replayed_and_processed_once(
    open_runtime: OpenRuntime, recorder: Recorder, settings: Settings
) -> None:
    item = fixture("presence_update_composing")
    async with open_runtime() as runtime:
        topology = Topology(runtime.settings)
        try:
            async with (
                worker_for(runtime, f"http://127.0.0.1:{dead_port()}/api/internal/webhook"),
                broker(RABBITMQ_URL) as (_, channel),
            ):
                publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
                await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
                # What the worker parks when it cannot keep a refusal (Postgres away).
                await channel.default_exchange.publish(
                    aio_pika.Message(b"not json at all"), routing_key=topology.parking
                )

                async def parked() -> bool:
                    return await depth(channel, topology.parking) == 2

                await wait_until(parked, within=20, message="both parked")
            async with running_service(runtime) as service, broker(RABBITMQ_URL) as (_, channel):
                env = env_for(settings, FORWARD_URL=service.url)
                dry = await cli_json(env, "replay", "--no-failed", "--dry-run")
                assert dry == {"dry_run": True, "failed_events": 0, "parked_messages": 1, "parked_left": 1}
                assert await depth(channel, topology.parking) == 2
                report = await cli_json(env, "replay", "--no-failed")
                await wait_until(
                    lambda: recorder.total == 1, within=15, message="the replayed message processed"
                )
                assert await depth(channel, topology.parking) == 1  # the unparseable one stays parked
                again = await cli_json(env, "replay", "--no-failed")
        finally:
            await remove(RABBITMQ_URL, topology)
    assert report["parked_messages"] == 1
    assert again["parked_messages"] == 0
    assert recorder.calls == {parse_envelope(item["rabbitmq_body"]).dedup_key: 1}


async def _processed_and_stuck(
    open_runtime: OpenRuntime,
    db: asyncpg.Connection,
    http: aiohttp.ClientSession,
    items: list[dict[str, Any]],
) -> None:
    """The first two events processed by the webhook, the others saved and left unprocessed."""
    async with open_runtime() as runtime, serving(runtime) as url:
        for item in items[:2]:
            async with http.post(url, data=orjson.dumps(item["webhook_body"])) as resp:
                assert resp.status == 200
        await stuck_events(runtime, db, items[2:])


async def test_purge_never_removes_an_unprocessed_row_and_refuses_a_short_age(
    open_runtime: OpenRuntime, db: asyncpg.Connection, settings: Settings, http: aiohttp.ClientSession
) -> None:
    await _processed_and_stuck(open_runtime, db, http, fixtures()[:4])
    await backdate(db, "3 days")
    await db.execute(
        f"UPDATE {TABLE} SET processed_at = now() - interval '3 days' WHERE processed_at IS NOT NULL"
    )
    await db.execute(
        f"UPDATE {TABLE} SET failed_at = now() - interval '3 days' WHERE id = (SELECT max(id) FROM {TABLE})"
    )
    env = env_for(settings)

    refused = await cli(env, "purge", "--older-than", "1h")
    assert refused.returncode == 1
    assert "shorter than the safe minimum" in refused.stderr
    dry = await cli_json(env, "purge", "--older-than", "2d", "--dry-run")
    assert dry["rows_deleted"] == 2
    assert await db.fetchval(f"SELECT count(*) FROM {TABLE}") == 4
    vacuumed = "SELECT last_vacuum FROM pg_stat_user_tables WHERE relid = $1::regclass"
    before = await db.fetchval(vacuumed, TABLE)
    done = await cli(env, "purge", "--older-than", "2d", "--batch-size", "1")
    assert done.returncode == 0, done.stderr
    assert "purge: 2 processed row(s) older than 2d were deleted" in done.stdout
    # Without autovacuum the purge vacuums what it deleted, and says so; with it, it leaves that
    # to autovacuum.
    autovacuum_off = await db.fetchval("SHOW autovacuum") != "on"
    after = await db.fetchval(vacuumed, TABLE)
    assert (after is not None and after != before) == autovacuum_off
    assert ("vacuuming (autovacuum is off)" in done.stderr) == autovacuum_off
    left = await db.fetch(f"SELECT processed_at FROM {TABLE}")
    assert len(left) == 2
    assert all(r["processed_at"] is None for r in left)  # the unprocessed and the failed one stay
    assert await db.fetchval(f"SELECT count(*) FROM {BODIES}") == 2  # the purged rows' bodies went too
    forced = await cli_json(env, "purge", "--older-than", "1s", "--force")
    assert forced["rows_deleted"] == 0


async def test_a_late_retry_of_an_event_purged_with_payload_only_is_still_a_duplicate(
    open_runtime: OpenRuntime,
    recorder: Recorder,
    db: asyncpg.Connection,
    settings: Settings,
    http: aiohttp.ClientSession,
) -> None:
    body = fixture("messages_upsert_text_incoming")["webhook_body"]
    async with open_runtime() as runtime, serving(runtime) as url:
        async with http.post(url, data=orjson.dumps(body)) as resp:
            assert (await resp.json())["status"] == "processed"
        await db.execute(f"UPDATE {TABLE} SET processed_at = now() - interval '2 days'")
        await runtime.redis.delete(
            *[k async for k in runtime.redis.scan_iter(match=settings.redis_key_prefix + "*")]
        )
        purged = await cli_json(env_for(settings), "purge", "--older-than", "1h", "--payload-only")
        assert purged == {
            "dry_run": False,
            "payload_only": True,
            "older_than_seconds": 3600.0,
            "payloads_dropped": 1,
            "body_partitions_dropped": 0,
            "bodies_dropped_with_partitions": 0,
        }
    # A fresh process (nothing remembered in memory) and no Redis marks: Postgres alone decides.
    async with (
        open_runtime() as runtime,
        serving(runtime) as url,
        http.post(url, data=orjson.dumps(body)) as resp,
    ):
        answer = await resp.json()
    assert answer["reason"] == "duplicate"
    assert recorder.total == 1
    row = await db.fetchrow(f"SELECT payload, dedup_key FROM {TABLE}")
    assert row["payload"] is None
    assert row["dedup_key"] == parse_envelope(body).dedup_key


async def test_inspect_shows_one_event_by_id_key_or_prefix_without_its_apikey(
    open_runtime: OpenRuntime, db: asyncpg.Connection, settings: Settings, http: aiohttp.ClientSession
) -> None:
    """With KEEP_APIKEY on (the apikey is stored), inspect still hides it unless asked."""
    item = fixture("send_message_text_via_api")
    key = parse_envelope(item["webhook_body"]).dedup_key
    settings = settings.model_copy(update={"keep_apikey": True})
    async with (
        open_runtime(keep_apikey=True) as runtime,
        serving(runtime) as url,
        http.post(url, data=orjson.dumps(item["webhook_body"])) as resp,
    ):
        assert resp.status == 200
    row_id = await db.fetchval(f"SELECT id FROM {TABLE}")
    env = env_for(settings)
    by_key = await cli_json(env, "inspect", key)
    by_id = await cli_json(env, "inspect", str(row_id))
    by_prefix = await cli_json(env, "inspect", key[:10])
    assert by_key == by_id == by_prefix
    assert by_key["state"] == "processed"
    assert by_key["channels"]["first"] == "WEBHOOK"
    assert by_key["payload"]["apikey"] == "[redacted]"
    assert by_key["payload"]["data"] == item["webhook_body"]["data"]
    shown = await cli_json(env, "inspect", key, "--show-apikey")
    assert shown["payload"]["apikey"] == item["webhook_body"]["apikey"]
    human = await cli(env, "inspect", key)
    assert human.returncode == 0
    assert key in human.stdout
    assert item["webhook_body"]["apikey"] not in human.stdout
    missing = await cli(env, "inspect", "f" * 64)
    assert missing.returncode == 1
    assert "no event matches" in missing.stderr


async def test_check_passes_with_a_running_service_and_fails_without_rabbitmq(
    open_runtime: OpenRuntime, settings: Settings
) -> None:
    async with open_runtime() as runtime, running_service(runtime):
        checked = await cli(env_for(settings), "check", "--json")
        results = orjson.loads(checked.stdout)
        states = {r["check"]: r["state"] for r in results}
        plain = await cli(env_for(settings), "check")
    assert checked.returncode == 0, results
    assert states["postgres"] == states["migrations"] == states["redis"] == states["rabbitmq"] == "ok"
    assert states["evolution queues"] == "ok"
    assert states["service queues"] == "ok"
    assert states["internal secret"] == "ok"
    assert states["webhook auth"] == "warn"
    assert plain.returncode == 0
    broken = await cli(
        env_for(settings, RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:{dead_port()}/"), "check"
    )
    assert broken.returncode == 1
    assert "rabbitmq" in broken.stdout


@pytest.mark.parametrize("as_json", [True, False])
async def test_reconcile_once_prints_what_it_did(
    as_json: bool, open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection, settings: Settings
) -> None:
    async with open_runtime() as runtime, serving(runtime) as url:
        await stuck_events(runtime, db, fixtures()[:2])
        env = env_for(settings, FORWARD_URL=url, RECONCILE_AFTER_SECONDS="60")
        if as_json:
            report = await cli_json(env, "reconcile", "--once")
            assert report["leader"] is True
            assert report["found"] == 2
            assert report["recovered"] == 2
        else:
            result = await cli(env, "reconcile", "--once")
            assert result.returncode == 0, result.stderr
            assert "found 2" in result.stdout
            assert "recovered 2" in result.stdout
    assert recorder.total == 2


async def test_purge_on_a_database_without_the_inbox_names_what_to_do(settings: Settings) -> None:
    env = {
        **env_for(settings),
        "EVOLUTION_INGEST_DATABASE_SCHEMA": f"never_migrated_{settings.database_schema}",
    }
    result = await cli(env, "purge", "--older-than", "2d", "--json")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "evolution-ingest migrate" in result.stderr
    assert "EVOLUTION_INGEST_DATABASE_SCHEMA" in result.stderr


async def test_purge_drops_a_partition_of_old_bodies_whole_and_keeps_an_unprocessed_body(
    open_runtime: OpenRuntime, db: asyncpg.Connection, settings: Settings, http: aiohttp.ClientSession
) -> None:
    await _processed_and_stuck(open_runtime, db, http, fixtures()[:3])
    day = 86_400
    start = (int(time.time()) // day - 3) * day
    old = Partition(start, start + day)
    await db.execute(
        f'CREATE TABLE "{old.name}" PARTITION OF {BODIES} FOR VALUES FROM '
        f"('{old.bound(old.start)}') TO ('{old.bound(old.end)}')"
    )
    # Three days old, bodies included (they move into the old partition with their key).
    at = "to_timestamp($1)"
    await db.execute(f"UPDATE {BODIES} SET received_at = {at}", start + 3600)
    await db.execute(f"UPDATE {TABLE} SET received_at = {at}", start + 3600)
    await db.execute(f"UPDATE {TABLE} SET processed_at = {at} WHERE processed_at IS NOT NULL", start + 3600)
    assert await db.fetchval(f'SELECT count(*) FROM "{old.name}"') == 3
    await db.execute(f'ANALYZE "{old.name}"')

    done = await cli_json(env_for(settings), "purge", "--older-than", "2d")
    assert done["body_partitions_dropped"] == 1
    assert done["bodies_dropped_with_partitions"] == 3
    assert done["rows_deleted"] == 2
    assert await db.fetchval("SELECT to_regclass($1)", old.name) is None
    left = await db.fetch(f"SELECT payload FROM {VIEW}")
    assert len(left) == 1
    assert left[0]["payload"] is not None, "the unprocessed event lost its body"
