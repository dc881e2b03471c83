"""The resources of one process (Postgres pool, Redis client, counters), opened and closed together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo

import asyncpg
import structlog
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from evolution_ingest.config import ENV_PREFIX, ConfigError, Settings
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.core.redaction import Redactor
from evolution_ingest.logic.router import Router
from evolution_ingest.logic.routes_file import load_routes
from evolution_ingest.stores import migrations
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import PostgresInbox, create_pool
from evolution_ingest.stores.locks import RedisLocks
from evolution_ingest.stores.refusals import RefusalLog

log = structlog.get_logger(__name__)

_CLOSE_TIMEOUT = 10.0


def redis_client(settings: Settings) -> Redis:
    """A client that fails fast: a slow or dead Redis must not hold requests up."""
    return Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_seconds,
        socket_connect_timeout=settings.redis_timeout_seconds,
        retry=Retry(NoBackoff(), 0),
    )


@dataclass(slots=True)
class Runtime:
    settings: Settings
    inbox: PostgresInbox
    redis: Redis
    locks: RedisLocks
    counters: Counters
    ingestion: Ingestion
    refusals: RefusalLog
    router: Router | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, settings: Settings, *, pipeline: HandlerPipeline | None = None
    ) -> AsyncIterator[Runtime]:
        """Open everything; on exit flush counters and close connections.

        With a routes file, the built-in router runs before ``pipeline`` (default: the
        configured handlers). A wrong routes file raises ``ConfigError`` before anything opens.
        """
        routes = load_routes(settings.routes_file) if settings.routes_file else None
        if routes is not None and not settings.keep_apikey:
            keeping = [r.name for r in routes.routes if any(d.include_apikey for d in r.forward)]
            if keeping:
                raise ConfigError(
                    f"{ENV_PREFIX}ROUTES_FILE: route(s) {', '.join(keeping)} set include_apikey, but the "
                    f"apikey is not kept: set {ENV_PREFIX}KEEP_APIKEY=true to store and forward it"
                )
        pipeline = pipeline or HandlerPipeline.from_specs(settings.handlers, default=routes is None)
        pool = await create_pool(
            settings.database_url,
            schema=settings.database_schema,
            size=settings.database_pool_size,
            command_timeout=settings.database_timeout_seconds,
            connect_timeout=settings.database_timeout_seconds,
            application_name=settings.database_application_name,
        )
        redis = redis_client(settings)
        counters = Counters(
            redis, prefix=settings.metrics_prefix, flush_interval=settings.metrics_flush_seconds
        )
        locks = RedisLocks(
            redis,
            prefix=settings.redis_key_prefix,
            lock_ttl=settings.lock_ttl_seconds,
            seen_ttl=settings.seen_ttl_seconds,
        )
        inbox = PostgresInbox(
            pool,
            acquire_timeout=settings.database_timeout_seconds,
            batch_concurrency=settings.database_batch_concurrency,
        )
        redactor = Redactor(secrets=settings.own_secrets, keep_apikey=settings.keep_apikey)
        refusals = RefusalLog(
            inbox, redactor, counters, max_bytes=settings.refusal_max_bytes, keep=settings.refusals_keep
        )
        router = None
        if routes is not None:
            router = Router(
                routes, inbox=inbox, redis=redis, counters=counters, key_prefix=settings.redis_key_prefix
            )
            pipeline = pipeline.before(router)
        ingestion = Ingestion(
            inbox=inbox,
            locks=locks,
            pipeline=pipeline,
            counters=counters,
            redactor=redactor,
            busy_wait_seconds=settings.lock_busy_wait_seconds,
            evolution_timezone=ZoneInfo(settings.evolution_timezone),
        )
        flusher = asyncio.create_task(counters.run(), name="counters-flush")
        try:
            yield cls(settings, inbox, redis, locks, counters, ingestion, refusals, router)
        finally:
            await ingestion.drain()
            log.info("group commit", events_per_statement=inbox.batch_sizes())
            if router is not None:
                await router.close()
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await counters.close()
            await redis.aclose()
            try:
                await asyncio.wait_for(pool.close(), _CLOSE_TIMEOUT)
            except TimeoutError:
                log.warning("Postgres connections still busy at shutdown; closing them")
                pool.terminate()


async def run_migrations(settings: Settings) -> list[migrations.Migration]:
    """Apply pending migrations with a dedicated connection."""
    conn = await asyncpg.connect(settings.database_url, timeout=settings.database_timeout_seconds)
    try:
        return await migrations.migrate(conn, settings.database_schema)
    finally:
        await conn.close()
