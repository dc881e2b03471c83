"""Every instance's connection, live: Evolution's own view polled, and alerts raised once, cleared once.

With ``EVOLUTION_URL`` set, one replica per ``INSTANCE_POLL_SECONDS`` (a Redis ``SET NX PX``)
reads each instance's ``connectionStatus`` (``GET /instance/fetchInstances``) into the
connection log — so a change is known even when its ``connection.update`` never arrived.

An alert is raised when an instance is logged out (closed with statusReason 401), or has been
away from ``open`` for ``INSTANCE_DOWN_ALERT_SECONDS``; it is cleared when it is ``open`` again.
Raised alerts are a Redis hash: ``HSETNX`` raises, ``HDEL`` clears, so with several replicas each
transition is announced once — to the log, and to ``GAP_ALERT_WEBHOOK_URL`` or the routes
file's ``alert_webhook_url``. Counters ``alert:instance:raised`` / ``cleared`` / ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import Final

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from evolution_ingest.config import Settings
from evolution_ingest.logic.routes_file import RoutesFile
from evolution_ingest.operate.errors import STORE_ERRORS
from evolution_ingest.operate.gaps import Announcer
from evolution_ingest.stores.connections import Connection, ConnectionLog
from evolution_ingest.stores.counters import Counters, reraise_cancellation
from evolution_ingest.stores.evolution import EvolutionApi, EvolutionError

log = structlog.get_logger(__name__)

_PRUNE_EVERY: Final = 3600.0


def alerts_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}instance-alerts"


async def raised_alerts(redis: Redis, settings: Settings) -> dict[str, str]:
    """Instance -> why its alert is raised (logged_out, away)."""
    raw = await redis.hgetall(alerts_key(settings))
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v).split("\t")[
            0
        ]
        for k, v in raw.items()
    }


def why(connection: Connection, now: datetime, after: float) -> str | None:
    """Why ``connection`` calls for an alert now, or None."""
    if connection.logged_out:
        return "logged_out"
    if connection.state != "open" and (now - connection.since).total_seconds() >= after:
        return "away"
    return None


class InstanceWatcher:
    def __init__(
        self,
        connections: ConnectionLog,
        counters: Counters,
        redis: Redis,
        settings: Settings,
        *,
        routes: RoutesFile | None,
        api: EvolutionApi | None,
    ) -> None:  # fmt: skip
        self._connections = connections
        self._counters = counters
        self._redis = redis
        self._settings = settings
        self._api = api
        self._key = alerts_key(settings)
        self._announcer = Announcer("instance", counters, settings, routes)
        self._pruned = 0.0

    async def poll(self) -> int:
        """Evolution's state of each instance into the log (one replica per interval); changes kept."""
        if self._api is None:
            return 0
        token = f"{self._settings.redis_key_prefix}instance-poll"
        if not await self._redis.set(
            token, "1", nx=True, px=max(1, int(self._settings.instance_poll_seconds * 900))
        ):
            return 0
        now = datetime.now(UTC)
        changed = 0
        for instance in await self._api.instances():
            name, state = instance.get("name"), instance.get("connectionStatus")
            if isinstance(name, str) and isinstance(state, str):
                changed += await self._connections.record(name, now, state, None, "poll")
        return changed

    async def check(self, now: datetime | None = None) -> tuple[list[str], list[str]]:
        """Raise and clear; returns the instances whose alert this call raised, and cleared."""
        now = now or datetime.now(UTC)
        connections = await self._connections.connections(now)
        raised, cleared = [], []
        current = await raised_alerts(self._redis, self._settings)
        for connection in connections:
            reason = why(connection, now, self._settings.instance_down_alert_seconds)
            name = connection.instance
            if (
                reason
                and name not in current
                and await self._redis.hsetnx(self._key, name, f"{reason}\t{now.timestamp()}")
            ):
                raised.append(name)
                text = (
                    f"evolution-ingest: instance {name!r} was logged out of WhatsApp at {connection.since:%Y-%m-%d %H:%M} UTC"
                    if reason == "logged_out"
                    else f"evolution-ingest: instance {name!r} is {connection.state} since "
                    f"{connection.since:%Y-%m-%d %H:%M} UTC"
                )
                await self._announce("raised", name, text, reason=reason, state=connection.state)
            elif connection.state == "open" and name in current and await self._redis.hdel(self._key, name):
                cleared.append(name)
                await self._announce(
                    "cleared", name, f"evolution-ingest: instance {name!r} is connected again"
                )
        if now.timestamp() - self._pruned >= _PRUNE_EVERY:
            await self._connections.prune(now)
            self._pruned = now.timestamp()
        return raised, cleared

    async def _announce(self, what: str, instance: str, text: str, **fields: str) -> None:
        await self._announcer(what, instance, text, log_as="instance alert", **fields)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.poll()
                    await self.check()
                except (*STORE_ERRORS, EvolutionError, RedisError) as exc:
                    log.warning("instance check skipped", error=str(exc))
                except (
                    Exception
                ):  # the edge of a loop that must not end: log with the traceback, count, go on
                    self._counters.incr("alert:instance:errors")
                    log.exception("instance check failed")
                reraise_cancellation()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.gap_check_interval_seconds)
        finally:
            await self.close()

    async def close(self) -> None:
        await self._announcer.close()
        if self._api is not None:
            await self._api.close()
