"""Where a WAL flush's time goes: each ``fdatasync`` of Postgres split by the scheduler's and the
block layer's tracepoints, under paced webhook load on ``up``.

    .venv/bin/python -m bench.flushes [--rates 100,1000] [--seconds 10] [--margin 4]
                                      [--postgres-slice-us 0] [--out DIR]

For each rate (unique events/s by webhook, open loop) one ``up`` process takes the load while
``perf record`` traces the whole machine for ``--seconds`` in its middle: the scheduler's switches
and wake-ups, the block layer's requests issued and completed, and ``fdatasync`` entered and left.
Each ``fdatasync`` of a Postgres process (a backend flushing its commit's WAL, or the WAL writer)
is then split into the time its process

- ran on a CPU (the kernel's own path: writing the pages out, waiting is not counted);
- slept, from leaving the CPU until the kernel woke it (its I/O in the disk, and the completion);
- waited for a core, from being woken until it ran again;
- waited for a core after being preempted while it ran;

and set beside the time the disk had the process's own requests in hand (issued to completed) and
the time it had any request in hand: the cache flush that follows the write is issued by a kernel
worker, not by the process, so the first leaves it out and the second counts other processes' too.
The four parts add up to the call's length. Needs ``perf`` with tracepoints (root, or
``perf_event_paranoid`` at -1) and prints the webhook's p99 at each rate beside the split.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import ctypes
import functools
import os
import platform
import re
import shutil
import struct
import sys
import tempfile
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.harness import DATABASE_URL, Isolation, median, post_all
from bench.measure import percentile
from bench.service import running, wait_traced, workload

TRACEPOINTS = (
    "sched:sched_switch",
    "sched:sched_waking",
    "block:block_rq_issue",
    "block:block_rq_complete",
    "syscalls:sys_enter_fdatasync",
    "syscalls:sys_exit_fdatasync",
)
#: ``perf script -F comm,tid,cpu,time,event,trace``: a task's name may hold spaces.
_LINE = re.compile(
    r"^\s*(?P<comm>.+?)\s+(?P<tid>\d+)\s+\[\d+\]\s+(?P<time>[\d.]+):\s+(?P<event>\S+):\s?(?P<trace>.*)$"
)
_SWITCH = re.compile(r"prev_pid=(?P<prev>\d+) .*prev_state=(?P<state>\S+) ==> .*next_pid=(?P<next>\d+)")
_WAKING = re.compile(r"\bpid=(?P<pid>\d+)")
_REQUEST = re.compile(r"^(?P<dev>\d+,\d+) (?P<rwbs>\S+) .*\(\S*\) (?P<sector>\d+) \+ (?P<sectors>\d+)")


@dataclass(frozen=True)
class Event:
    time: float
    comm: str
    tid: int
    name: str
    trace: str


def parse(lines: Iterable[str]) -> list[Event]:
    """The events of ``perf script -F comm,tid,cpu,time,event,trace``, in time order."""
    events = []
    for line in lines:
        match = _LINE.match(line)
        if match:
            events.append(
                Event(float(match["time"]), match["comm"], int(match["tid"]), match["event"], match["trace"])
            )
    events.sort(key=lambda event: event.time)
    return events


@dataclass
class Flush:
    """One ``fdatasync`` of a Postgres process, its length split into parts (seconds)."""

    tid: int
    started: float
    ended: float = 0.0
    on_cpu: float = 0.0
    asleep: float = 0.0
    woken_waiting: float = 0.0
    preempted_waiting: float = 0.0
    disk: float = 0.0
    any_disk: float = 0.0
    requests: list[tuple[float, float]] = field(default_factory=list)

    @property
    def length(self) -> float:
        return self.ended - self.started


@dataclass
class Split:
    """What one recording holds: the flushes, and every request the disk completed, by kind."""

    flushes: list[Flush]
    requests: dict[str, list[float]]
    seconds: float


class _Task:
    """Where a task in ``fdatasync`` is, and since when."""

    def __init__(self, flush: Flush) -> None:
        self.flush = flush
        self.state = "on_cpu"
        self.since = flush.started

    def move(self, state: str, now: float) -> None:
        part = self.state
        setattr(self.flush, part, getattr(self.flush, part) + now - self.since)
        self.state, self.since = state, now


def split(events: Sequence[Event], comm: str = "postgres") -> Split:
    """Each ``fdatasync`` of a task named ``comm``, split by where its task was.

    A task leaves the CPU asleep (its state ``D`` or ``S``) until it is woken, or preempted
    (state ``R``) until it runs again; a woken task waits for a core until it is switched in.
    The disk's parts are the union of the task's own requests, from issue to completion, while
    the call lasted, and the union of every request's."""
    splitter = _Splitter(comm)
    for event in events:
        step = splitter.steps.get(event.name)
        if step is not None:
            step(event)
    _any_disk(splitter.flushes, splitter.done)
    seconds = events[-1].time - events[0].time if events else 0.0
    return Split(splitter.flushes, dict(splitter.served), seconds)


