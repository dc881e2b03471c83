"""Comparing a setting with the default: the order alternates, and the summary hides nothing."""

from __future__ import annotations

from bench.compare import DEFAULT, Side, order, summary
from bench.report import Row
from bench.scenarios import Measured


def _side(ratio: float, service: float, p99: float, *, lost: int = 0, doubled: int = 0) -> Side:
    row = Row("x", 1000, 1000 * ratio, 10.0, p99, lost=lost, doubled=doubled)
    return Side(ratio, Measured(row, {"service": service, "Postgres": service / 2, "RabbitMQ": service / 4}))


def test_the_order_of_the_settings_alternates_from_round_to_round() -> None:
    names = [DEFAULT, "DATABASE_BATCH_CONCURRENCY=2"]
    assert [order(names, i) for i in range(3)] == [names, names[::-1], names]


def test_the_summary_gives_every_ratio_the_medians_and_every_loss() -> None:
    lines = summary(
        {
            DEFAULT: [_side(0.70, 0.5, 40), _side(0.74, 0.6, 60), _side(0.80, 0.7, 50)],
            "X=2": [_side(0.90, 0.4, 30), _side(0.60, 0.5, 90, lost=2), _side(0.75, 0.6, 20, doubled=1)],
        }
    )
    times = "\N{MULTIPLICATION SIGN}"
    assert lines == [
        f"default: ratios 0.70, 0.74, 0.80; median 0.74{times}, service 0.600 ms, Postgres 0.300 ms, "
        "RabbitMQ 0.150 ms, all 1.050 ms, webhook p99 50 ms; lost 0, doubled 0",
        f"X=2: ratios 0.90, 0.60, 0.75; median 0.75{times}, service 0.500 ms, Postgres 0.250 ms, "
        "RabbitMQ 0.125 ms, all 0.875 ms, webhook p99 30 ms; lost 2, doubled 1",
    ]
