"""Backfill runs (one instance, one window each), kept to resume them and to show them; and the
inbox lookups a backfill makes before ingesting a stored message."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from evolution_ingest.core import codec
from evolution_ingest.stores.inbox import TABLE as INBOX
from evolution_ingest.stores.inbox import VIEW
from evolution_ingest.stores.postgres import Postgres

TABLE: Final = "evolution_ingest_backfill_runs"
_COLUMNS: Final = (
    "id, instance, reason, window_start, window_end, done_down_to, started_at, updated_at, finished_at, "
    "records, ingested, already, error"
)


_RUN_FIELDS: Final = ("id", "instance", "reason", "window_start", "window_end", "done_down_to", "records", "ingested",
                      "already")  # fmt: skip


@dataclass(slots=True)
class Run:
    id: int
    instance: str
    reason: str
    window_start: datetime
    window_end: datetime
    done_down_to: datetime | None = None
    records: int = 0
    ingested: int = 0
    already: int = 0

    @property
    def cursor(self) -> datetime:
        """The newest stored message still to look at."""
        return self.done_down_to or self.window_end


class BackfillRuns:
    def __init__(self, db: Postgres) -> None:
        self._db = db

    async def start(self, instance: str, reason: str, start: datetime, end: datetime) -> Run:
        run_id = await self._db.fetchval(
            f"INSERT INTO {TABLE} (instance, reason, window_start, window_end) VALUES ($1, $2, $3, $4) RETURNING id",
            codec.label(instance), reason, start, end,
        )  # fmt: skip
        return Run(int(run_id), instance, reason, start, end)

    async def unfinished(self, instance: str) -> list[Run]:
        """Runs of ``instance`` that stopped before their end (a crash, a stop, an error), oldest first."""
        records = await self._db.fetch(
            f"SELECT {_COLUMNS} FROM {TABLE} WHERE instance = $1 AND finished_at IS NULL ORDER BY id",
            instance,
        )
        return [Run(**{name: r[name] for name in _RUN_FIELDS}) for r in records]

    async def progress(self, run: Run, error: str | None = None) -> None:
        await self._db.execute(
            f"UPDATE {TABLE} SET done_down_to = $2, records = $3, ingested = $4, already = $5, error = $6, "
            "updated_at = now() WHERE id = $1",
            run.id, run.done_down_to, run.records, run.ingested, run.already, error,
        )  # fmt: skip

    async def finish(self, run: Run) -> None:
        await self.progress(run)
        await self._db.execute(f"UPDATE {TABLE} SET finished_at = now() WHERE id = $1", run.id)

    async def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        records = await self._db.fetch(f"SELECT {_COLUMNS} FROM {TABLE} ORDER BY id DESC LIMIT $1", limit)
        return [dict(r) for r in records]

    async def last_window_end(self, instance: str, reason: str) -> datetime | None:
        """Where the last finished run of this kind ended (the next scheduled one starts before it)."""
        value = await self._db.fetchval(
            f"SELECT max(window_end) FROM {TABLE} WHERE instance = $1 AND reason = $2 AND finished_at IS NOT NULL",
            instance, reason,
        )  # fmt: skip
        return value if isinstance(value, datetime) else None

    async def prune(self, keep: int = 10_000) -> None:
        await self._db.execute(f"DELETE FROM {TABLE} WHERE id <= (SELECT max(id) FROM {TABLE}) - $1", keep)

    # --- what the inbox already holds ---------------------------------------------------------
    async def known_keys(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` the inbox has a row for."""
        records = await self._db.fetch(
            f"SELECT dedup_key FROM {INBOX} WHERE dedup_key = ANY($1::text[])", keys
        )
        return {r["dedup_key"] for r in records}

    async def known_message_ids(self, instance: str, ids: list[str], since: datetime) -> set[str]:
        """Those of ``ids`` (WhatsApp message ids) received since ``since`` in a single-message
        event of ``instance``, whatever its content: for stored messages that were edited, or
        saved under a key of version 1. Reads the rows of that time range (the ``received_at``
        index), so it is kept for these few."""
        records = await self._db.fetch(
            f"SELECT DISTINCT payload->'data'->'key'->>'id' AS id FROM {VIEW} "
            "WHERE received_at >= $3 AND instance = $1 AND event IN ('messages.upsert', 'send.message') "
            "AND payload->'data'->'key'->>'id' = ANY($2::text[])",
            instance, ids, since,
        )  # fmt: skip
        return {r["id"] for r in records}

    async def received_messages(self, instance: str, since: datetime) -> bool:
        """Whether ``instance`` delivered a message (``messages.upsert``) by a channel since ``since``."""
        return bool(
            await self._db.fetchval(
                f"SELECT EXISTS (SELECT 1 FROM {INBOX} WHERE received_at >= $2 AND instance = $1 "
                "AND event = 'messages.upsert' AND channel <> 'BACKFILL')",
                instance, since,
            )
        )  # fmt: skip

    async def last_received(self, since: datetime) -> dict[str, datetime]:
        """Per instance, when its newest event since ``since`` was received (when Redis forgot)."""
        records = await self._db.fetch(
            f"SELECT instance, max(received_at) AS at FROM {INBOX} WHERE received_at >= $1 "
            "AND channel <> 'BACKFILL' AND instance <> '' GROUP BY instance",
            since,
        )
        return {r["instance"]: r["at"] for r in records}
