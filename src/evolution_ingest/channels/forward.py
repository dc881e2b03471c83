"""Forwards of saved events to the webhook app (``already_saved: true`` + the internal secret).

Used by processes that do not serve the webhook app themselves (``worker``, ``reconcile``,
``replay``): the core calls :meth:`HttpForwarder.forward` while it holds the event's
lock. The webhook app says what came of a forward in the header
``x-evolution-ingest-outcome`` (the core's own outcome), so the answer is read, not
guessed; an answer without it (a 503, a proxy's error, a timeout, a refused
connection) means the webhook app was not reached. Forwards made together go in one
request (:mod:`evolution_ingest.channels.batched`), each answered as it ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import structlog

from evolution_ingest.channels.auth import DEDUP_KEY_HEADER, INTERNAL_SECRET_HEADER, OUTCOME_HEADER
from evolution_ingest.channels.batched import BATCH_HEADER, FORWARDS_TYPE, forward_line, read_answer_line
from evolution_ingest.core import codec
from evolution_ingest.core.contract import Outcome, Result
from evolution_ingest.core.identity import Envelope

log = structlog.get_logger(__name__)

_OUTCOMES = {outcome.value: outcome for outcome in Outcome}


#: Lines of one batch at most (a larger forward goes alone).
FORWARD_BATCH_BYTES: Final = 1024 * 1024
#: Answers to a batch after which its entries are sent again one by one (an older webhook app
#: does not take batches; a batch too large for the app's MAX_BODY_BYTES).
_ONE_BY_ONE: Final = frozenset({400, 404, 405, 413, 415, 422})


class HttpForwarder:
    """POSTs forwards over HTTP with aiohttp (fast under concurrency), one shared session.

    The forwards made in one turn of the event loop go in one request (:mod:`.batched`),
    at most ``batch_max`` of them and ``batch_bytes`` of lines; a forward alone, or larger
    than that, goes alone, as a plain forward.
    """

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        timeout: float,
        concurrency: int = 64,
        batch_max: int = 64,
        batch_bytes: int = FORWARD_BATCH_BYTES,
    ) -> None:
        self._url = url
        self._headers = {"content-type": "application/json", INTERNAL_SECRET_HEADER: secret}
        self._batch_headers = {"content-type": FORWARDS_TYPE, INTERNAL_SECRET_HEADER: secret}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, force_close=False),
            timeout=self._timeout,
            skip_auto_headers=("User-Agent",),
        )
        self._batch_max = batch_max
        self._batch_bytes = batch_bytes
        self._waiting: list[_Waiting] = []
        self._waiting_bytes = 0
        self._sending: set[asyncio.Task[None]] = set()
        #: Batches sent so far, and the forwards they carried (for tests and benchmarks).
        self.batches = 0
        self.batched = 0

    @property
    def batching(self) -> bool:
        """Whether forwards made together go in one request (off for an app that takes none)."""
        return self._batch_max > 1

    async def forward(self, envelope: Envelope) -> Result:
        """Send a saved event (its body, and its inbox row's key) to the webhook app."""
        payload = codec.dumps({**envelope.body, "already_saved": True})
        if not self.batching:
            return await self._one(envelope.dedup_key, payload)
        line = forward_line(envelope.dedup_key, payload)
        if len(line) > self._batch_bytes:
            return await self._one(envelope.dedup_key, payload)
        if self._waiting_bytes + len(line) > self._batch_bytes:
            self._send_waiting()
        waiting = _Waiting(envelope.dedup_key, payload, line, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        self._waiting_bytes += len(line)
        if len(self._waiting) >= self._batch_max:
            self._send_waiting()
        elif len(self._waiting) == 1:  # the rest of this turn's forwards ride along
            asyncio.get_running_loop().call_soon(self._send_waiting)
        # A cancelled caller cancels only its wait: the batch goes on, and its answer is dropped.
        return await waiting.result

    def _send_waiting(self) -> None:
        batch, self._waiting, self._waiting_bytes = self._waiting, [], 0
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Waiting]) -> None:
        try:
            if len(batch) == 1:
                only = batch[0]
                _settle(only, await self._one(only.key, only.payload))
            else:
                await self._batch(batch)
        except BaseException as exc:  # cancelled (closing): nobody may wait forever
            for waiting in batch:
                _settle(waiting, Result(Outcome.UNREACHABLE, waiting.key, error=f"forward stopped: {exc!r}"))
            raise

    async def _batch(self, batch: list[_Waiting]) -> None:
        self.batches += 1
        self.batched += len(batch)
        body = b"".join(waiting.line for waiting in batch)
        again: tuple[int, bool] | None = None
        try:
            async with self._session.post(self._url, data=body, headers=self._batch_headers) as response:
                if response.status == 200 and response.headers.get(BATCH_HEADER):
                    async for line in response.content:
                        read = read_answer_line(line)
                        if read is not None and 0 <= read[0] < len(batch):
                            index, status, outcome, answer = read
                            _settle(batch[index], _result(batch[index].key, status, outcome, _said(answer)))
                    missing = "the webhook app's answer ended before this event's"
                else:
                    raw = await response.read()
                    missing = f"HTTP {response.status}: {_detail(raw)}"
                    if response.status in _ONE_BY_ONE:
                        again = response.status, bool(response.headers.get(BATCH_HEADER))
        except TimeoutError:
            missing = f"timeout after {self._timeout.total}s"
        except (aiohttp.ClientError, OSError) as exc:
            missing = f"{type(exc).__name__}: {exc}"
        if again is not None:
            await self._one_by_one(batch, *again)
            return
        for waiting in batch:
            _settle(waiting, Result(Outcome.UNREACHABLE, waiting.key, error=missing[:1000]))

    async def _one_by_one(self, batch: list[_Waiting], status: int, batches_known: bool) -> None:
        if not batches_known:
            self._batch_max = 1
            log.warning(
                "the webhook app does not take batched forwards (an older version?): forwarding one "
                "event per request from now on",
                url=self._url,
                status=status,
            )
        for waiting, result in zip(
            batch,
            await asyncio.gather(*(self._one(waiting.key, waiting.payload) for waiting in batch)),
            strict=True,
        ):
            _settle(waiting, result)

    async def _one(self, key: str, payload: bytes) -> Result:
        """One forward in one request (the answer's outcome header says what came of it)."""
        headers = {**self._headers, DEDUP_KEY_HEADER: key}
        try:
            async with self._session.post(self._url, data=payload, headers=headers) as response:
                raw = await response.read()
                outcome = response.headers.get(OUTCOME_HEADER)
                status = response.status
        except TimeoutError:
            return Result(Outcome.UNREACHABLE, key, error=f"timeout after {self._timeout.total}s")
        except (aiohttp.ClientError, OSError) as exc:
            return Result(Outcome.UNREACHABLE, key, error=f"{type(exc).__name__}: {exc}"[:1000])
        return _result(key, status, outcome, _detail(raw))

    async def close(self) -> None:
        self._send_waiting()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        await self._session.close()
        # Let aiohttp's connector finish closing its transports.
        await asyncio.sleep(0)


@dataclass(slots=True)
class _Waiting:
    """A forward waiting for its batch: its key, its single-forward body, its line, its result."""

    key: str
    payload: bytes
    line: bytes
    result: asyncio.Future[Result]


def _settle(waiting: _Waiting, result: Result) -> None:
    if not waiting.result.done():
        waiting.result.set_result(result)


def _result(key: str, status: int, outcome: str | None, detail: str) -> Result:
    """What a forward's answer means: the core's outcome, when the webhook app said it."""
    said = _OUTCOMES.get(outcome or "")
    if said in {Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.LOCKED}:
        return Result(said, key)
    return Result(said or Outcome.UNREACHABLE, key, error=f"HTTP {status}: {detail}"[:1000])


def _detail(raw: bytes) -> str:
    """What a failed answer says, for ``last_error`` and the retry headers."""
    try:
        answer = codec.loads(raw)
    except codec.JsonRefused:
        return repr(raw[:200].decode(errors="replace"))
    return _said(answer)


def _said(answer: Any) -> str:
    if isinstance(answer, dict):
        return str(answer.get("detail") or answer.get("error") or answer)
    return repr(answer)
