"""Reading an Evolution body, on either channel: size and shape limits, then JSON."""

from __future__ import annotations

from typing import Any

from evolution_ingest.core import codec


class BodyRejected(Exception):
    """A body refused before it is an event; ``status`` is the HTTP answer it deserves.

    Evolution does not retry 400, 401, 403, 404 and 422, and retries everything else: a body
    that can never be accepted gets one of those, so that it is not sent again for 20 minutes.
    """

    def __init__(self, status: int, reason: str, code: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        #: Short, stable name of the reason (kept with the refused body, counted).
        self.code = code


def too_large(max_bytes: int) -> BodyRejected:
    return BodyRejected(
        422, f"body larger than {max_bytes} bytes (EVOLUTION_INGEST_MAX_BODY_BYTES)", "too_large"
    )


def count_keys(value: Any, limit: int) -> int:
    """Object keys in a parsed JSON value; counting stops just past ``limit``."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, dict):
            total += len(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def load_body(raw: bytes, *, max_bytes: int, max_keys: int) -> Any:
    """Parse ``raw`` as JSON within the limits, or raise :class:`BodyRejected`."""
    if len(raw) > max_bytes:
        raise too_large(max_bytes)
    try:
        body = codec.loads(raw)
    except codec.JsonRefused as exc:
        raise BodyRejected(400, exc.reason, exc.code) from None
    # Every key is followed by a colon, so few colons means few keys: skip the walk.
    if raw.count(b":") > max_keys and count_keys(body, max_keys) > max_keys:
        raise BodyRejected(
            422, f"more than {max_keys} keys in the body (EVOLUTION_INGEST_MAX_JSON_KEYS)", "too_many_keys"
        )
    return body
