"""Events this process is working on right now, and the bookkeeping it finishes in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import structlog

from evolution_ingest.core.events import Channel
from evolution_ingest.stores.inbox import PostgresInbox
from evolution_ingest.stores.locks import Probe, RedisLocks
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Work:
    #: Business logic completed (``processed_at`` committed) while this process held the event.
    processed: bool = False


class InFlight:
    """Which events this process holds (lock or claim), so that a copy arriving meanwhile may wait."""

    def __init__(self, inbox: PostgresInbox, locks: RedisLocks, *, busy_wait_seconds: float) -> None:
        self._inbox = inbox
        self._locks = locks
        self._busy_wait = busy_wait_seconds
        #: Events whose business logic runs in this process: True once processed.
        self._running: dict[str, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[None]] = set()

    @contextmanager
    def working(self, key: str) -> Iterator[Work]:
        """This process holds the event (lock or claim) from here: copies arriving meanwhile may wait."""
        work = Work()
        finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        mine = self._running.setdefault(key, finished) is finished
        try:
            yield work
        finally:
            if mine:
                del self._running[key]
                finished.set_result(work.processed)

    async def finished_here(self, key: str) -> bool:
        """If this process is running the event's business logic, wait for it: True once processed."""
        running = self._running.get(key)
        if running is None:
            return False
        try:
            return await asyncio.wait_for(asyncio.shield(running), self._busy_wait)
        except TimeoutError:
            return False

    def note_seen(self, key: str, channel: Channel, probe: Probe) -> None:
        """A copy of a processed event came by ``channel``: note it in the inbox, in the background."""
        if probe.recorded:
            return

        async def note() -> None:
            try:
                await self._inbox.record_seen(key, channel)
                await self._locks.release(key, None, [channel.value])
            except StoreUnavailable as exc:
                log.info("channel not recorded for a processed event", dedup_key=key, error=str(exc))

        task = asyncio.create_task(note())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
