"""Where a WAL flush's time goes: each fdatasync split by the scheduler's and the block layer's
tracepoints, from ``perf script`` text and from a real recording of a real Postgres."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import uuid
from pathlib import Path

import asyncpg
import pytest
from bench import flushes
from bench.harness import DATABASE_URL
from bench.measure import disk_counters

# perf script -F comm,tid,cpu,time,event,trace, as perf prints it (trimmed to what is read)
ONE_FLUSH = """\
        postgres  5794 [001]     1.000000: syscalls:sys_enter_fdatasync: fd: 0x00000025
        postgres  5794 [001]     1.000050:         block:block_rq_issue: 254,0 WS 8192 () 30275400 + 16 0x2,0,4 [postgres]
        postgres  5794 [001]     1.000100:           sched:sched_switch: prev_comm=postgres prev_pid=5794 prev_prio=120 prev_state=D ==> next_comm=python next_pid=700 next_prio=120
         swapper     0 [000]     1.000250:      block:block_rq_complete: 254,0 WS () 30275400 + 16 0x2,0,4 [0]
         swapper     0 [000]     1.000260:          sched:sched_waking: comm=postgres pid=5794 prio=120 target_cpu=001
          python   700 [001]     1.000900:           sched:sched_switch: prev_comm=python prev_pid=700 prev_prio=120 prev_state=R ==> next_comm=postgres next_pid=5794 next_prio=120
        postgres  5794 [001]     1.001000:  syscalls:sys_exit_fdatasync: 0x0
"""


def test_a_flush_is_split_into_cpu_sleep_and_waiting_for_a_core() -> None:
    result = flushes.split(flushes.parse(ONE_FLUSH.splitlines()))
    (flush,) = result.flushes
    assert flush.tid == 5794
    assert flush.length == pytest.approx(1000e-6)
    assert flush.on_cpu == pytest.approx(200e-6)  # 1.000000-1.000100 and 1.000900-1.001000
    assert flush.asleep == pytest.approx(160e-6)  # off the CPU until the completion woke it
    assert flush.woken_waiting == pytest.approx(640e-6)  # woken, python kept the core
    assert flush.preempted_waiting == 0.0
    assert flush.disk == pytest.approx(200e-6)  # its write, issued to completed
    assert flush.any_disk == pytest.approx(200e-6)
    assert result.requests == {"WS": [pytest.approx(200e-6)]}


def test_the_parts_add_up_to_the_call_and_preemption_is_its_own_part() -> None:
    text = """\
        postgres  10 [000]     5.000000: syscalls:sys_enter_fdatasync: fd: 0x3
        postgres  10 [000]     5.000100:           sched:sched_switch: prev_comm=postgres prev_pid=10 prev_prio=120 prev_state=R+ ==> next_comm=beam.smp next_pid=20 next_prio=120
        beam.smp  20 [000]     5.000400:           sched:sched_switch: prev_comm=beam.smp prev_pid=20 prev_prio=120 prev_state=S ==> next_comm=postgres next_pid=10 next_prio=120
        postgres  10 [000]     5.000500:           sched:sched_switch: prev_comm=postgres prev_pid=10 prev_prio=120 prev_state=D ==> next_comm=swapper/0 next_pid=0 next_prio=120
   kworker/0:1H-kb  30 [000]     5.000550:         block:block_rq_issue: 254,0 FF 0 () 0 + 0 0x0,0,0 [kworker/0:1H]
         swapper     0 [000]     5.000700:      block:block_rq_complete: 254,0 FF () 18446744073709551615 + 0 0x0,0,0 [0]
         swapper     0 [000]     5.000710:          sched:sched_waking: comm=postgres pid=10 prio=120 target_cpu=000
         swapper     0 [000]     5.000720:           sched:sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=postgres next_pid=10 next_prio=120
        postgres  10 [000]     5.000800:  syscalls:sys_exit_fdatasync: 0x0
"""
    (flush,) = flushes.split(flushes.parse(text.splitlines())).flushes
    parts = flush.on_cpu + flush.asleep + flush.woken_waiting + flush.preempted_waiting
    assert parts == pytest.approx(flush.length)
    assert flush.preempted_waiting == pytest.approx(300e-6)
    assert flush.asleep == pytest.approx(210e-6)
    assert flush.woken_waiting == pytest.approx(10e-6)
    assert flush.disk == 0.0  # the cache flush was issued by a kernel worker, not by this process
    assert flush.any_disk == pytest.approx(150e-6)  # but the disk had it in hand


def test_only_postgres_flushes_count_and_a_call_cut_by_the_recording_is_left_out() -> None:
    text = """\
            java  40 [000]     1.000000: syscalls:sys_enter_fdatasync: fd: 0x3
            java  40 [000]     1.000100:  syscalls:sys_exit_fdatasync: 0x0
        postgres  41 [001]     1.000200:  syscalls:sys_exit_fdatasync: 0x0
        postgres  42 [001]     1.000300: syscalls:sys_enter_fdatasync: fd: 0x3
