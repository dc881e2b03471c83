"""Settings of the stores: Postgres, Redis, RabbitMQ."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator


class StoreSettings(BaseModel):
    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        description="Postgres (`postgresql://user@host:port/db`).",
    )
    database_schema: str = Field(
        default="public",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$",
        description="Schema of the inbox (created by `migrate` if missing).",
    )
    database_pool_size: int = Field(default=16, ge=1, le=500, description="Postgres connections per process.")
    database_batch_concurrency: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Statements of each kind (saves, claims, marks) in flight at once; requests arriving "
        "meanwhile join the next one (group commit). Lower: bigger batches, fewer commits.",
    )
    database_application_name: str = Field(
        default="evolution-ingest", max_length=63, description="The connections' name in `pg_stat_activity`."
    )
    database_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        description="Connect, pool-acquire and statement timeout; past it the webhook answers 503.",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", description="Redis (locks, seen marks, counters)."
    )
    redis_timeout_seconds: float = Field(
        default=0.5, gt=0, description="How long to wait for Redis before carrying on with Postgres alone."
    )
    rabbitmq_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        description="RabbitMQ (the broker Evolution publishes to).",
    )

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
