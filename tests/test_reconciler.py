"""The reconciler heals what crashed: once, with one active reconciler, and gives up on the hopeless."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson

from evolution_ingest.channels.forward import HttpForwarder
from evolution_ingest.channels.reconciler import Reconciler
from evolution_ingest.core.contract import Result
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope, parse_envelope
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores.inbox import BODIES, TABLE
from tests.conftest import INTERNAL_SECRET, OpenRuntime, serving
from tests.support import Recorder, dead_port, fixture, fixtures, free_socket, wait_until
from tests.test_cli import env_for, healthy


class CountingForwarder:
    """Wraps a forwarder and counts forwards per dedup key."""

    def __init__(self, inner: HttpForwarder) -> None:
        self.inner = inner
        self.sent: Counter[str] = Counter()

    async def forward(self, envelope: Envelope) -> Result:
        self.sent[envelope.dedup_key] += 1
        return await self.inner.forward(envelope)

    async def close(self) -> None:
        await self.inner.close()


@asynccontextmanager
async def reconciler_for(runtime: Runtime, url: str) -> AsyncIterator[tuple[Reconciler, CountingForwarder]]:
    forwarder = CountingForwarder(HttpForwarder(url, INTERNAL_SECRET, timeout=5))
    runtime.ingestion.forward_with(forwarder)  # as `reconcile` does: the webhook app is elsewhere
    reconciler = Reconciler(
        ingestion=runtime.ingestion, reads=runtime.stores.reads, settings=runtime.settings
    )
    try:
        yield reconciler, forwarder
    finally:
        await reconciler.leadership.release()
        await forwarder.close()


async def stuck_events(runtime: Runtime, db: asyncpg.Connection, items: list[dict[str, Any]]) -> list[str]:
    """Save events as a crashed worker would have (saved, never processed), ten minutes ago."""
    keys = []
    for item in items:
        envelope = parse_envelope(item["rabbitmq_body"])
        await runtime.inbox.save(envelope, Channel.RABBITMQ, None)
        keys.append(envelope.dedup_key)
    await backdate(db, "10 minutes")
    return keys


async def backdate(db: asyncpg.Connection, age: str) -> None:
    """Every row received ``age`` ago; a body keeps its row's received_at (its partition key)."""
    await db.execute(
        f"WITH aged AS (UPDATE {TABLE} SET received_at = now() - $1::text::interval RETURNING id, received_at) "
        f"UPDATE {BODIES} AS b SET received_at = aged.received_at FROM aged WHERE b.event_id = aged.id",
        age,
    )


async def test_a_webhook_app_killed_after_saving_is_healed_by_the_next_pass_once(
    settings: Any,
    open_runtime: OpenRuntime,
    recorder: Recorder,
    db: asyncpg.Connection,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    started = tmp_path / "started"
    env = env_for(settings, PORT=str(port), HANDLERS="tests.support.handlers:hang", LOCK_TTL_SECONDS="1")
    env["TEST_STARTED_FILE"] = str(started)
    env["PYTHONPATH"] = os.getcwd()
    body = fixture("messages_upsert_text_incoming")["webhook_body"]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "evolution_ingest", "serve", env=env)
    try:
        await wait_until(lambda: healthy(http, port), within=30, message="the webhook app")
        request = asyncio.create_task(
            http.post(f"http://127.0.0.1:{port}/api/internal/webhook", data=orjson.dumps(body))
        )
        await wait_until(started.exists, within=10, message="business logic to start")
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        with contextlib.suppress(aiohttp.ClientError):  # the connection died with the process
            await request
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    row = await db.fetchrow(f"SELECT * FROM {TABLE}")
    assert row["processed_at"] is None  # saved, claimed, never finished
    assert row["claim_token"] is not None

    async with open_runtime(reconcile_after_seconds=0.5) as runtime, serving(runtime) as url:
        async with reconciler_for(runtime, url) as (reconciler, forwarder):

            async def healed() -> bool:
                await reconciler.run_once()  # nothing to do until the dead claim's lease runs out
                return recorder.total == 1

            await wait_until(healed, within=15, interval=0.3, message="the next pass to process it")
            second = await reconciler.run_once()
        await runtime.counters.flush()
        totals = await runtime.counters.read(["reconciler:recovered", "reconciler:runs"])
    assert recorder.calls == {parse_envelope(body).dedup_key: 1}
    assert forwarder.sent == {parse_envelope(body).dedup_key: 1}
    assert second.found == 0
    assert totals["reconciler:recovered"] == 1
    assert totals["reconciler:runs"] >= 2
    assert await db.fetchval(f"SELECT processed_at IS NOT NULL FROM {TABLE}")


