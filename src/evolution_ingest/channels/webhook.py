"""The webhook app: parse a call, hand it to the ingestion core, map the outcome to HTTP.

(Its routes and the ASGI app are in :mod:`evolution_ingest.channels.http`.) Status codes (Evolution retries everything but 400, 401, 403, 404 and 422): 200
processed or skipped (with the reason); 400 malformed JSON or not an Evolution event;
401 refused (no or wrong credentials); 422 an event that can never be accepted (too
large, too many keys, nested too deeply, a row Postgres cannot store); 409 a forward
for an event with no inbox row; 500 a handler failed (the event stays saved and will
be retried); 503 Postgres unreachable, with ``Retry-After``. A batch of forwards
(:mod:`evolution_ingest.channels.batched`) is answered 200 with a line per entry, each the
status and body that entry would have had alone. Every 4xx but 409 keeps
the refused body (:mod:`evolution_ingest.stores.refusals`) before it is answered: when that
cannot be written, the answer is 503 so that Evolution sends the body again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.types import Scope

from evolution_ingest.channels.answers import Answer, JsonAnswer, StreamedForwards, answer_for
from evolution_ingest.channels.auth import (
    DEDUP_KEY_HEADER,
    INTERNAL_SECRET_HEADER,
    EvolutionAuth,
    internal_refusal,
)
from evolution_ingest.channels.batched import BATCH_HEADER, FORWARDS_TYPE, parse_forwards
from evolution_ingest.config import Settings
from evolution_ingest.core import codec
from evolution_ingest.core.body import BodyRejected, load_body, too_large
from evolution_ingest.core.contract import Outcome, Receive, Result, RunSaved
from evolution_ingest.core.identity import Envelope, InvalidEvent
from evolution_ingest.core.ingestion import INTERNAL, Ingestion
from evolution_ingest.stores.evolution import INSTANCE_ID_HEADER, SOURCE_HEADER, webhook_path
from evolution_ingest.stores.postgres import StoreUnavailable
from evolution_ingest.stores.refusals import Refusal, RefusalLog

log = structlog.get_logger(__name__)

WEBHOOK_PATH: Final = "/api/internal/webhook"
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_CHANNEL: Final = "webhook"


#: Codes of bodies that parse and are events, but can never be accepted: 422.
_UNACCEPTABLE: Final = frozenset({"too_deep", "unstorable"})
#: The headers every call is read for, found in one pass over the ASGI scope's list (auth, when
#: on, reads the headers it needs itself).
_WANTED: Final = frozenset(
    name.encode() for name in ("content-length", "content-type", INTERNAL_SECRET_HEADER, DEDUP_KEY_HEADER, INSTANCE_ID_HEADER,
                               SOURCE_HEADER)
)  # fmt: skip


def _headers(scope: Scope) -> dict[str, str]:
    """The headers of :data:`_WANTED` a call carries (ASGI servers give names in lower case)."""
    return {
        name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"] if name in _WANTED
    }


class _Refused(Exception):
    """A call answered with a 4xx; ``counter`` says which counter it moves."""

    def __init__(
        self, status: int, reason: str, code: str, counter: str = f"{_CHANNEL}:rejected", raw: bytes = b""
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.code = code
        self.counter = counter
        #: The body as received (its first REFUSAL_MAX_BYTES when it was too large).
        self.raw = raw


@dataclass(frozen=True, slots=True)
class _Call:
    envelope: Envelope
    internal: bool
    #: Evolution's webhook that made the call (``instance`` or ``global``); None for a forward.
    path: str | None = None
    #: ``X-Instance-ID`` (Evolution 2.4 instance webhooks), logged with the outcome.
    instance_id: str | None = None


def _is_forward(body: Any) -> bool:
    """A forward from the worker or the reconciler says ``already_saved: true``."""
    if not isinstance(body, dict) or "already_saved" not in body:
        return False
    if not isinstance(body["already_saved"], bool):
        raise _Refused(400, "field 'already_saved' must be a boolean", "bad_forward")
    return body["already_saved"]


def _forward_key(key: str | None) -> str | None:
    """A forward names its inbox row (trusted: the secret authenticates the caller)."""
    if key is not None and not _HEX64.fullmatch(key):
        raise _Refused(400, f"{DEDUP_KEY_HEADER} must be 64 lowercase hex characters", "bad_forward")
    return key


class WebhookApp:
    """Request handling, with its resources passed in."""

    def __init__(self, ingestion: Ingestion, settings: Settings, refusals: RefusalLog) -> None:
        self._ingestion = ingestion
        self._counters = ingestion.counters
        self._refusals = refusals
        self._redact_url = ingestion.redactor.url
        self._keep_bytes = settings.refusal_max_bytes
        self._auth = EvolutionAuth(settings)
        self._secret = settings.internal_secret.get_secret_value() if settings.internal_secret else None
        self._max_body = settings.max_body_bytes
        self._max_keys = settings.max_json_keys
        self._retry_after = str(settings.retry_after_seconds)
        self._outcome_level = "info" if settings.log_outcomes else "debug"
        level = logging.INFO if settings.log_outcomes else logging.DEBUG
        #: Whether outcome lines pass the log level: when not, not even their fields are built.
        self._log_outcomes = logging.getLevelName(settings.log_level.upper()) <= level
        #: Entries of batched forwards still running.
        self._running: set[asyncio.Task[Any]] = set()

    async def receive(self, request: Request) -> Answer:
        """Answer one call: an event, a forward, or a batch of forwards (streamed)."""
        headers = _headers(request.scope)
        if headers.get("content-type") == FORWARDS_TYPE:
            return await self._forwards(request, headers)
        return await self._guarded(request, headers, None)

    async def _guarded(self, request: Request, headers: Mapping[str, str], raw: bytes | None) -> JsonAnswer:
        try:
            return await self._receive(request, headers, raw)
        except Exception:  # the edge: log with the traceback, count, answer 5xx (Evolution retries)
            self._counters.incr(f"{_CHANNEL}:errors")
            log.exception("unexpected error while ingesting", path=self._redact_url(request.url.path))
            return JsonAnswer(500, {"error": "internal error; the event was not acknowledged"})

    async def _receive(self, request: Request, headers: Mapping[str, str], body: bytes | None) -> JsonAnswer:
        """One call; ``body``: one entry of a batch of forwards (read already, a forward only)."""
        started = time.perf_counter()
        channel = _CHANNEL
        raw = body or b""
        try:
            if body is None:
                raw = await self._body(request, headers)
            call = self._read(request, raw, headers, forward_only=body is not None)
            channel = INTERNAL if call.internal else _CHANNEL
            result = await self._ingestion.ingest(
                RunSaved(call.envelope) if call.internal else Receive(call.envelope)
            )
            if result.outcome is Outcome.REFUSED:
                raise _Refused(422, result.error or "refused", result.code or "unstorable", raw=raw)
            if call.path is not None:
                self._counters.webhook_path(codec.label(call.envelope.instance), call.path)
        except _Refused as refused:
            return await self._refuse(refused, request, raw or refused.raw)
        except StoreUnavailable as exc:
            return self._unavailable(channel, exc)
        except ClientDisconnect:
            return JsonAnswer(400, {"error": "the client went away"})
        elapsed = time.perf_counter() - started
        self._counters.observe("webhook_seconds", elapsed)
        if self._log_outcomes:
            self._log_outcome(call, result, channel, elapsed)
        return answer_for(result)

    async def _forwards(self, request: Request, headers: Mapping[str, str]) -> Answer:
        """A batch of forwards (:mod:`~evolution_ingest.channels.batched`): each entry runs as if
        it had come alone, and is answered as soon as it has ended."""
        try:
            answer = await self._batch(request, headers)
        except Exception:  # the edge, as for one call: nothing of the batch was run
            self._counters.incr(f"{_CHANNEL}:errors")
            log.exception("unexpected error while reading a batch of forwards")
            answer = JsonAnswer(500, {"error": "internal error; the forwards were not acknowledged"})
        if isinstance(answer, JsonAnswer):  # refused whole: the forwarder knows it was read as a batch
            answer.headers.append((BATCH_HEADER.encode(), b"1"))
        return answer

    async def _batch(self, request: Request, headers: Mapping[str, str]) -> Answer:
        raw = b""
        try:
            raw = await self._body(request, headers)
            refusal = internal_refusal(self._secret, headers.get(INTERNAL_SECRET_HEADER))
            if refusal:
                raise _Refused(401, refusal, "unauthorized", f"{INTERNAL}:unauthorized")
            entries = parse_forwards(raw)
            if not entries:
                raise _Refused(400, "an empty batch of forwards", "bad_forward")
        except _Refused as refused:
            return await self._refuse(refused, request, raw or refused.raw)
        except ClientDisconnect:
            return JsonAnswer(400, {"error": "the client went away"})
        return StreamedForwards(
            [self._entry(request, headers, key, body) for key, body in entries], self._running
        )

    async def _entry(
        self, request: Request, headers: Mapping[str, str], key: str | None, body: bytes
    ) -> JsonAnswer:
        if key is None:  # a line that is not "<key> <body>": this entry alone is refused
            return await self._refuse(
                _Refused(400, "a batched forward is '<dedup key> <JSON body>'", "bad_forward"), request, body
            )
        return await self._guarded(request, {**headers, DEDUP_KEY_HEADER: key}, body)

    def _log_outcome(self, call: _Call, result: Result, channel: str, elapsed: float) -> None:
        getattr(log, self._outcome_level)(
            "outcome",
            outcome=result.outcome.value,
            event_name=call.envelope.event,
            instance=call.envelope.instance,
            dedup_key=result.dedup_key,
            channel=channel,
            duration_ms=round(elapsed * 1000, 2),
            **({"instance_id": call.instance_id} if call.instance_id else {}),
        )

    def _unavailable(self, channel: str, exc: StoreUnavailable) -> JsonAnswer:
        self._counters.incr(f"{channel}:unavailable")
        log.warning("answering 503, Postgres unavailable", error=str(exc))
        return JsonAnswer(
            503, {"error": "Postgres unavailable; retry later"}, {"Retry-After": self._retry_after}
        )

    async def _refuse(self, refused: _Refused, request: Request, raw: bytes) -> JsonAnswer:
        """Keep the refused body, then answer the 4xx; 503 if it cannot be kept (Evolution retries)."""
        path = self._redact_url(request.url.path)
        try:
            refusal_id = await self._refusals.record(
                Refusal(_CHANNEL, refused.code, refused.reason, raw, refused.status, path)
            )
        except StoreUnavailable as exc:
            log.warning("refusal not recorded; answering 503 so the body comes back", reason=refused.reason)
            return self._unavailable(_CHANNEL, exc)
        self._counters.incr(refused.counter)
        level = log.warning if refused.status in {401, 422} else log.info
        level(
            "call refused", status=refused.status, code=refused.code, reason=refused.reason, path=path,
            refusal_id=refusal_id,
        )  # fmt: skip
        return JsonAnswer(
            refused.status, {"error": refused.reason, "code": refused.code, "refusal_id": refusal_id}
        )

    def _read(
        self, request: Request, raw: bytes, headers: Mapping[str, str], *, forward_only: bool = False
    ) -> _Call:
        try:
            body = load_body(raw, max_bytes=self._max_body, max_keys=self._max_keys)
        except BodyRejected as exc:
            raise _Refused(exc.status, exc.reason, exc.code) from None
        internal = _is_forward(body)
        if forward_only and not internal:
            raise _Refused(
                400, "a batch of forwards holds forwards only (already_saved: true)", "bad_forward"
            )
        if internal:
            refusal = internal_refusal(self._secret, headers.get(INTERNAL_SECRET_HEADER))
            if refusal:
                raise _Refused(401, refusal, "unauthorized", f"{INTERNAL}:unauthorized")
        key = _forward_key(headers.get(DEDUP_KEY_HEADER)) if internal else None
        try:
            envelope = self._ingestion.envelope(body, dedup_key=key)
        except InvalidEvent as exc:
            raise _Refused(422 if exc.code in _UNACCEPTABLE else 400, exc.reason, exc.code) from None
        if internal:
            return _Call(envelope, internal=True)
        if self._auth.enabled:
            refusal = self._auth.refusal(
                headers=request.headers,
                url_token=request.path_params.get("token") or request.query_params.get("token"),
                body=body,
            )
            if refusal:
                raise _Refused(401, refusal, "unauthorized", f"{_CHANNEL}:unauthorized")
        instance_id = headers.get(INSTANCE_ID_HEADER)
        return _Call(
            envelope,
            internal=False,
            path=webhook_path(headers),
            instance_id=codec.label(instance_id[:100]) if instance_id else None,
        )

    async def _too_large(self, request: Request, chunks: list[bytes]) -> _Refused:
        """Refuse a body over the limit, keeping (up to REFUSAL_MAX_BYTES of) it for the operator."""
        kept = b"".join(chunks)
        while len(kept) <= self._keep_bytes:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
            kept += message.get("body", b"")
            if not message.get("more_body", False):
                break
        rejected = too_large(self._max_body)
        return _Refused(rejected.status, rejected.reason, rejected.code, raw=kept[: self._keep_bytes + 1])

    async def _body(self, request: Request, headers: Mapping[str, str]) -> bytes:
        """The raw body, read within the size limit (declared or streamed).

        Read straight from the ASGI channel: this runs for every event.
        """
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body:
            raise await self._too_large(request, [])
        chunks = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self._max_body:
                raise await self._too_large(request, chunks)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
