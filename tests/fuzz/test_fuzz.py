"""Fuzzing both channels with mutated Evolution bodies: never a 5xx, nothing valid lost, nothing left.

The short form runs in CI; ``FUZZ_CASES=10000 .venv/bin/pytest tests/fuzz -p no:cacheprovider``
runs the long one (and ``FUZZ_SEED`` another set of mutations).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evolution_ingest.core import codec
from evolution_ingest.core.events import Event
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.handlers import log_summary
from evolution_ingest.runtime import Runtime
from tests.conftest import RABBITMQ_URL, OpenRuntime, Service, running_service
from tests.fuzz.conftest import CASES, SEED
from tests.support import Recorder, stored_form, variants, wait_until
from tests.support.evolution import EvolutionPublisher, broker, depth
from tests.support.fuzz import ENVELOPE, cases, node_json

pytestmark = pytest.mark.timeout(1800)
IN_FLIGHT = 32


@asynccontextmanager
async def fuzzed_service(
    open_runtime: OpenRuntime, recorder: Recorder
) -> AsyncIterator[tuple[Runtime, Service]]:
    """The service with the built-in handler in front of the recorder (it looks at every event too)."""

    async def handler(event: Event) -> None:
        await log_summary(event)
        await recorder(event)

    async with (
        open_runtime(handler, log_outcomes=False, refusals_keep=1_000_000) as runtime,
        running_service(runtime) as service,
    ):
        yield runtime, service


async def post(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, Any]:
    async with http.post(url, data=raw, headers={"content-type": "application/json"}) as resp:
        body = await resp.read()
        return resp.status, codec.loads(body)


async def quiet(runtime: Runtime, service: Service) -> None:
    """Wait until every queue of the service and of Evolution is empty and no message is in flight."""
    queues = service.worker.topology.consumed_queues + service.worker.topology.service_queues
    async with broker(RABBITMQ_URL) as (_, channel):

        async def empty() -> bool:
            depths = [await depth(channel, queue) for queue in queues]
            return not any(depths) and service.worker._inflight == 0

        await wait_until(empty, within=120, interval=0.2, message="every queue empty, nothing in flight")


async def afterwards_each_valid_event_runs_once(
    runtime: Runtime, service: Service, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    fresh = variants(20, start=10_000)
    settings_ = runtime.settings
    async with broker(RABBITMQ_URL) as (_, channel):
        publisher = EvolutionPublisher(channel, settings_.rabbitmq_exchange, settings_.rabbitmq_prefix)
        for item in fresh:
            await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
            status, answer = await post(http, service.url, node_json(item["webhook_body"]))
            assert status == 200, answer
    keys = [parse_envelope(item["webhook_body"]).dedup_key for item in fresh]
    await wait_until(lambda: all(recorder.calls[k] == 1 for k in keys), within=30, message="fresh events run")
    await quiet(runtime, service)
    assert all(recorder.calls[k] == 1 for k in keys)
    async with http.get(service.url.replace("/api/internal/webhook", "/healthz")) as resp:
        assert resp.status == 200


async def test_fuzzed_webhook_bodies_get_no_5xx_and_every_accepted_one_is_stored(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection,
    report: Any,
) -> None:  # fmt: skip
    made = cases(CASES, SEED, "webhook_body")
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def send(raw: bytes) -> tuple[int, Any]:
        async with slots:
            return await post(http, service.url, raw)

    async with fuzzed_service(open_runtime, recorder) as (runtime, service):
        answers = await asyncio.gather(*(send(case.body) for case in made))
        await quiet(runtime, service)
        outcomes = Counter(
            f"{status} {answer.get('status') or answer.get('code')}" for status, answer in answers
        )
        report("webhook", len(made), outcomes)
        server_errors = [(case.name, status, answer) for case, (status, answer) in zip(made, answers, strict=True)
                         if status >= 500]  # fmt: skip
        assert server_errors == []
        accepted = {answer["dedup_key"] for status, answer in answers if status == 200}
        stored = {r["dedup_key"] for r in await db.fetch("SELECT dedup_key FROM evolution_ingestion_events")}
        assert accepted <= stored  # nothing answered 200 is missing
        refused = {answer["refusal_id"] for status, answer in answers if 400 <= status < 500}
        kept = {r["id"] for r in await db.fetch("SELECT id FROM evolution_ingest_refusals")}
        assert refused == kept  # every refusal is kept, none without an answer
        assert not recorder.doubled()
        await afterwards_each_valid_event_runs_once(runtime, service, http, recorder)


async def test_fuzzed_rabbitmq_messages_are_settled_once_each_without_retries_or_parking(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection,
    report: Any,
) -> None:  # fmt: skip
    made = cases(CASES, SEED + 1, "rabbitmq_body")
    async with fuzzed_service(open_runtime, recorder) as (runtime, service):
        settings_ = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings_.rabbitmq_exchange, settings_.rabbitmq_prefix)
            for case in made:
                await publisher.publish_global(case.body, case.routing_key)
        await quiet(runtime, service)
        await runtime.counters.flush()
        totals = await runtime.counters.read(
            [
                "rabbitmq:invalid",
                "rabbitmq:retried",
                "rabbitmq:parked",
                "rabbitmq:errors",
                "rabbitmq:settle_failed",
            ]
        )
        kept = await db.fetchval("SELECT count(*) FROM evolution_ingest_refusals WHERE source = 'rabbitmq'")
        processed = await db.fetchval(
            "SELECT count(*) FROM evolution_ingestion_events WHERE processed_at IS NOT NULL"
        )
        outcome = {
            "refused and acked": kept,
            "processed": processed,
            "duplicates": len(made) - kept - processed,
        }
        report("rabbitmq", len(made), Counter(outcome))
        assert totals == {
            "rabbitmq:invalid": kept, "rabbitmq:retried": 0, "rabbitmq:parked": 0, "rabbitmq:errors": 0,
            "rabbitmq:settle_failed": 0,
        }  # fmt: skip
        unprocessed = await db.fetchval(
            "SELECT count(*) FROM evolution_ingestion_events WHERE processed_at IS NULL"
        )
        assert unprocessed == 0
        assert not recorder.doubled()
        await afterwards_each_valid_event_runs_once(runtime, service, http, recorder)


# --- a property over arbitrary JSON in every envelope field -------------------------------------

_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=30)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
_BODIES = st.fixed_dictionaries(
    {},
    optional={
        name: (_TEXT.filter(str.strip) | _JSON) if name in {"event", "instance"} else _JSON
        for name in ENVELOPE
    },
)


def _as_received(value: Any) -> Any:
    """A JSON value as the service reads it: integers beyond 64 bits become doubles (as in JavaScript)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else float(value)
    if isinstance(value, dict):
        return {k: _as_received(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_received(v) for v in value]
    return value


@pytest.fixture
async def service(open_runtime: OpenRuntime) -> AsyncIterator[tuple[Runtime, Service]]:
    async with open_runtime(log_outcomes=False) as runtime, running_service(runtime) as running:
        yield runtime, running


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(body=_BODIES)
async def test_any_json_in_any_envelope_field_is_stored_exactly_or_refused_with_a_reason_on_both_channels(
    body: dict[str, Any],
    service: tuple[Runtime, Service],
    http: aiohttp.ClientSession,
    db: asyncpg.Connection,
) -> None:
    runtime, running = service
    url = running.url
    raw = node_json(body)
    status, answer = await post(http, url, raw)
    assert status in {200, 400, 422}, answer
    if status != 200:
        kept = await db.fetchrow(
            "SELECT code, body FROM evolution_ingest_refusals WHERE id = $1", answer["refusal_id"]
        )
        assert kept["code"] == answer["code"]
        return
    row = await db.fetchrow(
        "SELECT payload, payload_text, webhook_seen_at FROM evolution_ingestion_events WHERE dedup_key = $1",
        answer["dedup_key"],
    )
    assert row["webhook_seen_at"] is not None
    if answer["status"] == "processed":  # else an earlier example of this run had the same identity
        assert codec.from_storage(row["payload"], row["payload_text"]) == _as_received(stored_form(body))
    else:
        assert answer["reason"] == "duplicate"
    # The same body by RabbitMQ meets the webhook copy (same key), however odd its content.
    settings_ = runtime.settings
    async with broker(RABBITMQ_URL) as (_, channel):
        publisher = EvolutionPublisher(channel, settings_.rabbitmq_exchange, settings_.rabbitmq_prefix)
        await publisher.publish_global(raw, "messages.upsert")

    async def saved_twice() -> bool:
        seen = await db.fetchval(
            "SELECT rabbitmq_seen_at FROM evolution_ingestion_events WHERE dedup_key = $1",
            answer["dedup_key"],
        )
        return seen is not None

    await wait_until(saved_twice, within=10, message="the RabbitMQ copy recorded on the same row")
