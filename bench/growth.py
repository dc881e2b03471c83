"""Flat as it grows: unique events on an empty inbox, then with millions of rows in it, then a
``purge`` of a million rows alongside the load.

Rows are put in with SQL (as many processed events, each with its body, received 3 days ago
for the part the purge removes and just now for the rest), then vacuumed and analyzed, as
autovacuum would have done, and checkpointed and written to disk, as days of running would
have. Retention is off in this scenario: its own pass would otherwise run during the
measurements.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import asyncpg
import orjson

from bench.events import unique_event
from bench.harness import DATABASE_URL, Isolation, LoadResult, cli, median, post_all
from bench.measure import Pressure, PressureMeter, Traced, WindowCpu, cpu_note
from bench.report import Report, Row
from bench.rounds import lower_median, rounds_note
from bench.service import Running, e2e, running, service_env, wait_traced, workload
from evolution_ingest.stores.retention import Partition

#: A load run with what the machine and Postgres went through meanwhile.
Metered = Callable[[Awaitable[LoadResult]], Awaitable[tuple[LoadResult, Pressure]]]

_CHUNK = 250_000

_FILL = """
WITH rows AS (
    INSERT INTO evolution_ingest_inbox
        (dedup_key, event, instance, channel, webhook_seen_at, rabbitmq_seen_at, received_at,
         processed_at, attempts)
    SELECT encode(sha256(convert_to('growth-' || i, 'UTF8')), 'hex'), 'messages.upsert', 'bench-growth',
           'WEBHOOK', t, t, t, t, 1
    FROM (SELECT i, CASE WHEN i <= $3 THEN now() - interval '3 days' ELSE now() END AS t
          FROM generate_series($1::bigint, $2::bigint) AS i) AS s
    RETURNING id, received_at
)
INSERT INTO evolution_ingest_bodies (event_id, received_at, payload)
SELECT id, received_at, $4::jsonb FROM rows
"""

_SIZES = """
SELECT (SELECT count(*) FROM evolution_ingest_inbox) AS rows,
       pg_relation_size('evolution_ingest_inbox') AS heap,
       pg_total_relation_size('evolution_ingest_inbox') AS rows_total,
       (SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('evolution_ingest_bodies')) AS bodies,
       (SELECT json_object_agg(indexrelid::regclass::text, pg_relation_size(indexrelid))
          FROM pg_index WHERE indrelid = 'evolution_ingest_inbox'::regclass) AS indexes
