"""Read-only views for operators: ``status`` and ``inspect``, and the sections they are made of.

Each returns plain, JSON-ready data; the CLI renders it for a person or prints it as
JSON, the dashboard shows it. A store that cannot be reached shows up as an error in
its section instead of failing the whole view.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

from evolution_ingest.config import Settings
from evolution_ingest.core.redaction import REDACTED
from evolution_ingest.logic.routes_file import RoutesFile
from evolution_ingest.operate.errors import STORE_ERRORS, failed
from evolution_ingest.operate.instances import raised_alerts
from evolution_ingest.stores import Stores
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.refusals import RefusalLog

#: ``inspect refusal:<id>``: a refused body instead of an inbox row.
REFUSAL_REF: Final = "refusal:"


async def inbox_section(stores: Stores, settings: Settings) -> dict[str, Any]:
    try:
        stats = await stores.reads.stats(settings.reconcile_after_seconds)
        size = await stores.retention.sizes()
    except STORE_ERRORS as exc:  # status must work when a store is down
        return failed(exc)
    return {
        "ok": True,
        **stats,
        "stuck_after_seconds": settings.reconcile_after_seconds,
        "size": {
            **size,
            "bytes": sum(size.get(k, 0) for k in ("rows_bytes", "bodies_bytes", "deliveries_bytes")),
        },
        "retention": retention_in_force(settings),
    }


def retention_in_force(settings: Settings) -> dict[str, Any]:
    """The retention settings as ``status`` and the dashboard show them."""
    return {
        "enabled": settings.retention_enabled,
        "bodies_seconds": settings.retention_bodies_seconds,
        "rows_seconds": settings.retention_rows_seconds,
        "partition_seconds": settings.retention_partition_seconds,
        "strip_media": settings.retention_strip_media,
    }


async def counter_section(counters: Counters) -> dict[str, Any]:
    try:
        values = await counters.read()
    except STORE_ERRORS as exc:
        return failed(exc)
    channels: dict[str, dict[str, int]] = {}
    for name, value in sorted(values.items()):
        channel, _, counter = name.partition(":")
        channels.setdefault(channel, {})[counter or channel] = value
    return {"ok": True, **channels}


async def rabbitmq_section(stores: Stores) -> dict[str, Any]:
    try:
        return {"ok": True, **await stores.queues.status()}
    except STORE_ERRORS as exc:
        return failed(exc)


async def routes_section(
    stores: Stores, counters: dict[str, Any], routes: RoutesFile | None, settings: Settings
) -> dict[str, Any]:
    """Per route: forwarded / failed / permanent / dropped, alerts; destinations failing now."""
    if routes is None:
        return {"ok": True, "configured": False}
    try:
        problems = await stores.deliveries.problems()
    except STORE_ERRORS as exc:
        return failed(exc)
    forwards = counters.get("route", {}) if counters.get("ok") else {}
    alerts = counters.get("alert", {}) if counters.get("ok") else {}
    per_route = {
        route.name: {
            **{
                name: forwards.get(f"{route.name}:{name}", 0)
                for name in ("forwarded", "failed", "permanent", "dropped")
            },
            **{
                f"alerts_{name}": alerts.get(f"{route.name}:{name}", 0)
                for name in ("sent", "suppressed", "failed")
            },
        }
        for route in routes.routes
    }
    return {
        "ok": True,
        "configured": True,
        "file": str(settings.routes_file),
        "routes": per_route,
        "problems": problems,
    }


async def refusal_section(refusals: RefusalLog, recent: int = 20) -> dict[str, Any]:
    """How many refused bodies are kept, by code over 24 hours, and the newest ones."""
    try:
        return {"ok": True, "summary": await refusals.summary(), "recent": await refusals.recent(recent)}
    except STORE_ERRORS as exc:
        return failed(exc)


async def instances_section(stores: Stores, settings: Settings) -> dict[str, Any]:
    """Each instance's connection: state, since when, last close and why, uptime; its alert if raised."""
    now = datetime.now(UTC)
    try:
        connections = await stores.connections.connections(now)
        raised = await raised_alerts(stores.redis, settings)
    except STORE_ERRORS as exc:
        return failed(exc)
    return {
        "ok": True,
        "down_alert_after_seconds": settings.instance_down_alert_seconds,
        "instances": [{**c.as_dict(now), "alert": raised.get(c.instance)} for c in connections],
    }


async def backfill_section(stores: Stores, counted: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Backfill's counters and its latest runs."""
    try:
        runs = await stores.backfills.recent(10)
    except STORE_ERRORS as exc:
        return failed(exc)
    return {
        "ok": True,
        "automatic": bool(
            settings.evolution_url and settings.evolution_api_key and settings.backfill_enabled
        ),
        "counters": counted.get("backfill", {}) if counted.get("ok") else {},
        "recent_runs": [
            {k: v.isoformat() if isinstance(v, datetime) else v for k, v in run.items()} for run in runs
        ],
    }


async def status(stores: Stores, settings: Settings, routes: RoutesFile | None) -> dict[str, Any]:
    counted = await counter_section(stores.counters)
    return {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "inbox": await inbox_section(stores, settings),
        "rabbitmq": await rabbitmq_section(stores),
        "counters": counted,
        "routes": await routes_section(stores, counted, routes, settings),
        "refusals": await refusal_section(stores.refusals, recent=5),
        "instances": await instances_section(stores, settings),
        "backfill": await backfill_section(stores, counted, settings),
    }


async def inspect(stores: Stores, ref: str, *, show_apikey: bool = False) -> dict[str, Any]:
    """One inbox row by id, dedup key, or a unique prefix of at least 8 hex characters, with its
    deliveries; or one refused body by ``refusal:<id>``. :class:`LookupError` when there is none."""
    ref = ref.strip().lower()
    if ref.startswith(REFUSAL_REF):
        number = ref.removeprefix(REFUSAL_REF)
        found = await stores.refusals.get(int(number)) if number.isdigit() else None
        if found is None:
            raise LookupError(f"no refusal {number!r} is kept (see `status` for the kept ones)")
        return {"refusal": found}
    row = await stores.reads.one(ref)
    payload = row["payload"]
    if isinstance(payload, dict) and payload.get("apikey") is not None and not show_apikey:
        row["payload"] = {**payload, "apikey": REDACTED}  # stored only with KEEP_APIKEY
    row["claim_token"] = str(row["claim_token"]) if row.get("claim_token") else None
    row["channels"] = {
        "first": row["channel"],
        "webhook_seen_at": row["webhook_seen_at"],
        "rabbitmq_seen_at": row["rabbitmq_seen_at"],
    }
    row["deliveries"] = await stores.deliveries.of(row["id"])
    return row
