"""The benchmark: every scenario against the ceilings of this machine, in one bounded run.

    .venv/bin/python -m bench [--events 20000] [--backlog 100000] [--soak 500000] [--quick]
                               [--write docs/benchmarks.md]

Starts what it needs (service processes on its own schema, Redis prefix and queues,
a bare endpoint), drives them with an aiohttp load generator and a separate RabbitMQ
publisher, and prints one report: events/s, webhook and end-to-end latency, memory,
events lost and processed twice, each scenario as a ratio to the raw Postgres ceiling,
and where the CPU went. Every load is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import orjson

from bench.events import unique_event
from bench.harness import (
    DATABASE_URL,
    RABBITMQ_URL,
    Isolation,
    LoadResult,
    cli,
    free_port,
    post_all,
    process,
    table,
    wait_http,
)
from bench.measure import CpuMeter, Traced, infrastructure, percentile, status_mb
from evolution_ingest.core.identity import EVENT_NAMES, parse_envelope

EVENTS = sorted(
    {
        "messages.upsert",
        "send.message",
        "messages.update",
        "messages.delete",
        "messages.set",
        "connection.update",
        "qrcode.updated",
        "contacts.upsert",
        "presence.update",
        "groups.upsert",
        "group-participants.update",
        "call",
    }
)
assert set(EVENTS) <= set(EVENT_NAMES.values())


@dataclass
class Row:
    scenario: str
    events: int
    rate: float
    webhook_p50: float | None = None
    webhook_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p99: float | None = None
    rss: str = "-"
    lost: int | None = None
    doubled: int | None = None
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    ceilings: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: list[tuple[str, str, bool]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- ceilings -------------------------------------------------------------------------------


async def raw_postgres(bodies: Sequence[bytes], concurrency: int = 64) -> float:
    """INSERT ... ON CONFLICT then UPDATE per event, 64 in flight, pool of 16: the naive cost."""
    schema = f"bench_raw_{os.getpid()}"
    pool = await asyncpg.create_pool(DATABASE_URL, min_size=16, max_size=16)
    assert pool is not None
    try:
        await pool.execute(f'CREATE SCHEMA "{schema}"')
        await pool.execute(
            f'CREATE TABLE "{schema}".events (id bigserial PRIMARY KEY, dedup_key text UNIQUE NOT NULL, '
            "payload jsonb NOT NULL, received_at timestamptz NOT NULL DEFAULT now(), processed_at timestamptz)"
        )
        rows = [(parse_envelope(orjson.loads(b)).dedup_key, b.decode()) for b in bodies]
        queue = iter(rows)

        async def worker() -> None:
            for key, payload in queue:
                async with pool.acquire() as conn:
                    row_id = await conn.fetchval(
                        f'INSERT INTO "{schema}".events (dedup_key, payload) VALUES ($1, $2::jsonb) '
                        "ON CONFLICT (dedup_key) DO UPDATE SET dedup_key = EXCLUDED.dedup_key RETURNING id",
                        key,
                        payload,
                    )
                async with pool.acquire() as conn:
                    await conn.execute(
                        f'UPDATE "{schema}".events SET processed_at = now() WHERE id = $1', row_id
                    )

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(rows) / (time.perf_counter() - started)
    finally:
        await pool.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await pool.close()


async def bare_http(bodies: Sequence[bytes]) -> LoadResult:
    port = free_port()
    async with process([sys.executable, "-m", "bench.bare", str(port)], dict(os.environ), "bare endpoint"):
        await wait_http(f"http://127.0.0.1:{port}/healthz")
        return await post_all(f"http://127.0.0.1:{port}/bare", bodies, 64, 120)


# --- the service ---------------------------------------------------------------------------


@dataclass
class Running:
    urls: list[str]
    pids: list[int]
    iso: Isolation

    def rss(self) -> str:
        return " + ".join(f"{status_mb(pid, 'VmHWM'):.0f}" for pid in self.pids)


def _env(iso: Isolation, **extra: str) -> dict[str, str]:
    env = iso.env(
        HANDLERS="bench.handlers:trace",
        RABBITMQ_EXCHANGE=f"bench-{iso.run_id}",
        RABBITMQ_PREFIX=f"bench{iso.run_id}",
        RABBITMQ_SERVICE_PREFIX=f"bench-{iso.run_id}",
        RABBITMQ_EVENTS=",".join(EVENTS),
        RECONCILE_INTERVAL_SECONDS="30",
        **extra,
    )
    env["BENCH_TRACE_DIR"] = str(iso.trace_dir)
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    return env


@asynccontextmanager
async def running(
    iso: Isolation, layout: str, replicas: int = 1, *, warm: bool = True
) -> AsyncIterator[Running]:
    """``up`` (one process) or ``split`` (serve, worker and reconcile apart), ``replicas`` of each."""
    ports = [free_port() for _ in range(replicas)]
    async with AsyncExitStack() as stack:
        procs = []
        if layout == "up":
            procs.append(
                await stack.enter_async_context(process(cli("up"), _env(iso, PORT=str(ports[0])), "up"))
            )
        else:
            migrate = await asyncio.create_subprocess_exec(
                *cli("migrate"), env=_env(iso), stderr=subprocess.DEVNULL
            )
            await migrate.wait()
            for port in ports:
                url = f"http://127.0.0.1:{port}/api/internal/webhook"
                env = _env(iso, PORT=str(port), FORWARD_URL=url)
                for command in ("serve", "worker", "reconcile"):
                    procs.append(await stack.enter_async_context(process(cli(command), env, command)))
        for port in ports:
            await wait_http(f"http://127.0.0.1:{port}/healthz")
        await _consumers(iso, replicas)
        urls = [f"http://127.0.0.1:{p}/api/internal/webhook" for p in ports]
        if warm:
            await _warm_up(iso, urls)
        yield Running(urls, [p.pid for p in procs], iso)


async def _warm_up(iso: Isolation, urls: list[str], count: int = 400) -> None:
    """Open connections and fill caches with events of their own, then forget their traces."""
    bodies = [orjson.dumps(unique_event(10**9 + n, "warm-up")[0]) for n in range(count)]
    await post_all(urls, bodies, 64, 60)
    await wait_traced(iso, count, 30)
    for path in iso.trace_dir.glob("trace-*.txt"):
        path.write_text("", encoding="ascii")


async def _consumers(iso: Isolation, expected: int, within: float = 60) -> None:
    """Wait until the worker(s) consume every queue (a restart of the broker is not expected here)."""
    deadline = time.monotonic() + within
    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        while time.monotonic() < deadline:
            channel = await connection.channel()
            try:
                counts = [
                    (
                        await channel.declare_queue(f"bench{iso.run_id}.{e}", passive=True)
                    ).declaration_result.consumer_count
                    for e in EVENTS
                ]
                if all((c or 0) >= expected for c in counts):
                    return
            except aio_pika.exceptions.ChannelClosed:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("the worker did not start consuming")


@asynccontextmanager
async def publisher(iso: Isolation, start: int, count: int, rate: float = 0.0) -> AsyncIterator[Any]:
    """A publisher process, ready (messages prepared); ``await go()`` publishes and returns the send times."""
    times = iso.trace_dir / f"published-{start}.txt"
    args = [RABBITMQ_URL, f"bench-{iso.run_id}", f"bench{iso.run_id}", str(start), str(count), str(times)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.publisher", *args, "--rate", str(rate), env=_env(iso),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    assert proc.stdout is not None
    ready = (await asyncio.wait_for(proc.stdout.readline(), 300)).split()
    assert ready[0] == b"ready"
    preparing = float(ready[1])

    async def go() -> Path:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        await asyncio.wait_for(proc.wait(), 600)
        return times

    go.preparing_cpu = preparing  # type: ignore[attr-defined]
    try:
        yield go
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def publish(iso: Isolation, start: int, count: int) -> Path:
    async with publisher(iso, start, count) as go:
        return await go()  # type: ignore[no-any-return]


def read_times(path: Path, keys: Sequence[str]) -> dict[str, float]:
    sent = {}
    for line in path.read_text(encoding="ascii").splitlines():
        index, _, at = line.partition(" ")
        sent[keys[int(index)]] = float(at)
    return sent


async def wait_traced(iso: Isolation, expected: int, within: float) -> None:
    deadline = time.monotonic() + within
    while iso.traced() < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # late doubles would show up here


def workload(start: int, count: int) -> tuple[list[bytes], list[str]]:
    bodies, keys = [], []
    for n in range(start, start + count):
        webhook, _, _ = unique_event(n)
        bodies.append(orjson.dumps(webhook))
        keys.append(parse_envelope(webhook).dedup_key)
    return bodies, keys


def e2e(traced: Traced, sent: dict[str, float]) -> tuple[float, float]:
    values = traced.latencies_ms(sent)
    return percentile(values, 50), percentile(values, 99)


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
            unique = await post_all(service.urls, bodies, 64, 300)
            await wait_traced(iso, n, 60)
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


async def half_load(report: Report, n: int, offset: int, full_rate: float) -> None:
    bodies, keys = workload(offset, n)
    iso = Isolation()
    try:
        async with running(iso, "up") as service:
            result = await post_all(service.urls, bodies, 256, 300, rate=full_rate / 2)
            await wait_traced(iso, n, 60)
            traced = Traced.read(iso.trace_dir)
            sent = dict(zip(keys, result.sent_at, strict=True))
            report.rows.append(
                Row(
                    f"webhook only, unique, at half load ({full_rate / 2:,.0f}/s)",
                    n,
                    result.rate,
                    result.percentile(50),
                    result.percentile(99),
                    *e2e(traced, sent),
                    service.rss(),
                    traced.lost(keys),
                    traced.doubled(),
                )
            )
            report.checks.append(
                (
                    "webhook p99 ≤ 50 ms at half the maximum throughput",
                    f"{result.percentile(99):.1f} ms",
                    result.percentile(99) <= 50,
                )
            )
    finally:
        await iso.cleanup()


async def channel_scenario(
    report: Report,
    n: int,
    offset: int,
    *,
    name: str,
    layout: str,
    dual: bool,
    replicas: int = 1,
    cpu: bool = False,
    rate: float = 0.0,
) -> float:
    """Events through RabbitMQ only, or on both channels at once (as Evolution sends them)."""
    bodies, keys = workload(offset, n)
    iso = Isolation()
    try:
        async with running(iso, layout, replicas) as service, publisher(iso, offset, n, rate) as go:
            meter = CpuMeter(
                {"service": lambda: service.pids, "load generator": lambda: [os.getpid()], **infrastructure()}
            )
            meter.start()
            children = _children_cpu()
            webhook: LoadResult | None = None
            if dual:
                webhook, times = await asyncio.gather(
                    post_all(service.urls, bodies, 64, 300, rate=rate), go()
                )
            else:
                times = await go()
            await wait_traced(iso, n, 300)
            used = meter.stop()
            # The publisher, reaped by now, minus what it spent preparing before the window.
            used["load generator"] += _children_cpu() - children - go.preparing_cpu
            traced = Traced.read(iso.trace_dir)
            sent = read_times(times, keys)
            if webhook is not None:
                sent = {k: min(at, w) for (k, at), w in zip(sent.items(), webhook.sent_at, strict=True)}
            runs = [min(t) for t in traced.runs.values()]
            rate = len(runs) / (max(runs) - min(sent.values())) if runs else 0.0
            report.rows.append(
                Row(
                    name,
                    n,
                    rate,
                    webhook.percentile(50) if webhook else None,
                    webhook.percentile(99) if webhook else None,
                    *e2e(traced, sent),
                    service.rss(),
                    traced.lost(keys),
                    traced.doubled(),
                )
            )
            if cpu and runs:
                report.cpu[name] = {k: v / len(runs) * 1000 for k, v in used.items()}
            return rate
    finally:
        await iso.cleanup()


def _children_cpu() -> float:
    """CPU time of our children that have exited (the publisher, once it is done)."""
    times = os.times()
    return times.children_user + times.children_system


async def backlog(report: Report, n: int, offset: int) -> None:
    iso = Isolation()
    try:
        # Declare Evolution's queues and the service's before anything consumes: publish first.
        topology = await asyncio.create_subprocess_exec(
            *cli("topology"), env=_env(iso), stdout=subprocess.DEVNULL
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


# --- the report ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.1f}"


def render(report: Report, args: argparse.Namespace) -> str:
    pg = report.ceilings["raw Postgres: INSERT … ON CONFLICT + UPDATE per event, 64 in flight"]
    lines = [
        f"# evolution-ingest benchmark — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Machine: {_machine()}",
        f"Command: `.venv/bin/python -m bench {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        "## Ceilings on this machine, measured in the same run",
        "",
        table([[name, value] for name, value in report.ceilings.items()], ["ceiling", "per second"]),
        "",
        "## Scenarios (no-op handler, realistic bodies: the fixtures with unique ids)",
        "",
        table(
            [
                [
                    r.scenario,
                    r.events,
                    r.rate,
                    f"{r.rate / pg:.2f}×",
                    _ms(r.webhook_p50),
                    _ms(r.webhook_p99),
                    _ms(r.e2e_p50),
                    _ms(r.e2e_p99),
                    r.rss,
                    "-" if r.lost is None else r.lost,
                    "-" if r.doubled is None else r.doubled,
                    r.note,
                ]
                for r in report.rows
            ],
            [
                "scenario",
                "events",
                "events/s",
                "× raw PG",
                "webhook p50 ms",
                "webhook p99 ms",
                "e2e p50 ms",
                "e2e p99 ms",
                "peak RSS MiB",
                "lost",
                "doubled",
                "",
            ],
        ),
        "",
        "## Targets",
        "",
        table(
            [[name, got, "yes" if ok else "**no**"] for name, got, ok in report.checks],
            ["target", "reached", "met"],
        ),
    ]
    if report.cpu:
        lines += ["", "## Where the CPU goes (ms of CPU per event, all processes of the machine)", ""]
        names = sorted({k for per in report.cpu.values() for k in per})
        lines.append(
            table(
                [
                    [scenario, *(per.get(k, 0.0) for k in names), sum(per.values())]
                    for scenario, per in report.cpu.items()
                ],
                ["scenario", *names, "total"],
            )
        )
    if report.notes:
        lines += ["", *report.notes]
    return "\n".join(lines) + "\n"


def _machine() -> str:
    model = "?"
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {memory:.0f} GiB, Python {platform.python_version()}"


async def main(args: argparse.Namespace) -> Report:
    report = Report()
    n = args.events
    step = 10 * max(
        n, args.backlog, args.soak
    )  # every scenario gets ids of its own (offsets 1 to 9 times step)
    bodies, _ = workload(0, n)
    report.ceilings[
        "raw Postgres: INSERT … ON CONFLICT + UPDATE per event, 64 in flight"
    ] = await raw_postgres(bodies)
    bare = await bare_http(bodies)
    report.ceilings["bare HTTP endpoint parsing the JSON (same server stack, same load generator)"] = (
        bare.rate
    )
    pg = report.ceilings["raw Postgres: INSERT … ON CONFLICT + UPDATE per event, 64 in flight"]
    print(f"ceilings: raw Postgres {pg:,.0f} events/s, bare HTTP {bare.rate:,.0f} req/s", file=sys.stderr)

    unique_rate = await webhook_scenarios(report, n, 1 * step)
    await half_load(report, n, 2 * step, unique_rate)
    await channel_scenario(
        report, n, 3 * step, name="RabbitMQ only, through the forward (up)", layout="up", dual=False
    )
    dual = await channel_scenario(
        report, n, 4 * step, name="both channels (up)", layout="up", dual=True, cpu=True
    )
    await channel_scenario(
        report,
        n,
        9 * step,
        name=f"both channels at half load ({dual / 2:,.0f}/s, up)",
        layout="up",
        dual=True,
        rate=dual / 2,
    )
    await channel_scenario(
        report,
        n,
        5 * step,
        name="both channels (serve + worker + reconcile)",
        layout="split",
        dual=True,
        cpu=True,
    )
    scaled = await channel_scenario(
        report,
        n,
        6 * step,
        name="both channels, ×2 replicas of each",
        layout="split",
        dual=True,
        replicas=2,
        cpu=True,
    )
    report.checks.insert(0, ("both channels ≥ 1.0 × raw Postgres ceiling", f"{dual / pg:.2f}×", dual >= pg))
    report.notes.append(
        f"A second replica of each component: {scaled:,.0f} events/s with both channels "
        f"(the `up` process alone: {dual:,.0f})."
    )
    report.notes.append(
        "End-to-end latency (sent → business logic ran) of the scenarios at full speed includes the "
        "time events wait in RabbitMQ: the publisher sends faster than the service consumes. The "
        "half-load rows show the latency of a service that keeps up."
    )
    report.checks.append(
        (
            "load generator is not the limit",
            f"bare endpoint {bare.rate:,.0f} req/s vs webhook {unique_rate:,.0f}",
            bare.rate > 2 * unique_rate,
        )
    )
    await backlog(report, args.backlog, 7 * step)
    await soak(report, args.soak, 8 * step)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000, help="events per scenario")
    parser.add_argument("--backlog", type=int, default=100_000, help="events waiting in RabbitMQ at start")
    parser.add_argument("--soak", type=int, default=500_000, help="events for the memory soak")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes (a few minutes): 5,000 / 20,000 / 50,000"
    )
    parser.add_argument("--write", type=Path, help="also write the report to this Markdown file")
    args = parser.parse_args()
    if args.quick:
        args.events, args.backlog, args.soak = 5_000, 20_000, 50_000
    result = asyncio.run(main(args))
    text = render(result, args)
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
