"""The reconciler: finish events that were saved but never processed (a crash, an outage).

Every ``RECONCILE_INTERVAL_SECONDS`` it reads unprocessed rows saved more than
``RECONCILE_AFTER_SECONDS`` ago (oldest first, in bounded batches, skipping rows
whose claim is still alive), takes each one's lock and re-forwards it to the
webhook app with ``already_saved: true``. Business logic still runs only there,
under the row claim, so a re-forward can never make it run twice.

Only one reconciler works at a time however many replicas run: the leader holds a
Postgres advisory lock on a connection of its own; when it dies the connection
closes, the lock goes, and another replica takes over at its next interval.

A row whose business logic keeps failing is marked failed (``failed_at``) once it
has had ``RECONCILE_MAX_ATTEMPTS`` attempts, instead of being retried forever;
``replay`` sends it again once the cause is fixed. A forward that fails because
the webhook app is unreachable is not an attempt: it never marks an event failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg
import structlog

from evolution_ingest.channels.forward import Delivery, Forwarder
from evolution_ingest.config import Settings
from evolution_ingest.core import codec
from evolution_ingest.core.identity import InvalidEvent, parse_envelope
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import CONNECTION_ERRORS, TABLE, PostgresInbox, StoreUnavailable
from evolution_ingest.stores.locks import PROCESSED, RedisLocks

log = structlog.get_logger(__name__)

_NAME: Final = "reconciler"
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)

_STUCK: Final = f"""
SELECT id, dedup_key, payload, payload_text, attempts, received_at FROM {TABLE}
WHERE processed_at IS NULL AND failed_at IS NULL
  AND received_at < now() - make_interval(secs => $1)
  AND (claimed_until IS NULL OR claimed_until < now())
  AND (received_at, id) > ($2, $3)
