"""What an operator watches: Prometheus metrics, readiness, per-channel coverage and gap alerts.

Counters and latency histograms live in Redis (see :mod:`evolution_ingest.metrics`), so
every process of a deployment adds to the same figures and any webhook app's ``/metrics``
shows all of them; Prometheus may scrape one replica or all (the values agree). Gauges are
read from Postgres and RabbitMQ when scraped, at most every ``METRICS_CACHE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import aio_pika
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from evolution_ingest.channels.worker import BROKER_ERRORS
from evolution_ingest.config import Settings
from evolution_ingest.logic.alerts import chat_message
from evolution_ingest.logic.delivery import Courier, DeliveryStatus
from evolution_ingest.logic.routes_file import load_routes
from evolution_ingest.operate.views import inbox_stats, rabbitmq_status
from evolution_ingest.stores import migrations
from evolution_ingest.stores.counters import BUCKETS, Counters, reraise_cancellation
from evolution_ingest.stores.inbox import TABLE, PostgresInbox

log = structlog.get_logger(__name__)

NAMESPACE: Final = "evolution_ingest"
CHANNELS: Final = ("webhook", "rabbitmq")
HISTOGRAMS: Final = {
    "webhook_seconds": "Time to answer a webhook call or a forward that reached the ingestion core.",
    "handler_seconds": "Time the business logic (all handlers) took per run.",
    "end_to_end_seconds": "From Evolution's date_time to processed_at.",
}
_EXPOSITION: Final = "text/plain; version=0.0.4; charset=utf-8"


class Cached:
    """The last value of an async read, reused for ``ttl`` seconds; one read at a time."""

    def __init__(self, read: Callable[[], Awaitable[Any]], ttl: float) -> None:
        self._read = read
        self._ttl = ttl
        self._value: Any = None
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    async def get(self) -> Any:
        async with self._lock:
            if time.monotonic() - self._at >= self._ttl:
                self._value = await self._read()
                self._at = time.monotonic()
            return self._value


# --- coverage --------------------------------------------------------------------------

_COVERAGE: Final = f"""
SELECT instance,
       count(*) AS events,
       count(*) FILTER (WHERE webhook_seen_at IS NOT NULL AND rabbitmq_seen_at IS NOT NULL) AS both_channels,
       count(*) FILTER (WHERE rabbitmq_seen_at IS NULL) AS webhook_only,
       count(*) FILTER (WHERE webhook_seen_at IS NULL) AS rabbitmq_only
  FROM {TABLE}
 WHERE received_at >= now() - make_interval(secs => $1)
   AND received_at < now() - make_interval(secs => $2)
 GROUP BY instance
 ORDER BY instance
