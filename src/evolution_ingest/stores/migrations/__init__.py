"""Versioned schema migrations: plain SQL files applied in order, once each.

``NNNN_name.sql`` files in this package are applied inside one transaction each,
under a Postgres advisory lock so that replicas starting together do not race,
and recorded in ``evolution_ingest_migrations`` with a checksum. Running
``migrate`` again is a no-op.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import Final, TypeAlias

import asyncpg

MIGRATIONS_TABLE: Final = "evolution_ingest_migrations"
_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class MigrationState:
    applied: list[int]
    pending: list[Migration]
    #: Applied migrations whose file changed since (a sign of a hand-edited release).
    modified: list[int]

    @property
    def current(self) -> bool:
        return not self.pending


def available() -> list[Migration]:
    """Every migration shipped with this version, in order."""
    found = []
    for entry in resources.files(__package__).iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return sorted(found, key=lambda m: m.version)


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


Connection: TypeAlias = "asyncpg.Connection | asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"


async def state(conn: Connection, schema: str) -> MigrationState:
    """What is applied in ``schema`` and what is still to do (no changes made)."""
    exists = await conn.fetchval("SELECT to_regclass($1)", f"{_quote(schema)}.{MIGRATIONS_TABLE}")
    rows = (
        await conn.fetch(
            f"SELECT version, checksum FROM {_quote(schema)}.{MIGRATIONS_TABLE} ORDER BY version"
        )
        if exists
        else []
    )
    done = {row["version"]: row["checksum"] for row in rows}
    shipped = available()
    return MigrationState(
        applied=sorted(done),
        pending=[m for m in shipped if m.version not in done],
        modified=[m.version for m in shipped if m.version in done and done[m.version] != m.checksum],
    )


async def migrate(conn: Connection, schema: str, *, upto: int | None = None) -> list[Migration]:
    """Apply the pending migrations to ``schema`` (those up to version ``upto`` if given);
    return those applied now."""
    lock_key = f"evolution_ingest:migrate:{schema}"
    await conn.execute("SELECT pg_advisory_lock(hashtext($1))", lock_key)
    try:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {_quote(schema)}")
        await conn.execute(
            f"""CREATE TABLE IF NOT EXISTS {_quote(schema)}.{MIGRATIONS_TABLE} (
                    version    integer PRIMARY KEY,
                    name       text        NOT NULL,
                    checksum   text        NOT NULL,
                    applied_at timestamptz NOT NULL DEFAULT now()
                )"""
        )
        applied = []
        for migration in (await state(conn, schema)).pending:
            if upto is not None and migration.version > upto:
                break
            async with conn.transaction():
                await conn.execute(f"SET LOCAL search_path TO {_quote(schema)}")
                await conn.execute(migration.sql)
                await conn.execute(
                    f"INSERT INTO {_quote(schema)}.{MIGRATIONS_TABLE} (version, name, checksum)"
                    " VALUES ($1, $2, $3)",
                    migration.version,
                    migration.name,
                    migration.checksum,
                )
            applied.append(migration)
        return applied
    finally:
        await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", lock_key)
