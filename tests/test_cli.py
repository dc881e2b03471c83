"""The console script, run as an operator would: real processes, real signals."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from pydantic import SecretStr
from redis.asyncio import Redis

from evolution_ingest.config import Settings
from evolution_ingest.stores.queues import Topology
from tests.conftest import DATABASE_URL, RABBITMQ_URL, REDIS_URL
from tests.support import dead_port, fixture, free_socket, wait_until
from tests.support.evolution import EvolutionPublisher, broker, consumer_count, depth, remove


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a service process with exactly these settings (plus ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVOLUTION_INGEST_")}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"EVOLUTION_INGEST_{name.upper()}"] = _env_value(value)
    env["EVOLUTION_INGEST_LOG_FORMAT"] = "json"
    env.update({f"EVOLUTION_INGEST_{k}": v for k, v in extra.items()})
    return env


def _env_value(value: Any) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, list):
        return ",".join(_env_value(item) for item in value)
    return str(value)


def run_cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evolution_ingest", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@asynccontextmanager
async def running(env: dict[str, str], *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "evolution_ingest", *args, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def healthy(http: aiohttp.ClientSession, port: int) -> bool:
    try:
        async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


@asynccontextmanager
async def _removing_topology(settings: Settings) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await remove(RABBITMQ_URL, Topology(settings))


def test_help_lists_the_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "evolution_ingest", "--help"], capture_output=True, text=True, check=True
    )
    listed = re.findall(r"^  ([a-z]+)  ", result.stdout, flags=re.MULTILINE)  # click's "Commands:" rows
    assert {"migrate", "serve", "worker", "topology", "up", "reconcile", "status", "check"} <= set(listed)


def test_the_worker_refuses_to_start_without_the_internal_secret(
    make_settings: Callable[..., Settings],
) -> None:
    env = env_for(make_settings())
    del env["EVOLUTION_INGEST_INTERNAL_SECRET"]
    result = run_cli(env, "worker")
    assert result.returncode == 1
    assert "EVOLUTION_INGEST_INTERNAL_SECRET: required to forward events" in result.stderr
    assert "Traceback" not in result.stderr


async def test_topology_declares_what_evolution_declares_and_twice_is_harmless(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    env = env_for(settings)
    async with _removing_topology(settings):
        first = run_cli(env, "topology")
        second = run_cli(env, "topology")
        assert first.returncode == 0, first.stderr
        assert second.returncode == 0, second.stderr
        assert (
            f"consume {settings.rabbitmq_prefix}.messages.upsert  <- {settings.rabbitmq_exchange} [messages.upsert]"
            in first.stdout
        )
        assert "retry tier 1:" in first.stdout
        assert "parking:" in first.stdout
        # Evolution declaring its side afterwards does not clash (no PRECONDITION_FAILED).
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publisher.publish_global(fixture("call_offer")["rabbitmq_body"], "call")
            assert await depth(channel, f"{settings.rabbitmq_prefix}.call") == 1
            tier = Topology(settings).tiers[0].queue
            assert await depth(channel, tier) == 0


async def test_up_processes_an_event_published_to_rabbitmq(
    settings: Settings, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = env_for(settings, PORT=str(port))
    del env["EVOLUTION_INGEST_INTERNAL_SECRET"]  # up makes its own for the run
    item = fixture("connection_update_open")
    async with running(env, "up") as proc, _removing_topology(settings):
        await wait_until(lambda: healthy(http, port), within=30, message="up to answer")
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)

            async def consumed() -> bool:
                return (
                    await consumer_count(RABBITMQ_URL, f"{settings.rabbitmq_prefix}.connection.update") == 1
                )

            await wait_until(consumed, within=30, message="the worker to consume")
            await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])

        async def processed() -> bool:
            return (
                await db.fetchval(
                    "SELECT count(*) FROM evolution_ingestion_events WHERE processed_at IS NOT NULL"
                )
                == 1
            )

        await wait_until(processed, within=30, message="the event processed")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    row = await db.fetchrow("SELECT channel, rabbitmq_seen_at FROM evolution_ingestion_events")
    assert row["channel"] == "RABBITMQ"


def test_migrate_creates_the_schema_and_a_second_run_changes_nothing(
    make_settings: Callable[..., Settings], uid: str
) -> None:
    env = env_for(make_settings())
    try:
        first = run_cli(env, "migrate")
        second = run_cli(env, "migrate")
        assert first.returncode == 0, first.stderr
        assert second.returncode == 0, second.stderr
        assert '"migration applied"' in first.stderr
        assert '"schema is up to date"' in second.stderr

        async def columns() -> set[str]:
            conn = await asyncpg.connect(DATABASE_URL)
            try:
                rows = await conn.fetch(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
                    f"test_{uid}",
                    "evolution_ingestion_events",
                )
            finally:
                await conn.close()
            return {row["column_name"] for row in rows}

        assert {
            "id", "dedup_key", "event", "instance", "channel", "payload", "received_at", "processed_at",
            "attempts", "last_error", "webhook_seen_at", "rabbitmq_seen_at",
        } <= asyncio.run(columns())  # fmt: skip
    finally:

        async def drop() -> None:
            conn = await asyncpg.connect(DATABASE_URL)
            await conn.execute(f'DROP SCHEMA IF EXISTS "test_{uid}" CASCADE')
            await conn.close()

        asyncio.run(drop())


def test_a_wrong_setting_stops_start_up_with_its_name_and_no_traceback(
    make_settings: Callable[..., Settings],
) -> None:
    result = run_cli(env_for(make_settings(), PORT="eighty"), "serve")
    assert result.returncode == 1
    assert "EVOLUTION_INGEST_PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_migrate_without_postgres_says_which_setting_to_check(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(database_url=f"postgresql://postgres@127.0.0.1:{dead_port()}/test")
    result = run_cli(env_for(settings), "migrate")
    assert result.returncode == 1
    assert "cannot reach Postgres at EVOLUTION_INGEST_DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_handler_that_cannot_be_imported_stops_start_up(make_settings: Callable[..., Settings]) -> None:
    result = run_cli(env_for(make_settings(), HANDLERS="nowhere.module:handle"), "serve")
    assert result.returncode == 1
    assert "EVOLUTION_INGEST_HANDLERS: cannot import 'nowhere.module'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["serve", "up"])
async def test_the_service_answers_then_stops_cleanly_on_sigterm(
    command: str, settings: Settings, http: aiohttp.ClientSession
) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = env_for(settings, PORT=str(port), METRICS_FLUSH_SECONDS="30")
    body: dict[str, Any] = fixture("messages_upsert_text_incoming")["webhook_body"]
    async with running(env, command) as proc, _removing_topology(settings):
        await wait_until(lambda: healthy(http, port), within=30, message=f"{command} to answer")
        async with http.post(
            f"http://127.0.0.1:{port}/api/internal/webhook", data=orjson.dumps(body)
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "processed"
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
        assert proc.stderr is not None
        stderr = (await proc.stderr.read()).decode()
    assert code == 0, stderr
    assert "webhook app stopped" in stderr
    assert "TEST-INSTANCE-TOKEN-0000" not in stderr
    # The flush interval is longer than the run: the count reached Redis at shutdown.
    redis = Redis.from_url(REDIS_URL)
    try:
        assert await redis.get(settings.metrics_prefix + "webhook:processed") == b"1"
    finally:
        await redis.aclose()
