"""Read-only views for operators: ``status``, ``check`` and ``inspect``.

Each function returns plain, JSON-ready data; the CLI renders it for a person or
prints it as JSON. A store that cannot be reached shows up as an error in its
section instead of failing the whole view.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Final

import aio_pika
from aio_pika.abc import AbstractConnection

from evolution_ingest.channels.topology import Topology
from evolution_ingest.channels.worker import BROKER_ERRORS
from evolution_ingest.config import ConfigError, Settings
from evolution_ingest.core import codec
from evolution_ingest.logic.delivery import DeliveryLog
from evolution_ingest.logic.routes_file import load_routes
from evolution_ingest.stores import migrations
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import TABLE, PostgresInbox, StoreUnavailable
from evolution_ingest.stores.refusals import RefusalLog

_HEX: Final = re.compile(r"[0-9a-f]{8,64}")

_INBOX_STATS: Final = f"""
SELECT
  (SELECT count(*) FROM {TABLE} WHERE processed_at IS NULL AND failed_at IS NULL) AS pending,
  (SELECT count(*) FROM {TABLE} WHERE processed_at IS NULL AND failed_at IS NULL
                                  AND received_at < now() - make_interval(secs => $1)) AS stuck,
  (SELECT count(*) FROM {TABLE} WHERE failed_at IS NOT NULL AND processed_at IS NULL) AS failed,
  (SELECT min(received_at) FROM {TABLE} WHERE processed_at IS NULL AND failed_at IS NULL) AS oldest_pending,
  (SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($2)) AS rows_estimate,
  (SELECT count(*) FROM (SELECT 1 FROM {TABLE} LIMIT 100000) AS few) AS rows_upto,
  now() AS now
"""


def _error(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


async def inbox_stats(inbox: PostgresInbox, settings: Settings) -> dict[str, Any]:
    try:
        async with inbox.connection() as conn:
            row = await conn.fetchrow(
                _INBOX_STATS, settings.reconcile_after_seconds, f'"{settings.database_schema}".{TABLE}'
            )
    except Exception as exc:  # shown in the report, never raised: status must work when a store is down
        return _error(exc)
    assert row is not None
    oldest = row["oldest_pending"]
    return {
        "ok": True,
        "pending": row["pending"],
        "stuck": row["stuck"],
        "failed": row["failed"],
        "oldest_pending_age_seconds": round((row["now"] - oldest).total_seconds(), 1) if oldest else None,
        # Exact below 100,000 rows; the planner's estimate above (a count would scan the table).
        "rows": row["rows_upto"] if row["rows_upto"] < 100_000 else row["rows_estimate"],
        "stuck_after_seconds": settings.reconcile_after_seconds,
    }


async def counter_values(counters: Counters) -> dict[str, Any]:
    try:
        values = await counters.read()
    except Exception as exc:  # shown in the report
        return _error(exc)
    channels: dict[str, dict[str, int]] = {}
    for name, value in sorted(values.items()):
        channel, _, counter = name.partition(":")
        channels.setdefault(channel, {})[counter or channel] = value
    return {"ok": True, **channels}


@asynccontextmanager
async def _broker(settings: Settings) -> AsyncIterator[AbstractConnection]:
    connection = await aio_pika.connect(settings.rabbitmq_url, timeout=10)
    try:
        yield connection
    finally:
        with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
            await connection.close()


async def queue_states(connection: AbstractConnection, names: list[str]) -> dict[str, dict[str, Any]]:
    """Depth and consumers of each queue (``exists: False`` when it is not declared)."""
    states: dict[str, dict[str, Any]] = {}
    channel = await connection.channel()
    for name in names:
        try:
            declared = await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelClosed:  # NOT_FOUND closes the channel
            states[name] = {"exists": False}
            channel = await connection.channel()
            continue
        result = declared.declaration_result
        states[name] = {"exists": True, "messages": result.message_count, "consumers": result.consumer_count}
    with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
        await channel.close()
    return states


async def rabbitmq_status(settings: Settings) -> dict[str, Any]:
    topology = Topology(settings)
    try:
        async with _broker(settings) as connection:
            sources = await queue_states(connection, topology.source_queues)
            service = await queue_states(connection, topology.service_queues)
    except BROKER_ERRORS as exc:
        return _error(exc)
    tiers = {tier.queue: service[tier.queue] for tier in topology.tiers}
    return {
        "ok": True,
        "mode": topology.mode.value,
        "retry_tiers": tiers,
        "lock_busy": service[topology.busy.queue],
        "ready": service[topology.ready],
        "parking": service[topology.parking],
        "evolution_queues": sources,
    }


async def routes_status(inbox: PostgresInbox, counters: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Per route: forwarded / failed / permanent / dropped, alerts; destinations failing now."""
    if settings.routes_file is None:
        return {"ok": True, "configured": False}
    try:
        routes = load_routes(settings.routes_file)
        problems = await DeliveryLog(inbox).problems()
    except Exception as exc:  # shown in the report
        return _error(exc)
    per_route = {}
    for route in routes.routes:
        forwards = counters.get("route", {}) if counters.get("ok") else {}
        alerts = counters.get("alert", {}) if counters.get("ok") else {}
        per_route[route.name] = {
            **{
                name: forwards.get(f"{route.name}:{name}", 0)
                for name in ("forwarded", "failed", "permanent", "dropped")
            },
            **{
                f"alerts_{name}": alerts.get(f"{route.name}:{name}", 0)
                for name in ("sent", "suppressed", "failed")
            },
        }
    return {
        "ok": True,
        "configured": True,
        "file": str(settings.routes_file),
        "routes": per_route,
        "problems": problems,
    }


