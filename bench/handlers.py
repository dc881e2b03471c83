"""Business-logic handlers for benchmarks.

``trace`` is the benchmarks' no-op: it only appends ``<dedup key> <unix time>`` to a
file of its own process (line-buffered, a few microseconds), from which the benchmark
counts events lost and processed twice, and measures end-to-end latency.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TextIO

from evolution_ingest.core.events import Event

_trace: TextIO | None = None


async def trace(event: Event) -> None:
    global _trace  # noqa: PLW0603 - one file per process, opened on first use
    if _trace is None:
        path = Path(os.environ["BENCH_TRACE_DIR"]) / f"trace-{os.getpid()}.txt"
        _trace = path.open("a", buffering=1, encoding="ascii")
    _trace.write(f"{event.dedup_key} {time.time():.6f}\n")
