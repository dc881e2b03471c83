"""The Postgres inbox: the source of truth for what was received and processed.

One row per event identity (``dedup_key`` is unique) in ``evolution_ingest_inbox``, its body in
``evolution_ingest_bodies`` (partitioned by day, so that retention drops a day of bodies at
once); ``evolution_ingestion_events`` is the view that joins them. Saving is one
``INSERT ... ON CONFLICT`` that also records which channel delivered the copy, stores the body
of a new row, and, when asked, claims the row for business logic. The claim (a token and a
lease) is what keeps business logic to once per event when Redis cannot help.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import asyncpg
import structlog

from evolution_ingest.core import codec
from evolution_ingest.core.batching import Batcher
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.inbox_sql import (
    BODIES,
    CLAIM_SAVED,
    GIVE_UP,
    MARK_PROCESSED,
    NOTE_ERROR,
    RECORD_FAILURE,
    RENEW,
    SAVE,
    SEEN,
    STRIP_MEDIA,
    TABLE,
    VIEW,
)
from evolution_ingest.stores.postgres import Postgres, RowRejected, row_level

log = structlog.get_logger(__name__)

__all__ = ["BODIES", "TABLE", "VIEW", "Claim", "PostgresInbox", "SavedRow"]

_MAX_ERROR_CHARS: Final = 4000
#: How long a batch of seen bookkeeping gathers before it runs: nobody waits on it, and
#: one statement per 50 ms instead of one per loop turn costs far fewer round trips.
_SEEN_LINGER: Final = 0.05
_CHANNELS: Final = {channel.value: channel for channel in Channel}


class _Tokens:
    """Claim tokens unique across processes without a system call each: a random 64-bit prefix of
    this process (drawn again in a forked child) and a counter."""

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = int.from_bytes(os.urandom(8), "big") << 64
        self._counter = itertools.count(1)

    def next(self) -> uuid.UUID:
        return uuid.UUID(int=self._prefix | next(self._counter))


_TOKENS: Final = _Tokens()


@dataclass(frozen=True, slots=True)
class Claim:
    """The right to run business logic for one row until the lease runs out."""

    token: uuid.UUID
    lease_seconds: float

    @classmethod
    def new(cls, lease_seconds: float) -> Claim:
        return cls(_TOKENS.next(), lease_seconds)


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
        channel=_CHANNELS[record["channel"]],
        received_at=record["received_at"],
        attempts=record["attempts"],
        processed=record["processed"],
        claimed=token is not None and record["claim_token"] == token,
    )


class PostgresInbox:
    """Reads and writes ``evolution_ingestion_events`` through an asyncpg pool.

    Saves, claims and "processed" marks of concurrent events are grouped into one
    statement each (:class:`~evolution_ingest.core.batching.Batcher`): one commit serves
    many events, which is what lets the service outrun one statement per event.
    """

    def __init__(
        self, db: Postgres, *, batch_concurrency: int = 4, strip_media: Counters | None = None
    ) -> None:
        self._db = db
        #: When set (RETENTION_STRIP_MEDIA), base64 media leave a body once it is processed,
        #: counted as ``retention:media_stripped``.
        self._strip_media = strip_media
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
            linger=_SEEN_LINGER,
        )

    async def _batch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """Run a batch statement, retrying once if Postgres picked it as a deadlock victim."""
        for attempt in (1, 2):
            try:
                return await self._db.fetch(query, *args)
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
            SAVE,
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
            CLAIM_SAVED,
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
        marked = await self._batch(MARK_PROCESSED, ids)
        done = {record["id"] for record in marked}
        if self._strip_media is not None and marked:
            received = [record["received_at"] for record in marked]
            try:  # the marks are committed: a failure here only leaves the media in
                stripped = len(await self._batch(STRIP_MEDIA, sorted(done), min(received), max(received)))
                self._strip_media.incr("retention:media_stripped", stripped)
            except asyncpg.PostgresError as exc:
                log.warning("media not stripped from processed bodies", error=repr(exc))
        return [row_id in done for row_id in ids]

    async def record_seen(self, dedup_key: str, channel: Channel) -> None:
        """Note that ``channel`` delivered a copy of an event already processed (bookkeeping only)."""
        await self.record_seen_soon(dedup_key, channel)

    def record_seen_soon(self, dedup_key: str, channel: Channel) -> asyncio.Future[None]:
        """:meth:`record_seen` without waiting: the future says when it is committed (or why not)."""
        return self._seen.submit(_Seen(dedup_key, channel))

    async def _seen_batch(self, seen: list[_Seen]) -> list[None]:
        for channel, statement in SEEN.items():  # a backfilled copy has no column of its own
            keys = sorted(s.dedup_key for s in seen if s.channel is channel)
            if keys:
                await self._batch(statement, keys)
        return [None] * len(seen)

    async def renew(self, row_id: int, claim: Claim) -> bool:
        """Extend a claim still held; False when it was lost or the row is done."""
        return await self._db.execute(RENEW, row_id, claim.token, claim.lease_seconds) == "UPDATE 1"

    async def record_failure(self, row_id: int, claim: Claim, error: str) -> None:
        """Count a failed attempt, keep its error, and give the claim back."""
        await self._db.execute(RECORD_FAILURE, row_id, codec.label(error[:_MAX_ERROR_CHARS]), claim.token)

    # --- re-sending saved events (reconciler, replay) --------------------------------------
    async def note_error(self, row_id: int, error: str) -> None:
        """Keep why a re-send failed, without counting an attempt (nothing ran)."""
        await self._db.execute(NOTE_ERROR, row_id, codec.label(error[:_MAX_ERROR_CHARS]))

    async def message_key_v2_since(self) -> datetime | None:
        """When this inbox, holding version-1 message rows, moved to message keys of version 2."""
        try:
            value = await self._db.fetchval(
                "SELECT at FROM evolution_ingest_meta WHERE name = 'message_key_v2'"
            )
        except asyncpg.UndefinedTableError:  # not migrated yet: nothing of version 1 to match
            return None
        return value if isinstance(value, datetime) else None

    async def exists(self, dedup_key: str) -> bool:
        """Whether the inbox holds a row for ``dedup_key``."""
        return bool(
            await self._db.fetchval(f"SELECT EXISTS (SELECT 1 FROM {TABLE} WHERE dedup_key = $1)", dedup_key)
        )

    async def attempts(self, row_id: int) -> int | None:
        """Business-logic attempts of a row so far (None: no such row)."""
        value = await self._db.fetchval(f"SELECT attempts FROM {TABLE} WHERE id = $1", row_id)
        return None if value is None else int(value)

    async def give_up(self, row_id: int, max_attempts: int) -> bool:
        """Mark a row failed once it has had ``max_attempts``; True when this call marked it."""
        return await self._db.execute(GIVE_UP, row_id, max_attempts) == "UPDATE 1"

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
