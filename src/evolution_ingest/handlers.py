"""Business logic: loading the configured handlers and running them in order.

A handler is ``async def handle(event: Event) -> None``. Handlers run one after
the other; an exception from any of them means "not processed" and the event is
tried again later (Evolution's retry, the RabbitMQ retry tiers, the reconciler),
handlers before it included: make them idempotent on ``event.dedup_key``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import structlog

from evolution_ingest.config import ENV_PREFIX, ConfigError
from evolution_ingest.events import Event

Handler = Callable[[Event], Awaitable[None]]

log = structlog.get_logger("evolution_ingest.events")

#: What runs when ``EVOLUTION_INGEST_HANDLERS`` is empty.
DEFAULT_HANDLER: Final = "evolution_ingest.handlers:log_summary"


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


def load_handler(spec: str) -> Handler:
    """Import ``package.module:function``; a clear :class:`ConfigError` if that fails."""
    setting = f"{ENV_PREFIX}HANDLERS"
    module_name, _, attr_path = spec.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{setting}: cannot import {module_name!r} for {spec!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise ConfigError(f"{setting}: {module_name!r} has no {attr_path!r} ({spec!r})") from None
    if not callable(target) or not (
        inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))  # noqa: B004 - async callables
    ):
        raise ConfigError(f"{setting}: {spec!r} is not an async function (async def handle(event))")
    return target


class HandlerPipeline:
    """The handlers to run for each event, in order."""

    def __init__(self, handlers: Sequence[Handler]) -> None:
        self._handlers = tuple(handlers)

    @classmethod
    def from_specs(cls, specs: Sequence[str], *, default: bool = True) -> HandlerPipeline:
        """The handlers named; with none, the built-in log line (unless ``default`` is false)."""
        return cls([load_handler(spec) for spec in (specs or ([DEFAULT_HANDLER] if default else []))])

    def before(self, handler: Handler) -> HandlerPipeline:
        """A pipeline running ``handler`` first, then these."""
        return HandlerPipeline([handler, *self._handlers])

    def __len__(self) -> int:
        return len(self._handlers)

    async def run(self, event: Event) -> None:
        for handler in self._handlers:
            await handler(event)
