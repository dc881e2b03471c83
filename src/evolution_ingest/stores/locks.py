"""Short-term coordination in Redis: per-event locks and "already seen" markers.

Redis only accelerates; Postgres decides. Every method here answers something
usable when Redis is unreachable (``available=False``, ``False``, or nothing),
never raises for that, and never claims a duplicate that Postgres has not seen:

* the lock (``SET NX PX`` with an owner token, renewed while business logic runs,
  released only by its owner) keeps concurrent copies of one event from working
  at the same time;
* the seen marker records, *after* Postgres committed it, that a channel's copy
  is saved and whether business logic completed, so that a later copy can be
  answered without a round trip to Postgres.

Calls from concurrent requests are sent together in one pipeline (one round trip
for many events). Keys share a hash tag, so the scripts also work on Redis Cluster.
What this process itself marked is also remembered in memory for a while
(:class:`RecentlySeen`), so that a copy of an event this process finished — the
other channel's copy, an Evolution retry — is answered without even asking Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from evolution_ingest.core.batching import Batcher
from evolution_ingest.core.events import Channel

log = structlog.get_logger(__name__)

#: Field of the seen marker set once business logic completed.
PROCESSED: Final = "processed"

# KEYS: lock, seen. ARGV: token, lock ttl ms, channel.
# Returns {acquired, processed, channel recorded}.
_ACQUIRE: Final = """
local seen = redis.call('HMGET', KEYS[2], 'processed', ARGV[3])
local processed = seen[1] and 1 or 0
local recorded = seen[2] and 1 or 0
if processed == 1 then return {0, 1, recorded} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, 0, recorded} end
return {0, 0, recorded}
"""

# KEYS: lock, seen. ARGV: token (may be empty), seen ttl ms, fields to set...
_RELEASE: Final = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if #ARGV > 2 then
  for i = 3, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], '1') end
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
"""

# KEYS: lock. ARGV: token, ttl ms.
_RENEW: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Probe:
    """What Redis knows about an event when a copy arrives."""

    #: Redis answered. When False, nothing else here means anything.
    available: bool
    #: This copy now holds the lock.
    acquired: bool = False
    #: Business logic completed (committed in Postgres before it was marked).
    processed: bool = False
    #: A copy from this channel is committed in Postgres.
    recorded: bool = False

    @property
    def busy(self) -> bool:
        """Someone else holds the lock."""
        return self.available and not self.acquired and not self.processed


UNAVAILABLE: Final = Probe(available=False)


_BITS: Final = {PROCESSED: 1, Channel.WEBHOOK.value: 2, Channel.RABBITMQ.value: 4, Channel.BACKFILL.value: 8}


class RecentlySeen:
    """Seen marks this process set (committed facts only), bounded in size and age.

    Marks are kept as bits in (expiry, bits) tuples of plain numbers: small, and
    invisible to the garbage collector, however many there are.
    """

    def __init__(self, *, capacity: int, ttl: float) -> None:
        self._capacity = capacity
        self._ttl = ttl
        self._marks: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def _bits(self, dedup_key: str) -> int:
        entry = self._marks.get(dedup_key)
        if entry is None:
            return 0
        if entry[0] < time.monotonic():
            del self._marks[dedup_key]
            return 0
        return entry[1]

    def get(self, dedup_key: str) -> frozenset[str]:
        bits = self._bits(dedup_key)
        return frozenset(mark for mark, bit in _BITS.items() if bits & bit)

    def add(self, dedup_key: str, marks: Iterable[str]) -> None:
        bits = self._bits(dedup_key)
        for mark in marks:
            bits |= _BITS[mark]
        self._marks[dedup_key] = (time.monotonic() + self._ttl, bits)
        self._marks.move_to_end(dedup_key)
        while len(self._marks) > self._capacity:
            self._marks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._marks)