async def refusal_report(refusals: RefusalLog, recent: int = 20) -> dict[str, Any]:
    """How many refused bodies are kept, by code over 24 hours, and the newest ones."""
    try:
        return {"ok": True, "summary": await refusals.summary(), "recent": await refusals.recent(recent)}
    except StoreUnavailable as exc:
        return _error(exc)


async def status(
    inbox: PostgresInbox, counters: Counters, settings: Settings, refusals: RefusalLog
) -> dict[str, Any]:
    counted = await counter_values(counters)
    return {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "inbox": await inbox_stats(inbox, settings),
        "rabbitmq": await rabbitmq_status(settings),
        "counters": counted,
        "routes": await routes_status(inbox, counted, settings),
        "refusals": await refusal_report(refusals, recent=5),
    }


REFUSAL_REF: Final = "refusal:"


async def inspect(
    inbox: PostgresInbox, ref: str, *, refusals: RefusalLog | None = None, show_apikey: bool = False
) -> dict[str, Any]:
    """One inbox row by id, dedup key, or a unique prefix of at least 8 hex characters;
    or one refused body by ``refusal:<id>``."""
    ref = ref.strip().lower()
    if ref.startswith(REFUSAL_REF) and refusals is not None:
        number = ref.removeprefix(REFUSAL_REF)
        found = await refusals.get(int(number)) if number.isdigit() else None
        if found is None:
            raise LookupError(f"no refusal {number!r} is kept (see `status` for the kept ones)")
        return {"refusal": found}
    args: list[Any]
    if ref.isdigit():
        where, args = "id = $1", [int(ref)]
    elif _HEX.fullmatch(ref):
        # A range rather than LIKE, so that the unique index serves whatever the collation.
        where, args = "dedup_key >= $1 AND dedup_key < $2", [ref, ref + "g"]
    else:
        raise ValueError(f"{ref!r} is neither a row id nor a dedup key (or 8+ hex characters of one)")
    async with inbox.connection() as conn:
        records = await conn.fetch(f"SELECT * FROM {TABLE} WHERE {where} ORDER BY id LIMIT 2", *args)
    if not records:
        raise LookupError(f"no event matches {ref!r}")
    if len(records) > 1:
        raise LookupError(f"{ref!r} matches several events; give more characters")
    row = dict(records[0])
    payload = row["payload"] = codec.from_storage(row["payload"], row.pop("payload_text", None))
    if isinstance(payload, dict) and "apikey" in payload and not show_apikey:
        row["payload"] = {**payload, "apikey": "[redacted]"}
    row["claim_token"] = str(row["claim_token"]) if row.get("claim_token") else None
    row["channels"] = {
        "first": row["channel"],
        "webhook_seen_at": row["webhook_seen_at"],
        "rabbitmq_seen_at": row["rabbitmq_seen_at"],
    }
    row["state"] = "processed" if row["processed_at"] else "failed" if row["failed_at"] else "pending"
    row["deliveries"] = await DeliveryLog(inbox).of(row["id"])
    return row


