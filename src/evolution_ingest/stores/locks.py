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

Locks taken (and released) by concurrent requests go to Redis together: one script call
for the whole batch, so that the client's cost per command is paid once per batch, not once
per event. Every key carries the same hash tag, so a batch's keys live in one slot, as Redis
Cluster requires of a script. What this process itself marked is also remembered in
memory for a while (:class:`RecentlySeen`), so that a copy of an event this process finished
— the other channel's copy, an Evolution retry — is answered without even asking Redis.
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
#: The hash tag of every lock and seen key: one slot, so that one script may touch a batch's keys.
HASH_TAG: Final = "{ei}"

# KEYS: the lock and seen keys of each event, in pairs. ARGV: lock ttl ms, then the token and
# channel of each event. One number per event: 1 the lock is taken, 2 processed, 4 a copy from
# this channel is recorded.
_ACQUIRE: Final = """
local ttl = ARGV[1]
local out = {}
for i = 1, #KEYS / 2 do
  local marks = redis.call('HMGET', KEYS[2 * i], 'processed', ARGV[2 * i + 1])
  local bits = marks[2] and 4 or 0
  if marks[1] then
    bits = bits + 2
  elseif redis.call('SET', KEYS[2 * i - 1], ARGV[2 * i], 'NX', 'PX', ttl) then
    bits = bits + 1
  end
  out[i] = bits
end
return out
"""

# KEYS: the lock and seen keys of each event, in pairs. ARGV: seen ttl ms, then the token ('': no
# lock to release) and the fields to mark (space-separated, '': none) of each event.
_RELEASE: Final = """
local ttl = ARGV[1]
for i = 1, #KEYS / 2 do
  local token, marks = ARGV[2 * i], ARGV[2 * i + 1]
  if token ~= '' and redis.call('GET', KEYS[2 * i - 1]) == token then redis.call('DEL', KEYS[2 * i - 1]) end
  if marks ~= '' then
    for field in string.gmatch(marks, '%S+') do redis.call('HSET', KEYS[2 * i], field, '1') end
    redis.call('PEXPIRE', KEYS[2 * i], ttl)
  end
end
return #KEYS / 2
"""

# KEYS: lock. ARGV: token, ttl ms.
_RENEW: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_ACQUIRED: Final = 1
_PROCESSED_BIT: Final = 2
_RECORDED: Final = 4


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
#: Every answer Redis can give, by the bits of the acquire script (built once, not per copy).
_ANSWERS: Final = tuple(
    Probe(True, bool(bits & _ACQUIRED), bool(bits & _PROCESSED_BIT), bool(bits & _RECORDED))
    for bits in range(8)
)


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

    def bits(self, dedup_key: str) -> int:
        """The marks of ``dedup_key`` as bits (see ``_BITS``); 0 when none or expired."""
        entry = self._marks.get(dedup_key)
        if entry is None:
            return 0
        if entry[0] < time.monotonic():
            del self._marks[dedup_key]
            return 0
        return entry[1]

    def add(self, dedup_key: str, marks: Iterable[str]) -> None:
        bits = self.bits(dedup_key)
        for mark in marks:
            bits |= _BITS[mark]
        self._marks[dedup_key] = (time.monotonic() + self._ttl, bits)
        self._marks.move_to_end(dedup_key)
        while len(self._marks) > self._capacity:
            self._marks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._marks)


