"""The Postgres inbox: the source of truth for what was received and processed.

One row per event identity (``dedup_key`` is unique). Saving is one
``INSERT ... ON CONFLICT`` that also records which channel delivered the copy
and, when asked, claims the row for business logic. The claim (a token and a
lease) is what keeps business logic to once per event when Redis cannot help.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import asyncpg
import orjson

from evolution_ingest.core import codec
from evolution_ingest.core.batching import Batcher
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope

TABLE: Final = "evolution_ingestion_events"
_MAX_ERROR_CHARS: Final = 4000

#: Errors meaning "Postgres is unreachable right now", as opposed to a bad statement.
CONNECTION_ERRORS: Final = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.InsufficientResourcesError,
    # The client's own protocol state went wrong (seen when backends are terminated while
    # statements run): the connection is dropped (see ``connection``) and the step retried.
    asyncpg.exceptions.InternalClientError,
)


class StoreUnavailable(Exception):
    """Postgres cannot be reached; the caller answers 503 or retries later."""


class RowRejected(Exception):
    """Postgres refused this one event's row (its data, not the connection): a 4xx, never a retry."""

    def __init__(self, reason: str, code: str = "unstorable") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


#: SQLSTATE classes of errors caused by a row's values: data exception, integrity
#: constraint violation, program limit exceeded (an index entry too large).
_ROW_LEVEL_CLASSES: Final = frozenset({"22", "23", "54"})


def row_level(exc: BaseException) -> bool:
    """True when a batch statement failed because of (at least) one of its rows."""
    sqlstate = getattr(exc, "sqlstate", None)
    return isinstance(exc, asyncpg.PostgresError) and str(sqlstate or "")[:2] in _ROW_LEVEL_CLASSES


@dataclass(frozen=True, slots=True)
class Claim:
    """The right to run business logic for one row until the lease runs out."""

    token: uuid.UUID
    lease_seconds: float

    @classmethod
    def new(cls, lease_seconds: float) -> Claim:
        return cls(uuid.uuid4(), lease_seconds)


@dataclass(frozen=True, slots=True)
class SavedRow:
    """What the inbox says about an event right after a save or a claim."""

    id: int
    channel: Channel
    received_at: datetime
    attempts: int
    processed: bool
    #: True when the caller's claim was granted (it may run business logic).
    claimed: bool
    #: True when this call inserted the row (first copy of the event).
    inserted: bool = False


_CLAIMABLE = "(e.processed_at IS NULL AND (e.claimed_until IS NULL OR e.claimed_until < now()))"

# Every batch locks its rows in dedup_key order, whatever the statement: two batches
# touching the same rows then always queue up behind each other instead of deadlocking.

_SAVE = f"""
INSERT INTO {TABLE} AS e
    (dedup_key, event, instance, channel, payload, payload_text,
     webhook_seen_at, rabbitmq_seen_at, claim_token, claimed_until)
SELECT u.key, u.event, u.instance, u.channel, u.payload::jsonb, u.payload_text,
       CASE WHEN u.channel = 'WEBHOOK' THEN now() END,
       CASE WHEN u.channel = 'RABBITMQ' THEN now() END,
       u.token,
       CASE WHEN u.token IS NOT NULL THEN now() + make_interval(secs => u.lease) END
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::uuid[],
            $8::float8[])
     AS u(key, event, instance, channel, payload, payload_text, token, lease)
ON CONFLICT (dedup_key) DO UPDATE SET
    webhook_seen_at  = COALESCE(e.webhook_seen_at, EXCLUDED.webhook_seen_at),
    rabbitmq_seen_at = COALESCE(e.rabbitmq_seen_at, EXCLUDED.rabbitmq_seen_at),
    claim_token   = CASE WHEN EXCLUDED.claim_token IS NOT NULL AND {_CLAIMABLE}
                         THEN EXCLUDED.claim_token ELSE e.claim_token END,
    claimed_until = CASE WHEN EXCLUDED.claim_token IS NOT NULL AND {_CLAIMABLE}
                         THEN EXCLUDED.claimed_until ELSE e.claimed_until END
RETURNING dedup_key, id, channel, received_at, attempts, processed_at IS NOT NULL AS processed,
          claim_token, xmax = 0 AS inserted
"""

_CLAIM_SAVED = f"""
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::uuid[], $3::float8[]) AS u(key, token, lease)
), locked AS MATERIALIZED (
    SELECT e.id FROM {TABLE} AS e JOIN wanted ON e.dedup_key = wanted.key
    ORDER BY e.dedup_key FOR UPDATE OF e
)
UPDATE {TABLE} AS e SET
    claim_token   = CASE WHEN {_CLAIMABLE} THEN wanted.token ELSE e.claim_token END,
    claimed_until = CASE WHEN {_CLAIMABLE} THEN now() + make_interval(secs => wanted.lease)
                         ELSE e.claimed_until END
FROM locked, wanted
WHERE e.id = locked.id AND e.dedup_key = wanted.key
RETURNING e.dedup_key, e.id, e.channel, e.received_at, e.attempts,
          e.processed_at IS NOT NULL AS processed, e.claim_token
"""

