"""What a deployment needs: the CPU one event costs at the rate it comes, and the cores a rate takes.

    .venv/bin/python -m bench.sizing [--rates 100,300,1000,0] [--seconds 20] [--min-events 2000]
                                     [--full-events 20000] [--idle-seconds 10] [--log-level INFO]
                                     [--write FILE]

The service batches whatever arrives while a statement is out, so an event costs least when the
service is busiest: at a few hundred events/s most batches hold one event, and every event pays a
round trip to Redis and two to Postgres of its own. The benchmark's scenarios run as fast as they
go; a deployment mostly runs well below that. For each rate (events/s of each channel; ``0``: as
fast as it goes, 64 requests in flight) this sends unique events open loop to one ``up`` process,
by webhook alone, then on both channels (the same events through RabbitMQ too, as Evolution sends
them), and prints, per event, the CPU of the service and of each store, the webhook p50/p99, and
the cores the service and its stores take at the rate carried. The load generator and the
publisher are left out of the cores: in a deployment they are Evolution. Every step is bounded in
count (``--seconds`` of load at its rate, at least ``--min-events``; ``--full-events`` at full
speed) and in time. The service runs at its default log level, INFO, and writes an ``outcome``
line per webhook call and per delivery, which this reads as a log collector would
(``--log-level WARNING``: none, as in the benchmark's scenarios).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import Isolation, post_all, table
from bench.measure import Traced, machine_meter
from bench.report import invocation, logs_line, machine, ms
from bench.scenarios import measure_channels
from bench.service import running, wait_traced, workload

#: What the service needs beside itself; the load generator and the publisher stand for Evolution.
DEPLOYED = ("service", "Postgres", "Redis", "RabbitMQ")
#: The longest a step may take, whatever its rate.
_STEP_SECONDS = 300.0


@dataclass
class Step:
    """One rate on one channel mode: what was carried, and the CPU per event of each group."""

    mode: str
    asked: float
    carried: float
    p50: float | None
    p99: float | None
    cpu: Mapping[str, float]
    lost: int
    doubled: int

    @property
    def deployed_ms(self) -> float:
        """ms of CPU per event of the service and its stores."""
        return sum(self.cpu.get(name, 0.0) for name in DEPLOYED)

    @property
    def cores(self) -> float:
        """Cores the service and its stores keep busy at the rate carried."""
        return self.deployed_ms * self.carried / 1000

    def cells(self) -> list[object]:
        return [
            self.mode,
            "as fast as it goes" if not self.asked else f"{self.asked:,.0f}",
            f"{self.carried:,.0f}",
            ms(self.p50),
            ms(self.p99),
            *(f"{self.cpu.get(name, 0.0):.3f}" for name in DEPLOYED),
            f"{self.deployed_ms:.3f}",
            f"{self.cores:.2f}",
            self.lost,
            self.doubled,
        ]


HEADERS = [
    "channels", "rate asked (/s)", "carried (/s)", "webhook p50 ms", "webhook p99 ms",
    *(f"{name} ms/event" for name in DEPLOYED), "service + stores ms/event", "cores", "lost", "doubled",
]  # fmt: skip


def events_for(rate: float, seconds: float, min_events: int, full_events: int) -> int:
    """Events of one step: ``seconds`` of load at ``rate`` (at least ``min_events``), or
    ``full_events`` as fast as it goes (``rate`` 0)."""
    return full_events if rate <= 0 else max(min_events, round(rate * seconds))


async def webhook_steps(
    rates: Sequence[float], sizes: Sequence[int], offsets: Iterator[int], idle_seconds: float
) -> tuple[dict[str, float], list[Step]]:
    """First ``idle_seconds`` with nothing sent (each group's share of a core), then each rate in
    turn on the same ``up`` process, unique events by webhook alone."""
    steps = []
    iso = Isolation()
    try:
        async with running(iso, "up") as service:
            meter = machine_meter(lambda: service.pids)  # started again for each step
            meter.start()
            await asyncio.sleep(idle_seconds)
            idle = {
                name: seconds / idle_seconds for name, seconds in meter.stop().items() if name in DEPLOYED
            }
            done = 0
            for rate, n in zip(rates, sizes, strict=True):
                bodies, keys = workload(next(offsets), n)
                meter.start()
                result = await post_all(service.urls, bodies, 64, _STEP_SECONDS, rate=rate)
                done += n
                await wait_traced(iso, done, 60)
                cpu = meter.stop_per(n)
                traced = Traced.read(iso.trace_dir)
                steps.append(
                    Step("webhook only", rate, result.rate, result.percentile(50), result.percentile(99), cpu,
                         traced.lost(keys), traced.doubled())
                )  # fmt: skip
                print(_progress(steps[-1]), flush=True)
    finally:
        await iso.cleanup()
    return idle, steps


async def dual_steps(rates: Sequence[float], sizes: Sequence[int], offsets: Iterator[int]) -> list[Step]:
    """Each rate on a fresh ``up`` process, both channels (the publisher's own CPU left out)."""
    steps = []
    for rate, n in zip(rates, sizes, strict=True):
        measured = await measure_channels(
            n, next(offsets), name="both channels", layout="up", dual=True, cpu=True, rate=rate
        )
        row = measured.row
        steps.append(
            Step("both channels", rate, row.rate, row.webhook_p50, row.webhook_p99, measured.cpu or {},
                 row.lost or 0, row.doubled or 0)
        )  # fmt: skip
        print(_progress(steps[-1]), flush=True)
    return steps


def _progress(step: Step) -> str:
    return (
        f"{step.mode}, {step.asked:,.0f}/s asked: {step.carried:,.0f}/s carried, "
        f"service + stores {step.deployed_ms:.3f} ms/event, {step.cores:.2f} cores"
    )


def render(idle: Mapping[str, float], idle_seconds: float, steps: Sequence[Step], command: str) -> str:
    shares = ", ".join(f"{name} {idle.get(name, 0.0):.1%}" for name in DEPLOYED)
    return "\n".join(
        [
            f"Machine: {machine()}",
            f"Command: `{command}`",
            logs_line(),
            "",
            table([step.cells() for step in steps], HEADERS),
            "",
            f"Nothing sent, for {idle_seconds:,.0f} s (one `up` process): {shares} of a core.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates",
        default="100,300,1000,0",
        help="events/s of each channel, comma-separated (0: as fast as it goes)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of load at each rate")
    parser.add_argument("--min-events", type=int, default=2_000, help="events of a step at least")
    parser.add_argument(
        "--full-events", type=int, default=20_000, help="events of the step as fast as it goes"
    )
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="seconds with nothing sent, first")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default="INFO",
        help="the service's log level: INFO, its default, writes one outcome line per webhook call "
        "and per delivery (the benchmark's scenarios run at WARNING)",
    )
    parser.add_argument("--write", type=Path, help="also write the table to this Markdown file")
    args = parser.parse_args()
    os.environ["BENCH_LOG_LEVEL"] = args.log_level
    try:
        rates = [float(rate) for rate in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates: {args.rates!r} is not a comma-separated list of numbers")
    if (
        any(rate < 0 for rate in rates)
        or min(args.seconds, args.idle_seconds) <= 0
        or min(args.min_events, args.full_events) < 1
    ):
        parser.error(
            "--rates must be 0 or more, --seconds and --idle-seconds above 0, --min-events and --full-events 1 or more"
        )
    sizes = [events_for(rate, args.seconds, args.min_events, args.full_events) for rate in rates]
    offsets = itertools.count(8 * 10**11, 10 * max(sizes))

    async def both() -> tuple[dict[str, float], list[Step]]:
        idle, steps = await webhook_steps(rates, sizes, offsets, args.idle_seconds)
        return idle, steps + await dual_steps(rates, sizes, offsets)

    idle, steps = asyncio.run(both())
    text = render(idle, args.idle_seconds, steps, invocation("bench.sizing"))
    print(text)
    if args.write:
        args.write.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
