"""The PostgreSQL adapter: a shared database for several gateway replicas.

An asyncpg pool; each ledger change is one transaction on one pooled connection.
Holds are owned by gateway instances with leases (``instances``), so a replica's
orphaned holds are found by the others once its lease lapses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from bourse.storage.sql import Executor, IntegrityError, Row, SqlStore


def _count(status: str) -> int:
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class _PgExecutor:
    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            return list(await self._conn.fetch(sql, *args))
        except asyncpg.IntegrityConstraintViolationError as exc:
            raise IntegrityError(str(exc)) from None

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        try:
            row: Row | None = await self._conn.fetchrow(sql, *args)
        except asyncpg.IntegrityConstraintViolationError as exc:
            raise IntegrityError(str(exc)) from None
        return row

    async def execute(self, sql: str, *args: Any) -> int:
        try:
            status: str = await self._conn.execute(sql, *args)
        except asyncpg.IntegrityConstraintViolationError as exc:
            raise IntegrityError(str(exc)) from None
        return _count(status)


class PostgresStore(SqlStore):
    """Every storage port on one PostgreSQL database."""

    single_node = False

    def __init__(self, dsn: str, *, min_size: int = 2, max_size: int = 20) -> None:
        self.dsn = dsn
        self._pool: Any = None
        self._min = min_size
        self._max = max_size

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=self._min, max_size=self._max)
        await self.migrate()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def _p(self) -> Any:
        if self._pool is None:
            raise RuntimeError("the PostgreSQL store is not open")
        return self._pool

    @asynccontextmanager
    async def tx(self) -> AsyncIterator[Executor]:
        async with self._p().acquire() as conn, conn.transaction():
            yield _PgExecutor(conn)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[Executor]:
        async with self._p().acquire() as conn:
            yield _PgExecutor(conn)
