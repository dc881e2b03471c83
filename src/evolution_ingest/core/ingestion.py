"""The ingestion core: every request goes through :meth:`Ingestion.ingest` — lock ▸ inbox ▸ save ▸ act.

What each request asks is in :mod:`evolution_ingest.core.contract`. Rules kept here and nowhere else:

* a copy is answered only after its raw payload is committed in Postgres, or after Redis says the
  event is processed (Redis only says so after the commit); that a copy of a processed event came
  by this channel is then noted in the inbox in the background (bookkeeping, not safety);
* business logic runs only under a granted Postgres claim, so it runs once even when Redis is down
  or split; the Redis lock keeps concurrent copies from even trying, and both are renewed while a
  slow handler runs (or a relayed copy's forward);
* a relayed copy that finds its event being processed in this same process waits for that to
  finish rather than coming back later through the lock-busy queue;
* a row Postgres refuses (its data) is the outcome ``REFUSED``, for that event alone; Postgres
  being unreachable is the exception ``StoreUnavailable``.
"""

from __future__ import annotations

from datetime import UTC, tzinfo
from typing import Final

import structlog

from evolution_ingest.core import codec
from evolution_ingest.core.contract import (
    Forwarder,
    Outcome,
    Receive,
    Relay,
    Request,
    Resend,
    Result,
    RunSaved,
)
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope, parse_envelope
from evolution_ingest.core.inflight import InFlight
from evolution_ingest.core.lease import Lease
from evolution_ingest.core.legacy import LegacyKeys
from evolution_ingest.core.pipeline import HandlerPipeline
from evolution_ingest.core.redaction import Redactor
from evolution_ingest.core.resend import Resender
from evolution_ingest.core.runner import Runner
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import Claim, PostgresInbox, SavedRow
from evolution_ingest.stores.locks import PROCESSED, Probe, RedisLocks
from evolution_ingest.stores.postgres import RowRejected, StoreUnavailable

log = structlog.get_logger(__name__)

#: Counter prefix of forwarded calls (``already_saved``) in the webhook app.
INTERNAL: Final = "internal"
_SKIPPED: Final = {
    Outcome.DUPLICATE: "skipped_duplicate",
    Outcome.LOCKED: "skipped_locked",
    Outcome.NOT_FOUND: "not_found",
}


_PREFIXES: Final = {channel: channel.value.lower() for channel in Channel}


