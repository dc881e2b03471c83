"""What every part of the settings shares: the prefix, the error, the option enums, list parsing."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final

from pydantic import SecretStr
from pydantic_settings import NoDecode

ENV_PREFIX: Final = "EVOLUTION_INGEST_"


class ConfigError(Exception):
    """A setting has a wrong value. The message names the variable."""


class FieldError(Exception):
    """Raised by cross-field checks; pydantic lets it through unwrapped."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class WebhookAuth(enum.StrEnum):
    """How calls from Evolution API are authenticated (any listed method passes)."""

    NONE = "none"
    #: ``/api/internal/webhook/t/<token>`` or ``?token=<token>``: Evolution's
    #: global webhook cannot send headers, but its URL can carry a secret.
    URL_TOKEN = "url_token"  # noqa: S105 - a method name
    #: A static header (instance webhooks can send custom headers).
    HEADER = "header"
    #: ``Authorization: Bearer <HS256 JWT>`` signed with the instance's ``jwt_key``.
    JWT = "jwt"
    #: The instance ``apikey`` in the body, checked against a configured list.
    APIKEY = "apikey"


class RabbitMode(enum.StrEnum):
    """Which queues the worker consumes (see docs/rabbitmq.md for what each means for Evolution)."""

    #: Evolution's global queues ``<prefix>.<event>`` on one exchange (RABBITMQ_GLOBAL_ENABLED).
    GLOBAL = "global"
    #: Evolution's per-instance queues ``<instance>.<event>`` on one exchange per instance.
    INSTANCE = "instance"
    #: One queue of this service's own, bound to the exchange(s) for every listed event.
    OWN = "own"


class ForwardMode(enum.StrEnum):
    #: In-process when the webhook app runs in the same process (``up``), HTTP otherwise.
    AUTO = "auto"
    #: Always over HTTP (to compare, or to keep ``up`` exactly like separate processes).
    HTTP = "http"


class LogFormat(enum.StrEnum):
    AUTO = "auto"
    JSON = "json"
    TEXT = "text"


def split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CsvList = Annotated[list[str], NoDecode]


def present(secret: SecretStr | None) -> bool:
    return secret is not None and bool(secret.get_secret_value())
