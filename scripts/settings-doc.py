"""Write the settings table of docs/settings.md from the settings model (src/evolution_ingest/config)."""

from __future__ import annotations

import sys
from pathlib import Path

from evolution_ingest.config import reference

DOC = Path(__file__).parent.parent / "docs" / "settings.md"
START, END = "<!-- settings:start -->", "<!-- settings:end -->"


def rendered(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{reference()}\n{END}{tail}"


if __name__ == "__main__":
    current = DOC.read_text(encoding="utf-8")
    DOC.write_text(rendered(current), encoding="utf-8")
    sys.stdout.write(f"wrote {DOC}\n")