async def test_two_reconcilers_started_together_forward_each_stuck_event_once(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection
) -> None:
    items = fixtures()[:12]
    async with open_runtime() as runtime, serving(runtime) as url:
        keys = await stuck_events(runtime, db, items)
        async with (
            reconciler_for(runtime, url) as (first, sent_a),
            reconciler_for(runtime, url) as (second, sent_b),
        ):
            reports = await asyncio.gather(first.run_once(), second.run_once())
    assert sorted(r.leader for r in reports) == [False, True]
    assert (sent_a.sent + sent_b.sent) == Counter(dict.fromkeys(keys, 1))
    assert sorted(recorder.calls) == sorted(keys)
    assert not recorder.doubled()


async def test_when_the_active_reconciler_dies_another_takes_over(
    open_runtime: OpenRuntime, recorder: Recorder, db: asyncpg.Connection
) -> None:
    async with (
        open_runtime(reconcile_interval_seconds=0.2) as runtime,
        serving(runtime) as url,
        reconciler_for(runtime, url) as (leader, _),
        reconciler_for(runtime, url) as (standby, _),
    ):
        assert (await leader.run_once()).leader
        assert not (await standby.run_once()).leader
        stop = asyncio.Event()
        standing_by = asyncio.create_task(standby.run(stop))
        await leader.leadership.release()  # the leader's process died: its connection closed
        await stuck_events(runtime, db, fixtures()[:3])
        await wait_until(lambda: recorder.total == 3, within=10, message="the standby to take over")
        stop.set()
        await asyncio.wait_for(standing_by, 10)


async def test_a_stuck_event_that_always_fails_is_marked_failed_after_n_attempts(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    broken = Recorder(failures=10**6)
    async with open_runtime(broken, reconcile_max_attempts=3) as runtime, serving(runtime) as url:
        keys = await stuck_events(runtime, db, [fixture("call_offer")])
        async with reconciler_for(runtime, url) as (reconciler, forwarder):
            outcomes = [(await reconciler.run_once()).outcomes for _ in range(5)]
        await runtime.counters.flush()
        totals = await runtime.counters.read(["reconciler:failed", "reconciler:forward_fail"])
    assert [o["failing"] for o in outcomes] == [1, 1, 0, 0, 0]
    assert [o["dead"] for o in outcomes] == [0, 0, 1, 0, 0]
    assert forwarder.sent == {keys[0]: 3}  # given up on, it is no longer sent
    row = await db.fetchrow(f"SELECT * FROM {TABLE}")
    assert row["attempts"] == 3
    assert row["failed_at"] is not None
    assert row["processed_at"] is None
    assert row["last_error"].startswith("RuntimeError: handler failure on purpose")
    assert totals == {"reconciler:failed": 1, "reconciler:forward_fail": 3}


async def test_an_unreachable_webhook_app_never_marks_an_event_failed(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    async with open_runtime(reconcile_max_attempts=1) as runtime:
        await stuck_events(runtime, db, [fixture("groups_upsert")])
        async with reconciler_for(runtime, f"http://127.0.0.1:{dead_port()}/api/internal/webhook") as (
            reconciler,
            _,
        ):
            for _ in range(3):
                await reconciler.run_once()
    row = await db.fetchrow(f"SELECT * FROM {TABLE}")
    assert row["failed_at"] is None
    assert row["attempts"] == 0
    assert row["last_error"].startswith("re-forward failed: ClientConnectorError")