"""


async def coverage(inbox: PostgresInbox, counters: Counters, settings: Settings) -> dict[str, Any]:
    """Per instance: when each channel last delivered, and how many recent events each one saw.

    The share counts events received within ``COVERAGE_WINDOW_SECONDS``, leaving out the last
    ``COVERAGE_SETTLE_SECONDS`` (the other channel's copy of those may still be on its way).
    """
    instances: dict[str, dict[str, Any]] = {}
    now = time.time()
    try:
        last_seen = await counters.read_last_seen()
    except (RedisError, OSError) as exc:
        return {"ok": False, "error": f"Redis: {exc!r}"}
    for instance, seen in last_seen.items():
        instances[instance] = {
            "last_seen_seconds_ago": {ch: round(now - seen[ch], 1) if ch in seen else None for ch in CHANNELS}
        }
    try:
        async with inbox.connection() as conn:
            rows = await conn.fetch(
                _COVERAGE, settings.coverage_window_seconds, settings.coverage_settle_seconds
            )
    except Exception as exc:  # shown, never raised: the page must work when a store is down
        return {"ok": False, "error": f"Postgres: {exc!r}", "instances": instances}
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


class GapWatcher:
    """Raises an alert once when a channel goes silent for an instance, and clears it once,
    when that channel delivers again.

    Raised gaps are kept in a Redis hash: ``HSETNX`` raises, ``HDEL`` clears, so with several
    reconcilers each transition is announced by exactly one of them.
    """

    def __init__(self, counters: Counters, redis: Redis, settings: Settings) -> None:
        self._counters = counters
        self._redis = redis
        self._settings = settings
        self._key = gaps_key(settings)
        # Posted where the routes' alerts go, unless a URL of its own is set.
        routes = load_routes(settings.routes_file) if settings.routes_file else None
        self._url = settings.gap_alert_webhook_url or (routes.alert_webhook_url if routes else None)
        self._courier: Courier | None = Courier() if self._url else None

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
        self._counters.incr(f"alert:gap:{what}")
        log.warning(f"channel gap {what}", instance=instance, message=text, **fields)
        if self._courier is not None and self._url:
            result = await self._courier.send(
                f"gap!{instance}", self._url, chat_message(text), timeout_seconds=10
            )
            if result.status is not DeliveryStatus.DELIVERED:
                self._counters.incr("alert:gap:failed")
                log.warning("gap alert not delivered", error=result.error)

    async def run(self, stop: asyncio.Event) -> None:
        """Look every ``GAP_CHECK_INTERVAL_SECONDS`` until ``stop`` is set."""
        try:
            while not stop.is_set():
                try:
                    await self.check()
                except (RedisError, OSError) as exc:
                    log.warning("gap check skipped, Redis unavailable", error=repr(exc))
                except Exception:  # a watcher must not take the process down: log and look again
                    log.exception("gap check failed")
                reraise_cancellation()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.gap_check_interval_seconds)
        finally:
            if self._courier is not None:
                await self._courier.close()


# --- readiness -------------------------------------------------------------------------


class Readiness:
    """Can this process do its job now? Postgres (and migrations), Redis, RabbitMQ."""

    def __init__(self, inbox: PostgresInbox, redis: Redis, settings: Settings) -> None:
        self._inbox = inbox
        self._redis = redis
        self._settings = settings
        self._cached = Cached(self._check, settings.ready_cache_seconds)

    async def report(self) -> dict[str, Any]:
        report: dict[str, Any] = await self._cached.get()
        return report

    async def _check(self) -> dict[str, Any]:
        timeout = max(1.0, min(self._settings.database_timeout_seconds, 5.0))
        results = await asyncio.gather(
            self._bounded(self._postgres(), timeout),
            self._bounded(self._redis_ping(), timeout),
            self._bounded(self._rabbitmq(), timeout),
        )
        checks = dict(zip(("postgres", "redis", "rabbitmq"), results, strict=True))
        failing = [name for name, detail in checks.items() if detail != "ok"]
        return {"ready": not failing, "failing": failing, "checks": checks}

    @staticmethod
    async def _bounded(check: Awaitable[str], within: float) -> str:
        try:
            return await asyncio.wait_for(check, within)
        except TimeoutError:
            return f"no answer within {within:g} s"
        except Exception as exc:  # reported in the body, never raised
            return f"{type(exc).__name__}: {exc}"

    async def _postgres(self) -> str:
        async with self._inbox.connection() as conn:
            state = await migrations.state(conn, self._settings.database_schema)
        if not state.current:
            pending = ", ".join(f"{m.version:04d}_{m.name}" for m in state.pending)
            return f"migrations pending: {pending}"
        return "ok"

    async def _redis_ping(self) -> str:
        await self._redis.ping()
        return "ok"

    async def _rabbitmq(self) -> str:
        connection = await aio_pika.connect(self._settings.rabbitmq_url)
        with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
            await connection.close()
        return "ok"


# --- /metrics --------------------------------------------------------------------------

#: ``<channel>:<outcome>`` counters, as metric families with labels.
_OUTCOMES: Final = {
    "received": (
        "received",
        "Events received, per channel (internal: forwards from the worker and reconciler).",
    ),
    "processed": ("processed", "Business logic completed, per channel."),
    "failed": ("failed", "Business logic raised, per channel."),
    "unavailable": ("unavailable", "Copies answered or retried because Postgres was unreachable."),
}
_SKIPPED: Final = {"skipped_duplicate": "duplicate", "skipped_locked": "locked"}
_FORWARDS: Final = {"forward_ok": "ok", "forward_fail": "failed", "forward_locked": "locked"}
_INBOX_GAUGES: Final = {
    "pending": "Saved events not processed yet.",
    "stuck": "Pending events older than RECONCILE_AFTER_SECONDS.",
    "failed": "Events given up on (only a replay retries them).",
}


@dataclass
class Families:
    """Metric families of one scrape, built from values read beforehand."""

    items: list[Metric] = field(default_factory=list)

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{NAMESPACE}_{name}", doc, labels=list(labels))
        self.items.append(family)
        return family

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=list(labels))
        self.items.append(family)
        return family


class _Frozen(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def counter_families(counters: dict[str, int], families: Families) -> None:
    outcome = {
        key: families.counter(f"events_{name}", doc, ["channel"]) for key, (name, doc) in _OUTCOMES.items()
    }
    skipped = families.counter(
        "events_skipped",
        "Copies answered without running the logic, per channel and reason.",
        ["channel", "reason"],
    )
    forwards = families.counter(
        "forwards", "Forwards to the webhook app, per source and result.", ["source", "result"]
    )
    retries = families.counter("retries", "Messages sent to a retry tier.", ["tier"])
    parked = families.counter("parked", "Messages sent to the parking queue.")
    passes = families.counter("reconciler_passes", "Passes made as the active reconciler.")
    recoveries = families.counter("reconciler_recoveries", "Stuck events the reconciler got processed.")
    other = families.counter("counter", "Every other counter of the service, by its Redis name.", ["name"])
    for name, value in sorted(counters.items()):
        channel, _, what = name.partition(":")
        if what in _OUTCOMES and channel in {"webhook", "rabbitmq", "internal"}:
            outcome[what].add_metric([channel], value)
        elif what in _SKIPPED:
            skipped.add_metric([channel, _SKIPPED[what]], value)
        elif what in _FORWARDS and channel in {"rabbitmq", "reconciler"}:
            forwards.add_metric([channel, _FORWARDS[what]], value)
        elif channel == "rabbitmq" and what.startswith("retry_tier:"):
            retries.add_metric([what.removeprefix("retry_tier:")], value)
        elif name == "rabbitmq:parked":
            parked.add_metric([], value)
        elif name == "reconciler:runs":
            passes.add_metric([], value)
        elif name == "reconciler:recovered":
            recoveries.add_metric([], value)
        else:
            other.add_metric([name], value)


def histogram_family(
    name: str, doc: str, buckets: list[int], count: int, total: float
) -> HistogramMetricFamily:
    cumulative, running = [], 0
    for index, amount in enumerate(buckets):
        running += amount
        cumulative.append(("+Inf" if index == len(BUCKETS) else repr(BUCKETS[index]), running))
    cumulative[-1] = ("+Inf", count)
    return HistogramMetricFamily(f"{NAMESPACE}_{name}", doc, buckets=cumulative, sum_value=total)


def store_families(
    inbox: dict[str, Any], rabbitmq: dict[str, Any], redis_up: bool, families: Families
) -> None:
    up = families.gauge("store_up", "1 when the store answered this scrape's read.", ["store"])
    up.add_metric(["postgres"], 1 if inbox.get("ok") else 0)
    up.add_metric(["redis"], 1 if redis_up else 0)
    up.add_metric(["rabbitmq"], 1 if rabbitmq.get("ok") else 0)
    if inbox.get("ok"):
        for name, doc in _INBOX_GAUGES.items():
            families.gauge(f"inbox_{name}", doc).add_metric([], inbox[name])
        oldest = families.gauge(
            "inbox_oldest_pending_age_seconds", "Age of the oldest unprocessed event (0: none)."
        )
        oldest.add_metric([], inbox["oldest_pending_age_seconds"] or 0)
    if rabbitmq.get("ok"):
        depth = families.gauge(
            "queue_messages",
            "Messages ready in each queue of the service and of Evolution.",
            ["queue", "role"],
        )
        consumers = families.gauge("queue_consumers", "Consumers on each queue.", ["queue", "role"])
        roles: list[tuple[str, str, dict[str, Any]]] = [
            *((name, "retry_tier", state) for name, state in rabbitmq["retry_tiers"].items()),
            *((name, "evolution", state) for name, state in rabbitmq["evolution_queues"].items()),
        ]
        for role in ("parking", "lock_busy", "ready"):
            roles.append((role, role, rabbitmq[role]))
        for name, role, state in roles:
            if state.get("exists"):
                depth.add_metric([name, role], state["messages"])
                consumers.add_metric([name, role], state["consumers"])


class Metrics:
    """``GET /metrics``: one registry per scrape, filled from values read in one go."""

    def __init__(self, inbox: PostgresInbox, counters: Counters, redis: Redis, settings: Settings) -> None:
        self._counters = counters
        self._redis = redis
        self._settings = settings
        self._stores = Cached(
            lambda: asyncio.gather(inbox_stats(inbox, settings), rabbitmq_status(settings)),
            settings.metrics_cache_seconds,
        )

    async def exposition(self) -> tuple[bytes, str]:
        families = Families()
        try:
            counters = await self._counters.read()
            counter_families(counters, families)
            for name, doc in HISTOGRAMS.items():
                families.items.append(histogram_family(name, doc, *await self._counters.read_histogram(name)))
            await self._channel_families(families)
            redis_up = True
        except (RedisError, OSError) as exc:
            log.warning("metrics without counters, Redis unavailable", error=repr(exc))
            redis_up = False
        inbox, rabbitmq = await self.stores()
        store_families(inbox, rabbitmq, redis_up, families)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Frozen(families.items))
        return generate_latest(registry), _EXPOSITION

    async def stores(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Inbox figures and queue states, read at most every ``METRICS_CACHE_SECONDS``
        (shared by ``/metrics`` and the dashboard)."""
        inbox, rabbitmq = await self._stores.get()
        return inbox, rabbitmq

    async def _channel_families(self, families: Families) -> None:
        """Per instance and channel: age of the last delivery, and whether a gap alert is raised."""
        now = time.time()
        last_seen = await self._counters.read_last_seen()
        gaps = await raised_gaps(self._redis, self._settings)
        age = families.gauge(
            "channel_last_delivery_age_seconds",
            "Seconds since the channel last delivered an event of the instance.",
            ["instance", "channel"],
        )
        gap = families.gauge(
            "channel_gap",
            "1 while a gap alert is raised for the channel of the instance.",
            ["instance", "channel"],
        )
        for instance, seen in sorted(last_seen.items()):
            for channel in CHANNELS:
                if channel in seen:
                    age.add_metric([instance, channel], round(now - seen[channel], 3))
                    gap.add_metric([instance, channel], 1 if channel in gaps.get(instance, {}) else 0)
