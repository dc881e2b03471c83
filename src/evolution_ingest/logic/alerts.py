"""Alerts: a message made from the event, sent to the log and/or a chat webhook, with a cool-down.

The webhook body ``{"text": ..., "content": ...}`` is accepted as is by Slack
incoming webhooks (``text``) and Discord webhooks (``content``) and most tools that
take a JSON message. The cool-down is per route and instance, kept in Redis, so a
flapping instance sends one alert per window, whichever process sees it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Final

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from evolution_ingest.core.events import Event
from evolution_ingest.logic.route import lookup

log = structlog.get_logger(__name__)

_FIELD: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def render(template: str, event: Event) -> str:
    """Fill ``{instance}``, ``{event}``, ``{date_time}``, ``{data.state}``, ``{payload.sender}``..."""
    values: dict[str, Any] = {
        "instance": event.instance,
        "event": event.event,
        "date_time": event.date_time,
        "dedup_key": event.dedup_key,
        "channel": event.channel.value,
        "data": event.data,
        "payload": {k: v for k, v in event.payload.items() if k != "apikey"},
    }

    def fill(match: re.Match[str]) -> str:
        found, value = lookup(values, match[1])
        return "?" if not found or value is None else str(value)

    return _FIELD.sub(fill, template)


def chat_message(text: str) -> dict[str, str]:
    return {"text": text, "content": text}


class Cooldowns:
    """``SET NX PX`` per (route, instance); when Redis cannot answer, the alert goes out."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, route: str, instance: str) -> str:
        return f"{self._prefix}alert-cooldown:{route}:{instance}"

    async def begin(self, route: str, instance: str, seconds: float) -> bool:
        """True when no alert of this route for this instance went out within ``seconds``."""
        if seconds <= 0:
            return True
        try:
            return bool(
                await self._redis.set(
                    self._key(route, instance), "1", nx=True, px=max(1, int(seconds * 1000))
                )
            )
        except (RedisError, OSError) as exc:
            log.warning("alert cool-down unknown, Redis unavailable; sending", route=route, error=repr(exc))
            return True

    async def cancel(self, route: str, instance: str) -> None:
        """The alert did not go out: let the next try send it."""
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(self._key(route, instance))


class ConnectionMemory:
    """Which instances have been connected (a ``connection.update`` with state ``open``)."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self._redis = redis
        self._key = f"{prefix}connected-once"

    async def note(self, event: Event) -> None:
        if event.event != "connection.update" or not isinstance(event.data, dict):
            return
        if event.data.get("state") == "open":
            try:
                await self._redis.hset(self._key, event.instance, "1")
            except (RedisError, OSError) as exc:
                log.warning("instance state not remembered, Redis unavailable", error=repr(exc))

    async def was_connected(self, instance: str) -> bool:
        try:
            return bool(await self._redis.hexists(self._key, instance))
        except (RedisError, OSError):
            return True  # unknown: rather one alert too many than one missing
