"""The RabbitMQ worker: consume Evolution's queues, save each event, forward it, settle it once.

For each message: parse ▸ lock ▸ inbox ▸ save raw (channel RABBITMQ) ▸ forward to
the webhook app ▸ then exactly one settlement (:meth:`Worker.settle`):

* done (processed or a duplicate): ack;
* locked (being processed elsewhere): back after ``LOCK_BUSY_DELAY_SECONDS`` via
  the lock-busy queue, without using the retry budget; after
  ``LOCK_BUSY_MAX_RETURNS`` it is acked anyway — it is saved, the reconciler heals it;
* forward failed (or Postgres unreachable): next retry tier, then the parking queue;
* not JSON, not an Evolution event, too large, a row Postgres cannot store: kept as a
  refusal (:mod:`evolution_ingest.refusals`) and acked; the parking queue, with the
  reason, when the refusal cannot be written (Postgres away).

Every republish waits for the broker's confirm before the original is acked, and
nothing is ever nacked back onto its queue (quorum queues count redeliveries and
drop or dead-letter a message past its delivery limit). A crash at any point
leaves the message unacked (RabbitMQ redelivers it) or saved in the inbox (the
reconciler finishes it). Attempts are counted in the service's own header, not
``x-death``.

Connections are not "robust": the worker reconnects itself and declares and
consumes everything again, then checks regularly that its consumers are really
registered (some clients silently lose them on reconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractIncomingMessage

from evolution_ingest.channels.topology import declare
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

_RECONNECT_DELAYS: Final = (0.5, 1.0, 2.0, 5.0, 10.0)
_NAME = "rabbitmq"


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


class Worker:
    """Consumes Evolution's queues (and the service's ready queue) on one connection."""

    def __init__(self, *, ingestion: Ingestion, settings: Settings, refusals: RefusalLog) -> None:
        self._ingestion = ingestion
        self._refusals = refusals
        self._counters = ingestion.counters
        self._settings = settings
        self.topology = Topology(settings)
        self._slots = asyncio.Semaphore(settings.worker_concurrency)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._publisher: AbstractExchange | None = None
        #: Set while consumers are registered on every queue (tests and readiness wait on it).
        self.consuming = asyncio.Event()

    # --- connection lifecycle ------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, reconnecting whenever the broker goes away."""
        failures = 0
        while not stop.is_set():
            try:
                connection = await aio_pika.connect(
                    self._settings.rabbitmq_url,
                    timeout=10,
                    client_properties={"connection_name": "evolution-ingest worker"},
                )
            except BROKER_ERRORS as exc:
                delay = _RECONNECT_DELAYS[min(failures, len(_RECONNECT_DELAYS) - 1)]
                failures += 1
                log.warning("RabbitMQ unreachable, retrying", error=repr(exc), retry_in=delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                continue
            failures = 0
            try:
                await self._consume(connection, stop)
            except BROKER_ERRORS as exc:
                log.warning("RabbitMQ connection lost; reconnecting", error=repr(exc))
            finally:
                self.consuming.clear()
                self._publisher = None
                with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                    await asyncio.wait_for(connection.close(), 5)
        log.info("worker stopped")

    async def _consume(self, connection: AbstractConnection, stop: asyncio.Event) -> None:
        lost = asyncio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())
        publish_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        consume_channel = await connection.channel(publisher_confirms=False)
        for channel in (publish_channel, consume_channel):
            channel.close_callbacks.add(lambda *_: lost.set())
        await declare(publish_channel, self.topology)
        await consume_channel.set_qos(prefetch_count=self._settings.rabbitmq_prefetch)
        self._publisher = publish_channel.default_exchange
        consumers = []
        for name in self.topology.consumed_queues:
            queue = await consume_channel.get_queue(name, ensure=False)
            tag = await queue.consume(functools.partial(self.handle, name))
            consumers.append((queue, tag))
        self.consuming.set()
        log.info("worker consuming", queues=len(consumers), mode=self.topology.mode.value)

        waiting = [
            asyncio.create_task(stop.wait()),
            asyncio.create_task(lost.wait()),
            asyncio.create_task(self._watch(connection, consume_channel, [t for _, t in consumers], lost)),
        ]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waiting:
                task.cancel()
        self.consuming.clear()
        if lost.is_set():
            raise ConnectionError("connection or channel closed")
        # Stopping: take no more messages, finish those in flight, return the waiting ones.
        self._stopping = True
        for queue, tag in consumers:
            with contextlib.suppress(*BROKER_ERRORS):
                await queue.cancel(tag)
        try:
            await asyncio.wait_for(self._idle.wait(), self._settings.shutdown_timeout_seconds)
        except TimeoutError:
            log.warning(
                "messages still in flight at shutdown; RabbitMQ will redeliver them", count=self._inflight
            )

    async def _watch(
        self, connection: AbstractConnection, channel: AbstractChannel, tags: list[str], lost: asyncio.Event
    ) -> None:
        """Make sure every consumer is still registered, here and on the broker."""
        while True:
            await asyncio.sleep(self._settings.rabbitmq_watchdog_seconds)
            underlay = await channel.get_underlay_channel()
            registered = underlay.consumers if isinstance(underlay, aiormq.Channel) else {}
            missing = [tag for tag in tags if tag not in registered]
            if not missing:
                missing = await self._unconsumed_queues(connection)
            if missing:
                self._counters.incr(f"{_NAME}:consumer_lost")
                log.error("consumers lost; reconnecting to register them again", missing=missing)
                lost.set()
                return

    async def _unconsumed_queues(self, connection: AbstractConnection) -> list[str]:
        probe = await connection.channel(publisher_confirms=False)
        try:
            empty = []
            for name in self.topology.consumed_queues:
                declared = await probe.declare_queue(name, passive=True)
                if declared.declaration_result.consumer_count == 0:
                    empty.append(name)
            return empty
        finally:
            with contextlib.suppress(*BROKER_ERRORS):
                await probe.close()

    # --- one message ----------------------------------------------------------------------
    async def handle(self, queue: str, message: AbstractIncomingMessage) -> None:
        """The consumer callback: decide, then settle, with bounded concurrency."""
        self._inflight += 1
        self._idle.clear()
        try:
            async with self._slots:
                if self._stopping:
                    return  # never started: the channel closes and RabbitMQ redelivers it
                started = time.perf_counter()
                try:
                    decision = await self.decide(queue, message)
                except Exception as exc:  # the edge: log with the traceback, count, and retry it
                    self._counters.incr(f"{_NAME}:errors")
                    log.exception("unexpected error while handling a message", queue=queue)
                    decision = Decision(
                        Action.RETRY, f"unexpected error: {type(exc).__name__}: {exc}", "error"
                    )
                self._log_outcome(queue, decision, started)
                try:
                    await self.settle(queue, message, decision)
                except BROKER_ERRORS as exc:
                    self._counters.incr(f"{_NAME}:settle_failed")
                    log.warning("message not settled; RabbitMQ will redeliver it", error=repr(exc))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _log_outcome(self, queue: str, decision: Decision, started: float) -> None:
        envelope = decision.envelope
        getattr(log, "info" if self._settings.log_outcomes else "debug")(
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
        self, queue: str, message: AbstractIncomingMessage, code: str, reason: str, envelope: Envelope | None
    ) -> Decision:
        """Keep a message that can never be processed as a refusal and ack it; park it if it cannot be kept."""
        origin = f"{queue} [{message.routing_key or ''}]"
        try:
            await self._refusals.record(Refusal(_NAME, code, reason, message.body, None, origin))
        except StoreUnavailable:
            return Decision(Action.PARK, reason, "invalid", envelope)
        return Decision(Action.ACK, reason, "refused", envelope)

    async def decide(self, queue: str, message: AbstractIncomingMessage) -> Decision:
        try:
            body = load_body(
                message.body, max_bytes=self._settings.max_body_bytes, max_keys=self._settings.max_json_keys
            )
            envelope = self._ingestion.envelope(body)
        except (BodyRejected, InvalidEvent) as exc:
            self._counters.incr(f"{_NAME}:invalid")
            return await self._refuse(queue, message, exc.code, f"not an Evolution event: {exc.reason}", None)
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

    async def settle(self, queue: str, message: AbstractIncomingMessage, decision: Decision) -> None:
        """The one place a message is acknowledged, delayed, retried or parked."""
        headers = dict(message.headers or {})
        if decision.action is Action.ACK:
            await message.ack()
            return
        if decision.action is Action.BUSY:
            returns = _header_int(headers, HEADER_BUSY)
            if returns >= self._settings.lock_busy_max_returns:
                self._counters.incr(f"{_NAME}:busy_gave_up")
                log.info("event still locked; acknowledging (it is saved)", returns=returns)
            else:
                self._counters.incr(f"{_NAME}:lock_busy")
                await self._republish(queue, message, self.topology.busy.queue, {HEADER_BUSY: returns + 1})
            await message.ack()
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
            await message.ack()
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
        await message.ack()

    async def _republish(
        self, queue: str, message: AbstractIncomingMessage, target: str, extra: dict[str, Any]
    ) -> None:
        if self._publisher is None:
            raise aio_pika.exceptions.ChannelInvalidStateError("no publish channel")
        headers: dict[str, Any] = dict(message.headers or {})
        headers.setdefault(HEADER_ORIGIN, queue)
        headers.setdefault(HEADER_ROUTING_KEY, message.routing_key or "")
        headers.update(extra)
        copy = aio_pika.Message(
            body=message.body,
            headers=headers,
            content_type=message.content_type or "application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._publisher.publish(copy, routing_key=target)
