"""What each route destination made of each event: ``evolution_ingest_deliveries``.

A destination answers once per event: the outcome of every (event, destination) is
kept, so that when the event is tried again only the destinations that failed are
sent to again (see :mod:`evolution_ingest.logic.router`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from evolution_ingest.core import codec
from evolution_ingest.stores.postgres import Postgres

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


class DeliveryLog:
    """The outcome of each (event, destination), in Postgres next to the inbox."""

    def __init__(self, db: Postgres) -> None:
        self._db = db

    async def settled(self, event_id: int) -> set[str]:
        """Destinations that need nothing more for this event (delivered, or permanently refused)."""
        return {record["destination"] for record in await self._db.fetch(_SETTLED, event_id)}

    async def record(self, event_id: int, results: Sequence[DeliveryResult]) -> None:
        if not results:
            return
        await self._db.execute(
            _RECORD,
            event_id,
            [r.destination for r in results],
            [r.status.value for r in results],
            [r.http_status for r in results],
            [codec.label((r.error or "")[:_MAX_ERROR]) or None for r in results],
        )

    async def of(self, event_id: int) -> list[dict[str, Any]]:
        records = await self._db.fetch(
            f"SELECT destination, status, http_status, attempts, last_error, delivered_at, updated_at "
            f"FROM {DELIVERIES} WHERE event_id = $1 ORDER BY destination",
            event_id,
        )
        return [dict(record) for record in records]

    async def problems(self) -> list[dict[str, Any]]:
        """Per destination: how many events are failing, and how many were refused for good."""
        records = await self._db.fetch(
            f"SELECT destination, count(*) FILTER (WHERE status = 'failed') AS failing, "
            f"count(*) FILTER (WHERE status = 'permanent') AS permanent "
            f"FROM {DELIVERIES} WHERE status <> 'delivered' GROUP BY destination ORDER BY destination"
        )
        return [dict(record) for record in records]
