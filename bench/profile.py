"""Where the service's CPU goes: ``py-spy record`` of its processes under the dual-channel load.

    .venv/bin/python -m bench.profile [--events 20000] [--rate 0] [--layout up|split]
                                      [--webhook-only] [--perf] [--out DIR]

Runs the "both channels (up)" scenario once (``--layout split``: serve, worker and reconcile
apart; ``--webhook-only``: unique events by webhook, no RabbitMQ copies) with py-spy sampling
each service process, then prints each one's CPU and the share of its samples by where the
leaf-most known frame lives (HTTP server, AMQP client, asyncpg, redis-py, the service's own
modules, the event loop …), and the run's metric counters: which path each copy took (processed,
skipped as a duplicate, forwarded …). The collapsed stacks stay in ``--out`` (``profile-<process>.txt``)
for a flame graph (``py-spy`` can also write SVG: see its docs).

py-spy's shares are of wall-clock samples of a thread that is not idle, and a thread waiting for a
core counts as busy at the frame where it waits (most often the event loop, just woken up), so on a
loaded machine they overstate the loop. ``--perf`` also records each process with ``perf``, which
samples only cycles spent on a CPU, and prints the share of each process's CPU by shared object:
the Python interpreter, the kernel, the C library and each compiled extension.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from redis.asyncio import Redis

from bench.harness import REDIS_URL, Isolation, post_all
from bench.measure import CpuMeter
from bench.service import publisher, running, wait_traced, workload
from evolution_ingest.stores.counters import Counters

SAMPLES_PER_SECOND = 200
#: (bucket, pattern on the frame's file), tried from the leaf towards the root of each stack.
#: py-spy names a library's file from its package (``pika/channel.py``), without site-packages.
BUCKETS = [
    ("HTTP server (uvicorn, httptools)", re.compile(r"uvicorn|httptools|h11")),
    ("ASGI framework (starlette)", re.compile(r"starlette")),
    ("AMQP client (pika, aio-pika, aiormq, pamqp)", re.compile(r"(^|/)pika/|aio_pika|aiormq|pamqp")),
    ("Postgres driver (asyncpg)", re.compile(r"asyncpg")),
    ("Redis client (redis-py)", re.compile(r"(^|/)redis/")),
    ("logging (structlog)", re.compile(r"structlog|(^|/)logging/")),
    ("service: identity and body", re.compile(r"evolution_ingest/core/(identity|codec|body|redaction)")),
    ("service: HTTP app", re.compile(r"evolution_ingest/channels/(webhook|http|auth)")),
    (
        "service: RabbitMQ worker",
        re.compile(r"evolution_ingest/channels/(worker|messages|forward|consumer|delivery|acks|topology)"),
    ),
    ("service: ingestion core", re.compile(r"evolution_ingest/core/")),
    ("service: stores (inbox, locks, counters)", re.compile(r"evolution_ingest/stores/")),
    ("service: other", re.compile(r"evolution_ingest/|bench/handlers")),
    ("event loop (asyncio, uvloop)", re.compile(r"asyncio|uvloop")),
]
_FRAME_FILE = re.compile(r"\(([^)]*?):\d+\)$")


def shares(collapsed: str) -> list[tuple[str, int]]:
    """Samples per bucket, most first, from py-spy's collapsed ("raw") output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        bucket = "other"
        for frame in reversed(stack.split(";")):
            match = _FRAME_FILE.search(frame)
            where = match.group(1) if match else frame
            found = next((name for name, pattern in BUCKETS if pattern.search(where)), None)
            if found is not None:
                bucket = found
                break
        counts[bucket] += int(count)
    return counts.most_common()


