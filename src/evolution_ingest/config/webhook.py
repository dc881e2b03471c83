"""Settings of the webhook app: where it listens, who may call it, what it keeps of a body."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from evolution_ingest.config.base import CsvList, FieldError, WebhookAuth, present, split_csv


class WebhookSettings(BaseModel):
    host: str = Field(
        default="127.0.0.1", description="Where the webhook app listens (`0.0.0.0` to accept other hosts)."
    )
    port: int = Field(default=8080, ge=0, le=65535, description="The webhook app's port.")
    internal_secret: SecretStr | None = Field(
        default=None,
        description="Shared by the worker, reconciler and webhook app for forwards (`already_saved`); "
        "forwards are refused until it is set (`up` makes one per run).",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Larger bodies get 422 (media in base64 fits the default).",
    )
    max_json_keys: int = Field(
        default=2_000_000, ge=10, description="More object keys in one body get 422 (a JSON bomb guard)."
    )
    retry_after_seconds: int = Field(
        default=5, ge=1, description="`Retry-After` of a 503 (Postgres unreachable)."
    )
    webhook_auth: CsvList = Field(
        default_factory=lambda: [WebhookAuth.NONE.value],
        description="How Evolution's calls are checked: `url_token`, `header`, `jwt`, `apikey` (comma-separated: any passes) or `none`.",
    )
    webhook_token: SecretStr | None = Field(
        default=None, description="The token of `url_token` and `header`."
    )
    webhook_token_header: str = Field(default="x-webhook-token", description="The header of `header`.")
    webhook_jwt_key: SecretStr | None = Field(default=None, description="Evolution's `jwt_key` (for `jwt`).")
    webhook_jwt_leeway_seconds: float = Field(
        default=1800,
        ge=0,
        description="Accepted past a JWT's expiry: Evolution signs one token per event (10 min) and retries for ~20 min.",
    )
    webhook_apikeys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Accepted instance `apikey`s (for `apikey`), comma-separated."
    )
    migrate_on_start: bool = Field(
        default=False, description="`serve` applies migrations first (`up` always does)."
    )
    keep_apikey: bool = Field(
        default=False,
        description="Keep the instance `apikey` in stored bodies (and `Event.payload`); it is `[redacted]` otherwise.",
    )
    refusal_max_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="Refused bodies are kept up to this size (cut beyond: shown, not replayable).",
    )
    refusals_keep: int = Field(
        default=10_000, ge=1, description="Refused bodies kept; the oldest are dropped past it."
    )

    @field_validator("webhook_auth", mode="before")
    @classmethod
    def _webhook_csv(cls, value: Any) -> Any:
        return split_csv(value)

    @field_validator("webhook_apikeys", mode="before")
    @classmethod
    def _webhook_csv_keys(cls, value: Any) -> Any:
        return split_csv(value)

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

    @model_validator(mode="after")
    def _auth_needs_secrets(self) -> WebhookSettings:
        modes = set(self.webhook_auth)
        if modes & {WebhookAuth.URL_TOKEN, WebhookAuth.HEADER} and not present(self.webhook_token):
            raise FieldError("webhook_token", "required by WEBHOOK_AUTH url_token/header")
        if WebhookAuth.JWT in modes and not present(self.webhook_jwt_key):
            raise FieldError("webhook_jwt_key", "required by WEBHOOK_AUTH jwt")
        if WebhookAuth.APIKEY in modes and not self.webhook_apikeys:
            raise FieldError("webhook_apikeys", "required by WEBHOOK_AUTH apikey")
        return self

    @property
    def auth_methods(self) -> frozenset[WebhookAuth]:
        return frozenset(WebhookAuth(mode) for mode in self.webhook_auth) - {WebhookAuth.NONE}
