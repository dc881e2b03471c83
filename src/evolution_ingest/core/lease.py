"""Keeping a claim (and its Redis lock) alive while business logic runs longer than expected.

:class:`Leases` holds every claim of a process whose business logic is running, and renews the
ones held longer than a third of the lease. One timer serves them all: the common fast handler
costs two dictionary operations and nothing is scheduled for it.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

import structlog

from evolution_ingest.stores.counters import Counters, reraise_cancellation
from evolution_ingest.stores.inbox import Claim, PostgresInbox
from evolution_ingest.stores.locks import RedisLocks
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)


class Lease:
    """One held claim (and Redis lock); renewed by :class:`Leases` once it has been held a while."""

    __slots__ = ("_claim", "_key", "_leases", "_lock_token", "_row_id", "_task", "recording", "since")

    def __init__(
        self, leases: Leases, dedup_key: str, row_id: int | None, claim: Claim, lock_token: str | None
    ) -> None:
        self._leases = leases
        self._key = dedup_key
        self._row_id = row_id
        self._claim = claim
        self._lock_token = lock_token
        self.since = time.monotonic()
        #: Set once business logic has completed: the lease only covers recording it now,
        #: and a claim that ends meanwhile was ended by that record (processed_at is set).
        self.recording = False
        self._task: asyncio.Task[None] | None = None

    def renewing(self) -> bool:
        return self._task is not None

    def start_renewing(self, interval: float) -> None:
        self._task = asyncio.create_task(self._renew_forever(interval))

    async def _renew_forever(self, interval: float) -> None:
        inbox, locks, counters = self._leases.stores
        while True:
            if self._row_id is not None:
                try:
                    kept = await inbox.renew(self._row_id, self._claim)
                except StoreUnavailable as exc:
                    log.warning(
                        "claim not renewed, Postgres unavailable", dedup_key=self._key, error=str(exc)
                    )
                else:
                    if not kept and not self.recording:
                        counters.incr("claim:lost")
                        log.error("claim lost while business logic runs", dedup_key=self._key)
            if self._lock_token is not None:
                await locks.renew(self._key, self._lock_token)
            reraise_cancellation()
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        self._leases.release(self)
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task


class Leases:
    """The leases of one process, and the one timer that renews those held longer than a third
    of the lease (every sixth of it, it looks)."""

    def __init__(
        self, *, inbox: PostgresInbox, locks: RedisLocks, counters: Counters, lease_seconds: float
    ) -> None:
        self.stores = (inbox, locks, counters)
        self._interval = lease_seconds / 3
        self._held: dict[int, Lease] = {}
        self._timer: asyncio.TimerHandle | None = None

    def hold(self, dedup_key: str, row_id: int | None, claim: Claim, lock_token: str | None) -> Lease:
        """Keep ``claim`` (and the Redis lock of ``lock_token``) until :meth:`Lease.stop`."""
        lease = Lease(self, dedup_key, row_id, claim, lock_token)
        self._held[id(lease)] = lease
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._interval / 2, self._look)
        return lease

    def release(self, lease: Lease) -> None:
        self._held.pop(id(lease), None)

    def _look(self) -> None:
        self._timer = None
        due = time.monotonic() - self._interval
        for lease in list(self._held.values()):
            if lease.since <= due and not lease.renewing():
                lease.start_renewing(self._interval)
        if self._held:
            self._timer = asyncio.get_running_loop().call_later(self._interval / 2, self._look)
