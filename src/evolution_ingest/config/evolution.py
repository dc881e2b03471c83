"""Settings of talking to Evolution API itself: its REST API (``connect``, ``check``, backfill)."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr, field_validator


class EvolutionSettings(BaseModel):
    evolution_url: str | None = Field(
        default=None,
        description="Evolution API's base URL (`http://evolution:8080`): `connect` sets its webhooks and RabbitMQ "
        "events, `check` compares them, backfill reads its stored messages.",
    )
    evolution_api_key: SecretStr | None = Field(
        default=None,
        description="Evolution's global API key (its `AUTHENTICATION_API_KEY`); never logged or shown.",
    )
    evolution_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Timeout of one call to Evolution's REST API."
    )
    webhook_public_url: str | None = Field(
        default=None,
        description="Where Evolution reaches this service's webhook app (`http://ingest:8080`); `connect` puts it in "
        "the webhooks it sets.",
        json_schema_extra={"shown_default": "http://<HOST>:<PORT>"},
    )
    webhook_base64: bool = Field(
        default=False,
        description="`connect` asks Evolution for media in base64 inside the webhook bodies (large bodies).",
    )
    connect_wait_seconds: float = Field(
        default=120.0,
        ge=0,
        description="How long `connect` waits for each instance to deliver on both channels (0: do not wait).",
    )

    backfill_enabled: bool = Field(
        default=True,
        description="With `EVOLUTION_URL` set, backfill runs by itself: at start-up, every `BACKFILL_INTERVAL_SECONDS`, "
        "and for an instance whose channels both fell silent (docs/backfill.md).",
    )
    backfill_interval_seconds: float = Field(
        default=900.0, gt=0, description="How often the scheduled backfill runs."
    )
    backfill_overlap_seconds: float = Field(
        default=600.0,
        ge=0,
        description="How far a scheduled backfill's window reaches back before the previous one's end.",
    )
    backfill_settle_seconds: float = Field(
        default=120.0,
        ge=0,
        description="Stored messages younger than this are left to the channels (their copies may still be on the way).",
    )
    backfill_max_window_seconds: float = Field(
        default=7 * 86_400.0,
        gt=0,
        description="The longest window a backfill reads (at start-up after a long absence).",
    )
    backfill_page_size: int = Field(
        default=100,
        ge=1,
        le=1000,
        description="Stored messages per `findMessages` page (Evolution's `offset`).",
    )
    backfill_concurrency: int = Field(
        default=2,
        ge=1,
        le=32,
        description="Instances backfilled at once (each reads its pages one after another).",
    )
    instance_poll_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How often Evolution's `connectionState` of each instance is read (with `EVOLUTION_URL`).",
    )
    instance_down_alert_seconds: float = Field(
        default=600.0,
        gt=0,
        description="An instance away from `open` this long raises an alert (a logged-out one at once).",
    )

    @field_validator("evolution_url", "webhook_public_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/") if value else value
