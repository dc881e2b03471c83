"""The inbox read by operators and by the reconciler: where events stand, and one event.

The states of an event are defined here, once:

* **pending** — saved, not processed, not given up on;
* **stuck** — pending and older than ``RECONCILE_AFTER_SECONDS`` (the reconciler's work);
* **failed** — given up on after too many attempts; only a replay tries it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import asyncpg

from evolution_ingest.core import codec
from evolution_ingest.core.contract import SavedEvent
from evolution_ingest.core.identity import normalize_event_name
from evolution_ingest.stores.inbox import TABLE, VIEW
from evolution_ingest.stores.postgres import Postgres, where_set

PENDING: Final = "processed_at IS NULL AND failed_at IS NULL"
FAILED: Final = "failed_at IS NOT NULL AND processed_at IS NULL"
#: ``$1``: seconds after which a pending event is stuck.
STUCK: Final = f"{PENDING} AND received_at < now() - make_interval(secs => $1)"
#: Exact counts below this many rows; the planner's estimate above (a count would scan the table).
#: The count runs only while the estimate is below it: on a grown inbox, every ``/metrics``
#: scrape would otherwise read this many index entries to find out what it already knew.
_EXACT_UPTO: Final = 100_000
_HEX: Final = re.compile(r"[0-9a-f]{8,64}")

_STATS: Final = f"""
SELECT
  (SELECT count(*) FROM {TABLE} WHERE {PENDING}) AS pending,
  (SELECT count(*) FROM {TABLE} WHERE {STUCK}) AS stuck,
  (SELECT count(*) FROM {TABLE} WHERE {FAILED}) AS failed,
  (SELECT min(received_at) FROM {TABLE} WHERE {PENDING}) AS oldest_pending,
  GREATEST(size.reltuples, 0)::bigint AS rows_estimate,
  CASE WHEN size.reltuples < {_EXACT_UPTO}  -- -1 until the first ANALYZE
       THEN (SELECT count(*) FROM (SELECT 1 FROM {TABLE} LIMIT {_EXACT_UPTO}) AS few) END AS rows_upto,
  now() AS now
FROM (SELECT (SELECT reltuples FROM pg_class WHERE oid = to_regclass($2)) AS reltuples) AS size
"""

_SAVED_COLUMNS: Final = "id, dedup_key, payload, payload_text, attempts, received_at"

# Rows whose claim is still alive are being processed: a re-send would only find them locked.
_STUCK_PAGE: Final = f"""
SELECT {_SAVED_COLUMNS} FROM {VIEW}
WHERE {STUCK}
  AND (claimed_until IS NULL OR claimed_until < now())
  AND (received_at, id) > ($2, $3)
ORDER BY received_at, id
LIMIT $4
"""

_COVERAGE: Final = f"""
SELECT instance,
       count(*) AS events,
       count(*) FILTER (WHERE webhook_seen_at IS NOT NULL AND rabbitmq_seen_at IS NOT NULL) AS both_channels,
       count(*) FILTER (WHERE rabbitmq_seen_at IS NULL) AS webhook_only,
       count(*) FILTER (WHERE webhook_seen_at IS NULL) AS rabbitmq_only
  FROM {TABLE}
 WHERE received_at >= now() - make_interval(secs => $1)
   AND received_at < now() - make_interval(secs => $2)
 GROUP BY instance
 ORDER BY instance
"""

_FAILURES: Final = f"""
SELECT id, dedup_key, event, instance, attempts, last_error, last_attempt_at,
       processed_at IS NOT NULL AS processed, failed_at IS NOT NULL AS given_up
  FROM {TABLE}
 WHERE last_error IS NOT NULL
 ORDER BY last_attempt_at DESC NULLS LAST
 LIMIT $1
