"""What the benchmark says the machine went through: the time the host took from its cores."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import asyncpg
import pytest
from bench import measure
from bench.harness import DATABASE_URL
from bench.measure import (
    CpuMeter,
    Pressure,
    PressureMeter,
    StealMeter,
    WindowCpu,
    busy_seconds,
    cpu_seconds,
    stolen_seconds,
)


def test_stolen_seconds_are_the_steal_column_of_the_machines_line(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 1000 5 0 7 250 0 0\ncpu0 50 0 25 500 2 0 3 125 0 0\n", encoding="ascii")
    assert stolen_seconds(str(stat)) == 250 / measure._TICKS

    stat.write_text("cpu  100 0 50 1000\n", encoding="ascii")  # a kernel that does not count it
    assert stolen_seconds(str(stat)) == 0.0
    assert stolen_seconds(str(tmp_path / "missing")) == 0.0


def test_busy_seconds_are_every_state_that_ran_something(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: idle, I/O wait and steal ran nothing here
    stat.write_text("cpu  100 20 50 1000 5 3 7 250 0 0\n", encoding="ascii")
    assert busy_seconds(str(stat)) == (100 + 20 + 50 + 3 + 7) / measure._TICKS
    assert busy_seconds(str(tmp_path / "missing")) == 0.0


async def test_a_process_counts_the_children_it_reaped_only_when_asked() -> None:
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    own, reaped = cpu_seconds(os.getpid()), cpu_seconds(os.getpid(), reaped=True)
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", burn)
    await child.wait()
    assert cpu_seconds(os.getpid()) - own < 0.15  # it only waited
    assert 0.25 <= cpu_seconds(os.getpid(), reaped=True) - reaped <= 0.6


def test_postgres_counts_a_backend_that_closed_for_its_share_of_the_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The postmaster (1) and a backend (2) that had spent 3 s when the window began, 1 s more in
    # it, and closed: the postmaster's count then holds the backend's whole 4 s.
    pids = iter([[1, 2], [1]])
    seconds = iter([5.0, 3.0, 5.0 + 1.0 + 4.0])
    monkeypatch.setattr(measure, "cpu_seconds", lambda pid, reaped=False: next(seconds))
    meter = CpuMeter({"Postgres": lambda: next(pids)})
    meter.start()
    assert meter.stop() == {"Postgres": pytest.approx(1.0 + 1.0)}  # its own 1 s, and the backend's


def test_a_windows_cpu_leaves_the_rest_of_the_machine_to_what_no_group_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    busy = iter([100.0, 100.0 + 8.0])  # the cores ran something 8 s of the window
    children = iter([1.0, 1.0 + 0.5])  # a command this process ran and reaped: 0.5 s
    groups = iter([{"service": 2.0, "Postgres": 1.0}])
    monkeypatch.setattr(measure, "busy_seconds", lambda: next(busy))
    monkeypatch.setattr(measure, "children_cpu", lambda: next(children))
    monkeypatch.setattr(CpuMeter, "start", lambda self: None)
    monkeypatch.setattr(CpuMeter, "stop", lambda self: next(groups))

    cpu = WindowCpu(lambda: [], children="purge")
    cpu.start()
    assert cpu.stop_per(1_000) == pytest.approx(
        {"service": 2.0, "Postgres": 1.0, "purge": 0.5, "rest of the machine": 4.5}  # ms per event
    )
    assert measure.cpu_note({"service": 0.2, "Postgres": 0.1126}) == (
        "CPU per event: service 0.200 ms, Postgres 0.113 ms"
    )


def test_the_share_is_of_every_cores_time_over_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    stolen = iter([10.0, 11.5])  # 1.5 s taken from the cores over the window
    clock = iter([100.0, 105.0])  # 5 s of wall clock, on 2 cores: 10 s of core time
    monkeypatch.setattr(measure, "stolen_seconds", lambda: next(stolen))
    monkeypatch.setattr(measure.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(measure.os, "cpu_count", lambda: 2)

    meter = StealMeter()
    meter.start()
    assert meter.stop() == pytest.approx(0.15)


async def test_a_window_measured_on_this_machine_is_a_share() -> None:
    (result, share) = await StealMeter().during(_idle())
    assert result == "done"
    assert 0.0 <= share <= 1.0


async def _idle() -> str:
    await asyncio.sleep(0.05)  # wait-ok: a window for the meter to measure
    return "done"


def test_the_windows_note_says_what_the_host_took() -> None:
    pressure = Pressure(
        cpu_stall_ms=4_192.0,
        io_stall_ms=553.0,
        stolen_ms=812.4,
        checkpoints=1,
        checkpoint_sync_ms=48.0,
        wal_bytes=1e6,
        full_page_images=20,
        blocks_read=3,
        wal_flushes=1_500,
    )
    window = "CPU stall 4,192 ms, I/O stall 553 ms, taken by the host 812 ms, 1 checkpoint(s) (48 ms syncing)"
    assert str(pressure) == f"{window}, 1,500 WAL flushes"  # Postgres did not time them
    pressure.wal_flush_ms = 240.0
    assert str(pressure) == f"{window}, 1,500 WAL flushes (240 ms, 160 µs each)"
    pressure.disk_writes, pressure.disk_write_ms, pressure.disk_flushes = 2_000, 900.0, 0
    assert str(pressure) == (
        f"{window}, 1,500 WAL flushes (240 ms, 160 µs each); its disk: 2,000 writes (450 µs each), 0 cache flushes (none)"
    )
    pressure.postgres_core_wait_ms = 1_250.0
    assert str(pressure).endswith("0 cache flushes (none); Postgres waited 1,250 ms for a core")


def test_core_waits_are_each_live_processes_time_ready_but_not_running() -> None:
    gone = 2**22 + 1  # above the kernel's largest pid
    waits = measure.core_waits([os.getpid(), gone])
    assert set(waits) == {os.getpid()}
    assert waits[os.getpid()] >= 0.0


def test_the_disks_counters_are_the_whole_disks_even_for_a_partition(tmp_path: Path) -> None:
    # /sys/dev/block/<major>:<minor> of a partition links inside its disk's directory
    held = tmp_path / "file"
    held.write_text("", encoding="ascii")
    device = os.stat(held).st_dev
    disk = tmp_path / "devices" / "vda"
    (disk / "vda1").mkdir(parents=True)
    (disk / "vda1" / "partition").write_text("1\n", encoding="ascii")
    (disk / "vda1" / "stat").write_text(" ".join(["9"] * 17), encoding="ascii")
    # reads (4), writes 300 in 150 ms, in flight, ms, weighted, discards (4), flushes 40 in 2 ms
    (disk / "stat").write_text("1 0 8 1 300 5 2400 150 0 100 160 0 0 0 0 40 2\n", encoding="ascii")
    blocks = tmp_path / "block"
    blocks.mkdir()
    (blocks / f"{os.major(device)}:{os.minor(device)}").symlink_to(disk / "vda1")
    assert measure.disk_counters(str(held), str(blocks)) == (300.0, 150.0, 40.0, 2.0)

    # a kernel before 5.5 counts no flushes
    (disk / "stat").write_text("1 0 8 1 300 5 2400 150 0 100 160\n", encoding="ascii")
    assert measure.disk_counters(str(held), str(blocks)) == (300.0, 150.0, 0.0, 0.0)
    # not this machine's, or not a block device's
    assert measure.disk_counters(str(tmp_path / "missing"), str(blocks)) == (0.0, 0.0, 0.0, 0.0)
    assert measure.disk_counters(str(held), str(tmp_path / "none")) == (0.0, 0.0, 0.0, 0.0)
    assert measure.disk_counters(None) == (0.0, 0.0, 0.0, 0.0)


async def test_a_windows_pressure_takes_each_figure_from_its_own_counter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stalls = {"cpu": iter([1_000_000.0, 5_000_000.0]), "io": iter([0.0, 250_000.0])}  # microseconds
    stolen = iter([2.0, 2.75])
    # checkpoints, their sync ms, WAL bytes, full-page images, blocks read, WAL flushes, their ms,
    # whether Postgres timed them, where its WAL lies
    postgres = iter([
        (3, 10.0, 1_000.0, 5, 7, 100, 20.0, 1, "/pg/wal"), (4, 58.0, 9_000.0, 25, 10, 600, 95.0, 1, "/pg/wal"),
    ])  # fmt: skip
    # the WAL disk's writes, ms writing, cache flushes, ms flushing
    disk = iter([(1_000.0, 500.0, 40.0, 2.0), (1_800.0, 980.0, 140.0, 9.5)])
    monkeypatch.setattr(measure, "_stall_us", lambda resource: next(stalls[resource]))
    monkeypatch.setattr(measure, "stolen_seconds", lambda: next(stolen))
    monkeypatch.setattr(measure, "disk_counters", lambda path: next(disk) if path == "/pg/wal" else None)
    # Postgres's processes' seconds waiting for a core: pid 2 exits, pid 3 starts within the window
    waits = iter([{1: 0.5, 2: 1.0}, {1: 0.75, 3: 0.125}])
    monkeypatch.setattr(measure, "core_waits", lambda pids: next(waits))

    async def fetchrow(_query: str) -> tuple[float, ...]:
        return next(postgres)

    meter = PressureMeter(fetchrow)
    await meter.start()
    assert await meter.stop() == Pressure(
        cpu_stall_ms=4_000.0, io_stall_ms=250.0, stolen_ms=750.0, checkpoints=1,
        checkpoint_sync_ms=48.0, wal_bytes=8_000.0, full_page_images=20, blocks_read=3,
        wal_flushes=500, wal_flush_ms=75.0, disk_writes=800, disk_write_ms=480.0, disk_flushes=100,
        disk_flush_ms=7.5, postgres_core_wait_ms=375.0,
    )  # fmt: skip


async def test_the_publishers_cpu_is_a_group_of_its_own_without_its_preparing() -> None:
    # A child that spends CPU, like the publisher, reaped inside the window; it says it spent
    # 0.05 s preparing before the window, which is not the window's.
    class Publisher:
        preparing_cpu = 0.05

    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    with measure.dual_cpu(lambda: [], Publisher()) as used:
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", burn)
        await child.wait()
        assert used == {}  # filled in when the window ends
    assert set(used) == {"service", "load generator", "publisher", "RabbitMQ", "Postgres", "Redis"}
    assert used["service"] == 0.0  # no process in that group
    # The child's 0.3 s, less the 0.05 it spent preparing; this process's own CPU over the window
    # (it only waited for the child) is the load generator's, not the publisher's.
    assert 0.2 <= used["publisher"] <= 0.45
    assert used["load generator"] < 0.15


async def test_wal_flush_time_is_left_unknown_unless_postgres_timed_the_whole_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(measure, "_stall_us", lambda resource: 0.0)
    monkeypatch.setattr(measure, "stolen_seconds", lambda: 0.0)
    monkeypatch.setattr(measure, "core_waits", lambda pids: {})  # no Postgres on this machine
    # Timing turned on halfway: the flushes before it took no time that Postgres counted.
    postgres = iter([(0, 0.0, 0.0, 0, 0, 100, 0.0, 0, None), (0, 0.0, 0.0, 0, 0, 600, 95.0, 1, None)])

    async def fetchrow(_query: str) -> tuple[float, ...]:
        return next(postgres)

    meter = PressureMeter(fetchrow)
    await meter.start()
    pressure = await meter.stop()
    assert (pressure.wal_flushes, pressure.wal_flush_ms) == (500, None)
    assert pressure.postgres_core_wait_ms is None


async def test_the_meter_reads_a_real_postgres() -> None:
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        meter = PressureMeter(conn.fetchrow)
        await meter.start()
        # A commit on another backend, which reports its counters to the server as it exits
        writer = await asyncpg.connect(DATABASE_URL)
        await writer.execute("CREATE TEMP TABLE flushed (n int); INSERT INTO flushed VALUES (1)")
        await writer.close()
        timed = await conn.fetchval("SELECT current_setting('track_wal_io_timing') = 'on'")
        wal = await conn.fetchval("SELECT current_setting('data_directory') || '/pg_wal'")
        for _ in range(50):
            pressure = await meter.stop()
            if pressure.wal_flushes:
                break
            await asyncio.sleep(0.1)  # wait-ok: the exiting backend's counters reach the server
    finally:
        await conn.close()
    assert pressure.wal_bytes > 0
    assert pressure.wal_flushes >= 1  # its commit flushed the WAL
    assert (pressure.wal_flush_ms is not None) == timed
    assert pressure.postgres_core_wait_ms is not None  # Postgres runs on this machine
    assert pressure.postgres_core_wait_ms >= 0.0
    if measure.disk_counters(wal) != (0.0, 0.0, 0.0, 0.0):  # the WAL is on a disk of this machine
        assert pressure.disk_writes >= 1  # the flush wrote the WAL to it
