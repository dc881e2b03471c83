"""Evolution API's REST API, as a store: its instances, their webhook and RabbitMQ settings, their
stored messages. Routes and bodies as Evolution 2.3 and 2.4 define them (``src/api/routes``,
``src/api/integrations/event``, ``src/api/dto``); every call carries the global API key in the
``apikey`` header, which is never logged or shown.

Evolution answers errors as ``{"status", "error", "response": {"message": ...}}``: 401 for a
wrong key, 404 for an unknown instance, 400 with the schema's complaints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import quote

import aiohttp

from evolution_ingest.core import codec
from evolution_ingest.core.identity import EVENT_NAMES

#: The events an instance's webhook and RabbitMQ settings accept (Evolution's
#: ``EventController.events``, 2.3 and 2.4). ``groups.update`` is ``GROUP_UPDATE`` here, while
#: Evolution checks ``GROUPS_UPDATE`` when it emits: it never delivers that event (its bug).
INSTANCE_EVENTS: Final = (
    "APPLICATION_STARTUP", "QRCODE_UPDATED", "MESSAGES_SET", "MESSAGES_UPSERT", "MESSAGES_EDITED",
    "MESSAGES_UPDATE", "MESSAGES_DELETE", "SEND_MESSAGE", "SEND_MESSAGE_UPDATE", "CONTACTS_SET",
    "CONTACTS_UPSERT", "CONTACTS_UPDATE", "PRESENCE_UPDATE", "CHATS_SET", "CHATS_UPSERT", "CHATS_UPDATE",
    "CHATS_DELETE", "GROUPS_UPSERT", "GROUP_UPDATE", "GROUP_PARTICIPANTS_UPDATE", "CONNECTION_UPDATE",
    "LABELS_EDIT", "LABELS_ASSOCIATION", "CALL", "TYPEBOT_START", "TYPEBOT_CHANGE_STATUS", "REMOVE_INSTANCE",
    "LOGOUT_INSTANCE", "INSTANCE_CREATE", "INSTANCE_DELETE", "STATUS_INSTANCE", "MESSAGING_HISTORY_SET",
)  # fmt: skip
_NAMES_OF: Final = {name: enum for enum, name in EVENT_NAMES.items()}

#: Set by ``connect`` on the instance webhooks it writes: tells their calls from the global webhook's.
SOURCE_HEADER: Final = "x-evolution-ingest-source"
#: Evolution 2.4 sends it (with X-Instance-Name, X-Event-Type, X-Timestamp) on instance webhooks only.
INSTANCE_ID_HEADER: Final = "x-instance-id"
WEBHOOK_PATHS: Final = ("instance", "global")
#: Evolution's bodies carry ``apikey: null`` unless its environment exposes the instance token.
APIKEY_NULL: Final = (
    "apikey is null (Evolution sends it only with AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true)"
)


def webhook_path(headers: Mapping[str, str]) -> str:
    """Which of Evolution's webhooks made a call: ``instance`` or ``global``.

    The global webhook sends no headers of its own. An instance webhook carries the header
    ``connect`` sets, and from Evolution 2.4 on ``X-Instance-ID``; one set by hand on 2.3
    carries neither and counts as global.
    """
    return "instance" if SOURCE_HEADER in headers or INSTANCE_ID_HEADER in headers else "global"


def env_name(event: str) -> str:
    """The suffix of Evolution's ``WEBHOOK_EVENTS_*`` / ``RABBITMQ_EVENTS_*`` variables for ``event``."""
    return _NAMES_OF.get(event, event.replace(".", "_").replace("-", "_").upper())


def setting_name(event: str) -> str | None:
    """The name an instance's settings give ``event``; None when they cannot subscribe to it."""
    name = "GROUP_UPDATE" if event == "groups.update" else env_name(event)
    return name if name in INSTANCE_EVENTS else None


def event_of(setting: str) -> str:
    """Back from a settings name (``GROUP_UPDATE``) to the event (``groups.update``)."""
    return "groups.update" if setting == "GROUP_UPDATE" else EVENT_NAMES.get(setting, setting.lower())


