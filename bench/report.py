"""The benchmark's report: one row per scenario, the targets, where the CPU went; rendered as Markdown."""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime

from bench.harness import outcome_lines, service_log_level, table


@dataclass
class Row:
    scenario: str
    events: int
    rate: float
    webhook_p50: float | None = None
    webhook_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p99: float | None = None
    rss: str = "-"
    lost: int | None = None
    doubled: int | None = None
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    ceilings: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    #: (target, reached, met); met None for a row given for reference, not a target.
    checks: list[tuple[str, str, bool | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- the report ----------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.1f}"


def render(report: Report, args: argparse.Namespace) -> str:
    pg = report.ceilings["raw Postgres: INSERT … ON CONFLICT + UPDATE per event, 64 in flight"]
    lines = [
        f"# evolution-ingest benchmark — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Machine: {machine()}",
        f"Command: `{invocation('bench')}`",
        logs_line(),
        "",
        "## Ceilings on this machine, measured in the same run",
        "",
        table([[name, value] for name, value in report.ceilings.items()], ["ceiling", "per second"]),
        "",
        "## Scenarios (no-op handler, realistic bodies: the fixtures with unique ids)",
        "",
        table(
            [
                [
                    r.scenario,
                    r.events,
                    r.rate,
                    f"{r.rate / pg:.2f}×",
                    ms(r.webhook_p50),
                    ms(r.webhook_p99),
                    ms(r.e2e_p50),
                    ms(r.e2e_p99),
                    r.rss,
                    "-" if r.lost is None else r.lost,
                    "-" if r.doubled is None else r.doubled,
                    r.note,
                ]
                for r in report.rows
            ],
            [
                "scenario",
                "events",
                "events/s",
                "× raw PG",
                "webhook p50 ms",
                "webhook p99 ms",
                "e2e p50 ms",
                "e2e p99 ms",
                "peak RSS MiB",
                "lost",
                "doubled",
                "",
            ],
        ),
        "",
        "## Targets",
        "",
        table(
            [
                [name, got, "—" if ok is None else "yes" if ok else "**no**"]
                for name, got, ok in report.checks
            ],
            ["target", "reached", "met"],
        ),
    ]
    if report.cpu:
        lines += ["", "## Where the CPU goes (ms of CPU per event, all processes of the machine)", ""]
        names = sorted({k for per in report.cpu.values() for k in per})
        lines.append(
            table(
                [
                    [scenario, *(per.get(k, 0.0) for k in names), sum(per.values())]
                    for scenario, per in report.cpu.items()
                ],
                ["scenario", *names, "total"],
            )
        )
    if report.notes:
        lines += ["", *report.notes]
    return "\n".join(lines) + "\n"


def invocation(module: str) -> str:
    """The command line that ran ``module`` with this process's arguments, as one would type it."""
    return " ".join([".venv/bin/python -m", module, *sys.argv[1:]])


def logs_line() -> str:
    """The service's log level, as a report's header gives it."""
    said = (
        "one `outcome` line per webhook call and per delivery, as by default"
        if outcome_lines()
        else "no `outcome` lines; by default, at INFO, one per webhook call and per delivery"
    )
    return f"Service log level: {service_log_level()} ({said})"


def machine() -> str:
    model = "?"
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {memory:.0f} GiB, Python {platform.python_version()}"
