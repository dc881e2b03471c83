"""Group commit: many concurrent requests carried out as one statement, each caller awaiting its own answer.

There is no timer. A request starts a batch when fewer than ``max_concurrency``
batches are running; the batch takes what is waiting when its task first runs — at
the next turn of the event loop — so every request submitted in the meantime (the
rest of this turn: all the calls whose bytes arrived together) rides in it. Otherwise
a request waits and joins the next batch, which takes everything waiting when a
running one finishes. Under light load each request is its own batch (no added
latency); under heavy load batches grow by themselves and one commit serves many events.

Background work that nobody waits on (bookkeeping) may be given a ``linger``: its batch
waits that long before taking what is waiting, so that a trickle of requests makes a few
large statements instead of many of one. Each statement costs the client a round trip
whatever its size, and at moderate load that, not the rows, is most of the cost.

With a ``key``, a batch never holds two requests with the same key (a statement
cannot update one row twice); a request whose key is already in the batch waits
for the next one.

One bad request never fails the others. When a batch fails with an error that
``isolate`` says belongs to a row (bad data, a violated constraint), it is split in
halves, run again half by half, until the request that causes it fails alone: its
caller gets the error, every other caller the answer it would have had alone. The
statement must be atomic (it is: one statement), so a failed try changed nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    def __init__(
        self,
        execute: Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        key: Callable[[T], Hashable] | None = None,
        max_size: int = 256,
        max_concurrency: int = 4,
        isolate: Callable[[BaseException], bool] | None = None,
        linger: float = 0.0,
    ) -> None:
        self._execute = execute
        self._isolate = isolate
        self._key = key
        self._max_size = max_size
        self._max_concurrency = max_concurrency
        self._linger = linger
        self._waiting: deque[tuple[T, asyncio.Future[R]]] = deque()
        self._running = 0
        #: A batch's task started but not yet run: it will take what is waiting.
        self._pending: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Sizes of the batches run so far (for tests and benchmarks).
        self.batches = 0
        self.items = 0
        #: Batches split to find the request that failed them.
        self.splits = 0

    async def __call__(self, item: T) -> R:
        return await self.submit(item)

    def submit(self, item: T) -> asyncio.Future[R]:
        """Queue ``item`` without waiting; the future holds its result (or its failure)."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._start()
        return future

    def _start(self) -> None:
        if self._waiting and self._pending is None and self._running < self._max_concurrency:
            self._running += 1
            task = asyncio.create_task(self._run())
            self._pending = task
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._pending is task:  # cancelled before it ran: another one takes what waits
            self._pending = None
        self._running -= 1
        self._start()

    def _take(self) -> list[tuple[T, asyncio.Future[R]]]:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        keys: set[Hashable] = set()
        later: deque[tuple[T, asyncio.Future[R]]] = deque()
        while self._waiting and len(batch) < self._max_size:
            item, future = self._waiting.popleft()
            if future.done():  # the caller gave up (cancelled)
                continue
            key = self._key(item) if self._key is not None else None
            if key is not None and key in keys:
                later.append((item, future))
            else:
                keys.add(key)
                batch.append((item, future))
        self._waiting.extendleft(reversed(later))
        return batch

    async def _run(self) -> None:
        if self._linger and len(self._waiting) < self._max_size:
            await asyncio.sleep(self._linger)  # still pending: what is submitted meanwhile rides along
        self._pending = None
        batch = self._take()
        self._start()  # what this batch could not take (its size, a repeated key) may go at once
        if not batch:
            return
        self.batches += 1
        self.items += len(batch)
        try:
            await self._settle(batch)
        except BaseException as exc:  # cancelled while running: nobody may wait forever
            for _, future in batch:
                if not future.done():
                    future.set_exception(
                        asyncio.CancelledError() if isinstance(exc, asyncio.CancelledError) else exc
                    )
            raise

    async def _settle(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._execute([item for item, _ in batch])
        except Exception as exc:
            if len(batch) > 1 and self._isolate is not None and self._isolate(exc):
                # The halves hold different keys: they can run at once without deadlocking.
                self.splits += 1
                middle = len(batch) // 2
                await asyncio.gather(self._settle(batch[:middle]), self._settle(batch[middle:]))
                return
            for _, future in batch:  # a failure of the whole batch: every caller gets it
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    async def drain(self) -> None:
        """Wait until everything submitted so far has run."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
