"""The identity of an Evolution API event: its canonical form and dedup key.

Evolution gives no event id. One emission reaches us as a webhook body (with
``destination``) and as a RabbitMQ body (without it, keys in another order), and
the webhook may be retried for ~20 minutes. All of these copies must map to one
dedup key, while two genuinely different emissions must not.

Which fields identify an emission depends on the kind of event:

* one WhatsApp message (``messages.upsert``, ``send.message``, whose ``data`` has a
  ``key.id``): instance, event, the message's ``key.id`` and ``key.fromMe``, and its
  content — ``data.message`` without ``base64`` (media Evolution adds to webhook bodies
  only). Evolution may emit the same message again with a new ``date_time`` or another
  delivery ``status``: the same event, a chatbot must not answer it twice. A message whose
  content changed (decrypted, edited) is a new event. The same identity can be computed
  from the message as Evolution stores it (``POST /chat/findMessages``), which is what lets
  a backfilled message and a late channel copy of it be one event (docs/how-it-works.md).
* other message events (updates, deletions, history sets): instance, event and ``data``.
* every other event: instance, event, ``data`` and ``date_time``. The same state
  emitted again later (``open``, ``close``, ``open``) is a new event each time.

Single-message events were identified by their whole ``data`` before (key version 1):
:func:`legacy_dedup_key` computes that key, so that a copy arriving after an upgrade still
finds an event saved before it.

Everything else in the body (``destination``, ``sender``, ``server_url``,
``apikey``, fields this service adds such as ``already_saved``) is ignored.

Pure (no I/O): it is used on both channels and in tests alike. The canonical form
is orjson's with sorted keys — about ten times faster than ``json.dumps`` for the
same bytes, and hashing every copy of every event is on the hot path (see
:mod:`evolution_ingest.core.codec` for the bodies orjson cannot write).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from evolution_ingest.core import codec

#: Evolution's ``Events`` enum: enum name -> the name it puts in ``event``.
EVENT_NAMES: Final[Mapping[str, str]] = {
    "APPLICATION_STARTUP": "application.startup",
    "INSTANCE_CREATE": "instance.create",
    "INSTANCE_DELETE": "instance.delete",
    "QRCODE_UPDATED": "qrcode.updated",
    "CONNECTION_UPDATE": "connection.update",
    "STATUS_INSTANCE": "status.instance",
    "MESSAGES_SET": "messages.set",
    "MESSAGES_UPSERT": "messages.upsert",
    "MESSAGES_EDITED": "messages.edited",
    "MESSAGES_UPDATE": "messages.update",
    "MESSAGES_DELETE": "messages.delete",
    "SEND_MESSAGE": "send.message",
    "SEND_MESSAGE_UPDATE": "send.message.update",
    "CONTACTS_SET": "contacts.set",
    "CONTACTS_UPSERT": "contacts.upsert",
    "CONTACTS_UPDATE": "contacts.update",
    "PRESENCE_UPDATE": "presence.update",
    "CHATS_SET": "chats.set",
    "CHATS_UPDATE": "chats.update",
    "CHATS_UPSERT": "chats.upsert",
    "CHATS_DELETE": "chats.delete",
    "GROUPS_UPSERT": "groups.upsert",
    "GROUPS_UPDATE": "groups.update",
    "GROUP_PARTICIPANTS_UPDATE": "group-participants.update",
    "CALL": "call",
    "TYPEBOT_START": "typebot.start",
    "TYPEBOT_CHANGE_STATUS": "typebot.change-status",
    "LABELS_EDIT": "labels.edit",
    "LABELS_ASSOCIATION": "labels.association",
    "CREDS_UPDATE": "creds.update",
    "MESSAGING_HISTORY_SET": "messaging-history.set",
    "REMOVE_INSTANCE": "remove.instance",
    "LOGOUT_INSTANCE": "logout.instance",
}

#: Events Evolution can publish to webhooks and RabbitMQ (``creds.update`` stays inside it).
EMITTED_EVENTS: Final[tuple[str, ...]] = tuple(
    sorted(name for name in EVENT_NAMES.values() if name != "creds.update")
)

#: Events identified by content alone (a re-emission is the same event).
MESSAGE_EVENTS: Final[frozenset[str]] = frozenset(
    {
        "messages.upsert",
        "messages.set",
        "messages.update",
        "messages.edited",
        "messages.delete",
        "send.message",
        "send.message.update",
    }
)

#: Events that carry one WhatsApp message, identified by the message and its content.
SINGLE_MESSAGE_EVENTS: Final[frozenset[str]] = frozenset({"messages.upsert", "send.message"})
#: Fields of ``data.message`` that are transport, not content: Evolution adds ``base64`` to
#: webhook bodies only (``webhookBase64``), never to what it stores.
_TRANSPORT_FIELDS: Final = frozenset({"base64"})

_KEY_VERSION: Final = b"evolution-ingest/dedup/v1\n"
_MESSAGE_KEY_VERSION: Final = b"evolution-ingest/dedup/v2/message\n"


class InvalidEvent(ValueError):
    """A body that is not an Evolution event; ``reason`` says why, for a 4xx answer."""

    def __init__(self, reason: str, *, code: str = "not_an_event") -> None:
        super().__init__(reason)
        self.reason = reason
        #: Short, stable name of the reason (kept with the refused body, counted).
        self.code = code


@functools.lru_cache(maxsize=1024)
def normalize_event_name(name: str) -> str:
    """``MESSAGES_UPSERT`` or ``Messages.Upsert`` -> ``messages.upsert``."""
    stripped = name.strip()
    known = EVENT_NAMES.get(stripped.upper())
    if known is not None and "." not in stripped:
        return known
    return stripped.lower()


def canonical_json(value: Any) -> bytes:
    """One byte string per JSON value, whatever its key order or whitespace."""
    return codec.canonical(value)


def message_identity(event: str, instance: str, data: Any) -> dict[str, Any] | None:
    """The identity of a single-message event (see above); None for any other event or shape."""
    if event not in SINGLE_MESSAGE_EVENTS or not isinstance(data, dict):
        return None
    key = data.get("key")
    if not isinstance(key, dict) or not isinstance(key.get("id"), str) or not key["id"]:
        return None
    message = data.get("message")
    if isinstance(message, dict) and not _TRANSPORT_FIELDS.isdisjoint(message):
        message = {k: v for k, v in message.items() if k not in _TRANSPORT_FIELDS}
    return {"event": event, "instance": instance, "id": key["id"], "fromMe": key.get("fromMe") is True,
            "content": message}  # fmt: skip


def legacy_dedup_key(event: str, instance: str, data: Any, date_time: str | None) -> str:
    """The key of version 1: the whole ``data`` (and ``date_time`` outside message events)."""
    name = normalize_event_name(event)
    identity: dict[str, Any] = {"event": name, "instance": instance, "data": data}
    if name not in MESSAGE_EVENTS:
        identity["date_time"] = date_time
    return hashlib.sha256(_KEY_VERSION + canonical_json(identity)).hexdigest()


def dedup_key(event: str, instance: str, data: Any, date_time: str | None) -> str:
    """SHA-256 hex of the canonical identity of one Evolution emission."""
    name = normalize_event_name(event)
    message = message_identity(name, instance, data)
    if message is not None:
        return hashlib.sha256(_MESSAGE_KEY_VERSION + canonical_json(message)).hexdigest()
    return legacy_dedup_key(name, instance, data, date_time)


@dataclass(frozen=True, slots=True)
class Envelope:
    """An Evolution event body checked for shape, with its identity computed."""

    event: str
    instance: str
    data: Any
    date_time: str | None
    dedup_key: str
    #: The body as it is stored and shown: as Evolution sent it, minus the fields this
    #: service adds, and with its secrets redacted (see :mod:`evolution_ingest.core.redaction`).
    body: dict[str, Any]


#: Fields added by this service to forwarded bodies; stripped before storing.
SERVICE_FIELDS: Final[frozenset[str]] = frozenset({"already_saved"})
#: Evolution's errors webhook (``WEBHOOK_EVENTS_ERRORS_WEBHOOK``) reports errors of the server,
#: not of an instance: its body has no ``instance``, which is then stored as "".
ERROR_EVENT: Final = "error"


def parse_envelope(
    body: object,
    redact: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    *,
    key: str | None = None,
) -> Envelope:
    """Check that ``body`` is an Evolution event and compute its identity.

    The key is computed from the body as received — unless ``key`` gives it: the key of
    a saved row, carried by a forward or read from the inbox, names that row whatever its
    stored copy looks like. ``redact`` then makes the copy that is stored. Raises
    :class:`InvalidEvent` with a reason fit for a 4xx answer.
    """
    if not isinstance(body, dict):
        raise InvalidEvent(f"body must be a JSON object, not {_json_type(body)}")
    event = body.get("event")
    instance = body.get("instance")
    if event is None:
        raise InvalidEvent("missing field 'event'")
    if instance is None and event == ERROR_EVENT:
        instance = ""
    elif instance is None:
        raise InvalidEvent("missing field 'instance'")
    if not isinstance(event, str) or not event.strip():
        raise InvalidEvent(f"field 'event' must be a non-empty string, not {_json_type(event)}")
    if not isinstance(instance, str) or not (instance.strip() or event == ERROR_EVENT):
        raise InvalidEvent(f"field 'instance' must be a non-empty string, not {_json_type(instance)}")
    if "data" not in body:
        raise InvalidEvent("missing field 'data'")
    date_time = body.get("date_time")
    if date_time is not None and not isinstance(date_time, str):
        raise InvalidEvent(f"field 'date_time' must be a string, not {_json_type(date_time)}")
    data = body["data"]
    stored = {k: v for k, v in body.items() if k not in SERVICE_FIELDS}
    if key is None:
        key = _identify(event, instance, data, date_time)
    if redact is not None:
        stored = redact(stored)
    return Envelope(
        event=normalize_event_name(event),
        instance=instance,
        data=data,
        date_time=date_time,
        dedup_key=key,
        body=stored,
    )


def _identify(event: str, instance: str, data: Any, date_time: str | None) -> str:
    try:
        return dedup_key(event, instance, data, date_time)
    except codec.JsonRefused as exc:
        raise InvalidEvent(f"field 'data' cannot be identified: {exc.reason}", code=exc.code) from None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
