"""Backfill: the messages neither channel delivered, from the ones Evolution stored.

For one instance and a window, the stored messages (``POST /chat/findMessages``, newest
first, ``BACKFILL_PAGE_SIZE`` a page) are read page after page; each becomes the
``messages.upsert`` event it stands for (:mod:`evolution_ingest.core.stored`), and every one
the inbox does not hold yet goes through the ingestion core as a third source, ``BACKFILL``
(:class:`~evolution_ingest.core.contract.Relay`): saved, then run where business logic runs.

What the inbox holds is known by key (a message's key is the same from a channel and from
Evolution's store) and, for a stored message that was edited or saved before the move to
message keys, by message id. A run is resumable: ``done_down_to`` says how far it got.
Evolution's errors (a refused key, a 5xx, a slow page) end that instance's run, reported and
kept for the next one; they never stop the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import structlog

from evolution_ingest.config import Settings
from evolution_ingest.core import stored
from evolution_ingest.core.contract import Outcome, Relay
from evolution_ingest.core.events import Channel
from evolution_ingest.core.identity import Envelope, InvalidEvent, dedup_key
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.stores.backfill_runs import BackfillRuns, Run
from evolution_ingest.stores.evolution import EvolutionApi, EvolutionError

log = structlog.get_logger(__name__)

NAME: Final = "backfill"
#: Ingests in flight at once within a page.
_INGESTS: Final = 32
#: How far before a window a message id is looked for (an edit moves the stored time later).
_ID_SLACK: Final = timedelta(days=1)
#: Pages read at most in one window (a bound on the loop: 100,000 pages of up to 1,000).
_MAX_PAGES: Final = 100_000

Progress = Callable[[int], None]


@dataclass(slots=True)
class InstanceReport:
    instance: str
    records: int = 0
    ingested: int = 0
    already: int = 0
    failed: int = 0
    invalid: int = 0
    pages: int = 0
    error: str | None = None
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class _Candidate:
    record: dict[str, Any]
    envelope: Envelope
    twin: str | None  # the key it would have as send.message (a message this instance sent)


class Backfiller:
    def __init__(
        self, ingestion: Ingestion, runs: BackfillRuns, api: EvolutionApi, settings: Settings, *, sender: dict[str, str]
    ) -> None:  # fmt: skip
        self._ingestion = ingestion
        self._counters = ingestion.counters
        self._runs = runs
        self._api = api
        self._size = settings.backfill_page_size
        #: Each instance's own number (``ownerJid``), put in ``sender`` as Evolution does.
        self._sender = sender
        self._v2_since: datetime | None = None

    async def backfill(
        self, instance: str, start: datetime, end: datetime, reason: str, *, dry_run: bool = False,
        progress: Progress | None = None,
    ) -> InstanceReport:  # fmt: skip
        """Unfinished runs of ``instance`` first, then [start, end]; dry: count, ingest nothing."""
        report = InstanceReport(instance)
        began = time.monotonic()
        self._v2_since = await self._ingestion.inbox.message_key_v2_since()
        self._counters.incr(f"{NAME}:runs")
        try:
            if dry_run:
                await self._walk(
                    Run(0, instance, reason, start, end), report, dry_run=True, progress=progress
                )
            else:
                for unfinished in await self._runs.unfinished(instance):
                    await self._walk(unfinished, report, dry_run=False, progress=progress)
                run = await self._runs.start(instance, reason, start, end)
                await self._walk(run, report, dry_run=False, progress=progress)
        except EvolutionError as exc:
            report.error = exc.message
            self._counters.incr(f"{NAME}:errors")
            log.warning("backfill stopped by Evolution's answer", instance=instance, error=exc.message)
        report.seconds = round(time.monotonic() - began, 3)
        return report

    async def _walk(
        self, run: Run, report: InstanceReport, *, dry_run: bool, progress: Progress | None
    ) -> None:
        """Pages of [window_start, cursor], newest first, until the window is read."""
        top = run.cursor
        where = {"messageTimestamp": {"gte": stored.as_evolution_time(run.window_start),
                                      "lte": stored.as_evolution_time(top)}}  # fmt: skip
        page, pages = 1, 1
        while page <= min(pages, _MAX_PAGES):
            try:
                answer = await self._api.find_messages(
                    run.instance, {"where": where, "page": page, "offset": self._size}
                )
            except EvolutionError as exc:
                if not dry_run:
                    await self._runs.progress(run, error=exc.message)
                raise
            found = answer.get("messages")
            if not isinstance(found, dict):
                found = {}
            records = [r for r in found.get("records") or [] if isinstance(r, dict)]
            # A message stored meanwhile pushes the older ones down a page: read again, never skipped.
            pages = int(found.get("pages") or 0)
            report.pages += 1
            self._counters.incr(f"{NAME}:pages")
            if not records:
                break
            await self._page(run, records, report, dry_run=dry_run)
            if progress is not None:
                progress(len(records))
            stamps = [
                stored.timestamp(r) for r in records if isinstance(r.get("messageTimestamp"), int | float)
            ]
            if stamps and not dry_run:
                run.done_down_to = datetime.fromtimestamp(min(stamps), UTC)
                await self._runs.progress(run)
            page += 1
        if not dry_run:
            run.done_down_to = run.window_start
            await self._runs.finish(run)

    async def _page(
        self, run: Run, records: list[dict[str, Any]], report: InstanceReport, *, dry_run: bool
    ) -> None:
        candidates = self._candidates(run.instance, records, report)
        keys = [c.envelope.dedup_key for c in candidates] + [c.twin for c in candidates if c.twin]
        known = await self._runs.known_keys(keys) if keys else set()
        missing = [c for c in candidates if c.envelope.dedup_key not in known and c.twin not in known]
        by_id = [c for c in missing if stored.changed(c.record) or self._before_v2(c.record)]
        if by_id:
            ids = await self._runs.known_message_ids(
                run.instance, [stored.message_id(c.record) for c in by_id], run.window_start - _ID_SLACK
            )
            missing = [c for c in missing if c not in by_id or stored.message_id(c.record) not in ids]
        already = len(candidates) - len(missing)
        run.records += len(records)
        run.already += already
        report.records += len(records)
        report.already += already
        self._counters.incr(f"{NAME}:records", len(records))
        self._counters.incr(f"{NAME}:already_received", already)
        if dry_run:
            report.ingested += len(missing)
            return
        limit = asyncio.Semaphore(_INGESTS)

        async def ingest(candidate: _Candidate) -> Outcome:
            async with limit:
                return (await self._ingestion.ingest(Relay(candidate.envelope, Channel.BACKFILL))).outcome

        for outcome in await asyncio.gather(*(ingest(c) for c in missing)):
            report.outcomes[outcome.value] = report.outcomes.get(outcome.value, 0) + 1
            if outcome in {Outcome.DUPLICATE, Outcome.LOCKED}:  # a channel's copy came first after all
                report.already += 1
                run.already += 1
            else:
                report.ingested += 1
                run.ingested += 1
                if outcome is not Outcome.PROCESSED:  # saved: the reconciler runs it later
                    report.failed += 1

    def _candidates(
        self, instance: str, records: list[dict[str, Any]], report: InstanceReport
    ) -> list[_Candidate]:
        candidates = []
        for record in records:
            try:
                body = stored.event_body(
                    record, instance=instance, sender=self._sender.get(instance), server_url=self._api.url
                )
                envelope = self._ingestion.envelope(body)
            except (stored.NotAMessage, InvalidEvent) as exc:
                report.invalid += 1
                self._counters.incr(f"{NAME}:invalid")
                log.info("stored message skipped", instance=instance, reason=str(exc))
                continue
            mine = isinstance(record.get("key"), dict) and record["key"].get("fromMe") is True
            twin = dedup_key("send.message", instance, envelope.data, envelope.date_time) if mine else None
            candidates.append(_Candidate(record, envelope, twin))
        return candidates

    def _before_v2(self, record: dict[str, Any]) -> bool:
        return self._v2_since is not None and stored.timestamp(record) <= self._v2_since.timestamp()
