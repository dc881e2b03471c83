"""Evolution 2.4: ``extra`` fields spread at the top of both bodies, the event
``messaging-history.set``, and ``X-Instance-ID``/``-Name``, ``X-Event-Type``, ``X-Timestamp``
headers on instance webhooks. Fixtures: ``tests/fixtures/evolution_2_4_events.json``.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from structlog.testing import capture_logs

from evolution_ingest.core.identity import EMITTED_EVENTS, parse_envelope
from evolution_ingest.stores.evolution import INSTANCE_EVENTS, setting_name
from tests.conftest import RABBITMQ_URL, OpenRuntime, running_service
from tests.support import Recorder, fixture, fixtures_2_4, stored_form, wait_until
from tests.support.evolution import EvolutionPublisher, broker

NAMES = [item["name"] for item in fixtures_2_4()]


def _item(name: str) -> dict[str, Any]:
    return next(item for item in fixtures_2_4() if item["name"] == name)


@pytest.mark.parametrize("name", NAMES)
def test_one_emission_has_one_identity_on_both_channels(name: str) -> None:
    item = _item(name)
    webhook, rabbitmq = parse_envelope(item["webhook_body"]), parse_envelope(item["rabbitmq_body"])
    assert webhook.dedup_key == rabbitmq.dedup_key
    assert webhook.event == item["event"]


def test_extra_fields_come_first_and_are_kept_but_do_not_change_the_identity() -> None:
    item = _item("messages_set_2_4_extra_first")
    assert list(item["webhook_body"])[:3] == ["isLatest", "progress", "event"]
    envelope = parse_envelope(item["webhook_body"])
    assert envelope.body["isLatest"] is False
    assert envelope.body["progress"] == 42
    without = {k: v for k, v in item["rabbitmq_body"].items() if k not in {"isLatest", "progress"}}
    assert parse_envelope(without).dedup_key == envelope.dedup_key


def test_a_message_emitted_by_2_3_and_again_by_2_4_is_one_event() -> None:
    old = fixture("messages_upsert_text_incoming")["webhook_body"]
    new = _item("messages_upsert_2_4_instance_webhook")["webhook_body"]
    assert old["data"] == new["data"]
    assert old["date_time"] != new["date_time"]
    assert parse_envelope(old).dedup_key == parse_envelope(new).dedup_key


def test_messaging_history_set_is_an_event_both_channels_and_connect_know() -> None:
    assert "messaging-history.set" in EMITTED_EVENTS
    assert setting_name("messaging-history.set") == "MESSAGING_HISTORY_SET"
    assert "MESSAGING_HISTORY_SET" in INSTANCE_EVENTS


async def test_2_4_bodies_and_headers_are_processed_once_with_the_instance_id_logged(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    items = fixtures_2_4()
    events = sorted({item["event"] for item in items})
    with capture_logs() as logs:
        async with (
            open_runtime(rabbitmq_events=events, log_outcomes=True) as runtime,
            running_service(runtime) as service,
        ):
            settings = runtime.settings
            async with broker(RABBITMQ_URL) as (_, channel):
                publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
                for item in items:
                    async with http.post(
                        service.url, data=orjson.dumps(item["webhook_body"]), headers=item["webhook_headers"]
                    ) as answer:
                        assert answer.status == 200, await answer.text()
                    await publisher.publish_global(item["rabbitmq_body"], item["routing_key"])
            await wait_until(
                lambda: _all(recorder, len(items)), within=20, message="every 2.4 event processed"
            )
            counted = await runtime.counters.read(
                ["webhook:via:instance", "webhook:via:global", "rabbitmq:processed"]
            )
            await wait_until(
                lambda: _settled(runtime, len(items)), within=20, message="every RabbitMQ copy settled"
            )
    assert recorder.doubled() == []
    assert sorted(e.event for e in recorder.events) == sorted(item["event"] for item in items)
    history = next(e for e in recorder.events if e.event == "messaging-history.set")
    assert history.data == {"messageCount": 1834, "chatCount": 57, "contactCount": 212, "progress": 100}
    chunk = next(e for e in recorder.events if e.event == "messages.set")
    assert chunk.payload == stored_form(_item("messages_set_2_4_extra_first")["webhook_body"])
    assert counted["webhook:via:instance"] == len(items)
    assert counted["webhook:via:global"] == 0
    webhook_outcomes = [e for e in logs if e.get("event") == "outcome" and e.get("channel") == "webhook"]
    assert len(webhook_outcomes) == len(items)
    assert {e.get("instance_id") for e in webhook_outcomes} == {"c0ffee00-1a2b-4c3d-9e8f-0123456789ab"}


async def _all(recorder: Recorder, count: int) -> bool:
    return recorder.total == count


async def _settled(runtime: Any, count: int) -> bool:
    names = ["rabbitmq:processed", "rabbitmq:skipped_duplicate", "rabbitmq:skipped_locked"]
    values = await runtime.counters.read(names)
    return sum(values.values()) >= count
