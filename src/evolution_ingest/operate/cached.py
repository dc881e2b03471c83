"""The last value of an async read, reused for a while: what ``/metrics``, ``/readyz`` and the dashboard share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class Cached:
    """The last value of an async read, reused for ``ttl`` seconds; one read at a time."""

    def __init__(self, read: Callable[[], Awaitable[Any]], ttl: float) -> None:
        self._read = read
        self._ttl = ttl
        self._value: Any = None
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    async def get(self) -> Any:
        async with self._lock:
            if time.monotonic() - self._at >= self._ttl:
                self._value = await self._read()
                self._at = time.monotonic()
            return self._value
