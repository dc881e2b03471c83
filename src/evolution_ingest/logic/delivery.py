"""Delivering events to the routes' destinations, and remembering the outcome of each.

A destination answers once per event: the outcome of every (event, destination)
is kept in ``evolution_ingest_deliveries``, so when the event is tried again only
the destinations that failed are sent to again. 2xx is delivered; 408, 429, 5xx, a
timeout or a refused connection is a failure to retry; any other 4xx (and a
redirect) is permanent: recorded, counted and shown, never retried.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from evolution_ingest.core import codec
from evolution_ingest.stores.inbox import PostgresInbox

DELIVERIES: Final = "evolution_ingest_deliveries"
_MAX_ERROR: Final = 1000

_SETTLED: Final = f"SELECT destination FROM {DELIVERIES} WHERE event_id = $1 AND status <> 'failed'"

_RECORD: Final = f"""
INSERT INTO {DELIVERIES} AS d (event_id, destination, status, http_status, last_error, delivered_at)
SELECT $1, destination, status, http_status, last_error,
       CASE WHEN status = 'delivered' THEN now() END
FROM unnest($2::text[], $3::text[], $4::int[], $5::text[]) AS t(destination, status, http_status, last_error)
ON CONFLICT (event_id, destination) DO UPDATE SET
    status = EXCLUDED.status,
    http_status = EXCLUDED.http_status,
    last_error = EXCLUDED.last_error,
    attempts = d.attempts + 1,
    delivered_at = COALESCE(d.delivered_at, EXCLUDED.delivered_at),
    updated_at = now()
"""


class DeliveryStatus(enum.StrEnum):
    DELIVERED = "delivered"
    FAILED = "failed"
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    destination: str
    status: DeliveryStatus
    http_status: int | None = None
    error: str | None = None


def classify(status: int) -> DeliveryStatus:
    if 200 <= status < 300:
        return DeliveryStatus.DELIVERED
    if status in {408, 429} or status >= 500:
        return DeliveryStatus.FAILED
    return DeliveryStatus.PERMANENT


class DeliveryLog:
    """The outcome of each (event, destination), in Postgres next to the inbox."""

    def __init__(self, inbox: PostgresInbox) -> None:
        self._inbox = inbox

    async def settled(self, event_id: int) -> set[str]:
        """Destinations that need nothing more for this event (delivered, or permanently refused)."""
        async with self._inbox.connection() as conn:
            return {record["destination"] for record in await conn.fetch(_SETTLED, event_id)}

    async def record(self, event_id: int, results: Sequence[DeliveryResult]) -> None:
        if not results:
            return
        async with self._inbox.connection() as conn:
            await conn.execute(
                _RECORD,
                event_id,
                [r.destination for r in results],
                [r.status.value for r in results],
                [r.http_status for r in results],
                [codec.label((r.error or "")[:_MAX_ERROR]) or None for r in results],
            )

    async def of(self, event_id: int) -> list[dict[str, Any]]:
        async with self._inbox.connection() as conn:
            records = await conn.fetch(
                f"SELECT destination, status, http_status, attempts, last_error, delivered_at, updated_at "
                f"FROM {DELIVERIES} WHERE event_id = $1 ORDER BY destination",
                event_id,
            )
        return [dict(record) for record in records]

    async def problems(self) -> list[dict[str, Any]]:
        """Per destination: how many events are failing, and how many were refused for good."""
        async with self._inbox.connection() as conn:
            records = await conn.fetch(
                f"SELECT destination, count(*) FILTER (WHERE status = 'failed') AS failing, "
                f"count(*) FILTER (WHERE status = 'permanent') AS permanent "
                f"FROM {DELIVERIES} WHERE status <> 'delivered' GROUP BY destination ORDER BY destination"
            )
        return [dict(record) for record in records]


class Courier:
    """Sends JSON over HTTP with one shared aiohttp session (no redirects followed)."""

    def __init__(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=100),
            headers={"user-agent": "evolution-ingest"},
        )

    async def send(
        self,
        destination: str,
        url: str,
        body: Mapping[str, Any],
        *,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        timeout_seconds: float = 10.0,
    ) -> DeliveryResult:
        try:
            async with self._session.request(
                method,
                url,
                data=codec.dumps(body),
                headers={"content-type": "application/json", **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=timeout_seconds),
                allow_redirects=False,
            ) as response:
                text = (await response.read())[:300].decode(errors="replace")
                status = classify(response.status)
                error = None if status is DeliveryStatus.DELIVERED else f"HTTP {response.status}: {text}"
                return DeliveryResult(destination, status, response.status, error)
        except TimeoutError:
            return DeliveryResult(
                destination, DeliveryStatus.FAILED, None, f"timeout after {timeout_seconds}s"
            )
        except (aiohttp.ClientError, OSError) as exc:
            return DeliveryResult(destination, DeliveryStatus.FAILED, None, f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        await self._session.close()
