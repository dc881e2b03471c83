"""``check`` on Evolution's side: each set-up that looked right and still lost or repeated events.

Unconsumed Evolution queues (a prefix or mode mismatch), missing bindings, instance settings
that differ from what ``connect`` sets, double webhooks, and an auth method Evolution's settings
cannot pass — each reported with its fix, against the real broker and a fake Evolution.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from evolution_ingest.config import Settings
from evolution_ingest.stores.evolution import env_name
from evolution_ingest.stores.queues import Topology
from tests.conftest import RABBITMQ_URL, OpenRuntime, running_service
from tests.support import Recorder, fixture, wait_until
from tests.support.evolution import EvolutionPublisher, broker, delete, remove
from tests.support.fake_evolution import FakeEnvironment, FakeInstance
from tests.test_admin import cli
from tests.test_cli import env_for
from tests.test_connect import TOKEN, a_message, connect_env, evolution

MESSAGE = fixture("messages_upsert_text_incoming")["webhook_body"]["data"]


async def check(env: dict[str, str]) -> tuple[int, dict[str, list[dict[str, str]]]]:
    """Exit code, and the results by check name."""
    result = await cli(env, "check", "--json")
    by_name: dict[str, list[dict[str, str]]] = {}
    for item in orjson.loads(result.stdout):
        by_name.setdefault(item["check"], []).append(item)
    return result.returncode, by_name


def only(results: dict[str, list[dict[str, str]]], name: str) -> dict[str, str]:
    (found,) = results[name]
    return found


async def test_evolution_queues_under_another_prefix_are_unconsumed_and_check_says_how_to_fix_it(
    open_runtime: OpenRuntime,
) -> None:
    # Evolution without RABBITMQ_PREFIX_KEY names its queue after the event alone; the worker
    # consumes the prefixed one, so everything still arrives while Evolution's queue grows.
    event = "labels.association"
    async with open_runtime(rabbitmq_events=[event]) as runtime, running_service(runtime):
        settings = runtime.settings
        try:
            async with broker(RABBITMQ_URL) as (_, channel):
                unprefixed = EvolutionPublisher(channel, settings.rabbitmq_exchange, "")
                for n in range(3):
                    await unprefixed.publish_global(
                        {"event": event, "instance": "acme", "data": {"n": n}}, event
                    )
            code, results = await check(env_for(settings))
        finally:
            await delete(RABBITMQ_URL, [event])
    stray = only(results, "unconsumed evolution queues")
    assert code == 1
    assert stray["state"] == "fail"
    assert "3 message(s) waiting" in stray["detail"]
    assert event in stray["detail"]
    assert f"set RABBITMQ_PREFIX_KEY={settings.rabbitmq_prefix} on Evolution's side" in stray["detail"]
    assert only(results, "evolution queues")["state"] == "ok"  # the worker consumes its own


async def test_missing_bindings_fail_until_the_topology_is_declared(settings: Settings) -> None:
    env = env_for(settings)
    code, before = await check(env)
    declared = await cli(env, "topology")
    try:
        _, after = await check(env)
    finally:
        await remove(RABBITMQ_URL, Topology(settings))
    bindings = only(before, "bindings")
    assert code == 1
    assert bindings["state"] == "fail"
    assert f"{len(settings.rabbitmq_events)} missing" in bindings["detail"]
    assert "`evolution-ingest topology` (and run it before Evolution starts)" in bindings["detail"]
    assert declared.returncode == 0
    assert only(after, "bindings") == {
        "check": "bindings", "state": "ok",
        "detail": f"{len(settings.rabbitmq_events)} expected: exchanges and queues declared",
    }  # fmt: skip


async def test_instance_settings_that_differ_from_connect_and_instance_queues_nobody_consumes(
    settings: Settings,
) -> None:
    instance = f"i{settings.rabbitmq_exchange.removeprefix('evo-')}"
    stale = {"url": "https://old.example.test/hook", "enabled": True, "events": ["MESSAGES_UPSERT"]}
    own_rabbitmq = {"enabled": True, "events": ["MESSAGES_UPSERT"]}
    async with evolution([FakeInstance(instance, webhook=stale, rabbitmq=own_rabbitmq)]) as (_, url):
        env = connect_env(settings, url)
        try:
            async with broker(RABBITMQ_URL) as (_, channel):  # Evolution publishes to the instance's exchange
                publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
                await publisher.publish_instance({"event": "messages.upsert", "instance": instance, "data": {}},
                                                 "messages.upsert", instance)  # fmt: skip
            code, before = await check(env)
            connected = await cli(env, "connect")
            _, after = await check(env)
        finally:
            await delete(RABBITMQ_URL, [f"{instance}.messages.upsert"], [instance])
    differs = only(before, "evolution instances")
    assert differs["state"] == "warn"
    assert f"{instance} (webhook: url, headers, events" in differs["detail"]
    assert f"{instance} (rabbitmq: enabled" in differs["detail"]
    assert "fix: `evolution-ingest connect`" in differs["detail"]
    stray = only(before, "unconsumed evolution queues")
    assert code == 1
    assert stray["state"] == "fail"
    assert f"{instance}.messages.upsert" in stray["detail"]
    assert "`evolution-ingest connect` turns them off" in stray["detail"]
    assert connected.returncode == 0, connected.stdout + connected.stderr
    assert only(after, "evolution instances")["state"] == "ok"
    assert only(after, "evolution api")["state"] == "ok"


def _both_webhooks(settings: Settings, webhook: str) -> FakeEnvironment:
    events = {env_name(e) for e in settings.rabbitmq_events}
    return FakeEnvironment(
        webhook_global_url=webhook, webhook_global_events=events, rabbitmq_global=True,
        rabbitmq_exchange=settings.rabbitmq_exchange, rabbitmq_prefix=settings.rabbitmq_prefix,
        rabbitmq_global_events=events,
    )  # fmt: skip


async def test_an_instance_webhook_beside_the_global_one_is_a_double_webhook(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    async with (
        open_runtime(webhook_auth=["url_token"], webhook_token=TOKEN) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        base = service.url.removesuffix("/api/internal/webhook")
        env_evolution = _both_webhooks(settings, f"{service.url}/t/{TOKEN}")
        async with (
            evolution([FakeInstance("acme-twice")], env_evolution) as (fake, url),
            broker(RABBITMQ_URL) as (_, ch),
        ):
            env = connect_env(settings, url, base)
            assert (await cli(env, "connect")).returncode == 0  # sets the instance webhook too
            publisher = EvolutionPublisher(ch, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            statuses = await fake.emit(http, publisher, "acme-twice", "messages.upsert", MESSAGE)
            assert statuses == [200, 200]  # three copies: two webhooks and RabbitMQ
            await wait_until(lambda: _counted(runtime, "webhook:via:global"), within=10, message="counted")
            code, results = await check(env)
            # The fix check suggests: the global webhook alone; connect turns the instance one off.
            assert (await cli(env, "connect", "--webhook", "global")).returncode == 0
            assert fake.instances["acme-twice"].webhook is not None
            assert fake.instances["acme-twice"].webhook["enabled"] is False
    double = only(results, "double webhooks")
    assert double["state"] == "warn"
    assert "(acme-twice)" in double["detail"]
    assert "every event arrives twice by webhook" in double["detail"]
    assert "`evolution-ingest connect --webhook global`" in double["detail"]
    assert code == 0  # a warning: nothing is lost
    assert recorder.total == 1


async def _counted(runtime: Any, name: str) -> bool:
    return bool((await runtime.counters.read([name]))[name] > 0)


async def test_apikey_auth_cannot_pass_while_evolution_does_not_expose_it(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    instance = FakeInstance("acme-key")
    async with (
        open_runtime(webhook_auth=["apikey"], webhook_apikeys=[instance.token]) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        async with evolution([instance]) as (fake, url):
            instance.webhook = {"url": service.url, "enabled": True, "events": ["MESSAGES_UPSERT"]}
            env = env_for(settings, EVOLUTION_URL=url, EVOLUTION_API_KEY="fake-unused")
            _, quiet = await check(env)
            refused = await fake.emit(http, None, "acme-key", "messages.upsert", MESSAGE)
            code, results = await check(env)
            fake.env.expose_apikey = True
            accepted = await fake.emit(http, None, "acme-key", "messages.upsert", a_message(2))
    assert only(quiet, "webhook auth vs evolution")["state"] == "warn"
    assert (
        "passes only with AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true"
        in only(quiet, "webhook auth vs evolution")["detail"]
    )
    assert refused == [401]
    auth = only(results, "webhook auth vs evolution")
    assert code == 1
    assert auth["state"] == "fail"
    assert "Evolution sends apikey null" in auth["detail"]
    assert "AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true on Evolution's side" in auth["detail"]
    assert accepted == [200]
    assert recorder.total == 1


async def test_header_auth_cannot_pass_for_the_global_webhook(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    async with (
        open_runtime(webhook_auth=["header"], webhook_token=TOKEN) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        env_evolution = FakeEnvironment(
            webhook_global_url=service.url, webhook_global_events={"MESSAGES_UPSERT"}
        )
        async with evolution([FakeInstance("acme-global")], env_evolution) as (fake, _):
            statuses = await fake.emit(http, None, "acme-global", "messages.upsert", MESSAGE)
            code, results = await check(env_for(settings))
    assert statuses == [401]
    auth = only(results, "webhook auth vs evolution")
    assert code == 1
    assert auth["state"] == "fail"
    assert "missing header (the global webhook sends none)" in auth["detail"]
    assert "add url_token to EVOLUTION_INGEST_WEBHOOK_AUTH" in auth["detail"]
