"""Backfill's speed: stored messages read and ingested per second, and seconds per 1,000 records.

    .venv/bin/python -m bench.backfill [--records 5000] [--page-size 100]

A fake of Evolution's REST API (the tests' one, on a loopback port) holds ``--records`` stored
messages that neither channel delivered; ``up`` runs on an isolated schema; ``backfill --since 2h``
(forwarding to it) is timed twice: the first run ingests every message, the second finds each one
already received. Prints both, with the events lost and processed twice counted from the traces.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import orjson
from tests.support import running_server
from tests.support.fake_evolution import FakeEvolution, FakeInstance
from tests.test_connect import API_KEY, a_message

from bench.harness import Isolation, cli, free_port, process, wait_http
from bench.measure import Traced
from bench.service import service_env

TIMEOUT = 600.0


async def _backfill(env: dict[str, str]) -> tuple[float, dict[str, object]]:
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *cli("backfill"), "--since", "2h", "--json", env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    seconds = time.perf_counter() - began
    (report,) = orjson.loads(out)["instances"]
    return seconds, report


async def main(records: int, page_size: int) -> None:
    fake = FakeEvolution(API_KEY, [FakeInstance("bench-backfill")])
    now = int(time.time())
    keys = []
    for n in range(records):
        data = a_message(n)
        data["messageTimestamp"] = now - 3600 + n * 3000 // max(records, 1)
        fake.store("bench-backfill", data)
        keys.append(n)
    iso = Isolation()
    try:
        async with running_server(fake.app) as evolution_url:
            port = free_port()
            url = f"http://127.0.0.1:{port}/api/internal/webhook"
            extra = {"EVOLUTION_URL": evolution_url, "EVOLUTION_API_KEY": API_KEY, "BACKFILL_ENABLED": "false",
                     "BACKFILL_PAGE_SIZE": str(page_size)}  # fmt: skip
            async with process(cli("up"), service_env(iso, PORT=str(port), **extra), "up"):
                await wait_http(f"http://127.0.0.1:{port}/healthz")
                env = service_env(iso, FORWARD_URL=url, **extra)
                first, ingested = await _backfill(env)
                second, again = await _backfill(env)
        traced = Traced.read(iso.trace_dir)
        per_k = (lambda s: s / records * 1000) if records else (lambda s: 0.0)
        print(f"backfill of {records:,} stored messages (page size {page_size}), one instance:")
        print(f"  first run  (all missing):  {first:6.2f} s, {records / first:7,.0f} records/s, "
              f"{per_k(first):.2f} s per 1,000; ingested {ingested['ingested']}, already {ingested['already']}")  # fmt: skip
        print(f"  second run (all received): {second:6.2f} s, {records / second:7,.0f} records/s, "
              f"{per_k(second):.2f} s per 1,000; ingested {again['ingested']}, already {again['already']}")  # fmt: skip
        doubled = sum(1 for runs in traced.runs.values() if len(runs) > 1)
        print(f"  business logic ran for {len(traced.runs):,} messages; lost {records - len(traced.runs)}, "
              f"processed twice {doubled}")  # fmt: skip
    finally:
        await iso.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--page-size", type=int, default=100)
    args = parser.parse_args()
    if not 0 < args.records <= 200_000:
        sys.exit("--records: between 1 and 200,000")
    asyncio.run(main(args.records, args.page_size))
