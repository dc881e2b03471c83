"""Which channels deliver each instance's events: when each one last delivered, how many events
each one saw lately, and the gaps (a channel silent while the other delivers)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from redis.asyncio import Redis

from evolution_ingest.config import Settings
from evolution_ingest.operate.errors import STORE_ERRORS, failed
from evolution_ingest.stores import Stores

CHANNELS: Final = ("webhook", "rabbitmq")


async def coverage(stores: Stores, settings: Settings) -> dict[str, Any]:
    """Per instance: when each channel last delivered, and how many recent events each one saw.

    The share counts events received within ``COVERAGE_WINDOW_SECONDS``, leaving out the last
    ``COVERAGE_SETTLE_SECONDS`` (the other channel's copy of those may still be on its way).
    """
    instances: dict[str, dict[str, Any]] = {}
    now = time.time()
    try:
        last_seen = await stores.counters.read_last_seen()
    except STORE_ERRORS as exc:
        return failed(exc)
    for instance, seen in last_seen.items():
        instances[instance] = {
            "last_seen_seconds_ago": {ch: round(now - seen[ch], 1) if ch in seen else None for ch in CHANNELS}
        }
    try:
        rows = await stores.reads.coverage(settings.coverage_window_seconds, settings.coverage_settle_seconds)
    except STORE_ERRORS as exc:  # the page must work when a store is down
        return {**failed(exc), "instances": instances}
    for row in rows:
        entry = instances.setdefault(row["instance"], {"last_seen_seconds_ago": dict.fromkeys(CHANNELS)})
        events = row["events"]
        entry.update(
            events=events,
            both_channels=row["both_channels"],
            webhook_only=row["webhook_only"],
            rabbitmq_only=row["rabbitmq_only"],
            both_share=round(row["both_channels"] / events, 4) if events else None,
        )
    return {
        "ok": True,
        "window_seconds": settings.coverage_window_seconds,
        "settle_seconds": settings.coverage_settle_seconds,
        "instances": instances,
    }


@dataclass(frozen=True, slots=True)
class Gap:
    instance: str
    silent: str  # the channel that stopped
    other: str  # the channel that keeps delivering
    silent_for: float | None  # None: never delivered since the service started counting


def find_gaps(last_seen: dict[str, dict[str, float]], *, now: float, after: float) -> Iterator[Gap]:
    """Instances where one channel is silent for ``after`` seconds while the other delivers."""
    for instance, seen in last_seen.items():
        for silent, other in (CHANNELS, CHANNELS[::-1]):
            other_at, silent_at = seen.get(other), seen.get(silent)
            if other_at is None or silent_at is None or now - other_at >= after:
                continue  # a channel that never delivered is not used for this instance
            if now - silent_at >= after:
                yield Gap(instance, silent, other, round(now - silent_at, 1))


def gaps_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}gaps"


async def raised_gaps(redis: Redis, settings: Settings) -> dict[str, dict[str, float]]:
    """Gaps raised now: instance -> silent channel -> when the alert was raised (Unix time)."""
    raw = await redis.hgetall(gaps_key(settings))
    out: dict[str, dict[str, float]] = {}
    for name, value in raw.items():
        instance, _, channel = (name.decode() if isinstance(name, bytes) else name).rpartition("\t")
        out.setdefault(instance, {})[channel] = float(value)
    return out
