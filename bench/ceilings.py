"""The ceilings of this machine, measured in the same run as the scenarios."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence

import aiohttp
import asyncpg
import orjson

from bench.harness import (
    DATABASE_URL,
    RABBITMQ_URL,
    Isolation,
    LoadResult,
    free_port,
    post_all,
    process,
    wait_http,
)
from bench.measure import dual_cpu, machine_meter
from bench.service import EVENTS, publisher, workload
from evolution_ingest.core.identity import parse_envelope

# --- ceilings -------------------------------------------------------------------------------


async def raw_postgres(bodies: Sequence[bytes], concurrency: int = 64) -> float:
    """INSERT ... ON CONFLICT then UPDATE per event, 64 in flight, pool of 16: the naive cost."""
    schema = f"bench_raw_{os.getpid()}"
    # Planned per execution, as the service's statements are: a plan cached on the empty table
    # would scan it, and the ceiling would fall as the table grows.
    pool = await asyncpg.create_pool(
        DATABASE_URL, min_size=16, max_size=16, server_settings={"plan_cache_mode": "force_custom_plan"}
    )
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


async def bare_http(
    bodies: Sequence[bytes], rate: float = 0.0, concurrency: int = 64, cpu: dict[str, float] | None = None
) -> LoadResult:
    """The bare endpoint under the load generator: as fast as it answers, or open loop at ``rate``.

    ``cpu``: filled with the ms of CPU per request of each group of the CPU table (the endpoint's
    server under "service")."""
    port = free_port()
    command = [sys.executable, "-m", "bench.bare", str(port)]
    async with process(command, dict(os.environ), "bare endpoint") as server:
        await wait_http(f"http://127.0.0.1:{port}/healthz")
        meter = machine_meter(lambda: [server.pid])
        meter.start()
        result = await post_all(f"http://127.0.0.1:{port}/bare", bodies, concurrency, 120, rate=rate)
        if cpu is not None and result.count:
            cpu.update(meter.stop_per(result.count))
        return result


#: How long the copies may stop coming, once everything is sent, before a receiver counts as stalled.
_STALLED_SECONDS = 30.0
#: The longest wait for the copies, however slowly they still come.
_WAIT_SECONDS = 300.0


async def transport(n: int, offset: int, *, lean: bool = False, cpu: dict[str, float] | None = None) -> float:
    """Both channels' copies of ``n`` events, as the dual scenarios send them (same load generator,
    same publisher), into a receiver that only parses and answers / acks: events/s.

    ``lean``: the receiver on the service's own stack (``bench/bare.py --lean``). ``cpu``: filled
    with the ms of CPU per event of each group of the CPU table (the receiver under "service").

    A receiver that stops getting copies before it has them all measured nothing: it is said in
    the run's log, and measured once more."""
    name = "transport (lean)" if lean else "transport"
    for attempt in (1, 2):
        carried, consumed = await _transport_once(n, offset, lean=lean, cpu=cpu)
        if consumed >= n:
            return carried
        again = "; measuring it again" if attempt == 1 else "; its figure is no ceiling"
        print(f"{name}: the receiver got {consumed:,} of {n:,} RabbitMQ copies, then none{again}", flush=True)
    return carried


async def _transport_once(
    n: int, offset: int, *, lean: bool, cpu: dict[str, float] | None
) -> tuple[float, int]:
    """One measure of :func:`transport`: events/s, and the RabbitMQ copies the receiver got."""
    bodies, _ = workload(offset, n)
    iso = Isolation()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "bench.bare", str(port), "--amqp", RABBITMQ_URL,
               "--prefix", f"bench{iso.run_id}", "--events", ",".join(EVENTS), *(["--lean"] if lean else [])]  # fmt: skip
    try:
        # The publisher's queues are declared once it is ready; the receiver then consumes them.
        async with (
            publisher(iso, offset, n) as go,
            process(command, dict(os.environ), "bare receiver") as receiver,
        ):
            await wait_http(f"{base}/healthz")
            started = time.perf_counter()
            with dual_cpu(lambda: [receiver.pid], go) as used:
                await asyncio.gather(post_all(f"{base}/bare", bodies, 64, 300), go())
                consumed = await _copies_received(base, n)
                carried = n / (time.perf_counter() - started)
            if cpu is not None:
                cpu.update({name: seconds / n * 1000 for name, seconds in used.items()})
            return carried, consumed
    finally:
        await iso.cleanup()


async def _copies_received(base: str, n: int) -> int:
    """Wait until the receiver at ``base`` has ``n`` copies, gets none for a while, or the wait's
    bound has passed: how many it has."""
    last, moved = -1, time.monotonic()
    deadline = moved + _WAIT_SECONDS
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"{base}/consumed") as resp:
                consumed = int((await resp.json())["consumed"])
            now = time.monotonic()
            if consumed >= n or now > deadline:
                return consumed
            if consumed != last:
                last, moved = consumed, now
            elif now - moved > _STALLED_SECONDS:
                return consumed
            await asyncio.sleep(0.02)
