"""The layout keeps its rules (docs/architecture.md): each part imports only what it may."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "evolution_ingest"
#: The core's pure modules: no I/O, used by every part.
PURE_CORE = {"codec", "identity", "events", "redaction", "body", "contract", "batching", "pipeline", "stored"}
#: Which parts each part may import (besides itself and ``config``).
ALLOWED = {
    "core": {"core", "stores"},
    "stores": {"core"},
    "channels": {"core", "stores"},
    "logic": {"core", "stores"},
    "operate": {"core", "stores", "logic", "runtime", "commandline"},
}
SQL_WORDS = ("SELECT ", "INSERT INTO", "UPDATE ", "DELETE FROM")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("evolution_ingest"):
            # ``from evolution_ingest.core import codec`` names the module in the import list.
            packaged = node.module.count(".") < 2
            found.update(f"{node.module}.{a.name}" if packaged else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("evolution_ingest"))
    return found


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_what_its_part_may(path: Path) -> None:
    part = _part(path)
    if part not in ALLOWED:
        return  # the top level (cli, assembly, runtime...) puts the parts together
    allowed = ALLOWED[part] | {part, "config"}
    for name in _imports(path):
        target = name.split(".")[1]
        assert target in allowed, f"{part} imports {name}"
        if part in {"stores"} or (part == "core" and path.stem in PURE_CORE):
            # the stores and the pure core never reach the core's procedure (ingestion, runner...)
            leaf = name.split(".")[2] if name.count(".") >= 2 else ""
            assert target != "core" or leaf in PURE_CORE, f"{path.stem} imports {name}"
            if part == "core":
                assert target != "stores", f"the pure core ({path.stem}) imports {name}"


def test_the_runtime_the_operator_layer_opens_reaches_no_channel() -> None:
    assert not any(name.startswith("evolution_ingest.channels") for name in _imports(PACKAGE / "runtime.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_sql_lives_in_the_stores_only(path: Path) -> None:
    if _part(path) == "stores":
        return
    text = path.read_text(encoding="utf-8")
    assert not [
        word for word in SQL_WORDS if f'"{word}' in text or f"'{word}" in text or f'"""\n{word}' in text
    ]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path: Path) -> None:
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 330
