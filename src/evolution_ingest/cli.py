"""The ``evolution-ingest`` command: the service commands (operator commands are in ``admin``)."""

from __future__ import annotations

import secrets
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import click
import structlog
from pydantic import SecretStr

from evolution_ingest.assembly import Wiring, apply_migrations, declare_topology, run_backfill, run_service
from evolution_ingest.channels.reconciler import Reconciler
from evolution_ingest.commandline import (
    evolution_api,
    load_settings,
    require_secret,
    run_async,
    unavailable_is_an_error,
)
from evolution_ingest.config import ConfigError
from evolution_ingest.operate import actions, console, panels
from evolution_ingest.operate import commands as admin
from evolution_ingest.stores.evolution import EvolutionError

log = structlog.get_logger(__name__)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="evolution-ingest")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Receive Evolution API events by webhook and RabbitMQ; run business logic once each.

    Settings come from EVOLUTION_INGEST_* environment variables (and a .env file).
    """
    ctx.obj = Wiring()


@main.command()
def migrate() -> None:
    """Create or upgrade the inbox schema (idempotent)."""
    settings = load_settings()
    run_async(lambda: apply_migrations(settings))


@main.command()
def topology() -> None:
    """Declare the RabbitMQ exchanges and queues (idempotent) and list them."""
    settings = load_settings()
    declared = run_async(lambda: declare_topology(settings))
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
    settings = load_settings()

    async def run() -> int:
        if settings.migrate_on_start if do_migrate is None else do_migrate:
            await apply_migrations(settings)
        return await run_service(settings, webhook=True, worker=False, reconciler=False)

    sys.exit(run_async(run))


@main.command()
def worker() -> None:
    """Run the RabbitMQ worker (declares the topology on every connection)."""
    settings = load_settings()
    try:
        require_secret(settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(run_async(lambda: run_service(settings, webhook=False, worker=True, reconciler=False)))


@main.command()
def up() -> None:
    """Migrate, then run the webhook app, the worker and the reconciler until SIGTERM or Ctrl-C."""
    settings = load_settings()
    if settings.internal_secret is None:
        # Both ends of the forward live in this process: a per-run secret is enough.
        settings = settings.model_copy(update={"internal_secret": SecretStr(secrets.token_urlsafe(32))})
        log.info("EVOLUTION_INGEST_INTERNAL_SECRET not set; using a random one for this run")

    async def run() -> int:
        await apply_migrations(settings)
        return await run_service(settings, webhook=True, worker=True, reconciler=True)

    sys.exit(run_async(run))


@main.command()
@click.option("--once", is_flag=True, help="Run one pass, print what it did, and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the pass report as JSON.")
def reconcile(once: bool, as_json: bool) -> None:
    """Re-forward saved events that were never processed (one active reconciler at a time)."""
    settings = load_settings()

    async def one_pass() -> dict[str, Any]:
        async with Wiring().runtime(settings, forwards=True) as runtime:
            reconciler = Reconciler(
                ingestion=runtime.ingestion, reads=runtime.stores.reads, settings=settings
            )
            try:
                return (await reconciler.run_once()).as_dict()
            finally:
                await reconciler.leadership.release()

    if not once:
        sys.exit(run_async(lambda: run_service(settings, webhook=False, worker=False, reconciler=True)))
    report = run_async(unavailable_is_an_error(one_pass))
    if as_json:
        click.echo(actions.as_json(report))
    else:
        console.render_reconcile(report)


@main.command()
@click.option("--since", required=True, help="From this age back (6h, 2d) or ISO time.")
@click.option("--until", help="Up to this age back or ISO time (default: BACKFILL_SETTLE_SECONDS ago).")
@click.option(
    "--instance", "instances", multiple=True, help="Only this instance (repeatable); default: every one."
)
@click.option("--dry-run", is_flag=True, help="Count what would be ingested; ingest nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def backfill(since: str, until: str | None, instances: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """Ingest the messages Evolution stored that neither channel delivered (resumable; exit 1 on an error)."""
    settings = load_settings()
    try:
        start = admin.when(since) or datetime.now(UTC)
        end = admin.when(until) or datetime.now(UTC) - timedelta(seconds=settings.backfill_settle_seconds)
        api_settings = evolution_api(settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if start >= end:
        raise click.BadParameter(
            f"the window {start:%Y-%m-%d %H:%M:%S} .. {end:%Y-%m-%d %H:%M:%S} is empty", param_hint="--since"
        )

    async def run() -> list[dict[str, Any]]:
        async with Wiring().runtime(settings, forwards=not dry_run) as runtime:
            with console.progress_bar("stored messages read", None, enabled=not as_json) as advance:
                return await run_backfill(
                    runtime,
                    settings,
                    api_settings,
                    list(instances),
                    (start, end),
                    dry_run=dry_run,
                    progress=advance,
                )

    try:
        reports = run_async(unavailable_is_an_error(run))
    except EvolutionError as exc:
        raise click.ClickException(f"Evolution API at {api_settings[0]}: {exc.message}") from None
    if as_json:
        click.echo(actions.as_json({"dry_run": dry_run, "instances": reports}))
    else:
        panels.render_backfill(reports, dry_run=dry_run)
    sys.exit(1 if any(r["error"] for r in reports) else 0)


for command in admin.COMMANDS:
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