class _Scripts:
    """Lua scripts run by SHA, loaded again if Redis forgot them (a restart)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._sources = {"acquire": _ACQUIRE, "release": _RELEASE, "renew": _RENEW}
        self._sha: dict[str, str] = {}

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        for attempt in (1, 2):
            if len(self._sha) < len(self._sources):
                for script, source in self._sources.items():
                    self._sha[script] = await self._redis.script_load(source)
            try:
                return await self._redis.evalsha(self._sha[name], len(keys), *keys, *args)
            except NoScriptError:
                if attempt == 2:
                    raise
                self._sha.clear()
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
        self._lock_prefix = f"{prefix}lock:{HASH_TAG}:"
        self._seen_prefix = f"{prefix}seen:{HASH_TAG}:"
        #: Marks this process set; bounded, so memory stays flat however long it runs.
        self.recent = RecentlySeen(capacity=remember, ttl=seen_ttl)
        self._lock_ttl_ms = max(1, int(lock_ttl * 1000))
        self._seen_ttl_ms = max(1, int(seen_ttl * 1000))
        self._retry_after = retry_after
        self._down_until = 0.0
        self._scripts = _Scripts(redis)
        # One script call per batch; while it runs, the next batch gathers.
        self._acquires: Batcher[tuple[str, str, str], int] = Batcher(self._acquire_batch, max_concurrency=1)
        self._releases: Batcher[tuple[str, str, str], None] = Batcher(self._release_batch, max_concurrency=1)

    @property
    def lock_ttl(self) -> float:
        return self._lock_ttl_ms / 1000

    def lock_key(self, dedup_key: str) -> str:
        return self._lock_prefix + dedup_key

    def seen_key(self, dedup_key: str) -> str:
        return self._seen_prefix + dedup_key

    async def _batch(self, script: str, ttl_ms: int, calls: list[tuple[str, str, str]]) -> Any:
        """One call of ``script`` for a batch: the lock and seen keys of each event, then the TTL
        and the two arguments of each event (token and channel, or token and marks)."""
        keys: list[str] = []
        args: list[Any] = [ttl_ms]
        for dedup_key, first, second in calls:
            keys += (self._lock_prefix + dedup_key, self._seen_prefix + dedup_key)
            args += (first, second)
        return await self._scripts.run(script, keys, args)

    async def _acquire_batch(self, calls: list[tuple[str, str, str]]) -> list[int]:
        return list(await self._batch("acquire", self._lock_ttl_ms, calls))

    async def _release_batch(self, calls: list[tuple[str, str, str]]) -> list[None]:
        await self._batch("release", self._seen_ttl_ms, calls)
        return [None] * len(calls)

    def _skip(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, operation: str, exc: BaseException) -> None:
        if not self._skip():
            log.warning("redis unavailable, continuing with Postgres alone", op=operation, error=repr(exc))
        self._down_until = time.monotonic() + self._retry_after

    def known(self, dedup_key: str, channel: Channel | None) -> Probe | None:
        """What this process knows without asking Redis: the event processed (None: nothing)."""
        known = self.recent.bits(dedup_key)
        if not known & _BITS[PROCESSED]:
            return None
        recorded = channel is None or bool(known & _BITS[channel.value])
        return _ANSWERS[_PROCESSED_BIT | (_RECORDED if recorded else 0)]

    async def acquire(self, dedup_key: str, token: str, channel: Channel | None) -> Probe:
        """Try to take the lock; also read the seen marker.

        ``channel`` is the channel of the copy (None for the reconciler and replays). An event
        this process saw processed is answered from memory, without Redis.
        """
        probe = self.known(dedup_key, channel)
        if probe is not None:
            return probe
        if self._skip():
            return UNAVAILABLE
        taking = self._acquires.submit((dedup_key, token, channel.value if channel else "-"))
        try:
            bits = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The caller is gone (a worker whose broker connection died) but the batch still runs:
            # if it takes the lock, give it back at once instead of holding it for the TTL.
            taking.add_done_callback(lambda done: self._give_back(dedup_key, token, done))
            raise
        except (RedisError, OSError) as exc:
            self._failed("acquire", exc)
            return UNAVAILABLE
        return _ANSWERS[bits]

    def _give_back(self, dedup_key: str, token: str, taking: asyncio.Future[int]) -> None:
        if not taking.cancelled() and taking.exception() is None and taking.result() & _ACQUIRED:
            self.release_soon(dedup_key, token)

    async def release(self, dedup_key: str, token: str | None, marks: Iterable[str] = ()) -> None:
        """Release the lock if ``token`` still owns it, and set seen marks (committed facts only)."""
        future = self._release(dedup_key, token, marks)
        if future is None:
            return
        try:
            await future
        except (RedisError, OSError) as exc:
            self._failed("release", exc)

    def release_soon(self, dedup_key: str, token: str | None, marks: Iterable[str] = ()) -> None:
        """:meth:`release` without waiting for Redis: nothing that answers a caller depends on it.

        The marks are remembered in this process at once; if the process dies before Redis
        has them, the lock expires with its TTL and Postgres still knows everything.
        """
        future = self._release(dedup_key, token, marks)
        if future is not None:
            future.add_done_callback(self._released)

    def _release(
        self, dedup_key: str, token: str | None, marks: Iterable[str]
    ) -> asyncio.Future[None] | None:
        fields = " ".join(marks)
        if fields:
            self.recent.add(dedup_key, fields.split(" "))
        if (token is None and not fields) or self._skip():
            return None
        return self._releases.submit((dedup_key, token or "", fields))

    def _released(self, future: asyncio.Future[None]) -> None:
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
            renewed = await self._scripts.run(
                "renew", [self._lock_prefix + dedup_key], [token, self._lock_ttl_ms]
            )
        except (RedisError, OSError) as exc:
            self._failed("renew", exc)
            return False
        return bool(renewed)
