"""The Grafana dashboard (deploy/grafana/) queries only what ``/metrics`` serves."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RABBITMQ_URL, OpenRuntime, running_service
from tests.support import fixtures, wait_until
from tests.support.evolution import EvolutionPublisher, broker, send_both
from tests.test_operate import FailingFor

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "evolution-ingest.json"
_METRIC = re.compile(r"\b(evolution_ingest_[a-z0-9_]+)")
_BY = re.compile(r"\bby \(([^)]*)\)\s*\((\w+)")
_SELECTOR = re.compile(r"(evolution_ingest_[a-z0-9_]+)\{([^}]*)\}")


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "grafana_dashboard", ROOT / "scripts" / "grafana-dashboard.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_the_dashboard_file_is_what_its_script_writes() -> None:
    assert DASHBOARD.read_text(encoding="utf-8") == _generator().rendered(), (
        "run: .venv/bin/python scripts/grafana-dashboard.py"
    )


def test_every_panel_has_a_query_and_the_layout_fits_the_grid() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def _served(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Metric names served (with samples, or declared by a ``# TYPE`` line and zero so far),
    and the label names seen on each."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            names.add(name)
            names.update({"histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count"}}.get(kind, set()))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.add(sample.name)
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


async def test_every_metric_and_label_the_dashboard_queries_is_served(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession
) -> None:
    handler = FailingFor({"presence.update"})  # failures, retries and parking have samples too
    items = fixtures()
    async with open_runtime(handler) as runtime, running_service(runtime) as service:
        base = service.url.removesuffix("/api/internal/webhook")
        settings = runtime.settings
        async with broker(RABBITMQ_URL) as (_, channel):
            publisher = EvolutionPublisher(channel, settings.rabbitmq_exchange, settings.rabbitmq_prefix)
            await send_both(http, service.url, publisher, items)
        async with http.post(service.url, data=b"{not json"):
            pass

        async def scraped() -> str:
            async with http.get(base + "/metrics") as response:
                assert response.status == 200
                return await response.text()

        async def parked() -> bool:
            return "evolution_ingest_parked_total" in _served(await scraped())[0]

        await wait_until(parked, within=30, message="a failing event retried through every tier and parked")
        names, labels = _served(await scraped())
    wanted = {name for expr in queries() for name in _METRIC.findall(expr)}
    assert len(wanted) >= 20
    missing = sorted(wanted - names)
    assert missing == [], f"queried but not served: {missing}"
    for expr in queries():
        for grouping, name in _BY.findall(expr):
            metric = next(iter(_METRIC.findall(expr[expr.index(grouping) :])), name)
            if metric not in labels:
                continue  # declared, no sample yet: no labels served to compare with
            unknown = {label.strip() for label in grouping.split(",")} - labels[metric] - {"le"}
            assert not unknown, f"{expr}: {metric} has no label {unknown}"
        for metric, selector in _SELECTOR.findall(expr):
            used = {part.split("=")[0].rstrip("!~").strip() for part in selector.split(",")}
            assert used <= labels[metric], f"{expr}: {metric} has no label {used - labels[metric]}"
