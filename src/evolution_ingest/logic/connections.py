"""The built-in first step of business logic: note each instance's connection state.

Every ``connection.update`` event (``data.state``: open, connecting or close;
``data.statusReason``: why) is kept in the connection log before the configured handlers run,
once per event like them (a retry writes nothing twice). ``status``, the dashboard, ``/metrics``
and the instance alerts read that log.
"""

from __future__ import annotations

from datetime import datetime, tzinfo

from evolution_ingest.core.events import Event
from evolution_ingest.stores.connections import ConnectionLog

EVENT = "connection.update"


def emitted_at(event: Event, timezone: tzinfo) -> datetime:
    """When Evolution emitted it (its ``date_time`` is local time labelled Z), else when received."""
    if event.date_time:
        try:
            return datetime.fromisoformat(event.date_time.removesuffix("Z")).replace(tzinfo=timezone)
        except ValueError:
            pass
    return event.received_at


class ConnectionObserver:
    def __init__(self, log: ConnectionLog, timezone: tzinfo) -> None:
        self._log = log
        self._timezone = timezone

    async def __call__(self, event: Event) -> None:
        data = event.data
        if event.event != EVENT or not isinstance(data, dict) or not isinstance(data.get("state"), str):
            return
        reason = data.get("statusReason")
        await self._log.record(
            event.instance,
            emitted_at(event, self._timezone),
            data["state"],
            reason if _is_reason(reason) else None,
            "event",
        )


def _is_reason(value: object) -> bool:
    """A status code the log can hold (an ``integer`` column): anything else is dropped, not an
    error that would fail the event's business logic on every retry."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**31) <= value < 2**31
