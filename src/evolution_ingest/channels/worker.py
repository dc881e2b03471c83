"""The RabbitMQ worker: consume Evolution's queues; each message is decided and settled by
:mod:`evolution_ingest.channels.messages`.

Two connections: deliveries come on pika's (:mod:`evolution_ingest.channels.consumer`, the
cheap path every message takes), while declarations, republishing to the retry tiers and the
parking queue (with publisher confirms) and the watchdog's probes go on aio-pika's. A message
whose event this process has already seen processed is settled in pika's callback at once;
every other one is handled in a task of its own, at most ``WORKER_CONCURRENCY`` at a time.

A crash at any point leaves the message unacked (RabbitMQ redelivers it) or saved in
the inbox (the reconciler finishes it).

Connections are not "robust": the worker reconnects itself and declares and
consumes everything again, then checks regularly that its consumers are really
registered (the broker cancels a consumer whose queue was deleted).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Final

import aio_pika
import structlog
from aio_pika.abc import AbstractConnection

from evolution_ingest.channels.acks import Acks
from evolution_ingest.channels.consumer import Consumer
from evolution_ingest.channels.delivery import Delivery
from evolution_ingest.channels.messages import Action, Decision, Messages
from evolution_ingest.channels.topology import declare
from evolution_ingest.config import Settings
from evolution_ingest.core.identity import Envelope
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.stores.queues import (
    BROKER_ERRORS,
    Topology,
)
from evolution_ingest.stores.refusals import RefusalLog

log = structlog.get_logger(__name__)

_RECONNECT_DELAYS: Final = (0.5, 1.0, 2.0, 5.0, 10.0)
_NAME = "rabbitmq"


class Worker:
    """Consumes Evolution's queues (and the service's ready queue) on one connection."""

    def __init__(self, *, ingestion: Ingestion, settings: Settings, refusals: RefusalLog) -> None:
        self._counters = ingestion.counters
        self._settings = settings
        self.topology = Topology(settings)
        self._messages = Messages(
            ingestion=ingestion, settings=settings, refusals=refusals, topology=self.topology
        )
        self._slots = asyncio.Semaphore(settings.worker_concurrency)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        #: Tasks of the messages being handled (the fast ones have none).
        self._tasks: set[asyncio.Task[None]] = set()
        #: Set while consumers are registered on every queue (tests and readiness wait on it).
        self.consuming = asyncio.Event()

    # --- connection lifecycle ------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, reconnecting whenever the broker goes away."""
        failures = 0
        while not stop.is_set():
            try:
                connection, consumer = await self._connect()
            except BROKER_ERRORS as exc:
                delay = _RECONNECT_DELAYS[min(failures, len(_RECONNECT_DELAYS) - 1)]
                failures += 1
                log.warning("RabbitMQ unreachable, retrying", error=repr(exc), retry_in=delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                continue
            failures = 0
            try:
                await self._consume(connection, consumer, stop)
            except BROKER_ERRORS as exc:
                log.warning("RabbitMQ connection lost; reconnecting", error=repr(exc))
            finally:
                self.consuming.clear()
                self._messages.publisher = None
                self._messages.acks = None
                await consumer.close()
                with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                    await asyncio.wait_for(connection.close(), 5)
        log.info("worker stopped")

    async def _connect(self) -> tuple[AbstractConnection, Consumer]:
        url = self._settings.rabbitmq_url
        connection = await aio_pika.connect(
            url, timeout=10, client_properties={"connection_name": "evolution-ingest worker"}
        )
        try:
            consumer = await Consumer.open(
                url, prefetch=self._settings.rabbitmq_prefetch, name="evolution-ingest worker (deliveries)"
            )
        except BaseException:
            with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                await asyncio.wait_for(connection.close(), 5)
            raise
        return connection, consumer

    async def _consume(self, connection: AbstractConnection, consumer: Consumer, stop: asyncio.Event) -> None:
        lost = asyncio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())
        publish_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        publish_channel.close_callbacks.add(lambda *_: lost.set())
        await declare(publish_channel, self.topology)
        self._messages.publisher = publish_channel.default_exchange
        assert consumer.channel is not None
        acks = self._messages.acks = Acks(consumer.channel, self._counters)
        tags = [
            await consumer.consume(name, functools.partial(self._delivered, name))
            for name in self.topology.consumed_queues
        ]
        self.consuming.set()
        log.info("worker consuming", queues=len(tags), mode=self.topology.mode.value)

        waiting = [
            asyncio.create_task(stop.wait()),
            asyncio.create_task(lost.wait()),
            asyncio.create_task(consumer.closed.wait()),
            asyncio.create_task(self._watch(connection, consumer, tags, lost)),
        ]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waiting:
                task.cancel()
        self.consuming.clear()
        if lost.is_set() or consumer.closed.is_set():
            raise ConnectionError("connection or channel closed")
        # Stopping: take no more messages, finish those in flight, return the waiting ones.
        self._stopping = True
        for tag in tags:
            with contextlib.suppress(*BROKER_ERRORS):
                await consumer.cancel(tag)
        try:
            await asyncio.wait_for(self._idle.wait(), self._settings.shutdown_timeout_seconds)
        except TimeoutError:
            log.warning(
                "messages still in flight at shutdown; RabbitMQ will redeliver them", count=self._inflight
            )
        await acks.flush()

    async def _watch(
        self, connection: AbstractConnection, consumer: Consumer, tags: list[str], lost: asyncio.Event
    ) -> None:
        """Make sure every consumer is still registered, here and on the broker."""
        while True:
            await asyncio.sleep(self._settings.rabbitmq_watchdog_seconds)
            registered = consumer.consumer_tags
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
    def _delivered(self, queue: str, message: Delivery) -> None:
        """pika's callback for each delivery: settled at once when this process knows the event
        processed, else handled in a task of its own."""
        if self._stopping:
            return  # never started: the channel closes and RabbitMQ redelivers it
        started = time.perf_counter()
        try:
            decision, envelope = self._messages.decide_now(queue, message)
        except Exception:  # the edge: log with the traceback; the task below decides it again, guarded
            log.exception("unexpected error while reading a message", queue=queue)
            decision, envelope = None, None
        if decision is not None:
            self._messages.log_outcome(queue, decision, started)
            self._messages.ack_now(message)
            return
        task = asyncio.get_running_loop().create_task(self.handle(queue, message, envelope))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def handle(self, queue: str, message: Delivery, envelope: Envelope | None = None) -> None:
        """Decide, then settle, with bounded concurrency (``envelope``: the message, already read)."""
        self._inflight += 1
        self._idle.clear()
        try:
            async with self._slots:
                if self._stopping:
                    return  # never started: the channel closes and RabbitMQ redelivers it
                started = time.perf_counter()
                try:
                    decision = await self._messages.decide(queue, message, envelope)
                except Exception as exc:  # the edge: log with the traceback, count, and retry it
                    self._counters.incr(f"{_NAME}:errors")
                    log.exception("unexpected error while handling a message", queue=queue)
                    decision = Decision(
                        Action.RETRY, f"unexpected error: {type(exc).__name__}: {exc}", "error"
                    )
                self._messages.log_outcome(queue, decision, started)
                try:
                    await self._messages.settle(queue, message, decision)
                except BROKER_ERRORS as exc:
                    self._counters.incr(f"{_NAME}:settle_failed")
                    log.warning("message not settled; RabbitMQ will redeliver it", error=repr(exc))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
