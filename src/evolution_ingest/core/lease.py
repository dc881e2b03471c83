"""Keeping a claim (and its Redis lock) alive while business logic runs longer than expected."""

from __future__ import annotations

import asyncio
from contextlib import suppress

import structlog

from evolution_ingest.stores.counters import Counters, reraise_cancellation
from evolution_ingest.stores.inbox import Claim, PostgresInbox
from evolution_ingest.stores.locks import RedisLocks
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)


class Lease:
    """Renews the Postgres claim (and the Redis lock) every third of the lease.

    Nothing is scheduled but a timer until a third of the lease has passed, so
    the common fast handler costs no extra round trip.
    """

    def __init__(
        self,
        *,
        inbox: PostgresInbox,
        locks: RedisLocks,
        counters: Counters,
        dedup_key: str,
        row_id: int | None,
        claim: Claim,
        lock_token: str | None,
    ) -> None:
        self._inbox = inbox
        self._locks = locks
        self._counters = counters
        self._key = dedup_key
        self._row_id = row_id
        self._claim = claim
        self._lock_token = lock_token
        self._interval = claim.lease_seconds / 3
        #: Set once business logic has completed: the lease only covers recording it now,
        #: and a claim that ends meanwhile was ended by that record (processed_at is set).
        self.recording = False
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._start)

    def _start(self) -> None:
        self._task = asyncio.create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            if self._row_id is not None:
                try:
                    kept = await self._inbox.renew(self._row_id, self._claim)
                except StoreUnavailable as exc:
                    log.warning(
                        "claim not renewed, Postgres unavailable", dedup_key=self._key, error=str(exc)
                    )
                else:
                    if not kept and not self.recording:
                        self._counters.incr("claim:lost")
                        log.error("claim lost while business logic runs", dedup_key=self._key)
            if self._lock_token is not None:
                await self._locks.renew(self._key, self._lock_token)
            reraise_cancellation()
            await asyncio.sleep(self._interval)

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
