"""Operator commands: ``status``, ``check``, ``inspect``, ``replay``, ``purge`` (and ``connect``).

Readable output for a person, ``--json`` for scripts. The data comes from ``views`` and
``checks`` (read-only) and ``actions`` (changes); the rendering from ``console``. What a
command opens comes from the console script (:class:`Wiring`), so that this layer never
reaches into a channel.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import asyncpg
import click

from evolution_ingest.commandline import load_settings, run_async, unavailable_is_an_error
from evolution_ingest.config import ConfigError, Settings
from evolution_ingest.logic.routes_file import RoutesFile, configured_routes
from evolution_ingest.operate import actions, checks, console, panels, views
from evolution_ingest.operate.connect_command import connect
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores.inbox_reads import Filters
from evolution_ingest.stores.refusals import ReplayFilters
from evolution_ingest.stores.retention import Retention


class Wiring(Protocol):
    """What the console script gives the operator commands (``click`` context object)."""

    def runtime(
        self, settings: Settings, *, forwards: bool = False
    ) -> AbstractAsyncContextManager[Runtime]: ...


def _routes(settings: Settings) -> RoutesFile | None:
    try:
        return configured_routes(settings)
    except ConfigError:  # `check` says what is wrong with it; `status` shows the rest
        return None


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def status(wiring: Wiring, as_json: bool) -> None:
    """Events per channel, pending / stuck / failed, retry tiers and parking, and the counters."""
    settings = load_settings()

    async def gather() -> dict[str, Any]:
        async with wiring.runtime(settings) as runtime:
            return await views.status(runtime.stores, settings, _routes(settings))

    report = run_async(gather)
    if as_json:
        click.echo(actions.as_json(report))
    else:
        console.render_status(report)
        panels.render_evolution(report)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.pass_obj
def check(wiring: Wiring, as_json: bool) -> None:
    """Can the service work here? Stores, migrations, queues and consumers, secrets. Exit 1 on a failure."""
    settings = load_settings()

    async def run_checks() -> list[dict[str, str]]:
        async with wiring.runtime(settings) as runtime:
            return await checks.check(runtime.stores, settings)

    results = run_async(run_checks)
    if as_json:
        click.echo(actions.as_json(results))
    else:
        console.render_check(results)
    sys.exit(1 if any(result["state"] == "fail" for result in results) else 0)


@click.command()
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the row as JSON.")
@click.option("--show-apikey", is_flag=True, help="Show the stored apikey (kept only with KEEP_APIKEY).")
@click.pass_obj
def inspect(wiring: Wiring, ref: str, as_json: bool, show_apikey: bool) -> None:
    """One event: its row, channels, attempts, last error and stored payload.

    REF: a row id, a dedup key (or 8+ hex characters of one), or refusal:<id> for a refused body.
    """
    settings = load_settings()

    async def find() -> dict[str, Any]:
        async with wiring.runtime(settings) as runtime:
            return await views.inspect(runtime.stores, ref, show_apikey=show_apikey)

    try:
        row = run_async(unavailable_is_an_error(find))
    except (LookupError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(actions.as_json(row))
    elif "refusal" in row:
        console.render_refusal(row["refusal"])
    else:
        console.render_row(row)


def when(value: str | None) -> datetime | None:
    """An ISO time (UTC if no zone), or an age back from now (``2h``)."""
    if value is None:
        return None
    try:
        return datetime.now(UTC) - timedelta(seconds=actions.parse_age(value))
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither an ISO time nor an age like 2h") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@click.command()
@click.option("--failed/--no-failed", default=True, help="Replay events marked failed in the inbox.")
@click.option("--parked/--no-parked", default=True, help="Replay messages in the parking queue.")
@click.option(
    "--refused", is_flag=True, help="Also re-submit refused bodies kept by the service (after a fix)."
)
@click.option(
    "--code",
    "codes",
    multiple=True,
    help="Refused bodies of this code only (malformed_json, too_large, unauthorized...); repeatable.",
)
@click.option(
    "--include-unauthorized",
    is_flag=True,
    help="Also bodies refused for missing or wrong credentials (skipped unless named: --code unauthorized).",
)
@click.option("--event", help="Only this event (messages.upsert or MESSAGES_UPSERT).")
@click.option("--instance", help="Only this instance.")
@click.option("--since", help="Only from this time (ISO) or age (2h): received, or parked, since.")
@click.option("--until", help="Only before this time (ISO) or age.")
@click.option("--limit", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--dry-run", is_flag=True, help="Show what would be replayed; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def replay(
    wiring: Wiring,
    *,
    failed: bool,
    parked: bool,
    refused: bool,
    codes: tuple[str, ...],
    include_unauthorized: bool,
    event: str | None,
    instance: str | None,
    since: str | None,
    until: str | None,
    limit: int,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Send failed events and parked messages (and, with --refused, refused bodies) back through processing."""
    settings = load_settings()
    filters = Filters(event, instance, when(since), when(until))
    report = actions.ReplayReport(dry_run=dry_run)

    async def run_replay() -> dict[str, Any]:
        async with wiring.runtime(settings, forwards=True) as runtime:
            if failed:
                events = await runtime.stores.reads.failed(filters, limit)
                with console.progress_bar("failed events", len(events), enabled=not as_json) as advance:
                    await actions.replay_failed(runtime.ingestion, events, report, advance)
            if parked:
                with console.progress_bar("parked messages", None, enabled=not as_json) as advance:
                    await actions.replay_parked(settings, filters, report, limit, advance)
            if refused:
                wanted = ReplayFilters(
                    codes=codes,
                    since=filters.since,
                    until=filters.until,
                    unauthorized=include_unauthorized,
                )
                found = await runtime.refusals.to_replay(wanted, limit)
                with console.progress_bar("refused bodies", len(found), enabled=not as_json) as advance:
                    await actions.replay_refused(
                        runtime.ingestion, runtime.refusals, settings=settings, found=found, report=report,
                        progress=advance,
                    )  # fmt: skip
        return report.as_dict()

    result = run_async(unavailable_is_an_error(run_replay))
    if as_json:
        click.echo(actions.as_json(result))
    else:
        console.render_replay(result)