def _prefix(channel: Channel) -> str:
    return _PREFIXES[channel]


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
        max_attempts: int = 10,
        busy_wait_seconds: float = 5.0,
        evolution_timezone: tzinfo = UTC,
        legacy_compat_seconds: float = 0.0,
    ) -> None:
        self.inbox = inbox
        self.locks = locks
        self.counters = counters
        self.redactor = redactor or Redactor()
        self._runner = Runner(
            inbox=inbox,
            locks=locks,
            pipeline=pipeline,
            counters=counters,
            evolution_timezone=evolution_timezone,
        )
        self._forwarder: Forwarder | None = None
        self._forwarding = False
        self._resend = Resender(
            inbox=inbox, locks=locks, counters=counters, max_attempts=max_attempts,
            forward=self._forward, envelope=self.envelope,
        )  # fmt: skip
        self._inflight = InFlight(inbox, locks, busy_wait_seconds=busy_wait_seconds)
        self._legacy = LegacyKeys(inbox, legacy_compat_seconds)

    def forward_with(self, forwarder: Forwarder | None) -> None:
        """How relayed and re-sent events reach the business logic, set once at assembly:
        ``forwarder`` (the webhook app of another process), or None when this process runs it
        itself (``up``: the webhook app is here)."""
        self._forwarder, self._forwarding = forwarder, True

    def envelope(self, body: object, *, dedup_key: str | None = None) -> Envelope:
        """An Evolution body checked and identified, with the copy to store redacted.

        ``dedup_key``: the key of a saved row (a forward, a re-send) — trusted, not computed.
        Raises :class:`~evolution_ingest.core.identity.InvalidEvent`.
        """
        return parse_envelope(body, self.redactor.body, key=dedup_key)

    def known(self, envelope: Envelope, channel: Channel) -> Result | None:
        """A copy of an event this process saw processed, answered at once, as :meth:`ingest`
        would (counted, and its channel noted in the background); None: ask :meth:`ingest`."""
        probe = None if self._legacy.applies(envelope) else self.locks.known(envelope.dedup_key, channel)
        if probe is None:
            return None
        self._delivered(_prefix(channel), envelope)
        return self._duplicate(channel, envelope.dedup_key, probe)

    async def ingest(self, request: Request) -> Result:
        """The one way in: what the request asks, and what came of it."""
        try:
            match request:
                case Receive(envelope, channel):
                    if self._legacy.applies(envelope):
                        envelope = await self._legacy.resolve(envelope)
                    return await self._receive(envelope, channel)
                case Relay(envelope, channel):
                    if self._legacy.applies(envelope):
                        envelope = await self._legacy.resolve(envelope)
                    return await self._relay(envelope, channel)
                case RunSaved(envelope):
                    return await self._run_saved(envelope)
                case Resend(event, give_up):
                    return await self._resend(event, give_up=give_up)
        except RowRejected as exc:
            key = request.event.dedup_key if isinstance(request, Resend) else request.envelope.dedup_key
            return Result(Outcome.REFUSED, key, error=exc.reason, code=exc.code)
        raise AssertionError(f"not a request: {request!r}")

    # --- a copy from Evolution's webhook -------------------------------------------------
    async def _receive(self, envelope: Envelope, channel: Channel) -> Result:
        name, key = _prefix(channel), envelope.dedup_key
        self._delivered(name, envelope)
        known = self.locks.known(key, channel)
        if known is not None:  # processed, as this process saw: no need to ask anyone
            return self._duplicate(channel, key, known)
        claim = Claim.new(self.locks.lock_ttl)
        probe = await self._probe(name, key, claim.token.hex, channel)
        if probe.processed:
            return self._duplicate(channel, key, probe)
        if probe.busy:
            return await self._save_busy_copy(envelope, channel, probe)
        return await self._save_and_run(envelope, channel, probe, claim, here=False)

    async def _save_and_run(
        self, envelope: Envelope, channel: Channel, probe: Probe, claim: Claim, *, here: bool
    ) -> Result:
        """Save the copy and claim its row in one statement, then run the business logic.

        ``here``: a relayed copy in a process that runs the logic itself (``up``). It is
        counted as the in-process forward it stands for (``internal:*``, ``forward_ok``); the
        save's claim replaces the forward's separate claim statement.
        """
        name, key = _prefix(channel), envelope.dedup_key
        # The lock is ours, or Redis is unavailable: the Postgres claim decides.
        lock_token = claim.token.hex if probe.acquired else None
        marks: list[str] = []
        with self._inflight.working(key) as work:
            try:
                row = await self.inbox.save(envelope, channel, claim)
                marks = _marks(channel, row.processed)
                if row.processed:
                    return self._skip(name, Outcome.DUPLICATE, key, row)
                if here:
                    result = await self._run_here(envelope, row, claim, lock_token)
                    self._count_forward(name, envelope, result)
                elif not row.claimed:
                    return self._skip(name, Outcome.LOCKED, key, row)
                else:
                    result = await self._runner.run(envelope, row, claim, name, lock_token)
                if result.outcome is Outcome.PROCESSED:
                    work.processed = True
                    marks.append(PROCESSED)
                return result
            finally:
                self.locks.release_soon(key, lock_token, marks)

    async def _run_here(
        self, envelope: Envelope, row: SavedRow, claim: Claim, lock_token: str | None
    ) -> Result:
        """What a forward to this process does with a row saved (and maybe claimed) just now."""
        self.counters.incr(f"{INTERNAL}:received")
        if not row.claimed:
            return self._skip(INTERNAL, Outcome.LOCKED, envelope.dedup_key, row)
        try:
            return await self._runner.run(envelope, row, claim, INTERNAL, lock_token)
        except StoreUnavailable as exc:
            return Result(Outcome.UNREACHABLE, envelope.dedup_key, error=str(exc))

    # --- a copy from another source: save, then the logic runs where it runs -------------
    async def _relay(self, envelope: Envelope, channel: Channel) -> Result:
        name, key = _prefix(channel), envelope.dedup_key
        self._delivered(name, envelope)
        claim = Claim.new(self.locks.lock_ttl)
        probe = await self._probe(name, key, claim.token.hex, channel)
        if probe.busy and await self._inflight.finished_here(key):
            probe = Probe(True, processed=True, recorded=probe.recorded)
        if probe.processed:
            return self._duplicate(channel, key, probe)
        if probe.busy:
            return await self._save_busy_copy(envelope, channel, probe)
        if self._forwarding and self._forwarder is None:
            return await self._save_and_run(envelope, channel, probe, claim, here=True)

        lock_token = claim.token.hex if probe.acquired else None
        marks: list[str] = []
        renewal: Lease | None = None
        with self._inflight.working(key) as work:
            try:
                row = await self.inbox.save(envelope, channel, None)
                marks = _marks(channel, row.processed)
                if row.processed:
                    return self._skip(name, Outcome.DUPLICATE, key, row)
                if lock_token is not None:  # the lock is renewed while the forward runs
                    renewal = self._runner.lease(key, None, claim, lock_token)
                result = await self._forward(name, envelope)
                if result.done:
                    work.processed = True
                    marks.append(PROCESSED)
                return result
            finally:
                if renewal is not None:
                    await renewal.stop()
                self.locks.release_soon(key, lock_token, marks)

    async def _forward(self, name: str, envelope: Envelope) -> Result:
        """Have the business logic of a saved event run: here, or by the forwarder."""
        if not self._forwarding:
            raise RuntimeError("this process forwards nothing: Ingestion.forward_with was not called")
        if self._forwarder is None:
            try:
                result = await self._run_saved(envelope)
            except StoreUnavailable as exc:
                result = Result(Outcome.UNREACHABLE, envelope.dedup_key, error=str(exc))
        else:
            result = await self._forwarder.forward(envelope)
        self._count_forward(name, envelope, result)
        return result

    def _count_forward(self, name: str, envelope: Envelope, result: Result) -> None:
        if result.done:
            self.counters.incr(f"{name}:forward_ok")
        elif result.outcome is Outcome.LOCKED:
            self.counters.incr(f"{name}:forward_locked")
        else:
            self.counters.incr(f"{name}:forward_fail")
            log.warning(
                "forward failed",
                dedup_key=envelope.dedup_key,
                outcome=result.outcome.value,
                error=result.error,
            )

    # --- a forward of a saved event (the webhook app's side) -------------------------------
    async def _run_saved(self, envelope: Envelope) -> Result:
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
        with self._inflight.working(key) as work:
            result = await self._runner.run(envelope, row, claim, INTERNAL, None)
            work.processed = result.outcome is Outcome.PROCESSED
        if work.processed:
            self.locks.release_soon(key, None, [PROCESSED])
        return result

    # --- shared steps ------------------------------------------------------------------
    def _delivered(self, name: str, envelope: Envelope) -> None:
        self.counters.incr(f"{name}:received")
        if envelope.instance:
            self.counters.delivered(name, codec.label(envelope.instance))

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

    def _duplicate(self, channel: Channel, key: str, probe: Probe) -> Result:
        """A copy of a processed event: its channel noted in the background, counted, answered."""
        self._inflight.note_seen(key, channel, probe)
        return self._skip(_prefix(channel), Outcome.DUPLICATE, key)

    def _skip(self, name: str, outcome: Outcome, key: str, row: SavedRow | None = None) -> Result:
        self.counters.incr(f"{name}:{_SKIPPED[outcome]}")
        return Result(outcome, key, row.id if row else None)

    async def drain(self) -> None:
        """Wait for background bookkeeping (at shutdown)."""
        await self._inflight.drain()
        await self.inbox.drain()
        await self.locks.drain()
