"""Settings of the RabbitMQ channel: which queues, how fast, and how forwards reach the webhook app."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from evolution_ingest.config.base import CsvList, FieldError, ForwardMode, RabbitMode, split_csv
from evolution_ingest.core.identity import EMITTED_EVENTS, normalize_event_name


class RabbitSettings(BaseModel):
    rabbitmq_mode: RabbitMode = Field(
        default=RabbitMode.GLOBAL,
        description="`global`, `instance` or `own`: which queues the worker consumes (docs/rabbitmq.md).",
    )
    rabbitmq_exchange: str = Field(
        default="evolution_exchange", min_length=1, description="Evolution's `RABBITMQ_EXCHANGE_NAME`."
    )
    rabbitmq_prefix: str = Field(
        default="evolution",
        description="Evolution's `RABBITMQ_PREFIX_KEY` (empty when Evolution has none: its queues are then named after the event).",
    )
    rabbitmq_instances: CsvList = Field(
        default_factory=list,
        description="Instances whose exchanges and queues to consume (`instance` mode), comma-separated.",
    )
    rabbitmq_events: CsvList = Field(
        default_factory=lambda: list(EMITTED_EVENTS),
        description="Events to consume (`messages.upsert,connection.update`; `MESSAGES_UPSERT` works too).",
        json_schema_extra={"shown_default": "every event Evolution emits"},
    )
    rabbitmq_queue: str = Field(
        default="evolution-ingest.events", min_length=1, description="The service's own queue (`own` mode)."
    )
    rabbitmq_service_prefix: str = Field(
        default="evolution-ingest",
        min_length=1,
        description="Prefix of the service's retry, lock-busy, ready and parking queues.",
    )
    rabbitmq_prefetch: int = Field(
        default=32, ge=1, le=10_000, description="Unacknowledged messages per consumed queue."
    )
    worker_concurrency: int = Field(
        default=64, ge=1, le=10_000, description="Messages processed at once by one worker."
    )
    retry_delays_seconds: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 30.0, 180.0],
        description="Delay of each retry tier after a failed forward; after the last, the parking queue.",
    )
    lock_busy_delay_seconds: float = Field(
        default=2.0,
        gt=0,
        description="How long a message whose event is being processed elsewhere waits before it comes back.",
    )
    lock_busy_wait_seconds: float = Field(
        default=5.0,
        ge=0,
        description="A copy whose event is being processed in this same process (`up`) waits for it this long "
        "instead of taking the lock-busy queue.",
    )
    lock_busy_max_returns: int = Field(
        default=30,
        ge=0,
        description="Returns after which a locked message is acked anyway (it is saved; the reconciler finishes it).",
    )
    forward_url: str | None = Field(
        default=None,
        description="Where saved events are forwarded (worker, reconciler, replay).",
        json_schema_extra={"shown_default": "http://<HOST>:<PORT>/api/internal/webhook"},
    )
    forward_mode: ForwardMode = Field(
        default=ForwardMode.AUTO,
        description="`auto`: in-process when the webhook app runs in the same process (`up`), HTTP otherwise; `http`: always HTTP.",
    )
    forward_timeout_seconds: float = Field(
        default=30.0, gt=0, description="A forward slower than this fails (the next retry tier)."
    )
    forward_batch_max: int = Field(
        default=64,
        ge=1,
        le=1_000,
        description="Forwards made together go in one request, at most this many (each answered as it ends); "
        "1: one request per forward.",
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, gt=0, description="How long a stopping process waits for work in flight."
    )
    rabbitmq_watchdog_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How often the worker checks that its consumers are registered on the broker.",
    )

    @field_validator("rabbitmq_instances", "rabbitmq_events", mode="before")
    @classmethod
    def _rabbit_csv(cls, value: Any) -> Any:
        return split_csv(value)

    @field_validator("retry_delays_seconds", mode="before")
    @classmethod
    def _rabbit_csv_delays(cls, value: Any) -> Any:
        return split_csv(value)

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

    @model_validator(mode="after")
    def _instances_for_instance_mode(self) -> RabbitSettings:
        if self.rabbitmq_mode is RabbitMode.INSTANCE and not self.rabbitmq_instances:
            raise FieldError("rabbitmq_instances", "required by RABBITMQ_MODE instance")
        return self
