"""The reconciler: finish events that were saved but never processed (a crash, an outage).

Every ``RECONCILE_INTERVAL_SECONDS`` it reads stuck events (pending for more than
``RECONCILE_AFTER_SECONDS``, oldest first, in bounded batches, skipping those whose
claim is still alive) and sends each one on again through the ingestion core
(:class:`~evolution_ingest.core.contract.Resend`): the core takes its lock and forwards
it to the webhook app, where business logic runs under the row claim, so a re-send
can never make it run twice.

Only one reconciler works at a time however many replicas run: the leader holds a
Postgres advisory lock on a connection of its own; when it dies the connection
closes, the lock goes, and another replica takes over at its next interval.

An event whose business logic keeps failing is marked failed once it has had
``RECONCILE_MAX_ATTEMPTS`` attempts, instead of being retried forever; ``replay``
sends it again once the cause is fixed. A forward that fails because the webhook app
is unreachable is not an attempt: it never marks an event failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import structlog

from evolution_ingest.config import Settings
from evolution_ingest.core.contract import Outcome, Resend, Result, SavedEvent
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.core.resend import RESENDS
from evolution_ingest.stores import leadership
from evolution_ingest.stores.inbox_reads import InboxReads
from evolution_ingest.stores.postgres import StoreUnavailable

log = structlog.get_logger(__name__)

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
#: What a pass reports for each outcome of a re-send.
_REPORTED: Final = {
    Outcome.PROCESSED: "recovered",
    Outcome.DUPLICATE: "recovered",
    Outcome.LOCKED: "locked",
    Outcome.GIVEN_UP: "dead",
}


def reported(result: Result) -> str:
    """recovered, locked, dead, or failing (the event stays for a later pass)."""
    return _REPORTED.get(result.outcome, "failing")


@dataclass(slots=True)
class PassReport:
    """What one pass did (printed by ``reconcile --once``)."""

    leader: bool = True
    found: int = 0
    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("recovered", "locked", "failing", "dead"), 0)
    )
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "found": self.found,
            **self.outcomes,
            "seconds": round(self.seconds, 3),
        }


class Reconciler:
    def __init__(self, *, ingestion: Ingestion, reads: InboxReads, settings: Settings) -> None:
        self._ingestion = ingestion
        self._reads = reads
        self._settings = settings
        self.leadership = leadership(settings)

    async def run_once(self) -> PassReport:
        """One pass, if this process is (or becomes) the leader."""
        started = time.perf_counter()
        if not await self.leadership.acquire():
            return PassReport(leader=False)
        self._ingestion.counters.incr(f"{RESENDS}:runs")
        report = PassReport()
        slots = asyncio.Semaphore(self._settings.reconcile_concurrency)

        async def one(event: SavedEvent) -> None:
            async with slots:
                report.outcomes[reported(await self._ingestion.ingest(Resend(event)))] += 1

        after: tuple[datetime, int] = (_EPOCH, 0)
        limit = self._settings.reconcile_max_per_pass
        while report.found < limit:
            batch = await self._reads.stuck(
                self._settings.reconcile_after_seconds,
                after,
                min(self._settings.reconcile_batch_size, limit - report.found),
            )
            if not batch:
                break
            report.found += len(batch)
            await asyncio.gather(*(one(event) for event in batch))
            after = (batch[-1].received_at, batch[-1].id)
        report.seconds = time.perf_counter() - started
        return report

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop``; a pass that cannot reach Postgres is retried at the next interval."""
        try:
            while not stop.is_set():
                try:
                    report = await self.run_once()
                except StoreUnavailable as exc:
                    log.warning("reconciler pass skipped, Postgres unavailable", error=str(exc))
                else:
                    if report.found:
                        log.info("reconciler pass", **report.as_dict())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.reconcile_interval_seconds)
        finally:
            await self.leadership.release()
        log.info("reconciler stopped")
