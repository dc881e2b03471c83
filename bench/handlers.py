"""Business-logic handlers for benchmarks.

``trace`` is the benchmarks' no-op: it only notes ``<dedup key> <unix time>`` for a file of its
own process, from which the benchmark counts events lost and processed twice, and measures
end-to-end latency. Lines are written every 0.1 s (and at exit), not one write per event: the
handler should cost the service next to nothing, and the time noted is when the handler ran.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
from pathlib import Path
from typing import TextIO

from evolution_ingest.core.events import Event

_FLUSH_SECONDS = 0.1
_trace: TextIO | None = None
_lines: list[str] = []
_timer: asyncio.TimerHandle | None = None


def _flush() -> None:
    global _timer  # noqa: PLW0603 - one buffer per process
    _timer = None
    if _trace is not None and _lines:
        _trace.write("".join(_lines))
        _trace.flush()
        _lines.clear()


async def trace(event: Event) -> None:
    global _trace, _timer  # noqa: PLW0603 - one file per process, opened on first use
    if _trace is None:
        path = Path(os.environ["BENCH_TRACE_DIR"]) / f"trace-{os.getpid()}.txt"
        _trace = path.open("a", encoding="ascii")
        atexit.register(_flush)
    _lines.append(f"{event.dedup_key} {time.time():.6f}\n")
    if _timer is None:
        _timer = asyncio.get_running_loop().call_later(_FLUSH_SECONDS, _flush)
