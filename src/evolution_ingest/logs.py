"""Structured logs: JSON lines by default, readable text on a terminal.

Our own log calls go through structlog directly (cheap when filtered out);
libraries that use the standard ``logging`` module (uvicorn, aio-pika, asyncpg)
are rendered the same way. Values under secret-looking keys are redacted.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Final

import structlog
from structlog.typing import Processor

from evolution_ingest.config import LogFormat
from evolution_ingest.core import codec

_SECRET_KEYS: Final = frozenset(
    {"apikey", "api_key", "authorization", "token", "secret", "password", "internal_secret"}
)


def redact(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in event_dict:
        if key.lower() in _SECRET_KEYS:
            event_dict[key] = "[redacted]"
    return event_dict


def _json(value: Any, **_: Any) -> str:
    return codec.dumps(value, default=repr).decode()


def configure(level: str = "INFO", fmt: LogFormat = LogFormat.AUTO, *, cache: bool = True) -> None:
    """Set up structlog and the stdlib root logger once, at start-up.

    ``cache=False`` keeps loggers reconfigurable (``structlog.testing.capture_logs``).
    """
    text = fmt is LogFormat.TEXT or (fmt is LogFormat.AUTO and sys.stderr.isatty())
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if text
        else structlog.processors.JSONRenderer(serializer=_json)
    )
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact,
    ]
    numeric_level = logging.getLevelName(level)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=cache,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric_level)
    # Warnings of libraries (``warnings.warn``) become log lines too: every line stays one JSON object.
    logging.captureWarnings(True)
    # Per-request lines of the ASGI server would duplicate ours.
    logging.getLogger("uvicorn.access").disabled = True
    # pika narrates every step of a connection at INFO; the worker logs what matters itself.
    logging.getLogger("pika").setLevel(max(numeric_level, logging.WARNING))
