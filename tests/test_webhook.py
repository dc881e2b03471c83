"""The webhook channel against the real Postgres and Redis: once, nothing lost, clear answers."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest

from evolution_ingest.channels.auth import INTERNAL_SECRET_HEADER
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.runtime import Runtime
from tests.conftest import DATABASE_URL, INTERNAL_SECRET, OpenRuntime, serving
from tests.support import Recorder, dead_port, fixture, fixture_names, fixtures, stored_form, wait_until

Answer = tuple[int, dict[str, Any]]


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> Answer:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **(headers or {})}
    async with http.post(url, data=data, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def rows(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM evolution_ingestion_events ORDER BY id")


async def counters(runtime: Runtime, *names: str) -> dict[str, int]:
    await runtime.counters.flush()
    return await runtime.counters.read(names)


# --- exactly once --------------------------------------------------------------------


@pytest.mark.parametrize("name", fixture_names())
async def test_fifty_concurrent_copies_run_business_logic_once(
    name: str,
    webhook: tuple[Runtime, str],
    http: aiohttp.ClientSession,
    recorder: Recorder,
    db: asyncpg.Connection,
) -> None:
    runtime, url = webhook
    body = fixture(name)["webhook_body"]
    answers = await asyncio.gather(*(post(http, url, body) for _ in range(50)))

    statuses = [status for status, _ in answers]
    assert statuses == [200] * 50
    outcomes = [answer["status"] for _, answer in answers]
    assert outcomes.count("processed") == 1
    assert outcomes.count("skipped") == 49
    assert {answer.get("reason") for _, answer in answers if answer["status"] == "skipped"} <= {
        "duplicate",
        "locked",
    }
    assert recorder.calls == {parse_envelope(body).dedup_key: 1}
    stored = await rows(db)
    assert len(stored) == 1
    assert stored[0]["channel"] == "WEBHOOK"
    assert stored[0]["processed_at"] is not None
    assert stored[0]["webhook_seen_at"] is not None
    assert stored[0]["rabbitmq_seen_at"] is None
    assert stored[0]["payload"] == stored_form(body)
    assert stored[0]["attempts"] == 1
    totals = await counters(
        runtime,
        "webhook:received",
        "webhook:processed",
        "webhook:skipped_duplicate",
        "webhook:skipped_locked",
    )
    assert totals["webhook:received"] == 50
    assert totals["webhook:processed"] == 1
    assert totals["webhook:skipped_duplicate"] + totals["webhook:skipped_locked"] == 49


async def test_every_fixture_once_and_the_reemitted_message_is_a_duplicate(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    _, url = webhook
    for item in fixtures():
        status, answer = await post(http, url + item["webhook_path_suffix"], item["webhook_body"])
        assert status == 200
        expected = "skipped" if item["name"].endswith("_REEMITTED") else "processed"
        assert answer["status"] == expected, item["name"]
    assert recorder.total == 19
    assert not recorder.doubled()
    assert len(await rows(db)) == 19


async def test_two_emissions_of_one_connection_state_both_run(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    _, url = webhook
    first = fixture("connection_update_open")["webhook_body"]
    later = {**first, "date_time": "2025-11-04T13:00:00.000Z"}
    assert (await post(http, url, first))[1]["status"] == "processed"
    assert (await post(http, url, later))[1]["status"] == "processed"
    assert recorder.total == 2


async def test_a_changed_message_runs_again(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    _, url = webhook
    placeholder = fixture("messages_upsert_text_incoming")["webhook_body"]
    decrypted = copy.deepcopy(placeholder)
    decrypted["data"]["message"]["conversation"] = "texto decifrado"
    assert (await post(http, url, placeholder))[1]["status"] == "processed"
    assert (await post(http, url, decrypted))[1]["status"] == "processed"
    assert (await post(http, url, placeholder))[1] == {
        "status": "skipped",
        "reason": "duplicate",
        "dedup_key": parse_envelope(placeholder).dedup_key,
    }
    assert recorder.total == 2


# --- failures and retries ------------------------------------------------------------


async def test_a_handler_failing_twice_then_succeeding_is_processed_once(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    flaky = Recorder(failures=2)
    body = fixture("messages_upsert_group_text")["webhook_body"]
    async with open_runtime(flaky) as runtime, serving(runtime) as url:
        first = await post(http, url, body)
        second = await post(http, url, body)
        third = await post(http, url, body)
        fourth = await post(http, url, body)
        totals = await counters(runtime, "webhook:failed", "webhook:processed")
    assert [first[0], second[0], third[0], fourth[0]] == [500, 500, 200, 200]
    assert first[1]["status"] == "failed"
    assert "on purpose" in first[1]["detail"]
    assert third[1]["status"] == "processed"
    assert fourth[1]["reason"] == "duplicate"
    assert flaky.total == 1
    (row,) = await rows(db)
    assert row["attempts"] == 3
    assert row["last_error"] == "RuntimeError: handler failure on purpose (0 more)"
    assert row["processed_at"] is not None
    assert row["claim_token"] is None
    assert totals == {"webhook:failed": 2, "webhook:processed": 1}


async def test_a_handler_slower_than_the_lock_ttl_is_not_run_twice(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    slow = Recorder(delay=2.5)
    body = fixture("send_message_text_via_api")["webhook_body"]
    async with open_runtime(slow, lock_ttl_seconds=0.6) as runtime, serving(runtime) as url:
        first = asyncio.create_task(post(http, url, body))
        await asyncio.wait_for(slow.started.wait(), 5)
        duplicates = []
        while not first.done():  # duplicates keep arriving well past the TTL
            duplicates.append(await post(http, url, body))
            await asyncio.sleep(0.2)  # wait-ok: spacing the duplicates in time
        status, answer = await first
    assert (status, answer["status"]) == (200, "processed")
    assert len(duplicates) >= 8
    assert {(s, a["status"], a["reason"]) for s, a in duplicates} == {(200, "skipped", "locked")}
    assert slow.total == 1
    (row,) = await rows(db)
    assert row["attempts"] == 1


# --- Redis down: Postgres alone ------------------------------------------------------


async def test_with_redis_on_a_dead_port_fifty_copies_still_run_once(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    body = fixture("messages_upsert_image_incoming_with_base64")["webhook_body"]
    async with (
        open_runtime(redis_url=f"redis://127.0.0.1:{dead_port()}/0") as runtime,
        serving(runtime) as url,
    ):
        answers = await asyncio.gather(*(post(http, url, body) for _ in range(50)))
        pending = await runtime.counters.pending()
    assert [status for status, _ in answers] == [200] * 50
    assert [a["status"] for _, a in answers].count("processed") == 1
    assert recorder.total == 1
    assert len(await rows(db)) == 1
    assert pending["webhook:redis_fallback"] == 50
    assert pending["webhook:received"] == 50


async def test_counters_kept_through_a_redis_outage_are_flushed_when_it_returns(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder, proxy_factory: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 6379)
    async with (
        open_runtime(redis_url=f"redis://127.0.0.1:{proxy.port}/0") as runtime,
        serving(runtime) as url,
    ):
        proxy.cut()
        answers = await asyncio.gather(
            *(post(http, url, fixture("call_offer")["webhook_body"]) for _ in range(20))
        )
        assert [a["status"] for _, a in answers].count("processed") == 1
        assert not await runtime.counters.flush()
        proxy.restore()
        await wait_until(runtime.counters.flush, message="counters to flush after Redis returns")
        totals = await runtime.counters.read(["webhook:received", "webhook:redis_fallback"])
    assert totals == {"webhook:received": 20, "webhook:redis_fallback": 20}
    assert recorder.total == 1


# --- Postgres down: 503, never 200 ---------------------------------------------------


async def test_with_postgres_unreachable_the_answer_is_503_and_nothing_is_processed(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder, proxy_factory: Any, db: Any
) -> None:
    proxy = await proxy_factory("127.0.0.1", 5432)
    proxied = DATABASE_URL.replace(":5432/", f":{proxy.port}/")
    body = fixture("contacts_upsert_array")["webhook_body"]
    async with open_runtime(database_url=proxied) as runtime, serving(runtime) as url:
        proxy.cut()
        async with http.post(url, data=orjson.dumps(body)) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "5"
            assert "Postgres unavailable" in (await resp.json())["error"]
        assert recorder.total == 0
        assert await rows(db) == []
        proxy.restore()
        status, answer = await post(http, url, body)
        assert (status, answer["status"]) == (200, "processed")
        totals = await counters(runtime, "webhook:unavailable", "webhook:processed")
    assert recorder.total == 1
    assert totals == {"webhook:unavailable": 1, "webhook:processed": 1}


# --- internal forwards ---------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, "wrong-secret"])
async def test_already_saved_without_the_right_secret_is_refused_and_changes_nothing(
    secret: str | None,
    webhook: tuple[Runtime, str],
    http: aiohttp.ClientSession,
    recorder: Recorder,
    db: asyncpg.Connection,
) -> None:
    runtime, url = webhook
    body = {**fixture("messages_update_read")["rabbitmq_body"], "already_saved": True}
    headers = {INTERNAL_SECRET_HEADER: secret} if secret else {}
    status, answer = await post(http, url, body, headers=headers)
    assert status == 401
    assert INTERNAL_SECRET_HEADER in answer["error"]
    assert recorder.total == 0
    assert await rows(db) == []
    assert (await counters(runtime, "internal:unauthorized")) == {"internal:unauthorized": 1}


async def test_internal_calls_are_refused_when_no_secret_is_configured(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    body = {**fixture("messages_update_read")["rabbitmq_body"], "already_saved": True}
    async with open_runtime(internal_secret=None) as runtime, serving(runtime) as url:
        status, answer = await post(http, url, body, headers={INTERNAL_SECRET_HEADER: ""})
    assert status == 401
    assert "disabled" in answer["error"]
    assert recorder.total == 0


async def test_a_forward_for_an_unsaved_event_is_a_409_not_a_save(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    _, url = webhook
    body = {**fixture("messages_update_read")["rabbitmq_body"], "already_saved": True}
    status, answer = await post(http, url, body, headers={INTERNAL_SECRET_HEADER: INTERNAL_SECRET})
    assert status == 409
    assert "no inbox row" in answer["error"]
    assert recorder.total == 0
    assert await rows(db) == []


async def test_a_forward_runs_a_saved_event_once_and_never_saves_it_again(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    runtime, url = webhook
    item = fixture("groups_upsert")
    envelope = runtime.ingestion.envelope(item["rabbitmq_body"])
    saved = await runtime.inbox.save(envelope, Channel.RABBITMQ, None)  # as the worker saves it
    assert not saved.processed
    before = await rows(db)
    forward = {**item["rabbitmq_body"], "already_saved": True}
    headers = {INTERNAL_SECRET_HEADER: INTERNAL_SECRET}
    answers = await asyncio.gather(*(post(http, url, forward, headers=headers) for _ in range(10)))
    assert [a["status"] for _, a in answers].count("processed") == 1
    assert recorder.total == 1
    assert recorder.events[0].channel.value == "RABBITMQ"
    after = await rows(db)
    assert len(after) == 1
    assert after[0]["payload"] == before[0]["payload"] == stored_form(item["rabbitmq_body"])
    assert after[0]["webhook_seen_at"] is None


# --- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "status", "reason"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b"", 400, "malformed JSON"),
        (b"[1, 2, 3]", 400, "must be a JSON object"),
        (b'{"instance": "acme", "data": {}}', 400, "missing field 'event'"),
        (b'{"event": "call", "data": {}}', 400, "missing field 'instance'"),
        (b'{"event": ["call"], "instance": "acme", "data": {}}', 400, "'event' must be a non-empty string"),
        (b'{"event": "call", "instance": 7, "data": {}}', 400, "'instance' must be a non-empty string"),
        (b'{"event": "call", "instance": "a", "data": {}, "date_time": {}}', 400, "'date_time' must be"),
        (b'{"event": "call", "instance": "a", "data": {}, "already_saved": "yes"}', 400, "boolean"),
        (b'{"event": "call", "instance": "a", "data": 1e999}', 400, ""),
        (b"[" * 5000 + b"]" * 5000, 400, "malformed JSON"),
        (b"\xff\xfe{}", 400, "malformed JSON"),
    ],
)
async def test_bad_input_gets_a_4xx_with_a_reason_and_the_app_keeps_serving(
    payload: bytes,
    status: int,
    reason: str,
    webhook: tuple[Runtime, str],
    http: aiohttp.ClientSession,
    recorder: Recorder,
    db: asyncpg.Connection,
) -> None:
    runtime, url = webhook
    got_status, answer = await post(http, url, payload)
    assert got_status == status
    assert reason in answer["error"]
    assert answer["error"]
    assert await rows(db) == []
    (kept,) = await db.fetch("SELECT * FROM evolution_ingest_refusals")
    assert (kept["id"], kept["source"], kept["status"], kept["code"]) == (
        answer["refusal_id"], "webhook", status, answer["code"],
    )  # fmt: skip
    assert bytes(kept["body"]) == payload
    ok_status, ok = await post(http, url, fixture("call_offer")["webhook_body"])
    assert (ok_status, ok["status"]) == (200, "processed")
    assert (await counters(runtime, "webhook:rejected"))["webhook:rejected"] == 1


async def test_an_oversized_body_gets_422_is_kept_cut_and_the_app_keeps_serving(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    big = fixture("messages_upsert_image_incoming_with_base64")["webhook_body"]
    big["data"]["message"]["base64"] = "A" * 200_000
    async with (
        open_runtime(max_body_bytes=64 * 1024, refusal_max_bytes=8 * 1024) as runtime,
        serving(runtime) as url,
    ):
        status, answer = await post(http, url, big)
        assert (status, answer["code"]) == (422, "too_large")  # Evolution does not retry a 422
        assert "larger than 65536 bytes (EVOLUTION_INGEST_MAX_BODY_BYTES)" in answer["error"]

        async def chunked() -> Any:  # no Content-Length: the limit applies while streaming
            for _ in range(40):
                yield b" " * 4096

        async with http.post(url, data=chunked()) as resp:
            assert resp.status == 422
        status, answer = await post(http, url, fixture("call_offer")["webhook_body"])
    assert (status, answer["status"]) == (200, "processed")
    assert recorder.total == 1
    kept = await db.fetch("SELECT * FROM evolution_ingest_refusals ORDER BY id")
    assert [(r["code"], r["truncated"], len(r["body"])) for r in kept] == [("too_large", True, 8 * 1024)] * 2
    assert bytes(kept[0]["body"]) == orjson.dumps(big)[: 8 * 1024]


async def test_a_huge_number_of_keys_gets_422(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    body = fixture("contacts_upsert_single_object")["webhook_body"]
    body["data"] = {f"k{i}": i for i in range(5000)}
    async with open_runtime(max_json_keys=1000) as runtime, serving(runtime) as url:
        status, answer = await post(http, url, body)
        assert (status, answer["code"]) == (422, "too_many_keys")
        assert "more than 1000 keys" in answer["error"]
        ok = await post(http, url, fixture("call_offer")["webhook_body"])
    assert ok[0] == 200
    assert recorder.total == 1


async def test_a_nul_character_is_stored_in_place_of_rejecting_the_event(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder, db: asyncpg.Connection
) -> None:
    _, url = webhook
    body = fixture("messages_upsert_text_incoming")["webhook_body"]
    body["data"]["message"]["conversation"] = "a\u0000b \\u0000 literal"
    status, answer = await post(http, url, body)
    assert (status, answer["status"]) == (200, "processed")
    assert recorder.events[0].data["message"]["conversation"] == "a\u0000b \\u0000 literal"
    (row,) = await rows(db)
    assert row["payload"]["data"]["message"]["conversation"] == "a\ufffdb \\u0000 literal"


async def test_a_url_suffix_and_a_get_are_handled(
    webhook: tuple[Runtime, str], http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    _, url = webhook
    item = fixture("group_participants_update_add")
    status, answer = await post(http, url + "/group-participants-update", item["webhook_body"])
    assert (status, answer["status"]) == (200, "processed")
    async with http.get(url) as resp:
        assert resp.status == 405
    async with http.get(url.replace("/api/internal/webhook", "/healthz")) as resp:
        assert resp.status == 200


async def test_postgres_lost_between_the_logic_and_its_record_neither_fails_nor_repeats_it(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, proxy_factory: Any, db: Any
) -> None:
    """The handler completes, then Postgres goes away for 2 s: the record waits for it,
    holding the event's lease, and a copy arriving meanwhile is told "locked", not run again."""
    proxy = await proxy_factory("127.0.0.1", 5432)
    proxied = DATABASE_URL.replace(":5432/", f":{proxy.port}/")
    recorder = Recorder()

    async def cut_after_the_logic(event: Any) -> None:
        await recorder(event)
        proxy.cut()  # every pooled connection dies; the mark that follows cannot commit yet
        asyncio.get_running_loop().call_later(2.0, proxy.restore)  # longer than a second or two

    body = fixture("call_offer")["webhook_body"]
    key = parse_envelope(body).dedup_key
    async with (
        open_runtime(cut_after_the_logic, database_url=proxied, lock_ttl_seconds=3.0) as runtime,
        serving(runtime) as url,
    ):
        first = asyncio.create_task(post(http, url, body))
        await wait_until(lambda: recorder.total == 1, message="the logic to run")
        status, answer = await post(http, url, body)  # a retry while the record waits
        # Postgres is away (503, retried later) or the copy is saved and locked: never run.
        assert (status, answer.get("status")) in {(503, None), (200, "skipped")}
        assert await first == (200, {"status": "processed", "dedup_key": key})
    assert recorder.total == 1
    (row,) = await rows(db)
    assert row["processed_at"] is not None
    assert row["attempts"] == 1
