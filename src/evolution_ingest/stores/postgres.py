"""Postgres as every store uses it: one pool, one meaning of "unreachable", one leader at a time.

:class:`Postgres` hands out pooled connections and turns connection failures into
:class:`StoreUnavailable` (the webhook answers 503, the worker retries). A statement
that fails because of a row's data is :func:`row_level`: the batch it was in is split
(see :mod:`evolution_ingest.core.batching`) and that event alone is refused
(:class:`RowRejected`). :class:`Leadership` is a session advisory lock, for work that
one process of a deployment does at a time (the reconciler).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Final, TypeAlias

import asyncpg
import orjson
import structlog

log = structlog.get_logger(__name__)

Connection: TypeAlias = "asyncpg.Connection | asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"

#: Errors meaning "Postgres is unreachable right now", as opposed to a bad statement.
CONNECTION_ERRORS: Final = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.InsufficientResourcesError,
    # The client's own protocol state went wrong (seen when backends are terminated while
    # statements run): the connection is dropped (see ``connection``) and the step retried.
    asyncpg.exceptions.InternalClientError,
)


class StoreUnavailable(Exception):
    """Postgres cannot be reached; the caller answers 503 or retries later."""


class RowRejected(Exception):
    """Postgres refused this one event's row (its data, not the connection): a 4xx, never a retry."""

    def __init__(self, reason: str, code: str = "unstorable") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


#: SQLSTATE classes of errors caused by a row's values: data exception, integrity
#: constraint violation, program limit exceeded (an index entry too large).
_ROW_LEVEL_CLASSES: Final = frozenset({"22", "23", "54"})


def row_level(exc: BaseException) -> bool:
    """True when a batch statement failed because of (at least) one of its rows."""
    sqlstate = getattr(exc, "sqlstate", None)
    return isinstance(exc, asyncpg.PostgresError) and str(sqlstate or "")[:2] in _ROW_LEVEL_CLASSES


def where_set(clauses: list[str], args: list[Any], conditions: Iterable[tuple[str, str, Any]]) -> str:
    """A WHERE clause: ``clauses`` (extended in place) and ``column op $n`` for each (column, op,
    value) whose value is not None, joined by AND; each such value is appended to ``args``."""
    for column, op, value in conditions:
        if value is not None:
            args.append(value)
            clauses.append(f"{column} {op} ${len(args)}")
    return " AND ".join(clauses)


class Postgres:
    """The pool of a process, shared by every store; owned (and closed) by the runtime."""

    def __init__(self, pool: asyncpg.Pool, *, acquire_timeout: float = 5.0) -> None:
        self._pool = pool
        self._acquire_timeout = acquire_timeout

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        """A pooled connection; connection failures become :class:`StoreUnavailable`."""
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                try:
                    yield conn
                except asyncpg.exceptions.InternalClientError:
                    conn.terminate()  # never hand a connection in a broken state to the next user
                    raise
        except CONNECTION_ERRORS as exc:
            # One dead connection usually means all of them (a restart, terminated backends):
            # have every idle one replaced, so that the next tries do not draw them one by one.
            with contextlib.suppress(*CONNECTION_ERRORS, asyncpg.PostgresError):
                await self._pool.expire_connections()
            raise StoreUnavailable(f"Postgres unreachable: {exc!r}") from exc

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self.connection() as conn:
            return list(await conn.fetch(query, *args))

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        async with self.connection() as conn:
            return await conn.fetchrow(query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        async with self.connection() as conn:
            return await conn.fetchval(query, *args)

    async def execute(self, query: str, *args: Any) -> str:
        async with self.connection() as conn:
            return str(await conn.execute(query, *args))

    async def server_version(self) -> str:
        return str(await self.fetchval("SHOW server_version"))

    async def close(self, within: float) -> None:
        try:
            await asyncio.wait_for(self._pool.close(), within)
        except TimeoutError:
            log.warning("Postgres connections still busy at shutdown; closing them")
            self._pool.terminate()


class Leadership:
    """A session-level advisory lock held on a dedicated connection while this process leads."""

    def __init__(self, dsn: str, *, key: str, timeout: float, role: str) -> None:
        self._dsn = dsn
        self._key = key
        self._timeout = timeout
        self._role = role
        self._conn: asyncpg.Connection | None = None

    async def acquire(self) -> bool:
        """True while this process holds the lock (taking it if it is free)."""
        if self._conn is not None:
            try:
                await self._conn.fetchval("SELECT 1", timeout=self._timeout)
                return True
            except (*CONNECTION_ERRORS, asyncpg.PostgresError):
                await self.release()  # the connection died, and the lock with it
        try:
            conn = await asyncpg.connect(self._dsn, timeout=self._timeout)
        except CONNECTION_ERRORS as exc:
            raise StoreUnavailable(f"Postgres unreachable: {exc!r}") from exc
        if await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", self._key):
            self._conn = conn
            log.info(f"this process is now the active {self._role}")
            return True
        await conn.close()
        return False

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*CONNECTION_ERRORS, asyncpg.PostgresError):
                await conn.close(timeout=self._timeout)


async def init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        encoder=lambda value: value if isinstance(value, str) else orjson.dumps(value).decode(),
        decoder=orjson.loads,
        format="text",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Nothing to reset between uses: pooled connections change no session state (no SET,
    LISTEN, cursors or advisory locks), so the default reset query would be a wasted round trip.
    An open transaction is still rolled back by the pool before this is called."""


async def create_pool(
    dsn: str,
    *,
    schema: str,
    size: int,
    command_timeout: float,
    connect_timeout: float,
    application_name: str = "evolution-ingest",
) -> asyncpg.Pool:
    """A pool that connects lazily, so the app can start (and answer 503) while Postgres is down."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=0,
        max_size=size,
        command_timeout=command_timeout,
        timeout=connect_timeout,
        init=init_connection,
        reset=_keep_session,
        server_settings={
            "search_path": schema,
            "application_name": application_name,
            # Plan each execution for its arguments and the tables as they are now. A statement
            # prepared while the inbox is nearly empty otherwise keeps, after five executions, a
            # generic plan that scans the whole table (cheapest on one page), and nothing replaces
            # it until an ANALYZE: without autovacuum, or while it lags, a mark, claim or seen update
            # then costs what the inbox holds (5-13 ms per statement at 20,000 rows, growing).
            "plan_cache_mode": "force_custom_plan",
        },
    )
    assert pool is not None
    return pool
