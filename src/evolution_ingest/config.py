"""Settings, read once at start-up from ``EVOLUTION_INGEST_*`` variables (and ``.env``).

Every default works on a machine whose Postgres, Redis and RabbitMQ listen on
their standard local ports. A wrong value stops start-up with a message that
names the variable (:class:`ConfigError`).
"""

from __future__ import annotations

import difflib
import enum
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from evolution_ingest.core.identity import EMITTED_EVENTS, normalize_event_name

ENV_PREFIX: Final = "EVOLUTION_INGEST_"


class ConfigError(Exception):
    """A setting has a wrong value. The message names the variable."""


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
    """Which queues the worker consumes (see the README for what each means for Evolution)."""

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


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CsvList = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    """All settings of the service. Build it with :meth:`from_env`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    # --- stores -----------------------------------------------------------------
    database_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    #: Postgres schema holding the inbox (created by ``migrate`` if missing).
    database_schema: str = Field(default="public", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    database_pool_size: int = Field(default=16, ge=1, le=500)
    #: Statements of each kind (saves, claims, marks) running at once; the requests that arrive
    #: meanwhile join the next one (group commit). Lower: bigger batches, fewer commits.
    database_batch_concurrency: int = Field(default=1, ge=1, le=64)
    #: How the service's connections are named in ``pg_stat_activity`` (one name per replica helps).
    database_application_name: str = Field(default="evolution-ingest", max_length=63)
    #: Connect, pool-acquire and statement timeout; past it the webhook answers 503.
    database_timeout_seconds: float = Field(default=5.0, gt=0)
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Seconds to wait for Redis before carrying on with Postgres alone.
    redis_timeout_seconds: float = Field(default=0.5, gt=0)
    rabbitmq_url: str = "amqp://guest:guest@127.0.0.1:5672/"

    # --- the webhook app ----------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    #: Shared by worker, reconciler and webhook app for ``already_saved`` calls.
    internal_secret: SecretStr | None = None
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    #: Upper bound on object keys in one body (a JSON bomb guard).
    max_json_keys: int = Field(default=2_000_000, ge=10)
    #: ``Retry-After`` of a 503 (Postgres unreachable).
    retry_after_seconds: int = Field(default=5, ge=1)
    webhook_auth: CsvList = Field(default_factory=lambda: [WebhookAuth.NONE.value])
    webhook_token: SecretStr | None = None
    webhook_token_header: str = "x-webhook-token"  # noqa: S105 - a header name
    webhook_jwt_key: SecretStr | None = None
    #: Evolution signs one JWT per event (10 min expiry) and retries for ~20 min.
    webhook_jwt_leeway_seconds: float = Field(default=1800, ge=0)
    webhook_apikeys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    #: Run migrations when ``serve`` starts (``up`` always does).
    migrate_on_start: bool = False
    #: Keep the instance ``apikey`` in stored bodies (and so in ``Event.payload``); off by default.
    keep_apikey: bool = False
    #: Refused bodies are kept (for ``status``, ``inspect``, ``replay --refused``) up to this size.
    refusal_max_bytes: int = Field(default=256 * 1024, ge=1024)
    #: How many refused bodies are kept; the oldest are dropped past it.
    refusals_keep: int = Field(default=10_000, ge=1)

    # --- the RabbitMQ channel ----------------------------------------------------------
    rabbitmq_mode: RabbitMode = RabbitMode.GLOBAL
    #: Evolution's RABBITMQ_EXCHANGE_NAME (global mode and own mode in global setups).
    rabbitmq_exchange: str = Field(default="evolution_exchange", min_length=1)
    #: Evolution's RABBITMQ_PREFIX_KEY; empty when Evolution has none (queues are then ``<event>``).
    rabbitmq_prefix: str = "evolution"
    #: Instances whose exchanges and queues to consume (instance mode; own mode with no global exchange).
    rabbitmq_instances: CsvList = Field(default_factory=list)
    #: Events to consume; default: every event Evolution emits.
    rabbitmq_events: CsvList = Field(default_factory=lambda: list(EMITTED_EVENTS))
    #: The service's own queue in ``own`` mode.
    rabbitmq_queue: str = Field(default="evolution-ingest.events", min_length=1)
    #: Prefix of the service's retry, lock-busy, ready and parking queues.
    rabbitmq_service_prefix: str = Field(default="evolution-ingest", min_length=1)
    #: Unacknowledged messages per consumed queue.
    rabbitmq_prefetch: int = Field(default=32, ge=1, le=10_000)
    #: Messages processed at once by one worker, across all its queues.
    worker_concurrency: int = Field(default=64, ge=1, le=10_000)
    #: Delay of each retry tier after a failed forward; after the last, the parking queue.
    retry_delays_seconds: Annotated[list[float], NoDecode] = Field(default_factory=lambda: [5.0, 30.0, 180.0])
    #: How long a message whose event is locked (being processed elsewhere) waits before it comes back.
    lock_busy_delay_seconds: float = Field(default=2.0, gt=0)
    #: How long a copy waits for its event's business logic running in this same process
    #: (webhook app and worker together, as in ``up``) before taking the lock-busy queue.
    lock_busy_wait_seconds: float = Field(default=5.0, ge=0)
    #: Returns after which a locked message is acknowledged anyway (it is saved; the reconciler heals it).
    lock_busy_max_returns: int = Field(default=30, ge=0)
    #: Where the worker forwards saved events; default: this host's webhook app.
    forward_url: str | None = None
    forward_mode: ForwardMode = ForwardMode.AUTO
    forward_timeout_seconds: float = Field(default=30.0, gt=0)
    #: How long a stopping worker waits for messages in flight before closing.
    shutdown_timeout_seconds: float = Field(default=30.0, gt=0)
    #: How often the worker checks that its consumers are really registered on the broker.
    rabbitmq_watchdog_seconds: float = Field(default=30.0, gt=0)

    # --- the reconciler and maintenance ----------------------------------------------------
    #: How often the reconciler looks for saved, unprocessed events.
    reconcile_interval_seconds: float = Field(default=300.0, gt=0)
    #: How old an unprocessed event must be before the reconciler re-forwards it.
    reconcile_after_seconds: float = Field(default=120.0, ge=0)
    #: Rows read per query, oldest first.
    reconcile_batch_size: int = Field(default=200, ge=1, le=10_000)
    #: Forwards in flight at once during a pass.
    reconcile_concurrency: int = Field(default=8, ge=1, le=1_000)
    #: Rows handled at most in one pass (the next pass goes on).
    reconcile_max_per_pass: int = Field(default=10_000, ge=1)
    #: Business-logic attempts after which an event is marked failed; only a replay retries it.
    reconcile_max_attempts: int = Field(default=10, ge=1)
    #: ``purge`` refuses a shorter age unless forced: it must outlast Evolution's ~20 min of retries.
    purge_min_age_seconds: float = Field(default=86_400.0, ge=0)

    # --- business logic -------------------------------------------------------------
    #: ``pkg.module:function,...``; empty means the built-in one-line log (unless routes are set).
    handlers: CsvList = Field(default_factory=list)
    #: Built-in routing (forward, drop, alert) from a YAML or TOML file; runs before the handlers.
    routes_file: Path | None = None

    # --- timings --------------------------------------------------------------------
    #: Redis lock and Postgres claim lease; renewed while a handler runs.
    lock_ttl_seconds: float = Field(default=120, gt=0)
    #: How long Redis remembers that an event was saved / processed.
    seen_ttl_seconds: float = Field(default=3600, gt=0)
    metrics_flush_seconds: float = Field(default=1.0, gt=0)

    # --- counters and logs ----------------------------------------------------------
    metrics_prefix: str = "ps:metrics:evolution:"
    #: Prefix of this service's other Redis keys (locks, seen markers).
    redis_key_prefix: str = "evolution-ingest:"
    log_level: str = "INFO"
    log_format: LogFormat = LogFormat.AUTO
    #: One log line per outcome (event, instance, dedup key, channel, duration) at INFO.
    log_outcomes: bool = True

    # --- operating it: metrics, readiness, coverage, dashboard -------------------------
    #: Evolution's time zone: its ``date_time`` is local time labelled Z (end-to-end latency).
    evolution_timezone: str = "UTC"
    #: ``/metrics`` and ``/dashboard`` read Postgres and RabbitMQ at most this often.
    metrics_cache_seconds: float = Field(default=2.0, ge=0)
    #: ``/readyz`` checks the stores at most this often.
    ready_cache_seconds: float = Field(default=1.0, ge=0)
    #: A channel silent this long for an instance while the other delivers raises a gap alert.
    gap_alert_after_seconds: float = Field(default=300.0, gt=0)
    #: How often the gap watcher (in ``reconcile`` and ``up``) looks.
    gap_check_interval_seconds: float = Field(default=30.0, gt=0)
    #: Where gap alerts are posted as ``{"text", "content"}`` (Slack, Discord...); always logged.
    gap_alert_webhook_url: str | None = None
    #: The window of the coverage figures (share of events seen on both channels).
    coverage_window_seconds: float = Field(default=3600.0, gt=0)
    #: Events younger than this are left out of the coverage share (the other copy may be on its way).
    coverage_settle_seconds: float = Field(default=60.0, ge=0)
    #: ``/dashboard``: off unless set; open it with this token (HTTP basic auth password, or Bearer).
    dashboard_token: SecretStr | None = None

    @field_validator("webhook_auth", "handlers", "rabbitmq_instances", "rabbitmq_events", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("webhook_apikeys", "retry_delays_seconds", mode="before")
    @classmethod
    def _csv_values(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("retry_delays_seconds")
    @classmethod
    def _positive_delays(cls, value: list[float]) -> list[float]:
        if not value or any(delay <= 0 for delay in value):
            raise ValueError("give one or more positive delays in seconds, e.g. 5,30,180")
        return value

    @field_validator("rabbitmq_events")
    @classmethod
    def _event_names(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("list at least one event, e.g. messages.upsert,connection.update")
        return [normalize_event_name(event) for event in value]

    @field_validator("webhook_auth")
    @classmethod
    def _known_auth(cls, value: list[str]) -> list[str]:
        modes = [mode.lower() for mode in value] or [WebhookAuth.NONE.value]
        known = {mode.value for mode in WebhookAuth}
        for mode in modes:
            if mode not in known:
                raise ValueError(f"unknown method {mode!r}; choose from {', '.join(sorted(known))}")
        if WebhookAuth.NONE.value in modes and len(modes) > 1:
            raise ValueError("'none' cannot be combined with other methods")
        return modes

    @field_validator("handlers")
    @classmethod
    def _handler_specs(cls, value: list[str]) -> list[str]:
        for spec in value:
            module, sep, attr = spec.partition(":")
            if not sep or not module or not attr:
                raise ValueError(f"{spec!r} is not of the form 'package.module:function'")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("choose DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return level

    @field_validator("evolution_timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {value!r} (an IANA name such as UTC or America/Sao_Paulo)"
            ) from None
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must start with postgresql:// (e.g. postgresql://user@host:5432/db)")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @field_validator("rabbitmq_url")
    @classmethod
    def _amqp_url(cls, value: str) -> str:
        if not value.startswith(("amqp://", "amqps://")):
            raise ValueError("must start with amqp:// or amqps://")
        return value

    @model_validator(mode="after")
    def _instances_for_instance_mode(self) -> Settings:
        if self.rabbitmq_mode is RabbitMode.INSTANCE and not self.rabbitmq_instances:
            raise _FieldError("rabbitmq_instances", "required by RABBITMQ_MODE instance")
        return self

    @property
    def webhook_forward_url(self) -> str:
        """Where the worker and the reconciler send forwards."""
        if self.forward_url:
            return self.forward_url
        host = "127.0.0.1" if self.host in {"0.0.0.0", "::", ""} else self.host  # noqa: S104 - mapping, not binding
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/api/internal/webhook"

    @model_validator(mode="after")
    def _auth_needs_secrets(self) -> Settings:
        modes = set(self.webhook_auth)
        if modes & {WebhookAuth.URL_TOKEN, WebhookAuth.HEADER} and not _present(self.webhook_token):
            raise _FieldError("webhook_token", "required by WEBHOOK_AUTH url_token/header")
        if WebhookAuth.JWT in modes and not _present(self.webhook_jwt_key):
            raise _FieldError("webhook_jwt_key", "required by WEBHOOK_AUTH jwt")
        if WebhookAuth.APIKEY in modes and not self.webhook_apikeys:
            raise _FieldError("webhook_apikeys", "required by WEBHOOK_AUTH apikey")
        return self

    @property
    def auth_methods(self) -> frozenset[WebhookAuth]:
        return frozenset(WebhookAuth(mode) for mode in self.webhook_auth) - {WebhookAuth.NONE}

    @property
    def own_secrets(self) -> list[str]:
        """Secrets of this service that must never appear in what it keeps, shows or sends."""
        found = (self.webhook_token, self.webhook_jwt_key, self.internal_secret)
        return [
            secret.get_secret_value() for secret in found if secret is not None and secret.get_secret_value()
        ]

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Read the environment (and ``.env``); raise :class:`ConfigError` naming the variable.

        ``overrides`` (keyword arguments named after the fields) win over both.
        """
        try:
            return cls(**overrides)
        except _FieldError as exc:
            raise ConfigError(f"{ENV_PREFIX}{exc.field.upper()}: {exc.message}") from None
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None


class _FieldError(Exception):
    """Raised by cross-field checks; pydantic lets it through unwrapped."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _present(secret: SecretStr | None) -> bool:
    return secret is not None and bool(secret.get_secret_value())


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"][:1]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            lines.append(f"{ENV_PREFIX}{field.upper()}: {message}")
        else:
            lines.append(message)
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
