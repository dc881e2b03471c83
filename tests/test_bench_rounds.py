"""The both-channels targets of the benchmark: the median round stands for all, and hides nothing."""

from __future__ import annotations

from bench.report import Row
from bench.rounds import Round, budget, median_index, median_round, median_transport, stolen_shares
from bench.scenarios import Measured


def _round(transport: float, up: float, split: float, *, lost: int = 0, doubled: int = 0) -> Round:
    def measured(name: str, rate: float) -> Measured:
        return Measured(
            Row(name, 1000, rate, 10.0, 20.0, rss=f"{rate:.0f} MiB", lost=lost, doubled=doubled),
            cpu={"service": rate / 1000},
            notes=[f"{name} at {rate:.0f}"],
        )

    return Round(transport, measured("up", up), measured("split", split))


def test_the_median_round_is_chosen_by_its_ratio_to_its_own_ceiling() -> None:
    # By rate alone the middle round would be the second (900); by ratio to each round's own
    # ceiling it is the third: 0.8 against 0.75 and 0.9.
    rounds = [_round(1000, 750, 700), _round(1000, 900, 600), _round(1200, 960, 500)]

    up, ratio = median_round(rounds, lambda r: r.up)

    assert ratio == 0.8
    assert up.rate == 960
    assert up.cpu == {"service": 0.96}  # the CPU of that same round
    assert up.row.rss == "960 MiB"
    assert median_transport(rounds) == 1000


def test_every_rounds_ratio_is_in_the_note_and_losses_of_any_round_count() -> None:
    rounds = [_round(1000, 800, 700), _round(1000, 820, 710, lost=2), _round(1000, 810, 720, doubled=1)]

    split, ratio = median_round(rounds, lambda r: r.split)

    assert ratio == 0.71
    assert split.row.events == 3000
    assert (split.row.lost, split.row.doubled) == (2, 1)  # from rounds that were not the median
    times = "\N{MULTIPLICATION SIGN}"
    assert (
        f"0.70{times} (700 of 1,000/s), 0.71{times} (710 of 1,000/s), 0.72{times} (720 of 1,000/s)"
        in split.row.note
    )
    assert split.notes == ["split at 700", "split at 710", "split at 720"]


def test_an_even_count_takes_the_lower_median_and_one_round_has_no_note() -> None:
    two = [_round(1000, 900, 600), _round(1000, 700, 600)]
    lower, ratio = median_round(two, lambda r: r.up)
    assert ratio == 0.7
    assert lower.row.note.startswith("the lower median of 2 rounds")

    one, ratio = median_round([_round(1000, 850, 600)], lambda r: r.up)
    assert ratio == 0.85
    assert one.row.note == ""


def test_each_rounds_steal_is_given_per_scenario() -> None:
    one = Round(1000, _round(1000, 800, 700).up, _round(1000, 800, 700).split, (0.012, 0.05, 0.1049))
    assert stolen_shares(one) == "1.2 % / 5.0 % / 10.5 %"
    assert stolen_shares(_round(1000, 800, 700)) == "0.0 % / 0.0 % / 0.0 %"  # none measured


def test_the_budget_is_what_the_target_leaves_the_service_and_its_stores() -> None:
    one = _round(2000, 900, 800)
    one.up.cpu = {
        "service": 0.5,
        "load generator": 0.3,
        "publisher": 0.1,
        "RabbitMQ": 0.3,
        "Postgres": 0.2,
        "Redis": 0.05,
    }
    one.transport_cpu = {
        "service": 0.1,
        "load generator": 0.28,
        "publisher": 0.07,
        "RabbitMQ": 0.3,
        "Postgres": 0.0,
        "Redis": 0.0,
    }

    # 0.8 x 2,000/s = 1,600/s; 2 cores give 2,000 ms a second: 1.25 ms per event. The load
    # generator, the publisher and RabbitMQ took 0.70 of it, which leaves 0.55; the service and the
    # stores spent 0.75. The ceiling cost 0.75 ms per event at 2,000/s: 1,500 of 2,000 ms a second;
    # `up` 1.45 ms at 900/s: 1,305 of 2,000.
    times = "\N{MULTIPLICATION SIGN}"
    assert budget(one, 2) == (
        f"At 0.8{times} the transport ceiling of the round of `up`'s median (1,600 of 2,000/s), 2 cores have "
        "1.25 ms of CPU per dual event, all of them busy. In `up` the load generator, the publisher and "
        "RabbitMQ spent 0.70 ms of it, which leaves 0.55 ms for the service, Postgres and Redis: they spent "
        "0.75 ms. The ceiling itself cost the machine 0.75 ms per event and kept the cores 75 % busy; `up` "
        "kept them 65 % busy. Sending the load cost per event under `up` and under the ceiling: the load "
        "generator 0.30 against 0.28 ms, the publisher 0.10 against 0.07 ms."
    )


def test_the_round_that_stands_for_a_scenario_is_the_one_of_its_median_ratio() -> None:
    rounds = [_round(1000, 750, 700), _round(1000, 900, 600), _round(1200, 960, 500)]
    assert median_index(rounds, lambda r: r.up) == 2  # ratios 0.75, 0.9, 0.8
    assert median_index(rounds, lambda r: r.split) == 1  # ratios 0.7, 0.6, 0.42
    assert median_index(rounds[:2], lambda r: r.up) == 0  # the lower of two
