"""The event-loop monitor: a blocked loop is seen, measured and told apart from a waiting one."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import structlog

from evolution_ingest.operate.loop_monitor import HISTOGRAM, LoopMonitor
from tests.support import wait_until


class _Counts:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.observed: list[float] = []

    def incr(self, name: str, amount: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount

    def observe(self, histogram: str, seconds: float) -> None:
        assert histogram == HISTOGRAM
        self.observed.append(seconds)


@pytest.fixture
def monitored() -> tuple[LoopMonitor, _Counts]:
    counts = _Counts()
    return LoopMonitor(counts, interval=0.02, threshold=0.1), counts  # type: ignore[arg-type]


async def _with_monitor(monitor: LoopMonitor, counts: _Counts, stall: Any) -> list[dict[str, Any]]:
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(monitor.run(stop))
        await wait_until(lambda: len(counts.observed) >= 3, within=5, message="the monitor's first samples")
        stall()
        await wait_until(lambda: monitor.stalls >= 1, within=5, message="the stall seen")
        stop.set()
        await task
    return [entry for entry in logs if entry["event"] == "event loop stalled"]


async def test_a_loop_blocked_in_python_is_a_stall_of_this_process(
    monitored: tuple[LoopMonitor, _Counts],
) -> None:
    monitor, counts = monitored
    stalls = await _with_monitor(monitor, counts, lambda: sum(range(30_000_000)))  # ~0.3+ s of CPU
    assert counts.counts["loop:stalls"] == 1
    assert max(counts.observed) > 0.1
    (entry,) = stalls
    assert entry["lag_ms"] > 100
    assert entry["cause"] == "busy in this process"
    assert entry["cpu_ms"] > 0.5 * entry["window_ms"]


async def test_a_loop_that_waits_is_not_blamed_on_this_process(
    monitored: tuple[LoopMonitor, _Counts],
) -> None:
    monitor, counts = monitored
    stalls = await _with_monitor(
        monitor, counts, lambda: threading.Event().wait(0.3)
    )  # a blocking call: no CPU
    (entry,) = stalls
    assert entry["lag_ms"] > 100
    assert entry["cause"] == "waiting for a core (or a blocking call)"
    assert entry["cpu_ms"] < 0.5 * entry["window_ms"]
