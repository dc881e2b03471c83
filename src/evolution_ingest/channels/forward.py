"""Forwards of saved events to the webhook app (``already_saved: true`` + the internal secret).

Used by processes that do not serve the webhook app themselves (``worker``, ``reconcile``,
``replay``): the core calls :meth:`HttpForwarder.forward` while it holds the event's
lock. The webhook app says what came of a forward in the header
``x-evolution-ingest-outcome`` (the core's own outcome), so the answer is read, not
guessed; an answer without it (a 503, a proxy's error, a timeout, a refused
connection) means the webhook app was not reached.
"""

from __future__ import annotations

import asyncio

import aiohttp

from evolution_ingest.channels.auth import DEDUP_KEY_HEADER, INTERNAL_SECRET_HEADER, OUTCOME_HEADER
from evolution_ingest.core import codec
from evolution_ingest.core.contract import Outcome, Result
from evolution_ingest.core.identity import Envelope

_OUTCOMES = {outcome.value: outcome for outcome in Outcome}


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

    async def forward(self, envelope: Envelope) -> Result:
        """Send a saved event (its body, and its inbox row's key) to the webhook app."""
        key = envelope.dedup_key
        payload = codec.dumps({**envelope.body, "already_saved": True})
        headers = {**self._headers, DEDUP_KEY_HEADER: key}
        try:
            async with self._session.post(self._url, data=payload, headers=headers) as response:
                raw = await response.read()
                outcome = _OUTCOMES.get(response.headers.get(OUTCOME_HEADER, ""))
                status = response.status
        except TimeoutError:
            return Result(Outcome.UNREACHABLE, key, error=f"timeout after {self._timeout.total}s")
        except (aiohttp.ClientError, OSError) as exc:
            return Result(Outcome.UNREACHABLE, key, error=f"{type(exc).__name__}: {exc}"[:1000])
        if outcome in {Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.LOCKED}:
            return Result(outcome, key)
        return Result(outcome or Outcome.UNREACHABLE, key, error=f"HTTP {status}: {_detail(raw)}"[:1000])

    async def close(self) -> None:
        await self._session.close()
        # Let aiohttp's connector finish closing its transports.
        await asyncio.sleep(0)


def _detail(raw: bytes) -> str:
    """What a failed answer says, for ``last_error`` and the retry headers."""
    try:
        answer = codec.loads(raw)
    except codec.JsonRefused:
        return repr(raw[:200].decode(errors="replace"))
    if isinstance(answer, dict):
        return str(answer.get("detail") or answer.get("error") or answer)
    return repr(answer)
