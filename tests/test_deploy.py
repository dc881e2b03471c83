"""The compose file beside Evolution API: real settings, both channels wired alike, a safe start order."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from evolution_ingest.config import ENV_PREFIX, Settings
from evolution_ingest.core.identity import EVENT_NAMES, normalize_event_name

DEPLOY = Path(__file__).parent.parent / "deploy"
_VARIABLE = re.compile(r"\$\{([A-Z_]+)(:?[-?])?([^}]*)\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    return loaded


def _env(compose: dict[str, Any], service: str) -> dict[str, str]:
    return {k: str(v) for k, v in compose["services"][service].get("environment", {}).items()}


def _substituted(value: str) -> str:
    """As Compose reads it: ``${NAME:-default}`` unset gives its default, a required ``${NAME:?...}``
    a placeholder of its own name (a value the operator gives)."""
    return _VARIABLE.sub(lambda m: m[3] if m[2] == ":-" else f"<{m[1]}>", value)


def _ingest_services(compose: dict[str, Any]) -> list[str]:
    return [name for name in compose["services"] if name.startswith("ingest-")]


def test_every_evolution_ingest_variable_the_compose_file_sets_is_a_real_setting(
    compose: dict[str, Any],
) -> None:
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for service in _ingest_services(compose):
        names = {name for name in _env(compose, service) if name.startswith(ENV_PREFIX)}
        assert names, service
        assert names <= known, f"{service}: not settings: {sorted(names - known)}"
        values = {
            name.removeprefix(ENV_PREFIX).lower(): _substituted(value)
            for name, value in _env(compose, service).items()
        }
        Settings(_env_file=None, **{k: v for k, v in values.items() if v})  # type: ignore[call-arg]  # a pydantic-settings argument


def test_evolution_sends_its_global_webhook_to_the_service_with_the_services_token(
    compose: dict[str, Any],
) -> None:
    evolution, ingest = _env(compose, "evolution-api"), _env(compose, "ingest-serve")
    assert evolution["WEBHOOK_GLOBAL_ENABLED"] == "true"
    url = urlsplit(_substituted(evolution["WEBHOOK_GLOBAL_URL"]))
    aliases = {
        service: compose["services"][service].get("networks", {}).get("default", {}).get("aliases", [])
        for service in ("ingest-serve", "ingest-up")
    }
    assert all(url.hostname in names for names in aliases.values())  # both layouts answer at this name
    assert url.port == Settings(_env_file=None).port  # type: ignore[call-arg]  # the service's default port
    assert url.path == f"/api/internal/webhook/t/{_substituted(ingest[ENV_PREFIX + 'WEBHOOK_TOKEN'])}"
    assert "url_token" in ingest[ENV_PREFIX + "WEBHOOK_AUTH"].split(",")


def test_evolution_publishes_to_the_broker_exchange_and_queues_the_service_consumes(
    compose: dict[str, Any],
) -> None:
    evolution, ingest = _env(compose, "evolution-api"), _env(compose, "ingest-worker")
    assert (evolution["RABBITMQ_ENABLED"], evolution["RABBITMQ_GLOBAL_ENABLED"]) == ("true", "true")
    assert ingest[ENV_PREFIX + "RABBITMQ_MODE"] == "global"
    assert evolution["RABBITMQ_EXCHANGE_NAME"] == ingest[ENV_PREFIX + "RABBITMQ_EXCHANGE"]
    assert evolution["RABBITMQ_PREFIX_KEY"] == ingest[ENV_PREFIX + "RABBITMQ_PREFIX"]
    theirs, ours = (
        urlsplit(_substituted(evolution["RABBITMQ_URI"])),
        urlsplit(_substituted(ingest[ENV_PREFIX + "RABBITMQ_URL"])),
    )
    assert (theirs.hostname, theirs.port, theirs.username, theirs.password) == (
        ours.hostname, ours.port, ours.username, ours.password,
    )  # fmt: skip
    assert (theirs.path or "/") == ours.path


def test_the_same_events_are_on_both_channels_and_consumed_by_the_service(compose: dict[str, Any]) -> None:
    evolution, ingest = _env(compose, "evolution-api"), _env(compose, "ingest-worker")

    def enabled(prefix: str) -> set[str]:
        return {
            EVENT_NAMES[name.removeprefix(prefix)]
            for name, value in evolution.items()
            if name.startswith(prefix) and value == "true"
        }

    webhook, rabbitmq = enabled("WEBHOOK_EVENTS_"), enabled("RABBITMQ_EVENTS_")
    consumed = {normalize_event_name(e) for e in ingest[ENV_PREFIX + "RABBITMQ_EVENTS"].split(",")}
    assert webhook == rabbitmq == consumed
    assert "messages.upsert" in webhook


def test_evolution_starts_only_once_the_topology_is_declared(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["ingest-topology"]["command"] == ["topology"]
    assert services["evolution-api"]["depends_on"]["ingest-topology"] == {
        "condition": "service_completed_successfully"
    }
    for worker in ("ingest-worker", "ingest-up"):
        assert (
            services[worker]["depends_on"]["ingest-topology"]["condition"] == "service_completed_successfully"
        )


def test_evolution_and_the_service_do_not_clash_on_the_host(compose: dict[str, Any]) -> None:
    published = {
        service: [str(port).rsplit(":", 1)[0] for port in spec.get("ports", [])]
        for service, spec in compose["services"].items()
    }
    assert published["evolution-api"] == ["127.0.0.1:8081"]
    assert not any(published[service] for service in _ingest_services(compose))


def test_the_env_example_names_every_variable_and_holds_no_working_secret(compose: dict[str, Any]) -> None:
    text = (DEPLOY / "compose.yaml").read_text(encoding="utf-8")
    read = {m[1] for m in _VARIABLE.finditer(text)}
    required = {m[1] for m in _VARIABLE.finditer(text) if m[2] == ":?"}
    example = dict(
        line.split("=", 1) for line in (DEPLOY / ".env.example").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    )  # fmt: skip
    assert read <= set(example), sorted(read - set(example))
    secrets = {name for name in required if name.endswith(("PASSWORD", "KEY", "TOKEN", "SECRET"))}
    assert secrets == {
        "POSTGRES_PASSWORD",
        "RABBITMQ_PASSWORD",
        "EVOLUTION_API_KEY",
        "INGEST_WEBHOOK_TOKEN",
        "INGEST_INTERNAL_SECRET",
    }
    assert all(example[name] == "" for name in secrets)  # nothing that works until you make it
