"""The event handed to business logic, and the channels it can arrive by."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any


class Channel(enum.StrEnum):
    """How an event reached us. Stored in the inbox as its upper-case name."""

    WEBHOOK = "WEBHOOK"
    RABBITMQ = "RABBITMQ"
    #: Evolution's stored messages, for messages neither channel delivered (``backfill``).
    BACKFILL = "BACKFILL"


@dataclass(frozen=True, slots=True)
class Event:
    """One de-duplicated Evolution event, as business logic sees it.

    ``payload`` is the stored body (the first channel's copy, without the
    fields this service adds). ``dedup_key`` doubles as the idempotency key: in
    the one allowed repeat (a crash after the logic ran and before it was marked
    processed) the handler sees the same key again.
    """

    dedup_key: str
    event: str
    instance: str
    data: Any
    payload: Mapping[str, Any]
    channel: Channel
    received_at: datetime
    #: Evolution's ``date_time`` (local time labelled Z), when present.
    date_time: str | None = None
    #: How many times business logic was tried before this attempt.
    attempts: int = 0
    #: The row's id in the inbox.
    id: int = 0