async def main(args: argparse.Namespace) -> None:
    n = args.events
    offset = 7 * 10**11
    bodies, _ = workload(offset, n)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    names = ["up"] if args.layout == "up" else ["serve", "worker", "reconcile"]
    iso = Isolation()
    try:
        async with (
            running(iso, args.layout) as service,
            publisher(iso, offset, 0 if args.webhook_only else n, args.rate) as go,
        ):
            spies = [
                await _spy(pid, out / f"profile-{name}.txt")
                for name, pid in zip(names, service.pids, strict=True)
            ]
            if args.perf:
                spies += [
                    await _perf(pid, out / f"perf-{name}.data")
                    for name, pid in zip(names, service.pids, strict=True)
                ]
            meter = CpuMeter({name: _only(pid) for name, pid in zip(names, service.pids, strict=True)})
            started = time.perf_counter()
            meter.start()
            await asyncio.gather(post_all(service.urls, bodies, 64, 300, rate=args.rate), go())
            await wait_traced(iso, n, 300)
            used = meter.stop()
            elapsed = time.perf_counter() - started
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                await asyncio.wait_for(spy.wait(), 60)
        steps = await _counters(iso)
    finally:
        await iso.cleanup()
    channels = "by webhook only" if args.webhook_only else "on both channels"
    print(f"{n:,} events {channels}, {elapsed:.1f} s of load")
    for name, cpu in used.items():
        counted = shares((out / f"profile-{name}.txt").read_text(encoding="utf-8"))
        total = sum(c for _, c in counted) or 1
        # The CPU is the kernel's count. py-spy's samples give only the shares: it counts a thread
        # that waits for a core as busy, so on a loaded machine they add up to more than the CPU.
        print(
            f"the {name} process: {cpu:.1f} s of CPU ({100 * cpu / elapsed:.0f} % of one core), "
            f"{1000 * cpu / n:.2f} ms per event; {total:,} py-spy samples"
        )
        for bucket, count in counted:
            print(f"  {100 * count / total:5.1f} %  {bucket}")
        if args.perf:
            print(f"  where its CPU went, by perf (on-CPU samples only), {name}:")
            for share, where in await _perf_shares(out / f"perf-{name}.data"):
                print(f"  {share:5.1f} %  {where}")
    print("the service's counters (each copy's path):")
    for name, count in steps:
        print(f"  {count:9,}  {name}")


def _only(pid: int) -> Callable[[], list[int]]:
    return lambda: [pid]


async def _perf(pid: int, output: Path) -> asyncio.subprocess.Process:
    """``perf record`` of one process (CPU cycles on the CPU only), until it is sent SIGINT."""
    return await asyncio.create_subprocess_exec(
        "perf", "record", "--freq", str(SAMPLES_PER_SECOND), "--pid", str(pid), "--output", str(output),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


#: What each shared object of a process stands for, in perf's report by object.
_OBJECTS = [
    (re.compile(r"^libpython"), "the Python interpreter (bytecode, objects, memory)"),
    (re.compile(r"^\[kernel"), "the kernel (system calls, loopback TCP, scheduling)"),
    (re.compile(r"^libc\.|^ld-linux"), "the C library (malloc, memcpy)"),
    (re.compile(r"^loop\.cpython"), "the event loop (uvloop)"),
]


async def _perf_shares(data: Path) -> list[tuple[float, str]]:
    """Shares of a ``perf record`` by shared object (0.5 % and more), named by what they stand for."""
    report = await asyncio.create_subprocess_exec(
        "perf", "report", "--input", str(data), "--sort", "dso", "--stdio",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await report.communicate()
    shares = []
    for line in out.decode(errors="replace").splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if match is None or float(match.group(1)) < 0.5:
            continue
        dso = match.group(2)
        named = next((what for pattern, what in _OBJECTS if pattern.search(dso)), None)
        shares.append((float(match.group(1)), named or f"{dso.split('.')[0]} (a compiled extension)"))
    return shares


async def _counters(iso: Isolation) -> list[tuple[str, int]]:
    """The run's counters (not the histograms and series), read once the processes have stopped
    and flushed them."""
    redis = Redis.from_url(REDIS_URL)
    try:
        return sorted((await Counters(redis, prefix=iso.prefix + "metrics:").read()).items())
    finally:
        await redis.aclose()


async def _spy(pid: int, output: Path) -> asyncio.subprocess.Process:
    """``py-spy record`` of one process, until it is sent SIGINT."""
    return await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--format", "raw",
        "--rate", str(SAMPLES_PER_SECOND), "--output", str(output), "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="events/s of each channel (0: as fast as it goes)"
    )
    parser.add_argument(
        "--layout",
        choices=["up", "split"],
        default="up",
        help="one up process, or serve + worker + reconcile",
    )
    parser.add_argument(
        "--webhook-only", action="store_true", help="unique events by webhook, no RabbitMQ copies"
    )
    parser.add_argument(
        "--perf",
        action="store_true",
        help="also record each process with perf: the share of its CPU by shared object, on-CPU only",
    )
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "evolution-ingest-profile")
    if sys.platform != "linux":
        raise SystemExit("py-spy record needs Linux here")
    args = parser.parse_args()
    if args.perf and shutil.which("perf") is None:
        parser.error("--perf needs perf (Debian: apt install linux-perf)")
    asyncio.run(main(args))
