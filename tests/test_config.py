"""Settings: working local defaults; a wrong value names its variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evolution_ingest.config import ENV_PREFIX, ConfigError, Settings, WebhookAuth, unknown_variables
from evolution_ingest.core.pipeline import DEFAULT_HANDLER, HandlerPipeline, load_handler


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test sees only the variables it sets: not the shell's, nor a .env file in the work tree."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_defaults_point_at_the_standard_local_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.from_env(_env_file=None)
    assert settings.database_url == "postgresql://postgres@127.0.0.1:5432/postgres"
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.rabbitmq_url == "amqp://guest:guest@127.0.0.1:5672/"
    assert settings.port == 8080
    assert settings.lock_ttl_seconds == 120
    assert settings.metrics_prefix == "ps:metrics:evolution:"
    assert settings.auth_methods == frozenset()
    assert settings.max_body_bytes == 32 * 1024 * 1024


def test_values_come_from_the_environment_and_lists_are_comma_separated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EVOLUTION_INGEST_PORT", "9090")
    monkeypatch.setenv("EVOLUTION_INGEST_HANDLERS", "a.b:c, d.e:f")
    monkeypatch.setenv("EVOLUTION_INGEST_WEBHOOK_AUTH", "JWT,url_token")
    monkeypatch.setenv("EVOLUTION_INGEST_WEBHOOK_JWT_KEY", "fake-jwt-key")
    monkeypatch.setenv("EVOLUTION_INGEST_WEBHOOK_TOKEN", "fake-token")
    settings = Settings.from_env(_env_file=None)
    assert settings.port == 9090
    assert settings.handlers == ["a.b:c", "d.e:f"]
    assert settings.auth_methods == {WebhookAuth.JWT, WebhookAuth.URL_TOKEN}


def test_a_dotenv_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / ".env"
    env.write_text("EVOLUTION_INGEST_PORT=7070\nUNRELATED=1\n")
    assert Settings.from_env(_env_file=env).port == 7070


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("PORT", "eighty", "EVOLUTION_INGEST_PORT: Input should be a valid integer"),
        ("PORT", "70000", "EVOLUTION_INGEST_PORT: Input should be less than or equal to 65535"),
        ("LOCK_TTL_SECONDS", "0", "EVOLUTION_INGEST_LOCK_TTL_SECONDS: Input should be greater than 0"),
        ("DATABASE_URL", "mysql://x", "EVOLUTION_INGEST_DATABASE_URL: must start with postgresql://"),
        ("REDIS_URL", "localhost:6379", "EVOLUTION_INGEST_REDIS_URL: must start with redis://"),
        ("RABBITMQ_URL", "http://x", "EVOLUTION_INGEST_RABBITMQ_URL: must start with amqp://"),
        ("HANDLERS", "not_a_spec", "EVOLUTION_INGEST_HANDLERS: 'not_a_spec' is not of the form"),
        ("DATABASE_SCHEMA", "bad-schema;", "EVOLUTION_INGEST_DATABASE_SCHEMA: String should match pattern"),
        ("LOG_LEVEL", "loud", "EVOLUTION_INGEST_LOG_LEVEL: choose DEBUG"),
        ("MIGRATE_ON_START", "perhaps", "EVOLUTION_INGEST_MIGRATE_ON_START: Input should be a valid boolean"),
    ],
)
def test_a_wrong_value_names_the_variable(
    variable: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"EVOLUTION_INGEST_{variable}", value)
    with pytest.raises(ConfigError) as raised:
        Settings.from_env(_env_file=None)
    assert message in str(raised.value)


def test_unknown_variables_are_reported_with_a_hint() -> None:
    env = {"EVOLUTION_INGEST_LOCK_TTL": "5", "EVOLUTION_INGEST_PORT": "1", "OTHER": "x"}
    assert unknown_variables(env) == [
        "EVOLUTION_INGEST_LOCK_TTL (did you mean EVOLUTION_INGEST_LOCK_TTL_SECONDS?)"
    ]


async def _handler(event: object) -> None:
    return None


def _sync_handler(event: object) -> None:
    return None


def test_handlers_load_from_specs_and_default_to_the_log_line() -> None:
    assert len(HandlerPipeline.from_specs([])) == 1
    assert load_handler(DEFAULT_HANDLER).__name__ == "log_summary"
    assert load_handler("tests.test_config:_handler") is _handler


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:handle", "cannot import 'no_such_module_xyz'"),
        ("tests.test_config:missing", "has no 'missing'"),
        ("tests.test_config:_sync_handler", "is not an async function"),
    ],
)
def test_a_handler_that_cannot_be_loaded_names_the_setting(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match="EVOLUTION_INGEST_HANDLERS") as raised:
        load_handler(spec)
    assert message in str(raised.value)


def test_every_part_of_the_settings_keeps_its_validators_and_describes_each_setting() -> None:
    from evolution_ingest.config import PARTS  # noqa: PLC0415 - what this test is about

    merged = Settings.__pydantic_decorators__
    for _, part in PARTS:
        for kind in ("field_validators", "model_validators"):
            assert set(getattr(part.__pydantic_decorators__, kind)) <= set(getattr(merged, kind)), part
        assert all(field.description for field in part.model_fields.values()), part
    assert set(Settings.model_fields) == {name for _, part in PARTS for name in part.model_fields}
