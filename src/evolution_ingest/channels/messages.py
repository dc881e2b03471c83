"""One RabbitMQ message: what came of it (through the ingestion core), then exactly one settlement.

For each message: parse ▸ ``Relay`` to the core (lock ▸ inbox ▸ save ▸ the business logic
runs where it runs) ▸ then one settlement (:meth:`Messages.settle`):

* done (processed or a duplicate): ack;
* locked (being processed elsewhere): back after ``LOCK_BUSY_DELAY_SECONDS`` via the
  lock-busy queue, without using the retry budget; after ``LOCK_BUSY_MAX_RETURNS`` it is
  acked anyway — it is saved, the reconciler heals it;
* forward failed (or Postgres unreachable, or an unexpected error): next retry tier, then
  the parking queue;
* not JSON, not an Evolution event, too large, a row Postgres cannot store: kept as a
  refusal (:mod:`evolution_ingest.stores.refusals`) and acked; the parking queue, with the
  reason, when the refusal cannot be written (Postgres away).

Every republish waits for the broker's confirm before the original is acked, and
nothing is ever nacked back onto its queue (quorum queues count redeliveries and drop
or dead-letter a message past its delivery limit). Attempts are counted in the
service's own header, not ``x-death``.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import aio_pika
import structlog
from aio_pika.abc import AbstractExchange

from evolution_ingest.channels.acks import Acks
from evolution_ingest.channels.delivery import Delivery
from evolution_ingest.config import Settings
from evolution_ingest.core.body import BodyRejected, load_body
from evolution_ingest.core.contract import Outcome, Relay
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope, InvalidEvent
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.stores.postgres import StoreUnavailable
from evolution_ingest.stores.queues import (
    BROKER_ERRORS,
    HEADER_ATTEMPTS,
    HEADER_BUSY,
    HEADER_ERROR,
    HEADER_ORIGIN,
    HEADER_PARKED_AT,
    HEADER_PARKED_REASON,
    HEADER_ROUTING_KEY,
    Topology,
)
from evolution_ingest.stores.refusals import Refusal, RefusalLog

log = structlog.get_logger(__name__)

_NAME: Final = "rabbitmq"


class Action(enum.StrEnum):
    """How a message is settled (see :meth:`Worker.settle`)."""

    ACK = "ack"
    BUSY = "busy"
    RETRY = "retry"
    PARK = "park"


#: The settlement of each outcome of the core (a refusal is kept, then acked: see ``_refuse``).
SETTLEMENT: Final = {
    Outcome.PROCESSED: Action.ACK,
    Outcome.DUPLICATE: Action.ACK,
    Outcome.LOCKED: Action.BUSY,
    Outcome.FAILED: Action.RETRY,
    Outcome.UNREACHABLE: Action.RETRY,
    Outcome.NOT_FOUND: Action.RETRY,
}


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str | None = None
    #: What happened, for the outcome log line: the core's outcome, or invalid / unavailable / error.
    outcome: str = ""
    envelope: Envelope | None = None


def _header_int(headers: dict[str, Any], name: str) -> int:
    value = headers.get(name)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    try:
        return max(0, int(value)) if value is not None else 0
    except (TypeError, ValueError):
        return 0


class Messages:
    """Decides and settles messages; the worker owns the connection and hands them in."""

    def __init__(
        self, *, ingestion: Ingestion, settings: Settings, refusals: RefusalLog, topology: Topology
    ) -> None:
        self._ingestion = ingestion
        self._counters = ingestion.counters
        self._refusals = refusals
        self._settings = settings
        self.topology = topology
        #: The default exchange of the publishing channel, while connected.
        self.publisher: AbstractExchange | None = None
        #: The batched acknowledgements of the consuming channel, while connected.
        self.acks: Acks | None = None
        level = logging.INFO if settings.log_outcomes else logging.DEBUG
        #: Whether outcome lines pass the log level: when not, not even their fields are built.
        self._log_outcomes = logging.getLevelName(settings.log_level.upper()) <= level
        self._outcome = "info" if settings.log_outcomes else "debug"

    def log_outcome(self, queue: str, decision: Decision, started: float) -> None:
        if not self._log_outcomes:
            return
        envelope = decision.envelope
        getattr(log, self._outcome)(
            "outcome",
            outcome=decision.outcome,
            action=decision.action.value,
            event_name=envelope.event if envelope else None,
            instance=envelope.instance if envelope else None,
            dedup_key=envelope.dedup_key if envelope else None,
            channel=_NAME,
            queue=queue,
            duration_ms=round((time.perf_counter() - started) * 1000, 2),
        )

    async def _refuse(
        self, queue: str, message: Delivery, code: str, reason: str, envelope: Envelope | None
    ) -> Decision:
        """Keep a message that can never be processed as a refusal and ack it; park it if it cannot be kept."""
        origin = f"{queue} [{message.routing_key or ''}]"
        try:
            await self._refusals.record(Refusal(_NAME, code, reason, message.body, None, origin))
        except StoreUnavailable:
            return Decision(Action.PARK, reason, "invalid", envelope)
        return Decision(Action.ACK, reason, "refused", envelope)

    def _read(self, message: Delivery) -> Envelope:
        """The message as an event; :class:`BodyRejected` or :class:`InvalidEvent` if it is not one."""
        body = load_body(
            message.body, max_bytes=self._settings.max_body_bytes, max_keys=self._settings.max_json_keys
        )
        return self._ingestion.envelope(body)

    def decide_now(self, queue: str, message: Delivery) -> tuple[Decision | None, Envelope | None]:
        """Decide without waiting when this process knows the event processed; else (None, the
        envelope read, or None if it is not an event: :meth:`decide` refuses it)."""
        try:
            envelope = self._read(message)
        except (BodyRejected, InvalidEvent):
            return None, None
        result = self._ingestion.known(envelope, Channel.RABBITMQ)
        if result is None:
            return None, envelope
        return Decision(SETTLEMENT[result.outcome], result.error, result.outcome.value, envelope), envelope

    async def decide(self, queue: str, message: Delivery, envelope: Envelope | None = None) -> Decision:
        """What comes of ``message`` (``envelope``: the message already read by :meth:`decide_now`)."""
        if envelope is None:
            try:
                envelope = self._read(message)
            except (BodyRejected, InvalidEvent) as exc:
                self._counters.incr(f"{_NAME}:invalid")
                reason = f"not an Evolution event: {exc.reason}"
                return await self._refuse(queue, message, exc.code, reason, None)
        try:
            result = await self._ingestion.ingest(Relay(envelope, Channel.RABBITMQ))
        except StoreUnavailable as exc:
            self._counters.incr(f"{_NAME}:unavailable")
            return Decision(Action.RETRY, str(exc), "unavailable", envelope)
        if result.outcome is Outcome.REFUSED:
            self._counters.incr(f"{_NAME}:invalid")
            return await self._refuse(
                queue, message, result.code or "unstorable", result.error or "refused", envelope
            )
        return Decision(SETTLEMENT[result.outcome], result.error, result.outcome.value, envelope)

    async def settle(self, queue: str, message: Delivery, decision: Decision) -> None:
        """The one place a message is acknowledged, delayed, retried or parked."""
        headers = message.headers
        if decision.action is Action.ACK:
            await self._ack(message)
            return
        if decision.action is Action.BUSY:
            returns = _header_int(headers, HEADER_BUSY)
            if returns >= self._settings.lock_busy_max_returns:
                self._counters.incr(f"{_NAME}:busy_gave_up")
                log.info("event still locked; acknowledging (it is saved)", returns=returns)
            else:
                self._counters.incr(f"{_NAME}:lock_busy")
                await self._republish(queue, message, self.topology.busy.queue, {HEADER_BUSY: returns + 1})
            await self._ack(message)
            return
        attempts = _header_int(headers, HEADER_ATTEMPTS)
        if decision.action is Action.RETRY and attempts < len(self.topology.tiers):
            tier = self.topology.tiers[attempts]
            self._counters.incr(f"{_NAME}:retried")
            self._counters.incr(f"{_NAME}:retry_tier:{attempts + 1}")
            await self._republish(
                queue,
                message,
                tier.queue,
                {HEADER_ATTEMPTS: attempts + 1, HEADER_ERROR: decision.reason or ""},
            )
            await self._ack(message)
            return
        reason = decision.reason or "unknown"
        if decision.action is Action.RETRY:
            reason = f"gave up after {attempts} retries: {reason}"
        self._counters.incr(f"{_NAME}:parked")
        log.error("message parked", reason=reason, queue=queue)
        await self._republish(
            queue,
            message,
            self.topology.parking,
            {HEADER_PARKED_REASON: reason[:1000], HEADER_PARKED_AT: datetime.now(UTC).isoformat()},
        )
        await self._ack(message)

    async def _ack(self, message: Delivery) -> None:
        acks = self.acks
        if acks is not None and acks.owns(message):
            assert message.delivery_tag is not None
            acks.settled(message.delivery_tag)
        else:  # its channel is gone (the broker redelivers it), or no batching: alone, now
            await message.ack()

    def ack_now(self, message: Delivery) -> None:
        """Acknowledge a message decided at once (:meth:`decide_now`): with the batch, or alone."""
        acks = self.acks
        if acks is not None and acks.owns(message):
            assert message.delivery_tag is not None
            acks.settled(message.delivery_tag)
            return
        try:
            assert message.delivery_tag is not None
            message.channel.basic_ack(message.delivery_tag)
        except BROKER_ERRORS as exc:
            self._counters.incr(f"{_NAME}:settle_failed")
            log.warning("message not settled; RabbitMQ will redeliver it", error=repr(exc))

    async def _republish(self, queue: str, message: Delivery, target: str, extra: dict[str, Any]) -> None:
        if self.publisher is None:
            raise aio_pika.exceptions.ChannelInvalidStateError("no publish channel")
        headers = message.headers  # a copy of the delivery's
        headers.setdefault(HEADER_ORIGIN, queue)
        headers.setdefault(HEADER_ROUTING_KEY, message.routing_key or "")
        headers.update(extra)
        copy = aio_pika.Message(
            body=message.body,
            headers=headers,
            content_type=message.content_type or "application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self.publisher.publish(copy, routing_key=target)
