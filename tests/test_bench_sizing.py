"""The sizing table: what one event costs at a rate, and the cores that rate takes."""

from __future__ import annotations

import pytest
from bench.report import logs_line
from bench.sizing import Step, events_for, render

#: ms of CPU per event; the load generator and the publisher stand for Evolution.
CPU = {
    "service": 0.3,
    "Postgres": 0.2,
    "Redis": 0.05,
    "RabbitMQ": 0.15,
    "load generator": 1.0,
    "publisher": 1.0,
}


def test_a_step_lasts_its_seconds_at_its_rate_but_never_fewer_events_than_the_least() -> None:
    assert events_for(300, 20, 2_000, 20_000) == 6_000
    assert events_for(50, 20, 2_000, 20_000) == 2_000
    assert events_for(0, 20, 2_000, 20_000) == 20_000  # as fast as it goes


def test_the_cores_are_the_service_and_its_stores_at_the_rate_carried_not_what_sends_the_load() -> None:
    step = Step("both channels", 1000, 950, 3.0, 9.0, CPU, 0, 0)

    assert step.deployed_ms == pytest.approx(0.7)
    assert step.cores == pytest.approx(0.7 * 950 / 1000)


def test_the_table_has_a_line_per_step_and_the_idle_shares_below_it() -> None:
    steps = [
        Step("webhook only", 100, 100, 2.5, 4.1, CPU, 0, 0),
        Step("both channels", 0, 2_095, 29.3, 141.6, {"service": 0.27}, 1, 2),
    ]

    text = render({"service": 0.004, "Postgres": 0.0, "Redis": 0.001, "RabbitMQ": 0.002}, 10, steps, "cmd")

    lines = text.splitlines()

    def cells(mode: str) -> list[str]:
        line = next(line for line in lines if line.startswith(f"| {mode}"))
        return [cell.strip() for cell in line.strip("|").split("|")]

    assert cells("webhook only") == [
        "webhook only", "100", "100", "2.5", "4.1", "0.300", "0.200", "0.050", "0.150", "0.700", "0.07", "0", "0",
    ]  # fmt: skip
    assert cells("both channels") == [
        "both channels", "as fast as it goes", "2,095", "29.3", "141.6", "0.270", "0.000", "0.000", "0.000", "0.270",
        "0.57", "1", "2",
    ]  # fmt: skip
    assert (
        "Nothing sent, for 10 s (one `up` process): service 0.4%, Postgres 0.0%, Redis 0.1%, RabbitMQ 0.2% of a core."
        in lines
    )
    assert "Command: `cmd`" in lines


def test_the_header_says_whether_the_service_wrote_its_outcome_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BENCH_SETTINGS", raising=False)
    monkeypatch.setenv("BENCH_LOG_LEVEL", "info")
    assert logs_line() == (
        "Service log level: INFO (one `outcome` line per webhook call and per delivery, as by default)"
    )
    monkeypatch.setenv("BENCH_SETTINGS", "LOG_OUTCOMES=false")
    assert logs_line().startswith("Service log level: INFO (no `outcome` lines;")
    monkeypatch.setenv("BENCH_SETTINGS", "DATABASE_BATCH_CONCURRENCY=2, LOG_LEVEL=warning")
    assert logs_line().startswith("Service log level: WARNING (no `outcome` lines;")
    monkeypatch.delenv("BENCH_SETTINGS")
    monkeypatch.delenv("BENCH_LOG_LEVEL")
    assert logs_line().startswith("Service log level: WARNING (no `outcome` lines;")  # the benchmark's
