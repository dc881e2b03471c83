"""A fake of Evolution API's REST side, built from its source (2.3.6 / 2.4): the routes, bodies and
error answers ``connect``, ``check`` and the backfill use, and Evolution's way of emitting an
event to the webhooks and RabbitMQ it is configured with.

Routes (header ``apikey``: the global key, else 401):
``GET /instance/fetchInstances``, ``GET /instance/connectionState/{i}``,
``GET|POST /webhook/find|set/{i}``, ``GET|POST /rabbitmq/find|set/{i}``,
``POST /chat/findMessages/{i}``. An unknown instance is 404, a body the schema refuses 400,
with Evolution's error shape ``{"status", "error", "response": {"message": ...}}``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import jwt
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from evolution_ingest.stores.evolution import INSTANCE_EVENTS, env_name
from tests.support.evolution import EvolutionPublisher

ALL_EVENTS = [e for e in INSTANCE_EVENTS if e != "MESSAGING_HISTORY_SET"]


def _json(body: Any, status: int = 200) -> Response:
    return Response(b"" if body is None else orjson.dumps(body), status, media_type="application/json")


def _error(status: int, error: str, message: Any) -> Response:
    return _json({"status": status, "error": error, "response": {"message": message}}, status)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class FakeInstance:
    name: str
    state: str = "open"
    token: str = field(default_factory=lambda: "fake-instance-token-" + uuid.uuid4().hex[:8])
    id: str = field(default_factory=lambda: "c" + uuid.uuid4().hex[:24])
    webhook: dict[str, Any] | None = None
    rabbitmq: dict[str, Any] | None = None
    #: Stored message rows (``DATABASE_SAVE_DATA_NEW_MESSAGE``), as Prisma's Message model.
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FakeEnvironment:
    """What Evolution's own environment says about the global webhook and RabbitMQ."""

    webhook_global_url: str | None = None
    webhook_global_events: set[str] = field(default_factory=set)
    rabbitmq_enabled: bool = True
    rabbitmq_global: bool = False
    rabbitmq_exchange: str = "evolution_exchange"
    rabbitmq_prefix: str = "evolution"
    rabbitmq_global_events: set[str] = field(default_factory=set)
    expose_apikey: bool = False


