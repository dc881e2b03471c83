"""The resources of one process — its stores, the routes file, the ingestion core — opened and closed together."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo

import structlog
from redis.asyncio import Redis

from evolution_ingest.config import Settings
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.core.redaction import Redactor
from evolution_ingest.logic.connections import ConnectionObserver
from evolution_ingest.logic.router import Router
from evolution_ingest.logic.routes_file import RoutesFile, configured_routes
from evolution_ingest.stores import Stores
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import PostgresInbox
from evolution_ingest.stores.locks import RedisLocks
from evolution_ingest.stores.refusals import RefusalLog

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Runtime:
    settings: Settings
    stores: Stores
    ingestion: Ingestion
    routes: RoutesFile | None = None
    router: Router | None = None

    @property
    def inbox(self) -> PostgresInbox:
        return self.stores.inbox

    @property
    def redis(self) -> Redis:
        return self.stores.redis

    @property
    def locks(self) -> RedisLocks:
        return self.stores.locks

    @property
    def counters(self) -> Counters:
        return self.stores.counters

    @property
    def refusals(self) -> RefusalLog:
        return self.stores.refusals

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        settings: Settings,
        *,
        pipeline: HandlerPipeline | None = None,
        with_routes: bool = True,
        observe_connections: bool = True,
    ) -> AsyncIterator[Runtime]:
        """Open everything; on exit wait for work in flight, then close the stores.

        With a routes file (and ``with_routes``), the built-in router runs before ``pipeline``
        (default: the configured handlers). A wrong routes file raises ``ConfigError`` before
        anything opens. ``observe_connections``: keep each instance's connection state from its
        ``connection.update`` events first (:mod:`evolution_ingest.logic.connections`).
        """
        routes = configured_routes(settings) if with_routes else None
        pipeline = pipeline or HandlerPipeline.from_specs(settings.handlers, default=routes is None)
        redactor = Redactor(secrets=settings.own_secrets, keep_apikey=settings.keep_apikey)
        async with Stores.open(settings, redactor) as stores:
            router = None
            if routes is not None:
                router = Router(
                    routes,
                    deliveries=stores.deliveries,
                    redis=stores.redis,
                    counters=stores.counters,
                    key_prefix=settings.redis_key_prefix,
                )
                pipeline = pipeline.before(router)
            if observe_connections:
                pipeline = pipeline.before(
                    ConnectionObserver(stores.connections, ZoneInfo(settings.evolution_timezone))
                )
            ingestion = Ingestion(
                inbox=stores.inbox,
                locks=stores.locks,
                pipeline=pipeline,
                counters=stores.counters,
                redactor=redactor,
                max_attempts=settings.reconcile_max_attempts,
                busy_wait_seconds=settings.lock_busy_wait_seconds,
                evolution_timezone=ZoneInfo(settings.evolution_timezone),
                legacy_compat_seconds=settings.identity_v1_compat_seconds,
            )
            try:
                yield cls(settings, stores, ingestion, routes, router)
            finally:
                await ingestion.drain()
                if sizes := stores.inbox.batch_sizes():  # nothing to say after a command that wrote nothing
                    log.info("group commit", events_per_statement=sizes)
                if router is not None:
                    await router.close()
