"""The fault drill: events on both channels while something breaks; nothing lost, nothing doubled.

Run it alone with ``.venv/bin/pytest tests/drill`` (``DRILL_EVENTS=1000`` for a long form).
The service runs as separate ``serve``, ``worker`` and ``reconcile`` processes; Evolution is
emulated (webhook retried on failure, RabbitMQ publishes dropped while the broker is away).
Timings are shortened (lock lease 3 s, reconciler every second) so the system settles fast.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import pytest
from redis.asyncio import Redis

from evolution_ingest.config import Settings
from evolution_ingest.stores.queues import Topology
from tests.conftest import DATABASE_URL, RABBITMQ_URL, REDIS_URL
from tests.drill.conftest import EVENTS
from tests.drill.harness import Count, Deployment, Evolution, deployed, replicas, send_all, settle
from tests.support import eventually, running_server
from tests.support.evolution import broker, depth, remove, restart_rabbitmq
from tests.support.fake_evolution import FakeEvolution, FakeInstance

pytestmark = [pytest.mark.drill, pytest.mark.timeout(300)]

RATE = 20.0  # events per second: a short form lasts two seconds of sending
SHORT_TIMINGS = {
    "HANDLERS": "tests.support.handlers:drill",
    "LOCK_TTL_SECONDS": "3",
    "RECONCILE_INTERVAL_SECONDS": "1",
    "RECONCILE_AFTER_SECONDS": "2",
    "RETRY_DELAYS_SECONDS": "0.5,1,2,4",
    "LOCK_BUSY_DELAY_SECONDS": "0.3",
    "SHUTDOWN_TIMEOUT_SECONDS": "2",
    "RABBITMQ_WATCHDOG_SECONDS": "2",
}

Fault = Callable[[Deployment], Awaitable[None]]
FAKE_KEY = "fake-evolution-key-of-the-drill"


def drill_topology(settings: Settings) -> Topology:
    """The drill's queues and exchanges, named by the drill's own (short) timings."""
    timings = settings.model_copy(
        update={
            "retry_delays_seconds": [float(d) for d in SHORT_TIMINGS["RETRY_DELAYS_SECONDS"].split(",")],
            "lock_busy_delay_seconds": float(SHORT_TIMINGS["LOCK_BUSY_DELAY_SECONDS"]),
        }
    )
    return Topology(timings)


async def remove_drill_topology(settings: Settings) -> None:
    await remove(RABBITMQ_URL, drill_topology(settings))


def nothing_left(settings: Settings) -> Callable[[], Awaitable[bool]]:
    """No unprocessed row, and no message in any queue of the drill: nothing can run an event again."""
    topology = drill_topology(settings)

    async def quiet() -> bool:
        conn = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": settings.database_schema})
        try:
            if await conn.fetchval(
                "SELECT count(*) FROM evolution_ingestion_events WHERE processed_at IS NULL"
            ):
                return False
        finally:
            await conn.close()
        try:
            async with broker(RABBITMQ_URL) as (_, channel):
                for queue in [*topology.consumed_queues, *topology.service_queues]:
                    if await depth(channel, queue):
                        return False
        except aio_pika.exceptions.AMQPException:  # a queue not declared again yet after a restart
            return False
        return True

    return quiet


@asynccontextmanager
async def drill(
    settings: Settings, tmp_path: Path, uid: str, evolution_timeout: float = 10.0, **extra: str
) -> AsyncIterator[tuple[Deployment, Evolution, Path]]:
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**SHORT_TIMINGS, "DATABASE_APPLICATION_NAME": f"drill-{uid}", **extra}
    try:
        async with (
            deployed(settings, trace, **env) as deployment,
            Evolution(
                deployment.url,
                RABBITMQ_URL,
                settings.rabbitmq_exchange,
                settings.rabbitmq_prefix,
                webhook_timeout=evolution_timeout,
            ) as evolution,
        ):
            yield deployment, evolution, trace
    finally:
        await remove_drill_topology(settings)


async def run(
    deployment: Deployment, evolution: Evolution, trace: Path, fault: Fault | None = None, at: float = 0.3
) -> Count:
    """Send ``EVENTS`` events; at ``at`` of the way, inject ``fault``; wait for the system to settle."""
    sending = asyncio.create_task(send_all(evolution, 0, EVENTS, RATE))
    if fault is not None:
        await asyncio.sleep(EVENTS / RATE * at)  # wait-ok: let the fault land mid-stream
        await fault(deployment)
    keys = await sending  # Evolution's webhook retries are over too
    return await settle(trace, keys, within=120, quiet=nothing_left(deployment.settings))


def check(
    count: Count, record: Any, scenario: str, evolution: Evolution, *, doubles_allowed: int = 0
) -> None:
    notes = (
        f"webhook retries {evolution.webhook_retries}, publishes dropped {evolution.dropped_publishes}"
        + (f", missed by both channels {evolution.missed} (backfilled)" if evolution.missed else "")
        + (
            f"; doubles allowed (crash after the logic, before processed_at): ≤ {doubles_allowed}"
            if doubles_allowed
            else ""
        )
    )
    record(scenario, count, notes)
    assert count.settled, "the system did not come to rest: something was still pending"
    assert count.lost == 0, f"{count.lost} events lost"
    assert count.doubled <= doubles_allowed, f"{count.doubled} events processed twice"


def killed_for_a_second(component: str) -> Fault:
    """SIGKILL ``component``, leave it down for a second, start it again."""

    async def fault(deployment: Deployment) -> None:
        deployment.kill(component)
        await asyncio.sleep(1.0)  # wait-ok: the component stays down for a second
        await deployment.restart(component)

    return fault


async def test_both_channels_down_for_an_instance_then_back(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    # Evolution stores every message; while both channels are down for the instance (its webhook
    # gave up, its RabbitMQ publisher dropped) nothing reaches the service. The reconciler's
    # process backfills on its schedule from the stored messages.
    fake = FakeEvolution(FAKE_KEY, [FakeInstance("drill")])
    backfill = {
        "EVOLUTION_URL": "", "EVOLUTION_API_KEY": FAKE_KEY, "BACKFILL_INTERVAL_SECONDS": "2",
        "BACKFILL_SETTLE_SECONDS": "0", "BACKFILL_OVERLAP_SECONDS": "600", "GAP_CHECK_INTERVAL_SECONDS": "0.3",
    }  # fmt: skip
    async with running_server(fake.app) as evolution_url:
        backfill["EVOLUTION_URL"] = evolution_url
        async with drill(settings, tmp_path, uid, **backfill) as (deployment, evolution, trace):
            evolution.store = lambda data: fake.store("drill", data)

            async def both_down(_: Deployment) -> None:
                evolution.down = True
                # Both channels stay down while 40 % of the stream goes by (bounded by its length).
                await eventually(lambda: evolution.missed >= EVENTS * 0.4, within=EVENTS / RATE)
                evolution.down = False

            count = await run(deployment, evolution, trace, both_down)
    assert evolution.missed > 0
    check(count, record, "both channels down for an instance, then back", evolution)


async def test_worker_killed_in_the_middle_of_forwards(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    async with drill(settings, tmp_path, uid, DRILL_DELAY="0.2") as (deployment, evolution, trace):
        count = await run(deployment, evolution, trace, killed_for_a_second("worker"))
    check(count, record, "worker SIGKILLed mid-forwards, restarted", evolution)


async def test_webhook_app_killed_in_the_middle_of_handlers(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    async with drill(settings, tmp_path, uid, DRILL_DELAY="0.3") as (deployment, evolution, trace):
        count = await run(deployment, evolution, trace, killed_for_a_second("serve"))
    # At most the handlers in flight at the kill can have completed without their processed_at.
    check(
        count, record, "webhook app SIGKILLed mid-handlers, restarted", evolution, doubles_allowed=int(RATE)
    )


@pytest.mark.slow
async def test_rabbitmq_restarted(settings: Settings, tmp_path: Path, uid: str, record: Any) -> None:
    async def restart(deployment: Deployment) -> None:
        await restart_rabbitmq(RABBITMQ_URL)

    async with drill(settings, tmp_path, uid, DRILL_DELAY="0.1") as (deployment, evolution, trace):
        count = await run(deployment, evolution, trace, restart)
    check(count, record, "RabbitMQ restarted", evolution)


async def test_redis_restarted(
    settings: Settings, tmp_path: Path, uid: str, record: Any, proxy_factory: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 6379)

    async def restart_redis(deployment: Deployment) -> None:
        proxy.cut()  # connections drop ...
        redis = Redis.from_url(REDIS_URL)
        try:  # ... and, as after a restart without persistence, locks and markers are gone
            keys = [k async for k in redis.scan_iter(match=settings.redis_key_prefix + "*")]
            if keys:
                await redis.delete(*keys)
        finally:
            await redis.aclose()
        await asyncio.sleep(1.0)  # wait-ok: Redis stays away for a second
        proxy.restore()

    redis_url = f"redis://127.0.0.1:{proxy.port}/0"
    async with drill(settings, tmp_path, uid, DRILL_DELAY="0.2", REDIS_URL=redis_url) as (
        deployment,
        evolution,
        trace,
    ):
        count = await run(deployment, evolution, trace, restart_redis)
    check(count, record, "Redis restarted (keys lost)", evolution)


async def test_postgres_connections_terminated_during_load(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    async def terminate(deployment: Deployment) -> None:
        conn = await asyncpg.connect(DATABASE_URL)
        try:
            for _ in range(3):
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                    f"drill-{uid}",
                )
                await asyncio.sleep(EVENTS / RATE * 0.2)  # wait-ok: again, a little later
        finally:
            await conn.close()

    async with drill(settings, tmp_path, uid, DRILL_DELAY="0.1") as (deployment, evolution, trace):
        count = await run(deployment, evolution, trace, terminate, at=0.2)
    check(count, record, "Postgres connections terminated 3 times", evolution)


async def test_handler_failing_for_a_fifth_of_calls(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    async with drill(settings, tmp_path, uid, DRILL_FAIL_RATE="0.2") as (deployment, evolution, trace):
        count = await run(deployment, evolution, trace)
    check(count, record, "handler failing 20% of calls", evolution)


async def test_forwards_timing_out(settings: Settings, tmp_path: Path, uid: str, record: Any) -> None:
    async with drill(settings, tmp_path, uid, DRILL_DELAY="0.4", FORWARD_TIMEOUT_SECONDS="0.15") as (
        deployment,
        evolution,
        trace,
    ):
        count = await run(deployment, evolution, trace)
    check(count, record, "forwards timing out (0.15 s, handler ≤ 0.4 s)", evolution)


async def test_evolution_retries_after_its_own_timeout(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    async with drill(settings, tmp_path, uid, evolution_timeout=0.1, DRILL_DELAY="0.4") as (
        deployment,
        evolution,
        trace,
    ):
        count = await run(deployment, evolution, trace)
    assert evolution.webhook_retries > 0  # the same bodies really were sent again
    check(count, record, "Evolution re-sends after a 0.1 s timeout", evolution)


async def test_two_replicas_of_every_component(
    settings: Settings, tmp_path: Path, uid: str, record: Any
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**SHORT_TIMINGS, "DATABASE_APPLICATION_NAME": f"drill-{uid}", "DRILL_DELAY": "0.1"}
    try:
        async with (
            replicas(settings, trace, 2, **env) as (first, second),
            Evolution(
                [first.url, second.url], RABBITMQ_URL, settings.rabbitmq_exchange, settings.rabbitmq_prefix
            ) as evolution,
        ):
            count = await run(first, evolution, trace)
    finally:
        await remove_drill_topology(settings)
    check(count, record, "2 webhook apps, 2 workers, 2 reconcilers", evolution)
