"""A setting against the default, in interleaved rounds that each carry their own transport ceiling.

    .venv/bin/python -m bench.compare "DATABASE_BATCH_CONCURRENCY=2" [--events 20000] [--rounds 6]
                                      [--layout up|split] [--rate 0]

A lever worth a few per cent cannot be told from a shared machine's drift by two runs minutes
apart. Each round measures the transport ceiling, then the service with the default settings and
with ``SETTINGS`` (comma-separated ``NAME=value`` pairs, as in ``EVOLUTION_INGEST_NAME``), both
channels, in an order that alternates from round to round, each on ids of its own; every line
gives each one's ratio to its round's ceiling, the CPU the service, Postgres and RabbitMQ spent per
dual event and that of every process of the machine together, the webhook p50/p99, and events
lost and processed twice. The summary gives the medians.
With ``--rate``, both run open loop at that rate (the tail at a given load, not the throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from bench.ceilings import transport
from bench.measure import StealMeter
from bench.scenarios import Measured, measure_channels

DEFAULT = "default"


@dataclass
class Side:
    """One setting's run in one round."""

    ratio: float
    measured: Measured

    def cpu(self, pick: str) -> float:
        """ms of CPU per dual event of one group of the CPU table, or of every group (``all``)."""
        used = self.measured.cpu or {}
        return sum(used.values()) if pick == "all" else used.get(pick, 0.0)

    def line(self, name: str) -> str:
        row = self.measured.row
        return (
            f"{name}: {row.rate:,.0f}/s {self.ratio:.2f}×, service {self.cpu('service'):.3f} ms, "
            f"Postgres {self.cpu('Postgres'):.3f} ms, RabbitMQ {self.cpu('RabbitMQ'):.3f} ms, "
            f"all {self.cpu('all'):.3f} ms, webhook p50/p99 {row.webhook_p50 or 0:.0f}/"
            f"{row.webhook_p99 or 0:.0f} ms, lost {row.lost}, doubled {row.doubled}"
        )


def order(names: list[str], index: int) -> list[str]:
    """The order of the settings in round ``index``: as given, then reversed, and so on."""
    return names if index % 2 == 0 else names[::-1]


def summary(results: dict[str, list[Side]]) -> list[str]:
    """Each setting's ratios over the rounds and the medians of its figures."""

    def median(sides: list[Side], pick: str) -> float:
        return statistics.median(s.cpu(pick) for s in sides)

    return [
        f"{name}: ratios {', '.join(f'{s.ratio:.2f}' for s in sides)}; median "
        f"{statistics.median(s.ratio for s in sides):.2f}×, service {median(sides, 'service'):.3f} ms, "
        f"Postgres {median(sides, 'Postgres'):.3f} ms, RabbitMQ {median(sides, 'RabbitMQ'):.3f} ms, "
        f"all {median(sides, 'all'):.3f} ms, webhook p99 "
        f"{statistics.median(s.measured.row.webhook_p99 or 0 for s in sides):.0f} ms; "
        f"lost {sum(s.measured.row.lost or 0 for s in sides)}, doubled "
        f"{sum(s.measured.row.doubled or 0 for s in sides)}"
        for name, sides in results.items()
    ]


async def compare(
    settings: str, n: int, rounds: int, layout: str, rate: float, offsets: Iterator[int]
) -> None:
    tried = dict(pair.split("=", 1) for pair in settings.split(","))
    results: dict[str, list[Side]] = {DEFAULT: [], settings: []}
    for index in range(rounds):
        steal = StealMeter()
        ceiling, stolen = await steal.during(transport(n, next(offsets)))
        parts = [f"round {index + 1} of {rounds}: transport {ceiling:,.0f}/s (the host took {stolen:.1%})"]
        for name in order(list(results), index):
            measured = await measure_channels(
                n,
                next(offsets),
                name=name,
                layout=layout,
                dual=True,
                cpu=True,
                rate=rate,
                settings=None if name == DEFAULT else tried,
            )
            side = Side(measured.rate / ceiling, measured)
            results[name].append(side)
            parts.append(side.line(name))
        print("; ".join(parts), flush=True)
    print("\n".join(summary(results)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", help='NAME=value pairs, comma-separated: "DATABASE_BATCH_CONCURRENCY=2"')
    parser.add_argument("--events", type=int, default=20_000, help="events per scenario")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layout", choices=("up", "split"), default="up")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop at this many events/s (0: closed)")
    args = parser.parse_args()
    for pair in args.settings.split(","):
        if "=" not in pair:
            parser.error(f"{pair!r} is not NAME=value")
    step = 10 * args.events
    offsets = itertools.count(9 * 10**11, step)
    asyncio.run(compare(args.settings, args.events, args.rounds, args.layout, args.rate, offsets))


if __name__ == "__main__":
    main()
