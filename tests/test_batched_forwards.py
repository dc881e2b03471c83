"""Batched forwards against the real webhook app, Postgres and Redis: the forwards made together
go in one request, and every entry ends exactly as it would have alone, answered as it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import asyncpg
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from evolution_ingest.channels.auth import INTERNAL_SECRET_HEADER, OUTCOME_HEADER
from evolution_ingest.channels.batched import BATCH_HEADER, FORWARDS_TYPE, forward_line, parse_forwards
from evolution_ingest.channels.forward import HttpForwarder
from evolution_ingest.core import codec
from evolution_ingest.core.contract import Outcome
from evolution_ingest.core.events import Channel, Event
from evolution_ingest.core.identity import Envelope
from evolution_ingest.runtime import Runtime
from tests.conftest import INTERNAL_SECRET, OpenRuntime, serving
from tests.support import Recorder, dead_port, running_server, variants, wait_until


@asynccontextmanager
async def forwarder_to(
    url: str, secret: str = INTERNAL_SECRET, **options: int
) -> AsyncIterator[HttpForwarder]:
    forwarder = HttpForwarder(url, secret, timeout=10, **options)
    try:
        yield forwarder
    finally:
        await forwarder.close()


async def saved(runtime: Runtime, count: int, *, start: int = 0, alike: bool = False) -> list[Envelope]:
    """``count`` new events saved as the worker saves them (RabbitMQ copy, not processed);
    ``alike``: all made from one small fixture, so that their forwards have one size."""
    items = (
        [variants(1, start=3 + 20 * (5 + k))[0] for k in range(count)]
        if alike
        else variants(count, start=start)
    )
    envelopes = [runtime.ingestion.envelope(item["rabbitmq_body"]) for item in items]
    for envelope in envelopes:
        assert not (await runtime.inbox.save(envelope, Channel.RABBITMQ, None)).processed
    return envelopes


async def unprocessed(db: asyncpg.Connection) -> int:
    return int(
        await db.fetchval("SELECT count(*) FROM evolution_ingestion_events WHERE processed_at IS NULL")
    )


async def test_forwards_made_together_go_in_one_request_and_each_runs_once(
    webhook: tuple[Runtime, str], recorder: Recorder, db: asyncpg.Connection
) -> None:
    runtime, url = webhook
    envelopes = await saved(runtime, 20)
    async with forwarder_to(url) as forwarder:
        first = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes))
        again = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes))
        alone = await forwarder.forward(envelopes[0])  # one forward: a plain request, no batch
        assert (forwarder.batches, forwarder.batched) == (2, 40)
    assert [result.outcome for result in first] == [Outcome.PROCESSED] * 20
    assert [result.dedup_key for result in first] == [envelope.dedup_key for envelope in envelopes]
    assert [result.outcome for result in again] == [Outcome.DUPLICATE] * 20
    assert alone.outcome is Outcome.DUPLICATE
    assert recorder.total == 20
    assert recorder.doubled() == []
    assert {event.channel for event in recorder.events} == {Channel.RABBITMQ}
    assert await unprocessed(db) == 0


async def test_a_batch_is_cut_at_its_size_and_bytes_limits(
    webhook: tuple[Runtime, str], recorder: Recorder
) -> None:
    runtime, url = webhook
    envelopes = await saved(runtime, 10)
    async with forwarder_to(url, batch_max=4) as forwarder:
        results = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes))
        assert (forwarder.batches, forwarder.batched) == (3, 10)  # 4, 4 and 2
    assert recorder.total == 10
    assert all(result.outcome is Outcome.PROCESSED for result in results)

    more = await saved(runtime, 6, alike=True)
    sizes = {len(forward_line(e.dedup_key, codec.dumps({**e.body, "already_saved": True}))) for e in more}
    assert len(sizes) == 1
    async with forwarder_to(url, batch_bytes=2 * sizes.pop() + 1) as forwarder:
        results = await asyncio.gather(*(forwarder.forward(envelope) for envelope in more))
        assert (forwarder.batches, forwarder.batched) == (3, 6)  # two lines fit, not three
    assert all(result.outcome is Outcome.PROCESSED for result in results)
    assert recorder.total == 16
    assert recorder.doubled() == []


async def test_one_bad_entry_never_harms_the_others_of_its_batch(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    ran: list[str] = []
    failing: set[str] = set()

    async def handler(event: Event) -> None:
        if event.dedup_key in failing:
            raise RuntimeError("handler failure on purpose")
        ran.append(event.dedup_key)

    async with open_runtime(handler=handler) as runtime, serving(runtime) as url:
        good = await saved(runtime, 3)
        bad = await saved(runtime, 1, start=50)
        failing.add(bad[0].dedup_key)
        never_saved = runtime.ingestion.envelope(variants(1, start=90)[0]["rabbitmq_body"])
        async with forwarder_to(url) as forwarder:
            results = await asyncio.gather(
                *(forwarder.forward(envelope) for envelope in [good[0], bad[0], never_saved, *good[1:]])
            )
            assert forwarder.batches == 1
    outcomes = [result.outcome for result in results]
    assert outcomes == [
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.NOT_FOUND,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
    ]
    assert "HTTP 500" in (results[1].error or "")
    assert "on purpose" in (results[1].error or "")
    assert "HTTP 409" in (results[2].error or "")
    assert sorted(ran) == sorted(envelope.dedup_key for envelope in good)
    failed = await db.fetchrow(
        "SELECT processed_at, last_error FROM evolution_ingestion_events WHERE dedup_key = $1",
        bad[0].dedup_key,
    )
    assert failed is not None
    assert failed["processed_at"] is None
    assert "on purpose" in failed["last_error"]
    assert (
        await db.fetchval("SELECT count(*) FROM evolution_ingestion_events") == 4
    )  # nothing saved by a forward


async def test_lines_that_are_not_forwards_are_refused_alone_and_kept(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    runtime, url = webhook
    (envelope,) = await saved(runtime, 1)
    forward = codec.dumps({**envelope.body, "already_saved": True})
    not_a_forward = codec.dumps(envelope.body)  # an event, but without already_saved
    body = (
        b"this line is not a forward\n"
        + forward_line(envelope.dedup_key, not_a_forward)
        + forward_line("F" * 64, forward)  # not lowercase hex
        + forward_line(envelope.dedup_key, forward)
    )
    headers = {"content-type": FORWARDS_TYPE, INTERNAL_SECRET_HEADER: INTERNAL_SECRET}
    async with http.post(url, data=body, headers=headers) as response:
        assert response.status == 200
        assert response.headers[BATCH_HEADER] == "1"
        lines = [orjson.loads(line) async for line in response.content]
    by_index = {line["i"]: line for line in lines}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert [by_index[i]["status"] for i in range(4)] == [400, 400, 400, 200]
    assert by_index[0]["answer"]["code"] == by_index[1]["answer"]["code"] == "bad_forward"
    assert "already_saved" in by_index[1]["answer"]["error"]
    assert "64 lowercase hex" in by_index[2]["answer"]["error"]
    assert by_index[3]["outcome"] == "processed"
    assert by_index[3]["answer"]["status"] == "processed"
    assert recorder.total == 1
    kept = await db.fetch("SELECT code, status FROM evolution_ingest_refusals ORDER BY id")
    assert [(row["code"], row["status"]) for row in kept] == [("bad_forward", 400)] * 3


async def test_each_entry_is_answered_as_it_ends_not_when_the_batch_does(open_runtime: OpenRuntime) -> None:
    release = asyncio.Event()
    slow: set[str] = set()

    async def handler(event: Event) -> None:
        if event.dedup_key in slow:
            await release.wait()

    async with open_runtime(handler=handler) as runtime, serving(runtime) as url:
        held, quick = await saved(runtime, 2)
        slow.add(held.dedup_key)
        async with forwarder_to(url) as forwarder:
            pending = [asyncio.ensure_future(forwarder.forward(envelope)) for envelope in (held, quick)]
            await wait_until(pending[1].done, message="the quick entry's answer")
            assert not pending[0].done()
            assert pending[1].result().outcome is Outcome.PROCESSED
            release.set()
            assert (await pending[0]).outcome is Outcome.PROCESSED
            assert forwarder.batches == 1


async def test_a_batch_without_the_right_secret_is_refused_whole_and_changes_nothing(
    webhook: tuple[Runtime, str], recorder: Recorder, db: asyncpg.Connection
) -> None:
    runtime, url = webhook
    envelopes = await saved(runtime, 3)
    async with forwarder_to(url, secret="wrong-secret-for-this-test") as forwarder:
        results = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes))
        assert forwarder.batches == 1
        assert forwarder.batching
    assert {result.outcome for result in results} == {Outcome.UNREACHABLE}
    assert all("HTTP 401" in (result.error or "") for result in results)
    assert "wrong-secret-for-this-test" not in str(results)
    assert recorder.total == 0
    assert await unprocessed(db) == 3
    await runtime.counters.flush()
    assert await runtime.counters.read(["internal:unauthorized"]) == {"internal:unauthorized": 1}


@asynccontextmanager
async def older_webhook_app() -> AsyncIterator[tuple[str, list[str]]]:
    """A webhook app that takes single forwards only (JSON), as versions before batches did."""
    seen: list[str] = []

    async def receive(request: Request) -> JSONResponse:
        seen.append(request.headers["content-type"])
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return JSONResponse({"error": "malformed JSON", "code": "malformed_json"}, status_code=400)
        assert body["already_saved"] is True
        key = request.headers["x-evolution-ingest-dedup-key"]
        return JSONResponse({"status": "processed", "dedup_key": key}, headers={OUTCOME_HEADER: "processed"})

    async with running_server(
        Starlette(routes=[Route("/api/internal/webhook", receive, methods=["POST"])])
    ) as base:
        yield base + "/api/internal/webhook", seen


async def test_an_older_webhook_app_gets_single_forwards_and_loses_none(webhook: tuple[Runtime, str]) -> None:
    runtime, _ = webhook
    envelopes = [runtime.ingestion.envelope(item["rabbitmq_body"]) for item in variants(6)]
    async with older_webhook_app() as (url, seen), forwarder_to(url) as forwarder:
        first = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes[:3]))
        assert not forwarder.batching
        then = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes[3:]))
    assert [r.outcome for r in [*first, *then]] == [Outcome.PROCESSED] * 6
    assert seen == [FORWARDS_TYPE] + ["application/json"] * 6  # the batch once, then one by one


async def test_a_batch_larger_than_the_apps_body_limit_goes_one_by_one(
    open_runtime: OpenRuntime, recorder: Recorder
) -> None:
    async with open_runtime(max_body_bytes=2048) as runtime, serving(runtime) as url:
        envelopes = await saved(runtime, 8, alike=True)  # each fits in 2,048 bytes, not all 8
        async with forwarder_to(url) as forwarder:
            results = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes))
            assert forwarder.batches == 1
            assert forwarder.batching
    assert [result.outcome for result in results] == [Outcome.PROCESSED] * 8
    assert recorder.total == 8


async def test_an_unreachable_webhook_app_fails_every_entry_with_the_reason(
    webhook: tuple[Runtime, str],
) -> None:
    runtime, _ = webhook
    envelopes = [runtime.ingestion.envelope(item["rabbitmq_body"]) for item in variants(3)]
    async with forwarder_to(f"http://127.0.0.1:{dead_port()}/api/internal/webhook") as forwarder:
        results = await asyncio.gather(*(forwarder.forward(envelope) for envelope in envelopes))
    assert {result.outcome for result in results} == {Outcome.UNREACHABLE}
    assert all("Connect" in (result.error or "") for result in results)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", []),
        (b"a" * 64 + b" {}\n", [("a" * 64, b"{}")]),
        (b"short {}\n\n" + b"b" * 64 + b" [1]", [(None, b"short {}"), ("b" * 64, b"[1]")]),
        (b"c" * 64 + b"{}\n", [(None, b"c" * 64 + b"{}")]),
    ],
)
def test_batch_lines_parse_into_key_and_body(raw: bytes, expected: list[tuple[str | None, bytes]]) -> None:
    assert parse_forwards(raw) == expected


def test_a_forward_line_is_one_line_whatever_the_event_holds() -> None:
    body = {"event": "messages.upsert", "data": {"text": "two\nlines\r\nand a \u2028 separator"}}
    line = forward_line("d" * 64, codec.dumps(body))
    assert line.count(b"\n") == 1
    assert line.endswith(b"\n")
    assert parse_forwards(line) == [("d" * 64, codec.dumps(body))]
