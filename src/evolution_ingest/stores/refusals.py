"""Refused bodies, kept for the operator: a refusal is never silent.

Every body the webhook answers with a 4xx, and every RabbitMQ message settled without
being processed (not JSON, not an Evolution event, a row Postgres cannot store), is
kept in ``evolution_ingest_refusals`` with its reason, source and time, secrets
removed and cut at ``REFUSAL_MAX_BYTES``. ``status`` and the dashboard list them,
``inspect refusal:<id>`` shows one, ``replay --refused`` sends them through again once
the cause is fixed. The table keeps the newest ``REFUSALS_KEEP``; older ones are dropped.

A body that parses as JSON has its secrets removed field by field (``data`` untouched, so
a replay finds the same dedup key as a copy from the other channel); one that does not
parse has them removed from its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from evolution_ingest.core import codec
from evolution_ingest.core.redaction import Redactor
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.postgres import Postgres, where_set

REFUSALS: Final = "evolution_ingest_refusals"
_MAX_REASON: Final = 2000

_RECORD: Final = f"""
WITH added AS (
    INSERT INTO {REFUSALS} (source, status, code, reason, origin, body, body_bytes, truncated)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
    RETURNING id
), dropped AS (
    DELETE FROM {REFUSALS} WHERE id <= (SELECT id FROM added) - $9 RETURNING 1
)
SELECT (SELECT id FROM added) AS id, (SELECT count(*) FROM dropped) AS dropped
"""

_COLUMNS: Final = "id, received_at, source, status, code, reason, origin, body_bytes, truncated, replayed_at, replay_outcome"

_SUMMARY: Final = f"""
SELECT count(*) AS kept,
       count(*) FILTER (WHERE received_at > now() - interval '24 hours') AS last_24h,
       count(*) FILTER (WHERE replayed_at IS NULL) AS not_replayed,
       min(received_at) AS oldest, max(received_at) AS newest
  FROM {REFUSALS}
"""

_BY_CODE: Final = f"""
SELECT source, code, count(*) AS refusals FROM {REFUSALS}
 WHERE received_at > now() - interval '24 hours' GROUP BY source, code ORDER BY refusals DESC
"""


_UNAUTHORIZED: Final = f"""
SELECT reason, count(*) AS refusals, max(received_at) AS last_at FROM {REFUSALS}
 WHERE code = 'unauthorized' AND source = 'webhook' AND received_at > now() - make_interval(secs => $1)
 GROUP BY reason ORDER BY refusals DESC LIMIT 20
"""


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused body, as received."""

    source: str  # webhook | rabbitmq
    code: str
    reason: str
    body: bytes
    status: int | None = None
    #: The request path (token removed) or ``<queue> [<routing key>]``.
    origin: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayFilters:
    codes: tuple[str, ...] = ()
    source: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    #: Also bodies refused as unauthorized (they carried no valid credentials).
    unauthorized: bool = False


class RefusalLog:
    """The refusals table, written by the channels and read by the operator's views."""

    def __init__(
        self, db: Postgres, redactor: Redactor, counters: Counters, *, max_bytes: int, keep: int
    ) -> None:
        self._db = db
        self._redactor = redactor
        self._counters = counters
        self._max_bytes = max_bytes
        self._keep = keep

    def _redacted(self, raw: bytes) -> bytes:
        try:
            parsed = codec.loads(raw)
        except codec.JsonRefused:
            return self._redactor.text(raw)
        if not isinstance(parsed, dict):
            return self._redactor.text(raw)
        clean = self._redactor.body(parsed)
        if clean is parsed:
            return raw
        try:
            return codec.dumps(clean)
        except codec.JsonRefused:  # too deep to write again: redact the text instead
            return self._redactor.text(raw)

    async def record(self, refusal: Refusal) -> int:
        """Keep ``refusal``; its id. Raises ``StoreUnavailable`` when Postgres is away."""
        if len(refusal.body) > self._max_bytes:  # cut: it can be read, not replayed
            body = self._redactor.text(refusal.body[: self._max_bytes])
        else:
            body = self._redacted(refusal.body)
        truncated = len(refusal.body) > self._max_bytes or len(body) > self._max_bytes
        body = body[: self._max_bytes]
        row = await self._db.fetchrow(
            _RECORD,
            refusal.source,
            refusal.status,
            refusal.code,
            codec.label(refusal.reason[:_MAX_REASON]),
            codec.label(self._redactor.url(refusal.origin)) if refusal.origin else None,
            body,
            len(refusal.body),
            truncated,
            self._keep,
        )
        assert row is not None
        self._counters.incr("refusals:recorded")
        self._counters.incr(f"refusal:{refusal.source}:{refusal.code}")
        if row["dropped"]:
            self._counters.incr("refusals:dropped", row["dropped"])
        return int(row["id"])

    async def summary(self) -> dict[str, Any]:
        totals = await self._db.fetchrow(_SUMMARY)
        by_code = await self._db.fetch(_BY_CODE)
        assert totals is not None
        return {**dict(totals), "keep": self._keep, "last_24h_by_code": [dict(r) for r in by_code]}

    async def unauthorized_reasons(self, within_seconds: float) -> dict[str, int]:
        """Why webhook calls were refused as unauthorized lately: reason -> how many."""
        records = await self._db.fetch(_UNAUTHORIZED, within_seconds)
        return {r["reason"]: r["refusals"] for r in records}

    async def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        records = await self._db.fetch(f"SELECT {_COLUMNS} FROM {REFUSALS} ORDER BY id DESC LIMIT $1", limit)
        return [dict(r) for r in records]

    async def get(self, refusal_id: int) -> dict[str, Any] | None:
        """One refusal with its body (as text when it is UTF-8, else ``body_hex``)."""
        record = await self._db.fetchrow(f"SELECT {_COLUMNS}, body FROM {REFUSALS} WHERE id = $1", refusal_id)
        if record is None:
            return None
        row = dict(record)
        raw = bytes(row.pop("body"))
        try:
            row["body"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            row["body"], row["body_hex"] = None, raw.hex()
        return row

    async def to_replay(self, filters: ReplayFilters, limit: int) -> list[tuple[int, str, bytes, bool]]:
        """(id, source, body, truncated) of refusals not replayed yet, oldest first."""
        clauses = ["replayed_at IS NULL"]
        args: list[Any] = []
        if filters.codes:
            args.append(list(filters.codes))
            clauses.append(f"code = ANY(${len(args)})")
        elif not filters.unauthorized:
            clauses.append("code <> 'unauthorized'")
        where = where_set(
            clauses,
            args,
            (
                ("source", "=", filters.source),
                ("received_at", ">=", filters.since),
                ("received_at", "<", filters.until),
            ),
        )
        args.append(limit)
        query = (
            f"SELECT id, source, body, truncated FROM {REFUSALS} WHERE {where} ORDER BY id LIMIT ${len(args)}"
        )
        records = await self._db.fetch(query, *args)
        return [(r["id"], r["source"], bytes(r["body"]), r["truncated"]) for r in records]

    async def mark_replayed(self, refusal_id: int, outcome: str) -> None:
        await self._db.execute(
            f"UPDATE {REFUSALS} SET replayed_at = now(), replay_outcome = $2 WHERE id = $1",
            refusal_id,
            codec.label(outcome[:_MAX_REASON]),
        )