class _Scripts:
    """Lua scripts run by SHA in pipelines, loaded again if Redis forgot them (a restart)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._sources = {"acquire": _ACQUIRE, "release": _RELEASE, "renew": _RENEW}
        self._sha: dict[str, str] = {}

    async def run(self, name: str, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        for attempt in (1, 2):
            if len(self._sha) < len(self._sources):
                for script, source in self._sources.items():
                    self._sha[script] = await self._redis.script_load(source)
            async with self._redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    pipe.evalsha(self._sha[name], len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
                self._sha.clear()
                continue
            for result in results:
                if isinstance(result, Exception):
                    raise result
            return list(results)
        raise AssertionError("unreachable")


class RedisLocks:
    """Event locks and seen markers. A short circuit breaker avoids waiting on a dead Redis."""

    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str,
        lock_ttl: float,
        seen_ttl: float,
        retry_after: float = 1.0,
        remember: int = 50_000,
    ) -> None:
        self._prefix = prefix
        #: Marks this process set; bounded, so memory stays flat however long it runs.
        self.recent = RecentlySeen(capacity=remember, ttl=seen_ttl)
        self._lock_ttl_ms = max(1, int(lock_ttl * 1000))
        self._seen_ttl_ms = max(1, int(seen_ttl * 1000))
        self._retry_after = retry_after
        self._down_until = 0.0
        self._scripts = _Scripts(redis)
        self._acquires: Batcher[tuple[list[str], list[Any]], Any] = Batcher(
            lambda calls: self._scripts.run("acquire", calls), max_concurrency=1
        )
        self._releases: Batcher[tuple[list[str], list[Any]], Any] = Batcher(
            lambda calls: self._scripts.run("release", calls), max_concurrency=1
        )

    @property
    def lock_ttl(self) -> float:
        return self._lock_ttl_ms / 1000

    def _keys(self, dedup_key: str) -> list[str]:
        tag = "{" + dedup_key + "}"
        return [f"{self._prefix}lock:{tag}", f"{self._prefix}seen:{tag}"]

    def _skip(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, operation: str, exc: BaseException) -> None:
        if not self._skip():
            log.warning("redis unavailable, continuing with Postgres alone", op=operation, error=repr(exc))
        self._down_until = time.monotonic() + self._retry_after

    async def acquire(self, dedup_key: str, token: str, channel: Channel | None) -> Probe:
        """Try to take the lock; also read the seen marker.

        ``channel`` is the channel of the copy (None for the reconciler and replays).
        """
        known = self.recent.get(dedup_key)
        if PROCESSED in known and (channel is None or channel.value in known):
            return Probe(True, processed=True, recorded=True)
        if self._skip():
            return UNAVAILABLE
        taking = self._acquires.submit(
            (self._keys(dedup_key), [token, self._lock_ttl_ms, channel.value if channel else "-"])
        )
        try:
            acquired, processed, recorded = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The caller is gone (a worker whose broker connection died) but the batch still runs:
            # if it takes the lock, give it back at once instead of holding it for the TTL.
            taking.add_done_callback(lambda done: self._give_back(dedup_key, token, done))
            raise
        except (RedisError, OSError) as exc:
            self._failed("acquire", exc)
            return UNAVAILABLE
        return Probe(True, bool(acquired), bool(processed), bool(recorded))

    def _give_back(self, dedup_key: str, token: str, taking: asyncio.Future[Any]) -> None:
        if not taking.cancelled() and taking.exception() is None and taking.result()[0]:
            self.release_soon(dedup_key, token)

    async def release(self, dedup_key: str, token: str | None, marks: Iterable[str] = ()) -> None:
        """Release the lock if ``token`` still owns it, and set seen marks (committed facts only)."""
        fields = list(marks)
        if fields:
            self.recent.add(dedup_key, fields)
        if (token is None and not fields) or self._skip():
            return
        try:
            await self._releases((self._keys(dedup_key), [token or "", self._seen_ttl_ms, *fields]))
        except (RedisError, OSError) as exc:
            self._failed("release", exc)

    def release_soon(self, dedup_key: str, token: str | None, marks: Iterable[str] = ()) -> None:
        """:meth:`release` without waiting for Redis: nothing that answers a caller depends on it.

        The marks are remembered in this process at once; if the process dies before Redis
        has them, the lock expires with its TTL and Postgres still knows everything.
        """
        fields = list(marks)
        if fields:
            self.recent.add(dedup_key, fields)
        if (token is None and not fields) or self._skip():
            return
        future = self._releases.submit((self._keys(dedup_key), [token or "", self._seen_ttl_ms, *fields]))
        future.add_done_callback(self._released)

    def _released(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if isinstance(exc, RedisError | OSError):
            self._failed("release", exc)
        elif exc is not None:
            log.error("releasing a lock failed", error=repr(exc))

    async def drain(self) -> None:
        """Wait for releases still on their way to Redis (at shutdown)."""
        await self._releases.drain()

    async def renew(self, dedup_key: str, token: str) -> bool:
        """Extend a lock this token still owns; False when lost or Redis is down."""
        if self._skip():
            return False
        try:
            (renewed,) = await self._scripts.run(
                "renew", [(self._keys(dedup_key)[:1], [token, self._lock_ttl_ms])]
            )
        except (RedisError, OSError) as exc:
            self._failed("renew", exc)
            return False
        return bool(renewed)
