"""Retention of the inbox: partitions of bodies made ahead and dropped when old, rows removed in batches.

Bodies (``evolution_ingest_bodies``) are partitioned by ``received_at``, one partition per
``RETENTION_PARTITION_SECONDS``, named after the epoch seconds of its bounds. A partition whose
end is older than the body retention is dropped at once (a ``DROP TABLE``, no dead rows left
behind), after the bodies of events not processed yet (pending or failed) are copied to their
row: nothing that may still run loses its body. Rows (keys and states) live in an ordinary
table whose unique index keeps deciding duplicates; processed rows past the row retention are
deleted in batches walked in id order (the primary key, which follows ``received_at``), with
their route deliveries (``ON DELETE CASCADE``) and any body left.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

import asyncpg
import structlog

from evolution_ingest.config import Settings
from evolution_ingest.stores.deliveries import DELIVERIES
from evolution_ingest.stores.inbox import BODIES, TABLE
from evolution_ingest.stores.postgres import Postgres, StoreUnavailable
from evolution_ingest.stores.retention_sql import (
    DELETE_ROWS,
    EMPTY_BODIES,
    EMPTY_LEGACY_BODIES,
    OLD,
    RESCUE,
    SIZES,
)

log = structlog.get_logger(__name__)

#: One batch of a walk: given the last id looked at, (the new last id, its time, rows changed).
Step = Callable[[int], Awaitable[tuple[int, datetime | None, int]]]

PARTITION_PREFIX: Final = f"{BODIES}_p"
#: VACUUM and ANALYZE of a big table run past DATABASE_TIMEOUT_SECONDS: an hour is their bound.
_MAINTENANCE_TIMEOUT: Final = 3600.0
#: Between two batches of a walk, at least this many times the last batch's duration.
_DUTY_PAUSE: Final = 2.0
DEFAULT_PARTITION: Final = f"{BODIES}_default"


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of bodies: ``[start, end)`` in epoch seconds, which its name carries."""

    start: int
    end: int

    @property
    def name(self) -> str:
        return f"{PARTITION_PREFIX}{self.start}_{self.end}"

    @classmethod
    def named(cls, name: str) -> Partition | None:
        start, _, end = name.removeprefix(PARTITION_PREFIX).partition("_")
        if not name.startswith(PARTITION_PREFIX) or not (start.isdigit() and end.isdigit()):
            return None
        return cls(int(start), int(end))

    def bound(self, at: int) -> str:
        return datetime.fromtimestamp(at, UTC).isoformat()


@dataclass(frozen=True, slots=True)
class Dropped:
    partition: Partition
    bodies: int
    rescued: int


