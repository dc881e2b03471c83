"""The worker's data plane: deliveries of Evolution's queues on one pika channel.

pika's ``AsyncioConnection`` runs on the service's own event loop and decodes frames in plain
callbacks: no task, queue or future per frame. That costs about a third of the CPU per message
of aiormq under aio-pika (0.07 against 0.25 ms per message on the benchmark machine, see
docs/performance.md), and every event comes on this path once. What is rare and wants
awaitable confirms — declaring the topology, republishing to the retry tiers and the parking
queue, the watchdog's probes — stays on aio-pika (:mod:`evolution_ingest.channels.worker`).

Each call that waits for the broker (open, qos, consume, cancel) fails with
:class:`ConsumerClosed` when the channel or the connection closes meanwhile, and is bounded
by ``call_timeout``: nothing waits forever on a broker that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Final

import pika
import pika.channel
import pika.exceptions
import pika.spec
from pika.adapters.asyncio_connection import AsyncioConnection

from evolution_ingest.channels.delivery import Delivery

#: pika's errors meaning "the connection or channel is gone" (see ``BROKER_ERRORS``).
PIKA_ERRORS: Final = (pika.exceptions.AMQPError,)


class ConsumerClosed(ConnectionError):
    """The consumer's connection or channel closed (or never opened)."""


class Consumer:
    """One connection and one channel that consume queues and acknowledge deliveries."""

    def __init__(self, connection: AsyncioConnection, *, call_timeout: float) -> None:
        self._connection = connection
        self._timeout = call_timeout
        self.channel: pika.channel.Channel | None = None
        #: Set once the connection or the channel has closed, whoever closed it.
        self.closed = asyncio.Event()
        self._waiting: set[asyncio.Future[Any]] = set()

    @classmethod
    async def open(cls, url: str, *, prefetch: int, name: str, call_timeout: float = 10.0) -> Consumer:
        """Connect, open a channel and set its prefetch (per consumer); :class:`ConsumerClosed` if that fails."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[None] = loop.create_future()
        parameters = pika.URLParameters(url)
        parameters.client_properties = {"connection_name": name}
        parameters.connection_attempts = 1
        parameters.socket_timeout = call_timeout
        consumer: Consumer | None = None

        def on_open(_: Any) -> None:
            if not opened.done():
                opened.set_result(None)

        def on_error(_: Any, exc: BaseException) -> None:
            if not opened.done():
                opened.set_exception(ConsumerClosed(f"cannot connect: {exc!r}"))
            if consumer is not None:
                consumer._lost(exc)

        connection = AsyncioConnection(parameters, on_open, on_error, on_error, custom_ioloop=loop)
        consumer = cls(connection, call_timeout=call_timeout)
        try:
            await asyncio.wait_for(opened, call_timeout)
            channel: pika.channel.Channel = await consumer._call(
                lambda done: connection.channel(on_open_callback=done)
            )
            channel.add_on_close_callback(lambda _, exc: consumer._lost(exc))
            consumer.channel = channel
            await consumer._call(lambda done: channel.basic_qos(prefetch_count=prefetch, callback=done))
        except BaseException:
            await consumer.close()
            raise
        return consumer

    def _lost(self, exc: BaseException) -> None:
        self.closed.set()
        for future in self._waiting:
            if not future.done():
                future.set_exception(ConsumerClosed(f"RabbitMQ closed the consumer: {exc!r}"))

    async def _call(self, start: Callable[[Callable[[Any], None]], Any]) -> Any:
        """Start a broker call with a completion callback; wait for it (or for the channel to close)."""
        if self.closed.is_set():
            raise ConsumerClosed("the consumer is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def done(result: Any) -> None:
            if not future.done():
                future.set_result(result)

        self._waiting.add(future)
        try:
            start(done)
            return await asyncio.wait_for(future, self._timeout)
        except PIKA_ERRORS as exc:
            raise ConsumerClosed(f"RabbitMQ refused the call: {exc!r}") from exc
        finally:
            self._waiting.discard(future)

    def _open_channel(self) -> pika.channel.Channel:
        if self.channel is None or not self.channel.is_open:
            raise ConsumerClosed("the consumer's channel is closed")
        return self.channel

    async def consume(self, queue: str, on_message: Callable[[Delivery], None]) -> str:
        """Consume ``queue`` (manual acks); ``on_message`` runs in pika's read callback: it must not block."""
        channel = self._open_channel()

        def delivered(
            _: pika.channel.Channel, method: pika.spec.Basic.Deliver, properties: pika.spec.BasicProperties,
            body: bytes,
        ) -> None:  # fmt: skip
            on_message(Delivery(channel, method, properties, body))

        ok = await self._call(lambda done: channel.basic_consume(queue, delivered, callback=done))
        return str(ok.method.consumer_tag)

    async def cancel(self, tag: str) -> None:
        channel = self._open_channel()
        await self._call(lambda done: channel.basic_cancel(tag, callback=done))

    @property
    def consumer_tags(self) -> list[str]:
        """Consumers still registered (the broker cancels one when its queue is deleted)."""
        return self.channel.consumer_tags if self.channel is not None and self.channel.is_open else []

    async def close(self) -> None:
        """Close the connection (unacknowledged deliveries go back to their queues)."""
        if not self._connection.is_closed and not self._connection.is_closing:
            with contextlib.suppress(*PIKA_ERRORS):
                self._connection.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.closed.wait(), self._timeout)
