"""The one contract of the ingestion core: a request in, a result out.

Every way into the core is a :class:`Request`, and everything that answers is a
:class:`Result`, whichever channel asks:

* :class:`Receive` — a copy from Evolution's webhook: save it, run the business logic here;
* :class:`Relay` — a copy from another source (RabbitMQ, a replay): save it, then have the
  business logic run where it runs (the webhook app: in this process, or by a forward);
* :class:`RunSaved` — a forward of an event already saved (``already_saved``): run it here;
* :class:`Resend` — a saved event that was never processed (a crash, an outage): send it
  on again (the reconciler, ``replay``).

Expected outcomes are :class:`Outcome` values; Postgres being unreachable is the exception
:class:`~evolution_ingest.stores.postgres.StoreUnavailable`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope


class Outcome(enum.StrEnum):
    #: Business logic completed (in this call, or by the forward it made).
    PROCESSED = "processed"
    #: Business logic had already completed for this event.
    DUPLICATE = "duplicate"
    #: Another copy holds the event right now; this copy is saved.
    LOCKED = "locked"
    #: A handler raised; the event is saved with its error and will be tried again.
    FAILED = "failed"
    #: Saved, but the forward did not reach the business logic (the webhook app is away).
    UNREACHABLE = "unreachable"
    #: A forward or re-send for an event that has no inbox row.
    NOT_FOUND = "not_found"
    #: Postgres cannot store this event (its data, not the connection): never retried.
    REFUSED = "refused"
    #: A re-send out of attempts: marked failed; only an operator's replay tries it again.
    GIVEN_UP = "given_up"


#: Outcomes after which nothing is left to do for the event.
DONE: Final = frozenset({Outcome.PROCESSED, Outcome.DUPLICATE})


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    dedup_key: str
    row_id: int | None = None
    #: Why it failed or was refused (for logs, headers, ``last_error``).
    error: str | None = None
    #: The refusal's code (``Outcome.REFUSED``): ``unstorable``, ``too_deep``...
    code: str | None = None

    @property
    def done(self) -> bool:
        return self.outcome in DONE


@dataclass(frozen=True, slots=True)
class SavedEvent:
    """An inbox row as a re-send needs it: the body as received, and where it stands."""

    id: int
    dedup_key: str
    payload: dict[str, Any] | None
    attempts: int
    received_at: datetime


@dataclass(frozen=True, slots=True)
class Receive:
    envelope: Envelope
    channel: Channel = Channel.WEBHOOK


@dataclass(frozen=True, slots=True)
class Relay:
    envelope: Envelope
    channel: Channel = Channel.RABBITMQ


@dataclass(frozen=True, slots=True)
class RunSaved:
    envelope: Envelope


@dataclass(frozen=True, slots=True)
class Resend:
    event: SavedEvent
    #: Mark the event failed once it is out of attempts (the reconciler); a replay never does.
    give_up: bool = True


Request = Receive | Relay | RunSaved | Resend


class Forwarder(Protocol):
    """How a saved event reaches the business logic of another process (the webhook app)."""

    async def forward(self, envelope: Envelope) -> Result: ...

    async def close(self) -> None: ...