_MARK_PROCESSED = f"""
UPDATE {TABLE} AS e SET processed_at = now(), attempts = e.attempts + 1, last_attempt_at = now(),
                        claim_token = NULL, claimed_until = NULL
FROM (SELECT id FROM {TABLE} WHERE id = ANY($1::bigint[]) AND processed_at IS NULL
      ORDER BY dedup_key FOR UPDATE) AS locked
WHERE e.id = locked.id
RETURNING e.id
"""

_SEEN = {
    channel: f"""
UPDATE {TABLE} AS e SET {column} = COALESCE(e.{column}, now())
FROM (SELECT id FROM {TABLE} WHERE dedup_key = ANY($1::text[]) AND {column} IS NULL
      ORDER BY dedup_key FOR UPDATE) AS locked
WHERE e.id = locked.id
"""
    for channel, column in ((Channel.WEBHOOK, "webhook_seen_at"), (Channel.RABBITMQ, "rabbitmq_seen_at"))
}

_RENEW = f"""
UPDATE {TABLE} SET claimed_until = now() + make_interval(secs => $3)
WHERE id = $1 AND claim_token = $2 AND processed_at IS NULL
"""

_RECORD_FAILURE = f"""
UPDATE {TABLE} SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
    claim_token   = CASE WHEN claim_token = $3 THEN NULL ELSE claim_token END,
    claimed_until = CASE WHEN claim_token = $3 THEN NULL ELSE claimed_until END
WHERE id = $1 AND processed_at IS NULL
"""


@dataclass(frozen=True, slots=True)
class _Save:
    envelope: Envelope
    channel: Channel
    claim: Claim | None
    stored: codec.StoredJson


@dataclass(frozen=True, slots=True)
class _Seen:
    dedup_key: str
    channel: Channel


def _row(record: asyncpg.Record, token: uuid.UUID | None) -> SavedRow:
    return SavedRow(
        id=record["id"],
        channel=Channel(record["channel"]),
        received_at=record["received_at"],
        attempts=record["attempts"],
        processed=record["processed"],
        claimed=token is not None and record["claim_token"] == token,
        inserted=record.get("inserted", False),
    )


