"""Every scenario of the benchmark: webhook only, half load, RabbitMQ only, both channels, backlog, soak."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.harness import (
    Isolation,
    LoadResult,
    cli,
    post_all,
)
from bench.measure import Traced, dual_cpu, machine_meter, status_mb
from bench.report import Report, Row
from bench.service import (
    Running,
    e2e,
    publish,
    publisher,
    read_times,
    running,
    service_env,
    wait_traced,
    where_lost,
    workload,
)

# --- scenarios -----------------------------------------------------------------------------


def _again_row(scenario: str, n: int, result: LoadResult, service: Running, note: str) -> Row:
    """A row for events sent again: nothing new can be lost; any second run is a double."""
    return Row(
        scenario,
        n,
        result.rate,
        result.percentile(50),
        result.percentile(99),
        rss=service.rss(),
        lost=0,
        doubled=Traced.read(service.iso.trace_dir).doubled(),
        note=note,
    )


async def webhook_scenarios(report: Report, n: int, offset: int) -> float:
    """Unique events, the same events again (in memory), and again after a restart (Redis)."""
    bodies, keys = workload(offset, n)
    iso = Isolation()
    try:
        async with running(iso, "up") as service:
            meter = machine_meter(lambda: service.pids)
            meter.start()
            unique = await post_all(service.urls, bodies, 64, 300)
            await wait_traced(iso, n, 60)
            report.cpu["webhook only, unique events"] = meter.stop_per(n)
            traced = Traced.read(iso.trace_dir)
            sent = dict(zip(keys, unique.sent_at, strict=True))
            report.rows.append(
                Row(
                    "webhook only, unique events",
                    n,
                    unique.rate,
                    unique.percentile(50),
                    unique.percentile(99),
                    *e2e(traced, sent),
                    service.rss(),
                    traced.lost(keys),
                    traced.doubled(),
                )
            )
            again = await post_all(service.urls, bodies, 64, 300)
            report.rows.append(
                _again_row(
                    "webhook only, every event again",
                    n,
                    again,
                    service,
                    "answered from this process's memory",
                )
            )
        async with running(iso, "up") as service:  # a fresh process: Redis markers answer
            redis_again = await post_all(service.urls, bodies, 64, 300)
            report.rows.append(
                _again_row(
                    "webhook only, every event again, after a restart",
                    n,
                    redis_again,
                    service,
                    "answered from Redis",
                )
            )
        report.checks.append(
            (
                "duplicates suppressed ≥ 3× faster than unique events",
                f"{again.rate / unique.rate:.2f}× (memory), {redis_again.rate / unique.rate:.2f}× (Redis)",
                again.rate / unique.rate >= 3,
            )
        )
        return unique.rate
    finally:
        await iso.cleanup()


@dataclass
class Measured:
    """One run of a channel scenario: its row, and the CPU per event of each process group."""

    row: Row
    cpu: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.row.rate

    def record(self, report: Report) -> float:
        report.rows.append(self.row)
        if self.cpu is not None:
            report.cpu[self.row.scenario] = self.cpu
        report.notes.extend(self.notes)
        return self.rate


async def channel_scenario(report: Report, n: int, offset: int, **how: Any) -> float:
    """:func:`measure_channels` once, recorded in ``report``: events/s."""
    return (await measure_channels(n, offset, **how)).record(report)


async def measure_channels(
    n: int,
    offset: int,
    *,
    name: str,
    layout: str,
    dual: bool,
    replicas: int = 1,
    cpu: bool = False,
    rate: float = 0.0,
    settings: Mapping[str, str] | None = None,
) -> Measured:
    """Events through RabbitMQ only, or on both channels at once (as Evolution sends them);
    ``settings``: more service settings, as for :func:`bench.service.running`."""
    bodies, keys = workload(offset, n)
    iso = Isolation()
    try:
        async with (
            running(iso, layout, replicas, settings=settings) as service,
            publisher(iso, offset, n, rate) as go,
        ):
            webhook: LoadResult | None = None
            with dual_cpu(lambda: service.pids, go) as used:
                if dual:
                    webhook, times = await asyncio.gather(
                        post_all(service.urls, bodies, 64, 300, rate=rate), go()
                    )
                else:
                    times = await go()
                await wait_traced(iso, n, 300)
            traced = Traced.read(iso.trace_dir)
            sent = read_times(times, keys)
            if webhook is not None:
                sent = {k: min(at, w) for (k, at), w in zip(sent.items(), webhook.sent_at, strict=True)}
            runs = [min(t) for t in traced.runs.values()]
            carried = len(runs) / (max(runs) - min(sent.values())) if runs else 0.0
            measured = Measured(
                Row(
                    name,
                    n,
                    carried,
                    webhook.percentile(50) if webhook else None,
                    webhook.percentile(99) if webhook else None,
                    *e2e(traced, sent),
                    service.rss(),
                    traced.lost(keys),
                    traced.doubled(),
                )
            )
            if cpu and runs:
                measured.cpu = {k: v / len(runs) * 1000 for k, v in used.items()}
            if lost := await where_lost(iso, keys, bodies, traced):
                measured.notes.append(f"{name}: {lost}")
            return measured
    finally:
        await iso.cleanup()


async def backlog(report: Report, n: int, offset: int) -> None:
    iso = Isolation()
    try:
        # Declare Evolution's queues and the service's before anything consumes: publish first.
        topology = await asyncio.create_subprocess_exec(
            *cli("topology"), env=service_env(iso), stdout=subprocess.DEVNULL
        )
        await topology.wait()
        await publish(iso, offset, n)
        started = time.perf_counter()
        async with running(iso, "up", warm=False) as service:  # the backlog is its own warm-up
            await wait_traced(iso, n, 900)
            elapsed = time.perf_counter() - started
            traced = Traced.read(iso.trace_dir)
            report.rows.append(
                Row(
                    f"RabbitMQ backlog of {n:,} drained (up)",
                    n,
                    len(traced.runs) / elapsed,
                    rss=service.rss(),
                    lost=n - len(traced.runs),
                    doubled=traced.doubled(),
                    note="from start-up to the last event",
                )
            )
    finally:
        await iso.cleanup()


async def soak(report: Report, n: int, offset: int) -> None:
    """Many events through one process; resident memory after a tenth of them and at the end."""
    iso = Isolation()
    chunk = max(1, n // 10)
    try:
        async with running(iso, "up") as service:
            pid = service.pids[0]
            rss = []
            done = 0
            started = time.perf_counter()
            for part in range(10):
                bodies, _ = workload(offset + part * chunk, chunk)
                await post_all(service.urls, bodies, 64, 900)
                done += chunk
                rss.append(status_mb(pid, "VmRSS"))
            elapsed = time.perf_counter() - started
            growth = rss[-1] - rss[0]
            report.rows.append(
                Row(
                    f"soak: {done:,} unique webhook events (up)",
                    done,
                    done / elapsed,
                    rss=f"{rss[0]:.0f} → {rss[-1]:.0f}",
                    note=f"RSS growth after the first tenth: {growth:+.1f} MiB",
                )
            )
            report.checks.append(
                (
                    "memory flat: < 50 MB growth over the soak",
                    f"{growth:+.1f} MiB over {done:,} events",
                    growth < 50,
                )
            )
    finally:
        await iso.cleanup()