ORDER BY received_at, id
LIMIT $4
"""

_MARK_FAILED: Final = f"""
UPDATE {TABLE} SET failed_at = now()
WHERE id = $1 AND processed_at IS NULL AND failed_at IS NULL AND attempts >= $2
"""

_FORWARD_ERROR: Final = f"""
UPDATE {TABLE} SET last_error = $2 WHERE id = $1 AND processed_at IS NULL
"""


@dataclass(frozen=True, slots=True)
class InboxRow:
    """What a re-forward needs of an inbox row."""

    id: int
    dedup_key: str
    payload: dict[str, Any] | None
    attempts: int
    received_at: datetime

    @classmethod
    def of(cls, record: asyncpg.Record) -> InboxRow:
        payload = codec.from_storage(record["payload"], record["payload_text"])
        return cls(record["id"], record["dedup_key"], payload, record["attempts"], record["received_at"])


class Resent(enum.StrEnum):
    RECOVERED = "recovered"
    #: Being processed elsewhere right now; left alone.
    LOCKED = "locked"
    #: The forward failed; the row stays for a later pass.
    FAILING = "failing"
    #: Out of attempts: marked failed.
    DEAD = "dead"


class Resender:
    """Re-forwards one saved row under its lock; shared by the reconciler and ``replay``."""

    def __init__(
        self,
        *,
        inbox: PostgresInbox,
        locks: RedisLocks,
        forwarder: Forwarder,
        counters: Counters,
        max_attempts: int,
    ) -> None:
        self._inbox = inbox
        self._locks = locks
        self._forwarder = forwarder
        self._counters = counters
        self._max_attempts = max_attempts

    async def resend(self, row: InboxRow, *, mark_dead: bool = True) -> Resent:
        if mark_dead and row.attempts >= self._max_attempts:
            return await self._give_up(row)
        try:
            envelope = dataclasses.replace(parse_envelope(row.payload), dedup_key=row.dedup_key)
        except InvalidEvent as exc:  # a purged payload, or a row written by hand
            await self._note(row, f"stored payload cannot be forwarded: {exc.reason}")
            return Resent.FAILING
        token = uuid.uuid4().hex
        probe = await self._locks.acquire(row.dedup_key, token, None)
        if probe.processed:
            return Resent.RECOVERED
        if probe.busy:
            self._counters.incr(f"{_NAME}:skipped_locked")
            return Resent.LOCKED
        done = False
        try:
            self._counters.incr(f"{_NAME}:resent")
            result = await self._forwarder.forward(envelope)
            done = result.delivery is Delivery.DONE
        finally:
            await self._locks.release(
                row.dedup_key, token if probe.acquired else None, [PROCESSED] if done else []
            )
        if done:
            self._counters.incr(f"{_NAME}:recovered")
            return Resent.RECOVERED
        if result.delivery is Delivery.LOCKED:
            self._counters.incr(f"{_NAME}:skipped_locked")
            return Resent.LOCKED
        self._counters.incr(f"{_NAME}:forward_fail")
        log.warning("re-forward failed", dedup_key=row.dedup_key, error=result.error)
        if result.status != 500:  # a 500 is the handler's failure, already recorded by the webhook app
            await self._note(row, f"re-forward failed: {result.error}")
        if mark_dead:
            async with self._inbox.connection() as conn:
                attempts = await conn.fetchval(f"SELECT attempts FROM {TABLE} WHERE id = $1", row.id)
            if attempts is not None and attempts >= self._max_attempts:
                return await self._give_up(row)
        return Resent.FAILING

    async def _give_up(self, row: InboxRow) -> Resent:
        async with self._inbox.connection() as conn:
            status = await conn.execute(_MARK_FAILED, row.id, self._max_attempts)
        if status == "UPDATE 1":
            self._counters.incr(f"{_NAME}:failed")
            log.error(
                "event marked failed after too many attempts", dedup_key=row.dedup_key, attempts=row.attempts
            )
        return Resent.DEAD

    async def _note(self, row: InboxRow, error: str) -> None:
        async with self._inbox.connection() as conn:
            await conn.execute(_FORWARD_ERROR, row.id, error[:4000])


@dataclass(slots=True)
class PassReport:
    """What one pass did (printed by ``reconcile --once``)."""

    leader: bool = True
    found: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: {outcome.value: 0 for outcome in Resent})
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "found": self.found,
            **self.outcomes,
            "seconds": round(self.seconds, 3),
        }


class Leadership:
    """A session-level advisory lock held on a dedicated connection while this process leads."""

    def __init__(self, settings: Settings) -> None:
        self._dsn = settings.database_url
        self._timeout = settings.database_timeout_seconds
        self._key = f"evolution_ingest:reconciler:{settings.database_schema}"
        self._conn: asyncpg.Connection | None = None

    async def acquire(self) -> bool:
        """True while this process holds the lock (taking it if it is free)."""
        if self._conn is not None:
            try:
                await self._conn.fetchval("SELECT 1", timeout=self._timeout)
                return True
            except (*CONNECTION_ERRORS, asyncpg.PostgresError):
                await self.release()  # the connection died, and the lock with it
        try:
            conn = await asyncpg.connect(self._dsn, timeout=self._timeout)
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"Postgres unreachable: {exc!r}") from exc
        if await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", self._key):
            self._conn = conn
            log.info("this process is now the active reconciler")
            return True
        await conn.close()
        return False

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*CONNECTION_ERRORS, asyncpg.PostgresError):
                await conn.close(timeout=self._timeout)


class Reconciler:
    def __init__(
        self, *, resender: Resender, inbox: PostgresInbox, counters: Counters, settings: Settings
    ) -> None:
        self._resender = resender
        self._inbox = inbox
        self._counters = counters
        self._settings = settings
        self.leadership = Leadership(settings)
        self.resender = resender

    async def run_once(self) -> PassReport:
        """One pass, if this process is (or becomes) the leader."""
        started = time.perf_counter()
        if not await self.leadership.acquire():
            return PassReport(leader=False)
        self._counters.incr(f"{_NAME}:runs")
        report = PassReport()
        slots = asyncio.Semaphore(self._settings.reconcile_concurrency)

        async def one(row: InboxRow) -> None:
            async with slots:
                report.outcomes[(await self._resender.resend(row)).value] += 1

        after: tuple[datetime, int] = (_EPOCH, 0)
        while report.found < self._settings.reconcile_max_per_pass:
            batch = await self._stuck(
                after,
                min(
                    self._settings.reconcile_batch_size, self._settings.reconcile_max_per_pass - report.found
                ),
            )
            if not batch:
                break
            report.found += len(batch)
            await asyncio.gather(*(one(row) for row in batch))
            after = (batch[-1].received_at, batch[-1].id)
        report.seconds = time.perf_counter() - started
        return report

    async def _stuck(self, after: tuple[datetime, int], limit: int) -> list[InboxRow]:
        async with self._inbox.connection() as conn:
            records = await conn.fetch(
                _STUCK, self._settings.reconcile_after_seconds, after[0], after[1], limit
            )
        return [InboxRow.of(record) for record in records]

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop``; a pass that cannot reach Postgres is retried at the next interval."""
        try:
            while not stop.is_set():
                try:
                    report = await self.run_once()
                except StoreUnavailable as exc:
                    log.warning("reconciler pass skipped, Postgres unavailable", error=str(exc))
                else:
                    if report.found:
                        log.info("reconciler pass", **report.as_dict())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.reconcile_interval_seconds)
        finally:
            await self.leadership.release()
        log.info("reconciler stopped")
