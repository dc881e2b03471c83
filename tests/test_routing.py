"""Built-in routes: forwards once per destination, drops, filters, alerts with a cool-down."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
import yaml

from evolution_ingest.config import ConfigError
from evolution_ingest.core.events import Channel, Event
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.logic.route import Route
from evolution_ingest.logic.routes_file import load_routes
from evolution_ingest.operate import views
from evolution_ingest.runtime import Runtime
from tests.conftest import OpenRuntime, serving
from tests.support import Recorder, fixture, fixtures, running_server
from tests.support.destination import Destination
from tests.test_cli import env_for, run_cli

MESSAGE_FIXTURES = {
    "messages_upsert_text_incoming",
    "messages_upsert_text_fromMe_sent_from_phone",
    "send_message_text_via_api",
    "messages_update_delivery_ack",
    "messages_update_read",
    "messages_upsert_image_incoming_with_base64",
    "messages_upsert_group_text",
    "messages_delete_revoke",
    "messages_set_history_chunk",
}


def write_routes(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


@asynccontextmanager
async def destinations(*targets: Destination) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_server(t.app)) + "/hook" for t in targets]


@asynccontextmanager
async def routed(
    open_runtime: OpenRuntime, tmp_path: Path, document: dict[str, Any], **overrides: Any
) -> AsyncIterator[tuple[Runtime, str]]:
    async with (
        open_runtime(routes_file=write_routes(tmp_path, document), **overrides) as runtime,
        serving(runtime) as url,
    ):
        yield runtime, url


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=orjson.dumps(body)) as resp:
        return resp.status, await resp.json()


async def test_a_route_forwards_every_matching_fixture_once_with_its_idempotency_key(
    open_runtime: OpenRuntime, tmp_path: Path, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    app = Destination()
    async with destinations(app) as (url_app,):
        document = {
            "routes": [
                {"name": "drop-presence", "match": {"events": "presence.update"}, "drop": True},
                {"name": "messages", "match": {"events": ["messages.*", "send.message"]},
                 "forward": {"url": url_app, "headers": {"Authorization": "Bearer fake-app-token"}}},
            ]
        }  # fmt: skip
        async with routed(open_runtime, tmp_path, document) as (runtime, url):
            for item in fixtures() + fixtures():  # every event twice, the re-emission too
                status, _ = await post(http, url, item["webhook_body"])
                assert status == 200
            await runtime.counters.flush()
            totals = await runtime.counters.read(["route:messages:forwarded", "route:drop-presence:dropped"])
    expected = {parse_envelope(fixture(n)["webhook_body"]).dedup_key: fixture(n) for n in MESSAGE_FIXTURES}
    assert len(app.received) == len(expected)
    assert {r.headers["idempotency-key"] for r in app.received} == set(expected)
    for received in app.received:
        item = expected[received.headers["idempotency-key"]]
        assert received.headers["x-evolution-event"] == item["event"]
        assert received.headers["x-evolution-instance"] == "acme-sales"
        assert received.headers["authorization"] == "Bearer fake-app-token"
        assert "apikey" not in received.body
        assert received.body == {k: v for k, v in item["webhook_body"].items() if k != "apikey"}
    assert totals == {"route:messages:forwarded": len(expected), "route:drop-presence:dropped": 1}
    assert recorder.total == 19  # the handlers after the router still run for every event


async def test_two_destinations_with_one_failing_twice_deliver_once_each(
    open_runtime: OpenRuntime, tmp_path: Path, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    healthy, flaky = Destination(), Destination(statuses=[503, 503])
    body = fixture("messages_upsert_text_incoming")["webhook_body"]
    async with destinations(healthy, flaky) as (url_healthy, url_flaky):
        document = {"routes": [{"name": "both", "forward": [{"url": url_healthy}, {"url": url_flaky}]}]}
        async with routed(open_runtime, tmp_path, document) as (runtime, url):
            answers = [await post(http, url, body) for _ in range(4)]
            await runtime.counters.flush()
            totals = await runtime.counters.read(["route:both:forwarded", "route:both:failed"])
    assert [status for status, _ in answers] == [500, 500, 200, 200]
    assert "both#2: HTTP 503" in answers[0][1]["detail"]
    assert answers[3][1]["reason"] == "duplicate"
    assert len(healthy.received) == 1
    assert [r.status for r in flaky.received] == [503, 503, 200]
    assert len(flaky.accepted) == 1
    rows = await db.fetch("SELECT destination, status, attempts FROM evolution_ingest_deliveries ORDER BY 1")
    assert [tuple(r) for r in rows] == [("both", "delivered", 1), ("both#2", "delivered", 3)]
    assert totals == {"route:both:forwarded": 2, "route:both:failed": 2}


async def test_a_400_from_a_destination_is_permanent_and_not_retried(
    open_runtime: OpenRuntime, tmp_path: Path, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    refusing = Destination(default=400)
    body = fixture("send_message_text_via_api")["webhook_body"]
    async with destinations(refusing) as (url_refusing,):
        document = {"routes": [{"name": "crm", "forward": {"url": url_refusing}}]}
        async with routed(open_runtime, tmp_path, document) as (runtime, url):
            first = await post(http, url, body)
            again = await post(http, url, body)
            await runtime.counters.flush()
            totals = await runtime.counters.read(["route:crm:permanent", "route:crm:failed"])
            assert runtime.router is not None
            problems = await runtime.router.deliveries.problems()
            report = await views.status(runtime.stores, runtime.settings, runtime.routes)
            row = await views.inspect(runtime.stores, parse_envelope(body).dedup_key)
    assert first == (200, {"status": "processed", "dedup_key": parse_envelope(body).dedup_key})
    assert again[1]["reason"] == "duplicate"
    assert len(refusing.received) == 1
    stored = await db.fetchrow("SELECT status, http_status, last_error FROM evolution_ingest_deliveries")
    assert (stored["status"], stored["http_status"]) == ("permanent", 400)
    assert stored["last_error"].startswith("HTTP 400")
    assert totals == {"route:crm:permanent": 1, "route:crm:failed": 0}
    assert problems == [{"destination": "crm", "failing": 0, "permanent": 1}]
    assert report["routes"]["routes"]["crm"]["permanent"] == 1
    assert report["routes"]["problems"] == problems
    assert [(d["destination"], d["status"], d["http_status"]) for d in row["deliveries"]] == [
        ("crm", "permanent", 400)
    ]


def event_of(item: dict[str, Any]) -> Event:
    envelope = parse_envelope(item["webhook_body"])
    return Event(
        envelope.dedup_key, envelope.event, envelope.instance, envelope.data, envelope.body,
        Channel.WEBHOOK, datetime.now(UTC), envelope.date_time,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("match", "expected"),
    [
        ({"from_me": True}, {"messages_update_delivery_ack", "messages_update_read",
                             "messages_upsert_text_fromMe_sent_from_phone", "send_message_text_via_api"}),
        ({"from_me": False}, {"messages_delete_revoke", "messages_upsert_group_text",
                              "messages_upsert_image_incoming_with_base64", "messages_upsert_text_incoming",
                              "messages_upsert_text_incoming_REEMITTED"}),
        ({"chat": "group"}, {"messages_upsert_group_text"}),
        ({"events": "messages.up*"}, {"messages_update_delivery_ack", "messages_update_read",
                                      "messages_upsert_group_text", "messages_upsert_image_incoming_with_base64",
                                      "messages_upsert_text_fromMe_sent_from_phone", "messages_upsert_text_incoming",
                                      "messages_upsert_text_incoming_REEMITTED"}),
        ({"events": ["CONNECTION_UPDATE", "call"]}, {"connection_update_connecting", "connection_update_open",
                                                     "connection_update_close_logged_out", "call_offer"}),
        ({"instances": "acme-*", "events": "groups.*"}, {"groups_upsert"}),
        ({"instances": "other-*"}, set()),
        ({"data": {"key.remoteJid": "5511999990001@s.whatsapp.net"}},
         {"messages_upsert_text_fromMe_sent_from_phone", "messages_upsert_text_incoming",
          "messages_upsert_text_incoming_REEMITTED", "send_message_text_via_api"}),
        ({"data": {"message.conversation": {"regex": "(?i)s[aá]bado"}}},
         {"messages_upsert_text_incoming", "messages_upsert_text_incoming_REEMITTED"}),
        ({"data": {"state": ["open", "close"]}}, {"connection_update_open", "connection_update_close_logged_out"}),
        ({"data": {"participants.0": {"exists": True}}, "events": "group-*"}, {"group_participants_update_add"}),
        ({"message_type": "imageMessage"}, {"messages_upsert_image_incoming_with_base64"}),
        ({"sender": "5511999990003@*"}, {"messages_upsert_group_text"}),
    ],
)  # fmt: skip
def test_filters_select_exactly_the_fixtures_they_should(match: dict[str, Any], expected: set[str]) -> None:
    route = Route.model_validate({"name": "probe", "match": match, "drop": True})
    assert {item["name"] for item in fixtures() if route.matches(event_of(item))} == expected


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"routes": [{"name": "crm", "forward": {"method": "POST"}}]}, "route 'crm' (#1), field forward.0.url: Field required"),
        ({"routes": [{"name": "crm", "forward": {"url": "ftp://x"}}]}, "route 'crm' (#1), field forward.0.url: must be an http"),
        ({"routes": [{"name": "ok", "drop": True}, {"name": "bad", "match": {"evnets": "call"}, "drop": True}]},
         "route 'bad' (#2), field match.evnets: Extra inputs are not permitted"),
        ({"routes": [{"name": "rx", "match": {"data": {"a": {"regex": "("}}}, "drop": True}]},
         "route 'rx' (#1), field match.data.a.regex: not a regular expression"),
        ({"routes": [{"name": "idle"}]}, "route 'idle' (#1), field (the route itself): give at least one action"),
        ({"routes": [{"name": "a", "drop": True}, {"name": "a", "drop": True}]}, "route name 'a' is used twice"),
        ({"routes": [{"name": "env", "forward": {"url": "${NO_SUCH_VARIABLE_FOR_TESTS}"}}]},
         "route 'env' (#1), field forward.url: environment variable NO_SUCH_VARIABLE_FOR_TESTS is not set"),
        ({"routes": [{"name": "al", "alert": {"message": "x", "sinks": ["webhook"]}}]}, "alert.sinks has 'webhook' but no webhook_url"),
        ({"routes": []}, "field routes: List should have at least 1 item"),
    ],
)  # fmt: skip
def test_an_invalid_routes_file_names_the_route_and_the_field(
    document: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_routes(write_routes(tmp_path, document))
    assert "EVOLUTION_INGEST_ROUTES_FILE" in str(raised.value)
    assert message in str(raised.value)


def test_an_invalid_routes_file_stops_start_up(settings: Any, tmp_path: Path) -> None:
    path = write_routes(tmp_path, {"routes": [{"name": "crm", "forward": {"url": 42}}]})
    result = run_cli(env_for(settings, ROUTES_FILE=str(path)), "serve")
    assert result.returncode == 1
    assert "route 'crm' (#1), field forward.0.url: must be an http" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_example_routes_file_is_valid() -> None:
    routes = load_routes(Path(__file__).parent.parent / "examples" / "routes.yaml")
    assert [r.name for r in routes.routes][:3] == [
        "drop-presence",
        "messages-to-app",
        "inbound-direct-text-to-bot",
    ]


async def test_ten_closes_in_a_minute_send_one_alert(
    open_runtime: OpenRuntime, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    chat = Destination()
    close = fixture("connection_update_close_logged_out")["webhook_body"]
    async with destinations(chat) as (url_chat,):
        document = {
            "alert_webhook_url": url_chat,
            "routes": [{"name": "disconnected", "match": {"events": "connection.update", "data": {"state": "close"}},
                        "alert": {"message": "{instance} disconnected ({data.statusReason})",
                                  "sinks": ["log", "webhook"], "cooldown_seconds": 60}}],
        }  # fmt: skip
        async with routed(open_runtime, tmp_path, document) as (runtime, url):
            for second in range(10):
                status, answer = await post(
                    http, url, {**close, "date_time": f"2025-11-04T11:40:{second:02d}.000Z"}
                )
                assert (status, answer["status"]) == (200, "processed")
            await runtime.counters.flush()
            totals = await runtime.counters.read(["alert:disconnected:sent", "alert:disconnected:suppressed"])
    assert [r.body for r in chat.received] == [
        {"text": "acme-sales disconnected (401)", "content": "acme-sales disconnected (401)"}
    ]
    assert totals == {"alert:disconnected:sent": 1, "alert:disconnected:suppressed": 9}


async def test_a_qr_code_alerts_only_for_an_instance_that_was_connected(
    open_runtime: OpenRuntime, tmp_path: Path, http: aiohttp.ClientSession, uid: str
) -> None:
    document = {"routes": [{"name": "pair-again", "match": {"events": "qrcode.updated", "was_connected": True},
                            "alert": {"message": "{instance} needs pairing", "cooldown_seconds": 0}}]}  # fmt: skip
    qr = fixture("qrcode_updated")["webhook_body"]
    async with routed(open_runtime, tmp_path, document) as (runtime, url):
        await post(http, url, {**qr, "instance": f"new-{uid}"})  # never connected: no alert
        await post(http, url, fixture("connection_update_open")["webhook_body"])
        await post(http, url, qr)  # acme-sales was connected
        await runtime.counters.flush()
        totals = await runtime.counters.read(["alert:pair-again:sent"])
    assert totals == {"alert:pair-again:sent": 1}
