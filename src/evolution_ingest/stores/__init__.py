"""The stores: Postgres (the inbox, its read side, refusals, deliveries), Redis (locks, counters)
and RabbitMQ's queues. The only modules that write SQL. :class:`Stores` opens them together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from evolution_ingest.config import Settings
from evolution_ingest.core.redaction import Redactor
from evolution_ingest.stores import migrations
from evolution_ingest.stores.backfill_runs import BackfillRuns
from evolution_ingest.stores.connections import ConnectionLog
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.deliveries import DeliveryLog
from evolution_ingest.stores.inbox import PostgresInbox
from evolution_ingest.stores.inbox_reads import InboxReads
from evolution_ingest.stores.locks import RedisLocks
from evolution_ingest.stores.postgres import Leadership, Postgres, create_pool
from evolution_ingest.stores.queues import QueueReads
from evolution_ingest.stores.refusals import RefusalLog
from evolution_ingest.stores.retention import Retention, prepare_partitions

_CLOSE_TIMEOUT = 10.0


def redis_client(settings: Settings) -> Redis:
    """A client that fails fast: a slow or dead Redis must not hold requests up."""
    return Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_seconds,
        socket_connect_timeout=settings.redis_timeout_seconds,
        retry=Retry(NoBackoff(), 0),
    )


def leadership(settings: Settings, job: str = "reconciler", role: str = "reconciler") -> Leadership:
    """The advisory lock that makes one process of the replicas the active ``role`` for ``job``."""
    return Leadership(
        settings.database_url,
        key=f"evolution_ingest:{job}:{settings.database_schema}",
        timeout=settings.database_timeout_seconds,
        role=role,
    )


@dataclass(slots=True)
class Stores:
    """Every store of one process, sharing one Postgres pool and one Redis client (and, for
    what the operator reads of RabbitMQ, one connection, opened on the first read)."""

    db: Postgres
    redis: Redis
    counters: Counters
    locks: RedisLocks
    inbox: PostgresInbox
    reads: InboxReads
    refusals: RefusalLog
    deliveries: DeliveryLog
    connections: ConnectionLog
    backfills: BackfillRuns
    retention: Retention
    queues: QueueReads

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, settings: Settings, redactor: Redactor) -> AsyncIterator[Stores]:
        """Open everything (Postgres lazily: the app can start, and answer 503, while it is down);
        on exit, flush the counters and close the connections."""
        pool = await create_pool(
            settings.database_url,
            schema=settings.database_schema,
            size=settings.database_pool_size,
            command_timeout=settings.database_timeout_seconds,
            connect_timeout=settings.database_timeout_seconds,
            application_name=settings.database_application_name,
        )
        db = Postgres(pool, acquire_timeout=settings.database_timeout_seconds)
        redis = redis_client(settings)
        counters = Counters(
            redis, prefix=settings.metrics_prefix, flush_interval=settings.metrics_flush_seconds
        )
        stores = cls(
            db=db,
            redis=redis,
            counters=counters,
            locks=RedisLocks(
                redis,
                prefix=settings.redis_key_prefix,
                lock_ttl=settings.lock_ttl_seconds,
                seen_ttl=settings.seen_ttl_seconds,
            ),
            inbox=PostgresInbox(
                db,
                batch_concurrency=settings.database_batch_concurrency,
                strip_media=counters if settings.retention_strip_media else None,
            ),
            reads=InboxReads(db, schema=settings.database_schema),
            refusals=RefusalLog(
                db, redactor, counters, max_bytes=settings.refusal_max_bytes, keep=settings.refusals_keep
            ),
            deliveries=DeliveryLog(db),
            connections=ConnectionLog(db),
            backfills=BackfillRuns(db),
            retention=Retention(db),
            queues=QueueReads(settings),
        )
        flusher = asyncio.create_task(counters.run(), name="counters-flush")
        try:
            yield stores
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await counters.close()
            await stores.queues.close()
            await redis.aclose()
            await db.close(_CLOSE_TIMEOUT)


async def run_migrations(settings: Settings) -> list[migrations.Migration]:
    """Apply pending migrations with a dedicated connection, then make the coming partitions of
    bodies (so that the first saves find theirs; the retention leader keeps making them)."""
    conn = await asyncpg.connect(settings.database_url, timeout=settings.database_timeout_seconds)
    try:
        applied = await migrations.migrate(conn, settings.database_schema)
    finally:
        await conn.close()
    pool = await create_pool(
        settings.database_url,
        schema=settings.database_schema,
        size=1,
        command_timeout=settings.database_timeout_seconds,
        connect_timeout=settings.database_timeout_seconds,
    )
    db = Postgres(pool, acquire_timeout=settings.database_timeout_seconds)
    try:
        await prepare_partitions(Retention(db), settings)
    finally:
        await db.close(_CLOSE_TIMEOUT)
    return applied
