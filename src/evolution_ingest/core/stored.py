"""From a message Evolution stored to the ``messages.upsert`` event it stands for (backfill).

``POST /chat/findMessages/{instance}`` answers Prisma's ``Message`` rows: ``id`` (Evolution's
row id), ``key``, ``pushName``, ``messageType``, ``message``, ``messageTimestamp`` (seconds),
``instanceId``, ``source``, ``contextInfo`` and ``MessageUpdate`` (the delivery states it
went through). The event built from one has the body of a channel's ``messages.upsert``, so
handlers and routes see the same shape, and the same dedup key as its channel copies (the
message's id, direction and content: :mod:`evolution_ingest.core.identity`).

What can differ from a channel's copy: ``status`` (the furthest state among ``MessageUpdate``,
not the one at emission), ``pushName`` (Evolution fills a missing one when it answers), no
``base64`` media (never stored), ``date_time`` (from ``messageTimestamp``: when the message was
sent, not when Evolution emitted it), no ``destination``, ``apikey`` null, no 2.4 ``extra``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

#: Evolution's delivery states, in the order a message goes through them.
_PROGRESS: Final = ("ERROR", "PENDING", "SERVER_ACK", "DELIVERY_ACK", "READ", "PLAYED")
#: A stored message changed after it was emitted: its content is no longer the emitted one.
CHANGED_STATES: Final = frozenset({"EDITED"})
_DATA_FIELDS: Final = ("key", "pushName", "message", "contextInfo", "messageType", "messageTimestamp",
                       "instanceId", "source")  # fmt: skip


class NotAMessage(ValueError):
    """A record without the fields of a stored message (another Evolution version, a bad page)."""


def timestamp(record: dict[str, Any]) -> int:
    value = record.get("messageTimestamp")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NotAMessage(f"messageTimestamp is not a number: {value!r}")
    return int(value)


def message_id(record: dict[str, Any]) -> str:
    key = record.get("key")
    if not isinstance(key, dict) or not isinstance(key.get("id"), str) or not key["id"]:
        raise NotAMessage("no key.id")
    return str(key["id"])


def states(record: dict[str, Any]) -> list[str]:
    updates = record.get("MessageUpdate")
    if not isinstance(updates, list):
        return []
    return [u["status"] for u in updates if isinstance(u, dict) and isinstance(u.get("status"), str)]


def changed(record: dict[str, Any]) -> bool:
    """Edited after it was emitted (Evolution overwrites the stored content)."""
    return bool(CHANGED_STATES & set(states(record)))


def _status(record: dict[str, Any]) -> str | None:
    reached = [s for s in states(record) if s in _PROGRESS]
    return max(reached, key=_PROGRESS.index) if reached else None


def event_body(
    record: dict[str, Any], *, instance: str, sender: str | None, server_url: str | None
) -> dict[str, Any]:
    """The ``messages.upsert`` body of a stored message (raises :class:`NotAMessage`)."""
    message_id(record)
    sent = datetime.fromtimestamp(timestamp(record), UTC)
    data = {name: record.get(name) for name in _DATA_FIELDS}
    data["status"] = _status(record)
    return {
        "event": "messages.upsert",
        "instance": instance,
        "data": data,
        "date_time": sent.strftime("%Y-%m-%dT%H:%M:%S.000Z"),
        "sender": sender,
        "server_url": server_url,
        "apikey": None,
    }


def as_evolution_time(moment: datetime) -> str:
    """A bound of findMessages' ``messageTimestamp`` filter (Evolution reads whole seconds)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
