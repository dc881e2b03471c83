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
  after Redis says the event is processed (Redis only says so after the commit);
  that a copy of an already processed event came by this channel is then noted in
  the inbox in the background (bookkeeping, not safety);
* business logic runs only under a granted Postgres claim, so it runs once even
  when Redis is down or split; the Redis lock keeps concurrent copies from even
  trying, and both are renewed while a slow handler runs;
* a RabbitMQ copy that finds its event being processed in this same process waits
  for that to finish rather than coming back later through the lock-busy queue;
* expected outcomes are return values; Postgres being unreachable is the
  exception :class:`~evolution_ingest.inbox.StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from typing import Final

import structlog

from evolution_ingest.core import codec
from evolution_ingest.core.events import Channel, Event
from evolution_ingest.core.identity import Envelope, parse_envelope
from evolution_ingest.core.lease import Lease
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.core.redaction import Redactor
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import Claim, PostgresInbox, SavedRow, StoreUnavailable
from evolution_ingest.stores.locks import PROCESSED, Probe, RedisLocks

log = structlog.get_logger(__name__)

#: Counter prefix of forwarded calls (``already_saved``) in the webhook app.
INTERNAL: Final = "internal"


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


@dataclass(slots=True)
class _Work:
    #: Business logic completed (``processed_at`` committed) while this process held the event.
    processed: bool = False


def _marks(channel: Channel, processed: bool) -> list[str]:
    return [channel.value, PROCESSED] if processed else [channel.value]


class Ingestion:
    """The ingestion core; resources are passed in and owned by the caller."""

    def __init__(
        self,
        *,
        inbox: PostgresInbox,
        locks: RedisLocks,
        pipeline: HandlerPipeline,
        counters: Counters,
        redactor: Redactor | None = None,
        busy_wait_seconds: float = 5.0,
        evolution_timezone: tzinfo = UTC,
    ) -> None:
        self.inbox = inbox
        self.locks = locks
        self.pipeline = pipeline
        self.counters = counters
        self.redactor = redactor or Redactor()
        self._busy_wait = busy_wait_seconds
        self._evolution_tz = evolution_timezone
        #: Events whose business logic runs in this process: True once processed.
        self._running: dict[str, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[None]] = set()

    def envelope(self, body: object) -> Envelope:
        """An Evolution body checked and identified, with the copy to store redacted.

        Raises :class:`~evolution_ingest.identity.InvalidEvent`.
        """
        return parse_envelope(body, self.redactor.body)

    def _delivered(self, name: str, envelope: Envelope) -> None:
        self.counters.incr(f"{name}:received")
        if envelope.instance:
            self.counters.delivered(name, codec.label(envelope.instance))

    # --- external webhook -------------------------------------------------------------
    async def receive(self, envelope: Envelope, channel: Channel = Channel.WEBHOOK) -> Result:
        """Save a copy from Evolution and run business logic unless done or underway."""
        name, key = _prefix(channel), envelope.dedup_key
        self._delivered(name, envelope)
        token = uuid.uuid4()
        probe = await self._probe(name, key, str(token), channel)
        if probe.processed:
            self._note_seen(key, channel, probe)
            return self._skip(name, Outcome.DUPLICATE, key)
        if probe.busy:
            return await self._save_busy_copy(envelope, channel, probe)

        # The lock is ours, or Redis is unavailable: the Postgres claim decides.
        lock_token = str(token) if probe.acquired else None
        claim = Claim(token, self.locks.lock_ttl)
        marks: list[str] = []
        with self._working(key) as work:
            try:
                row = await self.inbox.save(envelope, channel, claim)
                marks = _marks(channel, row.processed)
                if row.processed:
                    return self._skip(name, Outcome.DUPLICATE, key, row)
                if not row.claimed:
                    return self._skip(name, Outcome.LOCKED, key, row)
                result = await self._run(envelope, row, claim, name, lock_token)
                if result.outcome is Outcome.PROCESSED:
                    work.processed = True
                    marks.append(PROCESSED)
                return result
            finally:
                self.locks.release_soon(key, lock_token, marks)

    # --- RabbitMQ: save, then the worker forwards -----------------------------------
    @asynccontextmanager
    async def hold(self, envelope: Envelope, channel: Channel = Channel.RABBITMQ) -> AsyncIterator[Hold]:
        """Save a copy and, when it still needs business logic, hold the lock while forwarding."""
        name, key = _prefix(channel), envelope.dedup_key
        self._delivered(name, envelope)
        token = str(uuid.uuid4())
        probe = await self._probe(name, key, token, channel)
        if probe.busy and await self._finished_here(key):
            probe = Probe(True, processed=True, recorded=probe.recorded)
        if probe.processed:
            self._note_seen(key, channel, probe)
            yield Hold(self._skip(name, Outcome.DUPLICATE, key).outcome, key)
            return
        if probe.busy:
            result = await self._save_busy_copy(envelope, channel, probe)
            yield Hold(result.outcome, key)
            return

        lock_token = token if probe.acquired else None
        marks: list[str] = []
        lease: Lease | None = None
        with self._working(key) as work:
            try:
                row = await self.inbox.save(envelope, channel, None)
                marks = _marks(channel, row.processed)
                if row.processed:
                    self._skip(name, Outcome.DUPLICATE, key, row)
                    yield Hold(Outcome.DUPLICATE, key, row)
                    return
                if lock_token is not None:
                    lease = self._lease(key, None, Claim(uuid.UUID(token), self.locks.lock_ttl), lock_token)
                hold = Hold(Outcome.SAVED, key, row)
                yield hold
                if hold.processed:
                    work.processed = True
                    marks.append(PROCESSED)
            finally:
                if lease is not None:
                    await lease.stop()
                self.locks.release_soon(key, lock_token, marks)

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
            self.locks.release_soon(key, None, [PROCESSED])
            return self._skip(INTERNAL, Outcome.DUPLICATE, key, row)
        if not row.claimed:
            return self._skip(INTERNAL, Outcome.LOCKED, key, row)
        with self._working(key) as work:
            result = await self._run(envelope, row, claim, INTERNAL, None)
            work.processed = result.outcome is Outcome.PROCESSED
        if work.processed:
            self.locks.release_soon(key, None, [PROCESSED])
        return result

    # --- shared steps ------------------------------------------------------------------
    async def _probe(self, name: str, key: str, token: str, channel: Channel) -> Probe:
        probe = await self.locks.acquire(key, token, channel)
        if not probe.available:
            self.counters.incr(f"{name}:redis_fallback")
        return probe

    async def _save_busy_copy(self, envelope: Envelope, channel: Channel, probe: Probe) -> Result:
        """Another copy holds the lock: make sure this one is saved, then say so."""
        name, key = _prefix(channel), envelope.dedup_key
        if probe.recorded:  # a copy from this channel is already committed
            return self._skip(name, Outcome.LOCKED, key)
        row = await self.inbox.save(envelope, channel, None)
        self.locks.release_soon(key, None, _marks(channel, row.processed))
        return self._skip(name, Outcome.DUPLICATE if row.processed else Outcome.LOCKED, key, row)

    async def _finished_here(self, key: str) -> bool:
        """If this process is running the event's business logic, wait for it: True once processed."""
        running = self._running.get(key)
        if running is None:
            return False
        try:
            return await asyncio.wait_for(asyncio.shield(running), self._busy_wait)
        except TimeoutError:
            return False

    def _note_seen(self, key: str, channel: Channel, probe: Probe) -> None:
        """A copy of a processed event came by ``channel``: note it in the inbox, in the background."""
        if probe.recorded:
            return

        async def note() -> None:
            try:
                await self.inbox.record_seen(key, channel)
                await self.locks.release(key, None, [channel.value])
            except StoreUnavailable as exc:
                log.info("channel not recorded for a processed event", dedup_key=key, error=str(exc))

        task = asyncio.create_task(note())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _skip(self, name: str, outcome: Outcome, key: str, row: SavedRow | None = None) -> Result:
        counter = {
            Outcome.DUPLICATE: "skipped_duplicate",
            Outcome.LOCKED: "skipped_locked",
            Outcome.NOT_FOUND: "not_found",
        }[outcome]
        self.counters.incr(f"{name}:{counter}")
        return Result(outcome, key, row.id if row else None)

    def _lease(self, key: str, row_id: int | None, claim: Claim, lock_token: str | None) -> Lease:
        return Lease(
            inbox=self.inbox, locks=self.locks, counters=self.counters,
            dedup_key=key, row_id=row_id, claim=claim, lock_token=lock_token,
        )  # fmt: skip

    @contextmanager
    def _working(self, key: str) -> Iterator[_Work]:
        """This process holds the event (lock or claim) from here: copies arriving meanwhile may wait."""
        work = _Work()
        finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        mine = self._running.setdefault(key, finished) is finished
        try:
            yield work
        finally:
            if mine:
                del self._running[key]
                finished.set_result(work.processed)

    async def _run(
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
        lease = self._lease(envelope.dedup_key, row.id, claim, lock_token)
        try:
            started = time.perf_counter()
            try:
                await self.pipeline.run(event)
            except Exception as exc:  # handlers are user code: record, count, answer 5xx
                error = f"{type(exc).__name__}: {exc}"
                log.exception(
                    "handler failed", dedup_key=envelope.dedup_key, event_name=envelope.event,
                    instance=envelope.instance, attempt=row.attempts + 1,
                )  # fmt: skip
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
                self.counters.observe("handler_seconds", time.perf_counter() - started)
            # The lease (claim and lock) holds until processed_at is committed: no other copy
            # may start the logic again while a brief Postgres outage delays the record.
            lease.recording = True
            await self._mark_processed(row.id)
        finally:
            await lease.stop()
        self.counters.incr(f"{name}:processed")
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
        self.counters.observe("end_to_end_seconds", (datetime.now(UTC) - emitted).total_seconds())

    async def _mark_processed(self, row_id: int) -> None:
        """Business logic ran: record it, riding out a Postgres outage shorter than the lock TTL.

        The lease keeps the event's claim and lock meanwhile; giving up earlier would let a
        retry run the logic a second time although nothing crashed.
        """
        deadline = time.monotonic() + self.locks.lock_ttl
        delay = 0.05
        while True:
            try:
                await self.inbox.mark_processed(row_id)
                return
            except StoreUnavailable:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                log.warning("business logic ran; recording it again after a Postgres error", row_id=row_id)
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 2.0)

    async def drain(self) -> None:
        """Wait for background bookkeeping (at shutdown)."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.inbox.drain()
        await self.locks.drain()
