"""One RabbitMQ delivery as the worker reads it: a thin view of aiormq's delivered message.

The worker consumes on aiormq's channel directly: each delivery runs as the one task aiormq
makes for it, without a second task and a full message object per delivery (what a consumer
registered through aio-pika's queue costs).
"""

from __future__ import annotations

from typing import Any

from aiormq.abc import AbstractChannel, DeliveredMessage


class Delivery:
    __slots__ = ("_message",)

    def __init__(self, message: DeliveredMessage) -> None:
        self._message = message

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def headers(self) -> dict[str, Any]:
        """A copy of the delivery's headers (the caller may change it)."""
        return dict(self._message.header.properties.headers or {})

    @property
    def content_type(self) -> str | None:
        return self._message.header.properties.content_type

    @property
    def routing_key(self) -> str | None:
        return self._message.routing_key

    @property
    def delivery_tag(self) -> int | None:
        return self._message.delivery_tag

    @property
    def channel(self) -> AbstractChannel:
        return self._message.channel

    async def ack(self) -> None:
        """Acknowledge this delivery alone, now (raises when its channel is closed)."""
        tag = self.delivery_tag
        assert tag is not None
        await self._message.channel.basic_ack(tag)
