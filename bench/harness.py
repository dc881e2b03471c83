"""Pieces shared by the benchmarks: processes, an isolated schema, an HTTP load generator, figures."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import asyncpg
from pydantic import TypeAdapter
from redis.asyncio import Redis

DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory of a process (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Isolation:
    """A schema and Redis prefixes of one benchmark run, removed afterwards."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    def __post_init__(self) -> None:
        self.trace_dir = Path(tempfile.mkdtemp(prefix=f"bench-{self.run_id}-"))

    def traced(self) -> int:
        """Business-logic runs recorded so far by the ``trace`` handler (all processes)."""
        return sum(path.read_bytes().count(b"\n") for path in self.trace_dir.glob("trace-*.txt"))

    @property
    def schema(self) -> str:
        return f"bench_{self.run_id}"

    @property
    def prefix(self) -> str:
        return f"bench:{self.run_id}:"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EVOLUTION_INGEST_")}
        env.update(
            EVOLUTION_INGEST_DATABASE_URL=DATABASE_URL,
            EVOLUTION_INGEST_DATABASE_SCHEMA=self.schema,
            EVOLUTION_INGEST_REDIS_URL=REDIS_URL,
            EVOLUTION_INGEST_RABBITMQ_URL=RABBITMQ_URL,
            EVOLUTION_INGEST_REDIS_KEY_PREFIX=self.prefix,
            EVOLUTION_INGEST_METRICS_PREFIX=self.prefix + "metrics:",
            EVOLUTION_INGEST_INTERNAL_SECRET="bench-secret-" + self.run_id,
            EVOLUTION_INGEST_HANDLERS="evolution_ingest.handlers:noop",
            EVOLUTION_INGEST_LOG_LEVEL=service_log_level(),
            EVOLUTION_INGEST_LOG_FORMAT="json",
        )
        env.update({f"EVOLUTION_INGEST_{k}": v for k, v in extra.items()})
        env.update({f"EVOLUTION_INGEST_{k}": v for k, v in bench_settings().items()})
        return env

    async def cleanup(self) -> None:
        conn = await asyncpg.connect(DATABASE_URL)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        finally:
            await conn.close()
        redis = Redis.from_url(REDIS_URL)
        try:
            keys = [k async for k in redis.scan_iter(match=self.prefix + "*", count=5000)]
            for start in range(0, len(keys), 1000):
                await redis.delete(*keys[start : start + 1000])
        finally:
            await redis.aclose()
        shutil.rmtree(self.trace_dir, ignore_errors=True)
        await self._delete_rabbitmq()

    async def _delete_rabbitmq(self) -> None:
        """Every queue and exchange whose name carries this run's id."""
        names = {}
        for kind in ("queues", "exchanges"):
            listed = await asyncio.create_subprocess_exec(
                "rabbitmqctl", f"list_{kind}", "name", "-q",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            out, _ = await listed.communicate()
            names[kind] = [name for name in out.decode().split() if self.run_id in name]
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            for queue in names["queues"]:
                channel = await connection.channel()
                await channel.queue_delete(queue)
            for exchange in names["exchanges"]:
                channel = await connection.channel()
                await channel.exchange_delete(exchange)


def bench_settings() -> dict[str, str]:
    """``BENCH_SETTINGS="DATABASE_BATCH_CONCURRENCY=1,..."``: settings of every service process
    (names without ``EVOLUTION_INGEST_``), to try them without editing code."""
    pairs = (pair.partition("=") for pair in os.environ.get("BENCH_SETTINGS", "").split(",") if pair)
    return {name.strip(): value.strip() for name, _, value in pairs}


def service_log_level() -> str:
    """The log level of the service's processes: ``BENCH_LOG_LEVEL``, WARNING unless it is set."""
    return bench_settings().get("LOG_LEVEL", os.environ.get("BENCH_LOG_LEVEL", "WARNING")).upper()


def outcome_lines() -> bool:
    """Whether the service writes an ``outcome`` line per webhook call and per delivery, as it
    does by default (INFO): the benchmark reads them, as a log collector would, and they cost
    CPU of their own (docs/performance.md). At WARNING, the benchmark's default, it writes none."""
    level = service_log_level()
    outcomes = TypeAdapter(bool).validate_python(
        bench_settings().get("LOG_OUTCOMES", "true")
    )  # as Settings reads it
    return level == "DEBUG" or (level == "INFO" and outcomes)


#: ``event loop stalled`` log lines of each service process, by pid (see ``process``).
STALLS: dict[int, list[dict[str, Any]]] = {}


@asynccontextmanager
async def process(
    args: Sequence[str], env: dict[str, str], name: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process, stopped with SIGTERM (then SIGKILL) on exit; ``STALLS[pid]`` collects the
    ``event loop stalled`` lines it logs (parsed)."""
    proc = await asyncio.create_subprocess_exec(*args, env=env, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    log: list[bytes] = []
    stalls = STALLS.setdefault(proc.pid, [])

    async def drain() -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            log.append(line)
            del log[:-50]
            if b"event loop stalled" in line:
                with contextlib.suppress(ValueError):
                    stalls.append(json.loads(line))

    drainer = asyncio.create_task(drain())
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        drainer.cancel()
        if os.environ.get("BENCH_SHOW_LOGS") or proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write(f"{name} exited with {proc.returncode}; last lines:\n")
            sys.stderr.write(b"".join(log).decode(errors="replace"))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "evolution_ingest", *args]


async def wait_http(url: str, within: float = 30) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url) as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {within}s")
            await asyncio.sleep(0.1)


@dataclass
class LoadResult:
    count: int
    seconds: float
    latencies_ms: list[float]
    statuses: dict[int, int]
    #: Unix time each body was sent, by index (what end-to-end latency is measured from).
    sent_at: list[float] = field(default_factory=list)
    #: Latency of each request in ms, by index (NaN: not sent): when the slow ones were sent.
    by_index: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    def percentile(self, p: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def post_all(
    urls: str | Sequence[str],
    bodies: Sequence[bytes],
    concurrency: int = 64,
    max_seconds: float = 120,
    headers: dict[str, str] | None = None,
    rate: float = 0.0,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """POST every body, bounded by count and time (and by ``stop``, once it is set).

    Closed loop (``rate`` 0): ``concurrency`` requests always in flight, as fast as the
    server answers. Open loop (``rate`` > 0): request *i* starts at ``i / rate`` seconds,
    whatever the answers, with at most ``concurrency`` in flight. Several ``urls`` are
    used in turn, as a load balancer would.

    Latency is measured in this process, so this process's own pauses count as the server's:
    what was alive before the load is frozen out of the garbage collector's full passes, and a
    request's task is let go once it is done. Holding every task of a long run made each full
    pass scan them all, a pause of 100-300 ms every few seconds of a 30-second run on a slow
    machine, counted in the p99 of whatever was measured.
    """
    targets = [urls] if isinstance(urls, str) else list(urls)
    with frozen():
        return await _post_all(targets, bodies, concurrency, max_seconds, headers, rate, stop)


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """What is alive now is left out of the collector's passes until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Inflight:
    """The tasks of the requests still running: a finished one is let go at once (its error, if
    any, kept for :meth:`wait`), so that what the process holds stays the size of what runs."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: list[BaseException] = []
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self, request: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(request)
        self._tasks.add(task)
        self._idle.clear()
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._failed.append(error)
        if not self._tasks:
            self._idle.set()

    async def wait(self) -> None:
        """Until every request has finished; the first error of any, raised.

        Waits on an event, not on ``gather``: gather holds every task it was given until the last
        one ends, and a sender that fell behind its schedule still has most of the run queued when
        it gets here, so the whole backlog would stay alive to the end of the run.
        """
        await self._idle.wait()
        if self._failed:
            raise self._failed[0]


async def _post_all(
    targets: list[str],
    bodies: Sequence[bytes],
    concurrency: int,
    max_seconds: float,
    headers: dict[str, str] | None,
    rate: float,
    stop: asyncio.Event | None,
) -> LoadResult:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    sent_at = [float("nan")] * len(bodies)
    by_index = [float("nan")] * len(bodies)
    deadline = time.monotonic() + max_seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    hdrs = {"content-type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession(connector=connector) as http:

        async def send(index: int) -> None:
            sent_at[index] = time.time()
            started = time.perf_counter()
            async with http.post(targets[index % len(targets)], data=bodies[index], headers=hdrs) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1
            latencies.append((time.perf_counter() - started) * 1000)
            by_index[index] = latencies[-1]

        started = time.perf_counter()
        if rate <= 0:
            indices = iter(range(len(bodies)))

            async def worker() -> None:
                for index in indices:
                    if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                        return
                    await send(index)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            slots = asyncio.Semaphore(concurrency)
            inflight = Inflight()

            async def paced(index: int) -> None:
                async with slots:
                    await send(index)

            for index in range(len(bodies)):
                delay = started + index / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                    break
                inflight.start(paced(index))
            await inflight.wait()
        elapsed = time.perf_counter() - started
    return LoadResult(len(latencies), elapsed, latencies, statuses, sent_at, by_index)


async def timed(step: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await step()
    return time.perf_counter() - started


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
