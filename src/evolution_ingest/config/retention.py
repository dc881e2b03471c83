"""Settings of retention: how long bodies and rows stay in the inbox, and how they leave."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, Field, model_validator

from evolution_ingest.config.base import FieldError

#: Evolution re-sends a webhook for ~20 minutes and a RabbitMQ message may wait in its queue for
#: as long as this service is down: a day is the least that keeps every copy a duplicate.
SAFE_HORIZON_SECONDS: Final = 86_400.0


class RetentionSettings(BaseModel):
    retention_enabled: bool = Field(
        default=True,
        description="Remove old bodies and rows automatically (one active process across replicas; "
        "docs/retention.md). Off: the inbox grows until `purge` is run.",
    )
    retention_bodies_seconds: float = Field(
        default=7 * 86_400.0,
        gt=0,
        description="How long a stored body is kept: a day's partition of bodies is dropped once all of it is "
        "older. Bodies of unprocessed or failed events are kept, whatever their age.",
    )
    retention_rows_seconds: float = Field(
        default=14 * 86_400.0,
        gt=0,
        description="How long an event's row (its dedup key and state) is kept after it was received and "
        "processed: the dedup horizon. A copy arriving later runs again. Unprocessed or failed rows are kept.",
    )
    retention_partition_seconds: float = Field(
        default=86_400.0,
        ge=1,
        description="The span of one partition of bodies (the step in which bodies leave). A partition's files "
        "are freed at once, slowing every commit meanwhile (~0.2 s per GB on a test machine): at high rates, a "
        "shorter span (docs/retention.md).",
    )
    retention_interval_seconds: float = Field(
        default=300.0, gt=0, description="How often the active process applies retention."
    )
    retention_batch_size: int = Field(
        default=5_000, ge=1, le=100_000, description="Rows deleted (or bodies emptied) per statement."
    )
    retention_batch_pause_seconds: float = Field(
        default=0.05,
        ge=0,
        description="Pause between two batches, and at least twice the last batch's time, so that ingestion "
        "keeps the upper hand (retention takes a third of Postgres at most).",
    )
    retention_strip_media: bool = Field(
        default=False,
        description="Remove a body's base64 media (`data.message.base64`, sent with WEBHOOK_BASE64) once its "
        "business logic ran: a replay then runs without them.",
    )

    @model_validator(mode="after")
    def _bodies_within_rows(self) -> RetentionSettings:
        if self.retention_bodies_seconds > self.retention_rows_seconds:
            raise FieldError(
                "retention_bodies_seconds",
                "must not exceed RETENTION_ROWS_SECONDS (a body without its row is never read)",
            )
        return self
