"""Rendering the sections about Evolution's side: each instance's connection, and backfill."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from evolution_ingest.operate.console import age, out, section_error, warn_if


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render_instances(section: dict[str, Any]) -> None:
    if section_error("Instances", section) or not section["instances"]:
        return
    table = Table(title="Instances (connection)", box=box.SIMPLE, title_justify="left")
    for column in ("instance", "state", "for", "last close", "uptime 24h", "uptime 7d", "alert"):
        table.add_column(column, justify="right" if column.startswith(("for", "uptime")) else "left")
    for item in section["instances"]:
        state = item["state"]
        shown = (
            f"[green]{state}[/]"
            if state == "open"
            else f"[red]{state}[/]"
            if state == "close"
            else f"[yellow]{state}[/]"
        )
        reason = item["last_close_reason"]
        close = "-" if item["last_close_at"] is None else f"{item['last_close_at'][:19]} ({reason})"
        if item["logged_out"]:
            close += " [red]logged out[/]"
        table.add_row(
            escape(item["instance"]), shown, age(item["for_seconds"]), close, _ratio(item["uptime"]["24h"]),
            _ratio(item["uptime"]["7d"]), f"[red]{item['alert']}[/]" if item["alert"] else "",
        )  # fmt: skip
    out().print(table)


def render_backfill_section(section: dict[str, Any]) -> None:
    if section_error("Backfill", section):
        return
    counters = section["counters"]
    mode = (
        "automatic"
        if section["automatic"]
        else "manual only (EVOLUTION_URL not set, or BACKFILL_ENABLED false)"
    )
    out().print(
        f"[bold]Backfill[/] ({mode}): {counters.get('records', 0)} stored message(s) read, "
        f"{counters.get('already_received', 0)} already received, {counters.get('received', 0)} ingested, "
        f"{counters.get('errors', 0)} error(s)"
    )
    for run in section["recent_runs"][:5]:
        state = "running" if run["finished_at"] is None else "done"
        error = f" [red]{escape(run['error'])}[/]" if run["error"] else ""
        out().print(
            f"  {run['started_at'][:19]} {escape(run['instance'])} ({run['reason']}, {state}): "
            f"{run['records']} read, {run['already']} already received, {run['ingested']} ingested{error}"
        )


def render_evolution(report: dict[str, Any]) -> None:
    render_instances(report["instances"])
    render_backfill_section(report["backfill"])


def render_backfill(reports: list[dict[str, Any]], *, dry_run: bool) -> None:
    table = Table(title="Backfill" + (" (dry run: nothing ingested)" if dry_run else ""), box=box.SIMPLE,
                  title_justify="left")  # fmt: skip
    columns = ("instance", "stored read", "already received", "would ingest" if dry_run else "ingested",
               "not processed yet", "skipped", "pages", "seconds", "error")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in {"instance", "error"} else "right")
    for r in reports:
        table.add_row(
            escape(r["instance"]), str(r["records"]), str(r["already"]), str(r["ingested"]), warn_if(r["failed"]),
            str(r["invalid"]), str(r["pages"]), f"{r['seconds']:.1f}", f"[red]{escape(r['error'])}[/]" if r["error"] else "",
        )  # fmt: skip
    out().print(table)
    if any(r["failed"] for r in reports):
        out().print("events not processed yet are saved: the reconciler runs them (or `replay`)")
