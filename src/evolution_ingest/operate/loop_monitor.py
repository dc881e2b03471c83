"""The event loop watched from inside: how late it wakes up, and why when it is very late.

Every ``interval`` the monitor asks to be woken; how late it wakes is the time every other
callback waited too (``event_loop_lag_seconds``). A wake-up later than ``threshold`` is a stall,
logged with what tells its causes apart:

* ``cpu_ms``: CPU this process used over the stall's window. Close to the window: the loop was
  busy in Python (one long callback, or a pile of them). Far below it: the process was not
  running — the machine's other processes had the cores (or a blocking system call);
* ``gc_ms``: time in the garbage collector over the window, and the generation it reached.

Counted as ``loop:stalls``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any, Final

import structlog

from evolution_ingest.stores.counters import Counters

log = structlog.get_logger(__name__)

HISTOGRAM: Final = "event_loop_lag_seconds"


class LoopMonitor:
    def __init__(self, counters: Counters, *, interval: float = 0.05, threshold: float = 0.1) -> None:
        self._counters = counters
        self._interval = interval
        self._threshold = threshold
        self._gc_seconds = 0.0
        self._gc_started = 0.0
        self._gc_generation = -1
        #: Stalls seen by this process (tests read it).
        self.stalls = 0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_seconds += time.perf_counter() - self._gc_started
            self._gc_generation = max(self._gc_generation, int(info.get("generation", 0)))

    async def run(self, stop: asyncio.Event) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            while not stop.is_set():
                began, cpu, collected = time.perf_counter(), time.process_time(), self._gc_seconds
                self._gc_generation = -1
                await asyncio.sleep(self._interval)
                window = time.perf_counter() - began
                lag = max(0.0, window - self._interval)
                self._counters.observe(HISTOGRAM, lag)
                if lag > self._threshold and not stop.is_set():
                    self._stalled(window, lag, time.process_time() - cpu, self._gc_seconds - collected)
        finally:
            gc.callbacks.remove(self._on_gc)

    def _stalled(self, window: float, lag: float, cpu: float, collecting: float) -> None:
        self.stalls += 1
        self._counters.incr("loop:stalls")
        log.warning(
            "event loop stalled",
            lag_ms=round(lag * 1000, 1),
            window_ms=round(window * 1000, 1),
            cpu_ms=round(cpu * 1000, 1),
            gc_ms=round(collecting * 1000, 1),
            gc_generation=self._gc_generation if self._gc_generation >= 0 else None,
            cause="busy in this process" if cpu > 0.5 * window else "waiting for a core (or a blocking call)",
        )
