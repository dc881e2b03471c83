"""Operator actions that change things: ``replay`` and ``purge``.

``replay`` sends failed events (from the inbox), parked messages (from the parking
queue) and, when asked, refused bodies back through processing; ``purge`` deletes old
processed rows, or only their payloads. Both take filters, have a dry run, and report
progress through a callback so the CLI can draw a progress bar. Events go through the
ingestion core like any other (``Resend``, ``Relay``): business logic still runs once.
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

from evolution_ingest.config import Settings
from evolution_ingest.core import codec
from evolution_ingest.core.body import BodyRejected, load_body
from evolution_ingest.core.contract import Outcome, Relay, Resend, Result, SavedEvent
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import InvalidEvent, parse_envelope
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.stores.inbox_reads import Filters
from evolution_ingest.stores.queues import (
    BROKER_ERRORS,
    HEADER_ATTEMPTS,
    HEADER_BUSY,
    HEADER_PARKED_AT,
    HEADER_REPLAYED_AT,
    Topology,
    broker,
)
from evolution_ingest.stores.refusals import RefusalLog

Progress = Callable[[int], None]
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_age(text: str) -> float:
    """``90m``, ``36h``, ``7d``, ``2w`` or plain seconds -> seconds."""
    match = _AGE.match(text.lower())
    if not match:
        raise ValueError(f"{text!r} is not an age like 90m, 36h, 7d or 2w")
    return float(match[1]) * _UNITS[match[2] or "s"]


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


def _still(result: Result) -> str:
    if result.done:
        return "recovered"
    return "still_locked" if result.outcome is Outcome.LOCKED else "still_failing"


async def replay_failed(
    ingestion: Ingestion, events: list[SavedEvent], report: ReplayReport, progress: Progress
) -> None:
    """Send each failed event on once more (its failure mark stays as history)."""
    report.failed_events = len(events)
    for event in events:
        if not report.dry_run:
            key = _still(await ingestion.ingest(Resend(event, give_up=False)))
            report.outcomes[key] = report.outcomes.get(key, 0) + 1
        progress(1)


def _refused_outcome(result: Result) -> str:
    match result.outcome:
        case Outcome.PROCESSED | Outcome.DUPLICATE:
            return result.outcome.value
        case Outcome.LOCKED:
            return "saved; being processed elsewhere"
        case Outcome.REFUSED:
            return f"still refused: {result.error}"
        case _:
            return f"saved; forward failed, the reconciler will finish it: {result.error}"


async def replay_refused(
    ingestion: Ingestion,
    refusals: RefusalLog,
    *,
    settings: Settings,
    found: list[tuple[int, str, bytes, bool]],
    report: ReplayReport,
    progress: Progress,
) -> None:
    """Re-submit refused bodies through the ingestion core, each as a copy from the channel that
    refused it; each is marked with its outcome."""
    report.refused += len(found)
    for refusal_id, source, body, truncated in found:
        if truncated:
            outcome = "still refused: the kept copy was cut at REFUSAL_MAX_BYTES"
        else:
            try:
                envelope = ingestion.envelope(
                    load_body(body, max_bytes=settings.max_body_bytes, max_keys=settings.max_json_keys)
                )
            except (BodyRejected, InvalidEvent) as exc:
                outcome = f"still refused: {exc.reason}"
            else:
                outcome = "would be re-submitted"
                if not report.dry_run:
                    outcome = _refused_outcome(
                        await ingestion.ingest(Relay(envelope, Channel(source.upper())))
                    )
        if not report.dry_run:
            await refusals.mark_replayed(refusal_id, outcome)
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
    async with broker(settings) as connection:
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
    #: Partitions of bodies wholly older than the age, dropped first, and the bodies they held
    #: (the planner's count; unprocessed events' bodies are kept in their row first).
    partitions: int = 0
    partition_bodies: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "payload_only": self.payload_only,
            "older_than_seconds": self.older_than_seconds,
            ("payloads_dropped" if self.payload_only else "rows_deleted"): self.rows,
            "body_partitions_dropped": self.partitions,
            "bodies_dropped_with_partitions": self.partition_bodies,
        }


def as_json(data: Any) -> str:
    return codec.dumps(data, default=str, indent=True).decode()
