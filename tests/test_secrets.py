"""Secrets stay secret: none of a run's secrets is stored, logged, shown or forwarded.

A real ``up`` process receives every fixture the way Evolution sends it with ``url_token``
auth (the token in the URL, so in ``destination``), with JWTs and the instance ``apikey``,
on both channels, plus an errors-webhook body with the global key and refused bodies that
carry the secrets. Then the inbox, the refusals and deliveries, the logs, ``inspect``,
``status``, the dashboard's data, ``/metrics`` and what a route forwarded are scanned.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import jwt
import orjson

from evolution_ingest.config import Settings
from evolution_ingest.stores.queues import Topology
from tests.conftest import RABBITMQ_URL
from tests.support import fixtures, free_socket, running_server, wait_until
from tests.support.destination import Destination
from tests.support.evolution import EvolutionPublisher, broker, remove
from tests.test_admin import cli
from tests.test_cli import env_for, healthy


def _secret(kind: str) -> str:
    return f"fake-{kind}-" + secrets.token_hex(16)


async def test_no_secret_of_a_run_is_stored_logged_shown_or_forwarded(
    settings: Settings, tmp_path: Path, http: aiohttp.ClientSession, db: asyncpg.Connection
) -> None:
    token, jwt_key, apikey, global_key, dashboard = (
        _secret(k) for k in ("url-token", "jwt-key", "instance-apikey", "global-key", "dashboard")
    )
    internal = settings.internal_secret.get_secret_value() if settings.internal_secret else ""
    issued: list[str] = []
    destination = Destination()
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    base = f"http://127.0.0.1:{port}"
    async with running_server(destination.app) as forwarded_to:
        routes = tmp_path / "routes.yaml"
        routes.write_text(
            f"alert_webhook_url: {forwarded_to}/alerts\n"
            "routes:\n"
            f"  - name: everything\n    forward: {{url: {forwarded_to}/crm}}\n"
            "  - name: closed\n    match: {events: connection.update, data: {state: close}}\n"
            "    alert: {message: '{instance} closed', sinks: [log, webhook], cooldown_seconds: 0}\n",
            encoding="utf-8",
        )
        env = env_for(
            settings,
            PORT=str(port),
            WEBHOOK_AUTH="url_token,jwt,apikey",
            WEBHOOK_TOKEN=token,
            WEBHOOK_JWT_KEY=jwt_key,
            WEBHOOK_APIKEYS=apikey,
            DASHBOARD_TOKEN=dashboard,
            ROUTES_FILE=str(routes),
            LOG_LEVEL="DEBUG",
        )
        log_path = tmp_path / "up.log"
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "evolution_ingest", "up", env=env, stderr=log_file, stdout=log_file
            )
        try:
            await wait_until(lambda: healthy(http, port), within=30, message="up to answer")
            sent = await _send_everything(http, base, token, jwt_key, apikey, global_key, issued, settings)
            await wait_until(
                lambda: _all_processed(db, sent), within=60, message="every event processed on both channels"
            )
            shown = await _operator_views(http, base, dashboard, db, env)
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
            await remove(RABBITMQ_URL, Topology(settings))
    stored = await _stored(db)
    logs = log_path.read_text(encoding="utf-8", errors="replace")
    forwarded = "\n".join(orjson.dumps({"h": r.headers, "b": r.body}).decode() for r in destination.received)
    assert len(destination.received) > 20  # the route forwarded the fixtures and the alert went out
    assert "closed" in forwarded
    places = {"inbox and tables": stored, "logs": logs, "operator views": shown, "forwarded": forwarded}
    for name, secret in {
        "webhook token": token, "JWT key": jwt_key, "instance apikey": apikey, "global API key": global_key,
        "internal secret": internal, "dashboard token": dashboard, **{f"JWT {i}": t for i, t in enumerate(issued)},
    }.items():  # fmt: skip
        found = [place for place, text in places.items() if secret in text]
        assert found == [], f"the {name} appears in: {', '.join(found)}"


async def _send_everything(
    http: aiohttp.ClientSession,
    base: str,
    token: str,
    jwt_key: str,
    apikey: str,
    global_key: str,
    issued: list[str],
    settings: Settings,
) -> int:
    """Every fixture on both channels, as Evolution sends it; returns how many distinct events."""
    sent = 0
    async with broker(RABBITMQ_URL) as (_, channel):
        publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
        for number, item in enumerate(fixtures()):
            suffix = item["webhook_path_suffix"]
            # The global webhook with url_token: Evolution writes its own URL, token included.
            body = {
                **item["webhook_body"],
                "apikey": apikey,
                "destination": f"{base}/api/internal/webhook/t/{token}{suffix}",
            }
            headers = {"content-type": "application/json"}
            url = f"{base}/api/internal/webhook/t/{token}{suffix}"
            if number % 3 == 0:  # an instance webhook with jwt_key: a Bearer token, no token in the URL
                issued.append(
                    jwt.encode({"iat": int(time.time()), "exp": int(time.time()) + 600}, jwt_key, "HS256")
                )
                headers["authorization"] = f"Bearer {issued[-1]}"
                url = (
                    f"{base}/api/internal/webhook{suffix}?token={token}"
                    if number % 2
                    else f"{base}/api/internal/webhook{suffix}"
                )
            async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
                assert resp.status == 200, await resp.text()
            await publisher.publish_global({**item["rabbitmq_body"], "apikey": apikey}, item["routing_key"])
            sent += 0 if item["name"].endswith("_REEMITTED") else 1
    # Evolution's errors webhook: its global key in api_key, no instance.
    error = {"event": "error", "data": {"error": "Internal Server Error", "status": 500}, "date_time": "2026-01-01T00:00:00.000Z",
             "api_key": global_key, "server_url": base}  # fmt: skip
    async with http.post(f"{base}/api/internal/webhook/t/{token}", data=orjson.dumps(error)) as resp:
        assert resp.status == 200, await resp.text()
    # Refused bodies that carry the secrets: a wrong token, a malformed body, an unknown apikey.
    leaky = {
        **fixtures()[0]["webhook_body"],
        "apikey": apikey,
        "destination": f"{base}/api/internal/webhook/t/{token}?token={token}",
    }
    for url, raw in (
        (f"{base}/api/internal/webhook/t/not-the-token", orjson.dumps({**leaky, "apikey": "unknown-key"})),
        (f"{base}/api/internal/webhook/t/{token}", orjson.dumps(leaky)[:-30]),
        (f"{base}/api/internal/webhook/t/{token}?token={token}", b'{"apikey": "' + apikey.encode() + b'", "event": 1}'),
    ):  # fmt: skip
        async with http.post(url, data=raw) as resp:
            assert resp.status in {400, 401}, await resp.text()
    return sent + 1


async def _all_processed(db: asyncpg.Connection, sent: int) -> bool:
    row = await db.fetchrow(
        "SELECT count(*) FILTER (WHERE processed_at IS NOT NULL) AS done,"
        " count(*) FILTER (WHERE rabbitmq_seen_at IS NOT NULL) AS by_rabbitmq FROM evolution_ingestion_events"
    )
    assert row is not None
    return bool(row["done"] == sent and row["by_rabbitmq"] == sent - 1)


async def _operator_views(
    http: aiohttp.ClientSession, base: str, dashboard: str, db: asyncpg.Connection, env: dict[str, str]
) -> str:
    texts: list[str] = []
    auth = {"authorization": f"Bearer {dashboard}"}
    paths = ["/dashboard/data", "/metrics"]
    paths += [
        f"/dashboard/events/{r['id']}" for r in await db.fetch("SELECT id FROM evolution_ingestion_events")
    ]
    paths += [
        f"/dashboard/refusals/{r['id']}" for r in await db.fetch("SELECT id FROM evolution_ingest_refusals")
    ]
    for path in paths:
        async with http.get(base + path, headers=auth) as resp:
            assert resp.status == 200, path
            texts.append(await resp.text())
    refs = [str(r["id"]) for r in await db.fetch("SELECT id FROM evolution_ingestion_events")]
    refs += [f"refusal:{r['id']}" for r in await db.fetch("SELECT id FROM evolution_ingest_refusals")]
    assert len(refs) > 20
    commands = [["status", "--json"], ["status"]]
    commands += [["inspect", ref, *form] for ref in refs for form in (["--json"], [])]
    slots = asyncio.Semaphore(4)

    async def run(args: list[str]) -> str:
        async with slots:
            result = await cli(env, *args)
        assert result.returncode == 0, result.stderr
        return result.stdout + result.stderr

    texts += await asyncio.gather(*(run(args) for args in commands))
    return "\n".join(texts)


async def _stored(db: asyncpg.Connection) -> str:
    """Every row of the service's tables, as text (bytes decoded)."""
    texts: list[str] = []
    for table in ("evolution_ingestion_events", "evolution_ingest_deliveries", "evolution_ingest_refusals"):
        for record in await db.fetch(f"SELECT * FROM {table}"):
            values: list[Any] = [
                bytes(v).decode("utf-8", "replace") if isinstance(v, bytes) else v for v in record.values()
            ]
            texts.append(orjson.dumps(values, default=str).decode())
    return "\n".join(texts)
