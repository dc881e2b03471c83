"""``evolution-ingest connect``: the command, and how its report reads (see :mod:`.connect`)."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
from rich import box
from rich.markup import escape
from rich.table import Table

from evolution_ingest.commandline import evolution_api, load_settings, run_async
from evolution_ingest.config import ConfigError, Settings
from evolution_ingest.core import codec
from evolution_ingest.operate import actions, console
from evolution_ingest.operate.connect import (
    WEBHOOK_MODES,
    Connector,
    ConnectReport,
    InstancePlan,
    Setting,
    report_data,
)
from evolution_ingest.stores import redis_client
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.evolution import EvolutionApi, EvolutionError

_WILDCARDS = {"0.0.0.0", "::", ""}  # noqa: S104 - names, not a bind


def _api(settings: Settings) -> tuple[str, str]:
    """Evolution's URL and key, or a message naming the setting that is missing."""
    try:
        found = evolution_api(settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if settings.webhook_public_url is None and settings.host in _WILDCARDS:
        raise click.ClickException(
            f"EVOLUTION_INGEST_WEBHOOK_PUBLIC_URL is not set, and HOST {settings.host!r} is no address Evolution "
            "can call: give the URL Evolution reaches this service at (http://ingest:8080)"
        )
    return found


async def _wait(connector: Connector, report: ConnectReport, settings: Settings, *, since: float, within: float, shown: bool) -> None:  # fmt: skip
    redis = redis_client(settings)
    counters = Counters(redis, prefix=settings.metrics_prefix)
    waiting = sum(1 for plan in report.instances if plan.state == "open")
    try:
        with console.progress_bar(
            "instances delivering on both channels (send each a message)", waiting, enabled=shown
        ) as advance:
            done = [0]

            def progress(now_done: int, _total: int) -> None:
                advance(now_done - done[0])
                done[0] = now_done

            await connector.wait(report, counters, since=since, within=within, progress=progress)
    finally:
        await redis.aclose()


@click.command()
@click.option(
    "--instance", "instances", multiple=True, help="Only this instance (repeatable); default: every one."
)
@click.option(
    "--webhook",
    "webhook_mode",
    type=click.Choice(WEBHOOK_MODES),
    default="instance",
    show_default=True,
    help="instance: set each instance's webhook; global: Evolution's global webhook delivers "
    "(printed as environment lines; instance webhooks pointing here are turned off).",
)
@click.option("--dry-run", is_flag=True, help="Show what would change, per instance; change nothing.")
@click.option("--wait-seconds", type=click.FloatRange(min=0), help="How long to wait for deliveries (default: CONNECT_WAIT_SECONDS; 0: do not wait).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def connect(
    instances: tuple[str, ...], webhook_mode: str, dry_run: bool, wait_seconds: float | None, as_json: bool
) -> None:
    """Set each Evolution instance's webhook and RabbitMQ events to match this service, then wait
    until each connected instance delivers on both channels. Idempotent. Exit 1 if a setting failed
    or a channel stayed silent."""
    settings = load_settings()
    url, key = _api(settings)
    within = settings.connect_wait_seconds if wait_seconds is None else wait_seconds

    async def run() -> ConnectReport:
        api = EvolutionApi(url, key, timeout=settings.evolution_timeout_seconds)
        connector = Connector(api, settings, webhook_mode=webhook_mode)
        try:
            since = time.time()
            report = await connector.plan(list(instances) or None)
            if not dry_run:
                await connector.apply(report)
                if within > 0 and not report.failed:
                    await _wait(connector, report, settings, since=since, within=within, shown=not as_json)
            return report
        except EvolutionError as exc:
            raise click.ClickException(f"Evolution API at {api.url}: {exc.message}") from None
        finally:
            await api.close()

    report = run_async(run)
    if as_json:
        click.echo(actions.as_json(report_data(report)))
    else:
        render(report, dry_run=dry_run)
    silent = report.waited_seconds is not None and any(
        not all(plan.delivered.values()) for plan in report.instances if plan.state == "open"
    )
    sys.exit(1 if report.failed or silent else 0)


def _changes(setting: Setting) -> str:
    if not setting.changes:
        return setting.action
    listed = "; ".join(f"{c.field}: {_short(c.current)} -> {_short(c.desired)}" for c in setting.changes)
    return f"{setting.action}: {listed}"


def _short(value: Any) -> str:
    text = codec.dumps(value).decode() if isinstance(value, dict | list) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _delivered(report: ConnectReport, plan: InstancePlan) -> str:
    if report.waited_seconds is None:
        return "-"
    if plan.state != "open":
        return "not connected"
    return ", ".join(
        f"{channel} {'[green]yes[/]' if seen else '[red]silent[/]'}"
        for channel, seen in plan.delivered.items()
    )


def render(report: ConnectReport, *, dry_run: bool) -> None:
    out = console.out()
    table = Table(title="Evolution instances" + (" (dry run: nothing changed)" if dry_run else ""),
                  box=box.SIMPLE, title_justify="left")  # fmt: skip
    for column in ("instance", "state", "webhook", "rabbitmq", "delivered"):
        table.add_column(column)
    for plan in report.instances:
        table.add_row(
            escape(plan.name),
            str(plan.state),
            escape(_changes(plan.webhook)),
            escape(_changes(plan.rabbitmq)),
            _delivered(report, plan),
        )
    out.print(table)
    for name in report.missing:
        out.print(f"[red]error[/]: Evolution has no instance {name!r} (see `GET /instance/fetchInstances`)")
    if not report.instances and not report.missing:
        out.print("no instance to connect")
    if report.environment:
        out.print("[bold]Evolution's environment[/] (REST cannot set these; add them and restart Evolution):")
        for line in report.environment:
            out.print(f"  {line}", markup=False)
    for note in report.notes:
        out.print(f"[yellow]note[/]: {escape(note)}")
    if report.waited_seconds is not None:
        _render_wait(report)


def _render_wait(report: ConnectReport) -> None:
    out = console.out()
    out.print(f"waited {report.waited_seconds:g}s for deliveries")
    for plan in report.instances:
        silent = [channel for channel, seen in plan.delivered.items() if not seen]
        if plan.state == "open" and silent:
            out.print(
                f"[red]silent[/]: {escape(plan.name)} delivered nothing by {' or '.join(silent)}: is the service "
                "running and reachable from Evolution at EVOLUTION_INGEST_WEBHOOK_PUBLIC_URL, and Evolution's "
                "environment set as above? Send the instance a message, then `evolution-ingest connect` again "
                "(or `check`)"
            )
