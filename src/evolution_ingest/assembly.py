"""How a process is put together: its runtime, the forwarder its core uses, and its components
(webhook app, worker, reconciler, gap watcher) running under one signal handler."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import aio_pika
import click
import structlog

from evolution_ingest.channels.backfill import Backfiller, InstanceReport
from evolution_ingest.channels.backfill_schedule import BackfillScheduler, api_for, senders
from evolution_ingest.channels.forward import FORWARD_BATCH_BYTES, HttpForwarder
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
from evolution_ingest.operate.instances import InstanceWatcher
from evolution_ingest.operate.loop_monitor import LoopMonitor
from evolution_ingest.operate.retention_job import RetentionJob
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores import run_migrations
from evolution_ingest.stores.evolution import EvolutionApi
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
        batch_max=settings.forward_batch_max,
        batch_bytes=min(FORWARD_BATCH_BYTES, settings.max_body_bytes),
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
        components: dict[str, Component] = {"loop-monitor": LoopMonitor(runtime.counters).run}
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
                components["instance-watcher"] = InstanceWatcher(
                    runtime.stores.connections, runtime.counters, runtime.redis, settings,
                    routes=runtime.routes, api=api_for(settings),
                ).run  # fmt: skip
                components["retention"] = RetentionJob(
                    runtime.stores.retention, runtime.counters, settings
                ).run
                if settings.evolution_url and settings.evolution_api_key and settings.backfill_enabled:
                    components["backfill"] = BackfillScheduler(
                        runtime.ingestion, runtime.stores, settings
                    ).run
            return await run_components(components)


class Wiring:
    """What the operator commands open (see :class:`evolution_ingest.operate.commands.Wiring`)."""

    @asynccontextmanager
    async def runtime(self, settings: Settings, *, forwards: bool = False) -> AsyncIterator[Runtime]:
        """Resources for operator commands: no business logic, no routes; forwards over HTTP when asked."""
        async with Runtime.open(
            settings, pipeline=HandlerPipeline(()), with_routes=False, observe_connections=False
        ) as runtime:
            if not forwards:
                yield runtime
                return
            async with forwarding(runtime, webhook_here=False):
                yield runtime


async def run_backfill(
    runtime: Runtime, settings: Settings, credentials: tuple[str, str], only: list[str],
    window: tuple[datetime, datetime], *, dry_run: bool, progress: Callable[[int], None],
) -> list[dict[str, Any]]:  # fmt: skip
    """``backfill``: each instance (or those named) over ``window``, a few at a time; a report each."""
    api = EvolutionApi(*credentials, timeout=settings.evolution_timeout_seconds)
    try:
        instances = await api.instances()
        names = [str(i["name"]) for i in instances if i.get("name")]
        backfiller = Backfiller(
            runtime.ingestion, runtime.stores.backfills, api, settings, sender=senders(instances)
        )
        limit = asyncio.Semaphore(settings.backfill_concurrency)

        async def one(name: str) -> dict[str, Any]:
            async with limit:
                report = await backfiller.backfill(
                    name, *window, "manual", dry_run=dry_run, progress=progress
                )
            return report.as_dict()

        reports = list(await asyncio.gather(*(one(n) for n in names if not only or n in only)))
    finally:
        await api.close()
    for name in sorted(set(only) - set(names)):
        reports.append({**InstanceReport(name).as_dict(), "error": f"Evolution has no instance {name!r}"})
    return reports
