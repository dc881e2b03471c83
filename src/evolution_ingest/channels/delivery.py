"""One RabbitMQ delivery as the worker reads it: a thin view of what pika hands the consumer."""

from __future__ import annotations

from typing import Any

import pika.channel
import pika.spec


class Delivery:
    __slots__ = ("_method", "_properties", "body", "channel")

    def __init__(
        self,
        channel: pika.channel.Channel,
        method: pika.spec.Basic.Deliver,
        properties: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        #: The channel it came on: only that channel can acknowledge it.
        self.channel = channel
        self._method = method
        self._properties = properties
        self.body = body

    @property
    def headers(self) -> dict[str, Any]:
        """A copy of the delivery's headers (the caller may change it)."""
        return dict(self._properties.headers or {})

    # pika's frame attributes are untyped: each is given its type here, once.
    @property
    def content_type(self) -> str | None:
        value: str | None = self._properties.content_type
        return value

    @property
    def routing_key(self) -> str | None:
        value: str | None = self._method.routing_key
        return value

    @property
    def delivery_tag(self) -> int | None:
        value: int | None = self._method.delivery_tag
        return value

    async def ack(self) -> None:
        """Acknowledge this delivery alone, now (raises when its channel is closed)."""
        tag = self.delivery_tag
        assert tag is not None
        self.channel.basic_ack(tag)
