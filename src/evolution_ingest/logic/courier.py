"""Sending events to the routes' destinations over HTTP, and what their answers mean.

2xx is delivered; 408, 429, 5xx, a timeout or a refused connection is a failure to
retry; any other 4xx (and a redirect) is permanent: recorded, counted and shown,
never retried (see :mod:`evolution_ingest.stores.deliveries`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from evolution_ingest.core import codec
from evolution_ingest.stores.deliveries import DeliveryResult, DeliveryStatus


def classify(status: int) -> DeliveryStatus:
    if 200 <= status < 300:
        return DeliveryStatus.DELIVERED
    if status in {408, 429} or status >= 500:
        return DeliveryStatus.FAILED
    return DeliveryStatus.PERMANENT


class Courier:
    """Sends JSON over HTTP with one shared aiohttp session (no redirects followed)."""

    def __init__(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=100),
            headers={"user-agent": "evolution-ingest"},
        )

    async def send(
        self,
        destination: str,
        url: str,
        body: Mapping[str, Any],
        *,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        timeout_seconds: float = 10.0,
    ) -> DeliveryResult:
        try:
            async with self._session.request(
                method,
                url,
                data=codec.dumps(body),
                headers={"content-type": "application/json", **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=timeout_seconds),
                allow_redirects=False,
            ) as response:
                text = (await response.read())[:300].decode(errors="replace")
                status = classify(response.status)
                error = None if status is DeliveryStatus.DELIVERED else f"HTTP {response.status}: {text}"
                return DeliveryResult(destination, status, response.status, error)
        except TimeoutError:
            return DeliveryResult(
                destination, DeliveryStatus.FAILED, None, f"timeout after {timeout_seconds}s"
            )
        except (aiohttp.ClientError, OSError) as exc:
            return DeliveryResult(destination, DeliveryStatus.FAILED, None, f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        await self._session.close()
