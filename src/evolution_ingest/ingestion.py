"""The one decision procedure both channels call: lock ▸ inbox ▸ save ▸ act.

Three entry points, one per kind of caller:

* :meth:`Ingestion.receive` — a copy from Evolution's webhook: save it, then run
  business logic unless it already ran or is running elsewhere.
* :meth:`Ingestion.hold` — a copy from RabbitMQ: save it and hold the lock while
  the worker forwards it to the webhook app.
* :meth:`Ingestion.process_saved` — a forward (``already_saved``) from the worker
  or the reconciler: run business logic for a row that is already saved.

Rules kept here and nowhere else:

* a copy is answered only after its raw payload is committed in Postgres, or
  after Redis says a copy from the same channel was (Redis only records that
  after the commit);
* business logic runs only under a granted Postgres claim, so it runs once even
  when Redis is down or split; the Redis lock keeps concurrent copies from even
  trying, and both are renewed while a slow handler runs;
* expected outcomes are return values; Postgres being unreachable is the
  exception :class:`~evolution_ingest.inbox.StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Final

import structlog

from evolution_ingest.events import Channel, Event
from evolution_ingest.handlers import HandlerPipeline
from evolution_ingest.identity import Envelope
from evolution_ingest.inbox import Claim, PostgresInbox, SavedRow, StoreUnavailable
from evolution_ingest.locks import PROCESSED, RedisLocks
from evolution_ingest.metrics import Counters, reraise_cancellation

log = structlog.get_logger(__name__)

#: Counter prefix of forwarded calls (``already_saved``) in the webhook app.
INTERNAL: Final = "internal"
_MARK_RETRY_DELAYS: Final = (0.05, 0.25, 1.0)


class Outcome(enum.StrEnum):
    PROCESSED = "processed"
    #: Business logic already completed for this event.
    DUPLICATE = "duplicate"
    #: Another copy holds the lock or the claim; this copy is saved.
    LOCKED = "locked"
    #: A handler raised; the row keeps the error and stays unprocessed.
    FAILED = "failed"
    #: Saved and waiting to be forwarded (RabbitMQ channel).
    SAVED = "saved"
    #: A forward for an event that has no inbox row.
    NOT_FOUND = "not_found"


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    dedup_key: str
    row_id: int | None = None
    error: str | None = None


@dataclass(slots=True)
class Hold:
    """A saved RabbitMQ copy; the lock is held until the ``hold`` block exits."""

    outcome: Outcome
    dedup_key: str
    row: SavedRow | None = None
    #: Set by the worker when the forward answered that the event is processed.
    processed: bool = field(default=False)


def _prefix(channel: Channel) -> str:
    return channel.value.lower()


class _Lease:
    """Renews the Postgres claim (and the Redis lock) while business logic runs.

    Nothing is scheduled but a timer until a third of the lease has passed, so
    the common fast handler costs no extra round trip.
    """

    def __init__(
        self,
        ingestion: Ingestion,
        dedup_key: str,
        row_id: int | None,
        claim: Claim,
        lock_token: str | None,
    ) -> None:
        self._ingestion = ingestion
        self._key = dedup_key
        self._row_id = row_id
        self._claim = claim
        self._lock_token = lock_token
        self._interval = claim.lease_seconds / 3
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._start)

    def _start(self) -> None:
        self._task = asyncio.create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            if self._row_id is not None:
                try:
                    kept = await self._ingestion.inbox.renew(self._row_id, self._claim)
                except StoreUnavailable as exc:
                    log.warning(
                        "claim not renewed, Postgres unavailable", dedup_key=self._key, error=str(exc)
                    )
                else:
                    if not kept:
                        self._ingestion.counters.incr("claim:lost")
                        log.error("claim lost while business logic runs", dedup_key=self._key)
            if self._lock_token is not None:
                await self._ingestion.locks.renew(self._key, self._lock_token)
            reraise_cancellation()
            await asyncio.sleep(self._interval)

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task


class Ingestion:
    """The ingestion core; resources are passed in and owned by the caller."""

    def __init__(
        self,
        *,
        inbox: PostgresInbox,
        locks: RedisLocks,
        pipeline: HandlerPipeline,
        counters: Counters,
    ) -> None:
        self.inbox = inbox
        self.locks = locks
        self.pipeline = pipeline
        self.counters = counters

    # --- external webhook -------------------------------------------------------------
    async def receive(self, envelope: Envelope, channel: Channel = Channel.WEBHOOK) -> Result:
        """Save a copy from Evolution and run business logic unless done or underway."""
        name, key = _prefix(channel), envelope.dedup_key
        self.counters.incr(f"{name}:received")
        token = uuid.uuid4()
        probe = await self.locks.acquire(key, str(token), channel)
        if not probe.available:
            self.counters.incr(f"{name}:redis_fallback")
        if probe.processed and probe.recorded:
            return self._skip(name, Outcome.DUPLICATE, key)
        if probe.busy and probe.recorded:
            return self._skip(name, Outcome.LOCKED, key)
        if probe.processed or probe.busy:
            row = await self.inbox.save(envelope, channel, None)
            await self.locks.release(key, None, _marks(channel, row.processed))
            return self._skip(name, Outcome.DUPLICATE if row.processed else Outcome.LOCKED, key, row)

        # The lock is ours, or Redis is unavailable: the Postgres claim decides.
        lock_token = str(token) if probe.acquired else None
        claim = Claim(token, self.locks.lock_ttl)
        marks: list[str] = []
        try:
            row = await self.inbox.save(envelope, channel, claim)
            marks = _marks(channel, row.processed)
            if row.processed:
                return self._skip(name, Outcome.DUPLICATE, key, row)
            if not row.claimed:
                return self._skip(name, Outcome.LOCKED, key, row)
            result = await self._run(envelope, row, claim, name, lock_token)
            if result.outcome is Outcome.PROCESSED:
                marks.append(PROCESSED)
            return result
        finally:
            await self.locks.release(key, lock_token, marks)

    # --- RabbitMQ: save, then the worker forwards -----------------------------------
    @asynccontextmanager
    async def hold(self, envelope: Envelope, channel: Channel = Channel.RABBITMQ) -> AsyncIterator[Hold]:
        """Save a copy and, when it still needs business logic, hold the lock while forwarding."""
        name, key = _prefix(channel), envelope.dedup_key
        self.counters.incr(f"{name}:received")
        token = str(uuid.uuid4())
        probe = await self.locks.acquire(key, token, channel)
        if not probe.available:
            self.counters.incr(f"{name}:redis_fallback")
        if probe.recorded and (probe.processed or probe.busy):
            outcome = Outcome.DUPLICATE if probe.processed else Outcome.LOCKED
            self._skip(name, outcome, key)
            yield Hold(outcome, key)
            return

        lock_token = token if probe.acquired else None
        marks: list[str] = []
        lease: _Lease | None = None
        try:
            row = await self.inbox.save(envelope, channel, None)
            marks = _marks(channel, row.processed)
            if row.processed or probe.busy:
                outcome = Outcome.DUPLICATE if row.processed else Outcome.LOCKED
                self._skip(name, outcome, key, row)
                yield Hold(outcome, key, row)
                return
            if lock_token is not None:
                lease = _Lease(self, key, None, Claim(uuid.UUID(token), self.locks.lock_ttl), lock_token)
            hold = Hold(Outcome.SAVED, key, row)
            yield hold
            if hold.processed:
                marks.append(PROCESSED)
        finally:
            if lease is not None:
                await lease.stop()
            await self.locks.release(key, lock_token, marks)

    # --- forwards from the worker and the reconciler ---------------------------------
    async def process_saved(self, envelope: Envelope) -> Result:
        """Run business logic for a saved row, unless it already ran or is running."""
        key = envelope.dedup_key
        self.counters.incr(f"{INTERNAL}:received")
        claim = Claim.new(self.locks.lock_ttl)
        row = await self.inbox.claim_saved(key, claim)
        if row is None:
            return self._skip(INTERNAL, Outcome.NOT_FOUND, key)
        if row.processed:
            await self.locks.release(key, None, [PROCESSED])
            return self._skip(INTERNAL, Outcome.DUPLICATE, key, row)
        if not row.claimed:
            return self._skip(INTERNAL, Outcome.LOCKED, key, row)
        result = await self._run(envelope, row, claim, INTERNAL, None)
        if result.outcome is Outcome.PROCESSED:
            await self.locks.release(key, None, [PROCESSED])
        return result

    # --- shared steps ------------------------------------------------------------------
    def _skip(self, name: str, outcome: Outcome, key: str, row: SavedRow | None = None) -> Result:
        counter = {
            Outcome.DUPLICATE: "skipped_duplicate",
            Outcome.LOCKED: "skipped_locked",
            Outcome.NOT_FOUND: "not_found",
        }[outcome]
        self.counters.incr(f"{name}:{counter}")
        return Result(outcome, key, row.id if row else None)

    async def _run(
        self,
        envelope: Envelope,
        row: SavedRow,
        claim: Claim,
        name: str,
        lock_token: str | None,
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
        lease = _Lease(self, envelope.dedup_key, row.id, claim, lock_token)
        try:
            await self.pipeline.run(event)
        except Exception as exc:  # handlers are user code: record, count, answer 5xx
            error = f"{type(exc).__name__}: {exc}"
            log.exception(
                "handler failed",
                dedup_key=envelope.dedup_key,
                event_name=envelope.event,
                instance=envelope.instance,
                attempt=row.attempts + 1,
            )
            try:
                await self.inbox.record_failure(row.id, claim, error)
            except StoreUnavailable as store_exc:
                log.warning(
                    "failure not recorded, Postgres unavailable",
                    dedup_key=envelope.dedup_key,
                    error=str(store_exc),
                )
            self.counters.incr(f"{name}:failed")
            return Result(Outcome.FAILED, envelope.dedup_key, row.id, error)
        finally:
            await lease.stop()
        await self._mark_processed(row.id)
        self.counters.incr(f"{name}:processed")
        return Result(Outcome.PROCESSED, envelope.dedup_key, row.id)

    async def _mark_processed(self, row_id: int) -> None:
        """Business logic ran: record it, riding out a brief Postgres outage."""
        for delay in _MARK_RETRY_DELAYS:
            try:
                await self.inbox.mark_processed(row_id)
                return
            except StoreUnavailable:
                await asyncio.sleep(delay)
        await self.inbox.mark_processed(row_id)


def _marks(channel: Channel, processed: bool) -> list[str]:
    return [channel.value, PROCESSED] if processed else [channel.value]
