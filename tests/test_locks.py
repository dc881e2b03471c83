"""The Redis lock and seen markers, against the real Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from evolution_ingest.core.events import Channel
from evolution_ingest.stores.locks import PROCESSED, RedisLocks
from tests.conftest import REDIS_URL
from tests.support import dead_port, wait_until

KEY = "ab" * 32


@pytest.fixture
async def redis(uid: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    yield client
    keys = [k async for k in client.scan_iter(match=f"test:{uid}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def locks_for(redis: Redis, uid: str, ttl: float = 5.0) -> RedisLocks:
    return RedisLocks(redis, prefix=f"test:{uid}:", lock_ttl=ttl, seen_ttl=60)


async def test_only_one_holder_and_only_the_owner_releases(redis: Redis, uid: str) -> None:
    locks = locks_for(redis, uid)
    first = await locks.acquire(KEY, "owner", Channel.WEBHOOK)
    second = await locks.acquire(KEY, "intruder", Channel.RABBITMQ)
    assert (first.acquired, second.acquired, second.busy) == (True, False, True)
    await locks.release(KEY, "intruder")
    assert (await locks.acquire(KEY, "third", Channel.WEBHOOK)).busy
    await locks.release(KEY, "owner")
    assert (await locks.acquire(KEY, "third", Channel.WEBHOOK)).acquired


async def test_a_lock_expires_unless_renewed_by_its_owner(redis: Redis, uid: str) -> None:
    locks = locks_for(redis, uid, ttl=0.3)
    assert (await locks.acquire(KEY, "owner", Channel.WEBHOOK)).acquired
    assert await locks.renew(KEY, "owner")
    assert not await locks.renew(KEY, "intruder")
    ttl_ms = await redis.pttl(locks.lock_key(KEY))
    assert 0 < ttl_ms <= 300

    async def free() -> bool:
        return (await locks.acquire(KEY, "next", Channel.WEBHOOK)).acquired

    await wait_until(free, within=3, message="the lock to expire")


async def test_seen_marks_tell_a_later_copy_what_postgres_committed(redis: Redis, uid: str) -> None:
    locks = locks_for(redis, uid)
    assert (await locks.acquire(KEY, "a", Channel.WEBHOOK)).acquired
    await locks.release(KEY, "a", [Channel.WEBHOOK.value])
    webhook_copy = await locks.acquire(KEY, "b", Channel.WEBHOOK)
    assert (webhook_copy.acquired, webhook_copy.recorded, webhook_copy.processed) == (True, True, False)
    await locks.release(KEY, "b", [Channel.WEBHOOK.value, PROCESSED])
    rabbit_copy = await locks.acquire(KEY, "c", Channel.RABBITMQ)
    assert (rabbit_copy.acquired, rabbit_copy.processed, rabbit_copy.recorded) == (False, True, False)
    again = await locks.acquire(KEY, "d", Channel.WEBHOOK)
    assert (again.processed, again.recorded) == (True, True)
    assert 0 < await redis.pttl(locks.seen_key(KEY)) <= 60_000


async def test_a_dead_redis_answers_unavailable_without_raising() -> None:
    client = Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0", socket_connect_timeout=0.2)
    locks = RedisLocks(client, prefix="x:", lock_ttl=1, seen_ttl=1)
    probe = await locks.acquire(KEY, "t", Channel.WEBHOOK)
    assert not probe.available
    assert not probe.busy
    assert not await locks.renew(KEY, "t")
    await locks.release(KEY, "t", [PROCESSED])
    await client.aclose()


async def test_a_caller_cancelled_while_taking_the_lock_does_not_leave_it_held(
    redis: Redis, uid: str
) -> None:
    """A worker's task cancelled mid-acquire (its broker connection died): the lock the batch took
    is given back, so the redelivered copy is not locked out for the TTL."""
    locks = locks_for(redis, uid, ttl=60.0)
    for _ in range(20):  # the cancellation lands before or after the command reached Redis
        caller = asyncio.create_task(locks.acquire(KEY, "gone", Channel.RABBITMQ))
        await asyncio.sleep(0)  # wait-ok: one turn of the loop, so that the acquire is under way
        caller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        await wait_until(lambda: _free(redis, uid), within=2, message="the lock given back")
    assert (await locks.acquire(KEY, "next", Channel.RABBITMQ)).acquired
    await locks.drain()


async def _free(redis: Redis, uid: str) -> bool:
    return not [k async for k in redis.scan_iter(match=f"test:{uid}:lock:*")]
