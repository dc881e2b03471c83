"""Fixtures for tests against the real Postgres, Redis (and RabbitMQ) of this machine.

Each test gets its own Postgres schema and its own Redis key prefixes, so tests
never see each other's rows, locks or counters, and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import hypothesis
import pytest
from redis.asyncio import Redis

from evolution_ingest import logs
from evolution_ingest.channels.forward import HttpForwarder
from evolution_ingest.channels.http import create_app
from evolution_ingest.channels.worker import Worker
from evolution_ingest.config import LogFormat, Settings
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.operate.dashboard import Operator
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores import run_migrations
from evolution_ingest.stores.postgres import init_connection
from evolution_ingest.stores.queues import Topology
from tests.support import Recorder, fixtures, running_server
from tests.support.evolution import remove, sweep_stale_queues
from tests.support.proxy import TcpProxy

DATABASE_URL = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
INTERNAL_SECRET = "test-internal-secret-" + uuid.uuid4().hex  # generated per run, never real


@pytest.fixture
def uid() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture
def make_settings(uid: str) -> Callable[..., Settings]:
    """Settings isolated to this test; keyword arguments override fields."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": DATABASE_URL,
            "database_schema": f"test_{uid}",
            "redis_url": REDIS_URL,
            "rabbitmq_url": RABBITMQ_URL,
            "internal_secret": INTERNAL_SECRET,
            "redis_key_prefix": f"test:{uid}:",
            "metrics_prefix": f"test:{uid}:metrics:",
            "metrics_flush_seconds": 0.2,
            "database_timeout_seconds": 2.0,
            "redis_timeout_seconds": 0.3,
            # RabbitMQ names of this test only; short delays.
            "rabbitmq_exchange": f"evo-{uid}",
            "rabbitmq_prefix": f"p{uid}",
            "rabbitmq_service_prefix": f"ei-{uid}",
            "rabbitmq_queue": f"ei-{uid}.events",
            "rabbitmq_events": sorted({item["event"] for item in fixtures()}),
            "retry_delays_seconds": [0.3, 0.6, 0.9],
            "lock_busy_delay_seconds": 0.2,
            "rabbitmq_watchdog_seconds": 1.0,
            "shutdown_timeout_seconds": 5.0,
            "forward_timeout_seconds": 5.0,
            "metrics_cache_seconds": 0.0,
            "ready_cache_seconds": 0.0,
        }
        values.update(overrides)
        return Settings(_env_file=None, **values)  # type: ignore[call-arg]  # a pydantic-settings argument, not a field

    return make


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """Settings a test module needs from the start (before migration); override it there."""
    return {}


@pytest.fixture
async def settings(
    make_settings: Callable[..., Settings], uid: str, settings_overrides: dict[str, Any]
) -> AsyncIterator[Settings]:
    """Migrated settings; the schema and Redis keys are removed after the test."""
    current = make_settings(**settings_overrides)
    await run_migrations(current)
    yield current
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "test_{uid}" CASCADE')
    finally:
        await conn.close()
    await remove_redis_keys(uid)


async def remove_redis_keys(uid: str) -> None:
    """Every Redis key of the test ``uid`` (locks, seen marks, counters)."""
    redis = Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in redis.scan_iter(match=f"test:{uid}:*", count=1000)]
        if keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()


@pytest.fixture
async def db(settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection to the test's schema, for assertions."""
    conn = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": settings.database_schema})
    await init_connection(conn)
    yield conn
    await conn.close()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


OpenRuntime = Callable[..., AbstractAsyncContextManager[Runtime]]


@pytest.fixture
def open_runtime(settings: Settings, recorder: Recorder) -> OpenRuntime:
    """``async with open_runtime(**overrides) as runtime`` — business logic is ``recorder``."""

    @asynccontextmanager
    async def open_(
        handler: Callable[..., Awaitable[None]] | None = None, **overrides: Any
    ) -> AsyncIterator[Runtime]:
        current = Settings.model_validate({**settings.model_dump(), **overrides}) if overrides else settings
        async with Runtime.open(current, pipeline=HandlerPipeline([handler or recorder])) as runtime:
            yield runtime

    return open_


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@asynccontextmanager
async def serving(runtime: Runtime) -> AsyncIterator[str]:
    """The webhook app of ``runtime`` on a real port; yields its webhook URL."""
    operator = Operator(runtime.stores, runtime.settings)
    async with running_server(
        create_app(runtime.ingestion, runtime.settings, runtime.refusals, operator.endpoints())
    ) as base:
        yield base + "/api/internal/webhook"


@pytest.fixture
async def webhook(open_runtime: OpenRuntime) -> AsyncIterator[tuple[Runtime, str]]:
    """A running webhook app with default test settings: ``(runtime, url)``."""
    async with open_runtime() as runtime, serving(runtime) as url:
        yield runtime, url


@pytest.fixture
async def proxy_factory() -> AsyncIterator[Callable[[str, int], Awaitable[TcpProxy]]]:
    proxies: list[TcpProxy] = []

    async def make(host: str, port: int) -> TcpProxy:
        proxy = await TcpProxy(host, port).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        await proxy.close()


@dataclass
class Service:
    """A webhook app and a worker sharing one runtime, as `up` runs them."""

    runtime: Runtime
    url: str
    worker: Worker
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def stop_worker(self, within: float = 20) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, within)


@asynccontextmanager
async def worker_for(
    runtime: Runtime, forward_url: str
) -> AsyncIterator[tuple[Worker, asyncio.Event, asyncio.Task[None]]]:
    settings = runtime.settings
    assert settings.internal_secret is not None
    forwarder = HttpForwarder(
        forward_url, settings.internal_secret.get_secret_value(), timeout=settings.forward_timeout_seconds
    )
    runtime.ingestion.forward_with(forwarder)  # as `worker` does: the webhook app is in another process
    worker = Worker(ingestion=runtime.ingestion, settings=settings, refusals=runtime.refusals)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.consuming.wait(), 20)
        yield worker, stop, task
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        finally:
            await forwarder.close()


@asynccontextmanager
async def running_service(runtime: Runtime, forward_url: str | None = None) -> AsyncIterator[Service]:
    """Webhook app on a real port plus a worker forwarding to it (or to ``forward_url``)."""
    try:
        async with serving(runtime) as url, worker_for(runtime, forward_url or url) as (worker, stop, task):
            yield Service(runtime, url, worker, stop, task)
    finally:
        await remove(RABBITMQ_URL, Topology(runtime.settings))


def pytest_sessionstart(session: pytest.Session) -> None:
    swept = asyncio.run(sweep_stale_queues(RABBITMQ_URL))
    if swept:
        print(f"\nswept {swept} idle queues left by an earlier, interrupted run")


def pytest_configure(config: pytest.Config) -> None:
    logs.configure("INFO", LogFormat.TEXT, cache=False)
    # CI replays the same examples every run (no flaky discoveries); locally they vary.
    hypothesis.settings.register_profile("ci", derandomize=True, deadline=None)
    hypothesis.settings.register_profile("dev", deadline=None)
    hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
