"""Backfill by itself: when it runs, over which window, and by whom.

With ``EVOLUTION_URL`` set and ``BACKFILL_ENABLED``, the process that holds the backfill lock
(a Postgres advisory lock: one active backfiller across replicas; ``up`` and ``reconcile``
compete for it) runs, per instance:

* **at start-up** — from the last event it saw of the instance (less the overlap) to now: the
  time the service was away. Instances it never heard from are left alone (their history is
  not "missed");
* **on a schedule**, every ``BACKFILL_INTERVAL_SECONDS``, a window that starts
  ``BACKFILL_OVERLAP_SECONDS`` before the previous one ended;
* **for a silent instance** — connected (``open``) but neither channel delivered for
  ``GAP_ALERT_AFTER_SECONDS`` while Evolution has newer stored messages — from its last event.

Each window ends ``BACKFILL_SETTLE_SECONDS`` ago (copies on their way are the channels'), and is
at most ``BACKFILL_MAX_WINDOW_SECONDS`` long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime, timedelta
from typing import Final

import structlog
from redis.exceptions import RedisError

from evolution_ingest.channels.backfill import NAME, Backfiller, InstanceReport
from evolution_ingest.config import Settings
from evolution_ingest.core import stored
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.stores import Stores, leadership
from evolution_ingest.stores.counters import reraise_cancellation
from evolution_ingest.stores.evolution import EvolutionApi, EvolutionError
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)

_TICK: Final = 30.0
CHANNELS: Final = ("webhook", "rabbitmq")


def api_for(settings: Settings) -> EvolutionApi | None:
    if not settings.evolution_url or settings.evolution_api_key is None:
        return None
    return EvolutionApi(
        settings.evolution_url,
        settings.evolution_api_key.get_secret_value(),
        timeout=settings.evolution_timeout_seconds,
    )


def senders(instances: list[dict[str, object]]) -> dict[str, str]:
    return {str(i["name"]): str(i["ownerJid"]) for i in instances if i.get("name") and i.get("ownerJid")}


class BackfillScheduler:
    def __init__(self, ingestion: Ingestion, stores: Stores, settings: Settings) -> None:
        self._ingestion = ingestion
        self._stores = stores
        self._settings = settings
        self._leadership = leadership(settings, "backfill", "backfiller")
        self._started = False
        self._next_schedule = 0.0
        #: Per instance, the last delivery time a silent-instance backfill already covered.
        self._silent_done: dict[str, float] = {}

    def _window_end(self, now: datetime) -> datetime:
        return now - timedelta(seconds=self._settings.backfill_settle_seconds)

    def _bounded(self, start: datetime, now: datetime) -> datetime:
        return max(start, now - timedelta(seconds=self._settings.backfill_max_window_seconds))

    async def _last_seen(self, now: datetime) -> dict[str, datetime]:
        seen = await self._stores.counters.read_last_seen()
        found = {
            instance: datetime.fromtimestamp(max(channels.get(c, 0.0) for c in CHANNELS), UTC)
            for instance, channels in seen.items()
            if instance and any(c in channels for c in CHANNELS)
        }
        if not found:  # Redis forgot (flushed, replaced): the inbox knows, more slowly
            found = await self._stores.backfills.last_received(self._bounded(now - timedelta(days=365), now))
        return found

    async def tick(self, api: EvolutionApi) -> list[InstanceReport]:
        """One look, as the leader: what is due now. Returns the runs it made."""
        now = datetime.now(UTC)
        instances = await api.instances()
        names = [str(i["name"]) for i in instances if i.get("name")]
        backfiller = Backfiller(
            self._ingestion, self._stores.backfills, api, self._settings, sender=senders(instances)
        )
        overlap = timedelta(seconds=self._settings.backfill_overlap_seconds)
        end = self._window_end(now)
        windows: dict[str, tuple[datetime, str]] = {}
        if not self._started:
            last = await self._last_seen(now)
            windows = {n: (self._bounded(last[n] - overlap, now), "startup") for n in names if n in last}
            self._started = True
            self._next_schedule = time.monotonic() + self._settings.backfill_interval_seconds
        elif time.monotonic() >= self._next_schedule:
            self._next_schedule = time.monotonic() + self._settings.backfill_interval_seconds
            interval = timedelta(seconds=self._settings.backfill_interval_seconds)
            for name in names:
                previous = await self._stores.backfills.last_window_end(name, "schedule")
                start = (previous or now - interval) - overlap
                windows[name] = (self._bounded(start, now), "schedule")
        else:
            for name, start in (await self._silent(api, now, names)).items():
                windows[name] = (self._bounded(start - overlap, now), "silent")
        windows = {n: w for n, w in windows.items() if w[0] < end}
        limit = asyncio.Semaphore(self._settings.backfill_concurrency)

        async def one(name: str, start: datetime, reason: str) -> InstanceReport:
            async with limit:
                report = await backfiller.backfill(name, start, end, reason)
            log.info(
                "backfill run", instance=name, reason=reason, window_start=start.isoformat(),
                window_end=end.isoformat(), records=report.records, ingested=report.ingested,
                already=report.already, error=report.error,
            )  # fmt: skip
            return report

        return list(await asyncio.gather(*(one(n, s, r) for n, (s, r) in windows.items())))

    async def _silent(self, api: EvolutionApi, now: datetime, names: list[str]) -> dict[str, datetime]:
        """Instances connected, silent on both channels for GAP_ALERT_AFTER_SECONDS, with newer
        stored messages: from when each was last heard."""
        after = self._settings.gap_alert_after_seconds
        seen = await self._stores.counters.read_last_seen()
        connected = {c.instance for c in await self._stores.connections.connections(now) if c.state == "open"}
        found: dict[str, datetime] = {}
        for name in names:
            channels = seen.get(name, {})
            last = max((channels.get(c, 0.0) for c in CHANNELS), default=0.0)
            if name not in connected or not last or now.timestamp() - last < after:
                continue
            if self._silent_done.get(name, 0.0) >= last:
                continue  # this silence was backfilled already; the schedule goes on
            since = datetime.fromtimestamp(last, UTC)
            where = {
                "messageTimestamp": {
                    "gte": stored.as_evolution_time(since),
                    "lte": stored.as_evolution_time(now),
                }
            }
            answer = await api.find_messages(name, {"where": where, "page": 1, "offset": 1})
            total = (
                (answer.get("messages") or {}).get("total") if isinstance(answer.get("messages"), dict) else 0
            )
            self._silent_done[name] = last
            if total:
                self._stores.counters.incr(f"{NAME}:silent_instances")
                found[name] = since
        return found

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: as the leader, what is due every ``_TICK`` seconds."""
        api = api_for(self._settings)
        if api is None or not self._settings.backfill_enabled:
            return
        try:
            while not stop.is_set():
                try:
                    if await self._leadership.acquire():
                        await self.tick(api)
                except (StoreUnavailable, EvolutionError, RedisError, OSError) as exc:
                    log.warning("backfill skipped", error=str(exc))
                except (
                    Exception
                ):  # the edge of a loop that must not end: log with the traceback, count, go on
                    self._stores.counters.incr(f"{NAME}:errors")
                    log.exception("backfill tick failed")
                reraise_cancellation()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        stop.wait(), min(_TICK, self._settings.gap_check_interval_seconds * 3)
                    )
        finally:
            await self._leadership.release()
            await api.close()
