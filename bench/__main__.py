"""The benchmark: every scenario against the ceilings of this machine, in one bounded run.

    .venv/bin/python -m bench [--events 20000] [--backlog 100000] [--soak 500000]
                               [--prefill 5000000] [--purge 1000000] [--rounds 3] [--quick]
                               [--write docs/benchmarks.md]

Starts what it needs (service processes on its own schema, Redis prefix and queues,
a bare endpoint), drives them with an aiohttp load generator and a separate RabbitMQ
publisher, and prints one report: events/s, webhook and end-to-end latency, memory,
events lost and processed twice, each scenario as a ratio to the raw Postgres ceiling,
the targets as ratios to the transport ceiling (and, for reference, to a lean receiver on the
service's own stack) and to the bare endpoint, what the machine went through during the
latency runs, and where the CPU went. Every load is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bench.ceilings import bare_http, raw_postgres, transport
from bench.growth import growth
from bench.latency import half_load
from bench.report import Report, render
from bench.rounds import UP, budget, dual_rounds, median_index, median_round, median_transport, stolen_shares
from bench.scenarios import backlog, channel_scenario, soak, webhook_scenarios
from bench.service import workload

PG = "raw Postgres: INSERT … ON CONFLICT + UPDATE per event, 64 in flight"
BARE = "bare HTTP endpoint parsing the JSON (same server stack, same load generator)"
TRANSPORT = "transport: both channels into a bare receiver (parse, answer 200 / ack; same load generator and publisher)"
CEILING_CPU = (
    "for reference: the transport ceiling (its bare receiver under service), the round of up's median"
)
LEAN = (
    "transport, lean receiver: the same on the service's own stack (raw ASGI on uvicorn; pika, batched acks)"
)


async def main(args: argparse.Namespace) -> Report:
    report = Report()
    n = args.events
    # Every scenario gets ids of its own: the next offset, in the order they run.
    offsets = iter(range(10 * max(n, args.backlog, args.soak), 10**12, 10 * max(n, args.backlog, args.soak)))
    bodies, _ = workload(0, n)
    pg = await raw_postgres(bodies)
    bare_cpu: dict[str, float] = {}
    bare = await bare_http(bodies, cpu=bare_cpu)
    lean = await transport(n, next(offsets), lean=True)
    print(
        f"ceilings: raw Postgres {pg:,.0f} events/s, bare HTTP {bare.rate:,.0f} req/s, "
        f"lean receiver's transport {lean:,.0f} events/s",
        file=sys.stderr,
    )

    unique_rate = await webhook_scenarios(report, n, next(offsets))
    await half_load(report, n, next(offsets), unique_rate)
    await channel_scenario(
        report, n, next(offsets), name="RabbitMQ only, through the forward (up)", layout="up", dual=False
    )
    rounds = await dual_rounds(n, offsets, args.rounds)
    carried = median_transport(rounds)
    report.ceilings = {
        PG: pg,
        BARE: bare.rate,
        TRANSPORT: carried,
        LEAN: lean,
    }
    up, up_ratio = median_round(rounds, lambda r: r.up)
    split, split_ratio = median_round(rounds, lambda r: r.split)
    dual = up.record(report)
    await channel_scenario(
        report,
        n,
        next(offsets),
        name=f"both channels at half load ({dual / 2:,.0f}/s, up)",
        layout="up",
        dual=True,
        rate=dual / 2,
    )
    split.record(report)
    # What the ceiling cost, beside what the service cost, in the round that stands for `up`.
    standing = rounds[median_index(rounds, lambda r: r.up)]
    report.cpu[CEILING_CPU] = standing.transport_cpu
    scaled = await channel_scenario(
        report,
        n,
        next(offsets),
        name="both channels, ×2 replicas of each",
        layout="split",
        dual=True,
        replicas=2,
        cpu=True,
    )
    if len(rounds) > 1:
        report.notes.append(
            f"Transport ceiling in the {len(rounds)} rounds of the both-channels scenarios: "
            + ", ".join(f"{r.transport:,.0f}/s" for r in rounds)
            + f" (the table gives their median, {carried:,.0f}/s); each round's scenarios are measured "
            "against the ceiling of their own round, and the median round is reported. "
            "Share of the cores' time the host took (steal) during each round's transport / up / "
            "separate processes: " + ", ".join(stolen_shares(r) for r in rounds) + "."
        )
    report.checks[:0] = [
        ("both channels (up) ≥ 0.8 × transport ceiling", f"{up_ratio:.2f}×", up_ratio >= 0.8),
        ("both channels (separate processes) ≥ 0.8 × transport ceiling", f"{split_ratio:.2f}×",
         split_ratio >= 0.8),
        ("webhook only, unique ≥ 0.5 × bare HTTP", f"{unique_rate / bare.rate:.2f}×", unique_rate >= 0.5 * bare.rate),
        _service_cpu(report, UP),
        ("both channels (up), for reference: × raw Postgres ceiling", f"{dual / pg:.2f}×", None),
        ("both channels, for reference: × the lean receiver's transport (up / separate processes)",
         f"{dual / lean:.2f}× / {split.rate / lean:.2f}×", None),
    ]  # fmt: skip
    report.notes.append(budget(standing, os.cpu_count() or 1))
    report.notes.append(
        f"A second replica of each component: {scaled:,.0f} events/s with both channels "
        f"(the `up` process alone: {dual:,.0f})."
    )
    report.notes.append(
        "End-to-end latency (sent → business logic ran) of the scenarios at full speed includes the "
        "time events wait in RabbitMQ: the publisher sends faster than the service consumes. The "
        "half-load rows show the latency of a service that keeps up."
    )
    report.checks.append(
        (
            "load generator is not the limit",
            f"bare endpoint {bare.rate:,.0f} req/s vs webhook {unique_rate:,.0f}",
            bare.rate > 2 * unique_rate,
        )
    )
    # The other side of the webhook target, in the CPU table under the unique webhook events.
    report.cpu["for reference: the bare HTTP endpoint (its server under service)"] = bare_cpu
    await backlog(report, args.backlog, next(offsets))
    await growth(report, n, offsets, args.prefill, args.purge, args.rounds)
    await soak(report, args.soak, next(offsets))
    return report


def _service_cpu(report: Report, scenario: str) -> tuple[str, str, bool | None]:
    """The target on the service's own CPU per dual-channel event, read off the CPU table."""
    used = report.cpu.get(scenario, {}).get("service")
    target = f"CPU the service spends per dual-channel event ({scenario}) ≤ 0.45 ms"
    if used is None:
        return target, "not measured", False
    return target, f"{used:.2f} ms", used <= 0.45


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000, help="events per scenario")
    parser.add_argument("--backlog", type=int, default=100_000, help="events waiting in RabbitMQ at start")
    parser.add_argument("--soak", type=int, default=500_000, help="events for the memory soak")
    parser.add_argument(
        "--prefill", type=int, default=5_000_000, help="rows put in the inbox for the growth rows"
    )
    parser.add_argument(
        "--purge", type=int, default=1_000_000, help="of those, rows purged alongside the load"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (a few minutes): 5,000 / 20,000 / 50,000; 500,000 rows, 100,000 purged",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of (transport ceiling, up, separate processes) for the both-channels targets, "
        "and of (empty inbox, full inbox) for the growth target",
    )
    parser.add_argument("--write", type=Path, help="also write the report to this Markdown file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.quick:
        args.events, args.backlog, args.soak = 5_000, 20_000, 50_000
        args.prefill, args.purge = 500_000, 100_000
    result = asyncio.run(main(args))
    text = render(result, args)
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
