"""Counters of every step, kept in Redis under a prefix (``ps:metrics:evolution:``).

Counting never touches the network on the request path: increments add up in
memory and a background task flushes them with one pipelined ``INCRBY`` per
counter every second (and once more on shutdown). While Redis is down they keep
adding up and are flushed when it returns, so a Redis outage never fails a
request and loses no count unless the process dies in between.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterable

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)


def reraise_cancellation() -> None:
    """Raise ``CancelledError`` if this task was cancelled and something swallowed it.

    A cancellation that lands exactly when a client library's own timeout fires
    can come out as that library's error; a loop that handles such errors and
    carries on would then never stop.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Counters:
    """Named counters (``webhook:processed``); see the README for the full list."""

    def __init__(self, redis: Redis, *, prefix: str, flush_interval: float = 1.0) -> None:
        self._redis = redis
        self._prefix = prefix
        self._interval = flush_interval
        self._pending: Counter[str] = Counter()
        self._redis_down = False

    @property
    def prefix(self) -> str:
        return self._prefix

    def incr(self, name: str, amount: int = 1) -> None:
        self._pending[name] += amount

    def pending(self) -> dict[str, int]:
        """Increments not yet flushed to Redis."""
        return dict(self._pending)

    async def flush(self) -> bool:
        """Send what is pending; True when Redis took it (or nothing was pending)."""
        if not self._pending:
            return True
        batch, self._pending = self._pending, Counter()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, amount in batch.items():
                    pipe.incrby(self._prefix + name, amount)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._pending.update(batch)
            if not self._redis_down:
                log.warning("counters not flushed, Redis unavailable; keeping them", error=repr(exc))
            self._redis_down = True
            return False
        self._redis_down = False
        return True

    async def run(self) -> None:
        """Flush forever (cancel to stop; :meth:`close` flushes the remainder)."""
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()
            reraise_cancellation()

    async def close(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(self._interval, 2.0)):
                await self.flush()

    async def read(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """Current values from Redis (pending increments of this process included)."""
        if names is None:
            keys = [key async for key in self._redis.scan_iter(match=self._prefix + "*", count=500)]
            wanted = sorted(k.decode() if isinstance(k, bytes) else k for k in keys)
        else:
            wanted = [self._prefix + name for name in names]
        values = await self._redis.mget(wanted) if wanted else []
        totals = {
            key.removeprefix(self._prefix): int(value or 0) for key, value in zip(wanted, values, strict=True)
        }
        for name, amount in self._pending.items():
            if names is None or name in totals:
                totals[name] = totals.get(name, 0) + amount
        return totals
