"""Forwards of saved events to the webhook app (``already_saved: true`` + the internal secret).

Used by the worker and the reconciler. The answer is classified once, here:
``processed`` or ``duplicate`` mean done; ``locked`` means someone else is on it;
anything else (a non-2xx, a timeout, a refused connection) is a failure to retry.

Between processes the forward is HTTP (:class:`HttpForwarder`). When the worker
runs in the same process as the webhook app (``up``), :class:`InProcessForwarder`
calls the same code the webhook app runs for a forward — claim, business logic,
outcomes, ``internal:*`` counters — without the HTTP round trip.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from evolution_ingest.channels.auth import DEDUP_KEY_HEADER, INTERNAL_SECRET_HEADER
from evolution_ingest.core import codec
from evolution_ingest.core.identity import Envelope
from evolution_ingest.core.ingestion import Ingestion, Outcome
from evolution_ingest.stores.inbox import StoreUnavailable


class Delivery(enum.StrEnum):
    DONE = "done"
    LOCKED = "locked"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ForwardResult:
    delivery: Delivery
    #: HTTP status, when there was an answer.
    status: int | None = None
    #: Why it failed, for logs, headers and ``last_error``.
    error: str | None = None


class Forwarder(Protocol):
    async def forward(self, envelope: Envelope) -> ForwardResult: ...

    async def close(self) -> None: ...


def classify(status: int, answer: Any) -> ForwardResult:
    """Map the webhook app's answer to what the sender should do."""
    if status == 200 and isinstance(answer, dict):
        if answer.get("status") == "processed" or answer.get("reason") == "duplicate":
            return ForwardResult(Delivery.DONE, status)
        if answer.get("reason") == "locked":
            return ForwardResult(Delivery.LOCKED, status)
    detail = answer.get("detail") or answer.get("error") if isinstance(answer, dict) else None
    return ForwardResult(Delivery.FAILED, status, f"HTTP {status}: {detail or answer!r}"[:1000])


class HttpForwarder:
    """POSTs forwards over HTTP with aiohttp (fast under concurrency), one shared session."""

    def __init__(self, url: str, secret: str, *, timeout: float, concurrency: int = 64) -> None:
        self._url = url
        self._headers = {"content-type": "application/json", INTERNAL_SECRET_HEADER: secret}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, force_close=False),
            timeout=self._timeout,
            skip_auto_headers=("User-Agent",),
        )

    @property
    def url(self) -> str:
        return self._url

    async def forward(self, envelope: Envelope) -> ForwardResult:
        """Send a saved event (its body, and its inbox row's key) to the webhook app."""
        payload = codec.dumps({**envelope.body, "already_saved": True})
        headers = {**self._headers, DEDUP_KEY_HEADER: envelope.dedup_key}
        try:
            async with self._session.post(self._url, data=payload, headers=headers) as response:
                raw = await response.read()
                status = response.status
        except TimeoutError:
            return ForwardResult(Delivery.FAILED, None, f"timeout after {self._timeout.total}s")
        except (aiohttp.ClientError, OSError) as exc:
            return ForwardResult(Delivery.FAILED, None, f"{type(exc).__name__}: {exc}"[:1000])
        try:
            answer = codec.loads(raw)
        except codec.JsonRefused:
            answer = raw[:200].decode(errors="replace")
        return classify(status, answer)

    async def close(self) -> None:
        await self._session.close()
        # Let aiohttp's connector finish closing its transports.
        await asyncio.sleep(0)


class InProcessForwarder:
    """The forward of ``up``: :meth:`Ingestion.process_saved` called directly (no HTTP hop)."""

    def __init__(self, ingestion: Ingestion) -> None:
        self._ingestion = ingestion

    async def forward(self, envelope: Envelope) -> ForwardResult:
        try:
            result = await self._ingestion.process_saved(envelope)
        except StoreUnavailable as exc:
            return ForwardResult(Delivery.FAILED, 503, str(exc))
        match result.outcome:
            case Outcome.PROCESSED | Outcome.DUPLICATE:
                return ForwardResult(Delivery.DONE, 200)
            case Outcome.LOCKED:
                return ForwardResult(Delivery.LOCKED, 200)
            case Outcome.FAILED:
                return ForwardResult(Delivery.FAILED, 500, f"HTTP 500: {result.error}")
            case _:
                return ForwardResult(Delivery.FAILED, 409, "HTTP 409: no inbox row for this event")

    async def close(self) -> None:
        return None
