"""Handlers loaded by service processes that tests start (``EVOLUTION_INGEST_HANDLERS``)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import TextIO

from evolution_ingest.core.events import Event


async def hang(event: Event) -> None:
    """Say that business logic started (the event is saved and claimed), then never finish."""
    await asyncio.to_thread(Path(os.environ["TEST_STARTED_FILE"]).write_text, event.dedup_key, "ascii")
    await asyncio.Event().wait()


_trace: TextIO | None = None


def _traced(what: str, key: str) -> None:
    global _trace  # noqa: PLW0603 - one trace file per process, opened on first use
    if _trace is None:
        path = Path(os.environ["DRILL_TRACE_DIR"]) / f"trace-{os.getpid()}.txt"
        _trace = path.open("a", buffering=1, encoding="ascii")
    _trace.write(f"{what} {key} {time.time():.6f}\n")


async def drill(event: Event) -> None:
    """The fault drill's business logic: maybe slow, maybe failing, traced when it starts and when it
    ends (``done`` once it completed, ``fail`` when it raised).

    ``DRILL_DELAY`` (seconds, a random share of it), ``DRILL_FAIL_RATE`` (0..1) and
    ``DRILL_TRACE_DIR`` (one file per process) come from the environment.
    """
    _traced("start", event.dedup_key)
    try:
        delay = float(os.environ.get("DRILL_DELAY", "0"))
        if delay:
            await asyncio.sleep(random.uniform(0, delay))  # wait-ok: a handler that takes a while
        if random.random() < float(os.environ.get("DRILL_FAIL_RATE", "0")):
            raise RuntimeError("drill: failing on purpose")
    except BaseException:
        _traced("fail", event.dedup_key)
        raise
    _traced("done", event.dedup_key)