async def _drop_old_partitions(retention: Retention, age: float, report: actions.PurgeReport) -> None:
    """Bodies in partitions wholly older than ``age`` go with their partition (as retention drops
    them: unprocessed events' bodies are kept in their row first), not one by one."""
    try:
        dropped = await retention.drop_partitions(time.time(), age)
    except asyncpg.LockNotAvailableError:
        click.echo("purge: a partition of bodies was busy; its bodies are removed one by one", err=True)
        return
    report.partitions = len(dropped)
    report.partition_bodies = sum(d.bodies for d in dropped)


@click.command()
@click.option(
    "--older-than", "older_than", required=True, help="Age of processed rows to remove: 90m, 36h, 7d, 2w."
)
@click.option(
    "--payload-only",
    is_flag=True,
    help="Drop the stored body but keep the key (late copies stay duplicates).",
)
@click.option("--force", is_flag=True, help="Allow an age below EVOLUTION_INGEST_PURGE_MIN_AGE_SECONDS.")
@click.option("--batch-size", type=click.IntRange(min=1, max=100_000), default=5_000, show_default=True)
@click.option("--dry-run", is_flag=True, help="Count what would be purged; change nothing.")
@click.option(
    "--unpaced",
    is_flag=True,
    help="Delete as fast as Postgres goes (a maintenance window). By default batches are paced "
    "as retention's are, so that the running service keeps its latency.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_obj
def purge(
    wiring: Wiring,
    *,
    older_than: str,
    payload_only: bool,
    force: bool,
    batch_size: int,
    dry_run: bool,
    unpaced: bool,
    as_json: bool,
) -> None:
    """Delete processed rows older than an age, in batches. Never an unprocessed row."""
    settings = load_settings()
    try:
        age = actions.parse_age(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from None
    # Dropping payloads keeps the keys, so late copies are still recognised: no minimum then.
    if age < settings.purge_min_age_seconds and not (force or payload_only):
        raise click.ClickException(
            f"--older-than {older_than} is shorter than the safe minimum of {settings.purge_min_age_seconds:g}s "
            "(EVOLUTION_INGEST_PURGE_MIN_AGE_SECONDS): a late webhook retry of a purged event would run again. "
            "Use --payload-only (keeps the keys), or --force."
        )
    report = actions.PurgeReport(dry_run=dry_run, payload_only=payload_only, older_than_seconds=age)

    async def run_purge() -> dict[str, Any]:
        async with wiring.runtime(settings) as runtime:
            retention = runtime.stores.retention
            if dry_run:
                report.rows = await retention.count(age, payload_only=payload_only)
            else:
                await _drop_old_partitions(retention, age, report)
                remove = retention.empty_bodies if payload_only else retention.delete_rows
                # The count (a scan of the inbox) is only for the progress bar.
                total = None if as_json else await retention.count(age, payload_only=payload_only)
                with console.progress_bar("purging", total, enabled=not as_json) as advance:
                    report.rows = await retention.walk(
                        lambda after: remove(after, age, batch_size),
                        until=time.time() - age,
                        progress=advance,
                        pause=0.0 if unpaced else settings.retention_batch_pause_seconds,
                    )
                if report.rows and not await retention.autovacuum_on():
                    # Nothing else would remove the deleted rows' versions and index entries, and
                    # without that their space is never reused (docs/operating.md).
                    with console.progress_bar("vacuuming (autovacuum is off)", None, enabled=not as_json):
                        await retention.vacuum()
        return report.as_dict()

    result = run_async(unavailable_is_an_error(run_purge))
    if as_json:
        click.echo(actions.as_json(result))
    else:
        console.render_purge(result, older_than)


COMMANDS = [status, check, inspect, replay, purge, connect]
