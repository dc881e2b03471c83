"""Settings of operating the service: counters, logs, metrics, readiness, coverage and gap alerts, dashboard."""

from __future__ import annotations

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, Field, SecretStr, field_validator

from evolution_ingest.config.base import LogFormat


class OperatingSettings(BaseModel):
    metrics_prefix: str = Field(default="ps:metrics:evolution:", description="Prefix of the Redis counters.")
    redis_key_prefix: str = Field(
        default="evolution-ingest:",
        description="Prefix of the service's other Redis keys (locks, seen marks).",
    )
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    log_format: LogFormat = Field(
        default=LogFormat.AUTO,
        description="`json` (one object per line), `text`, or `auto` (text on a terminal).",
    )
    log_outcomes: bool = Field(
        default=True,
        description=(
            "One `outcome` line per webhook call and RabbitMQ delivery (at DEBUG when `false`). "
            "At full speed they cost 3 to 10 % of the rate carried, below it little (docs/monitoring.md)."
        ),
    )
    evolution_timezone: str = Field(
        default="UTC",
        description="Evolution's time zone: its `date_time` is local time labelled `Z` (end-to-end latency).",
    )
    metrics_cache_seconds: float = Field(
        default=2.0,
        ge=0,
        description="`/metrics` and the dashboard read Postgres and RabbitMQ at most this often.",
    )
    ready_cache_seconds: float = Field(
        default=1.0, ge=0, description="`/readyz` checks the stores at most this often."
    )
    gap_alert_after_seconds: float = Field(
        default=300.0,
        gt=0,
        description="A channel silent this long for an instance while the other delivers raises a gap alert.",
    )
    gap_check_interval_seconds: float = Field(
        default=30.0, gt=0, description="How often the gap watcher (in `up` and `reconcile`) looks."
    )
    gap_alert_webhook_url: str | None = Field(
        default=None,
        description='Gap alerts are posted here as `{"text", "content"}` (Slack, Discord...), else to the routes\' '
        "`alert_webhook_url`; always logged.",
    )
    coverage_window_seconds: float = Field(
        default=3600.0, gt=0, description="The coverage figures count the events received in this window."
    )
    coverage_settle_seconds: float = Field(
        default=60.0, ge=0, description="...leaving out the youngest (their other copy may be on its way)."
    )
    dashboard_token: SecretStr | None = Field(
        default=None,
        description="Turns `/dashboard` on; the token is the basic-auth password (any user name) or a Bearer token.",
    )

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
