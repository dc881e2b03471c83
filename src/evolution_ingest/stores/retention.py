"""Removing old processed events from the inbox, in batches: never an unprocessed or failed one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from evolution_ingest.stores.inbox import TABLE
from evolution_ingest.stores.postgres import Postgres

#: ``$1``: the age in seconds. Never a row that is not processed: that is the whole point.
_PROCESSED_BEFORE: Final = "processed_at IS NOT NULL AND processed_at < now() - make_interval(secs => $1)"


def _purgeable(payload_only: bool) -> str:
    return _PROCESSED_BEFORE + (" AND payload IS NOT NULL" if payload_only else "")


class Purge:
    """Deletes processed rows older than an age (or only their stored bodies, keeping the keys)."""

    def __init__(self, db: Postgres, *, payload_only: bool) -> None:
        self._db = db
        self.payload_only = payload_only

    async def count(self, older_than: float) -> int:
        return int(
            await self._db.fetchval(
                f"SELECT count(*) FROM {TABLE} WHERE {_purgeable(self.payload_only)}", older_than
            )
        )

    async def run(self, older_than: float, *, batch_size: int, progress: Callable[[int], None]) -> int:
        """Remove in id order, batch by batch; returns how many rows (or bodies) went."""
        action = (
            f"UPDATE {TABLE} AS e SET payload = NULL, payload_text = NULL FROM doomed WHERE e.id = doomed.id"
            if self.payload_only
            else f"DELETE FROM {TABLE} AS e USING doomed WHERE e.id = doomed.id"
        )
        query = (
            f"WITH doomed AS (SELECT id FROM {TABLE} WHERE id > $2 AND {_purgeable(self.payload_only)} "
            f"ORDER BY id LIMIT $3) {action} RETURNING e.id"
        )
        last_id, total = 0, 0
        while ids := [
            record["id"] for record in await self._db.fetch(query, older_than, last_id, batch_size)
        ]:
            total += len(ids)
            last_id = max(ids)
            progress(len(ids))
        return total
