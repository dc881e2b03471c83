"""A business-logic handler for benchmarks: counts each run per dedup key, to find lost and doubled events."""

from __future__ import annotations

import os

from redis.asyncio import Redis

from evolution_ingest.events import Event

_redis: Redis | None = None


async def count(event: Event) -> None:
    """``HINCRBY <BENCH_CALLS_KEY> <dedup_key> 1``: one field per event, its value the runs."""
    global _redis  # noqa: PLW0603 - one client per process, created on first use
    if _redis is None:
        _redis = Redis.from_url(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    await _redis.hincrby(os.environ["BENCH_CALLS_KEY"], event.dedup_key, 1)
