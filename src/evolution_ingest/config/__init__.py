"""Settings, read once at start-up from ``EVOLUTION_INGEST_*`` variables (and ``.env``).

Every default works on a machine whose Postgres, Redis and RabbitMQ listen on their
standard local ports. A wrong value stops start-up with a message that names the
variable (:class:`ConfigError`). Each part of the settings is a model of its own
(stores, webhook, RabbitMQ, processing, operating); :class:`Settings` is all of them,
and :func:`reference` is the table of ``docs/settings.md``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any, Final

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from evolution_ingest.config.base import (
    ENV_PREFIX,
    ConfigError,
    FieldError,
    ForwardMode,
    LogFormat,
    RabbitMode,
    WebhookAuth,
)
from evolution_ingest.config.evolution import EvolutionSettings
from evolution_ingest.config.operating import OperatingSettings
from evolution_ingest.config.processing import ProcessingSettings
from evolution_ingest.config.rabbitmq import RabbitSettings
from evolution_ingest.config.retention import RetentionSettings
from evolution_ingest.config.stores import StoreSettings
from evolution_ingest.config.webhook import WebhookSettings

__all__ = [
    "ENV_PREFIX", "ConfigError", "ForwardMode", "LogFormat", "RabbitMode", "Settings", "WebhookAuth",
    "reference", "unknown_variables",
]  # fmt: skip

#: The parts, in the order the reference lists them.
PARTS: Final[tuple[tuple[str, type[BaseModel]], ...]] = (
    ("Stores", StoreSettings),
    ("Webhook app", WebhookSettings),
    ("RabbitMQ channel", RabbitSettings),
    ("Business logic, timings and the reconciler", ProcessingSettings),
    ("Operating: logs, metrics, coverage, dashboard", OperatingSettings),
    ("Retention: how long bodies and rows stay", RetentionSettings),
    ("Evolution API's REST API: connect, check, backfill", EvolutionSettings),
)


class Settings(
    StoreSettings,
    WebhookSettings,
    RabbitSettings,
    ProcessingSettings,
    OperatingSettings,
    RetentionSettings,
    EvolutionSettings,
    BaseSettings,
):
    """All settings of the service. Build it with :meth:`from_env`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=".env", env_file_encoding="utf-8", extra="ignore", frozen=True
    )

    @property
    def own_secrets(self) -> list[str]:
        """Secrets of this service that must never appear in what it keeps, shows or sends."""
        found = (self.webhook_token, self.webhook_jwt_key, self.internal_secret, self.evolution_api_key)
        return [
            secret.get_secret_value() for secret in found if secret is not None and secret.get_secret_value()
        ]

    @property
    def public_webhook_url(self) -> str:
        """This service's webhook URL as Evolution reaches it (without auth or event suffix)."""
        base = self.webhook_public_url or f"http://{self.host}:{self.port}"
        return f"{base}/api/internal/webhook"

    @property
    def webhook_forward_url(self) -> str:
        """Where the worker and the reconciler send forwards."""
        if self.forward_url:
            return self.forward_url
        host = "127.0.0.1" if self.host in {"0.0.0.0", "::", ""} else self.host  # noqa: S104 - mapping, not binding
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/api/internal/webhook"

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Read the environment (and ``.env``); raise :class:`ConfigError` naming the variable.

        ``overrides`` (keyword arguments named after the fields) win over both.
        """
        try:
            return cls(**overrides)
        except FieldError as exc:
            raise ConfigError(f"{ENV_PREFIX}{exc.field.upper()}: {exc.message}") from None
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"][:1]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{ENV_PREFIX}{field.upper()}: {message}" if error["loc"] else message)
    return "invalid settings:\n  " + "\n  ".join(lines)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``EVOLUTION_INGEST_*`` variables that match no setting (likely typos), with hints."""
    env = os.environ if environ is None else environ
    names = {ENV_PREFIX + field.upper() for field in Settings.model_fields}
    hints = []
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in names:
            close = difflib.get_close_matches(var, sorted(names), n=1)
            hints.append(f"{var} (did you mean {close[0]}?)" if close else var)
    return hints


def _shown(field: Any) -> str:
    extra = field.json_schema_extra or {}
    if "shown_default" in extra:
        return f"{extra['shown_default']}"
    value = field.get_default(call_default_factory=True)
    if value is None or isinstance(value, SecretStr):
        return "—"
    if isinstance(value, list):
        value = ",".join(str(v) for v in value) or "—"
    if isinstance(value, bool):
        value = str(value).lower()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def reference() -> str:
    """The Markdown table of every setting, by part: variable, default, what it does."""
    lines: list[str] = []
    for title, part in PARTS:
        lines += [f"### {title}", "", "| variable | default | what |", "|---|---|---|"]
        for name, field in part.model_fields.items():
            lines.append(f"| `{ENV_PREFIX}{name.upper()}` | {_shown(field)} | {field.description or ''} |")
        lines.append("")
    return "\n".join(lines)
