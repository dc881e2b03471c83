"""The webhook at half its maximum rate: the p99 of ten runs, what the machine went through during
each, the service's event-loop lag, and the bare endpoint under the same load for reference."""

from __future__ import annotations

import aiohttp
import asyncpg

from bench.ceilings import bare_http
from bench.harness import DATABASE_URL, STALLS, Isolation, median, post_all
from bench.measure import Pressure, PressureMeter, Traced
from bench.report import Report, Row
from bench.service import e2e, running, wait_traced, workload


async def loop_lag(url: str) -> str:
    """Shares of the service's event-loop wake-ups later than 10, 25, 50 and 100 ms (from /metrics)."""
    base = url.split("/api/", maxsplit=1)[0]
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    buckets = {}
    for line in text.splitlines():
        if line.startswith("evolution_ingest_event_loop_lag_seconds_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            buckets[le] = float(line.rsplit(" ", 1)[1])
    total = buckets.get("+Inf", 0.0)
    if not total:
        return "not measured"
    late = [f"{100 * (total - buckets[le]) / total:.2f} % over {float(le) * 1000:.0f} ms"
            for le in ("0.01", "0.025", "0.05", "0.1") if le in buckets]  # fmt: skip
    return f"{total:,.0f} wake-ups, " + ", ".join(late)


async def half_load(report: Report, n: int, offset: int, full_rate: float, runs: int = 10) -> None:
    """Open-loop webhook load at half the maximum rate, ``runs`` times on one process: p99 of each,
    and what the machine went through during each (CPU and I/O stalls, Postgres checkpoints)."""
    iso = Isolation()
    each = max(1, n // 2)
    results, pressures = [], []
    sent: dict[str, float] = {}
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        async with running(iso, "up") as service:
            meter = PressureMeter(conn.fetchrow)
            for run in range(runs):
                bodies, keys = workload(offset + run * each, each)
                result, pressure = await meter.during(
                    post_all(service.urls, bodies, 256, 300, rate=full_rate / 2)
                )
                pressures.append(pressure)
                await wait_traced(iso, (run + 1) * each, 60)
                results.append(result)
                sent.update(zip(keys, result.sent_at, strict=True))
            traced = Traced.read(iso.trace_dir)
            p99s = [r.percentile(99) for r in results]
            report.rows.append(
                Row(
                    f"webhook only, unique, at half load ({full_rate / 2:,.0f}/s), {runs} runs",
                    runs * each,
                    median([r.rate for r in results]),
                    median([r.percentile(50) for r in results]),
                    median(p99s),
                    *e2e(traced, sent),
                    service.rss(),
                    traced.lost(sent),
                    traced.doubled(),
                    note="medians of the runs; p99 of each run: "
                    + ", ".join(f"{p:.0f}" for p in p99s)
                    + " ms",
                )
            )
            lag = await loop_lag(service.urls[0])
            stalls = [s for pid in service.pids for s in STALLS.get(pid, [])]
            busy = [s for s in stalls if s.get("cause", "").startswith("busy")]
            report.notes.append(
                f"Half load, {runs} runs: the service's event loop stalled > 100 ms {len(stalls)} times "
                f"({len(busy)} busy in the process, {len(stalls) - len(busy)} waiting for a core; longest "
                f"{max((s['lag_ms'] for s in stalls), default=0):.0f} ms; most GC in one "
                f"{max((s['gc_ms'] for s in stalls), default=0):.0f} ms). Its wake-ups every 50 ms: {lag}."
            )
            report.notes.append(_pressure_note(p99s, pressures))
            report.rows.append(await _bare_at(full_rate / 2, offset + runs * each, each))
            good = sum(1 for p in p99s if p <= 50)
            report.checks.append(
                (
                    f"webhook p99 ≤ 50 ms at half the maximum throughput, in ≥ 9 of {runs} runs",
                    f"{good} of {runs} (median {median(p99s):.1f} ms, worst {max(p99s):.1f} ms)",
                    good >= 0.9 * runs,
                )
            )
    finally:
        await conn.close()
        await iso.cleanup()


async def _bare_at(rate: float, offset: int, n: int, runs: int = 3) -> Row:
    """The same open-loop load into the bare endpoint (parse, answer): the latency that the load
    generator and the machine alone give at that rate, the floor under the service's."""
    bodies, _ = workload(offset, n)
    results = [await bare_http(bodies, rate=rate, concurrency=256) for _ in range(runs)]
    p99s = [r.percentile(99) for r in results]
    return Row(
        f"for reference: the bare endpoint at the same half load ({rate:,.0f}/s), {runs} runs",
        runs * n,
        median([r.rate for r in results]),
        median([r.percentile(50) for r in results]),
        median(p99s),
        note="medians of the runs; p99 of each run: " + ", ".join(f"{p:.0f}" for p in p99s) + " ms",
    )


def _pressure_note(p99s: list[float], pressures: list[Pressure]) -> str:
    """Each half-load run's p99 beside what the machine went through meanwhile."""
    runs = "; ".join(f"{p99:.0f} ms: {pressure}" for p99, pressure in zip(p99s, pressures, strict=True))
    return f"What each half-load run went through (p99: stalls of the machine, from /proc/pressure, /proc/stat and Postgres): {runs}."
