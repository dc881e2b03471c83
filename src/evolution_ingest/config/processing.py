"""Settings of what happens to an event once saved: business logic, its timings, the reconciler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from evolution_ingest.config.base import CsvList, split_csv


class ProcessingSettings(BaseModel):
    handlers: CsvList = Field(
        default_factory=list,
        description="Business logic: `pkg.module:function,...`.",
        json_schema_extra={"shown_default": "the built-in log line (none when routes are set)"},
    )
    routes_file: Path | None = Field(
        default=None,
        description="Built-in routing from a YAML or TOML file: forward, drop, alert (docs/routes.md).",
    )
    lock_ttl_seconds: float = Field(
        default=120,
        gt=0,
        description="Redis lock and Postgres row claim lease (renewed while a handler runs).",
    )
    seen_ttl_seconds: float = Field(
        default=3600, gt=0, description="How long Redis remembers that an event was saved / processed."
    )
    metrics_flush_seconds: float = Field(
        default=1.0, gt=0, description="How often counters are flushed to Redis."
    )
    reconcile_interval_seconds: float = Field(
        default=300.0, gt=0, description="How often the reconciler looks for saved, unprocessed events."
    )
    reconcile_after_seconds: float = Field(
        default=120.0,
        ge=0,
        description="Age after which a saved, unprocessed event is stuck (the reconciler re-forwards it).",
    )
    reconcile_batch_size: int = Field(
        default=200, ge=1, le=10_000, description="Rows read per query, oldest first."
    )
    reconcile_concurrency: int = Field(
        default=8, ge=1, le=1_000, description="Re-forwards in flight at once during a pass."
    )
    reconcile_max_per_pass: int = Field(
        default=10_000, ge=1, description="Rows handled at most in one pass (the next pass goes on)."
    )
    reconcile_max_attempts: int = Field(
        default=10,
        ge=1,
        description="Business-logic attempts after which an event is marked failed; only a replay retries it.",
    )
    identity_v1_compat_seconds: float = Field(
        default=7 * 86_400.0,
        ge=0,
        description="After the upgrade to message keys of version 2, how long a copy of a message is also matched "
        "against its version-1 key (only when the inbox held version-1 rows; docs/how-it-works.md).",
    )
    purge_min_age_seconds: float = Field(
        default=86_400.0,
        ge=0,
        description="`purge` refuses a shorter age unless `--force` (or `--payload-only`): it must outlast Evolution's ~20 min of retries.",
    )

    @field_validator("handlers", mode="before")
    @classmethod
    def _processing_csv(cls, value: Any) -> Any:
        return split_csv(value)

    @field_validator("handlers")
    @classmethod
    def _handler_specs(cls, value: list[str]) -> list[str]:
        for spec in value:
            module, sep, attr = spec.partition(":")
            if not sep or not module or not attr:
                raise ValueError(f"{spec!r} is not of the form 'package.module:function'")
        return value
