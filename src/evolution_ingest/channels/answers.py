"""The webhook app's answers: a JSON body per call, or a batch of forwards' lines as they end."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine, Mapping
from typing import Any

from starlette.types import Receive, Scope, Send

from evolution_ingest.channels.auth import OUTCOME_HEADER
from evolution_ingest.channels.batched import ANSWERS_TYPE, BATCH_HEADER, answer_line
from evolution_ingest.core import codec
from evolution_ingest.core.contract import Outcome, Result


class JsonAnswer:
    """A JSON response as two ASGI messages: built for every event, so kept minimal."""

    __slots__ = ("body", "headers", "outcome", "status")

    def __init__(
        self, status: int, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        self.status = status
        self.body = codec.dumps(payload)
        #: The core's outcome, when the answer says it (:data:`OUTCOME_HEADER`).
        self.outcome = headers.get(OUTCOME_HEADER) if headers else None
        self.headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.body)).encode()),
            *((name.lower().encode(), value.encode()) for name, value in (headers or {}).items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class StreamedForwards:
    """The answer to a batch of forwards: a line per entry, sent as soon as the entry has ended
    (the entries that end in one turn of the event loop go in one chunk)."""

    def __init__(
        self, entries: list[Coroutine[Any, Any, JsonAnswer]], running: set[asyncio.Task[Any]]
    ) -> None:
        loop = asyncio.get_running_loop()
        self._ready: list[bytes] = []
        self._woken = asyncio.Event()
        self._left = len(entries)
        for index, entry in enumerate(entries):
            # Held by the app, not by this answer: an entry runs to its end even if the caller goes.
            task = loop.create_task(entry)
            running.add(task)
            task.add_done_callback(running.discard)
            task.add_done_callback(functools.partial(self._ended, index))

    def _ended(self, index: int, task: asyncio.Task[JsonAnswer]) -> None:
        if task.cancelled() or task.exception() is not None:  # stopped while running: not acknowledged
            line = answer_line(
                index, 503, None, b'{"error":"the webhook app stopped before this forward ended"}'
            )
        else:
            answer = task.result()
            line = answer_line(index, answer.status, answer.outcome, answer.body)
        self._ready.append(line)
        self._left -= 1
        self._woken.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", ANSWERS_TYPE.encode()), (BATCH_HEADER.encode(), b"1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        more = True
        while more:
            await self._woken.wait()
            self._woken.clear()
            lines, self._ready = self._ready, []
            more = self._left > 0
            await send({"type": "http.response.body", "body": b"".join(lines), "more_body": more})


#: What the webhook app answers a call with.
Answer = JsonAnswer | StreamedForwards


def answer_for(result: Result) -> JsonAnswer:
    """The HTTP answer of a result; its outcome also in a header, for the forwarder."""
    key = result.dedup_key
    said = {OUTCOME_HEADER: result.outcome.value}
    match result.outcome:
        case Outcome.PROCESSED:
            return JsonAnswer(200, {"status": "processed", "dedup_key": key}, said)
        case Outcome.DUPLICATE | Outcome.LOCKED:
            return JsonAnswer(
                200, {"status": "skipped", "reason": result.outcome.value, "dedup_key": key}, said
            )
        case Outcome.FAILED:
            failed = {
                "status": "failed",
                "error": "business logic failed; the event is saved and will be retried",
                "detail": (result.error or "")[:500],
                "dedup_key": key,
            }
            return JsonAnswer(500, failed, said)
        case Outcome.NOT_FOUND:
            missing = {
                "error": "no inbox row for this event: a forward must follow a save",
                "dedup_key": key,
            }
            return JsonAnswer(409, missing, said)
        case _:  # a Receive or a RunSaved answers nothing else
            raise AssertionError(f"unexpected outcome {result.outcome}")