class PostgresInbox:
    """Reads and writes ``evolution_ingestion_events`` through an asyncpg pool.

    Saves, claims and "processed" marks of concurrent events are grouped into one
    statement each (:class:`~evolution_ingest.batching.Batcher`): one commit serves
    many events, which is what lets the service outrun one statement per event.
    """

    def __init__(
        self, pool: asyncpg.Pool, *, acquire_timeout: float = 5.0, batch_concurrency: int = 4
    ) -> None:
        self._pool = pool
        self._acquire_timeout = acquire_timeout
        self._saves: Batcher[_Save, SavedRow] = Batcher(
            self._save_batch,
            key=lambda s: s.envelope.dedup_key,
            max_concurrency=batch_concurrency,
            isolate=row_level,
        )
        self._claims: Batcher[tuple[str, Claim], SavedRow | None] = Batcher(
            self._claim_batch, key=lambda c: c[0], max_concurrency=batch_concurrency, isolate=row_level
        )
        self._marks: Batcher[int, bool] = Batcher(
            self._mark_batch, key=lambda i: i, max_concurrency=batch_concurrency, isolate=row_level
        )
        self._seen: Batcher[_Seen, None] = Batcher(
            self._seen_batch,
            key=lambda s: (s.dedup_key, s.channel),
            max_size=1000,
            max_concurrency=1,
            isolate=row_level,
        )

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        """A pooled connection; connection failures become :class:`StoreUnavailable`."""
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                try:
                    yield conn
                except asyncpg.exceptions.InternalClientError:
                    conn.terminate()  # never hand a connection in a broken state to the next user
                    raise
        except CONNECTION_ERRORS as exc:
            # One dead connection usually means all of them (a restart, terminated backends):
            # have every idle one replaced, so that the next tries do not draw them one by one.
            with contextlib.suppress(Exception):
                await self._pool.expire_connections()
            raise StoreUnavailable(f"Postgres unreachable: {exc!r}") from exc

    async def _batch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """Run a batch statement, retrying once if Postgres picked it as a deadlock victim."""
        for attempt in (1, 2):
            try:
                async with self.connection() as conn:
                    return list(await conn.fetch(query, *args))
            except asyncpg.exceptions.DeadlockDetectedError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # --- saving (INSERT ... ON CONFLICT), maybe claiming ------------------------------------
    async def save(self, envelope: Envelope, channel: Channel, claim: Claim | None) -> SavedRow:
        """Save the raw event (or record that ``channel`` saw it too); maybe claim it.

        :class:`RowRejected` when this event cannot be stored (the events saved with it are not
        affected); :class:`StoreUnavailable` when Postgres cannot be reached.
        """
        try:  # serialized here, by the caller's task: a body that cannot be written fails alone
            stored = codec.for_storage(envelope.body)
        except codec.JsonRefused as exc:
            raise RowRejected(exc.reason, exc.code) from None
        try:
            return await self._saves(_Save(envelope, channel, claim, stored))
        except asyncpg.PostgresError as exc:
            if row_level(exc):
                raise RowRejected(f"Postgres cannot store this event: {exc}") from exc
            raise

    async def _save_batch(self, saves: list[_Save]) -> list[SavedRow]:
        ordered = sorted(saves, key=lambda s: s.envelope.dedup_key)
        records = await self._batch(
            _SAVE,
            [s.envelope.dedup_key for s in ordered],
            [codec.label(s.envelope.event) for s in ordered],
            [codec.label(s.envelope.instance) for s in ordered],
            [s.channel.value for s in ordered],
            [s.stored.jsonb for s in ordered],
            [s.stored.exact for s in ordered],
            [s.claim.token if s.claim else None for s in ordered],
            [s.claim.lease_seconds if s.claim else 0.0 for s in ordered],
        )
        by_key = {record["dedup_key"]: record for record in records}
        return [_row(by_key[s.envelope.dedup_key], s.claim.token if s.claim else None) for s in saves]

    # --- claiming a saved row (forwards) -----------------------------------------------------
    async def claim_saved(self, dedup_key: str, claim: Claim) -> SavedRow | None:
        """Claim an already saved row; ``None`` when there is no row for the key."""
        return await self._claims((dedup_key, claim))

    async def _claim_batch(self, claims: list[tuple[str, Claim]]) -> list[SavedRow | None]:
        records = await self._batch(
            _CLAIM_SAVED,
            [key for key, _ in claims],
            [claim.token for _, claim in claims],
            [claim.lease_seconds for _, claim in claims],
        )
        by_key = {record["dedup_key"]: record for record in records}
        return [_row(by_key[key], claim.token) if key in by_key else None for key, claim in claims]

    # --- finishing -----------------------------------------------------------------------------
    async def mark_processed(self, row_id: int) -> bool:
        """Record that business logic completed; False when it already was."""
        return await self._marks(row_id)

    async def _mark_batch(self, ids: list[int]) -> list[bool]:
        done = {record["id"] for record in await self._batch(_MARK_PROCESSED, ids)}
        return [row_id in done for row_id in ids]

    async def record_seen(self, dedup_key: str, channel: Channel) -> None:
        """Note that ``channel`` delivered a copy of an event already processed (bookkeeping only)."""
        await self._seen(_Seen(dedup_key, channel))

    async def _seen_batch(self, seen: list[_Seen]) -> list[None]:
        for channel in Channel:
            keys = sorted(s.dedup_key for s in seen if s.channel is channel)
            if keys:
                await self._batch(_SEEN[channel], keys)
        return [None] * len(seen)

    async def renew(self, row_id: int, claim: Claim) -> bool:
        """Extend a claim still held; False when it was lost or the row is done."""
        async with self.connection() as conn:
            status = await conn.execute(_RENEW, row_id, claim.token, claim.lease_seconds)
        return bool(status == "UPDATE 1")

    async def record_failure(self, row_id: int, claim: Claim, error: str) -> None:
        """Count a failed attempt, keep its error, and give the claim back."""
        async with self.connection() as conn:
            await conn.execute(_RECORD_FAILURE, row_id, codec.label(error[:_MAX_ERROR_CHARS]), claim.token)

    async def fetch(self, dedup_key: str) -> dict[str, Any] | None:
        """The whole row for a key (tests and ``inspect``)."""
        async with self.connection() as conn:
            record = await conn.fetchrow(f"SELECT * FROM {TABLE} WHERE dedup_key = $1", dedup_key)
        return None if record is None else dict(record)

    def batch_sizes(self) -> dict[str, float]:
        """Average events per statement so far, per kind of batch (benchmarks, debugging)."""
        batchers: dict[str, Batcher[Any, Any]] = {
            "save": self._saves, "claim": self._claims, "mark": self._marks, "seen": self._seen,
        }  # fmt: skip
        return {name: b.items / b.batches for name, b in batchers.items() if b.batches}

    async def drain(self) -> None:
        """Wait for batched writes in flight (at shutdown)."""
        for batcher in (self._saves, self._claims, self._marks, self._seen):
            await batcher.drain()


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        encoder=lambda value: value if isinstance(value, str) else orjson.dumps(value).decode(),
        decoder=orjson.loads,
        format="text",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Nothing to reset between uses: pooled connections change no session state (no SET,
    LISTEN, cursors or advisory locks), so the default reset query would be a wasted round trip.
    An open transaction is still rolled back by the pool before this is called."""


async def create_pool(
    dsn: str,
    *,
    schema: str,
    size: int,
    command_timeout: float,
    connect_timeout: float,
    application_name: str = "evolution-ingest",
) -> asyncpg.Pool:
    """A pool that connects lazily, so the app can start (and answer 503) while Postgres is down."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=0,
        max_size=size,
        command_timeout=command_timeout,
        timeout=connect_timeout,
        init=init_connection,
        reset=_keep_session,
        server_settings={"search_path": schema, "application_name": application_name},
    )
    assert pool is not None
    return pool
