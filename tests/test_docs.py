"""The docs match the code: the settings table is the settings model's, the routes example loads."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from evolution_ingest.logic.routes_file import load_routes

ROOT = Path(__file__).parent.parent


def test_the_settings_table_is_generated_from_the_settings_model() -> None:
    spec = importlib.util.spec_from_file_location("settings_doc", ROOT / "scripts" / "settings-doc.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert module.rendered(current) == current, "run: .venv/bin/python scripts/settings-doc.py"


def test_the_routes_example_of_the_docs_is_a_valid_routes_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (block,) = re.findall(
        r"```yaml\n(.*?)```", (ROOT / "docs" / "routes.md").read_text(encoding="utf-8"), re.S
    )
    for name in ("ALERT_WEBHOOK_URL", "CRM_TOKEN"):
        monkeypatch.setenv(name, "https://hooks.example.test/x" if name.endswith("URL") else "fake-token")
    path = tmp_path / "routes.yaml"
    path.write_text(block, encoding="utf-8")
    assert [route.name for route in load_routes(path).routes] == ["presence-noise", "crm", "disconnected"]


def test_every_link_between_the_docs_points_at_a_file_that_exists() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"