class Retention:
    """Partitions of bodies, batched removals, and the inbox's size (``status``, ``/metrics``)."""

    def __init__(self, db: Postgres, *, lock_timeout_seconds: float = 2.0) -> None:
        self._db = db
        self._lock_timeout_ms = max(1, int(lock_timeout_seconds * 1000))

    async def partitions(self) -> list[Partition]:
        records = await self._db.fetch(
            "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass($1)",
            BODIES,
        )
        found = (Partition.named(r["relname"]) for r in records)
        return sorted((p for p in found if p is not None), key=lambda p: p.start)

    async def ensure_partitions(self, now: float, span: float, ahead: float) -> list[Partition]:
        """Create partitions from the last one (or the current span) until ``now + ahead``.

        A body saved while its partition was missing sits in the default partition; the next
        partition then starts after it, and the default keeps that stretch.
        """
        step = max(1, int(span))
        existing = await self.partitions()
        start = existing[-1].end if existing else int(now // step * step)
        created = []
        while start < now + ahead:
            stray = await self._db.fetchval(
                f"SELECT max(received_at) FROM {DEFAULT_PARTITION} WHERE received_at >= to_timestamp($1)",
                start,
            )
            if stray is not None:
                start = max(start, math.floor(stray.timestamp()) + 1)
            partition = Partition(start, (start // step + 1) * step)
            await self._create(partition)
            created.append(partition)
            start = partition.end
        return created

    async def _create(self, partition: Partition) -> None:
        # Made alone, then attached: ATTACH does not block saves (CREATE ... PARTITION OF would).
        async with self._db.connection() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = {self._lock_timeout_ms}")
            await conn.execute(f'CREATE TABLE "{partition.name}" (LIKE {BODIES} INCLUDING DEFAULTS)')
            await conn.execute(
                f'ALTER TABLE {BODIES} ATTACH PARTITION "{partition.name}" FOR VALUES '
                f"FROM ('{partition.bound(partition.start)}') TO ('{partition.bound(partition.end)}')"
            )

    async def drop_partitions(self, now: float, older_than: float) -> list[Dropped]:
        """Drop every partition whose end is older than ``older_than`` seconds, oldest first."""
        dropped = []
        for partition in await self.partitions():
            if partition.end > now - older_than:
                break
            dropped.append(await self._drop(partition))
        return dropped

    async def _drop(self, partition: Partition) -> Dropped:
        await self._estimate_ready(partition.name)
        async with self._db.connection() as conn:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = {self._lock_timeout_ms}")
                rescued = await conn.execute(RESCUE.format(partition=partition.name))
                # Counted from the statistics: a count(*) of a day's bodies would take seconds, in here.
                bodies = await conn.fetchval(
                    "SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)",
                    partition.name,
                )
                # Emptied first, under a lock of this partition alone. A DROP locks the parent
                # table too, and holds that lock until the partition's files are gone from disk:
                # a day's bodies (a gigabyte or more) kept every save waiting for half a second.
                await conn.execute(f'TRUNCATE "{partition.name}"')
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = {self._lock_timeout_ms}")
                await conn.execute(f'DROP TABLE "{partition.name}"')
        return Dropped(partition, int(bodies), int(rescued.split()[-1]))

    async def _estimate_ready(self, name: str) -> None:
        """A partition never analyzed gets its statistics now (ANALYZE samples a big one; it reads a
        small one whole, so the count is exact there)."""
        analyzed = await self._db.fetchval(
            "SELECT reltuples >= 0 FROM pg_class WHERE oid = to_regclass($1)", name
        )
        if analyzed is False:
            await self._maintenance(f'ANALYZE "{name}"')

    async def empty_default(self, older_than: float, batch_size: int) -> int:
        """Bodies of processed events caught by the default partition, past the body retention."""
        status = await self._db.execute(
            f"DELETE FROM {DEFAULT_PARTITION} WHERE (event_id, received_at) IN ("
            f"SELECT b.event_id, b.received_at FROM {DEFAULT_PARTITION} AS b JOIN {TABLE} AS i ON i.id = b.event_id "
            "WHERE b.received_at < now() - make_interval(secs => $1) AND i.processed_at IS NOT NULL LIMIT $2)",
            older_than,
            batch_size,
        )
        return int(status.split()[-1])

    async def first_id(self) -> int:
        """Where a walk starts: just before the oldest row."""
        value = await self._db.fetchval(f"SELECT min(id) FROM {TABLE}")
        return 0 if value is None else int(value) - 1

    async def delete_rows(
        self, after_id: int, older_than: float, batch_size: int
    ) -> tuple[int, datetime | None, int]:
        """One batch of processed rows past ``older_than``: (last id looked at, its time, rows deleted)."""
        return await self._step(DELETE_ROWS, after_id, older_than, batch_size)

    async def empty_bodies(
        self, after_id: int, older_than: float, batch_size: int, *, legacy_only: bool = False
    ) -> tuple[int, datetime | None, int]:
        """One batch of bodies of processed rows past ``older_than`` (rows and keys kept);
        ``legacy_only``: only bodies kept in the row, not in a partition."""
        query = EMPTY_LEGACY_BODIES if legacy_only else EMPTY_BODIES
        return await self._step(query, after_id, older_than, batch_size)

    async def walk(
        self,
        step: Step,
        *,
        until: float,
        progress: Callable[[int], None],
        pause: float = 0.0,
        stopped: Callable[[], bool] = lambda: False,
    ) -> int:
        """Batches of ``step`` in id order from the oldest row, until the rows reached were
        received after ``until`` (epoch seconds) or none is left; ``progress`` gets each count."""
        after, total = await self.first_id(), 0
        while not stopped():
            began = time.monotonic()
            after, newest, count = await step(after)
            total += count
            progress(count)
            if newest is None or newest.timestamp() >= until:
                break
            if pause:  # and at least twice the batch's own time: a third of Postgres at most
                await asyncio.sleep(max(pause, _DUTY_PAUSE * (time.monotonic() - began)))
        return total

    async def _step(
        self, query: str, after_id: int, older_than: float, batch_size: int
    ) -> tuple[int, datetime | None, int]:
        # A step reaches into every partition of the bodies. Planned for each batch's arguments
        # (the service's connections plan so, see stores/postgres.py) it costs Postgres more than
        # it saves; its generic plan, made on the tables as they are, walks ranges of ids well.
        async with self._db.connection() as conn, conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = auto")
            record = await conn.fetchrow(query, after_id, batch_size, older_than)
        assert record is not None
        return (record["last_id"] or after_id, record["newest"], int(record["done"]))

    async def count(self, older_than: float, *, payload_only: bool) -> int:
        """Rows (or bodies) a purge of ``older_than`` would remove."""
        body = (
            f" AND (i.payload IS NOT NULL OR EXISTS (SELECT 1 FROM {BODIES} AS b WHERE b.event_id = i.id))"
            if payload_only
            else ""
        )
        query = f"SELECT count(*) FROM {TABLE} AS i WHERE {OLD.replace('$3', '$1')}{body}"
        return int(await self._db.fetchval(query, older_than))

    async def sizes(self) -> dict[str, object]:
        """Bytes of rows, bodies and deliveries (indexes and TOAST included), partitions, oldest row."""
        try:
            record = await self._db.fetchrow(SIZES)
        except asyncpg.UndefinedTableError:  # not migrated yet
            return {}
        assert record is not None
        oldest = record["oldest"]
        return {
            "rows_bytes": int(record["rows_bytes"] or 0),
            "bodies_bytes": int(record["bodies_bytes"] or 0),
            "deliveries_bytes": int(record["deliveries_bytes"] or 0),
            "partitions": int(record["partitions"]),
            "oldest_age_seconds": round((record["now"] - oldest).total_seconds(), 1) if oldest else None,
        }

    async def autovacuum_on(self) -> bool:
        """Whether the server's autovacuum runs (it reclaims the space of deleted rows for reuse)."""
        return str(await self._db.fetchval("SHOW autovacuum")).lower() == "on"

    async def vacuum(self) -> None:
        """Plain VACUUM of the rows and deliveries (no lock that blocks saves), for servers without
        autovacuum: without it, the space of deleted rows is never reused and the table grows."""
        for table in (TABLE, DELIVERIES):
            await self._maintenance(f"VACUUM (ANALYZE) {table}")

    async def _maintenance(self, statement: str) -> None:
        """A statement that takes as long as the table is big: no command timeout of its own."""
        async with self._db.connection() as conn:
            # Paced like autovacuum (a manual VACUUM runs at full speed otherwise), then reset:
            # the connection goes back to the pool.
            await conn.execute("SET vacuum_cost_delay = 2")
            try:
                await conn.execute(statement, timeout=_MAINTENANCE_TIMEOUT)
            finally:
                await conn.execute("RESET vacuum_cost_delay")

    async def legacy_cleared(self) -> bool:
        """Whether the bodies saved before partitioning have all been through the body retention."""
        return bool(
            await self._db.fetchval(
                "SELECT EXISTS (SELECT 1 FROM evolution_ingest_meta WHERE name = 'legacy_bodies_cleared')"
            )
        )

    async def partitioned_since(self) -> datetime | None:
        value = await self._db.fetchval(
            "SELECT at FROM evolution_ingest_meta WHERE name = 'bodies_partitioned'"
        )
        return value if isinstance(value, datetime) else None

    async def note_legacy_cleared(self) -> None:
        await self._db.execute(
            "INSERT INTO evolution_ingest_meta (name, at) VALUES ('legacy_bodies_cleared', now()) ON CONFLICT DO NOTHING"
        )


def partitions_ahead(settings: Settings) -> float:
    """How far ahead partitions are made: two spans and two intervals (a missed tick or two)."""
    return 2 * settings.retention_partition_seconds + 2 * settings.retention_interval_seconds


async def prepare_partitions(retention: Retention, settings: Settings) -> None:
    """Make the coming partitions now (at start-up); a failure is logged, the leader retries."""
    try:
        await retention.ensure_partitions(
            time.time(), settings.retention_partition_seconds, partitions_ahead(settings)
        )
    except (StoreUnavailable, asyncpg.PostgresError, OSError) as exc:
        log.info("partitions of bodies not prepared now; the retention leader will", error=repr(exc))
