"""Copies of single-message events saved under their key of version 1.

Since key version 2, ``messages.upsert`` and ``send.message`` are identified by their message
(:mod:`evolution_ingest.core.identity`). An inbox that held version-1 rows when it was migrated
(``evolution_ingest_meta.message_key_v2``) may still receive late copies of them — an Evolution
retry, a message that waited in RabbitMQ through the upgrade. For ``IDENTITY_V1_COMPAT_SECONDS``
after the migration, a copy whose version-1 key names a saved row takes that row's key, and is
then a duplicate like any other copy. A fresh inbox never pays for it.
"""

from __future__ import annotations

import dataclasses
import time

from evolution_ingest.core.identity import SINGLE_MESSAGE_EVENTS, Envelope, legacy_dedup_key
from evolution_ingest.stores.inbox import PostgresInbox


class LegacyKeys:
    def __init__(self, inbox: PostgresInbox, compat_seconds: float) -> None:
        self._inbox = inbox
        self._compat = compat_seconds
        #: Until when (Unix time) to look; None until read (Postgres may be away at start).
        self._until: float | None = None if compat_seconds > 0 else 0.0

    async def _window(self) -> float:
        if self._until is None:
            since = await self._inbox.message_key_v2_since()
            self._until = since.timestamp() + self._compat if since is not None else 0.0
        return self._until

    def applies(self, envelope: Envelope) -> bool:
        """Whether :meth:`resolve` may change ``envelope`` (False for nearly every copy, at no cost)."""
        return self._until != 0.0 and envelope.event in SINGLE_MESSAGE_EVENTS

    async def resolve(self, envelope: Envelope) -> Envelope:
        """``envelope``, with the key of its version-1 row when there is one (see above)."""
        if not self.applies(envelope):
            return envelope
        if time.time() >= await self._window():
            self._until = 0.0  # the window has passed: never look again
            return envelope
        legacy = legacy_dedup_key(envelope.event, envelope.instance, envelope.data, envelope.date_time)
        if legacy != envelope.dedup_key and await self._inbox.exists(legacy):
            return dataclasses.replace(envelope, dedup_key=legacy)
        return envelope