class EvolutionError(Exception):
    """Evolution answered with an error, or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EvolutionRefused(EvolutionError):
    """401/403: the API key is wrong (EVOLUTION_INGEST_EVOLUTION_API_KEY)."""


class EvolutionNotFound(EvolutionError):
    """404: no such instance."""


def _message(status: int, raw: bytes) -> str:
    try:
        body = codec.loads(raw)
    except codec.JsonRefused:
        return f"HTTP {status}: {raw[:200].decode(errors='replace')}"
    if isinstance(body, dict):
        detail = body.get("response", {}).get("message") if isinstance(body.get("response"), dict) else None
        detail = detail if detail is not None else body.get("message") or body.get("error")
        while isinstance(detail, list) and len(detail) == 1:
            detail = detail[0]
        if isinstance(detail, list):
            detail = "; ".join(str(part) for part in detail)
        return f"HTTP {status}: {detail}"
    return f"HTTP {status}: {body!r}"[:300]


class EvolutionApi:
    """One aiohttp session to one Evolution server."""

    def __init__(self, url: str, api_key: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._session = aiohttp.ClientSession(
            headers={"apikey": api_key, "content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        )

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self._session.request(
                method, self.url + path, data=None if body is None else codec.dumps(body)
            ) as response:
                raw = await response.read()
                status = response.status
        except TimeoutError:
            raise EvolutionError(None, f"no answer from {self.url} within the timeout") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EvolutionError(None, f"cannot reach {self.url}: {type(exc).__name__}: {exc}") from None
        if status in {401, 403}:
            raise EvolutionRefused(
                status, _message(status, raw) + " (check EVOLUTION_INGEST_EVOLUTION_API_KEY)"
            )
        if status == 404:
            raise EvolutionNotFound(status, _message(status, raw))
        if status >= 400:
            raise EvolutionError(status, _message(status, raw))
        if not raw.strip():
            return None
        try:
            return codec.loads(raw)
        except codec.JsonRefused:
            raise EvolutionError(status, f"not JSON: {raw[:200]!r}") from None

    @staticmethod
    def _name(instance: str) -> str:
        return quote(instance, safe="")

    async def instances(self) -> list[dict[str, Any]]:
        """``GET /instance/fetchInstances``: every instance (name, connectionStatus, ...)."""
        found = await self._call("GET", "/instance/fetchInstances")
        return [item for item in found or [] if isinstance(item, dict)]

    async def connection_state(self, instance: str) -> str | None:
        """``GET /instance/connectionState/{instance}``: open, connecting or close."""
        answer = await self._call("GET", f"/instance/connectionState/{self._name(instance)}")
        state = answer.get("instance", {}).get("state") if isinstance(answer, dict) else None
        return state if isinstance(state, str) else None

    async def webhook(self, instance: str) -> dict[str, Any] | None:
        """``GET /webhook/find/{instance}``: the instance's webhook, or None."""
        found = await self._call("GET", f"/webhook/find/{self._name(instance)}")
        return found if isinstance(found, dict) else None

    async def set_webhook(self, instance: str, webhook: dict[str, Any]) -> Any:
        """``POST /webhook/set/{instance}`` with ``{"webhook": {enabled, url, headers, byEvents, base64, events}}``."""
        return await self._call("POST", f"/webhook/set/{self._name(instance)}", {"webhook": webhook})

    async def rabbitmq(self, instance: str) -> dict[str, Any] | None:
        """``GET /rabbitmq/find/{instance}``: the instance's RabbitMQ events, or None."""
        found = await self._call("GET", f"/rabbitmq/find/{self._name(instance)}")
        return found if isinstance(found, dict) else None

    async def set_rabbitmq(self, instance: str, rabbitmq: dict[str, Any]) -> Any:
        """``POST /rabbitmq/set/{instance}`` with ``{"rabbitmq": {enabled, events}}``."""
        return await self._call("POST", f"/rabbitmq/set/{self._name(instance)}", {"rabbitmq": rabbitmq})

    async def find_messages(self, instance: str, query: dict[str, Any]) -> dict[str, Any]:
        """``POST /chat/findMessages/{instance}``: one page of stored messages, newest first."""
        found = await self._call("POST", f"/chat/findMessages/{self._name(instance)}", query)
        return found if isinstance(found, dict) else {}
