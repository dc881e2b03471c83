"""Running the business logic of one claimed row: the handlers, the lease, then ``processed_at``."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, tzinfo

import structlog

from evolution_ingest.core.contract import Outcome, Result
from evolution_ingest.core.events import Event
from evolution_ingest.core.identity import Envelope
from evolution_ingest.core.lease import Lease, Leases
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import Claim, PostgresInbox, SavedRow
from evolution_ingest.stores.locks import RedisLocks
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)


class Runner:
    """Runs the handlers for a row whose claim the caller holds, and records the outcome."""

    def __init__(
        self,
        *,
        inbox: PostgresInbox,
        locks: RedisLocks,
        pipeline: HandlerPipeline,
        counters: Counters,
        evolution_timezone: tzinfo = UTC,
    ) -> None:
        self._inbox = inbox
        self._locks = locks
        self._pipeline = pipeline
        self._counters = counters
        self._evolution_tz = evolution_timezone
        self._leases = Leases(inbox=inbox, locks=locks, counters=counters, lease_seconds=locks.lock_ttl)

    def lease(self, key: str, row_id: int | None, claim: Claim, lock_token: str | None) -> Lease:
        """Keeps the claim (and the Redis lock) alive while work on the event goes on."""
        return self._leases.hold(key, row_id, claim, lock_token)

    async def run(
        self, envelope: Envelope, row: SavedRow, claim: Claim, name: str, lock_token: str | None
    ) -> Result:
        event = Event(
            dedup_key=envelope.dedup_key,
            event=envelope.event,
            instance=envelope.instance,
            data=envelope.data,
            payload=envelope.body,
            channel=row.channel,
            received_at=row.received_at,
            date_time=envelope.date_time,
            attempts=row.attempts,
            id=row.id,
        )
        lease = self.lease(envelope.dedup_key, row.id, claim, lock_token)
        try:
            started = time.perf_counter()
            try:
                await self._pipeline.run(event)
            except Exception as exc:  # handlers are user code: record, count, answer 5xx
                error = f"{type(exc).__name__}: {exc}"
                log.exception(
                    "handler failed", dedup_key=envelope.dedup_key, event_name=envelope.event,
                    instance=envelope.instance, attempt=row.attempts + 1,
                )  # fmt: skip
                try:
                    await self._inbox.record_failure(row.id, claim, error)
                except StoreUnavailable as store_exc:
                    log.warning(
                        "failure not recorded, Postgres unavailable",
                        dedup_key=envelope.dedup_key,
                        error=str(store_exc),
                    )
                self._counters.incr(f"{name}:failed")
                return Result(Outcome.FAILED, envelope.dedup_key, row.id, error)
            finally:
                self._counters.observe("handler_seconds", time.perf_counter() - started)
            # The lease (claim and lock) holds until processed_at is committed: no other copy
            # may start the logic again while a brief Postgres outage delays the record.
            lease.recording = True
            await self._mark_processed(row.id)
        finally:
            await lease.stop()
        self._counters.incr(f"{name}:processed")
        self._observe_end_to_end(envelope.date_time)
        return Result(Outcome.PROCESSED, envelope.dedup_key, row.id)

    def _observe_end_to_end(self, date_time: str | None) -> None:
        """From Evolution's ``date_time`` (its local time, labelled Z) to processed."""
        if not date_time:
            return
        try:
            emitted = datetime.fromisoformat(date_time).replace(tzinfo=self._evolution_tz)
        except ValueError:
            return
        self._counters.observe("end_to_end_seconds", (datetime.now(UTC) - emitted).total_seconds())

    async def _mark_processed(self, row_id: int) -> None:
        """Business logic ran: record it, riding out a Postgres outage shorter than the lock TTL.

        The lease keeps the event's claim and lock meanwhile; giving up earlier would let a
        retry run the logic a second time although nothing crashed.
        """
        deadline = time.monotonic() + self._locks.lock_ttl
        delay = 0.05
        while True:
            try:
                await self._inbox.mark_processed(row_id)
                return
            except StoreUnavailable:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                log.warning("business logic ran; recording it again after a Postgres error", row_id=row_id)
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 2.0)
