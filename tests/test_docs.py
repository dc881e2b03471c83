"""The docs match the code: the settings table is the settings model's, the routes example loads, every link lands."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from evolution_ingest.config import Settings
from evolution_ingest.logic.routes_file import load_routes
from evolution_ingest.operate.connect import Connector
from evolution_ingest.stores.evolution import SOURCE_HEADER

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


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_between_the_docs_points_at_a_file_that_exists() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"


@functools.cache
def _anchors(page: Path) -> set[str]:
    """The fragments a page answers to, as GitHub makes them: each heading's slug (repeats numbered),
    and each ``<a id="...">``."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    anchors = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for line in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_to_a_place_in_the_docs_points_at_a_heading_that_exists() -> None:
    broken = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target, fragment in re.findall(r"\]\(([^)#:\s]*)#([^)\s]+)\)", text):
            if target and not target.endswith(".md"):
                continue
            if fragment not in _anchors(page.parent / target if target else page):
                broken.append(f"{page.name} -> {target or page.name}#{fragment}")
    assert not broken, "\n".join(broken)


def _connectors() -> list[Any]:
    """``connect`` for every mode that changes what it prints or sets."""
    connectors = []
    for mode in ("global", "instance", "own"):
        for auth in ("url_token", "header,jwt", "apikey"):
            settings = Settings(  # type: ignore[call-arg]  # a pydantic-settings argument, not a field
                _env_file=None, rabbitmq_mode=mode, rabbitmq_instances=["acme"], webhook_auth=auth,
                webhook_token="fake-token", webhook_jwt_key="fake-jwt-key-" + "x" * 32, webhook_apikeys=["fake"],
                webhook_public_url="http://ingest:8080",
            )  # fmt: skip
            for webhook in ("instance", "global"):
                connectors.append(Connector(None, settings, webhook_mode=webhook))  # type: ignore[arg-type]  # no REST call here
    return connectors


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text[text.index("## Connect Evolution API") : text.index("## Your business logic")]


def test_the_readme_names_every_evolution_setting_connect_prints_and_the_expose_caveat() -> None:
    section = _readme_section()
    printed = {
        re.sub(r"_(EVENTS)_[A-Z_]+$", r"_\1_<EVENT>", line.split("=")[0].lstrip("# ").split(" ")[0])
        for connector in _connectors()
        for line in connector.environment_lines()
    }
    assert "RABBITMQ_PREFIX_KEY" in printed
    for name in printed:
        shown = "WEBHOOK_GLOBAL_*" if name.startswith("WEBHOOK_GLOBAL_") else name
        assert f"`{shown}`" in section or f"`{name}=" in section, f"the README does not name {name}"
    assert "without it Evolution sends `apikey: null`" in section


def test_the_readme_and_docs_describe_the_webhook_connect_sets() -> None:
    section = _readme_section()
    desired = _connectors()[0].desired_webhook()
    for name in desired:
        assert f"`{name}" in section, f"the README does not say what connect sets in {name}"
    assert f"`{SOURCE_HEADER}`" in section
    (example,) = re.findall(
        r"```json\n(.*?)```", (ROOT / "docs" / "evolution.md").read_text(encoding="utf-8"), re.S
    )
    by_hand = json.loads(example)["webhook"]
    assert set(by_hand) == set(desired)
    assert by_hand["headers"] == {SOURCE_HEADER: "instance"}
    assert by_hand["byEvents"] is desired["byEvents"]
