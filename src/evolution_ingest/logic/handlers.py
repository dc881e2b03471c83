"""The built-in handlers (public as :mod:`evolution_ingest.handlers`, the names ``HANDLERS`` takes).

They never log a message's text or the ``apikey`` unless the operator opts in
(:func:`log_with_text`).
"""

from __future__ import annotations

import structlog

from evolution_ingest.core.events import Event

log = structlog.get_logger("evolution_ingest.events")


async def log_summary(event: Event) -> None:
    """The built-in handler: one log line per event, without its content or apikey."""
    _log_event(event)


def _log_event(event: Event, **extra: object) -> None:
    log.info(
        "event",
        event_name=event.event,
        instance=event.instance,
        dedup_key=event.dedup_key,
        channel=event.channel.value,
        summary=summarize(event),
        **extra,
    )


async def log_with_text(event: Event) -> None:
    """Like :func:`log_summary`, plus the text of a message: the operator's opt-in.

    Set ``EVOLUTION_INGEST_HANDLERS=evolution_ingest.handlers:log_with_text``. The ``apikey``
    is never logged, whatever the handler.
    """
    _log_event(event, text=message_text(event))


def message_text(event: Event) -> str | None:
    """The text (or caption) of a message event, if it has one."""
    data = event.data
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict):
        return None
    if isinstance(message.get("conversation"), str):
        return str(message["conversation"])
    for kind, field in (
        ("extendedTextMessage", "text"),
        ("imageMessage", "caption"),
        ("videoMessage", "caption"),
        ("documentMessage", "caption"),
    ):
        inner = message.get(kind)
        if isinstance(inner, dict) and isinstance(inner.get(field), str):
            return str(inner[field])
    return None


async def noop(event: Event) -> None:
    """Does nothing: keep the inbox only, or measure the service itself (benchmarks)."""


def summarize(event: Event) -> str:
    """A short description of what happened, never the text of a message."""
    data = event.data
    if isinstance(data, list):
        return f"{len(data)} item(s)"
    if not isinstance(data, dict):
        return type(data).__name__
    key = data.get("key") if isinstance(data.get("key"), dict) else data
    assert isinstance(key, dict)
    parts = []
    for name in ("messageType", "state", "status", "action"):
        value = data.get(name)
        if isinstance(value, (str, int)):
            parts.append(f"{name}={value}")
    remote = key.get("remoteJid") or data.get("id")
    if isinstance(remote, str):
        parts.append(f"chat={remote}")
    if isinstance(key.get("fromMe"), bool):
        parts.append(f"fromMe={str(key['fromMe']).lower()}")
    return " ".join(parts) or "-"