class _Splitter:
    """The tasks in ``fdatasync`` and the disk's requests in flight, as the events go by."""

    def __init__(self, comm: str) -> None:
        self.comm = comm
        self.tasks: dict[int, _Task] = {}
        self.flushes: list[Flush] = []
        self.in_flight: dict[tuple[str, str, str], deque[tuple[float, int, str]]] = defaultdict(deque)
        self.served: dict[str, list[float]] = defaultdict(list)
        self.done: list[tuple[float, float]] = []  # every request served, issued to completed
        self.steps: dict[str, Callable[[Event], None]] = {
            "syscalls:sys_enter_fdatasync": self.enter,
            "syscalls:sys_exit_fdatasync": self.exit,
            "sched:sched_switch": self.switch,
            "sched:sched_waking": self.waking,
            "block:block_rq_issue": self.request,
            "block:block_rq_complete": self.request,
        }

    def enter(self, event: Event) -> None:
        if event.comm == self.comm:
            self.tasks[event.tid] = _Task(Flush(event.tid, event.time))

    def exit(self, event: Event) -> None:
        task = self.tasks.pop(event.tid, None)
        if task is not None:
            task.move("on_cpu", event.time)
            task.flush.ended = event.time
            task.flush.disk = _union(task.flush.requests, task.flush.started, event.time)
            self.flushes.append(task.flush)

    def switch(self, event: Event) -> None:
        match = _SWITCH.search(event.trace)
        if match is None:
            return
        prev, following = self.tasks.get(int(match["prev"])), self.tasks.get(int(match["next"]))
        if prev is not None:
            prev.move("preempted_waiting" if match["state"].startswith("R") else "asleep", event.time)
        if following is not None:
            following.move("on_cpu", event.time)

    def waking(self, event: Event) -> None:
        match = _WAKING.search(event.trace)
        task = self.tasks.get(int(match["pid"])) if match else None
        if task is not None and task.state == "asleep":
            task.move("woken_waiting", event.time)

    def request(self, event: Event) -> None:
        match = _REQUEST.match(event.trace)
        if match is None:
            return
        # A cache flush carries no sectors, and its completion names sector -1: matched in order
        sector = match["sector"] if match["sectors"] != "0" else "flush"
        key = (match["dev"], sector, match["sectors"])
        if event.name == "block:block_rq_issue":
            self.in_flight[key].append((event.time, event.tid, match["rwbs"]))
        elif self.in_flight[key]:
            issued, tid, rwbs = self.in_flight[key].popleft()
            self.served[rwbs].append(event.time - issued)
            self.done.append((issued, event.time))
            if tid in self.tasks:
                self.tasks[tid].flush.requests.append((issued, event.time))


def _any_disk(flushes: Iterable[Flush], done: list[tuple[float, float]]) -> None:
    """Each flush's time with any request in the disk, from the requests that can overlap it."""
    done.sort()
    issued = [lo for lo, _ in done]
    longest = max((hi - lo for lo, hi in done), default=0.0)
    for flush in flushes:
        first = bisect.bisect_left(issued, flush.started - longest)
        last = bisect.bisect_right(issued, flush.ended)
        flush.any_disk = _union(done[first:last], flush.started, flush.ended)


