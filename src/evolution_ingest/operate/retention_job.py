"""Retention, applied by itself: one active process across replicas, in bounded steps.

Every ``RETENTION_INTERVAL_SECONDS`` the leader (a Postgres advisory lock, as for the
reconciler's backfill) makes the partitions of bodies for the next spans, drops the partitions
past ``RETENTION_BODIES_SECONDS`` (bodies of unprocessed events are kept with their row), empties
the bodies saved before partitioning, and deletes processed rows past
``RETENTION_ROWS_SECONDS`` in batches of ``RETENTION_BATCH_SIZE`` with a pause between them. Each
step is counted (``retention:*``); long work logs a progress line every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Final

import asyncpg
import structlog

from evolution_ingest.config import Settings
from evolution_ingest.stores import leadership
from evolution_ingest.stores.counters import Counters, reraise_cancellation
from evolution_ingest.stores.postgres import StoreUnavailable
from evolution_ingest.stores.retention import Retention, Step, partitions_ahead

log = structlog.get_logger(__name__)

_PROGRESS_EVERY: Final = 10.0


class RetentionJob:
    def __init__(self, retention: Retention, counters: Counters, settings: Settings) -> None:
        self._retention = retention
        self._counters = counters
        self._settings = settings
        self._leadership = leadership(settings, "retention", "retention")
        self._legacy_cleared = False
        self._stop = asyncio.Event()

    async def tick(self) -> dict[str, int]:
        """One pass of everything due; returns what it did (also counted and logged)."""
        s, done = self._settings, dict.fromkeys(
            ("partitions_created", "partitions_dropped", "bodies_dropped", "bodies_rescued",
             "bodies_emptied", "rows_deleted", "vacuums"), 0,
        )  # fmt: skip
        now = time.time()
        created = await self._retention.ensure_partitions(
            now, s.retention_partition_seconds, partitions_ahead(s)
        )
        done["partitions_created"] = len(created)
        if s.retention_enabled:
            for dropped in await self._retention.drop_partitions(now, s.retention_bodies_seconds):
                done["partitions_dropped"] += 1
                done["bodies_dropped"] += dropped.bodies
                done["bodies_rescued"] += dropped.rescued
                log.info(
                    "retention: partition of bodies dropped",
                    partition=dropped.partition.name, bodies=dropped.bodies, kept_unprocessed=dropped.rescued,
                )  # fmt: skip
            done["bodies_emptied"] += await self._retention.empty_default(
                s.retention_bodies_seconds, s.retention_batch_size
            )
            if not self._legacy_cleared:
                done["bodies_emptied"] += await self._legacy_bodies()
            done["rows_deleted"] = await self._walk(
                "rows deleted",
                lambda after: self._retention.delete_rows(
                    after, s.retention_rows_seconds, s.retention_batch_size
                ),
                until=now - s.retention_rows_seconds,
            )
        if s.retention_enabled and not await self._retention.autovacuum_on():
            await self._retention.vacuum()  # reuse the space of what was deleted and updated
            done["vacuums"] = 1
        for name, value in done.items():
            if value:
                self._counters.incr(f"retention:{name}", value)
        self._counters.incr("retention:runs")
        if any(value for name, value in done.items() if name != "vacuums"):
            log.info("retention: pass done", **done)
        return done

    async def _legacy_bodies(self) -> int:
        """Bodies kept in their row from before partitioning, once past the body retention."""
        if await self._retention.legacy_cleared():
            self._legacy_cleared = True
            return 0
        s = self._settings
        since = await self._retention.partitioned_since()
        cutoff = time.time() - s.retention_bodies_seconds
        emptied = await self._walk(
            "old bodies emptied",
            lambda after: self._retention.empty_bodies(
                after, s.retention_bodies_seconds, s.retention_batch_size, legacy_only=True
            ),
            until=min(cutoff, since.timestamp()) if since else cutoff,  # rows saved before partitioning
        )
        if since is not None and since.timestamp() <= cutoff:
            await self._retention.note_legacy_cleared()  # every pre-partitioning row was walked past
            self._legacy_cleared = True
        return emptied

    async def _walk(self, what: str, step: Step, *, until: float) -> int:
        """A walk of the store, with a progress line every few seconds."""
        started = shown = time.monotonic()
        total = 0

        def progress(count: int) -> None:
            nonlocal shown, total
            total += count
            if time.monotonic() - shown >= _PROGRESS_EVERY:
                shown = time.monotonic()
                log.info(
                    f"retention: {what} so far", count=total, per_second=round(total / (shown - started))
                )

        return await self._retention.walk(
            step,
            until=until,
            progress=progress,
            pause=self._settings.retention_batch_pause_seconds,
            stopped=self._stop.is_set,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: as the leader, a pass every ``RETENTION_INTERVAL_SECONDS``."""
        self._stop = stop
        try:
            while not stop.is_set():
                try:
                    if await self._leadership.acquire():
                        await self.tick()
                except (StoreUnavailable, OSError) as exc:
                    log.warning("retention skipped", error=str(exc))
                except asyncpg.LockNotAvailableError:
                    log.info("retention: a lock was busy; next pass")
                except (
                    Exception
                ):  # the edge of a loop that must not end: log with the traceback, count, go on
                    self._counters.incr("retention:errors")
                    log.exception("retention pass failed")
                reraise_cancellation()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.retention_interval_seconds)
        finally:
            await self._leadership.release()