async def check(inbox: PostgresInbox, counters: Counters, settings: Settings) -> list[dict[str, str]]:
    """Can the service do its job here? One line per check: ok, warn or fail."""
    results: list[dict[str, str]] = []

    def add(name: str, state: str, detail: str) -> None:
        results.append({"check": name, "state": state, "detail": detail})

    try:
        async with inbox.connection() as conn:
            version = await conn.fetchval("SHOW server_version")
            add("postgres", "ok", f"reachable, server {version}")
            migration_state = await migrations.state(conn, settings.database_schema)
    except Exception as exc:  # reported, not raised
        add("postgres", "fail", f"{type(exc).__name__}: {exc}")
        migration_state = None
    if migration_state is not None:
        if migration_state.current:
            add(
                "migrations",
                "ok",
                f"schema {settings.database_schema} current ({len(migration_state.applied)} applied)",
            )
        else:
            pending = ", ".join(f"{m.version:04d}_{m.name}" for m in migration_state.pending)
            add("migrations", "fail", f"pending: {pending}; run `evolution-ingest migrate`")
        if migration_state.modified:
            add("migrations", "warn", f"applied migrations changed since: {migration_state.modified}")
    try:
        await counters.read(["webhook:received"])
        add("redis", "ok", "reachable")
    except Exception as exc:  # reported, not raised
        add("redis", "fail", f"{type(exc).__name__}: {exc}")
    await _check_rabbitmq(settings, add)
    if settings.routes_file is not None:
        try:
            routes = load_routes(settings.routes_file)
            add("routes file", "ok", f"{settings.routes_file}: {len(routes.routes)} route(s)")
        except ConfigError as exc:
            add("routes file", "fail", str(exc))
    secret = settings.internal_secret
    if secret is not None and secret.get_secret_value():
        add("internal secret", "ok", "set")
    else:
        add(
            "internal secret",
            "warn",
            "not set: `up` makes one per run; separate serve and worker processes need it",
        )
    if settings.auth_methods:
        add("webhook auth", "ok", ", ".join(sorted(settings.auth_methods)))
    else:
        add(
            "webhook auth",
            "warn",
            "off: anyone who can reach the port can inject events (EVOLUTION_INGEST_WEBHOOK_AUTH)",
        )
    return results


async def _check_rabbitmq(settings: Settings, add: Any) -> None:
    topology = Topology(settings)
    try:
        async with _broker(settings) as connection:
            sources = await queue_states(connection, topology.source_queues)
            service = await queue_states(connection, topology.service_queues)
    except BROKER_ERRORS as exc:
        add("rabbitmq", "fail", f"{type(exc).__name__}: {exc}")
        return
    add("rabbitmq", "ok", f"reachable, {topology.mode.value} mode")
    missing = [name for name, state in sources.items() if not state["exists"]]
    unconsumed = [name for name, state in sources.items() if state["exists"] and not state["consumers"]]
    if missing:
        add(
            "evolution queues",
            "warn",
            f"{len(missing)} not declared yet (Evolution or the worker will): {_some(missing)}",
        )
    if unconsumed:
        add(
            "evolution queues",
            "fail",
            f"{len(unconsumed)} without a consumer (is the worker running?): {_some(unconsumed)}",
        )
    if not missing and not unconsumed:
        add("evolution queues", "ok", f"{len(sources)} queues, each with a consumer")
    absent = [name for name, state in service.items() if not state["exists"]]
    if absent:
        add(
            "service queues",
            "fail",
            f"{len(absent)} missing (run `evolution-ingest topology`): {_some(absent)}",
        )
    else:
        parked = service[topology.parking]["messages"]
        add("service queues", "warn" if parked else "ok", f"declared; {parked} message(s) parked")


def _some(names: list[str], shown: int = 4) -> str:
    listed = ", ".join(names[:shown])
    return f"{listed} and {len(names) - shown} more" if len(names) > shown else listed
