"""Webhook throughput: unique events, then the same events again (duplicates), against the ceiling.

    .venv/bin/python -m bench.webhook [--events 20000] [--concurrency 64]

Starts `evolution-ingest serve` (no-op handler) and a bare parse-only endpoint on the same
HTTP stack, drives both with the same aiohttp load generator, prints one table, and removes
its schema and Redis keys. Bounded: --events requests per phase, --max-seconds per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from bench.events import unique_event
from bench.harness import Isolation, cli, free_port, peak_rss_mb, post_all, process, table, wait_http


async def main(events: int, concurrency: int, max_seconds: float) -> None:
    bodies = [orjson.dumps(unique_event(n)[0]) for n in range(events)]
    iso = Isolation()
    rows = []
    try:
        bare_port = free_port()
        async with process(
            [sys.executable, "-m", "bench.bare", str(bare_port)], iso.env(), "bare endpoint"
        ) as bare:
            await wait_http(f"http://127.0.0.1:{bare_port}/healthz")
            ceiling = await post_all(f"http://127.0.0.1:{bare_port}/bare", bodies, concurrency, max_seconds)
            rows.append(
                [
                    "bare endpoint (parse JSON only)",
                    ceiling.count,
                    ceiling.rate,
                    ceiling.percentile(50),
                    ceiling.percentile(99),
                    1.0,
                    peak_rss_mb(bare.pid),
                    ceiling.statuses,
                ]
            )

        port = free_port()
        env = iso.env(PORT=str(port))
        async with process(cli("serve", "--migrate"), env, "webhook app") as app:
            await wait_http(f"http://127.0.0.1:{port}/healthz")
            url = f"http://127.0.0.1:{port}/api/internal/webhook"
            warm = [orjson.dumps(unique_event(events + n, "warm-up")[0]) for n in range(500)]
            await post_all(url, warm, concurrency, max_seconds)
            for label, batch in (
                ("webhook, unique events", bodies),
                ("webhook, every event again (duplicates)", bodies),
            ):
                result = await post_all(url, batch, concurrency, max_seconds)
                rows.append(
                    [
                        label,
                        result.count,
                        result.rate,
                        result.percentile(50),
                        result.percentile(99),
                        result.rate / ceiling.rate,
                        peak_rss_mb(app.pid),
                        result.statuses,
                    ]
                )
    finally:
        await iso.cleanup()
    print(
        table(
            rows, ["scenario", "requests", "req/s", "p50 ms", "p99 ms", "× bare", "peak RSS MiB", "statuses"]
        )
    )
    unique, dup = rows[1][2], rows[2][2]
    print(
        f"\nduplicates vs unique: {dup / unique:.2f}×   (concurrency {concurrency}, {events} events per phase)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=120)
    args = parser.parse_args()
    asyncio.run(main(args.events, args.concurrency, args.max_seconds))
