"""Every instance's connection, live: from connection.update events and Evolution's connectionState,
in ``status``, ``/metrics`` and the dashboard's data, with alerts raised once and cleared once."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import orjson
import pytest
from pydantic import SecretStr

from evolution_ingest.operate.instances import InstanceWatcher
from evolution_ingest.stores.connections import uptime
from evolution_ingest.stores.evolution import EvolutionApi
from tests.conftest import OpenRuntime, serving
from tests.support import fixture, running_server
from tests.support.destination import Destination
from tests.support.fake_evolution import FakeEvolution, FakeInstance
from tests.test_admin import cli
from tests.test_cli import env_for
from tests.test_connect import API_KEY

NOW = datetime.now(UTC).replace(microsecond=0)


def _connection(state: str, reason: int, at: datetime, instance: str = "acme-sales") -> dict[str, Any]:
    name = {"open": "connection_update_open", "close": "connection_update_close_logged_out"}.get(
        state, "connection_update_connecting"
    )
    body = fixture(name)["webhook_body"]
    body["instance"] = instance
    body["data"] = {**body["data"], "instance": instance, "state": state, "statusReason": reason}
    body["date_time"] = at.strftime("%Y-%m-%dT%H:%M:%S.000Z")
    return body


def test_uptime_is_the_share_of_the_known_window_spent_open() -> None:
    changes = [
        (NOW - timedelta(hours=30), "open"),
        (NOW - timedelta(hours=6), "close"),
        (NOW - timedelta(hours=3), "open"),
    ]
    assert uptime(changes, NOW - timedelta(hours=24), NOW) == round(21 / 24, 4)
    assert uptime(changes[1:], NOW - timedelta(hours=24), NOW) == 0.5  # before the first state: not known
    assert uptime([], NOW - timedelta(hours=24), NOW) is None


async def test_states_recorded_together_keep_the_changes_that_one_at_a_time_in_time_order_would(
    open_runtime: OpenRuntime,
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    minute = timedelta(minutes=1)
    given = [  # (instance, minutes after `at`, state), in the order they arrive, all at once
        ("one", 3, "close"), ("one", 1, "open"), ("one", 2, "open"), ("one", 1, "open"),
        ("two", 1, "connecting"), ("one", 4, "close"), ("two", 2, "open"), ("one", 5, "open"),
    ]  # fmt: skip
    async with open_runtime() as runtime:
        log = runtime.stores.connections
        await log.record("one", at, "close", 428, "event")  # already kept: "one" starts closed
        kept = await asyncio.gather(
            *(log.record(instance, at + n * minute, state, None, "event") for instance, n, state in given)
        )
        assert log._records.batches < len(given)  # they did share statements
        rows = await runtime.stores.db.fetch(
            "SELECT instance, at, state FROM evolution_ingest_connection_states ORDER BY instance, at"
        )
    assert [(r["instance"], round((r["at"] - at) / minute), r["state"]) for r in rows] == [
        ("one", 0, "close"), ("one", 1, "open"), ("one", 3, "close"), ("one", 5, "open"),
        ("two", 1, "connecting"), ("two", 2, "open"),
    ]  # fmt: skip
    # Each call says whether its state was kept; of two equal ones, the first.
    assert kept == [True, True, False, False, True, False, True, True]


async def test_a_state_postgres_refuses_fails_alone_in_its_batch(open_runtime: OpenRuntime) -> None:
    at = datetime.now(UTC).replace(microsecond=0)
    async with open_runtime() as runtime:
        log = runtime.stores.connections
        outcomes = await asyncio.gather(
            log.record("fine", at, "open", None, "event"),
            log.record("bad", at, "open", 2**40, "event"),  # not an integer column's value
            log.record("also-fine", at, "close", 401, "event"),
            return_exceptions=True,
        )
    assert outcomes[0] is True
    assert outcomes[2] is True
    assert isinstance(outcomes[1], Exception)


async def test_a_status_reason_no_column_can_hold_is_dropped_and_the_event_still_processed(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    async with open_runtime() as runtime, serving(runtime) as url:
        body = _connection("close", 2**40, at, "acme-odd")
        async with http.post(url, data=orjson.dumps(body)) as answer:
            assert answer.status == 200
            assert (await answer.json())["status"] == "processed"
        row = await runtime.stores.db.fetchrow(
            "SELECT state, reason FROM evolution_ingest_connection_states WHERE instance = 'acme-odd'"
        )
    assert row is not None
    assert (row["state"], row["reason"]) == ("close", None)


async def test_status_and_metrics_show_each_instance_and_alerts_are_raised_and_cleared_once(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    alerts = Destination()
    # not NOW: the suite may reach this test minutes after the module was imported
    now = datetime.now(UTC).replace(microsecond=0)
    async with running_server(alerts.app) as hook:  # noqa: SIM117 - the runtime needs the hook's URL
        async with open_runtime(
            gap_alert_webhook_url=f"{hook}/alerts", instance_down_alert_seconds=600.0
        ) as runtime:
            async with serving(runtime) as url:
                timeline = [("connecting", 200, now - timedelta(hours=3)), ("open", 200, now - timedelta(hours=3) + timedelta(minutes=1)),
                            ("close", 401, now - timedelta(hours=1))]  # fmt: skip
                for state, reason, at in timeline:
                    async with http.post(url, data=orjson.dumps(_connection(state, reason, at))) as answer:
                        assert answer.status == 200
                # A second instance connecting for 20 minutes: away longer than the setting.
                async with http.post(
                    url,
                    data=orjson.dumps(
                        _connection("connecting", 200, now - timedelta(minutes=20), "acme-support")
                    ),
                ):
                    pass
                base = url.removesuffix("/api/internal/webhook")
                env = env_for(runtime.settings)
                status = orjson.loads((await cli(env, "status", "--json")).stdout)["instances"]
                human = (await cli(env, "status")).stdout
                replicas = [
                    InstanceWatcher(runtime.stores.connections, runtime.counters, runtime.redis, runtime.settings,
                                    routes=None, api=None)
                    for _ in range(2)
                ]  # fmt: skip
                first = [await r.check() for r in replicas]
                async with http.get(base + "/metrics") as answer:
                    metrics = await answer.text()
                reconnected = _connection("open", 200, datetime.now(UTC))
                async with http.post(url, data=orjson.dumps(reconnected)):
                    pass
                second = [await r.check() for r in replicas]
                for replica in replicas:
                    await replica.close()
                counted = await runtime.counters.read(["alert:instance:raised", "alert:instance:cleared"])
    sales = next(i for i in status["instances"] if i["instance"] == "acme-sales")
    assert sales["state"] == "close"
    assert sales["logged_out"] is True
    assert sales["last_close_reason"] == 401
    assert sales["uptime"]["24h"] == pytest.approx(119 / 180, abs=0.002)  # open 1 h 59 min of the 3 h known
    assert sales["alert"] is None  # not raised yet at that moment
    assert "logged out" in human
    assert "acme-support" in human
    assert sorted(name for raised, _ in first for name in raised) == ["acme-sales", "acme-support"]
    assert 'evolution_ingest_instance_up{instance="acme-sales"} 0.0' in metrics
    assert 'evolution_ingest_instance_alert{instance="acme-sales"} 1.0' in metrics
    ratio = re.search(
        r'evolution_ingest_instance_uptime_ratio\{instance="acme-sales",window="24h"\} ([0-9.]+)', metrics
    )
    assert ratio is not None
    assert float(ratio[1]) == pytest.approx(119 / 180, abs=0.002)
    assert sorted(name for _, cleared in second for name in cleared) == ["acme-sales"]
    assert counted == {"alert:instance:raised": 2, "alert:instance:cleared": 1}
    texts = [r.body["text"] for r in alerts.received]
    assert len(texts) == 3
    assert any("'acme-sales' was logged out of WhatsApp" in t for t in texts)
    assert any("'acme-support' is connecting since" in t for t in texts)
    assert any("'acme-sales' is connected again" in t for t in texts)


async def test_evolutions_connection_state_is_polled_by_one_replica_per_interval(
    open_runtime: OpenRuntime,
) -> None:
    fake = FakeEvolution(
        API_KEY, [FakeInstance("acme-sales", state="open"), FakeInstance("acme-off", state="close")]
    )
    async with (
        running_server(fake.app) as url,
        open_runtime(evolution_url=url, evolution_api_key=SecretStr(API_KEY)) as runtime,
    ):
        watchers = []
        for _ in range(2):
            api = EvolutionApi(url, API_KEY)
            watchers.append(
                InstanceWatcher(runtime.stores.connections, runtime.counters, runtime.redis, runtime.settings,
                                routes=None, api=api)
            )  # fmt: skip
        try:
            polled = [await w.poll() for w in watchers]
            connections = {
                c.instance: c.state for c in await runtime.stores.connections.connections(datetime.now(UTC))
            }
        finally:
            for w in watchers:
                assert w._api is not None
                await w._api.close()
    assert sorted(polled) == [0, 2]
    assert connections == {"acme-sales": "open", "acme-off": "close"}
