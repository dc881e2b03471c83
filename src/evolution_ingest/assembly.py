"""How a process is put together: its runtime, the forwarder its core uses, and its components
(webhook app, worker, reconciler, gap watcher) running under one signal handler."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
import click
import structlog

from evolution_ingest.channels.forward import HttpForwarder
from evolution_ingest.channels.http import create_app
from evolution_ingest.channels.reconciler import Reconciler
from evolution_ingest.channels.topology import declare
from evolution_ingest.channels.worker import Worker
from evolution_ingest.commandline import require_secret
from evolution_ingest.config import ForwardMode, Settings
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.lifecycle import Component, run_components, webhook_component
from evolution_ingest.operate.dashboard import Operator
from evolution_ingest.operate.gaps import GapWatcher
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores import run_migrations
from evolution_ingest.stores.postgres import CONNECTION_ERRORS
from evolution_ingest.stores.queues import BROKER_ERRORS, Topology

log = structlog.get_logger(__name__)


async def apply_migrations(settings: Settings) -> None:
    try:
        applied = await run_migrations(settings)
    except CONNECTION_ERRORS as exc:
        raise click.ClickException(f"cannot reach Postgres at EVOLUTION_INGEST_DATABASE_URL: {exc}") from None
    if applied:
        for migration in applied:
            log.info("migration applied", version=migration.version, name=migration.name)
    else:
        log.info("schema is up to date", schema=settings.database_schema)


async def declare_topology(settings: Settings) -> Topology:
    topology = Topology(settings)
    try:
        connection = await aio_pika.connect(settings.rabbitmq_url, timeout=10)
    except BROKER_ERRORS as exc:
        raise click.ClickException(f"cannot reach RabbitMQ at EVOLUTION_INGEST_RABBITMQ_URL: {exc}") from None
    async with connection:
        await declare(await connection.channel(), topology)
    return topology


@asynccontextmanager
async def forwarding(runtime: Runtime, *, webhook_here: bool) -> AsyncIterator[None]:
    """Give the runtime's core its way to the business logic: a direct call when this process
    serves the webhook app (and the mode allows), else a forward over HTTP."""
    settings = runtime.settings
    if webhook_here and settings.forward_mode is ForwardMode.AUTO:
        log.info("forwards run in-process (the webhook app is in this process)")
        runtime.ingestion.forward_with(None)
        yield
        return
    forwarder = HttpForwarder(
        settings.webhook_forward_url,
        require_secret(settings),
        timeout=settings.forward_timeout_seconds,
        concurrency=max(settings.worker_concurrency, settings.reconcile_concurrency),
    )
    runtime.ingestion.forward_with(forwarder)
    try:
        yield
    finally:
        await forwarder.close()


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for a long-running service.

    Objects made at start-up (modules, settings, pools) are frozen out of every later
    collection, and young collections run every 20,000 allocations instead of 700, so
    fewer collector pauses land on requests. Memory stays flat (the benchmark's soak
    checks it).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


async def run_service(settings: Settings, *, webhook: bool, worker: bool, reconciler: bool) -> int:
    tune_gc()
    async with Runtime.open(settings) as runtime:
        components: dict[str, Component] = {}
        if webhook:
            operator = Operator(runtime.stores, settings)
            app = create_app(runtime.ingestion, settings, runtime.refusals, operator.endpoints())
            components["webhook"] = webhook_component(app, settings)
            log.info("webhook app starting", host=settings.host, port=settings.port)
        if not (worker or reconciler):
            return await run_components(components)
        async with forwarding(runtime, webhook_here=webhook):
            if worker:
                components["worker"] = Worker(
                    ingestion=runtime.ingestion, settings=settings, refusals=runtime.refusals
                ).run
            if reconciler:
                components["reconciler"] = Reconciler(
                    ingestion=runtime.ingestion, reads=runtime.stores.reads, settings=settings
                ).run
                components["gap-watcher"] = GapWatcher(
                    runtime.counters, runtime.redis, settings, runtime.routes
                ).run
            return await run_components(components)


class Wiring:
    """What the operator commands open (see :class:`evolution_ingest.operate.commands.Wiring`)."""

    @asynccontextmanager
    async def runtime(self, settings: Settings, *, forwards: bool = False) -> AsyncIterator[Runtime]:
        """Resources for operator commands: no business logic, no routes; forwards over HTTP when asked."""
        async with Runtime.open(settings, pipeline=HandlerPipeline(()), with_routes=False) as runtime:
            if not forwards:
                yield runtime
                return
            async with forwarding(runtime, webhook_here=False):
                yield runtime
