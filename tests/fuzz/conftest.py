"""The fuzz tests: a short form in CI, ``FUZZ_CASES=10000`` for the long one; a summary at the end."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

#: Mutated bodies per channel (CI runs the short form; see docs for the long one).
CASES = int(os.environ.get("FUZZ_CASES", "1000"))
#: The seed of the mutations; a failing case is reproduced with the same seed.
SEED = int(os.environ.get("FUZZ_SEED", "20261201"))

RESULTS: list[tuple[str, int, Counter[str]]] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    terminalreporter.section("fuzz")
    for channel, cases, outcomes in RESULTS:
        listed = ", ".join(f"{name} {count}" for name, count in sorted(outcomes.items()))
        terminalreporter.write_line(f"{channel:<10} {cases:>6} cases (seed {SEED}): {listed}")


@pytest.fixture
def report() -> Any:
    def add(channel: str, cases: int, outcomes: Counter[str]) -> None:
        RESULTS.append((channel, cases, outcomes))

    return add