"""


def saved_event(record: asyncpg.Record) -> SavedEvent:
    payload = codec.from_storage(record["payload"], record["payload_text"])
    return SavedEvent(record["id"], record["dedup_key"], payload, record["attempts"], record["received_at"])


@dataclass(frozen=True, slots=True)
class Filters:
    """Which events an operator's command looks at (an omitted one matches everything)."""

    event: str | None = None
    instance: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def matches(self, event: str, instance: str, at: datetime | None) -> bool:
        if self.event and normalize_event_name(self.event) != event:
            return False
        if self.instance and self.instance != instance:
            return False
        if at is not None and self.since and at < self.since:
            return False
        return not (at is not None and self.until and at >= self.until)


class InboxReads:
    def __init__(self, db: Postgres, *, schema: str) -> None:
        self._db = db
        self._table = f'"{schema}".{TABLE}'

    async def stats(self, stuck_after: float) -> dict[str, Any]:
        row = await self._db.fetchrow(_STATS, stuck_after, self._table)
        assert row is not None
        oldest, exact = row["oldest_pending"], row["rows_upto"]
        return {
            "pending": row["pending"],
            "stuck": row["stuck"],
            "failed": row["failed"],
            "oldest_pending_age_seconds": round((row["now"] - oldest).total_seconds(), 1) if oldest else None,
            "rows": exact if exact is not None and exact < _EXACT_UPTO else row["rows_estimate"],
        }

    async def stuck(self, older_than: float, after: tuple[datetime, int], limit: int) -> list[SavedEvent]:
        """Stuck events not claimed right now, oldest first, after ``(received_at, id)``."""
        records = await self._db.fetch(_STUCK_PAGE, older_than, after[0], after[1], limit)
        return [saved_event(r) for r in records]

    async def failed(self, filters: Filters, limit: int) -> list[SavedEvent]:
        """Events given up on, oldest first."""
        args: list[Any] = []
        where = where_set(
            [FAILED],
            args,
            (
                ("event", "=", normalize_event_name(filters.event) if filters.event else None),
                ("instance", "=", filters.instance),
                ("received_at", ">=", filters.since),
                ("received_at", "<", filters.until),
            ),
        )
        args.append(limit)
        query = (
            f"SELECT {_SAVED_COLUMNS} FROM {VIEW} WHERE {where} ORDER BY received_at, id LIMIT ${len(args)}"
        )
        return [saved_event(r) for r in await self._db.fetch(query, *args)]

    async def one(self, ref: str) -> dict[str, Any]:
        """One row by id, dedup key, or a unique prefix of at least 8 hex characters; its body as received.

        :class:`LookupError` when none (or several) match, :class:`ValueError` for a malformed ref.
        """
        args: list[Any]
        if ref.isdigit():
            where, args = "id = $1", [int(ref)]
        elif _HEX.fullmatch(ref):
            # A range rather than LIKE, so that the unique index serves whatever the collation.
            where, args = "dedup_key >= $1 AND dedup_key < $2", [ref, ref + "g"]
        else:
            raise ValueError(f"{ref!r} is neither a row id nor a dedup key (or 8+ hex characters of one)")
        records = await self._db.fetch(f"SELECT * FROM {VIEW} WHERE {where} ORDER BY id LIMIT 2", *args)
        if not records:
            raise LookupError(f"no event matches {ref!r}")
        if len(records) > 1:
            raise LookupError(f"{ref!r} matches several events; give more characters")
        row = dict(records[0])
        row["payload"] = codec.from_storage(row["payload"], row.pop("payload_text", None))
        row["state"] = "processed" if row["processed_at"] else "failed" if row["failed_at"] else "pending"
        return row

    async def recent_failures(self, limit: int = 20) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._db.fetch(_FAILURES, limit)]

    async def coverage(self, window: float, settle: float) -> list[dict[str, Any]]:
        """Per instance, events of the window (minus the last ``settle`` seconds) by the channels that saw them."""
        return [dict(r) for r in await self._db.fetch(_COVERAGE, window, settle)]
