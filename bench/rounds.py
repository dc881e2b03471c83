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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

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
    #: ms of CPU per event of each group of the CPU table under the ceiling (the receiver as "service").
    transport_cpu: dict[str, float] = field(default_factory=dict)


async def dual_rounds(n: int, offsets: Iterator[int], rounds: int) -> list[Round]:
    """``rounds`` rounds of ``n`` events each, every scenario on ids of its own."""
    done: list[Round] = []
    for index in range(rounds):
        steal = StealMeter()
        ceiling_cpu: dict[str, float] = {}
        carried, on_transport = await steal.during(transport(n, next(offsets), cpu=ceiling_cpu))
        up, on_up = await steal.during(
            measure_channels(n, next(offsets), name=UP, layout="up", dual=True, cpu=True)
        )
        split, on_split = await steal.during(
            measure_channels(n, next(offsets), name=SPLIT, layout="split", dual=True, cpu=True)
        )
        done.append(Round(carried, up, split, (on_transport, on_up, on_split), ceiling_cpu))
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


def lower_median(ratios: Sequence[float]) -> int:
    """Where the median of ``ratios`` is (the lower one of an even count)."""
    order = sorted(range(len(ratios)), key=ratios.__getitem__)
    return order[(len(order) - 1) // 2]


def rounds_note(ratios: Sequence[float], each: Sequence[str], what: str) -> str:
    """The note of a target measured in rounds: which median, then ``what`` was measured in each
    round, then every round's ratio with its figures."""
    median = "the lower median" if len(ratios) % 2 == 0 else "the median"
    listed = ", ".join(f"{ratio:.2f}× ({figures})" for ratio, figures in zip(ratios, each, strict=True))
    return f"{median} of {len(ratios)} rounds, {what}: {listed}"


def median_index(rounds: list[Round], pick: Callable[[Round], Measured]) -> int:
    """Which round has the median ratio of ``pick`` to its own ceiling (the lower one of an even count)."""
    return lower_median([pick(r).rate / r.transport for r in rounds])


def median_round(rounds: list[Round], pick: Callable[[Round], Measured]) -> tuple[Measured, float]:
    """The round of the median ratio (the lower one of an even count) standing for all of them,
    and that ratio. Its row counts the events of every round, and what any round lost or ran twice.
    """
    ratios = [pick(r).rate / r.transport for r in rounds]
    middle = median_index(rounds, pick)
    chosen = pick(rounds[middle])
    rows = [pick(r).row for r in rounds]
    each = [f"{pick(r).rate:,.0f} of {r.transport:,.0f}/s" for r in rounds]
    what = "each against the transport ceiling measured just before it"
    note = (
        f"{rounds_note(ratios, each, what)}; events, lost and doubled over all rounds"
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


def budget(one: Round, cores: int, target: float = 0.8) -> str:
    """What ``target`` times the round's transport ceiling leaves the service and its stores of the CPU
    of ``cores`` cores, if they did nothing else and the host took none, against what `up` spent in
    that round (ms per dual event); how busy the ceiling and `up` kept the cores; and what sending
    the load cost under each."""
    rate = target * one.transport
    have = cores * 1000 / rate
    spent = one.up.cpu or {}  # none when the round traced nothing: the note still comes out
    carrying = sum(spent.get(group, 0.0) for group in ("load generator", "publisher", "RabbitMQ"))
    storing = sum(spent.get(group, 0.0) for group in ("service", "Postgres", "Redis"))
    under_ceiling = sum(one.transport_cpu.values())

    def busy(per_event: float, carried: float) -> str:
        return f"{per_event * carried / (cores * 10):.0f} %"

    def sending(group: str) -> str:
        return f"the {group} {spent.get(group, 0.0):.2f} against {one.transport_cpu.get(group, 0.0):.2f} ms"

    return (
        f"At {target}× the transport ceiling of the round of `up`'s median ({rate:,.0f} of "
        f"{one.transport:,.0f}/s), {cores} cores have {have:.2f} ms of CPU per dual event, all of "
        f"them busy. In `up` the load generator, the publisher and RabbitMQ spent {carrying:.2f} ms "
        f"of it, which leaves {have - carrying:.2f} ms for the service, Postgres and Redis: they "
        f"spent {storing:.2f} ms. The ceiling itself cost the machine {under_ceiling:.2f} ms per "
        f"event and kept the cores {busy(under_ceiling, one.transport)} busy; `up` kept them "
        f"{busy(sum(spent.values()), one.up.rate)} busy. Sending the load cost per event under `up` "
        f"and under the ceiling: {sending('load generator')}, {sending('publisher')}."
    )
