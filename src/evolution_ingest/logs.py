"""Structured logs: JSON lines by default, readable text on a terminal.

Our own log calls go through structlog directly (cheap when filtered out);
libraries that use the standard ``logging`` module (uvicorn, aio-pika, asyncpg)
are rendered the same way. Values under secret-looking keys are redacted.

Lines logged while an event loop runs are written together at the start of its next turn
(:class:`Lines`): one system call for all the outcome lines of a batch, not one each.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import Any, BinaryIO, Final

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


class _Stamp:
    """The time of the line, in UTC, as ``2026-01-02T03:04:05.678901Z``: structlog's ISO stamp,
    with the date and time of the second made once a second rather than for every line."""

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")

    def __call__(
        self, _logger: Any, _name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        now = time.time()
        whole = int(now)
        second, text = self._second  # one tuple: another thread sees a pair that belongs together
        if second != whole:
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
            self._second = (whole, text)
        event_dict["timestamp"] = f"{text}.{int((now - whole) * 1_000_000):06d}Z"
        return event_dict


def _render(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> bytes:
    """The line as JSON bytes (what ``JSONRenderer`` gives, a call shorter)."""
    return codec.dumps(event_dict, default=repr)


def _render_text(logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
    """The same line as text, for the standard library's formatter."""
    return _render(logger, name, event_dict).decode()


def _as_bytes(line: str) -> bytes:
    return line.encode("utf-8", "backslashreplace")


def _encode(_logger: Any, _name: str, line: Any) -> bytes:
    """The text renderer's line as bytes, for :class:`Lines`."""
    return _as_bytes(str(line))


class Lines:
    """Where log lines go: a binary file (stderr) that gets each event loop turn's lines at once.

    A line logged on a thread that runs an event loop is kept until that loop starts its next
    turn, then written with every other line of the turn in one write; a line logged anywhere
    else (start-up, a one-shot command, another thread) is written at once. More than ``most``
    lines waiting are written at once too, and what is left at exit is written then. It is
    structlog's logger itself (:meth:`msg`), and the standard library's handler writes to it too:
    the ``flush`` after each line decides which.
    """

    def __init__(self, out: BinaryIO, *, most: int = 512) -> None:
        self._out = out
        self._most = most
        self._lines: list[bytes] = []
        #: The loop a write is scheduled on, None when none is.
        self._scheduled: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def msg(self, message: bytes) -> None:
        """A rendered line, without its newline: structlog's logger, whatever the level, and the
        standard library's handler both write here."""
        with self._lock:
            self._lines.append(message + b"\n")
        self.flush()

    log = debug = info = warn = warning = fatal = failure = err = error = critical = exception = msg

    def flush(self) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or len(self._lines) >= self._most:
            self.write_out()
        elif self._scheduled is not loop:
            self._scheduled = loop
            loop.call_soon(self.write_out)

    def write_out(self) -> None:
        """Write every line waiting, now."""
        with self._lock:
            lines, self._lines, self._scheduled = self._lines, [], None
        if not lines:
            return
        try:
            self._out.write(b"".join(lines))
            self._out.flush()
        except (OSError, ValueError):  # stderr closed or gone: nowhere left to say so
            pass


class _Handler(logging.Handler):
    """The standard library's records, formatted, into the same :class:`Lines`."""

    def __init__(self, lines: Lines) -> None:
        super().__init__()
        self._lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.msg(_as_bytes(self.format(record)))
        except Exception:  # as logging.StreamHandler: a record that cannot be formatted is reported
            self.handleError(record)


#: The lines of the last :func:`configure` (written out at exit, and when it is configured again).
_configured: list[Lines] = []


@atexit.register
def _write_out() -> None:
    for lines in _configured:
        lines.write_out()


def configure(level: str = "INFO", fmt: LogFormat = LogFormat.AUTO, *, cache: bool = True) -> None:
    """Set up structlog and the stdlib root logger once, at start-up.

    ``cache=False`` keeps loggers reconfigurable (``structlog.testing.capture_logs``).
    """
    text = fmt is LogFormat.TEXT or (fmt is LogFormat.AUTO and sys.stderr.isatty())
    renderer: Processor
    to_bytes: list[Processor]
    if text:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        to_bytes = [renderer, _encode]
    else:
        renderer = _render_text
        to_bytes = [_render]
    _write_out()
    lines = Lines(sys.stderr.buffer)
    _configured[:] = [lines]
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _Stamp(),
        redact,
    ]
    numeric_level = logging.getLevelName(level)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, *to_bytes],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=lambda *_: lines,
        cache_logger_on_first_use=cache,
    )
    handler = _Handler(lines)
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
