"""The RabbitMQ channel against the real RabbitMQ, Postgres and Redis, published as Evolution does."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest

from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores.queues import HEADER_ATTEMPTS, HEADER_ORIGIN, HEADER_PARKED_REASON, Topology
from tests.conftest import DATABASE_URL, RABBITMQ_URL, OpenRuntime, running_service, serving, worker_for
from tests.support import Recorder, dead_port, fixture, fixtures, wait_until
from tests.support.evolution import (
    EvolutionPublisher,
    broker,
    consumer_count,
    consumers,
    depth,
    remove,
    restart_rabbitmq,
    take_all,
)

UNIQUE = 19  # the 20 fixtures hold one re-emission of another message


async def counters(runtime: Runtime, *names: str) -> dict[str, int]:
    await runtime.counters.flush()
    return await runtime.counters.read(names)


async def publish_all(publisher: EvolutionPublisher, items: list[dict[str, Any]]) -> None:
    for item in items:
        await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])


async def test_every_fixture_published_to_rabbitmq_only_runs_once_via_the_forward(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection
) -> None:
    async with open_runtime() as runtime, running_service(runtime) as service:
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publish_all(publisher, fixtures())
            await wait_until(lambda: recorder.total == UNIQUE, within=20, message="19 events processed")
            await wait_until(lambda: _settled(runtime, 20), within=10, message="every message settled")
            assert await _all_empty(channel, service.worker.topology.consumed_queues)
        totals = await counters(
            runtime,
            "rabbitmq:received",
            "rabbitmq:forward_ok",
            "rabbitmq:skipped_duplicate",
            "internal:processed",
        )
    assert not recorder.doubled()
    assert {event.channel.value for event in recorder.events} == {"RABBITMQ"}
    rows = await db.fetch("SELECT * FROM evolution_ingestion_events")
    assert len(rows) == UNIQUE
    assert all(r["rabbitmq_seen_at"] and not r["webhook_seen_at"] and r["processed_at"] for r in rows)
    assert totals["rabbitmq:received"] == 20
    assert totals["rabbitmq:forward_ok"] + totals["rabbitmq:skipped_duplicate"] == 20
    assert totals["internal:processed"] == UNIQUE


async def _settled(runtime: Runtime, expected: int) -> bool:
    """Every delivery has ended in an ack (forwarded or a duplicate)."""
    done = await counters(
        runtime, "rabbitmq:forward_ok", "rabbitmq:skipped_duplicate", "rabbitmq:busy_gave_up"
    )
    return sum(done.values()) >= expected


async def _all_empty(channel: Any, queues: list[str]) -> bool:
    return all([await depth(channel, q) == 0 for q in queues])


async def test_both_channels_interleaved_and_concurrent_run_each_event_once(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection, http: aiohttp.ClientSession
) -> None:
    copies = 5
    async with open_runtime() as runtime, running_service(runtime) as service:
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)

            async def webhook(item: dict[str, Any]) -> int:
                async with http.post(service.url, data=orjson.dumps(item["webhook_body"])) as resp:
                    return resp.status

            sends: list[Any] = []
            for item in fixtures():
                sends += [webhook(item) for _ in range(copies)]
                sends += [
                    publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
                    for _ in range(copies)
                ]
            random.Random(3).shuffle(sends)
            results = await asyncio.gather(*sends)
            assert [status for status in results if status is not None] == [200] * (20 * copies)
            await wait_until(lambda: recorder.total >= UNIQUE, within=20, message="every event processed")
            await wait_until(
                lambda: _settled(runtime, 20 * copies), within=20, message="every message settled"
            )
            assert await _all_empty(channel, service.worker.topology.consumed_queues)
        totals = await counters(
            runtime,
            *(
                f"{channel_name}:{name}"
                for channel_name in ("webhook", "rabbitmq", "internal")
                for name in ("received", "processed", "skipped_duplicate", "skipped_locked", "failed")
            ),
            "rabbitmq:forward_ok",
            "rabbitmq:lock_busy",
            "rabbitmq:busy_gave_up",
        )
    assert recorder.total == UNIQUE
    assert not recorder.doubled()
    rows = await db.fetch("SELECT * FROM evolution_ingestion_events")
    assert len(rows) == UNIQUE
    assert all(r["webhook_seen_at"] and r["rabbitmq_seen_at"] and r["processed_at"] for r in rows)
    assert totals["webhook:received"] == 20 * copies
    assert totals["webhook:received"] == sum(
        totals[f"webhook:{n}"] for n in ("processed", "skipped_duplicate", "skipped_locked")
    )
    assert totals["webhook:processed"] + totals["internal:processed"] == UNIQUE
    # Every RabbitMQ delivery (first deliveries plus lock-busy returns) ended one way.
    deliveries = 20 * copies + totals["rabbitmq:lock_busy"]
    assert totals["rabbitmq:received"] == deliveries
    assert totals["rabbitmq:received"] == (
        totals["rabbitmq:skipped_duplicate"]
        + totals["rabbitmq:skipped_locked"]
        + totals["rabbitmq:forward_ok"]
        + totals.get("rabbitmq:forward_locked", 0)
    )
    assert totals["internal:received"] == (
        totals["internal:processed"]
        + totals["internal:skipped_duplicate"]
        + totals["internal:skipped_locked"]
    )


async def test_a_webhook_app_down_for_a_while_makes_messages_walk_the_tiers_then_they_run_once(
    open_runtime: OpenRuntime, recorder: Recorder, proxy_factory: Any
) -> None:
    async with open_runtime() as runtime, serving(runtime) as url:
        port = int(url.split(":")[2].split("/")[0])
        proxy = await proxy_factory("127.0.0.1", port)
        proxy.cut()
        forward_url = url.replace(f":{port}/", f":{proxy.port}/")
        items = fixtures()[:6]
        try:
            async with worker_for(runtime, forward_url), broker(RABBITMQ_URL) as (_, channel):
                settings = runtime.settings
                await publish_all(
                    EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix), items
                )

                async def reached_tier_two() -> bool:
                    return (await counters(runtime, "rabbitmq:retry_tier:2"))["rabbitmq:retry_tier:2"] >= len(
                        items
                    )

                await wait_until(reached_tier_two, within=15, message="every message in tier 2")
                assert recorder.total == 0
                proxy.restore()
                await wait_until(
                    lambda: recorder.total == len(items), within=15, message="processed after recovery"
                )
                totals = await counters(
                    runtime, "rabbitmq:retry_tier:1", "rabbitmq:forward_fail", "rabbitmq:parked"
                )
        finally:
            await remove(RABBITMQ_URL, Topology(runtime.settings))
    assert not recorder.doubled()
    assert totals["rabbitmq:retry_tier:1"] == len(items)
    assert totals["rabbitmq:forward_fail"] >= 2 * len(items)
    assert totals["rabbitmq:parked"] == 0


async def test_a_webhook_app_down_for_good_parks_every_message_with_its_error(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection
) -> None:
    items = fixtures()[:4]
    async with open_runtime() as runtime:
        topology = Topology(runtime.settings)
        try:
            async with (
                worker_for(runtime, f"http://127.0.0.1:{dead_port()}/api/internal/webhook"),
                broker(RABBITMQ_URL) as (_, channel),
            ):
                settings = runtime.settings
                await publish_all(
                    EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix), items
                )

                async def all_parked() -> bool:
                    return await depth(channel, topology.parking) == len(items)

                await wait_until(all_parked, within=20, message="every message parked")
                parked = await take_all(channel, topology.parking)
                totals = await counters(runtime, "rabbitmq:parked", "rabbitmq:retried")
        finally:
            await remove(RABBITMQ_URL, topology)
    assert recorder.total == 0
    assert totals == {"rabbitmq:parked": len(items), "rabbitmq:retried": 3 * len(items)}
    bodies = sorted(orjson.loads(m.body)["event"] for m in parked)
    assert bodies == sorted(item["event"] for item in items)
    for message in parked:
        headers = message.headers
        assert headers[HEADER_ATTEMPTS] == 3
        assert str(headers[HEADER_PARKED_REASON]).startswith("gave up after 3 retries: ClientConnectorError")
        assert str(headers[HEADER_ORIGIN]).startswith(runtime.settings.rabbitmq_prefix + ".")
    # Nothing silently dropped: the events are saved in the inbox, waiting.
    rows = await db.fetch("SELECT processed_at FROM evolution_ingestion_events")
    assert len(rows) == len(items)
    assert all(r["processed_at"] is None for r in rows)


async def test_a_broken_message_is_kept_as_a_refusal_acked_and_the_worker_keeps_consuming(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection
) -> None:
    async with open_runtime() as runtime, running_service(runtime) as service:
        settings = runtime.settings
        topology = service.worker.topology
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publisher.publish_global(b"this is not json", "messages.upsert")
            await publisher.publish_global(b'["an", "array"]', "messages.upsert")
            await publisher.publish_global(fixture("call_offer")["rabbitmq_body"], "call")

            async def two_kept() -> bool:
                return await db.fetchval("SELECT count(*) FROM evolution_ingest_refusals") == 2

            await wait_until(two_kept, within=10, message="two refusals kept")
            await wait_until(lambda: recorder.total == 1, within=10, message="the valid one processed")
            queue = f"{settings.rabbitmq_prefix}.messages.upsert"
            assert await depth(channel, queue) == 0
            assert await depth(channel, topology.parking) == 0
    kept = sorted(await db.fetch("SELECT * FROM evolution_ingest_refusals"), key=lambda r: r["code"])
    assert [(r["source"], r["status"], r["code"], bytes(r["body"])) for r in kept] == [
        ("rabbitmq", None, "malformed_json", b"this is not json"),
        ("rabbitmq", None, "not_an_event", b'["an", "array"]'),
    ]
    assert kept[1]["reason"].startswith("not an Evolution event: body must be a JSON object")
    assert {r["origin"] for r in kept} == {f"{settings.rabbitmq_prefix}.messages.upsert [messages.upsert]"}


async def test_a_broken_message_is_parked_when_its_refusal_cannot_be_kept(
    open_runtime: OpenRuntime, recorder: Recorder, proxy_factory: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 5432)
    proxied = DATABASE_URL.replace(":5432/", f":{proxy.port}/")
    async with open_runtime(database_url=proxied) as runtime, running_service(runtime) as service:
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            proxy.cut()
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publisher.publish_global(b"this is not json", "messages.upsert")

            async def parked() -> bool:
                return await depth(channel, service.worker.topology.parking) == 1

            await wait_until(parked, within=15, message="the message parked")
            proxy.restore()
            (message,) = await take_all(channel, service.worker.topology.parking)
    assert message.body == b"this is not json"
    assert str(message.headers[HEADER_PARKED_REASON]).startswith("not an Evolution event: malformed JSON")


@pytest.mark.parametrize("here", [False, True], ids=["another-process", "this-process"])
async def test_a_locked_event_comes_back_without_using_the_retry_budget(
    here: bool, open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    """Locked by a webhook copy: from another process it waits in the lock-busy queue;
    in the same process (``up``) it waits for that copy to finish. Never a retry tier."""
    slow = Recorder(delay=1.5)
    item = fixture("messages_upsert_group_text")
    wait = 5.0 if here else 0.0  # 0: behave as if the lock holder were another process
    async with (
        open_runtime(slow, lock_busy_wait_seconds=wait) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            webhook = asyncio.create_task(http.post(service.url, data=orjson.dumps(item["webhook_body"])))
            await asyncio.wait_for(slow.started.wait(), 5)
            await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
            response = await webhook
            assert response.status == 200
            response.release()

            async def settled() -> bool:
                c = await counters(runtime, "rabbitmq:skipped_duplicate")
                return c["rabbitmq:skipped_duplicate"] == 1

            await wait_until(settled, within=10, message="the RabbitMQ copy to end as a duplicate")
        totals = await counters(runtime, "rabbitmq:lock_busy", "rabbitmq:retried", "rabbitmq:parked")
    assert slow.total == 1
    assert totals["rabbitmq:lock_busy"] == 0 if here else totals["rabbitmq:lock_busy"] >= 2
    assert totals["rabbitmq:retried"] == 0
    assert totals["rabbitmq:parked"] == 0


async def test_a_stopping_worker_finishes_what_is_in_flight_and_takes_nothing_more(
    open_runtime: OpenRuntime,
) -> None:
    slow = Recorder(delay=1.0)
    items = fixtures()[:3]
    async with open_runtime(slow) as runtime, running_service(runtime) as service:
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publisher.publish_global(items[0]["rabbitmq_body"], items[0]["routing_key"])
            await asyncio.wait_for(slow.started.wait(), 10)
            await service.stop_worker()
            assert slow.total == 1  # finished before the worker returned
            for item in items[1:]:
                await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
            queue = service.worker.topology.source_queues[0]
            assert await consumers(channel, queue) == 0
            assert sum([await depth(channel, q) for q in service.worker.topology.source_queues]) == 2
            totals = await counters(runtime, "rabbitmq:forward_ok")
    assert totals["rabbitmq:forward_ok"] == 1


async def test_an_unfinished_message_is_never_acked_and_the_next_worker_gets_it(
    open_runtime: OpenRuntime, recorder: Recorder
) -> None:
    slow = Recorder(delay=2.0)
    item = fixture("messages_delete_revoke")
    async with (
        open_runtime(slow, shutdown_timeout_seconds=0.2) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
            await asyncio.wait_for(slow.started.wait(), 10)
            await service.stop_worker()  # gives up waiting after 0.2 s: the message stays unacked
            queue = service.worker.topology.source_queues[
                service.worker.topology.source_queues.index(f"{settings.rabbitmq_prefix}.messages.delete")
            ]
            await wait_until(
                lambda: _depth_is(channel, queue, 1), within=10, message="the message back in its queue"
            )
            async with worker_for(runtime, service.url):
                await wait_until(
                    lambda: _depth_is(channel, queue, 0), within=15, message="the next worker took it"
                )
                await wait_until(lambda: slow.total == 1, within=10, message="the logic to finish")
    assert slow.total == 1


async def _depth_is(channel: Any, queue: str, expected: int) -> bool:
    return await depth(channel, queue) == expected


async def test_per_instance_mode_with_a_hyphenated_event(
    open_runtime: OpenRuntime, recorder: Recorder, uid: str
) -> None:
    instance = f"acme-{uid}"
    item = fixture("group_participants_update_add")
    body = {**item["rabbitmq_body"], "instance": instance}
    async with (
        open_runtime(rabbitmq_mode="instance", rabbitmq_instances=[instance]) as runtime,
        running_service(runtime) as service,
    ):
        assert f"{instance}.group-participants.update" in service.worker.topology.source_queues
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(
                channel, runtime.settings.rabbitmq_exchange, runtime.settings.rabbitmq_prefix
            )
            await publisher.publish_instance(body, "group-participants.update", instance)
            await wait_until(lambda: recorder.total == 1, within=10, message="processed")
    assert recorder.events[0].instance == instance
    assert recorder.events[0].event == "group-participants.update"


async def test_global_mode_with_a_hyphenated_event_and_no_prefix(
    open_runtime: OpenRuntime, recorder: Recorder, uid: str
) -> None:
    event = "group-participants.update"
    async with (
        open_runtime(rabbitmq_prefix="", rabbitmq_events=[event], rabbitmq_exchange=f"evo-{uid}") as runtime,
        running_service(runtime) as service,
    ):
        # With no prefix Evolution's queue is the bare event name; one test at a time may own it.
        assert service.worker.topology.source_queues == [event]
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, runtime.settings.rabbitmq_exchange, "")
            await publisher.publish_global(fixture("group_participants_update_add")["rabbitmq_body"], event)
            await wait_until(lambda: recorder.total == 1, within=10, message="processed")


async def test_own_mode_consumes_a_queue_of_the_service_bound_to_the_exchange(
    open_runtime: OpenRuntime, recorder: Recorder
) -> None:
    async with open_runtime(rabbitmq_mode="own") as runtime, running_service(runtime) as service:
        settings = runtime.settings
        assert service.worker.topology.source_queues == [settings.rabbitmq_queue]
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publish_all(publisher, fixtures()[:5])
            await wait_until(lambda: recorder.total == 5, within=10, message="processed")
            # Evolution's own queues still receive their copy: that is what own mode costs.
            evolution_queue = f"{settings.rabbitmq_prefix}.{fixtures()[0]['event']}"
            assert await depth(channel, evolution_queue) >= 1
        await remove(
            RABBITMQ_URL,
            service.worker.topology,
            [f"{settings.rabbitmq_prefix}.{i['event']}" for i in fixtures()],
        )


async def test_a_lost_consumer_is_noticed_and_registered_again(
    open_runtime: OpenRuntime, recorder: Recorder
) -> None:
    async with open_runtime() as runtime, running_service(runtime):
        settings = runtime.settings
        queue = f"{settings.rabbitmq_prefix}.call"
        async with broker(RABBITMQ_URL) as (_, channel):
            await channel.queue_delete(queue)  # the broker cancels the worker's consumer on it

        async def back() -> bool:
            return await consumer_count(RABBITMQ_URL, queue) >= 1

        await wait_until(back, within=15, message="the consumer registered again")
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await publisher.publish_global(fixture("call_offer")["rabbitmq_body"], "call")
            await wait_until(lambda: recorder.total == 1, within=10, message="processed after recovery")
        totals = await counters(runtime, "rabbitmq:consumer_lost")
    assert totals["rabbitmq:consumer_lost"] >= 1


async def test_a_cut_broker_connection_while_messages_flow_loses_nothing(
    open_runtime: OpenRuntime, recorder: Recorder, proxy_factory: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 5672)
    events = 60
    async with (
        open_runtime(rabbitmq_url=f"amqp://guest:guest@127.0.0.1:{proxy.port}/") as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            bodies = [
                _unique(fixture("messages_upsert_text_incoming")["rabbitmq_body"], n) for n in range(events)
            ]
            for n, body in enumerate(bodies):
                await publisher.publish_global(body, "messages.upsert")
                if n == events // 3:
                    proxy.cut()
                    service.worker.consuming.clear()
                if n == events // 2:
                    proxy.restore()
            await wait_until(
                lambda: len(recorder.calls) == events, within=30, message="every event processed"
            )
    assert not recorder.doubled()
    assert set(recorder.calls) == {parse_envelope(b).dedup_key for b in bodies}


def _unique(body: dict[str, Any], n: int) -> dict[str, Any]:
    data = {**body["data"], "key": {**body["data"]["key"], "id": f"{body['data']['key']['id']}-{n}"}}
    return {**body, "data": data}


@pytest.mark.slow
async def test_a_rabbitmq_restart_while_messages_flow_loses_nothing(
    open_runtime: OpenRuntime, recorder: Recorder
) -> None:
    events = 40
    async with open_runtime() as runtime, running_service(runtime) as service:
        settings = runtime.settings
        bodies = [_unique(fixture("messages_upsert_group_text")["rabbitmq_body"], n) for n in range(events)]
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            for body in bodies[: events // 2]:
                await publisher.publish_global(body, "messages.upsert")
        await restart_rabbitmq(RABBITMQ_URL)
        await wait_until(service.worker.consuming.is_set, within=60, message="the worker consuming again")
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            for body in bodies[events // 2 :]:
                await publisher.publish_global(body, "messages.upsert")
            await wait_until(
                lambda: len(recorder.calls) == events, within=60, message="every event processed"
            )
    assert not recorder.doubled()
