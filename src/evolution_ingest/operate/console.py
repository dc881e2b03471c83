"""Rendering operator reports for a person (``--json`` prints the same data as JSON instead)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.syntax import Syntax
from rich.table import Table

from evolution_ingest.operate.actions import as_json


@functools.cache
def out() -> Console:
    """Made on first use (not at import): wide when piped, so that keys and errors stay on one line."""
    return Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)


_STATE_MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
_CHANNEL_COLUMNS = ("received", "processed", "skipped_duplicate", "skipped_locked", "failed")


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def section_error(title: str, section: dict[str, Any]) -> bool:
    if section.get("ok"):
        return False
    out().print(f"[bold]{title}[/]: [red]unavailable[/] ({escape(str(section.get('error')))})")
    return True


def megabytes(value: int | None) -> str:
    return "—" if value is None else f"{value / 1_048_576:,.1f} MB"


def retention_line(retention: dict[str, Any], size: dict[str, Any]) -> str:
    """``retention: bodies 7d, rows (the dedup horizon) 30d · rows 12.0 MB, bodies 80.1 MB in 9 partitions``."""
    parts = (
        f"retention: bodies {age(retention.get('bodies_seconds'))}, rows (the dedup horizon) "
        f"{age(retention.get('rows_seconds'))}"
        + (", media stripped after processing" if retention.get("strip_media") else "")
        if retention.get("enabled")
        else "retention: [yellow]off[/] (the inbox grows until `purge` runs)"
    )
    return (
        f"{parts} · rows {megabytes(size.get('rows_bytes'))}, bodies {megabytes(size.get('bodies_bytes'))} "
        f"in {size.get('partitions', 0)} partitions, deliveries {megabytes(size.get('deliveries_bytes'))}"
    )


def render_status(report: dict[str, Any]) -> None:
    out().print(f"[bold]evolution-ingest status[/] at {report['at']}")
    inbox = report["inbox"]
    if not section_error("Inbox", inbox):
        table = Table(title="Inbox", box=box.SIMPLE, title_justify="left")
        for column in (
            "pending",
            f"stuck (> {age(inbox['stuck_after_seconds'])})",
            "failed",
            "oldest pending",
            "rows",
            "size",
            "oldest row",
        ):
            table.add_column(column, justify="right")
        size = inbox.get("size", {})
        table.add_row(
            str(inbox["pending"]),
            warn_if(inbox["stuck"]),
            warn_if(inbox["failed"]),
            age(inbox["oldest_pending_age_seconds"]),
            str(inbox["rows"]),
            megabytes(size.get("bytes")),
            age(size.get("oldest_age_seconds")),
        )
        out().print(table)
        out().print(retention_line(inbox.get("retention", {}), size))
    counters = report["counters"]
    if not section_error("Counters", counters):
        table = Table(
            title="Per channel (counters since the counters were created)",
            box=box.SIMPLE,
            title_justify="left",
        )
        table.add_column("channel")
        for column in _CHANNEL_COLUMNS:
            table.add_column(column.replace("skipped_", "skipped "), justify="right")
        for channel in ("webhook", "rabbitmq", "internal"):
            values = counters.get(channel, {})
            table.add_row(channel, *(str(values.get(column, 0)) for column in _CHANNEL_COLUMNS))
        out().print(table)
        extra = {
            f"{channel}:{name}": value
            for channel, values in counters.items()
            if isinstance(values, dict) and channel not in {"route", "alert"}  # shown under Routes
            for name, value in values.items()
            if not (channel in {"webhook", "rabbitmq", "internal"} and name in _CHANNEL_COLUMNS)
        }
        if extra:
            out().print("Other counters: " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
    render_routes(report["routes"])
    render_refusals(report["refusals"])
    rabbit = report["rabbitmq"]
    if not section_error("RabbitMQ", rabbit):
        table = Table(title=f"RabbitMQ ({rabbit['mode']} mode)", box=box.SIMPLE, title_justify="left")
        for column in ("queue", "messages", "consumers"):
            table.add_column(column, justify="right" if column != "queue" else "left")
        rows = [
            *rabbit["retry_tiers"].items(),
            ("lock busy", rabbit["lock_busy"]),
            ("ready", rabbit["ready"]),
        ]
        rows.append(("parking", rabbit["parking"]))
        rows += list(rabbit["evolution_queues"].items())
        for name, state in rows:
            if not state.get("exists"):
                table.add_row(name, "[yellow]not declared[/]", "-")
            else:
                consumers = state["consumers"]
                messages = state["messages"]
                table.add_row(
                    name,
                    f"[red]{messages}[/]" if name == "parking" and messages else str(messages),
                    str(consumers) if consumers or name not in rabbit["evolution_queues"] else "[red]0[/]",
                )
        out().print(table)


def render_refusals(section: dict[str, Any]) -> None:
    if section_error("Refused bodies", section):
        return
    summary = section["summary"]
    out().print(
        f"[bold]Refused bodies[/]: {summary['kept']} kept (the newest {summary['keep']}), "
        f"{warn_if(summary['last_24h'])} in the last 24 h, {summary['not_replayed']} not replayed"
    )
    for row in summary["last_24h_by_code"]:
        out().print(f"  {row['source']} {row['code']}: {row['refusals']}")
    for row in section["recent"]:
        out().print(
            f"  refusal:{row['id']}  {row['received_at']:%Y-%m-%d %H:%M:%S}  {row['source']} "
            f"{row['status'] or '-'} {row['code']}: {row['reason'][:120]}"
        )
    if section["recent"]:
        out().print("  (inspect refusal:<id> shows one; replay --refused re-submits them after a fix)")


def render_refusal(row: dict[str, Any]) -> None:
    table = Table(box=box.SIMPLE, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name in (
        "id", "received_at", "source", "status", "code", "reason", "origin", "body_bytes", "truncated",
        "replayed_at", "replay_outcome",
    ):  # fmt: skip
        table.add_row(name, "-" if row.get(name) is None else escape(str(row[name])))
    out().print(table)
    if row.get("body") is not None:
        out().print(row["body"], markup=False, highlight=False)
    else:
        out().print(f"body (not UTF-8, hex): {row['body_hex']}")


def render_routes(section: dict[str, Any]) -> None:
    if not section.get("configured") or section_error("Routes", section):
        return
    table = Table(title=f"Routes ({section['file']})", box=box.SIMPLE, title_justify="left")
    columns = ("forwarded", "failed", "permanent", "dropped", "alerts_sent", "alerts_suppressed")
    table.add_column("route")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for name, values in section["routes"].items():
        table.add_row(
            name, *(warn_if(values[c]) if c in {"failed", "permanent"} else str(values[c]) for c in columns)
        )
    out().print(table)
    for problem in section["problems"]:
        out().print(
            f"  destination {problem['destination']}: [yellow]{problem['failing']} failing[/], "
            f"[red]{problem['permanent']} refused for good[/] (see `inspect` of an event)"
        )


def warn_if(value: int) -> str:
    return f"[yellow]{value}[/]" if value else "0"


def render_check(results: list[dict[str, str]]) -> None:
    table = Table(box=box.SIMPLE)
    table.add_column("check")
    table.add_column("state")
    table.add_column("detail")
    for result in results:
        table.add_row(result["check"], _STATE_MARK[result["state"]], escape(result["detail"]))
    out().print(table)


def render_row(row: dict[str, Any]) -> None:
    table = Table(box=box.SIMPLE, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name in (
        "id", "dedup_key", "state", "event", "instance", "received_at", "processed_at", "failed_at",
        "attempts", "last_attempt_at", "last_error", "claimed_until",
    ):  # fmt: skip
        table.add_row(name, "-" if row.get(name) is None else escape(str(row[name])))
    channels = row["channels"]
    table.add_row(
        "channels",
        f"first {channels['first']}; webhook {channels['webhook_seen_at'] or 'never'}; "
        f"rabbitmq {channels['rabbitmq_seen_at'] or 'never'}",
    )
    out().print(table)
    for delivery in row.get("deliveries", []):
        out().print(
            f"delivery {delivery['destination']}: {delivery['status']} after {delivery['attempts']} attempt(s)"
            + (f" — {delivery['last_error']}" if delivery["last_error"] else "")
        )
    if row.get("payload") is None:
        out().print("payload: [yellow]purged[/] (the key is kept so late copies are still recognised)")
    else:
        out().print(Syntax(as_json(row["payload"]), "json", word_wrap=True))


def render_reconcile(report: dict[str, Any]) -> None:
    if not report["leader"]:
        out().print("another reconciler is active; this pass did nothing")
        return
    out().print(
        f"reconcile: found {report['found']} stuck event(s) in {report['seconds']:.2f}s — "
        f"recovered {report['recovered']}, still failing {report['failing']}, "
        f"marked failed {report['dead']}, being processed elsewhere {report['locked']}"
    )


def render_replay(report: dict[str, Any]) -> None:
    verb = "would be replayed" if report["dry_run"] else "replayed"
    out().print(
        f"replay: {report['failed_events']} failed event(s) and {report['parked_messages']} parked message(s) {verb}"
    )
    outcomes = {k: v for k, v in report.items() if k == "recovered" or k.startswith("still_")}
    if outcomes:
        out().print(
            "  failed events: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in outcomes.items())
        )
    if report["parked_messages"] and not report["dry_run"]:
        out().print("  parked messages went to the ready queue; the worker processes them")
    if report["parked_left"]:
        out().print(
            f"  {report['parked_left']} parked message(s) left in place (not Evolution events, or filtered out)"
        )
    if "refused_bodies" in report:
        became = ", ".join(f"{k} {v}" for k, v in sorted(report["refused_outcomes"].items()))
        out().print(f"  {report['refused_bodies']} refused body(ies) {verb}: {became}")


def render_purge(report: dict[str, Any], older_than: str) -> None:
    count = report.get("rows_deleted", report.get("payloads_dropped", 0))
    what = "payload(s) of processed rows" if report["payload_only"] else "processed row(s)"
    verb = "would be" if report["dry_run"] else "were"
    done = "dropped" if report["payload_only"] else "deleted"
    out().print(f"purge: {count} {what} older than {older_than} {verb} {done}")


@contextmanager
def progress_bar(description: str, total: int | None, *, enabled: bool = True) -> Iterator[Any]:
    """A progress bar on a terminal (nothing when ``enabled`` is false); yields ``advance(n)``."""
    if not enabled:
        yield lambda n: None
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=False,
    ) as progress:  # fmt: skip
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
