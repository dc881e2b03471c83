"""Reading an Evolution body, on either channel: size and shape limits, then JSON."""

from __future__ import annotations

from typing import Any

import orjson


class BodyRejected(Exception):
    """A body refused before it is an event; ``status`` is the HTTP answer it deserves."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


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
        raise BodyRejected(413, f"body larger than {max_bytes} bytes")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyRejected(400, f"malformed JSON: {exc}") from None
    # Every key is followed by a colon, so few colons means few keys: skip the walk.
    if raw.count(b":") > max_keys and count_keys(body, max_keys) > max_keys:
        raise BodyRejected(413, f"more than {max_keys} keys in the body")
    return body
