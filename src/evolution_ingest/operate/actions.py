"""Operator actions that change things: ``replay`` and ``purge``.

``replay`` sends failed events (from the inbox) and parked messages (from the
parking queue) back through processing; ``purge`` deletes old processed rows, or
only their payloads. Both take filters, have a dry run, and report progress
through a callback so the CLI can draw a progress bar.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from evolution_ingest.channels.forward import Delivery, Forwarder
from evolution_ingest.channels.reconciler import InboxRow, Resender, Resent
from evolution_ingest.channels.topology import Topology
from evolution_ingest.channels.worker import BROKER_ERRORS, HEADER_ATTEMPTS, HEADER_BUSY, HEADER_PARKED_AT
from evolution_ingest.config import Settings
from evolution_ingest.core import codec
from evolution_ingest.core.body import BodyRejected, load_body
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope, InvalidEvent, normalize_event_name, parse_envelope
from evolution_ingest.core.ingestion import Ingestion, Outcome
from evolution_ingest.runtime import Runtime
from evolution_ingest.stores.inbox import TABLE, PostgresInbox, RowRejected

Progress = Callable[[int], None]
HEADER_REPLAYED_AT: Final = "x-evolution-ingest-replayed-at"
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_age(text: str) -> float:
    """``90m``, ``36h``, ``7d``, ``2w`` or plain seconds -> seconds."""
    match = _AGE.match(text.lower())
    if not match:
        raise ValueError(f"{text!r} is not an age like 90m, 36h, 7d or 2w")
    return float(match[1]) * _UNITS[match[2] or "s"]


@dataclass(frozen=True, slots=True)
class Filters:
    event: str | None = None
    instance: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def matches(self, event: str, instance: str, at: datetime | None) -> bool:
        if self.event and normalize_event_name(self.event) != event:
            return False
        if self.instance and self.instance != instance:
            return False
        if at is not None and self.since and at < self.since:
            return False
        return not (at is not None and self.until and at >= self.until)


@dataclass(slots=True)
class ReplayReport:
    dry_run: bool
    failed_events: int = 0
    parked_messages: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    #: Parked messages left where they are: not Evolution events, or filtered out.
    parked_left: int = 0
    #: Refused bodies looked at, and what became of them (processed, duplicate, still refused...).
    refused: int = 0
    refused_outcomes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "dry_run": self.dry_run,
            "failed_events": self.failed_events,
            "parked_messages": self.parked_messages,
            "parked_left": self.parked_left,
            **self.outcomes,
        }
        if self.refused:
            report |= {"refused_bodies": self.refused, "refused_outcomes": self.refused_outcomes}
        return report


async def failed_rows(inbox: PostgresInbox, filters: Filters, limit: int) -> list[InboxRow]:
    """Events marked failed and still unprocessed, oldest first."""
    clauses = ["failed_at IS NOT NULL", "processed_at IS NULL"]
    args: list[Any] = []
    for column, value, op in (
        ("event", normalize_event_name(filters.event) if filters.event else None, "="),
        ("instance", filters.instance, "="),
        ("received_at", filters.since, ">="),
        ("received_at", filters.until, "<"),
    ):
        if value is not None:
            args.append(value)
            clauses.append(f"{column} {op} ${len(args)}")
    args.append(limit)
    query = (
        f"SELECT id, dedup_key, payload, payload_text, attempts, received_at FROM {TABLE} WHERE {' AND '.join(clauses)} "
        f"ORDER BY received_at, id LIMIT ${len(args)}"
    )
    async with inbox.connection() as conn:
        return [InboxRow.of(record) for record in await conn.fetch(query, *args)]


async def replay_failed(
    rows: list[InboxRow], resender: Resender, report: ReplayReport, progress: Progress
) -> None:
    """Forward each failed event once more (its failure mark stays as history)."""
    report.failed_events = len(rows)
    for row in rows:
        if not report.dry_run:
            outcome = await resender.resend(row, mark_dead=False)
            key = "recovered" if outcome is Resent.RECOVERED else f"still_{outcome.value}"
            report.outcomes[key] = report.outcomes.get(key, 0) + 1
        progress(1)


async def resubmit(ingestion: Ingestion, sender: Forwarder, envelope: Envelope, channel: Channel) -> str:
    """Save a copy as if ``channel`` had just delivered it, then forward it (the worker's path)."""
    async with ingestion.hold(envelope, channel) as held:
        if held.outcome is not Outcome.SAVED:
            return "duplicate" if held.outcome is Outcome.DUPLICATE else "saved; being processed elsewhere"
        result = await sender.forward(envelope)
        if result.delivery is Delivery.DONE:
            held.processed = True
            return "processed"
    if result.delivery is Delivery.LOCKED:
        return "saved; being processed elsewhere"
    return f"saved; forward failed, the reconciler will finish it: {result.error}"


async def replay_refused(
    runtime: Runtime,
    sender: Forwarder,
    found: list[tuple[int, str, bytes, bool]],
    report: ReplayReport,
    progress: Progress,
) -> None:
    """Re-submit refused bodies through the ingestion core; each is marked with its outcome."""
    settings = runtime.settings
    report.refused += len(found)
    for refusal_id, source, body, truncated in found:
        if truncated:
            outcome = "still refused: the kept copy was cut at REFUSAL_MAX_BYTES"
        else:
            try:
                envelope = runtime.ingestion.envelope(
                    load_body(body, max_bytes=settings.max_body_bytes, max_keys=settings.max_json_keys)
                )
            except (BodyRejected, InvalidEvent) as exc:
                outcome = f"still refused: {exc.reason}"
            else:
                outcome = "would be re-submitted"
                if not report.dry_run:
                    try:
                        outcome = await resubmit(runtime.ingestion, sender, envelope, Channel(source.upper()))
                    except RowRejected as exc:
                        outcome = f"still refused: {exc.reason}"
        if not report.dry_run:
            await runtime.refusals.mark_replayed(refusal_id, outcome)
        key = outcome.split(":", 1)[0].split(";", 1)[0]
        report.refused_outcomes[key] = report.refused_outcomes.get(key, 0) + 1
        progress(1)


async def replay_parked(
    settings: Settings, filters: Filters, report: ReplayReport, limit: int, progress: Progress
) -> None:
    """Move matching parked messages to the ready queue, with a fresh retry budget.

    Messages are taken without acknowledgement; those not replayed go back to the
    parking queue when the channel closes. Only what was parked when the replay
    started is looked at.
    """
    topology = Topology(settings)
    connection = await aio_pika.connect(settings.rabbitmq_url, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        parking = await channel.declare_queue(topology.parking, passive=True)
        waiting = min(limit, int(parking.declaration_result.message_count or 0))
        for _ in range(waiting):
            message = await parking.get(no_ack=False, fail=False)
            if message is None:
                break
            if not _replayable(message, settings, filters):
                report.parked_left += 1
            else:
                report.parked_messages += 1
                if not report.dry_run:
                    await channel.default_exchange.publish(_fresh(message), routing_key=topology.ready)
                    await message.ack()
            progress(1)
        with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
            await channel.close()  # unacknowledged messages return to the parking queue
    finally:
        with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
            await connection.close()


def _replayable(message: AbstractIncomingMessage, settings: Settings, filters: Filters) -> bool:
    try:
        body = load_body(message.body, max_bytes=settings.max_body_bytes, max_keys=settings.max_json_keys)
        envelope = parse_envelope(body)
    except (BodyRejected, InvalidEvent):
        return False  # it would only be parked again
    parked_at = (message.headers or {}).get(HEADER_PARKED_AT)
    at = None
    with contextlib.suppress(TypeError, ValueError):
        at = datetime.fromisoformat(parked_at.decode() if isinstance(parked_at, bytes) else str(parked_at))
    return filters.matches(envelope.event, envelope.instance, at)


def _fresh(message: AbstractIncomingMessage) -> aio_pika.Message:
    headers = {k: v for k, v in (message.headers or {}).items() if k not in {HEADER_ATTEMPTS, HEADER_BUSY}}
    headers[HEADER_REPLAYED_AT] = datetime.now(UTC).isoformat()
    return aio_pika.Message(
        body=message.body,
        headers=headers,
        content_type=message.content_type or "application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


@dataclass(slots=True)
class PurgeReport:
    dry_run: bool
    payload_only: bool
    older_than_seconds: float
    rows: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "payload_only": self.payload_only,
            "older_than_seconds": self.older_than_seconds,
            ("payloads_dropped" if self.payload_only else "rows_deleted"): self.rows,
        }


def _purgeable(payload_only: bool) -> str:
    # Never an unprocessed row: processed_at IS NOT NULL is the whole point.
    extra = " AND payload IS NOT NULL" if payload_only else ""
    return f"processed_at IS NOT NULL AND processed_at < now() - make_interval(secs => $1){extra}"


async def purge_count(inbox: PostgresInbox, older_than: float, payload_only: bool) -> int:
    async with inbox.connection() as conn:
        count = await conn.fetchval(
            f"SELECT count(*) FROM {TABLE} WHERE {_purgeable(payload_only)}", older_than
        )
    return int(count)


async def purge(inbox: PostgresInbox, report: PurgeReport, *, batch_size: int, progress: Progress) -> None:
    """Delete (or strip the payload of) processed rows older than the age, in id order, batch by batch."""
    action = (
        f"UPDATE {TABLE} AS e SET payload = NULL FROM doomed WHERE e.id = doomed.id"
        if report.payload_only
        else f"DELETE FROM {TABLE} AS e USING doomed WHERE e.id = doomed.id"
    )
    query = (
        f"WITH doomed AS (SELECT id FROM {TABLE} WHERE id > $2 AND {_purgeable(report.payload_only)} "
        f"ORDER BY id LIMIT $3) {action} RETURNING e.id"
    )
    last_id = 0
    while True:
        async with inbox.connection() as conn:
            ids = [
                record["id"]
                for record in await conn.fetch(query, report.older_than_seconds, last_id, batch_size)
            ]
        if not ids:
            return
        report.rows += len(ids)
        last_id = max(ids)
        progress(len(ids))


def as_json(data: Any) -> str:
    return codec.dumps(data, default=str, indent=True).decode()