def _union(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` clipped to [start, end]."""
    total, open_start, open_end = 0.0, None, None
    for lo, hi in sorted((max(lo, start), min(hi, end)) for lo, hi in intervals if hi > start and lo < end):
        if open_end is None or lo > open_end:
            if open_end is not None and open_start is not None:
                total += open_end - open_start
            open_start, open_end = lo, hi
        else:
            open_end = max(open_end, hi)
    if open_end is not None and open_start is not None:
        total += open_end - open_start
    return total


PARTS = (
    ("length", "in fdatasync"),
    ("on_cpu", "on a CPU"),
    ("asleep", "asleep until woken"),
    ("woken_waiting", "woken, waiting for a core"),
    ("preempted_waiting", "preempted, waiting for a core"),
    ("disk", "its own requests in the disk"),
    ("any_disk", "any request in the disk"),
)


def summary(result: Split) -> list[str]:
    """The split as lines of text: per flush, the mean, median and p90 of each part, in µs."""
    flushes = result.flushes
    if not flushes:
        return ["no fdatasync of Postgres in the recording"]
    busy = sum(flush.length for flush in flushes)
    seconds = max(result.seconds, 1e-6)
    lines = [
        f"{len(flushes):,} WAL flushes by {len({f.tid for f in flushes})} processes in "
        f"{result.seconds:.1f} s: {len(flushes) / seconds:,.0f}/s, in fdatasync "
        f"{100 * busy / seconds:.0f} % of the time (summed over processes)",
        f"  {'per flush, µs':34} {'mean':>7} {'median':>7} {'p90':>7} {'share':>6}",
    ]
    for attr, label in PARTS:
        values = [getattr(flush, attr) for flush in flushes]
        mean = sum(values) / len(values)
        share = f"{100 * sum(values) / busy:5.0f} %"
        lines.append(
            f"  {label:34} {1e6 * mean:7.0f} {1e6 * median(values):7.0f} "
            f"{1e6 * percentile(values, 90):7.0f} {share:>6}"
        )
    kinds = ", ".join(
        f"{rwbs} {len(times):,} ({1e6 * median(times):.0f} µs median, {1e6 * percentile(times, 90):.0f} p90)"
        for rwbs, times in sorted(result.requests.items(), key=lambda item: -len(item[1]))
    )
    lines.append(f"  the disk's requests, by kind (all processes): {kinds or 'none'}")
    return lines


class PerfError(RuntimeError):
    """``perf`` could not record or read a recording."""


#: sched_setattr and sched_getattr, by machine; struct sched_attr as of its first version (56 bytes)
_SCHED_CALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_SCHED_ATTR = struct.Struct("IIQiIQQQII")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def set_slice(pid: int, slice_ns: int) -> int:
    """Ask the kernel to give ``pid`` a scheduler slice of ``slice_ns`` (the normal policy; EEVDF
    keeps a custom slice from Linux 6.12 on, 0 is the default) and return the slice it reports."""
    calls = _SCHED_CALLS.get(platform.machine())
    if calls is None:
        raise OSError(f"sched_setattr: no system call number known for {platform.machine()}")
    libc = _libc()
    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, 0, 0, 0, 0, slice_ns, 0, 0, 0, 0))
    if libc.syscall(calls[0], pid, attr, 0) != 0:
        raise OSError(ctypes.get_errno(), f"sched_setattr of {pid}: {os.strerror(ctypes.get_errno())}")
    got = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if libc.syscall(calls[1], pid, got, _SCHED_ATTR.size, 0) != 0:
        raise OSError(ctypes.get_errno(), f"sched_getattr of {pid}: {os.strerror(ctypes.get_errno())}")
    return int(_SCHED_ATTR.unpack(got.raw)[5])


async def _slices(application: str, slice_ns: int, done: asyncio.Event, kept: dict[int, int]) -> None:
    """Until ``done``: the slice of each Postgres backend of ``application``, as it connects."""
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        while not done.is_set():
            pids = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1", application
            )
            for (pid,) in pids:
                if pid not in kept:
                    with contextlib.suppress(ProcessLookupError):
                        kept[pid] = set_slice(pid, slice_ns)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.2)
    finally:
        await conn.close()


async def _record(data: Path, seconds: float, delay: float) -> None:
    await asyncio.sleep(delay)
    proc = await asyncio.create_subprocess_exec(
        "perf", "record", "--quiet", "--all-cpus", "--output", str(data),
        "--event", ",".join(TRACEPOINTS), "--", "sleep", f"{seconds:g}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise PerfError(f"perf record failed: {err.decode(errors='replace').strip()[-300:]}")


async def _script(data: Path) -> list[Event]:
    proc = await asyncio.create_subprocess_exec(
        "perf", "script", "--input", str(data), "--fields", "comm,tid,cpu,time,event,trace",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return parse(out.decode(errors="replace").splitlines())


async def main(args: argparse.Namespace) -> None:
    out: Path = args.out
    iso = Isolation()
    application = f"bench-flushes-{iso.run_id}"
    sent = 0
    kept: dict[int, int] = {}
    done = asyncio.Event()
    slicing = None
    try:
        async with running(iso, "up", settings={"DATABASE_APPLICATION_NAME": application}) as service:
            if args.postgres_slice_us:
                slicing = asyncio.create_task(
                    _slices(application, int(args.postgres_slice_us * 1000), done, kept)
                )
            for rate in args.rates:
                count = int(rate * (args.seconds + 2 * args.margin))
                bodies, _ = workload(sent, count)
                data = out / f"flushes-{rate:g}.data"
                try:
                    async with asyncio.TaskGroup() as group:  # perf failing stops the load too
                        loading = group.create_task(
                            post_all(service.urls, bodies, 256, 3 * args.seconds + 60, rate=rate)
                        )
                        group.create_task(_record(data, args.seconds, args.margin))
                except* PerfError as failed:
                    raise failed.exceptions[0] from None
                load = loading.result()
                sent += count
                await wait_traced(iso, sent, 60)
                print(
                    f"at {rate:,.0f} unique events/s by webhook (sent {load.rate:,.0f}/s; "
                    f"p50 {load.percentile(50):.1f} ms, p99 {load.percentile(99):.1f} ms):"
                )
                for line in summary(split(await _script(data))):
                    print("  " + line)
    finally:
        done.set()
        if slicing is not None:
            await slicing
        await iso.cleanup()
    if args.postgres_slice_us:
        slices = sorted({ns / 1000 for ns in kept.values()})
        print(f"the service's {len(kept)} Postgres backends were asked for a slice of "
              f"{args.postgres_slice_us:g} µs; the kernel reported {', '.join(f'{us:g}' for us in slices)} µs")  # fmt: skip
    print(f"recordings in {out} (perf script --input …)")


def rates(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError("rates are events/s above 0, comma-separated: 100,1000")
    return values


def cli(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.flushes",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--rates", type=rates, default=[100.0, 1000.0],
                        help="unique webhook events/s, comma-separated (default 100,1000)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each recording")
    parser.add_argument("--margin", type=float, default=4.0,
                        help="seconds of load before and after each recording")  # fmt: skip
    parser.add_argument("--out", help="folder for the recordings (default: a new temporary one)")
    parser.add_argument("--postgres-slice-us", type=float, default=0.0,
                        help="ask the kernel for this scheduler slice (µs, Linux 6.12+) for the "
                             "service's own Postgres backends while they live (default: leave them)")  # fmt: skip
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 60:
        parser.error("--seconds: between 1 and 60")
    if not 0 <= args.margin <= 60:
        parser.error("--margin: between 0 and 60")
    if args.postgres_slice_us and not 100 <= args.postgres_slice_us <= 100_000:
        parser.error("--postgres-slice-us: between 100 and 100000 (the kernel's bounds), or 0 to leave it")
    if shutil.which("perf") is None:
        parser.error("needs perf (Debian: apt install linux-perf)")
    if args.postgres_slice_us and os.geteuid() != 0:
        parser.error("--postgres-slice-us: needs root, to set the slice of Postgres's processes")
    args.out = Path(args.out or tempfile.mkdtemp(prefix="bench-flushes-"))
    args.out.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    try:
        asyncio.run(main(cli()))
    except PerfError as failed:
        sys.exit(f"bench.flushes: {failed}")
    except KeyboardInterrupt:
        sys.exit(130)
