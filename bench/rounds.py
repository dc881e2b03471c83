"""The both-channels targets, measured in rounds that each carry their own ceiling.

A target is a ratio of two throughputs, and on a shared machine either one drifts by 10 to 20 % over
minutes, so a single pair measured minutes apart says as much about the machine as about the
service. Each round measures the transport ceiling, then ``up``, then separate processes, back to
back; each scenario's ratio is to its own round's ceiling; and the report gives the median round
(every round's ratio in its note, events lost and processed twice added up over all of them).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.ceilings import transport
from bench.measure import StealMeter
from bench.scenarios import Measured, measure_channels

UP = "both channels (up)"
SPLIT = "both channels (serve + worker + reconcile)"


@dataclass
class Round:
    """One round: the transport ceiling, then the service carrying the same load two ways."""

    transport: float
    up: Measured
    split: Measured
    #: Share of the machine's core time the host took during each of the three (steal).
    stolen: tuple[float, float, float] = (0.0, 0.0, 0.0)


async def dual_rounds(n: int, offsets: Iterator[int], rounds: int) -> list[Round]:
    """``rounds`` rounds of ``n`` events each, every scenario on ids of its own."""
    done: list[Round] = []
    for index in range(rounds):
        steal = StealMeter()
        carried, on_transport = await steal.during(transport(n, next(offsets)))
        up, on_up = await steal.during(
            measure_channels(n, next(offsets), name=UP, layout="up", dual=True, cpu=True)
        )
        split, on_split = await steal.during(
            measure_channels(n, next(offsets), name=SPLIT, layout="split", dual=True, cpu=True)
        )
        done.append(Round(carried, up, split, (on_transport, on_up, on_split)))
        print(
            f"both channels, round {index + 1} of {rounds}: transport {carried:,.0f}/s, "
            f"up {up.rate:,.0f}/s ({up.rate / carried:.2f}×), "
            f"separate processes {split.rate:,.0f}/s ({split.rate / carried:.2f}×); "
            f"taken by the host {stolen_shares(done[-1])}",
            file=sys.stderr,
        )
    return done


def stolen_shares(one: Round) -> str:
    """The host's share of the cores during the round's transport, up and separate processes."""
    return " / ".join(f"{100 * share:.1f} %" for share in one.stolen)


def median_transport(rounds: list[Round]) -> float:
    return statistics.median(r.transport for r in rounds)


def median_round(rounds: list[Round], pick: Callable[[Round], Measured]) -> tuple[Measured, float]:
    """The round of the median ratio (the lower one of an even count) standing for all of them,
    and that ratio. Its row counts the events of every round, and what any round lost or ran twice.
    """
    ratios = [pick(r).rate / r.transport for r in rounds]
    order = sorted(range(len(rounds)), key=ratios.__getitem__)
    middle = order[(len(order) - 1) // 2]
    chosen = pick(rounds[middle])
    rows = [pick(r).row for r in rounds]
    each = ", ".join(
        f"{ratio:.2f}× ({pick(r).rate:,.0f} of {r.transport:,.0f}/s)"
        for r, ratio in zip(rounds, ratios, strict=True)
    )
    median = "the lower median" if len(rounds) % 2 == 0 else "the median"
    note = (
        f"{median} of {len(rounds)} rounds, each against the transport ceiling measured just before it: "
        f"{each}; events, lost and doubled over all rounds"
        if len(rounds) > 1
        else ""
    )
    row = dataclasses.replace(
        chosen.row,
        events=sum(r.events for r in rows),
        lost=sum(r.lost or 0 for r in rows),
        doubled=sum(r.doubled or 0 for r in rows),
        note=note,
    )
    notes = [line for r in rounds for line in pick(r).notes]
    return Measured(row, chosen.cpu, notes), ratios[middle]
