"""Backfill: messages both channels missed come from Evolution's stored ones, once each.

Against a fake of Evolution's REST API that stores what it emits (``DATABASE_SAVE_DATA_NEW_MESSAGE``)
and serves it at ``POST /chat/findMessages`` as Evolution does (newest first, pages, whole-second
bounds), a real webhook app and worker, and the ``backfill`` command.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest

from evolution_ingest.core import stored
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import SINGLE_MESSAGE_EVENTS, dedup_key, parse_envelope
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores.evolution import env_name
from tests.conftest import RABBITMQ_URL, OpenRuntime, Service, running_service
from tests.support import Recorder, fixtures, running_server, wait_until
from tests.support.evolution import EvolutionPublisher, broker
from tests.support.fake_evolution import FakeEnvironment, FakeEvolution, FakeInstance
from tests.test_admin import cli
from tests.test_cli import env_for
from tests.test_connect import API_KEY, a_message


@dataclass
class World:
    runtime: Runtime
    service: Service
    fake: FakeEvolution
    evolution_url: str
    publisher: EvolutionPublisher
    http: aiohttp.ClientSession

    def env(self, **extra: str) -> dict[str, str]:
        return env_for(
            self.runtime.settings, EVOLUTION_URL=self.evolution_url, EVOLUTION_API_KEY=API_KEY,
            FORWARD_URL=self.service.url, BACKFILL_PAGE_SIZE="10", **extra,
        )  # fmt: skip

    async def emit(self, instance: str, number: int, **changes: Any) -> None:
        """A message Evolution stores and sends on both channels."""
        await self.fake.emit(
            self.http, self.publisher, instance, "messages.upsert", recent(number, **changes)
        )

    async def redeliver(self, instance: str, number: int, **changes: Any) -> None:
        """A late copy of an emission (a webhook retry, a RabbitMQ redelivery): not stored again."""
        self.fake.save_messages = False
        try:
            await self.emit(instance, number, **changes)
        finally:
            self.fake.save_messages = True

    def drop(self, instance: str, number: int) -> None:
        """A message Evolution stores and that neither channel delivers."""
        self.fake.store(instance, recent(number))


def recent(number: int, **changes: Any) -> dict[str, Any]:
    """Message ``number``, sent ten minutes ago (plus ``number`` seconds)."""
    data = a_message(number)
    data["messageTimestamp"] = int(time.time()) - 600 + number
    data.update(changes)
    return data


@asynccontextmanager
async def world(
    open_runtime: OpenRuntime,
    http: aiohttp.ClientSession,
    instances: tuple[str, ...] = ("acme-sales",),
    **overrides: Any,
) -> AsyncIterator[World]:
    async with open_runtime(**overrides) as runtime, running_service(runtime) as service:
        settings = runtime.settings
        hook = {"url": service.url, "enabled": True, "events": ["MESSAGES_UPSERT", "SEND_MESSAGE"]}
        env = FakeEnvironment(
            rabbitmq_global=True, rabbitmq_exchange=settings.rabbitmq_exchange, rabbitmq_prefix=settings.rabbitmq_prefix,
            rabbitmq_global_events={env_name(e) for e in settings.rabbitmq_events},
        )  # fmt: skip
        fake = FakeEvolution(API_KEY, [FakeInstance(name, webhook=dict(hook)) for name in instances], env)
        async with running_server(fake.app) as url, broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            yield World(runtime, service, fake, url, publisher, http)


async def backfill(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    result = await cli(env, "backfill", "--since", "1h", *args, "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, orjson.loads(result.stdout), result.stderr


def by_instance(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["instance"]: r for r in report["instances"]}


async def _total(recorder: Recorder, count: int) -> bool:
    return recorder.total >= count


async def test_messages_both_channels_missed_are_backfilled_once_and_late_copies_are_duplicates(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    async with world(open_runtime, http) as w:
        for n in range(30):
            if 10 <= n < 20:
                w.drop("acme-sales", n)
            else:
                await w.emit("acme-sales", n)
        await wait_until(lambda: _total(recorder, 20), within=20, message="20 messages by the channels")
        code, first, _ = await backfill(w.env())
        # Evolution's retries and a late RabbitMQ copy after the backfill: another status, media
        # transport, a new date_time — the same messages.
        for n in range(10, 15):
            await w.redeliver("acme-sales", n, status="READ")
        await wait_until(lambda: _late_copies_seen(db, 5), within=20, message="the late copies recorded")
        again_code, again, _ = await backfill(w.env())
        for n in range(30, 35):
            w.drop("acme-sales", n)
        dry_code, dry, _ = await backfill(w.env(), "--dry-run")
        rows_after_dry = await db.fetchval("SELECT count(*) FROM evolution_ingestion_events")
        last_code, last, _ = await backfill(w.env())
        await wait_until(lambda: _total(recorder, 35), within=20, message="35 messages")
    assert code == again_code == dry_code == last_code == 0
    assert {k: by_instance(first)["acme-sales"][k] for k in ("records", "already", "ingested", "failed", "error")} == {
        "records": 30, "already": 20, "ingested": 10, "failed": 0, "error": None,
    }  # fmt: skip
    assert {k: by_instance(again)["acme-sales"][k] for k in ("records", "already", "ingested")} == {
        "records": 30, "already": 30, "ingested": 0,
    }  # fmt: skip
    assert dry["dry_run"] is True
    assert {k: by_instance(dry)["acme-sales"][k] for k in ("records", "already", "ingested")} == {
        "records": 35, "already": 30, "ingested": 5,
    }  # fmt: skip
    assert rows_after_dry == 30  # the dry run counted, it ingested nothing
    assert by_instance(last)["acme-sales"]["ingested"] == 5
    assert recorder.total == 35
    assert recorder.doubled() == []
    backfilled = sorted(e.data["key"]["id"][-2:] for e in recorder.events if e.channel is Channel.BACKFILL)
    assert backfilled == [f"{n:02d}" for n in (*range(10, 20), *range(30, 35))]
    assert (
        await db.fetchval("SELECT count(*) FROM evolution_ingestion_events WHERE channel = 'BACKFILL'") == 15
    )


async def _late_copies_seen(db: asyncpg.Connection, count: int) -> bool:
    found = await db.fetchval(
        "SELECT count(*) FROM evolution_ingestion_events WHERE channel = 'BACKFILL' "
        "AND webhook_seen_at IS NOT NULL AND rabbitmq_seen_at IS NOT NULL"
    )
    return int(found) >= count


async def test_evolutions_errors_are_reported_per_instance_and_a_stopped_run_resumes(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    names = ("acme-refused", "acme-broken", "acme-slow", "acme-resumed")
    async with world(open_runtime, http, names) as w:
        for name in names:
            for n in range(25):
                w.drop(name, n)
        w.fake.fail_finds = {
            "acme-refused": [(401, "Unauthorized", "Unauthorized")],
            "acme-broken": [(500, "Internal Server Error", "prisma: connection pool timeout")],
            "acme-resumed": [None, (502, "Bad Gateway", "upstream went away")],  # page 2 fails
        }
        code, report, stderr = await backfill(w.env(), "--instance", "acme-refused", "--instance", "acme-broken",
                                              "--instance", "acme-resumed")  # fmt: skip
        w.fake.find_delay = 2.0  # a page slower than the timeout
        slow_code, slow_report, _ = await backfill(
            w.env(EVOLUTION_TIMEOUT_SECONDS="0.5"), "--instance", "acme-slow"
        )
        w.fake.find_delay = 0.0
        resumed = await db.fetch(
            "SELECT finished_at, done_down_to, ingested FROM evolution_ingest_backfill_runs "
            "WHERE instance = 'acme-resumed' ORDER BY id"
        )
        again_code, again, _ = await backfill(
            w.env(), "--instance", "acme-resumed", "--instance", "acme-refused"
        )
        await wait_until(lambda: _total(recorder, 50), within=20, message="50 messages")
        human = await cli(
            w.env(),
            "backfill",
            "--since",
            "1h",
            "--dry-run",
            "--instance",
            "acme-broken",
            "--instance",
            "nope",
        )
    assert code == 1
    found = by_instance(report)
    assert (
        found["acme-refused"]["error"] == "HTTP 401: Unauthorized (check EVOLUTION_INGEST_EVOLUTION_API_KEY)"
    )
    assert found["acme-broken"]["error"] == "HTTP 500: prisma: connection pool timeout"
    assert found["acme-resumed"]["error"] == "HTTP 502: upstream went away"
    assert found["acme-resumed"]["ingested"] == 10  # the first page went through
    assert slow_code == 1
    assert by_instance(slow_report)["acme-slow"]["error"].startswith("no answer from http://127.0.0.1:")
    assert [r["finished_at"] is None for r in resumed] == [True]
    assert resumed[0]["done_down_to"] is not None
    assert again_code == 0
    assert by_instance(again)["acme-resumed"]["ingested"] == 15
    assert by_instance(again)["acme-refused"]["ingested"] == 25
    assert recorder.total == 50
    assert recorder.doubled() == []
    assert (
        await db.fetchval(
            "SELECT count(*) FROM evolution_ingest_backfill_runs WHERE instance = 'acme-resumed' AND finished_at IS NULL"
        )
        == 0
    )
    assert human.returncode == 1
    assert "Evolution has no instance 'nope'" in human.stdout
    assert "acme-broken" in human.stdout
    assert "Traceback" not in human.stderr
    assert API_KEY not in human.stdout + human.stderr + stderr


@pytest.mark.parametrize(
    "name",
    [i["name"] for i in fixtures() if i["event"] in SINGLE_MESSAGE_EVENTS and "REEMITTED" not in i["name"]],
)
def test_a_stored_message_has_the_key_of_its_channel_copy(name: str) -> None:
    item = next(i for i in fixtures() if i["name"] == name)
    body = item["webhook_body"]
    fake = FakeEvolution(API_KEY, [FakeInstance(body["instance"])])
    record = orjson.loads(orjson.dumps(fake.store(body["instance"], copy.deepcopy(body["data"]))))  # as JSON
    built = stored.event_body(record, instance=body["instance"], sender=body.get("sender"), server_url=None)
    envelope = parse_envelope(built)
    if body["event"] == "send.message":  # sent through the API: its channel copy is send.message
        assert (
            dedup_key("send.message", body["instance"], built["data"], built["date_time"])
            == parse_envelope(body).dedup_key
        )
    else:
        assert envelope.dedup_key == parse_envelope(body).dedup_key
        assert envelope.dedup_key == parse_envelope(item["rabbitmq_body"]).dedup_key
    assert built["event"] == "messages.upsert"
    assert set(built["data"]) == {"key", "pushName", "status", "message", "contextInfo", "messageType",
                                  "messageTimestamp", "instanceId", "source"}  # fmt: skip


async def test_an_edited_message_and_one_saved_under_its_old_key_are_not_backfilled_again(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    async with world(open_runtime, http) as w:
        await w.emit("acme-sales", 1)
        await wait_until(lambda: _total(recorder, 1), within=20, message="message 1")
        # Evolution overwrites a stored message when it is edited (and adds an EDITED update).
        edited = w.fake.instances["acme-sales"].messages[0]
        edited["message"] = {"conversation": "editado: abrimos no sábado"}
        edited["MessageUpdate"].append({"status": "EDITED"})
        # A message received before the upgrade, saved under its key of version 1.
        old = recent(2)
        body = {
            "event": "messages.upsert",
            "instance": "acme-sales",
            "data": old,
            "date_time": "2026-11-30T10:00:00.000Z",
        }
        from evolution_ingest.core.identity import legacy_dedup_key  # noqa: PLC0415

        v1 = legacy_dedup_key("messages.upsert", "acme-sales", old, body["date_time"])
        await db.execute(
            "INSERT INTO evolution_ingest_inbox (dedup_key, event, instance, channel, payload, processed_at) "
            "VALUES ($1, 'messages.upsert', 'acme-sales', 'WEBHOOK', $2::jsonb, now())",
            v1, orjson.dumps(body).decode(),
        )  # fmt: skip
        await db.execute("INSERT INTO evolution_ingest_meta (name, at) VALUES ('message_key_v2', now())")
        w.fake.store("acme-sales", old)
        code, report, _ = await backfill(w.env())
    assert code == 0
    assert {k: by_instance(report)["acme-sales"][k] for k in ("records", "already", "ingested")} == {
        "records": 2, "already": 2, "ingested": 0,
    }  # fmt: skip
    assert recorder.total == 1
