"""A saved, unprocessed event sent on again (the reconciler's and ``replay``'s re-sends)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Final

import structlog

from evolution_ingest.core.contract import Outcome, Result, SavedEvent
from evolution_ingest.core.identity import Envelope, InvalidEvent
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox import PostgresInbox
from evolution_ingest.stores.locks import PROCESSED, RedisLocks

log = structlog.get_logger(__name__)

#: Counter prefix of re-sends (the reconciler's and ``replay``'s).
RESENDS: Final = "reconciler"


class Resender:
    """Takes the event's lock, has its business logic run where it runs, gives up after ``max_attempts``."""

    def __init__(
        self,
        *,
        inbox: PostgresInbox,
        locks: RedisLocks,
        counters: Counters,
        max_attempts: int,
        forward: Callable[[str, Envelope], Awaitable[Result]],
        envelope: Callable[..., Envelope],
    ) -> None:
        self._inbox = inbox
        self._locks = locks
        self._counters = counters
        self._max_attempts = max_attempts
        self._forward = forward
        self._envelope = envelope

    async def __call__(self, event: SavedEvent, *, give_up: bool) -> Result:
        key = event.dedup_key
        if give_up and event.attempts >= self._max_attempts:
            return await self._give_up(event)
        try:
            envelope = self._envelope(event.payload, dedup_key=key)
        except InvalidEvent as exc:  # a purged payload, or a row written by hand
            error = f"stored payload cannot be forwarded: {exc.reason}"
            await self._inbox.note_error(event.id, error)
            return Result(Outcome.FAILED, key, event.id, error)
        token = uuid.uuid4().hex
        probe = await self._locks.acquire(key, token, None)
        if probe.processed:
            return Result(Outcome.DUPLICATE, key, event.id)
        if probe.busy:
            self._counters.incr(f"{RESENDS}:skipped_locked")
            return Result(Outcome.LOCKED, key, event.id)
        result = Result(Outcome.UNREACHABLE, key, event.id)
        try:
            self._counters.incr(f"{RESENDS}:resent")
            result = await self._forward(RESENDS, envelope)
        finally:
            await self._locks.release(
                key, token if probe.acquired else None, [PROCESSED] if result.done else []
            )
        if result.done:
            self._counters.incr(f"{RESENDS}:recovered")
            return Result(Outcome.PROCESSED, key, event.id)
        if result.outcome is Outcome.LOCKED:
            self._counters.incr(f"{RESENDS}:skipped_locked")
            return result
        if result.outcome is not Outcome.FAILED:  # a handler's failure is already recorded by its run
            await self._inbox.note_error(event.id, f"re-forward failed: {result.error}")
        if give_up and (await self._inbox.attempts(event.id) or 0) >= self._max_attempts:
            return await self._give_up(event)
        return result

    async def _give_up(self, event: SavedEvent) -> Result:
        if await self._inbox.give_up(event.id, self._max_attempts):
            self._counters.incr(f"{RESENDS}:failed")
            log.error(
                "event marked failed after too many attempts",
                dedup_key=event.dedup_key,
                attempts=event.attempts,
            )
        return Result(Outcome.GIVEN_UP, event.dedup_key, event.id)
