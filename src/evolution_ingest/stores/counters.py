"""Counters of every step, kept in Redis under a prefix (``ps:metrics:evolution:``).

Counting never touches the network on the request path: increments add up in
memory and a background task flushes them with one pipelined ``INCRBY`` per
counter every second (and once more on shutdown). While Redis is down they keep
adding up and are flushed when it returns, so a Redis outage never fails a
request and loses no count unless the process dies in between.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import Counter
from collections.abc import Iterable
from typing import Final

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)

#: Upper bounds (seconds) of the latency histograms; one more bucket catches the rest.
BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Per-minute delivery counts are kept this long (the dashboard shows the last hour).
RATE_TTL_SECONDS: Final = 2 * 3600
#: Keys under the prefix that are not plain counters (left out of :meth:`Counters.read`).
SERIES: Final = ("hist:", "rate:", "last_seen", "webhook_paths")
LAST_SEEN: Final = "last_seen"
#: Per instance, when each of Evolution's webhooks (``instance``, ``global``) last called.
WEBHOOK_PATHS: Final = "webhook_paths"


def bucket_label(index: int) -> str:
    return "+Inf" if index == len(BUCKETS) else repr(BUCKETS[index])


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
        self._rates: Counter[str] = Counter()
        self._last_seen: dict[str, float] = {}
        self._paths: dict[str, float] = {}
        self._redis_down = False
        #: A read and a flush never interleave: a read between a flush's swap and its write would
        #: find the increments in neither place.
        self._exclusive = asyncio.Lock()
        # Names built once, not per event.
        self._histograms: dict[str, tuple[str, ...]] = {}
        self._rate_names: dict[str, tuple[int, str]] = {}
        self._seen_names: dict[tuple[str, str], str] = {}
        self._path_names: dict[tuple[str, str], tuple[str, str]] = {}

    @property
    def prefix(self) -> str:
        return self._prefix

    def incr(self, name: str, amount: int = 1) -> None:
        self._pending[name] += amount

    def observe(self, histogram: str, seconds: float) -> None:
        """One observation of a latency histogram, shared by every process through Redis.

        Buckets are kept as plain counters (``hist:<name>:<bucket>``, not cumulative),
        with ``:count`` and ``:sum_us`` beside them.
        """
        names = self._histograms.get(histogram) or self._histogram(histogram)
        seconds = max(seconds, 0.0)
        pending = self._pending
        pending[names[bisect.bisect_left(BUCKETS, seconds)]] += 1
        pending[names[-2]] += 1
        pending[names[-1]] += round(seconds * 1_000_000)

    def _histogram(self, histogram: str) -> tuple[str, ...]:
        """The counter names of ``histogram``: one per bucket, then ``:count`` and ``:sum_us``."""
        buckets = [f"hist:{histogram}:{bucket_label(i)}" for i in range(len(BUCKETS) + 1)]
        names = (*buckets, f"hist:{histogram}:count", f"hist:{histogram}:sum_us")
        self._histograms[histogram] = names
        return names

    def delivered(self, channel: str, instance: str) -> None:
        """A channel delivered an event of ``instance``: per-minute rates and last-seen times."""
        now = time.time()
        minute = int(now // 60) * 60
        rate = self._rate_names.get(channel)
        if rate is None or rate[0] != minute:
            rate = self._rate_names[channel] = (minute, f"rate:{channel}:{minute}")
        self._rates[rate[1]] += 1
        seen = self._seen_names.get((instance, channel))
        if seen is None:
            if len(self._seen_names) > 10_000:  # bounded: instances come and go
                self._seen_names.clear()
            seen = self._seen_names[(instance, channel)] = f"{instance}\t{channel}"
        self._last_seen[seen] = round(now, 3)

    def webhook_path(self, instance: str, path: str) -> None:
        """A webhook call of ``instance`` came through Evolution's ``instance`` or ``global`` webhook."""
        names = self._path_names.get((instance, path))
        if names is None:
            if len(self._path_names) > 10_000:  # bounded: instances come and go
                self._path_names.clear()
            names = self._path_names[(instance, path)] = (f"webhook:via:{path}", f"{instance}\t{path}")
        self._pending[names[0]] += 1
        self._paths[names[1]] = round(time.time(), 3)

    async def pending(self) -> dict[str, int]:
        """Increments not yet flushed to Redis (after a flush under way has kept or sent its own)."""
        async with self._exclusive:
            return dict(self._pending)

    async def flush(self) -> bool:
        """Send what is pending; True when Redis took it (or nothing was pending)."""
        async with self._exclusive:
            return await self._flush()

    async def _flush(self) -> bool:
        if not (self._pending or self._rates or self._last_seen or self._paths):
            return True
        batch, self._pending = self._pending, Counter()
        rates, self._rates = self._rates, Counter()
        seen, self._last_seen = self._last_seen, {}
        paths, self._paths = self._paths, {}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, amount in batch.items():
                    pipe.incrby(self._prefix + name, amount)
                for name, amount in rates.items():
                    pipe.incrby(self._prefix + name, amount)
                    pipe.expire(self._prefix + name, RATE_TTL_SECONDS)
                for key, times in ((LAST_SEEN, seen), (WEBHOOK_PATHS, paths)):
                    if times:
                        pipe.hset(self._prefix + key, mapping=times)  # type: ignore[arg-type]  # redis-py types values as str/bytes; it sends floats as is
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._pending.update(batch)
            self._rates.update(rates)
            self._last_seen = {**seen, **self._last_seen}
            self._paths = {**paths, **self._paths}
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
        async with self._exclusive:
            return await self._read(names)

    async def _read(self, names: Iterable[str] | None) -> dict[str, int]:
        if names is None:
            keys = [key async for key in self._redis.scan_iter(match=self._prefix + "*", count=500)]
            names_found = (k.decode() if isinstance(k, bytes) else k for k in keys)
            wanted = sorted(k for k in names_found if not k.removeprefix(self._prefix).startswith(SERIES))
        else:
            wanted = [self._prefix + name for name in names]
        values = await self._redis.mget(wanted) if wanted else []
        totals = {
            key.removeprefix(self._prefix): int(value or 0) for key, value in zip(wanted, values, strict=True)
        }
        for name, amount in self._pending.items():
            if names is None and name.startswith(SERIES):
                continue
            if names is None or name in totals:
                totals[name] = totals.get(name, 0) + amount
        return totals

    async def read_rates(self, channel: str, minutes: int = 60) -> list[tuple[int, int]]:
        """(minute start, deliveries) of ``channel`` over the last ``minutes`` minutes, oldest first."""
        now = int(time.time() // 60) * 60
        starts = [now - 60 * back for back in range(minutes - 1, -1, -1)]
        values = await self._redis.mget([f"{self._prefix}rate:{channel}:{start}" for start in starts])
        return [(start, int(value or 0)) for start, value in zip(starts, values, strict=True)]

    async def read_last_seen(self) -> dict[str, dict[str, float]]:
        """Per instance, per channel: when it last delivered (Unix time)."""
        return await self._read_times(LAST_SEEN)

    async def read_webhook_paths(self) -> dict[str, dict[str, float]]:
        """Per instance, per webhook of Evolution (``instance``, ``global``): when it last called."""
        return await self._read_times(WEBHOOK_PATHS)

    async def _read_times(self, key: str) -> dict[str, dict[str, float]]:
        async with self._exclusive:
            raw = await self._redis.hgetall(self._prefix + key)
            pending = dict(self._last_seen if key == LAST_SEEN else self._paths)
        seen: dict[str, dict[str, float]] = {}
        for field, value in raw.items():
            name = field.decode() if isinstance(field, bytes) else field
            instance, _, what = name.rpartition("\t")
            seen.setdefault(instance, {})[what] = float(value)
        for name, at in pending.items():
            instance, _, what = name.rpartition("\t")
            seen.setdefault(instance, {})[what] = max(at, seen.get(instance, {}).get(what, 0.0))
        return seen

    async def read_histogram(self, histogram: str) -> tuple[list[int], int, float]:
        """(count per bucket, not cumulative, last one +Inf), count, sum in seconds."""
        names = [f"hist:{histogram}:{bucket_label(i)}" for i in range(len(BUCKETS) + 1)]
        values = await self.read([*names, f"hist:{histogram}:count", f"hist:{histogram}:sum_us"])
        return (
            [values[n] for n in names],
            values[f"hist:{histogram}:count"],
            values[f"hist:{histogram}:sum_us"] / 1e6,
        )
