"""Operating it: /metrics, /readyz, per-channel coverage and gap alerts, outcome log lines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from bench.events import unique_event
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from evolution_ingest.config import Settings
from evolution_ingest.core.events import Channel, Event
from evolution_ingest.handlers import log_summary, log_with_text
from evolution_ingest.operate.coverage import coverage, find_gaps
from evolution_ingest.operate.gaps import GapWatcher
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores.queues import QueueReads, Topology
from tests.conftest import (
    DATABASE_URL,
    INTERNAL_SECRET,
    RABBITMQ_URL,
    REDIS_URL,
    OpenRuntime,
    running_service,
    serving,
)
from tests.support import Recorder, fixture, fixtures, free_socket, running_server, wait_until
from tests.support.destination import Destination
from tests.support.evolution import EvolutionPublisher, broker, remove

UNIQUE = 19  # the 20 fixtures hold one re-emission of another message


async def scrape(
    http: aiohttp.ClientSession, base: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by the Prometheus client's parser: (sample name, labels) -> value."""
    async with http.get(base + "/metrics") as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class FailingFor(Recorder):
    """Records every event; raises for the events named in ``failing``."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    async def __call__(self, event: Event) -> None:
        if event.event in self.failing:
            raise RuntimeError(f"no handler for {event.event} today")
        await super().__call__(event)


async def test_metrics_move_with_each_channel_and_gauges_match_the_database(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    failing = {"presence.update"}
    handler = FailingFor(failing)
    items = fixtures()
    fails = sum(1 for item in items if item["webhook_body"]["event"] in failing)
    assert fails > 0
    async with open_runtime(handler) as runtime, running_service(runtime) as service:
        base = service.url.removesuffix("/api/internal/webhook")
        before = await scrape(http, base)
        assert value(before, "evolution_ingest_events_received_total", channel="webhook") == 0
        for item in items:
            async with http.post(service.url, data=orjson.dumps(item["webhook_body"])):
                pass
        after_webhook = await scrape(http, base)
        assert value(after_webhook, "evolution_ingest_events_received_total", channel="webhook") == 20
        assert (
            value(after_webhook, "evolution_ingest_events_processed_total", channel="webhook")
            == UNIQUE - fails
        )
        assert value(after_webhook, "evolution_ingest_events_failed_total", channel="webhook") == fails
        assert (
            value(
                after_webhook, "evolution_ingest_events_skipped_total", channel="webhook", reason="duplicate"
            )
            == 1
        )
        assert value(after_webhook, "evolution_ingest_events_received_total", channel="rabbitmq") == 0
        # Handler runs: one per processed event and one per failure.
        assert value(after_webhook, "evolution_ingest_handler_seconds_count") == UNIQUE
        assert value(after_webhook, "evolution_ingest_webhook_seconds_count") == 20  # every call answered
        assert value(after_webhook, "evolution_ingest_handler_seconds_bucket", le="+Inf") == UNIQUE

        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            for item in items:
                await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])

            async def rabbitmq_settled() -> bool:
                samples = await scrape(http, base)
                return value(samples, "evolution_ingest_events_received_total", channel="rabbitmq") >= 20

            await wait_until(rabbitmq_settled, within=20, message="20 RabbitMQ deliveries counted")
        samples = await scrape(http, base)
        skipped = value(
            samples, "evolution_ingest_events_skipped_total", channel="rabbitmq", reason="duplicate"
        )
        forwarded = sum(
            value(samples, "evolution_ingest_forwards_total", source="rabbitmq", result=result)
            for result in ("ok", "failed", "locked")
        )
        # Processed copies are duplicates; the failed events are forwarded (and fail again).
        assert skipped + forwarded >= UNIQUE
        assert skipped >= UNIQUE - fails

        pending = await db.fetchval(
            "SELECT count(*) FROM evolution_ingestion_events WHERE processed_at IS NULL AND failed_at IS NULL"
        )
        assert pending == fails
        assert value(samples, "evolution_ingest_inbox_pending") == pending
        assert value(samples, "evolution_ingest_inbox_failed") == 0
        assert value(samples, "evolution_ingest_inbox_stuck") == 0  # younger than RECONCILE_AFTER_SECONDS
        oldest = await db.fetchval(
            "SELECT EXTRACT(EPOCH FROM now() - min(received_at)) FROM evolution_ingestion_events "
            "WHERE processed_at IS NULL"
        )
        assert abs(value(samples, "evolution_ingest_inbox_oldest_pending_age_seconds") - float(oldest)) < 2
        for store in ("postgres", "redis", "rabbitmq"):
            assert value(samples, "evolution_ingest_store_up", store=store) == 1
        tier = service.worker.topology.tiers[0].queue
        assert (("evolution_ingest_queue_messages", (("queue", tier), ("role", "retry_tier")))) in samples
        assert value(samples, "evolution_ingest_queue_consumers", queue="parking", role="parking") == 0
        for queue in service.worker.topology.source_queues:  # Evolution's queues, each consumed
            assert value(samples, "evolution_ingest_queue_consumers", queue=queue, role="evolution") == 1

        # Made older than RECONCILE_AFTER_SECONDS, the pending rows are stuck; given up on, failed.
        await db.execute(
            "UPDATE evolution_ingest_inbox SET received_at = now() - interval '10 minutes' "
            "WHERE processed_at IS NULL"
        )
        samples = await scrape(http, base)
        assert value(samples, "evolution_ingest_inbox_stuck") == pending
        assert 599 < value(samples, "evolution_ingest_inbox_oldest_pending_age_seconds") < 700
        await db.execute("UPDATE evolution_ingest_inbox SET failed_at = now() WHERE processed_at IS NULL")
        samples = await scrape(http, base)
        assert value(samples, "evolution_ingest_inbox_failed") == fails
        assert value(samples, "evolution_ingest_inbox_pending") == 0
        assert value(samples, "evolution_ingest_inbox_stuck") == 0


async def test_end_to_end_latency_is_measured_from_evolutions_date_time(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    async with open_runtime() as runtime, serving(runtime) as url:
        body, _, _ = unique_event(1)
        body["date_time"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        async with http.post(url, data=orjson.dumps(body)) as response:
            assert response.status == 200
        samples = await scrape(http, url.removesuffix("/api/internal/webhook"))
    assert value(samples, "evolution_ingest_end_to_end_seconds_count") == 1
    assert value(samples, "evolution_ingest_end_to_end_seconds_bucket", le="5.0") == 1
    assert 0 <= value(samples, "evolution_ingest_end_to_end_seconds_sum") < 5


@pytest.mark.parametrize("store", ["postgres", "redis", "rabbitmq"])
async def test_readyz_turns_unready_when_a_store_goes_away_and_ready_when_it_returns(
    store: str, open_runtime: OpenRuntime, http: aiohttp.ClientSession, proxy_factory: Any
) -> None:
    ports = {"postgres": 5432, "redis": 6379, "rabbitmq": 5672}
    proxy = await proxy_factory("127.0.0.1", ports[store])
    overrides = {
        "postgres": {"database_url": DATABASE_URL.replace(":5432/", f":{proxy.port}/")},
        "redis": {"redis_url": REDIS_URL.replace(":6379/", f":{proxy.port}/")},
        "rabbitmq": {"rabbitmq_url": RABBITMQ_URL.replace(":5672/", f":{proxy.port}/")},
    }[store]
    async with open_runtime(**overrides) as runtime, serving(runtime) as url:
        readyz = url.removesuffix("/api/internal/webhook") + "/readyz"

        async def state() -> tuple[int, dict[str, Any]]:
            async with http.get(readyz) as response:
                return response.status, await response.json()

        status, report = await state()
        assert (status, report["ready"], report["failing"]) == (200, True, [])
        proxy.cut()
        await wait_until(lambda: _status_is(state, 503), within=10, message=f"unready without {store}")
        status, report = await state()
        assert report["failing"] == [store]
        assert report["checks"][store] != "ok"
        proxy.restore()
        await wait_until(lambda: _status_is(state, 200), within=15, message=f"ready again with {store}")


async def test_readyz_and_metrics_share_one_rabbitmq_connection_and_replace_one_that_stops_answering(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, proxy_factory: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 5672)
    async with (
        open_runtime(rabbitmq_url=RABBITMQ_URL.replace(":5672/", f":{proxy.port}/")) as runtime,
        serving(runtime) as url,
    ):
        base = url.removesuffix("/api/internal/webhook")

        async def state() -> tuple[int, dict[str, Any]]:
            async with http.get(base + "/readyz") as response:
                return response.status, await response.json()

        for _ in range(5):  # neither is cached in the tests' settings
            assert (await state())[0] == 200
            samples = await scrape(http, base)
            assert value(samples, "evolution_ingest_store_up", store="rabbitmq") == 1
        assert proxy.accepted == 1

        proxy.hold()  # open, and silent: the check gives up on it
        status, report = await state()
        assert (status, report["failing"]) == (503, ["rabbitmq"])
        assert report["checks"]["rabbitmq"] == "no answer within 2 s"
        proxy.release()
        await wait_until(lambda: _status_is(state, 200), within=15, message="ready on a new connection")
        assert proxy.accepted == 2
    await wait_until(lambda: proxy.live == 0, within=10, message="the connection closed with the stores")


async def test_the_queue_read_gives_up_on_a_silent_broker_and_reads_again_once_it_answers(
    make_settings: Callable[..., Settings], proxy_factory: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 5672)  # RabbitMQ only: no schema to migrate
    reads = QueueReads(
        make_settings(rabbitmq_url=RABBITMQ_URL.replace(":5672/", f":{proxy.port}/")), within=1.0
    )
    try:
        before = await reads.status()
        assert before["ready"] == {"exists": False}  # nothing declared this test's queues
        proxy.hold()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="RabbitMQ did not answer within 1 s"):
            await reads.status()
        assert time.monotonic() - started < 3
        proxy.release()
        assert await reads.status() == before
        await reads.ping()
        assert proxy.accepted == 2
    finally:
        await reads.close()


async def _status_is(state: Any, expected: int) -> bool:
    status, _ = await state()
    return bool(status == expected)


async def test_readyz_names_pending_migrations(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, db: Any
) -> None:
    async with open_runtime() as runtime, serving(runtime) as url:
        await db.execute("DELETE FROM evolution_ingest_migrations WHERE version = 3")
        async with http.get(url.removesuffix("/api/internal/webhook") + "/readyz") as response:
            assert response.status == 503
            report = await response.json()
    assert report["failing"] == ["postgres"]
    assert "0003_coverage" in report["checks"]["postgres"]


def test_gaps_need_both_channels_used_and_one_silent() -> None:
    now = 1_000_000.0
    seen = {
        "both-fresh": {"webhook": now - 1, "rabbitmq": now - 2},
        "rabbit-silent": {"webhook": now - 1, "rabbitmq": now - 400},
        "webhook-silent": {"webhook": now - 400, "rabbitmq": now - 3},
        "webhook-only-user": {"webhook": now - 1},
        "all-quiet": {"webhook": now - 900, "rabbitmq": now - 800},
    }
    gaps = {(g.instance, g.silent, g.other) for g in find_gaps(seen, now=now, after=300)}
    assert gaps == {("rabbit-silent", "rabbitmq", "webhook"), ("webhook-silent", "webhook", "rabbitmq")}


async def test_a_silent_channel_raises_one_gap_alert_and_clears_it_when_it_resumes(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    with capture_logs() as logs:
        await _gap_scenario(open_runtime, http, logs)


async def _gap_scenario(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, capture_logs: list[Any]
) -> None:
    async with (
        open_runtime(gap_alert_after_seconds=1.0, gap_check_interval_seconds=0.1) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        watchers = [
            GapWatcher(runtime.counters, runtime.redis, settings, None) for _ in range(2)
        ]  # two replicas
        stop = asyncio.Event()
        tasks = [asyncio.create_task(w.run(stop)) for w in watchers]
        try:
            async with broker(RABBITMQ_URL) as (_, channel):
                publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
                n = 0

                async def send(both: bool) -> None:
                    nonlocal n
                    n += 1
                    webhook, rabbit, event = unique_event(n, "acme-gap")
                    async with http.post(service.url, data=orjson.dumps(webhook)):
                        pass
                    if both:
                        await publisher.publish_global(rabbit, event)

                async def deliver(both: bool, seconds: float) -> None:
                    for _ in range(int(seconds / 0.1)):
                        await send(both)
                        await asyncio.sleep(0.1)  # wait-ok: a steady trickle of events

                await deliver(True, 1.0)
                await wait_until(
                    lambda: _seen_both(runtime), within=10, message="both channels seen for acme-gap"
                )
                assert _gap_logs(capture_logs) == []
                await deliver(False, 2.5)  # RabbitMQ silent for this instance, the webhook goes on
                await wait_until(lambda: len(_gap_logs(capture_logs)) == 1, within=5, message="one gap alert")
                print([e for e in capture_logs if e.get("log_level") != "info"])
                raised = _gap_logs(capture_logs)[0]
                assert (raised["event"], raised["instance"], raised["silent"]) == (
                    "channel gap raised",
                    "acme-gap",
                    "rabbitmq",
                )
                await deliver(False, 1.0)  # still silent: no second alert
                assert len(_gap_logs(capture_logs)) == 1
                samples = await scrape(http, service.url.removesuffix("/api/internal/webhook"))
                assert (
                    value(samples, "evolution_ingest_channel_gap", instance="acme-gap", channel="rabbitmq")
                    == 1
                )
                assert (
                    value(samples, "evolution_ingest_channel_gap", instance="acme-gap", channel="webhook")
                    == 0
                )
                assert (
                    value(
                        samples,
                        "evolution_ingest_channel_last_delivery_age_seconds",
                        instance="acme-gap",
                        channel="rabbitmq",
                    )
                    >= 2
                )
                await deliver(True, 1.0)
                await wait_until(lambda: len(_gap_logs(capture_logs)) == 2, within=5, message="gap cleared")
                cleared = _gap_logs(capture_logs)[1]
                assert (cleared["event"], cleared["instance"]) == ("channel gap cleared", "acme-gap")
                samples = await scrape(http, service.url.removesuffix("/api/internal/webhook"))
                assert (
                    value(samples, "evolution_ingest_channel_gap", instance="acme-gap", channel="rabbitmq")
                    == 0
                )
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        counts = await runtime.counters.read(["alert:gap:raised", "alert:gap:cleared"])
    assert counts == {"alert:gap:raised": 1, "alert:gap:cleared": 1}


async def _seen_both(runtime: Runtime) -> bool:
    seen = await runtime.counters.read_last_seen()
    return set(seen.get("acme-gap", {})) == {"webhook", "rabbitmq"}


def _gap_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if str(entry.get("event", "")).startswith("channel gap")]


async def test_coverage_counts_events_seen_on_both_channels_and_on_one(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    async with (
        open_runtime(coverage_settle_seconds=0.0) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            for n in range(12):
                webhook, rabbit, event = unique_event(n, "acme-cov")
                if n < 8 or n >= 10:  # 8 on both, 2 on RabbitMQ only, 2 on the webhook only
                    async with http.post(service.url, data=orjson.dumps(webhook)):
                        pass
                if n < 10:
                    await publisher.publish_global(rabbit, event)

            async def seen_all() -> bool:
                report = await coverage(runtime.stores, settings)
                entry = report["instances"].get("acme-cov", {})
                return entry.get("both_channels") == 8 and entry.get("events") == 12

            await wait_until(seen_all, within=20, message="coverage of 12 events")
        report = await coverage(runtime.stores, settings)
    entry = report["instances"]["acme-cov"]
    assert (entry["webhook_only"], entry["rabbitmq_only"], entry["both_share"]) == (2, 2, round(8 / 12, 4))
    assert all(0 <= entry["last_seen_seconds_ago"][ch] < 60 for ch in ("webhook", "rabbitmq"))


async def test_no_log_line_of_a_running_service_holds_the_apikey(tmp_path: Path, settings: Settings) -> None:
    """``up`` as a process, every fixture on both channels: one outcome line each, no apikey."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {
        **os.environ,
        **{
            f"EVOLUTION_INGEST_{name.upper()}": str(getattr(settings, name))
            for name in (
                "database_url",
                "database_schema",
                "redis_url",
                "redis_key_prefix",
                "metrics_prefix",
                "rabbitmq_url",
                "rabbitmq_exchange",
                "rabbitmq_prefix",
                "rabbitmq_service_prefix",
            )
        },
        "EVOLUTION_INGEST_RABBITMQ_EVENTS": ",".join(settings.rabbitmq_events),
        # The same queue names as the test's settings, so that the test removes them after.
        "EVOLUTION_INGEST_RETRY_DELAYS_SECONDS": ",".join(map(str, settings.retry_delays_seconds)),
        "EVOLUTION_INGEST_LOCK_BUSY_DELAY_SECONDS": str(settings.lock_busy_delay_seconds),
        "EVOLUTION_INGEST_INTERNAL_SECRET": INTERNAL_SECRET,
        "EVOLUTION_INGEST_PORT": str(port),
        "EVOLUTION_INGEST_LOG_FORMAT": "json",
        "EVOLUTION_INGEST_HANDLERS": "evolution_ingest.handlers:log_summary",
    }
    log_path = tmp_path / "service.log"
    with log_path.open("wb") as log_file:
        service = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "evolution_ingest", "up", env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            await _send_on_both_channels(port, settings)
        finally:
            service.terminate()
            assert await asyncio.wait_for(service.wait(), 30) == 0
            await remove(RABBITMQ_URL, Topology(settings))
    lines = log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    outcomes = [r for r in records if r.get("event") == "outcome"]
    assert len([r for r in outcomes if r["channel"] == "webhook"]) == 20
    assert len([r for r in outcomes if r["channel"] == "rabbitmq"]) >= 20
    for record in outcomes:
        assert {"event_name", "instance", "dedup_key", "channel", "duration_ms", "outcome"} <= set(record)
    assert len([r for r in records if r.get("event") == "event"]) == UNIQUE  # the built-in handler's lines
    for apikey in {item["webhook_body"]["apikey"] for item in fixtures()}:
        assert not [line for line in lines if apikey in line]
    # Nor the text of a message (the built-in handler logs a summary without it).
    text = fixture("messages_upsert_text_incoming")["webhook_body"]["data"]["message"]["conversation"]
    assert not [line for line in lines if text in line]


