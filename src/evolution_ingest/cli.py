"""The ``evolution-ingest`` command: the only place that reads the environment."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click
import structlog
import uvicorn
import uvloop

from evolution_ingest import logs
from evolution_ingest.config import ConfigError, Settings, unknown_variables
from evolution_ingest.inbox import CONNECTION_ERRORS
from evolution_ingest.runtime import Runtime, run_migrations
from evolution_ingest.webhook import create_app

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


async def _serve(settings: Settings) -> None:
    async with Runtime.open(settings) as runtime:
        app = create_app(runtime.ingestion, settings)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=30,
        )
        server = uvicorn.Server(config)
        # Signals are ours: uvicorn would re-raise SIGTERM after its shutdown,
        # killing the process before counters are flushed and pools closed.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _stopper(server))
        log.info("webhook app listening", host=settings.host, port=settings.port)
        await server.serve()
    log.info("webhook app stopped")


def _stopper(server: uvicorn.Server) -> Callable[[], None]:
    def stop() -> None:
        # A second signal while stopping skips the graceful wait.
        server.force_exit = server.should_exit
        server.should_exit = True

    return stop


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
@click.option(
    "--migrate/--no-migrate",
    "do_migrate",
    default=None,
    help="Apply migrations first (default: EVOLUTION_INGEST_MIGRATE_ON_START).",
)
def serve(do_migrate: bool | None) -> None:
    """Run the webhook app."""
    settings = _settings()

    async def run() -> None:
        if settings.migrate_on_start if do_migrate is None else do_migrate:
            await _migrate(settings)
        await _serve(settings)

    _run(run)


@main.command()
def up() -> None:
    """Migrate, then run everything (for now: the webhook app) until SIGTERM or Ctrl-C."""
    settings = _settings()

    async def run() -> None:
        await _migrate(settings)
        await _serve(settings)

    _run(run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
