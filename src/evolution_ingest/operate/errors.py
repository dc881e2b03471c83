"""The errors of the stores, which an operator's view shows in its section instead of failing."""

from __future__ import annotations

from typing import Any, Final

import asyncpg
from redis.exceptions import RedisError

from evolution_ingest.stores.postgres import StoreUnavailable
from evolution_ingest.stores.queues import BROKER_ERRORS

#: A store that cannot answer right now (or a schema not migrated yet): shown, never raised.
STORE_ERRORS: Final = (StoreUnavailable, asyncpg.PostgresError, RedisError, *BROKER_ERRORS)


def failed(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