async def _send_on_both_channels(port: int, settings: Settings) -> None:
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:

        async def ready() -> bool:
            try:
                async with http.get(base + "/readyz") as response:
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(ready, within=30, message="the service to be ready")
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            for item in fixtures():
                async with http.post(base + "/api/internal/webhook", data=orjson.dumps(item["webhook_body"])):
                    pass
                await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])

        async def rabbitmq_done() -> bool:
            samples = await scrape(http, base)
            return value(samples, "evolution_ingest_events_received_total", channel="rabbitmq") >= 20

        await wait_until(rabbitmq_done, within=30, message="20 RabbitMQ deliveries")


@pytest.mark.parametrize(("handler", "shows_text"), [(log_summary, False), (log_with_text, True)])
async def test_message_text_is_logged_only_by_the_opt_in_handler(handler: Any, shows_text: bool) -> None:
    body = fixture("messages_upsert_text_incoming")["webhook_body"]
    text = body["data"]["message"]["conversation"]
    event = Event(
        dedup_key="0" * 64,
        event=body["event"],
        instance=body["instance"],
        data=body["data"],
        payload=body,
        channel=Channel.WEBHOOK,
        received_at=datetime.now(UTC),
        date_time=body["date_time"],
        attempts=0,
        id=1,
    )
    with capture_logs() as logs:
        await handler(event)
    assert len(logs) == 1
    rendered = json.dumps(logs[0], ensure_ascii=False)
    assert (text in rendered) is shows_text
    assert body["apikey"] not in rendered