"""


async def _connect(iso: Isolation) -> asyncpg.Connection:
    conn = await asyncpg.connect(DATABASE_URL)
    await conn.execute(f'SET search_path TO "{iso.schema}"')
    return conn


async def fill(iso: Isolation, count: int, old: int) -> float:
    """``count`` processed rows with bodies, the first ``old`` received 3 days ago; seconds taken."""
    body = orjson.dumps(unique_event(0, "growth")[0]).decode()
    started = time.perf_counter()
    conn = await _connect(iso)
    try:
        # The old rows' bodies in their day's partition, as in an inbox whose retention runs.
        day = 86_400
        first = (int(time.time()) - 3 * day) // day * day
        part = Partition(first, first + day)
        await conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{part.name}" PARTITION OF evolution_ingest_bodies '
            f"FOR VALUES FROM ('{part.bound(part.start)}') TO ('{part.bound(part.end)}')"
        )
        for start in range(1, count + 1, _CHUNK):
            end = min(count, start + _CHUNK - 1)
            await conn.execute(_FILL, start, end, old, body, timeout=900)
            print(f"growth: {end:,} of {count:,} rows in the inbox ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr)  # fmt: skip
        await conn.execute("VACUUM (ANALYZE) evolution_ingest_inbox", timeout=1800)
        await conn.execute("VACUUM (ANALYZE) evolution_ingest_bodies", timeout=1800)
        # An inbox that grew over days has its pages on disk: without this, the measurements
        # that follow would wait behind the writeback of the rows just put in (commits stall
        # behind it for a second at a time).
        await checkpoint(conn)
        await asyncio.get_running_loop().run_in_executor(None, os.sync)
    finally:
        await conn.close()
    return time.perf_counter() - started


async def checkpoint(conn: asyncpg.Connection) -> None:
    """A checkpoint now (it needs a superuser; without one, none, and a note says so)."""
    try:
        await conn.execute("CHECKPOINT", timeout=1800)
    except asyncpg.InsufficientPrivilegeError:
        print(
            "growth: no CHECKPOINT (not a superuser); the checkpoints fall where they fall", file=sys.stderr
        )


async def _metered(iso: Isolation, load: Awaitable[LoadResult]) -> tuple[LoadResult, Pressure]:
    """``load`` run with what the machine and Postgres went through meanwhile."""
    conn = await _connect(iso)
    try:
        return await PressureMeter(conn.fetchrow).during(load)
    finally:
        await conn.close()


async def sizes(iso: Isolation) -> dict[str, object]:
    conn = await _connect(iso)
    try:
        record = await conn.fetchrow(_SIZES)
    finally:
        await conn.close()
    assert record is not None
    return {**dict(record), "indexes": orjson.loads(record["indexes"])}


def _row(name: str, n: int, result: LoadResult, traced: Traced, keys: list[str], service: Running,
         note: str = "") -> Row:  # fmt: skip
    sent = {k: at for k, at in zip(keys, result.sent_at, strict=True) if not math.isnan(at)}  # sent ones only
    lost = traced.lost(sent)
    return Row(name, n, result.rate, result.percentile(50), result.percentile(99), *e2e(traced, sent),
               service.rss(), lost, traced.doubled(), note=note)  # fmt: skip


async def _purge_under_load(
    iso: Isolation, service: Running, bodies: list[bytes], rate: float
) -> tuple[LoadResult, str]:
    """``purge --older-than 2d`` while webhook events come at ``rate`` from ``bodies`` (the first
    ones, until the purge ends): the load and a note."""
    stop = asyncio.Event()
    load = asyncio.create_task(post_all(service.urls, bodies, 256, 300, rate=rate, stop=stop))
    await asyncio.sleep(2)  # wait-ok: the load runs before the purge starts
    started = time.perf_counter()
    purge = await asyncio.create_subprocess_exec(
        *cli("purge", "--older-than", "2d", "--json"), env=service_env(iso),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(purge.communicate(), 900)
    took = time.perf_counter() - started
    stop.set()
    during = await load
    removed = (
        f"{orjson.loads(out)['rows_deleted']:,} rows" if purge.returncode == 0 else "nothing (it failed)"
    )
    return during, f"purge took {took:.0f} s, removed {removed}"


async def _load_row(
    iso: Isolation, service: Running, measured: Metered, bodies: list[bytes], keys: list[str], name: str,
    *, concurrency: int, rate: float = 0.0, stalls: bool = False, note: str = "",
) -> tuple[Row, LoadResult]:  # fmt: skip
    """``bodies`` sent to ``service`` (at ``rate``, or as fast as they go at 0) and traced to the end: a
    row of the report with the WAL and reads per event and what each process spent on one (the
    service the one sent to; any other service, idle meanwhile, is in the rest of the machine),
    after what the machine went through when ``stalls``; and the load's result."""
    done = iso.traced()
    cpu = WindowCpu(lambda: service.pids)
    cpu.start()
    result, machine = await measured(post_all(service.urls, bodies, concurrency, 300, rate=rate))
    await wait_traced(iso, done + len(bodies), 60)
    spent = cpu.stop_per(len(bodies))
    parts = (note, str(machine) if stalls else "", machine.per_event(len(bodies)), cpu_note(spent))
    row = _row(name, len(bodies), result, Traced.read(iso.trace_dir), keys, service,
               note="; ".join(part for part in parts if part))  # fmt: skip
    return row, result


async def _half_load(
    report: Report, iso: Isolation, service: Running, meter: PressureMeter, bodies: list[bytes],
    keys: list[str], rate: float, name: str,
) -> LoadResult:  # fmt: skip
    """One half-load run without a purge: a row of the report, with what the machine went through."""
    row, result = await _load_row(iso, service, meter.during, bodies, keys, name, concurrency=256, rate=rate,
                                  stalls=True)  # fmt: skip
    report.rows.append(row)
    return result


