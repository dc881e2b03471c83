"""The Postgres inbox: the source of truth for what was received and processed.

One row per event identity (``dedup_key`` is unique). Saving is one
``INSERT ... ON CONFLICT`` that also records which channel delivered the copy
and, when asked, claims the row for business logic. The claim (a token and a
lease) is what keeps business logic to once per event when Redis cannot help.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import asyncpg
import orjson

from evolution_ingest.events import Channel
from evolution_ingest.identity import Envelope

TABLE: Final = "evolution_ingestion_events"
_MAX_ERROR_CHARS: Final = 4000

# A NUL inside a JSON string (escaped as \u0000, after an even number of
# backslashes) cannot be stored in jsonb; it is replaced by U+FFFD in the stored copy.
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")

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
)


class StoreUnavailable(Exception):
    """Postgres cannot be reached; the caller answers 503 or retries later."""


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


def serialize_payload(body: dict[str, Any]) -> str:
    text = orjson.dumps(body).decode()
    if "\\u0000" in text:
        text = _NUL_ESCAPE.sub(r"\1\\ufffd", text)
    return text


_CLAIMABLE = "(e.processed_at IS NULL AND (e.claimed_until IS NULL OR e.claimed_until < now()))"

_SAVE = f"""
INSERT INTO {TABLE} AS e
    (dedup_key, event, instance, channel, payload,
     webhook_seen_at, rabbitmq_seen_at, claim_token, claimed_until)
VALUES ($1, $2, $3, $4, $5::jsonb,
        CASE WHEN $4 = 'WEBHOOK' THEN now() END,
        CASE WHEN $4 = 'RABBITMQ' THEN now() END,
        $6::uuid,
        CASE WHEN $6::uuid IS NOT NULL THEN now() + make_interval(secs => $7) END)
ON CONFLICT (dedup_key) DO UPDATE SET
    webhook_seen_at  = COALESCE(e.webhook_seen_at, EXCLUDED.webhook_seen_at),
    rabbitmq_seen_at = COALESCE(e.rabbitmq_seen_at, EXCLUDED.rabbitmq_seen_at),
    claim_token   = CASE WHEN EXCLUDED.claim_token IS NOT NULL AND {_CLAIMABLE}
                         THEN EXCLUDED.claim_token ELSE e.claim_token END,
    claimed_until = CASE WHEN EXCLUDED.claim_token IS NOT NULL AND {_CLAIMABLE}
                         THEN EXCLUDED.claimed_until ELSE e.claimed_until END
RETURNING id, channel, received_at, attempts, processed_at IS NOT NULL AS processed,
          $6::uuid IS NOT NULL AND claim_token IS NOT DISTINCT FROM $6::uuid AS claimed,
          xmax = 0 AS inserted
"""

_CLAIM_SAVED = f"""
UPDATE {TABLE} AS e SET
    claim_token   = CASE WHEN {_CLAIMABLE} THEN $2::uuid ELSE e.claim_token END,
    claimed_until = CASE WHEN {_CLAIMABLE} THEN now() + make_interval(secs => $3)
                         ELSE e.claimed_until END
WHERE e.dedup_key = $1
RETURNING id, channel, received_at, attempts, processed_at IS NOT NULL AS processed,
          claim_token IS NOT DISTINCT FROM $2::uuid AS claimed
"""

_RENEW = f"""
UPDATE {TABLE} SET claimed_until = now() + make_interval(secs => $3)
WHERE id = $1 AND claim_token = $2 AND processed_at IS NULL
"""

_MARK_PROCESSED = f"""
UPDATE {TABLE} SET processed_at = now(), attempts = attempts + 1, last_attempt_at = now(),
                   claim_token = NULL, claimed_until = NULL
WHERE id = $1 AND processed_at IS NULL
"""

_RECORD_FAILURE = f"""
UPDATE {TABLE} SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
    claim_token   = CASE WHEN claim_token = $3 THEN NULL ELSE claim_token END,
    claimed_until = CASE WHEN claim_token = $3 THEN NULL ELSE claimed_until END
WHERE id = $1 AND processed_at IS NULL
"""


def _row(record: asyncpg.Record, *, inserted: bool = False) -> SavedRow:
    return SavedRow(
        id=record["id"],
        channel=Channel(record["channel"]),
        received_at=record["received_at"],
        attempts=record["attempts"],
        processed=record["processed"],
        claimed=record["claimed"],
        inserted=inserted,
    )


class PostgresInbox:
    """Reads and writes ``evolution_ingestion_events`` through an asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool, *, acquire_timeout: float = 5.0) -> None:
        self._pool = pool
        self._acquire_timeout = acquire_timeout

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        """A pooled connection; connection failures become :class:`StoreUnavailable`."""
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                yield conn
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"Postgres unreachable: {exc!r}") from exc

    async def save(self, envelope: Envelope, channel: Channel, claim: Claim | None) -> SavedRow:
        """Save the raw event (or record that ``channel`` saw it too); maybe claim it."""
        async with self.connection() as conn:
            record = await conn.fetchrow(
                _SAVE,
                envelope.dedup_key,
                envelope.event,
                envelope.instance,
                channel.value,
                serialize_payload(envelope.body),
                claim.token if claim else None,
                claim.lease_seconds if claim else 0.0,
            )
        assert record is not None  # INSERT ... ON CONFLICT DO UPDATE always returns the row
        return _row(record, inserted=record["inserted"])

    async def claim_saved(self, dedup_key: str, claim: Claim) -> SavedRow | None:
        """Claim an already saved row; ``None`` when there is no row for the key."""
        async with self.connection() as conn:
            record = await conn.fetchrow(_CLAIM_SAVED, dedup_key, claim.token, claim.lease_seconds)
        return None if record is None else _row(record)

    async def renew(self, row_id: int, claim: Claim) -> bool:
        """Extend a claim still held; False when it was lost or the row is done."""
        async with self.connection() as conn:
            status = await conn.execute(_RENEW, row_id, claim.token, claim.lease_seconds)
        return bool(status == "UPDATE 1")

    async def mark_processed(self, row_id: int) -> bool:
        """Record that business logic completed; False when it already was."""
        async with self.connection() as conn:
            status = await conn.execute(_MARK_PROCESSED, row_id)
        return bool(status == "UPDATE 1")

    async def record_failure(self, row_id: int, claim: Claim, error: str) -> None:
        """Count a failed attempt, keep its error, and give the claim back."""
        async with self.connection() as conn:
            await conn.execute(_RECORD_FAILURE, row_id, error[:_MAX_ERROR_CHARS], claim.token)

    async def fetch(self, dedup_key: str) -> dict[str, Any] | None:
        """The whole row for a key (tests and ``inspect``)."""
        async with self.connection() as conn:
            record = await conn.fetchrow(f"SELECT * FROM {TABLE} WHERE dedup_key = $1", dedup_key)
        return None if record is None else dict(record)


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        encoder=lambda value: value if isinstance(value, str) else orjson.dumps(value).decode(),
        decoder=orjson.loads,
        format="text",
    )


async def create_pool(
    dsn: str, *, schema: str, size: int, command_timeout: float, connect_timeout: float
) -> asyncpg.Pool:
    """A pool that connects lazily, so the app can start (and answer 503) while Postgres is down."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=0,
        max_size=size,
        command_timeout=command_timeout,
        timeout=connect_timeout,
        init=init_connection,
        server_settings={"search_path": schema, "application_name": "evolution-ingest"},
    )
    assert pool is not None
    return pool