async def test_two_watchers_post_one_gap_alert_and_one_clearance_to_the_alert_webhook(
    open_runtime: OpenRuntime,
) -> None:
    chat = Destination()
    async with (
        running_server(chat.app) as base,
        open_runtime(gap_alert_after_seconds=5.0, gap_alert_webhook_url=base + "/hooks/chat") as runtime,
    ):
        redis, settings = runtime.redis, runtime.settings
        seen_key = settings.metrics_prefix + "last_seen"
        now = time.time()
        await redis.hset(seen_key, mapping={"acme-x\twebhook": now, "acme-x\trabbitmq": now - 60})
        replicas = [GapWatcher(runtime.counters, redis, settings, None) for _ in range(2)]
        outcomes = [await watcher.check() for watcher in (*replicas, *replicas)]
        assert sum(len(raised) for raised, _ in outcomes) == 1
        await redis.hset(seen_key, "acme-x\trabbitmq", time.time() + 1)  # RabbitMQ is back
        outcomes = [await watcher.check() for watcher in (*replicas, *replicas)]
        assert [cleared for _, cleared in outcomes if cleared] == [[("acme-x", "rabbitmq")]]
        for watcher in replicas:
            await watcher.run(_already_set())  # closes its HTTP session
    texts = [r.body["text"] for r in chat.accepted]
    assert len(texts) == 2
    assert "no rabbitmq deliveries for instance 'acme-x'" in texts[0]
    assert "rabbitmq delivers again for instance 'acme-x'" in texts[1]
    assert chat.received[0].body["content"] == texts[0]  # Discord reads "content", Slack "text"


def _already_set() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event