async def _purge_rows(
    report: Report, iso: Isolation, service: Running, offset: int, n: int, rate: float, purged: int
) -> tuple[list[LoadResult], LoadResult]:
    """Half load twice before, during, and twice after a purge of ``purged`` rows: a row of the
    report each, with what the machine went through meanwhile. The baselines, then the load
    during the purge.

    Each of the five starts right after a checkpoint. The load alone writes enough WAL (the
    unique index's full-page images, 9 KiB an event with millions of rows) for Postgres to start
    a checkpoint every 40 s or so here, and the first change of every page after one costs a
    full-page image: where a window falls in that cycle moves its p99 by more than the purge
    does. With the events counted before it, the purge's window began with a checkpoint and
    held its sync phase, 20 s later, while the 12-second baselines held neither. Started alike,
    the windows differ by what the purge does, its own WAL (which brings the next checkpoint
    sooner) included."""
    conn = await _connect(iso)
    meter = PressureMeter(conn.fetchrow)
    baselines = []
    try:
        for run in (1, 2):
            bodies, calm = workload(offset, n)
            offset += n
            name = f"growth: at half load ({rate:,.0f}/s), no purge ({run} of 2 before)"
            await checkpoint(conn)
            baselines.append(await _half_load(report, iso, service, meter, bodies, calm, rate, name))
        done = iso.traced()
        # Made before the window: making them is the load generator's work, not the load's (it
        # added 0.1 ms per event to the load generator's CPU in the window when made inside).
        bodies, keys = workload(offset, int(rate * 300))  # bounded: at most 5 minutes of load
        offset += len(keys)
        await checkpoint(conn)
        cpu = WindowCpu(lambda: service.pids, children="purge")
        cpu.start()
        (during, note), machine = await meter.during(_purge_under_load(iso, service, bodies, rate))
        await wait_traced(iso, done + during.count, 120)
        spent = cpu.stop_per(during.count)
        report.rows.append(_row(f"growth: at half load during a purge of {purged:,} rows", during.count, during,
                                Traced.read(iso.trace_dir), keys, service,
                                note=f"{note}; {machine}; with the purge's own: {machine.per_event(during.count)}; "
                                     f"{cpu_note(spent)}"))  # fmt: skip
        for run in (1, 2):
            bodies, calm = workload(offset, n)
            offset += n
            name = f"growth: at half load ({rate:,.0f}/s), after the purge ({run} of 2)"
            await checkpoint(conn)
            baselines.append(await _half_load(report, iso, service, meter, bodies, calm, rate, name))
    finally:
        await conn.close()
    return baselines, during


def median_pair(pairs: Sequence[tuple[Row, Row]]) -> tuple[Row, Row, float]:
    """The round whose ratio of the full inbox's rate to the empty one's is the median (the lower
    one of an even count) standing for all: its two rows, each counting the events of every round
    and what any round lost (processed twice: the last round's count, which the trace accumulates
    over the rounds), every round's ratio in the full inbox's note; and that ratio."""
    ratios = [full.rate / empty.rate for empty, full in pairs]
    middle = lower_median(ratios)
    each = [f"{full.rate:,.0f} vs {empty.rate:,.0f}/s" for empty, full in pairs]
    head = rounds_note(ratios, each, "the empty inbox then the full one in each") if len(pairs) > 1 else ""

    def merged(rows: list[Row], first: str) -> Row:
        chosen = rows[middle]
        return dataclasses.replace(
            chosen,
            events=sum(r.events for r in rows),
            lost=sum(r.lost or 0 for r in rows),
            doubled=rows[-1].doubled,
            note="; ".join(part for part in (first, chosen.note) if part),
        )

    beside = f"round {middle + 1} of {len(pairs)}, the median's (every round in the next row)" if head else ""
    return merged([e for e, _ in pairs], beside), merged([f for _, f in pairs], head), ratios[middle]


