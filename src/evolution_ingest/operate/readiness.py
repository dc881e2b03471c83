"""``/readyz``: can this process do its job now? Postgres (with current migrations), Redis, RabbitMQ."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from evolution_ingest.config import Settings
from evolution_ingest.operate.cached import Cached
from evolution_ingest.operate.errors import STORE_ERRORS
from evolution_ingest.stores import Stores, migrations


class Readiness:
    """Can this process do its job now? Postgres (and migrations), Redis, RabbitMQ."""

    def __init__(self, stores: Stores, settings: Settings) -> None:
        self._db = stores.db
        self._redis = stores.redis
        self._queues = stores.queues
        self._settings = settings
        self._cached = Cached(self._check, settings.ready_cache_seconds)

    async def report(self) -> dict[str, Any]:
        report: dict[str, Any] = await self._cached.get()
        return report

    async def _check(self) -> dict[str, Any]:
        timeout = max(1.0, min(self._settings.database_timeout_seconds, 5.0))
        results = await asyncio.gather(
            self._bounded(self._postgres(), timeout),
            self._bounded(self._redis_ping(), timeout),
            self._bounded(self._rabbitmq(), timeout),
        )
        checks = dict(zip(("postgres", "redis", "rabbitmq"), results, strict=True))
        failing = [name for name, detail in checks.items() if detail != "ok"]
        return {"ready": not failing, "failing": failing, "checks": checks}

    @staticmethod
    async def _bounded(check: Awaitable[str], within: float) -> str:
        try:
            return await asyncio.wait_for(check, within)
        except TimeoutError:
            return f"no answer within {within:g} s"
        except STORE_ERRORS as exc:  # reported in the body, never raised
            return f"{type(exc).__name__}: {exc}"

    async def _postgres(self) -> str:
        async with self._db.connection() as conn:
            state = await migrations.state(conn, self._settings.database_schema)
        if not state.current:
            pending = ", ".join(f"{m.version:04d}_{m.name}" for m in state.pending)
            return f"migrations pending: {pending}"
        return "ok"

    async def _redis_ping(self) -> str:
        await self._redis.ping()
        return "ok"

    async def _rabbitmq(self) -> str:
        await self._queues.ping()
        return "ok"
