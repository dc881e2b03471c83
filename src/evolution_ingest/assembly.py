"""How the command line puts the parts together: settings from the environment, the event loop,
the resources of a process and its components. The only place that reads the environment."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aio_pika
import click
import structlog
import uvloop

from evolution_ingest import logs
from evolution_ingest.channels.forward import Forwarder, HttpForwarder, InProcessForwarder
from evolution_ingest.channels.reconciler import Reconciler, Resender
from evolution_ingest.channels.topology import Topology, declare
from evolution_ingest.channels.webhook import create_app
from evolution_ingest.channels.worker import BROKER_ERRORS, Worker
from evolution_ingest.config import ConfigError, ForwardMode, Settings, unknown_variables
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.lifecycle import Component, run_components, webhook_component
from evolution_ingest.operate.dashboard import Operator
from evolution_ingest.operate.observe import GapWatcher
from evolution_ingest.runtime import Runtime, run_migrations
from evolution_ingest.stores.inbox import CONNECTION_ERRORS, StoreUnavailable

log = structlog.get_logger(__name__)
T = TypeVar("T")


def load_settings() -> Settings:
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    logs.configure(settings.log_level, settings.log_format)
    for variable in unknown_variables():
        log.warning("unknown setting ignored", variable=variable)
    return settings


def run_async(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(main())
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None


def require_secret(settings: Settings) -> str:
    if settings.internal_secret is None or not settings.internal_secret.get_secret_value():
        raise ConfigError(
            "EVOLUTION_INGEST_INTERNAL_SECRET: required to forward events to the webhook app "
            "(worker, reconciler, replay); set the same value for the webhook app"
        )
    return settings.internal_secret.get_secret_value()


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
async def forwarder(settings: Settings, runtime: Runtime | None = None) -> AsyncIterator[Forwarder]:
    """In-process when ``runtime`` also serves the webhook app (and the mode allows), else HTTP."""
    if runtime is not None and settings.forward_mode is ForwardMode.AUTO:
        log.info("forwards run in-process (the webhook app is in this process)")
        yield InProcessForwarder(runtime.ingestion)
        return
    forwarder = HttpForwarder(
        settings.webhook_forward_url,
        require_secret(settings),
        timeout=settings.forward_timeout_seconds,
        concurrency=max(settings.worker_concurrency, settings.reconcile_concurrency),
    )
    try:
        yield forwarder
    finally:
        await forwarder.close()


def build_reconciler(runtime: Runtime, sender: Forwarder) -> Reconciler:
    settings = runtime.settings
    resender = Resender(
        inbox=runtime.inbox,
        locks=runtime.locks,
        forwarder=sender,
        counters=runtime.counters,
        max_attempts=settings.reconcile_max_attempts,
    )
    return Reconciler(resender=resender, inbox=runtime.inbox, counters=runtime.counters, settings=settings)


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
            operator = Operator(runtime.inbox, runtime.counters, runtime.redis, settings, runtime.refusals)
            app = create_app(runtime.ingestion, settings, runtime.refusals, operator.routes())
            components["webhook"] = webhook_component(app, settings)
            log.info("webhook app starting", host=settings.host, port=settings.port)
        if not (worker or reconciler):
            return await run_components(components)
        async with forwarder(settings, runtime if webhook else None) as sender:
            if worker:
                components["worker"] = Worker(
                    ingestion=runtime.ingestion,
                    forwarder=sender,
                    settings=settings,
                    refusals=runtime.refusals,
                ).run
            if reconciler:
                components["reconciler"] = build_reconciler(runtime, sender).run
                components["gap-watcher"] = GapWatcher(runtime.counters, runtime.redis, settings).run
            return await run_components(components)


@asynccontextmanager
async def operator_runtime(settings: Settings) -> AsyncIterator[Runtime]:
    """Resources for operator commands: no business logic is loaded."""
    async with Runtime.open(settings, pipeline=HandlerPipeline(())) as runtime:
        yield runtime


def unavailable_is_an_error(
    step: Callable[[], Coroutine[Any, Any, T]],
) -> Callable[[], Coroutine[Any, Any, T]]:
    async def run() -> T:
        try:
            return await step()
        except StoreUnavailable as exc:
            raise click.ClickException(f"{exc} (check EVOLUTION_INGEST_DATABASE_URL)") from None

    return run
