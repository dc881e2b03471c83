"""Measuring a scenario: CPU seconds per component, memory, what the trace handler saw, and the
machine's own stalls (CPU, I/O, Postgres checkpoints, time the host took from its cores)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, reaped: bool = False) -> float:
    """User + system CPU time of a process so far (0 when it is gone); with ``reaped``, with
    that of its children that have exited and that it has waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICKS


def _machine_ticks(path: str) -> list[int]:
    """The machine's line of /proc/stat: clock ticks of every core, summed, by state."""
    try:
        with open(path, encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return []
    return [int(field) for field in fields[1:]] if fields and fields[0] == "cpu" else []


def stolen_seconds(path: str = "/proc/stat") -> float:
    """Seconds of this machine's cores that the host gave to others since boot, summed over the
    cores (``steal`` in /proc/stat; 0 where the kernel does not count it). A virtual machine's
    scenario runs slower in a window where this grows, whatever the code does."""
    ticks = _machine_ticks(path)
    return ticks[7] / _TICKS if len(ticks) > 7 else 0.0


def busy_seconds(path: str = "/proc/stat") -> float:
    """Seconds this machine's cores ran anything since boot, summed over the cores: user, nice,
    system, irq and softirq in /proc/stat (not idle, I/O wait or steal) -- every process's and
    the kernel's own threads'."""
    ticks = _machine_ticks(path)
    return sum(ticks[state] for state in (0, 1, 2, 5, 6) if state < len(ticks)) / _TICKS


class StealMeter:
    """The share of the machine's core time the host took between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._before = (0.0, 0.0)

    @staticmethod
    def _sample() -> tuple[float, float]:
        return stolen_seconds(), time.monotonic()

    def start(self) -> None:
        self._before = self._sample()

    def stop(self) -> float:
        stolen, now = self._sample()
        elapsed = (now - self._before[1]) * (os.cpu_count() or 1)
        return (stolen - self._before[0]) / elapsed if elapsed > 0 else 0.0

    async def during(self, work: Awaitable[T]) -> tuple[T, float]:
        """``work``'s result, and the share of the cores' time the host took while it ran."""
        self.start()
        result = await work
        return result, self.stop()


def pids_named(*names: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if comm in names:
                found.append(int(entry.name))
    return found


def core_waits(pids: Iterable[int]) -> dict[int, float]:
    """Seconds each process has spent runnable but waiting for a core, since it started
    (``/proc/<pid>/schedstat``; processes gone meanwhile, or a kernel without it, are left out)."""
    waits = {}
    for pid in pids:
        try:
            waits[pid] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return waits


def status_mb(pid: int, field: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


#: Groups whose processes' exited children count as theirs: Postgres's postmaster reaps every
#: backend that closes (a command's connection, a pool's), whose CPU would otherwise go uncounted.
_REAPING = frozenset({"Postgres"})


class CpuMeter:
    """CPU seconds spent by each group of processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, groups: Mapping[str, Callable[[], Iterable[int]]]) -> None:
        self._groups = groups
        self._before: dict[str, dict[int, float]] = {}

    def _sample(self) -> dict[str, dict[int, float]]:
        return {
            name: {pid: cpu_seconds(pid, reaped=name in _REAPING) for pid in pids()}
            for name, pids in self._groups.items()
        }

    def start(self) -> None:
        self._before = self._sample()

    def stop(self) -> dict[str, float]:
        after = self._sample()
        used = {}
        for name, pids in after.items():
            before = self._before.get(name, {})
            used[name] = sum(max(0.0, seconds - before.get(pid, 0.0)) for pid, seconds in pids.items())
            if name in _REAPING:  # a child that exited is in its parent's count, whole life long
                used[name] = max(0.0, used[name] - sum(s for pid, s in before.items() if pid not in pids))
        return used

    def stop_per(self, count: int) -> dict[str, float]:
        """:meth:`stop`, as ms of CPU per one of ``count`` events (or requests)."""
        return {name: seconds / count * 1000 for name, seconds in self.stop().items()}


def machine_meter(service: Callable[[], Iterable[int]]) -> CpuMeter:
    """The groups of the CPU table: ``service``, this process (the load generator), the stores."""
    return CpuMeter({"service": service, "load generator": lambda: [os.getpid()], **infrastructure()})


@contextmanager
def dual_cpu(service: Callable[[], Iterable[int]], publisher: Any) -> Iterator[dict[str, float]]:
    """CPU seconds of each group of the CPU table over the block, filled in when it ends. The
    publisher (``publisher``, the ``go`` of :func:`bench.service.publisher`, whose process the block
    has reaped) is a group of its own, without what it spent preparing its messages; the load
    generator is this process (the HTTP load and the bench's own bookkeeping)."""
    meter = machine_meter(service)
    meter.start()
    children = children_cpu()
    used: dict[str, float] = {}
    yield used
    used.update(meter.stop())
    used["publisher"] = children_cpu() - children - publisher.preparing_cpu