class FakeEvolution:
    def __init__(
        self,
        api_key: str,
        instances: list[FakeInstance],
        env: FakeEnvironment | None = None,
        *,
        version: str = "2.4",
    ) -> None:
        #: "2.3" or "2.4": 2.4 sends X-Instance-* headers on instance webhooks and spreads ``extra``.
        self.version = version
        self.api_key = api_key
        self.instances = {i.name: i for i in instances}
        self.env = env or FakeEnvironment()
        self.calls: list[tuple[str, str]] = []
        #: (status, error, message) answered by the next ``set`` call instead of setting.
        self.fail_next_set: tuple[int, str, Any] | None = None
        #: Seconds every findMessages call takes (a slow page).
        self.find_delay = 0.0
        #: Per instance, what its next findMessages calls answer, one each: (status, error, message)
        #: instead of a page, or None for the page.
        self.fail_finds: dict[str, list[tuple[int, str, Any] | None]] = {}
        #: DATABASE_SAVE_DATA_NEW_MESSAGE: emitted messages are stored (and findMessages serves them).
        self.save_messages = True
        self.app = Starlette(
            routes=[
                Route("/instance/fetchInstances", self._fetch_instances, methods=["GET"]),
                Route("/instance/connectionState/{name}", self._connection_state, methods=["GET"]),
                Route("/webhook/find/{name}", self._find("webhook"), methods=["GET"]),
                Route("/webhook/set/{name}", self._set_webhook, methods=["POST"]),
                Route("/rabbitmq/find/{name}", self._find("rabbitmq"), methods=["GET"]),
                Route("/rabbitmq/set/{name}", self._set_rabbitmq, methods=["POST"]),
                Route("/chat/findMessages/{name}", self._find_messages, methods=["POST"]),
            ]
        )

    # --- the guards ------------------------------------------------------------------------
    def _guard(self, request: Request) -> tuple[Response | None, FakeInstance | None]:
        self.calls.append((request.method, request.url.path))
        if request.headers.get("apikey") != self.api_key:
            return _error(401, "Unauthorized", "Unauthorized"), None
        name = request.path_params.get("name")
        if name is None:
            return None, None
        if name not in self.instances:
            return _error(404, "Not Found", [f'The "{name}" instance does not exist']), None
        return None, self.instances[name]

    # --- instances -------------------------------------------------------------------------
    async def _fetch_instances(self, request: Request) -> Response:
        refused, _ = self._guard(request)
        if refused:
            return refused
        rows = [
            {
                "id": i.id, "name": i.name, "connectionStatus": i.state, "ownerJid": "5511999990000@s.whatsapp.net",
                "profileName": "Acme", "profilePicUrl": None, "integration": "WHATSAPP-BAILEYS",
                "number": None, "businessId": None, "token": i.token, "clientName": "evolution_exchange",
                "disconnectionReasonCode": None, "disconnectionObject": None, "disconnectionAt": None,
                "createdAt": "2026-01-01T00:00:00.000Z", "updatedAt": "2026-01-01T00:00:00.000Z",
                "Chatwoot": None, "Proxy": None, "Rabbitmq": i.rabbitmq, "Nats": None, "Sqs": None,
                "Websocket": None, "Setting": None, "_count": {"Message": len(i.messages), "Contact": 0, "Chat": 0},
            }
            for i in self.instances.values()
        ]  # fmt: skip
        return _json(rows)

    async def _connection_state(self, request: Request) -> Response:
        refused, instance = self._guard(request)
        if refused or instance is None:
            return refused or _error(400, "Bad Request", ['"instanceName" not provided.'])
        return _json({"instance": {"instanceName": instance.name, "state": instance.state}})

    # --- webhook and RabbitMQ settings -----------------------------------------------------
    def _find(self, kind: str) -> Any:
        async def find(request: Request) -> Response:
            refused, instance = self._guard(request)
            if refused or instance is None:
                return refused or _error(400, "Bad Request", ["no instance"])
            return _json(getattr(instance, kind))

        return find

    def _validate(self, body: Any, kind: str, required: tuple[str, ...]) -> list[str]:
        if not isinstance(body, dict) or kind not in body:
            return [f'requires property "{kind}"']
        value = body[kind]
        problems = [f'{kind} requires property "{name}"' for name in required if name not in value]
        for index, event in enumerate(value.get("events") or []):
            if event not in INSTANCE_EVENTS:
                problems.append(
                    f"{kind}.events[{index}] is not one of enum values: {','.join(INSTANCE_EVENTS)}"
                )
        return problems

    def _events(self, value: dict[str, Any]) -> list[str]:
        if not value.get("enabled"):
            return []
        return list(value.get("events") or []) or list(ALL_EVENTS)

    async def _set_webhook(self, request: Request) -> Response:
        refused, instance = self._guard(request)
        if refused or instance is None:
            return refused or _error(400, "Bad Request", ["no instance"])
        if self.fail_next_set:
            status, error, message = self.fail_next_set
            self.fail_next_set = None
            return _error(status, error, message)
        body = orjson.loads(await request.body())
        problems = self._validate(body, "webhook", ("enabled", "url"))
        if problems:
            return _error(400, "Bad Request", [problems])
        value = body["webhook"]
        instance.webhook = {
            "id": (instance.webhook or {}).get("id", "w" + uuid.uuid4().hex[:24]), "url": value["url"],
            "headers": value.get("headers"), "enabled": value["enabled"], "events": self._events(value),
            "webhookByEvents": value.get("byEvents", False), "webhookBase64": value.get("base64", False),
            "createdAt": _now(), "updatedAt": _now(), "instanceId": instance.id,
        }  # fmt: skip
        return _json(instance.webhook, 201)

    async def _set_rabbitmq(self, request: Request) -> Response:
        refused, instance = self._guard(request)
        if refused or instance is None:
            return refused or _error(400, "Bad Request", ["no instance"])
        body = orjson.loads(await request.body())
        problems = self._validate(body, "rabbitmq", ("enabled",))
        if problems:
            return _error(400, "Bad Request", [problems])
        if not self.env.rabbitmq_enabled:
            return _json(None, 201)  # Evolution without RABBITMQ_ENABLED sets nothing
        value = body["rabbitmq"]
        instance.rabbitmq = {
            "id": (instance.rabbitmq or {}).get("id", "r" + uuid.uuid4().hex[:24]),
            "enabled": value["enabled"], "events": self._events(value),
            "createdAt": _now(), "updatedAt": _now(), "instanceId": instance.id,
        }  # fmt: skip
        return _json(instance.rabbitmq, 201)

    # --- stored messages (backfill) ----------------------------------------------------------
    async def _find_messages(self, request: Request) -> Response:
        refused, instance = self._guard(request)
        if refused or instance is None:
            return refused or _error(400, "Bad Request", ["no instance"])
        planned = self.fail_finds.get(instance.name)
        failure = planned.pop(0) if planned else None
        if failure is not None:
            status, error, message = failure
            return _error(status, error, message)
        if self.find_delay:
            await asyncio.sleep(self.find_delay)  # wait-ok: a slow Evolution, on purpose
        raw = await request.body()
        query = orjson.loads(raw) if raw else {}
        where = query.get("where") or {}
        stamp = where.get("messageTimestamp") or {}
        # As Evolution: the time filter applies only with both bounds, in whole seconds.
        rows = [m for m in instance.messages if not ("gte" in stamp and "lte" in stamp) or _within(m, stamp)]
        rows.sort(key=lambda m: m["messageTimestamp"], reverse=True)
        size = int(query.get("offset") or 50)
        page = max(1, int(query.get("page") or 1))
        pages = (len(rows) + size - 1) // size
        return _json(
            {"messages": {"total": len(rows), "pages": pages, "currentPage": page,
                          "records": rows[(page - 1) * size : page * size]}}
        )  # fmt: skip

    def store(self, instance: str, data: dict[str, Any]) -> dict[str, Any]:
        """Keep a message as Evolution's ``message.create`` does (findMessages' row shape)."""
        found = self.instances[instance]
        message = {k: v for k, v in (data.get("message") or {}).items() if k != "base64"}
        record = {
            "id": "m" + uuid.uuid4().hex[:24], "key": data["key"], "pushName": data.get("pushName"),
            "messageType": data.get("messageType", "conversation"), "message": message,
            "messageTimestamp": data.get("messageTimestamp", int(time.time())), "instanceId": found.id,
            "source": data.get("source", "android"), "contextInfo": data.get("contextInfo"),
            "MessageUpdate": [{"status": data["status"]}] if data.get("status") else [],
        }  # fmt: skip
        found.messages.append(record)
        return record

    # --- emitting, as Evolution does -----------------------------------------------------------
    async def emit(
        self,
        http: aiohttp.ClientSession,
        publisher: EvolutionPublisher | None,
        instance: str,
        event: str,
        data: Any,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """Send ``event`` to the webhooks and RabbitMQ this Evolution is configured with; the webhooks' statuses."""
        found = self.instances[instance]
        we = env_name(event)
        date_time = _now()
        statuses: list[int] = []
        if self.save_messages and event in {"messages.upsert", "send.message"} and isinstance(data, dict):
            self.store(instance, data)
        spread = extra if self.version == "2.4" and extra else {}
        base = {**spread, "event": event, "instance": instance, "data": data, "date_time": date_time,
                "sender": "5511999990000@s.whatsapp.net", "server_url": "http://evolution.example.test",
                "apikey": found.token if self.env.expose_apikey else None}  # fmt: skip
        webhook = found.webhook or {}
        destination = webhook.get("url") or f"{self.env.webhook_global_url}/{we.lower().replace('_', '-')}"
        body = orjson.dumps({**base, "destination": destination})
        if webhook.get("enabled") and we in (webhook.get("events") or []):
            headers = {**(webhook.get("headers") or {})}
            if self.version == "2.4":
                headers |= {"X-Instance-ID": found.id, "X-Instance-Name": instance, "X-Event-Type": event,
                            "X-Timestamp": str(int(time.time() * 1000))}  # fmt: skip
            key = headers.pop("jwt_key", None)
            if key:
                now = int(time.time())
                headers["Authorization"] = (
                    f"Bearer {jwt.encode({'iat': now, 'exp': now + 600}, key, 'HS256')}"
                )
            url = webhook["url"] + (
                f"/{we.lower().replace('_', '-')}" if webhook.get("webhookByEvents") else ""
            )
            async with http.post(
                url, data=body, headers={**headers, "content-type": "application/json"}
            ) as answer:
                statuses.append(answer.status)
        if self.env.webhook_global_url and we in self.env.webhook_global_events:
            async with http.post(
                self.env.webhook_global_url, data=body, headers={"content-type": "application/json"}
            ) as answer:
                statuses.append(answer.status)
        rabbit = orjson.dumps(base)
        if (
            publisher is not None
            and found.rabbitmq
            and found.rabbitmq.get("enabled")
            and we in found.rabbitmq["events"]
        ):
            await publisher.publish_instance(rabbit, event, instance)
        if publisher is not None and self.env.rabbitmq_global and we in self.env.rabbitmq_global_events:
            await publisher.publish_global(rabbit, event)
        return statuses


def _within(message: dict[str, Any], stamp: dict[str, Any]) -> bool:
    low, high = (
        int(datetime.fromisoformat(str(stamp[b]).replace("Z", "+00:00")).timestamp()) for b in ("gte", "lte")
    )
    return low <= message["messageTimestamp"] <= high
