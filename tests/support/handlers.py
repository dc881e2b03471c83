"""Handlers loaded by service processes that tests start (``EVOLUTION_INGEST_HANDLERS``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from evolution_ingest.events import Event


async def hang(event: Event) -> None:
    """Say that business logic started (the event is saved and claimed), then never finish."""
    await asyncio.to_thread(Path(os.environ["TEST_STARTED_FILE"]).write_text, event.dedup_key, "ascii")
    await asyncio.Event().wait()