async def _unique(iso: Isolation, service: Running, offset: int, n: int, name: str, note: str = "") -> Row:
    """``n`` unique webhook events as fast as they go: a row (:func:`_load_row`)."""
    bodies, keys = workload(offset, n)
    row, _ = await _load_row(iso, service, functools.partial(_metered, iso), bodies, keys, name,
                             concurrency=64, note=note)  # fmt: skip
    return row


async def growth(
    report: Report, n: int, offsets: Iterator[int], prefill: int, purged: int, rounds: int = 3
) -> None:
    """Unique events into an empty inbox and into one of ``prefill`` rows (a fresh process each,
    both running), in ``rounds`` rounds of one then the other; then a purge of ``purged`` of those
    rows alongside a load at half the empty inbox's rate.

    The target is a ratio of two throughputs, which drifts with the machine over minutes (the two
    measured once, five minutes apart, have given 0.67 and 1.59 times on the same code): each round
    measures both within a few seconds of each other, and the median round stands for all. Events
    get ids from ``offsets``: the rounds' from one, the purge's windows' from the next."""
    offset = next(offsets)
    empty_iso, iso = Isolation(), Isolation()
    try:
        migrate = await asyncio.create_subprocess_exec(
            *cli("migrate"), env=service_env(iso), stdout=asyncio.subprocess.DEVNULL
        )
        await migrate.wait()
        # Before the service starts: the oldest rows get the lowest ids, as in a real inbox
        # (purge and retention walk in id order).
        took = await fill(iso, prefill, purged)
        async with running(iso, "up", settings={"RETENTION_ENABLED": "false"}) as service:
            pairs = []
            async with running(empty_iso, "up", settings={"RETENTION_ENABLED": "false"}) as beside:
                for index in range(rounds):
                    empty = await _unique(
                        empty_iso, beside, offset, n, "growth: unique webhook events, empty inbox"
                    )
                    full = await _unique(iso, service, offset + n, n,
                                         f"growth: the same with {prefill:,} rows in the inbox",
                                         note=f"rows put in and vacuumed in {took:.0f} s")  # fmt: skip
                    offset += 2 * n
                    pairs.append((empty, full))
                    print(f"growth, round {index + 1} of {rounds}: empty inbox {empty.rate:,.0f}/s, "
                          f"{prefill:,} rows {full.rate:,.0f}/s ({full.rate / empty.rate:.2f}×)", file=sys.stderr)  # fmt: skip
            empty, full, ratio = median_pair(pairs)
            report.rows += [empty, full]
            measured = await sizes(iso)

            baselines, during = await _purge_rows(
                report, iso, service, next(offsets), n, empty.rate / 2, purged
            )
    finally:
        await empty_iso.cleanup()
        await iso.cleanup()

    rows = int(measured["rows"])  # type: ignore[call-overload]
    heap = int(measured["heap"])  # type: ignore[call-overload]
    indexes: dict[str, int] = measured["indexes"]  # type: ignore[assignment]
    per_index = ", ".join(
        f"{name.split('.')[-1]} {size / rows:.0f}" for name, size in sorted(indexes.items())
    )
    report.notes.append(
        f"Inbox with {rows:,} rows: {heap / rows:.0f} bytes per row in the heap, per index entry: {per_index}; "
        f"rows with their indexes {int(measured['rows_total']) / rows:.0f} bytes per event "  # type: ignore[call-overload]
        f"and bodies {int(measured['bodies']) / rows:.0f} bytes per event (all partitions, TOAST and keys)."  # type: ignore[call-overload]
    )
    report.checks.append(
        (
            f"flat as it grows: unique events with {prefill:,} rows ≥ 0.9 × empty inbox",
            f"{ratio:.2f}× ({full.rate:,.0f} vs {empty.rate:,.0f}/s)",
            ratio >= 0.9,
        )
    )
    calm = [b.percentile(99) for b in baselines]
    calm_p99 = median(calm)
    report.checks.append(
        (
            f"a purge of {purged:,} rows raises webhook p99 by < 2× (vs the median p99 of 2 runs before and 2 after)",
            f"{during.percentile(99) / calm_p99:.2f}× "
            f"({', '.join(f'{p:.0f}' for p in calm)} ms without → {during.percentile(99):.0f} ms during)",
            during.percentile(99) < 2 * calm_p99,
        )
    )
