"""Events this process is working on right now, and the bookkeeping it finishes in the background."""

from __future__ import annotations

import asyncio
import functools
from types import TracebackType

import structlog

from evolution_ingest.core.events import Channel
from evolution_ingest.stores.inbox import PostgresInbox
from evolution_ingest.stores.locks import Probe, RedisLocks
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)


class Work:
    """This process holds one event (its lock or claim) from ``with`` to its end."""

    __slots__ = ("_key", "_mine", "_running", "processed", "waiter")

    def __init__(self, running: dict[str, Work], key: str) -> None:
        self._running = running
        self._key = key
        self._mine = False
        #: Business logic completed (``processed_at`` committed) while this process held the event.
        self.processed = False
        #: Created when another copy waits for this one (rare): its result is ``processed``.
        self.waiter: asyncio.Future[bool] | None = None

    def __enter__(self) -> Work:
        self._mine = self._running.setdefault(self._key, self) is self
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._mine:
            del self._running[self._key]
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(self.processed)


class InFlight:
    """Which events this process holds (lock or claim), so that a copy arriving meanwhile may wait."""

    def __init__(self, inbox: PostgresInbox, locks: RedisLocks, *, busy_wait_seconds: float) -> None:
        self._inbox = inbox
        self._locks = locks
        self._busy_wait = busy_wait_seconds
        #: Events whose business logic runs in this process.
        self._running: dict[str, Work] = {}

    def working(self, key: str) -> Work:
        """``with working(key) as work``: this process holds the event; copies arriving meanwhile may wait."""
        return Work(self._running, key)

    async def finished_here(self, key: str) -> bool:
        """If this process is running the event's business logic, wait for it: True once processed."""
        work = self._running.get(key)
        if work is None:
            return False
        if work.waiter is None:
            work.waiter = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(work.waiter), self._busy_wait)
        except TimeoutError:
            return False

    def note_seen(self, key: str, channel: Channel, probe: Probe) -> None:
        """A copy of a processed event came by ``channel``: note it in the inbox, in the background,
        then in Redis (a committed fact only)."""
        if probe.recorded:
            return
        noted = self._inbox.record_seen_soon(key, channel)
        noted.add_done_callback(functools.partial(self._noted, key, channel))

    def _noted(self, key: str, channel: Channel, noted: asyncio.Future[None]) -> None:
        if noted.cancelled():
            return
        exc = noted.exception()
        if exc is None:
            self._locks.release_soon(key, None, [channel.value])
        elif isinstance(exc, StoreUnavailable):
            log.info("channel not recorded for a processed event", dedup_key=key, error=str(exc))
        else:
            log.error("channel not recorded for a processed event", dedup_key=key, error=repr(exc))

    async def drain(self) -> None:
        """Nothing of its own to wait for: the stores drain their batches (see ``Ingestion.drain``)."""
