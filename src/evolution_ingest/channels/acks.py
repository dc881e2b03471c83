"""Acknowledgements of one consuming channel, sent in batches.

A settled message is not acked on its own. Once per turn of the event loop, one ``basic.ack``
with ``multiple=True`` acknowledges every delivery up to the highest tag below which all are
settled. Delivery tags of a channel are consecutive from 1 (AMQP 0-9-1, §1.8.3.13), so that
is known without tracking deliveries: nothing below the tag can still be in flight.

A settled delivery above one still in flight waits at most ``hold`` seconds, then is acked
alone: a slow message never holds back the others' acks, nor fills the prefetch window.

An ack that does not reach the broker (the channel closed) loses nothing: the broker
redelivers the message, and its copy is a duplicate. Before a stopping worker closes the
channel, :meth:`Acks.flush` sends every ack still held. Sending one is writing a frame
(pika's ``basic_ack``): nothing to wait for.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import pika.channel
import structlog

from evolution_ingest.channels.delivery import Delivery
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.queues import BROKER_ERRORS

log = structlog.get_logger(__name__)

#: How long a settled delivery above an unsettled one waits before it is acked alone.
HOLD_SECONDS: Final = 0.2


class Acks:
    def __init__(self, channel: pika.channel.Channel, counters: Counters, *, hold: float = HOLD_SECONDS):
        self._channel = channel
        self._counters = counters
        self._hold = hold
        #: The lowest delivery tag not yet acknowledged by a multiple ack.
        self._next = 1
        #: Settled, not yet acknowledged: tag → when it was settled.
        self._settled: dict[int, float] = {}
        #: Acked alone, above ``_next``: skipped when the multiple ack reaches them.
        self._alone: set[int] = set()
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        #: Frames sent, and deliveries they acknowledged (tests and benchmarks read them).
        self.frames = 0
        self.acked = 0

    def owns(self, message: Delivery) -> bool:
        """Whether ``message`` came on this channel (not on one closed since)."""
        return message.channel is self._channel and self._channel.is_open and message.delivery_tag is not None

    def settled(self, tag: int) -> None:
        """The message with ``tag`` is settled (done, or republished and confirmed): ack it soon."""
        self._settled[tag] = time.monotonic()
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        for frame in self._frames(time.monotonic() - self._hold):
            self._send(*frame)
        if self._settled and self._timer is None:  # some wait above a delivery still in flight
            self._timer = asyncio.get_running_loop().call_later(self._hold, self._late)

    def _late(self) -> None:
        self._timer = None
        self._flush()

    def _frames(self, older_than: float) -> list[tuple[int, bool, int]]:
        """(tag, multiple, deliveries) of each ack to send now."""
        frames = []
        upto, count = 0, 0
        while self._next in self._settled or self._next in self._alone:
            if self._settled.pop(self._next, None) is not None:
                upto, count = self._next, count + 1
            else:  # acked alone already: the multiple ack must not name it
                self._alone.discard(self._next)
            self._next += 1
        if count:
            frames.append((upto, True, count))
        for tag, at in list(self._settled.items()):
            if at <= older_than:
                del self._settled[tag]
                self._alone.add(tag)
                frames.append((tag, False, 1))
        return frames

    def _send(self, tag: int, multiple: bool, count: int) -> None:
        try:
            self._channel.basic_ack(tag, multiple=multiple)
        except (*BROKER_ERRORS, RuntimeError) as exc:
            self._counters.incr("rabbitmq:settle_failed", count)
            log.warning("acknowledgement not sent; RabbitMQ will redeliver", error=repr(exc), messages=count)
            return
        self.frames += 1
        self.acked += count

    async def flush(self) -> None:
        """Send every ack still held (before the channel closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._scheduled = False
        for frame in self._frames(float("inf")):
            self._send(*frame)
