"""``check``: can the service do its job here? One line per check: ok, warn or fail, with the fix."""

from __future__ import annotations

import time
from collections.abc import Callable

from evolution_ingest.config import ConfigError, Settings
from evolution_ingest.config.retention import SAFE_HORIZON_SECONDS
from evolution_ingest.logic.routes_file import configured_routes
from evolution_ingest.operate import evolution_checks
from evolution_ingest.operate.errors import STORE_ERRORS
from evolution_ingest.operate.evolution_checks import some
from evolution_ingest.stores import Stores, migrations
from evolution_ingest.stores.queues import Topology, broker, queue_states

Add = Callable[[str, str, str], None]


async def check(stores: Stores, settings: Settings) -> list[dict[str, str]]:
    results: list[dict[str, str]] = []

    def add(name: str, state: str, detail: str) -> None:
        results.append({"check": name, "state": state, "detail": detail})

    await _check_postgres(stores, settings, add)
    try:
        await stores.counters.read(["webhook:received"])
        add("redis", "ok", "reachable")
    except STORE_ERRORS as exc:
        add("redis", "fail", f"{type(exc).__name__}: {exc}")
    await _check_rabbitmq(settings, add)
    if settings.routes_file is not None:
        try:
            routes = configured_routes(settings)
            add(
                "routes file", "ok", f"{settings.routes_file}: {len(routes.routes) if routes else 0} route(s)"
            )
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
    await _check_retention(stores, settings, add)
    await evolution_checks.check(stores, settings, add)
    return results


async def _check_retention(stores: Stores, settings: Settings, add: Add) -> None:
    """The horizon against what may bring a late copy, and whether partitions are made ahead."""
    rows = settings.retention_rows_seconds
    if not settings.retention_enabled:
        add(
            "retention",
            "warn",
            "off: the inbox grows until `purge` runs (EVOLUTION_INGEST_RETENTION_ENABLED)",
        )
    elif rows < SAFE_HORIZON_SECONDS:
        add("retention", "warn",
            f"rows kept {rows:g}s, under a day: a late copy (a queue backlog, a replay) would run again "
            "(EVOLUTION_INGEST_RETENTION_ROWS_SECONDS)")  # fmt: skip
    elif settings.backfill_enabled and rows < settings.backfill_max_window_seconds:
        add("retention", "warn",
            f"rows kept {rows:g}s, less than BACKFILL_MAX_WINDOW_SECONDS: a backfill would ingest again what "
            "retention removed (EVOLUTION_INGEST_RETENTION_ROWS_SECONDS)")  # fmt: skip
    else:
        add("retention", "ok",
            f"bodies {settings.retention_bodies_seconds:g}s, rows (the dedup horizon) {rows:g}s")  # fmt: skip
    try:
        partitions = await stores.retention.partitions()
        autovacuum = await stores.retention.autovacuum_on()
    except STORE_ERRORS:
        return  # reported by the postgres line
    if not autovacuum:
        add("autovacuum", "warn",
            "off on this server: the retention pass runs VACUUM on the inbox itself, every "
            "RETENTION_INTERVAL_SECONDS; turn autovacuum on for the rest of the database")  # fmt: skip
    if not partitions or partitions[-1].end <= time.time():
        add("partitions", "warn",
            "no partition of bodies for now: new bodies go to the default partition "
            "(run `evolution-ingest migrate`, or keep a reconciler running: it makes them)")  # fmt: skip
    else:
        ahead = partitions[-1].end - time.time()
        add("partitions", "ok", f"{len(partitions)} partitions of bodies, made {ahead:,.0f}s ahead")


async def _check_postgres(stores: Stores, settings: Settings, add: Add) -> None:
    try:
        version = await stores.db.server_version()
        add("postgres", "ok", f"reachable, server {version}")
        async with stores.db.connection() as conn:
            state = await migrations.state(conn, settings.database_schema)
    except STORE_ERRORS as exc:
        add("postgres", "fail", f"{type(exc).__name__}: {exc}")
        return
    if state.current:
        add("migrations", "ok", f"schema {settings.database_schema} current ({len(state.applied)} applied)")
    else:
        pending = ", ".join(f"{m.version:04d}_{m.name}" for m in state.pending)
        add("migrations", "fail", f"pending: {pending}; run `evolution-ingest migrate`")
    if state.modified:
        add("migrations", "warn", f"applied migrations changed since: {state.modified}")


async def _check_rabbitmq(settings: Settings, add: Add) -> None:
    topology = Topology(settings)
    try:
        async with broker(settings) as connection:
            sources = await queue_states(connection, topology.source_queues)
            service = await queue_states(connection, topology.service_queues)
    except STORE_ERRORS as exc:
        add("rabbitmq", "fail", f"{type(exc).__name__}: {exc}")
        return
    add("rabbitmq", "ok", f"reachable, {topology.mode.value} mode")
    # A queue that does not exist is a missing binding: see evolution_checks.
    unconsumed = [name for name, state in sources.items() if state["exists"] and not state["consumers"]]
    if unconsumed:
        add(
            "evolution queues",
            "fail",
            f"{len(unconsumed)} without a consumer (is the worker running?): {some(unconsumed)}",
        )
    else:
        existing = sum(1 for state in sources.values() if state["exists"])
        add("evolution queues", "ok", f"{existing} queue(s), each with a consumer")
    absent = [name for name, state in service.items() if not state["exists"]]
    if absent:
        add(
            "service queues",
            "fail",
            f"{len(absent)} missing (run `evolution-ingest topology`): {some(absent)}",
        )
    else:
        parked = service[topology.parking]["messages"]
        add("service queues", "warn" if parked else "ok", f"declared; {parked} message(s) parked")