"""
    result = flushes.split(flushes.parse(text.splitlines()))
    assert result.flushes == []
    assert flushes.summary(result) == ["no fdatasync of Postgres in the recording"]


def test_a_task_name_with_spaces_is_read_whole() -> None:
    (event,) = flushes.parse(["  Web Content  77 [000]   3.5: sched:sched_waking: comm=x pid=1 prio=120"])
    assert (event.comm, event.tid, event.time, event.name) == ("Web Content", 77, 3.5, "sched:sched_waking")


def test_the_summary_gives_each_part_and_its_share_of_the_flushes_time() -> None:
    result = flushes.split(flushes.parse(ONE_FLUSH.splitlines()))
    lines = flushes.summary(result)
    assert "1 WAL flushes by 1 processes" in lines[0]
    woken = next(line for line in lines if "woken, waiting for a core" in line)
    assert woken.split()[-5:] == ["640", "640", "640", "64", "%"]
    disk = next(line for line in lines if "its own requests in the disk" in line)
    assert disk.split()[-5:] == ["200", "200", "200", "20", "%"]
    assert lines[-1].endswith("WS 1 (200 µs median, 200 p90)")


def test_rates_are_checked() -> None:
    assert flushes.rates("100, 1000") == [100.0, 1000.0]
    for bad in ("", "0", "100,-5"):
        with pytest.raises(argparse.ArgumentTypeError, match="above 0"):
            flushes.rates(bad)


@pytest.mark.skipif(shutil.which("perf") is None, reason="perf is not installed")
async def test_a_real_recording_splits_a_real_backends_commits(tmp_path: Path) -> None:
    schema = "test_flushes_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(DATABASE_URL)
    data = tmp_path / "flushes.data"
    try:
        await conn.execute(f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.t (n int)")
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        wal = await conn.fetchval("SELECT current_setting('data_directory') || '/pg_wal'")
        recording = asyncio.ensure_future(flushes._record(data, 2.0, 0.0))
        commits = 0
        while not recording.done():  # each commit flushes its WAL: one fdatasync each
            await conn.execute(f"INSERT INTO {schema}.t VALUES ($1)", commits)
            commits += 1
            await asyncio.sleep(0.005)  # wait-ok: a few hundred commits across the recording
        await recording
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()
    result = flushes.split(await flushes._script(data))
    own = [flush for flush in result.flushes if flush.tid == pid]
    assert len(own) >= 20, f"{len(own)} of {commits} commits seen flushing"
    for flush in own:
        parts = flush.on_cpu + flush.asleep + flush.woken_waiting + flush.preempted_waiting
        assert parts == pytest.approx(flush.length, abs=1e-6)
        assert flush.on_cpu > 0
    assert any(flush.asleep > 0 for flush in own)  # it slept while its WAL went to the disk
    if disk_counters(wal) != (0.0, 0.0, 0.0, 0.0):  # the WAL is on a disk of this machine
        assert any(flush.disk > 0 for flush in own)
        assert any(kind.startswith("W") for kind in result.requests)


def _kernel_keeps_custom_slices() -> bool:
    major, minor = (int(part) for part in re.findall(r"\d+", platform.release())[:2])
    return (major, minor) >= (6, 12)


@pytest.mark.skipif(not _kernel_keeps_custom_slices(), reason="EEVDF's custom slice came in Linux 6.12")
async def test_the_slice_of_an_applications_backends_is_set_while_they_live() -> None:
    application = "test-flushes-" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(DATABASE_URL, server_settings={"application_name": application})
    other = await asyncpg.connect(DATABASE_URL)  # another application's backend is left alone
    try:
        pid, other_pid = (
            await conn.fetchval("SELECT pg_backend_pid()"),
            await other.fetchval("SELECT pg_backend_pid()"),
        )
        done, kept = asyncio.Event(), {}
        slicing = asyncio.create_task(flushes._slices(application, 150_000, done, kept))
        for _ in range(100):
            if kept:
                break
            await asyncio.sleep(0.05)  # wait-ok: the first pass over pg_stat_activity
        done.set()
        await slicing
        assert kept == {pid: 150_000}
        assert flushes.set_slice(pid, 0) not in (0, 150_000)  # back to the kernel's own slice
        assert other_pid not in kept
    finally:
        await conn.close()
        await other.close()


async def test_perf_failing_to_record_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "perf"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'No permission to enable sched:sched_switch event.' >&2\nexit 255\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with pytest.raises(
        flushes.PerfError, match="perf record failed: No permission to enable sched:sched_switch"
    ):
        await flushes._record(tmp_path / "out.data", 1.0, 0.0)