def cpu_note(per_event: Mapping[str, float]) -> str:
    """CPU ms per event of each group, for a row's note."""
    return "CPU per event: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in per_event.items())


class WindowCpu:
    """The CPU a window of load cost per event: each group of the CPU table (the ``service``, this
    process as the load generator, the stores), this process's children that exited meanwhile
    (a command it ran, under ``children``), and the rest of the machine (the kernel's threads and
    any other process), from the machine's busy time less all of those."""

    def __init__(self, service: Callable[[], Iterable[int]], children: str | None = None) -> None:
        self._meter = machine_meter(service)
        self._children_name = children
        self._children = 0.0
        self._busy = 0.0

    def start(self) -> None:
        self._meter.start()
        self._children = children_cpu()
        self._busy = busy_seconds()

    def stop_per(self, count: int) -> dict[str, float]:
        """What each spent since :meth:`start`, in ms per one of ``count`` events."""
        busy = busy_seconds() - self._busy
        count = max(count, 1)
        used = self._meter.stop()
        if self._children_name is not None:
            used[self._children_name] = children_cpu() - self._children
        used["rest of the machine"] = max(0.0, busy - sum(used.values()))
        return {name: seconds / count * 1000 for name, seconds in used.items()}


def children_cpu() -> float:
    """CPU time of this process's children that have exited (the publisher, once it is done)."""
    times = os.times()
    return times.children_user + times.children_system


def infrastructure() -> dict[str, Callable[[], Iterable[int]]]:
    return {
        "RabbitMQ": lambda: pids_named("beam.smp"),
        "Postgres": lambda: pids_named("postgres"),
        "Redis": lambda: pids_named("redis-server"),
    }


@dataclass
class Traced:
    """Business-logic runs recorded by ``bench.handlers.trace``: dedup key -> run times."""

    runs: dict[str, list[float]]

    @classmethod
    def read(cls, directory: Path) -> Traced:
        runs: dict[str, list[float]] = {}
        for path in directory.glob("trace-*.txt"):
            for line in path.read_text(encoding="ascii").splitlines():
                key, _, at = line.partition(" ")
                runs.setdefault(key, []).append(float(at))
        return cls(runs)

    def lost(self, keys: Iterable[str]) -> int:
        return sum(1 for key in keys if key not in self.runs)

    def doubled(self) -> int:
        return sum(1 for times in self.runs.values() if len(times) > 1)

    def latencies_ms(self, sent: Mapping[str, float]) -> list[float]:
        return [(min(self.runs[key]) - at) * 1000 for key, at in sent.items() if key in self.runs]


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


@dataclass
class Pressure:
    """What the machine went through over a window: time some task stalled waiting for a core or
    for I/O (the kernel's pressure-stall information, /proc/pressure), time the host took from the
    machine's cores (steal, summed over the cores), Postgres checkpoints, and what Postgres wrote
    to its WAL and read from outside its buffers (the whole server's), and how often it flushed
    the WAL to disk: the time those flushes took is known only where Postgres times them
    (``track_wal_io_timing``), else ``wal_flush_ms`` is ``None``. Where the WAL's disk is on
    this machine, also what that disk did, as the kernel's block layer saw it: writes and
    cache flushes completed and the time they took (all of the disk's, not only Postgres's), and
    the time Postgres's processes spent ready to run but waiting for a core (those alive at the
    window's end)."""

    cpu_stall_ms: float
    io_stall_ms: float
    stolen_ms: float
    checkpoints: int
    checkpoint_sync_ms: float
    wal_bytes: float
    full_page_images: int
    blocks_read: int
    wal_flushes: int = 0
    wal_flush_ms: float | None = None
    disk_writes: int = 0
    disk_write_ms: float = 0.0
    disk_flushes: int = 0
    disk_flush_ms: float = 0.0
    postgres_core_wait_ms: float | None = None

    def __str__(self) -> str:
        wal = f"{self.wal_flushes:,} WAL flushes"
        if self.wal_flush_ms is not None:
            wal += f" ({self.wal_flush_ms:,.0f} ms, {_each_us(self.wal_flush_ms, self.wal_flushes)})"
        if self.disk_writes or self.disk_flushes:
            wal += (
                f"; its disk: {self.disk_writes:,} writes ({_each_us(self.disk_write_ms, self.disk_writes)}), "
                f"{self.disk_flushes:,} cache flushes ({_each_us(self.disk_flush_ms, self.disk_flushes)})"
            )
        if self.postgres_core_wait_ms is not None:
            wal += f"; Postgres waited {self.postgres_core_wait_ms:,.0f} ms for a core"
        return (
            f"CPU stall {self.cpu_stall_ms:,.0f} ms, I/O stall {self.io_stall_ms:,.0f} ms, "
            f"taken by the host {self.stolen_ms:,.0f} ms, {self.checkpoints} checkpoint(s) ({self.checkpoint_sync_ms:,.0f} ms syncing), "
            f"{wal}"
        )

    def per_event(self, events: int) -> str:
        """What Postgres wrote and read per event over the window (the whole server's counters)."""
        events = max(events, 1)
        return (
            f"WAL {self.wal_bytes / events / 1024:.1f} KiB per event "
            f"({self.full_page_images / events:.2f} full-page images), "
            f"{self.blocks_read / events:.2f} blocks read from outside shared buffers per event"
        )


