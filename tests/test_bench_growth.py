"""The growth target of the benchmark: the empty and the full inbox in rounds, the median round for all."""

from __future__ import annotations

import pytest
from bench.growth import median_pair
from bench.report import Row

TIMES = "\N{MULTIPLICATION SIGN}"


def _pair(empty: float, full: float, *, lost: int = 0, doubled: int = 0) -> tuple[Row, Row]:
    return (
        Row("empty", 1000, empty, 10.0, 20.0, note=f"WAL at {empty:.0f}"),
        Row("full", 1000, full, 12.0, 25.0, lost=lost, doubled=doubled, note=f"WAL at {full:.0f}"),
    )


def test_the_median_round_is_chosen_by_its_own_ratio_not_by_either_rate() -> None:
    # By rate alone the empty inbox's median is the third round's (3,000/s) and the full one's
    # the second's (2,650/s); by each round's own ratio it is the first: 0.9 against 0.78 and 1.03.
    pairs = [_pair(2900, 2610), _pair(3400, 2650), _pair(3000, 3100)]

    empty, full, ratio = median_pair(pairs)

    assert ratio == pytest.approx(0.9)
    assert (empty.rate, full.rate) == (2900, 2610)
    assert full.note.endswith("; WAL at 2610")  # that round's own figures
    assert empty.note == "round 1 of 3, the median's (every round in the next row); WAL at 2900"


def test_every_rounds_ratio_is_in_the_note_and_losses_of_any_round_count() -> None:
    pairs = [_pair(3000, 3000, lost=1), _pair(3000, 2400, doubled=1), _pair(3000, 2700, doubled=2)]

    empty, full, ratio = median_pair(pairs)

    assert ratio == 0.9
    assert full.events == empty.events == 3000
    assert full.lost == 1  # lost in a round that was not the median
    assert full.doubled == 2  # the trace accumulates: the last round's count holds every round's
    assert full.note.startswith(
        "the median of 3 rounds, the empty inbox then the full one in each: "
        f"1.00{TIMES} (3,000 vs 3,000/s), 0.80{TIMES} (2,400 vs 3,000/s), 0.90{TIMES} (2,700 vs 3,000/s)"
    )


def test_an_even_count_takes_the_lower_median_and_one_round_has_only_its_own_note() -> None:
    _, _, ratio = median_pair([_pair(3000, 3000), _pair(3000, 2400)])
    assert ratio == 0.8

    empty, full, ratio = median_pair([_pair(2000, 1900)])
    assert ratio == 0.95
    assert (empty.note, full.note) == ("WAL at 2000", "WAL at 1900")
