"""What every command does first: read the settings, set up the logs, run its coroutine on uvloop,
and turn a store that cannot be reached into a clear message (never a traceback)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import asyncpg
import click
import structlog
import uvloop

from evolution_ingest import logs
from evolution_ingest.config import ConfigError, Settings, unknown_variables
from evolution_ingest.stores.postgres import StoreUnavailable

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


def unavailable_is_an_error(
    step: Callable[[], Coroutine[Any, Any, T]],
) -> Callable[[], Coroutine[Any, Any, T]]:
    async def run() -> T:
        try:
            return await step()
        except StoreUnavailable as exc:
            raise click.ClickException(f"{exc} (check EVOLUTION_INGEST_DATABASE_URL)") from None
        except asyncpg.UndefinedTableError as exc:
            raise click.ClickException(
                f"the inbox is not set up in this database and schema ({exc}): run `evolution-ingest migrate` "
                "(or start the service), or check EVOLUTION_INGEST_DATABASE_URL and EVOLUTION_INGEST_DATABASE_SCHEMA"
            ) from None

    return run


def require_secret(settings: Settings) -> str:
    if settings.internal_secret is None or not settings.internal_secret.get_secret_value():
        raise ConfigError(
            "EVOLUTION_INGEST_INTERNAL_SECRET: required to forward events to the webhook app "
            "(worker, reconciler, replay); set the same value for the webhook app"
        )
    return settings.internal_secret.get_secret_value()


def evolution_api(settings: Settings) -> tuple[str, str]:
    """Evolution's URL and API key, or a ConfigError naming the setting that is missing."""
    if not settings.evolution_url:
        raise ConfigError(
            "EVOLUTION_INGEST_EVOLUTION_URL is not set: give Evolution API's base URL (http://evolution:8080)"
        )
    if settings.evolution_api_key is None or not settings.evolution_api_key.get_secret_value():
        raise ConfigError(
            "EVOLUTION_INGEST_EVOLUTION_API_KEY is not set: give Evolution's global API key "
            "(its AUTHENTICATION_API_KEY)"
        )
    return settings.evolution_url, settings.evolution_api_key.get_secret_value()
