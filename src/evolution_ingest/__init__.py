"""evolution-ingest: every Evolution API event, from webhook and RabbitMQ, processed once.

The public API for business logic is small: handlers receive an :class:`Event`.
"""

from evolution_ingest.core.events import Channel, Event
from evolution_ingest.core.identity import dedup_key

__all__ = ["Channel", "Event", "dedup_key"]
