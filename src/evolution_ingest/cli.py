"""The ``evolution-ingest`` command: the only place that reads the environment."""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aio_pika
import click
import structlog
import uvloop
from pydantic import SecretStr

from evolution_ingest import logs
from evolution_ingest.config import ConfigError, Settings, unknown_variables
from evolution_ingest.forward import HttpForwarder
from evolution_ingest.inbox import CONNECTION_ERRORS
from evolution_ingest.lifecycle import Component, run_components, webhook_component
from evolution_ingest.runtime import Runtime, run_migrations
from evolution_ingest.topology import Topology, declare
from evolution_ingest.webhook import create_app
from evolution_ingest.worker import BROKER_ERRORS, Worker

log = structlog.get_logger(__name__)
T = TypeVar("T")


def _settings() -> Settings:
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    logs.configure(settings.log_level, settings.log_format)
    for variable in unknown_variables():
        log.warning("unknown setting ignored", variable=variable)
    return settings


def _run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(main())
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None


def _require_secret(settings: Settings) -> str:
    if settings.internal_secret is None or not settings.internal_secret.get_secret_value():
        raise ConfigError(
            "EVOLUTION_INGEST_INTERNAL_SECRET: required by the worker to forward events to the webhook app "
            "(set the same value for both)"
        )
    return settings.internal_secret.get_secret_value()


async def _migrate(settings: Settings) -> None:
    try:
        applied = await run_migrations(settings)
    except CONNECTION_ERRORS as exc:
        raise click.ClickException(f"cannot reach Postgres at EVOLUTION_INGEST_DATABASE_URL: {exc}") from None
    if applied:
        for migration in applied:
            log.info("migration applied", version=migration.version, name=migration.name)
    else:
        log.info("schema is up to date", schema=settings.database_schema)


async def _declare_topology(settings: Settings) -> Topology:
    topology = Topology(settings)
    try:
        connection = await aio_pika.connect(settings.rabbitmq_url, timeout=10)
    except BROKER_ERRORS as exc:
        raise click.ClickException(f"cannot reach RabbitMQ at EVOLUTION_INGEST_RABBITMQ_URL: {exc}") from None
    async with connection:
        await declare(await connection.channel(), topology)
    return topology


@asynccontextmanager
async def _worker(runtime: Runtime) -> AsyncIterator[Component]:
    settings = runtime.settings
    forwarder = HttpForwarder(
        settings.webhook_forward_url,
        _require_secret(settings),
        timeout=settings.forward_timeout_seconds,
        concurrency=settings.worker_concurrency,
    )
    try:
        yield Worker(ingestion=runtime.ingestion, forwarder=forwarder, settings=settings).run
    finally:
        await forwarder.close()


async def _run_service(settings: Settings, *, webhook: bool, worker: bool) -> int:
    async with Runtime.open(settings) as runtime:
        components: dict[str, Component] = {}
        if webhook:
            components["webhook"] = webhook_component(create_app(runtime.ingestion, settings), settings)
            log.info("webhook app starting", host=settings.host, port=settings.port)
        if not worker:
            return await run_components(components)
        async with _worker(runtime) as consume:
            components["worker"] = consume
            return await run_components(components)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="evolution-ingest")
def main() -> None:
    """Receive Evolution API events by webhook and RabbitMQ; run business logic once each.

    Settings come from EVOLUTION_INGEST_* environment variables (and a .env file).
    """


@main.command()
def migrate() -> None:
    """Create or upgrade the inbox schema (idempotent)."""
    settings = _settings()
    _run(lambda: _migrate(settings))


@main.command()
def topology() -> None:
    """Declare the RabbitMQ exchanges and queues (idempotent) and list them."""
    settings = _settings()
    declared = _run(lambda: _declare_topology(settings))
    click.echo(f"mode: {declared.mode.value}")
    for binding in declared.sources:
        click.echo(f"  consume {binding.queue}  <- {binding.exchange} [{binding.routing_key}]")
    for tier_number, tier in enumerate(declared.tiers, start=1):
        click.echo(
            f"  retry tier {tier_number}: {tier.queue} (after {tier.delay_seconds:g}s) -> {declared.ready}"
        )
    click.echo(
        f"  lock busy: {declared.busy.queue} (after {declared.busy.delay_seconds:g}s) -> {declared.ready}"
    )
    click.echo(f"  parking: {declared.parking}")


@main.command()
@click.option(
    "--migrate/--no-migrate",
    "do_migrate",
    default=None,
    help="Apply migrations first (default: EVOLUTION_INGEST_MIGRATE_ON_START).",
)
def serve(do_migrate: bool | None) -> None:
    """Run the webhook app."""
    settings = _settings()

    async def run() -> int:
        if settings.migrate_on_start if do_migrate is None else do_migrate:
            await _migrate(settings)
        return await _run_service(settings, webhook=True, worker=False)

    sys.exit(_run(run))


@main.command()
def worker() -> None:
    """Run the RabbitMQ worker (declares the topology on every connection)."""
    settings = _settings()
    try:
        _require_secret(settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(_run(lambda: _run_service(settings, webhook=False, worker=True)))


@main.command()
def up() -> None:
    """Migrate, then run the webhook app and the worker until SIGTERM or Ctrl-C."""
    settings = _settings()
    if settings.internal_secret is None:
        # Both ends of the forward live in this process: a per-run secret is enough.
        settings = settings.model_copy(update={"internal_secret": SecretStr(secrets.token_urlsafe(32))})
        log.info("EVOLUTION_INGEST_INTERNAL_SECRET not set; using a random one for this run")

    async def run() -> int:
        await _migrate(settings)
        return await _run_service(settings, webhook=True, worker=True)

    sys.exit(_run(run))


if __name__ == "__main__":  # pragma: no cover
    main()
