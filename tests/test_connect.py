"""``evolution-ingest connect`` against a fake of Evolution's REST API built from its source.

The fake answers as Evolution 2.3/2.4 does (routes, bodies, ``{"status", "error", "response"}``
errors) and emits events the way Evolution does to the webhooks and RabbitMQ it is set to.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from evolution_ingest.config import Settings
from evolution_ingest.stores.evolution import (
    SOURCE_HEADER,
    EvolutionApi,
    EvolutionError,
    EvolutionNotFound,
    EvolutionRefused,
    env_name,
)
from tests.conftest import RABBITMQ_URL, OpenRuntime, running_service
from tests.support import Recorder, dead_port, fixture, running_server, wait_until
from tests.support.evolution import EvolutionPublisher, broker
from tests.support.fake_evolution import FakeEnvironment, FakeEvolution, FakeInstance
from tests.test_admin import cli, cli_json
from tests.test_cli import env_for

API_KEY = "fake-evolution-global-key-" + secrets.token_hex(8)
TOKEN = "fake-url-token-" + secrets.token_hex(8)
HERE = "http://127.0.0.1:8080"
WEBHOOK = f"{HERE}/api/internal/webhook"


@asynccontextmanager
async def evolution(
    instances: list[FakeInstance], env: FakeEnvironment | None = None, **options: Any
) -> AsyncIterator[tuple[FakeEvolution, str]]:
    fake = FakeEvolution(API_KEY, instances, env, **options)
    async with running_server(fake.app) as url:
        yield fake, url


def connect_env(
    settings: Settings, evolution_url: str, public_url: str = HERE, **extra: str
) -> dict[str, str]:
    values = {
        "EVOLUTION_URL": evolution_url, "EVOLUTION_API_KEY": API_KEY, "WEBHOOK_PUBLIC_URL": public_url,
        "WEBHOOK_AUTH": "url_token", "WEBHOOK_TOKEN": TOKEN, "CONNECT_WAIT_SECONDS": "0",
    }  # fmt: skip
    return env_for(settings, **(values | extra))


def _sets(fake: FakeEvolution) -> list[str]:
    return [path for method, path in fake.calls if method == "POST" and "/set/" in path]


def _by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in report["instances"]}


def _events(settings: Settings) -> list[str]:
    return sorted({env_name(e) for e in settings.rabbitmq_events})


async def test_dry_run_shows_per_instance_what_would_change_and_changes_nothing(settings: Settings) -> None:
    old = {"url": "https://old.example.test/hook", "enabled": True, "events": ["MESSAGES_UPSERT"],
           "webhookByEvents": True, "webhookBase64": False, "headers": {"authorization": "Bearer fake-old"}}  # fmt: skip
    async with evolution([FakeInstance("acme-sales", webhook=old), FakeInstance("acme-support")]) as (
        fake,
        url,
    ):
        env = connect_env(settings, url)
        report = await cli_json(env, "connect", "--dry-run")
        human = await cli(env, "connect", "--dry-run")
    assert _sets(fake) == []
    assert fake.instances["acme-sales"].webhook == old
    sales, support = (_by_name(report)[name] for name in ("acme-sales", "acme-support"))
    assert sales["webhook"]["action"] == support["webhook"]["action"] == "would set"
    changes = {c["field"]: c for c in sales["webhook"]["changes"]}
    assert set(changes) == {"url", "headers", "byEvents", "events"}
    assert changes["url"] == {
        "field": "url", "current": "https://old.example.test/hook", "desired": f"{WEBHOOK}/t/[redacted]"
    }  # fmt: skip
    assert changes["headers"]["current"] == {"authorization": "[redacted]"}
    assert changes["events"]["desired"] == _events(settings)
    assert {c["field"] for c in support["webhook"]["changes"]} == {"enabled", "url", "headers", "events"}
    # global RabbitMQ mode: the instances' own RabbitMQ events stay off (their queues would fill)
    assert sales["rabbitmq"] == {"action": "unchanged", "changes": []}
    assert human.returncode == 0, human.stderr
    assert "dry run: nothing changed" in human.stdout
    assert "acme-sales" in human.stdout
    assert "would set: url: https://old.example.test/hook ->" in human.stdout
    for output in (orjson.dumps(report).decode(), human.stdout, human.stderr):
        assert TOKEN not in output
        assert API_KEY not in output
        assert "fake-old" not in output


async def test_connect_sets_each_instance_as_this_service_needs_and_a_second_run_changes_nothing(
    settings: Settings,
) -> None:
    instances = [FakeInstance("acme-sales"), FakeInstance("acme-support"), FakeInstance("acme-later")]
    async with evolution(instances) as (fake, url):
        env = connect_env(
            settings, url, RABBITMQ_MODE="instance", RABBITMQ_INSTANCES="acme-sales,acme-support"
        )
        first = await cli_json(env, "connect")
        sets_after_first = len(_sets(fake))
        second = await cli_json(env, "connect")
        human = await cli(env, "connect")
    events = _events(settings)
    for name in ("acme-sales", "acme-support", "acme-later"):
        webhook = fake.instances[name].webhook
        assert webhook is not None
        assert {k: webhook[k] for k in ("url", "enabled", "headers", "webhookByEvents", "webhookBase64")} == {
            "url": f"{WEBHOOK}/t/{TOKEN}", "enabled": True, "headers": {SOURCE_HEADER: "instance"},
            "webhookByEvents": False, "webhookBase64": False,
        }  # fmt: skip
        assert sorted(webhook["events"]) == events
        assert _by_name(first)[name]["webhook"]["action"] == "set"
    for name in ("acme-sales", "acme-support"):
        rabbitmq = fake.instances[name].rabbitmq
        assert rabbitmq is not None
        assert rabbitmq["enabled"] is True
        assert sorted(rabbitmq["events"]) == events
        assert _by_name(first)[name]["rabbitmq"]["action"] == "set"
    later = _by_name(first)["acme-later"]["rabbitmq"]["action"]
    assert later.startswith("left alone (add it to EVOLUTION_INGEST_RABBITMQ_INSTANCES")
    assert fake.instances["acme-later"].rabbitmq is None
    assert sets_after_first == 5
    assert len(_sets(fake)) == sets_after_first  # the second and third runs set nothing
    for item in second["instances"]:
        assert item["webhook"]["action"] == "unchanged"
        assert item["rabbitmq"]["action"] in {"unchanged", later}
    assert human.returncode == 0
    assert "RABBITMQ_GLOBAL_ENABLED=false" in human.stdout


async def test_global_mode_prints_evolution_environment_lines_without_a_secret(settings: Settings) -> None:
    here = {"url": f"{WEBHOOK}/t/{TOKEN}", "enabled": True, "events": ["MESSAGES_UPSERT"]}
    elsewhere = {"url": "https://crm.example.test/hook", "enabled": True, "events": ["MESSAGES_UPSERT"]}
    instances = [FakeInstance("acme-here", webhook=here), FakeInstance("acme-elsewhere", webhook=elsewhere)]
    async with evolution(instances) as (fake, url):
        env = connect_env(settings, url, WEBHOOK_AUTH="url_token,apikey", WEBHOOK_APIKEYS="fake-apikey")
        report = await cli_json(env, "connect", "--webhook", "global", "--dry-run")
        human = await cli(env, "connect", "--webhook", "global", "--dry-run")
    lines = report["evolution_environment"]
    assert "WEBHOOK_GLOBAL_ENABLED=true" in lines
    assert f"WEBHOOK_GLOBAL_URL={WEBHOOK}/t/<EVOLUTION_INGEST_WEBHOOK_TOKEN>" in lines
    assert "WEBHOOK_GLOBAL_WEBHOOK_BY_EVENTS=false" in lines
    assert "RABBITMQ_URI=amqp://guest:<password>@127.0.0.1:5672" in lines
    assert f"RABBITMQ_EXCHANGE_NAME={settings.rabbitmq_exchange}" in lines
    assert f"RABBITMQ_PREFIX_KEY={settings.rabbitmq_prefix}" in lines
    assert "RABBITMQ_GLOBAL_ENABLED=true" in lines
    assert "AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true" in lines
    for event in settings.rabbitmq_events:
        assert f"WEBHOOK_EVENTS_{env_name(event)}=true" in lines
        assert f"RABBITMQ_EVENTS_{env_name(event)}=true" in lines
    # An instance webhook pointing here would double every event: it is turned off; others stay.
    changes = _by_name(report)["acme-here"]["webhook"]["changes"]
    assert {c["field"]: c["desired"] for c in changes} == {"enabled": False, "events": []}
    assert _by_name(report)["acme-elsewhere"]["webhook"]["action"].startswith("left alone")
    assert _sets(fake) == []
    assert "Evolution's environment" in human.stdout
    assert "WEBHOOK_GLOBAL_URL=" in human.stdout
    for output in (orjson.dumps(report).decode(), human.stdout):
        assert TOKEN not in output
        assert "guest:guest" not in output


async def test_refusals_of_evolution_are_clear_errors(settings: Settings) -> None:
    async with evolution([FakeInstance("acme-sales")]) as (fake, url):
        wrong = await cli(
            {**connect_env(settings, url), "EVOLUTION_INGEST_EVOLUTION_API_KEY": "fake-wrong-key"}, "connect"
        )
        fake.fail_next_set = (400, "Bad Request", [["webhook.url is not a valid URL"]])
        refused = await cli_json_status(connect_env(settings, url), "connect")
        unknown = await cli(
            connect_env(settings, url), "connect", "--instance", "nope", "--instance", "acme-sales"
        )
    assert wrong.returncode == 1
    assert "HTTP 401: Unauthorized (check EVOLUTION_INGEST_EVOLUTION_API_KEY)" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    assert "fake-wrong-key" not in wrong.stderr + wrong.stdout
    assert unknown.returncode == 1
    assert "Evolution has no instance 'nope'" in unknown.stdout
    assert "acme-sales" in unknown.stdout  # the instance that exists is still connected
    assert fake.instances["acme-sales"].webhook is not None
    code, report = refused
    assert code == 1
    assert (
        _by_name(report)["acme-sales"]["webhook"]["action"]
        == "failed: HTTP 400: webhook.url is not a valid URL"
    )


async def cli_json_status(env: dict[str, str], *args: str) -> tuple[int, Any]:
    result = await cli(env, *args, "--json")
    return result.returncode, orjson.loads(result.stdout)


@pytest.mark.parametrize(
    ("unset", "named"),
    [
        ("EVOLUTION_URL", "EVOLUTION_INGEST_EVOLUTION_URL"),
        ("EVOLUTION_API_KEY", "EVOLUTION_INGEST_EVOLUTION_API_KEY"),
        ("WEBHOOK_PUBLIC_URL", "EVOLUTION_INGEST_WEBHOOK_PUBLIC_URL"),
    ],
)
async def test_a_missing_setting_is_named(settings: Settings, unset: str, named: str) -> None:
    env = {**connect_env(settings, "http://127.0.0.1:9"), "EVOLUTION_INGEST_HOST": "0.0.0.0"}  # noqa: S104 - a setting, not a bind
    del env[f"EVOLUTION_INGEST_{unset}"]
    result = await cli(env, "connect")
    assert result.returncode == 1
    assert named in result.stderr
    assert "Traceback" not in result.stderr


async def test_an_unreachable_evolution_is_a_clear_error(settings: Settings) -> None:
    result = await cli(connect_env(settings, f"http://127.0.0.1:{dead_port()}"), "connect")
    assert result.returncode == 1
    assert "cannot reach http://127.0.0.1:" in result.stderr
    assert "Traceback" not in result.stderr


async def test_the_client_reads_evolutions_error_answers(settings: Settings) -> None:
    async with evolution([FakeInstance("acme-sales")]) as (_, url):
        api = EvolutionApi(url, API_KEY)
        stranger = EvolutionApi(url, "fake-wrong-key")
        try:
            with pytest.raises(EvolutionNotFound, match='HTTP 404: The "nope" instance does not exist'):
                await api.webhook("nope")
            with pytest.raises(
                EvolutionError, match=r"HTTP 400: .*webhook.events\[0\] is not one of enum values"
            ):
                await api.set_webhook(
                    "acme-sales", {"enabled": True, "url": WEBHOOK, "events": ["NOT_AN_EVENT"]}
                )
            with pytest.raises(EvolutionRefused, match="HTTP 401: Unauthorized"):
                await stranger.instances()
            assert await api.connection_state("acme-sales") == "open"
            assert await api.webhook("acme-sales") is None
        finally:
            await api.close()
            await stranger.close()


def a_message(number: int, text: str | None = None) -> dict[str, Any]:
    """The ``number``-th distinct incoming message (a message is its id and content)."""
    data = copy.deepcopy(fixture("messages_upsert_text_incoming")["webhook_body"]["data"])
    data["key"]["id"] = f"{data['key']['id'][:20]}{number:012d}"
    data["messageTimestamp"] = data["messageTimestamp"] + number
    if text is not None:
        data["message"]["conversation"] = text
    return data


def _global_rabbitmq(settings: Settings) -> FakeEnvironment:
    return FakeEnvironment(
        rabbitmq_global=True, rabbitmq_exchange=settings.rabbitmq_exchange, rabbitmq_prefix=settings.rabbitmq_prefix,
        rabbitmq_global_events={env_name(e) for e in settings.rabbitmq_events},
    )  # fmt: skip


async def _when(condition: Callable[[], bool], what: str) -> None:
    async def met() -> bool:
        return condition()

    await wait_until(met, within=30, message=what)


async def test_connect_waits_until_each_connected_instance_delivers_on_both_channels(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession
) -> None:
    async with (
        open_runtime(webhook_auth=["url_token"], webhook_token=TOKEN) as runtime,
        running_service(runtime) as service,
    ):
        settings = runtime.settings
        instances = [
            FakeInstance("acme-sales"),
            FakeInstance("acme-support"),
            FakeInstance("acme-off", state="close"),
        ]
        async with (
            evolution(instances, _global_rabbitmq(settings)) as (fake, url),
            broker(RABBITMQ_URL) as (_, channel),
        ):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            env = connect_env(settings, url, service.url.removesuffix("/api/internal/webhook"))
            run = asyncio.create_task(cli_json_status(env, "connect", "--wait-seconds", "30"))
            await _when(
                lambda: all(fake.instances[n].webhook for n in ("acme-sales", "acme-support")), "webhooks set"
            )
            for number, name in enumerate(("acme-sales", "acme-support")):
                statuses = await fake.emit(http, publisher, name, "messages.upsert", a_message(number))
                assert statuses == [200]
            code, report = await asyncio.wait_for(run, 60)
            assert code == 0, report
            assert {n: i["delivered"] for n, i in _by_name(report).items()} == {
                "acme-sales": {"webhook": True, "rabbitmq": True},
                "acme-support": {"webhook": True, "rabbitmq": True},
                "acme-off": {"webhook": False, "rabbitmq": False},
            }
            assert report["waited_seconds"] < 30
            # Again: nothing to set; acme-sales delivers by webhook only, so RabbitMQ is reported silent.
            calls = len(fake.calls)
            again = asyncio.create_task(cli(env, "connect", "--wait-seconds", "4"))
            await _when(lambda: len(fake.calls) >= calls + 7, "the second run to read every instance")
            await fake.emit(http, None, "acme-sales", "messages.upsert", a_message(9))
            second = await asyncio.wait_for(again, 60)
    assert second.returncode == 1
    sales = next(line for line in second.stdout.splitlines() if line.strip().startswith("acme-sales"))
    assert "webhook yes" in sales
    assert "rabbitmq silent" in sales
    assert "not connected" in second.stdout
    await wait_until(lambda: _ran(recorder, 3), within=10, message="three events processed")
    assert recorder.doubled() == []


async def _ran(recorder: Recorder, count: int) -> bool:
    return recorder.total == count
