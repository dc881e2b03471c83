"""Gap alerts: a channel silent for an instance while the other delivers — raised once, cleared once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from evolution_ingest.config import Settings
from evolution_ingest.logic.alerts import chat_message
from evolution_ingest.logic.courier import Courier
from evolution_ingest.logic.routes_file import RoutesFile
from evolution_ingest.operate.coverage import Gap, find_gaps, gaps_key, raised_gaps
from evolution_ingest.stores.counters import Counters, reraise_cancellation
from evolution_ingest.stores.deliveries import DeliveryStatus

log = structlog.get_logger(__name__)


class Announcer:
    """Counts an alert's transition, logs it, and posts it where alerts go (``kind``: gap, instance).

    The URL is ``GAP_ALERT_WEBHOOK_URL``, or the routes file's ``alert_webhook_url``; none: log only.
    """

    def __init__(self, kind: str, counters: Counters, settings: Settings, routes: RoutesFile | None) -> None:
        self._kind = kind
        self._counters = counters
        self._url = settings.gap_alert_webhook_url or (routes.alert_webhook_url if routes else None)
        self._courier: Courier | None = Courier() if self._url else None

    async def __call__(self, what: str, instance: str, text: str, *, log_as: str, **fields: Any) -> None:
        self._counters.incr(f"alert:{self._kind}:{what}")
        log.warning(f"{log_as} {what}", instance=instance, message=text, **fields)
        if self._courier is not None and self._url:
            result = await self._courier.send(
                f"{self._kind}!{instance}", self._url, chat_message(text), timeout_seconds=10
            )
            if result.status is not DeliveryStatus.DELIVERED:
                self._counters.incr(f"alert:{self._kind}:failed")
                log.warning(f"{log_as} alert not delivered", error=result.error)

    async def close(self) -> None:
        if self._courier is not None:
            await self._courier.close()


class GapWatcher:
    """Raises an alert once when a channel goes silent for an instance, and clears it once,
    when that channel delivers again.

    Raised gaps are kept in a Redis hash: ``HSETNX`` raises, ``HDEL`` clears, so with several
    reconcilers each transition is announced by exactly one of them.
    """

    def __init__(
        self, counters: Counters, redis: Redis, settings: Settings, routes: RoutesFile | None
    ) -> None:
        self._counters = counters
        self._redis = redis
        self._settings = settings
        self._key = gaps_key(settings)
        # Posted where the routes' alerts go, unless a URL of its own is set.
        self._announcer = Announcer("gap", counters, settings, routes)

    async def check(self) -> tuple[list[Gap], list[tuple[str, str]]]:
        """One look: returns the gaps this call raised and the (instance, channel) it cleared."""
        now = time.time()
        last_seen = await self._counters.read_last_seen()
        gaps = {
            (g.instance, g.silent): g
            for g in find_gaps(last_seen, now=now, after=self._settings.gap_alert_after_seconds)
        }
        raised: list[Gap] = []
        for (instance, channel), gap in gaps.items():
            if await self._redis.hsetnx(self._key, f"{instance}\t{channel}", str(now)):
                raised.append(gap)
                await self._announce(
                    "raised",
                    instance,
                    f"evolution-ingest: no {gap.silent} deliveries for instance {instance!r} for "
                    f"{gap.silent_for:.0f} s while {gap.other} keeps delivering",
                    silent=gap.silent,
                    silent_for_seconds=gap.silent_for,
                )
        cleared: list[tuple[str, str]] = []
        for instance, channels in (await raised_gaps(self._redis, self._settings)).items():
            for channel, raised_at in channels.items():
                # Cleared only by the silent channel delivering again (not by both falling quiet).
                if last_seen.get(instance, {}).get(channel, 0.0) <= raised_at or (instance, channel) in gaps:
                    continue
                if await self._redis.hdel(self._key, f"{instance}\t{channel}"):
                    cleared.append((instance, channel))
                    await self._announce(
                        "cleared",
                        instance,
                        f"evolution-ingest: {channel} delivers again for instance {instance!r}",
                        silent=channel,
                    )
        return raised, cleared

    async def _announce(self, what: str, instance: str, text: str, **fields: Any) -> None:
        await self._announcer(what, instance, text, log_as="channel gap", **fields)

    async def run(self, stop: asyncio.Event) -> None:
        """Look every ``GAP_CHECK_INTERVAL_SECONDS`` until ``stop`` is set."""
        try:
            while not stop.is_set():
                try:
                    await self.check()
                except (RedisError, OSError) as exc:
                    log.warning("gap check skipped, Redis unavailable", error=repr(exc))
                except (
                    Exception
                ):  # the edge of a loop that must not end: log with the traceback, count, go on
                    self._counters.incr("alert:gap:errors")
                    log.exception("gap check failed")
                reraise_cancellation()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.gap_check_interval_seconds)
        finally:
            await self._announcer.close()