def _each_us(ms: float, count: int) -> str:
    return f"{ms / count * 1000:,.0f} µs each" if count else "none"


def disk_counters(path: str | None, sys_block: str = "/sys/dev/block") -> tuple[float, float, float, float]:
    """Writes completed, milliseconds writing, cache flushes completed and milliseconds flushing,
    since boot, of the disk that holds ``path`` (the whole disk for a partition), from the kernel's
    block-layer statistics; zeros where the path is not on this machine or not on a block device
    (a network or memory file system), or where the kernel does not count flushes (before 5.5)."""
    if path is None:
        return 0.0, 0.0, 0.0, 0.0
    try:
        device = os.stat(path).st_dev
        node = Path(sys_block) / f"{os.major(device)}:{os.minor(device)}"
        if (node / "partition").exists():
            node = node.resolve().parent
        fields = (node / "stat").read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0, 0.0, 0.0
    # reads: 0-3; writes completed, merged, sectors, ms: 4-7; in flight, ms, weighted: 8-10;
    # discards: 11-14; flushes completed, ms: 15-16
    if len(fields) < 17:
        return float(fields[4]), float(fields[7]), 0.0, 0.0
    return float(fields[4]), float(fields[7]), float(fields[15]), float(fields[16])


def _stall_us(resource: str) -> float:
    """Microseconds some task stalled on ``resource`` since boot (0 where PSI is off)."""
    try:
        line = Path(f"/proc/pressure/{resource}").read_text().splitlines()[0]
    except (OSError, IndexError):
        return 0.0
    return float(line.rsplit("total=", 1)[1])


_POSTGRES = """
SELECT b.checkpoints_timed + b.checkpoints_req, b.checkpoint_sync_time, w.wal_bytes, w.wal_fpi,
       (SELECT sum(blks_read) FROM pg_stat_database), w.wal_sync, w.wal_sync_time,
       (current_setting('track_wal_io_timing') = 'on')::int,
       CASE WHEN pg_has_role('pg_read_all_settings', 'USAGE')
            THEN current_setting('data_directory') || '/pg_wal' END
FROM pg_stat_bgwriter AS b, pg_stat_wal AS w
"""


class PressureMeter:
    """:class:`Pressure` between :meth:`start` and :meth:`stop` (Postgres through ``fetchrow``)."""

    def __init__(self, fetchrow: Callable[[str], Any]) -> None:
        self._fetchrow = fetchrow
        self._before: tuple[float, ...] = ()
        self._waits: dict[int, float] = {}

    async def _sample(self) -> tuple[float, ...]:
        *counters, timed, wal = await self._fetchrow(_POSTGRES)
        return (
            _stall_us("cpu"), _stall_us("io"), stolen_seconds(), *(float(value) for value in counters),
            *disk_counters(wal), float(timed),
        )  # fmt: skip

    async def start(self) -> None:
        self._before = await self._sample()
        self._waits = core_waits(pids_named("postgres"))

    async def stop(self) -> Pressure:
        after = await self._sample()
        waits = core_waits(pids_named("postgres"))
        before = self._before
        cpu, io, stolen, checkpoints, sync_ms, wal, fpi, read, flushes, flush_ms, *disk, _ = (
            a - b for a, b in zip(after, before, strict=True)
        )
        timed = bool(before[-1] and after[-1])
        return Pressure(
            cpu_stall_ms=cpu / 1000,
            io_stall_ms=io / 1000,
            stolen_ms=stolen * 1000,
            checkpoints=int(checkpoints),
            checkpoint_sync_ms=sync_ms,
            wal_bytes=wal,
            full_page_images=int(fpi),
            blocks_read=int(read),
            wal_flushes=int(flushes),
            wal_flush_ms=flush_ms if timed else None,
            disk_writes=int(disk[0]),
            disk_write_ms=disk[1],
            disk_flushes=int(disk[2]),
            disk_flush_ms=disk[3],
            # a process started in the window waited all of its time in it
            postgres_core_wait_ms=(
                sum(wait - self._waits.get(pid, 0.0) for pid, wait in waits.items()) * 1000 if waits else None
            ),
        )

    async def during(self, work: Awaitable[T]) -> tuple[T, Pressure]:
        """``work``'s result, and what the machine went through while it ran."""
        await self.start()
        result = await work
        return result, await self.stop()
