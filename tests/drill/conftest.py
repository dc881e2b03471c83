"""The fault drill: every scenario's count, printed as one table at the end of the run."""

from __future__ import annotations

import os
from typing import Any

import pytest

RESULTS: list[dict[str, Any]] = []

#: Events per scenario: a short form in CI, more with DRILL_EVENTS=1000.
EVENTS = int(os.environ.get("DRILL_EVENTS", "40"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    terminalreporter.section("fault drill")
    header = f"{'scenario':<44} {'sent':>6} {'completed':>9} {'lost':>5} {'doubled':>8}  notes"
    terminalreporter.write_line(header)
    for row in RESULTS:
        terminalreporter.write_line(
            f"{row['scenario']:<44} {row['sent']:>6} {row['completed']:>9} {row['lost']:>5} "
            f"{row['doubled']:>8}  {row['notes']}"
        )


@pytest.fixture
def record() -> Any:
    def add(scenario: str, count: Any, notes: str = "") -> None:
        RESULTS.append(
            {
                "scenario": scenario,
                "sent": count.sent,
                "completed": len(count.completed),
                "lost": count.lost,
                "doubled": count.doubled,
                "notes": notes,
            }
        )

    return add
