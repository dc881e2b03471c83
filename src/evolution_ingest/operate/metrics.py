"""``/metrics``: the Prometheus exposition, from an explicit registry built for each scrape.

Counters and latency histograms live in Redis (see :mod:`evolution_ingest.stores.counters`), so
every process of a deployment adds to the same figures and any webhook app's ``/metrics``
shows all of them; Prometheus may scrape one replica or all (the values agree). Gauges are
read from Postgres and RabbitMQ when scraped, at most every ``METRICS_CACHE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from evolution_ingest.config import Settings
from evolution_ingest.operate.cached import Cached
from evolution_ingest.operate.coverage import CHANNELS, raised_gaps
from evolution_ingest.operate.errors import STORE_ERRORS
from evolution_ingest.operate.views import inbox_section, instances_section, rabbitmq_section
from evolution_ingest.stores import Stores
from evolution_ingest.stores.counters import BUCKETS

log = structlog.get_logger(__name__)

NAMESPACE: Final = "evolution_ingest"
HISTOGRAMS: Final = {
    "webhook_seconds": "Time to answer a webhook call or a forward that reached the ingestion core.",
    "handler_seconds": "Time the business logic (all handlers) took per run.",
    "end_to_end_seconds": "From Evolution's date_time to processed_at.",
    "event_loop_lag_seconds": "How late each process's event loop woke up for a timer, sampled every 50 ms.",
}
_EXPOSITION: Final = "text/plain; version=0.0.4; charset=utf-8"


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
    refusals = families.counter(
        "refusals", "Bodies refused (kept for the operator), per source and reason code.", ["source", "code"]
    )
    other = families.counter("counter", "Every other counter of the service, by its Redis name.", ["name"])
    for name, value in sorted(counters.items()):
        channel, _, what = name.partition(":")
        if what in _OUTCOMES and channel in {"webhook", "rabbitmq", "internal", "backfill"}:
            outcome[what].add_metric([channel], value)
        elif what in _SKIPPED:
            skipped.add_metric([channel, _SKIPPED[what]], value)
        elif what in _FORWARDS and channel in {"rabbitmq", "reconciler"}:
            forwards.add_metric([channel, _FORWARDS[what]], value)
        elif channel == "rabbitmq" and what.startswith("retry_tier:"):
            retries.add_metric([what.removeprefix("retry_tier:")], value)
        elif channel == "refusal" and what.count(":") == 1:
            refusals.add_metric(what.split(":"), value)
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
        families.gauge(
            "inbox_rows", "Rows in the inbox (exact up to 100,000, the planner's estimate above)."
        ).add_metric([], inbox["rows"])
        size = inbox.get("size", {})
        if size.get("partitions") is not None:
            part = families.gauge(
                "inbox_bytes",
                "Bytes on disk (indexes and TOAST included) of each part of the inbox.",
                ["part"],
            )
            for name in ("rows", "bodies", "deliveries"):
                part.add_metric([name], size[f"{name}_bytes"])
            families.gauge(
                "inbox_body_partitions", "Partitions of bodies (one per RETENTION_PARTITION_SECONDS)."
            ).add_metric([], size["partitions"])
            families.gauge(
                "inbox_oldest_row_age_seconds", "Age of the oldest row kept (0: none)."
            ).add_metric([], size["oldest_age_seconds"] or 0)
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


def instance_families(section: dict[str, Any], families: Families) -> None:
    """Per instance: connected or not, its uptimes, and whether an alert is raised."""
    if not section.get("ok"):
        return
    up = families.gauge("instance_up", "1 while the instance's WhatsApp connection is open.", ["instance"])
    uptime = families.gauge(
        "instance_uptime_ratio",
        "Share of the window the instance was open (of the part known).",
        ["instance", "window"],
    )
    alert = families.gauge(
        "instance_alert", "1 while an instance alert is raised (logged out, away).", ["instance"]
    )
    for item in section["instances"]:
        up.add_metric([item["instance"]], 1 if item["state"] == "open" else 0)
        alert.add_metric([item["instance"]], 1 if item["alert"] else 0)
        for window, ratio in item["uptime"].items():
            if ratio is not None:
                uptime.add_metric([item["instance"], window], ratio)


class Metrics:
    """``GET /metrics``: one registry per scrape, filled from values read in one go."""

    def __init__(self, stores: Stores, settings: Settings) -> None:
        self._counters = stores.counters
        self._redis = stores.redis
        self._settings = settings
        self._stores = Cached(
            lambda: asyncio.gather(
                inbox_section(stores, settings),
                rabbitmq_section(stores),
                instances_section(stores, settings),
            ),
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
        except STORE_ERRORS as exc:
            log.warning("metrics without counters, Redis unavailable", error=repr(exc))
            redis_up = False
        inbox, rabbitmq = await self.stores()
        store_families(inbox, rabbitmq, redis_up, families)
        instance_families((await self._stores.get())[2], families)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Frozen(families.items))
        return generate_latest(registry), _EXPOSITION

    async def stores(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Inbox figures and queue states, read at most every ``METRICS_CACHE_SECONDS``
        (shared by ``/metrics`` and the dashboard)."""
        inbox, rabbitmq, _ = await self._stores.get()
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
