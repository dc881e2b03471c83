"""Business logic: loading the configured handlers and running them in order.

A handler is ``async def handle(event: Event) -> None``. Handlers run one after
the other; an exception from any of them means "not processed" and the event is
tried again later (Evolution's retry, the RabbitMQ retry tiers, the reconciler),
handlers before it included: make them idempotent on ``event.dedup_key``.
The built-in handlers are in :mod:`evolution_ingest.handlers`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from evolution_ingest.config import ENV_PREFIX, ConfigError
from evolution_ingest.core.events import Event

Handler = Callable[[Event], Awaitable[None]]

#: What runs when ``EVOLUTION_INGEST_HANDLERS`` is empty.
DEFAULT_HANDLER: Final = "evolution_ingest.handlers:log_summary"


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
