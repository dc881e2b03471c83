"""evolution-ingest: every Evolution API event, from webhook and RabbitMQ, processed once.

The public API for business logic is small: handlers receive an :class:`Event`.
"""

from evolution_ingest.events import Channel, Event
from evolution_ingest.identity import dedup_key

__all__ = ["Channel", "Event", "dedup_key"]
