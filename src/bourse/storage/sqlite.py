"""The SQLite adapter (the embedded default): one database file in the data folder.

One connection, WAL journal, transactions serialized by an asyncio lock and opened
with ``BEGIN IMMEDIATE`` so a write never fails half-way on a lock. Statements use
the shared ``$n`` parameters of :mod:`bourse.storage.sql`, rewritten to ``?n``.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite

from bourse.storage.sql import Executor, IntegrityError, Row, SqlStore

_PARAM = re.compile(r"\$(\d+)")


class _SqliteExecutor:
    __slots__ = ("_cache", "_conn")

    def __init__(self, conn: aiosqlite.Connection, cache: dict[str, str]) -> None:
        self._conn = conn
        self._cache = cache

    def _sql(self, sql: str) -> str:
        out = self._cache.get(sql)
        if out is None:
            out = self._cache[sql] = _PARAM.sub(r"?\1", sql)
        return out

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            async with self._conn.execute(self._sql(sql), args) as cur:
                return list(await cur.fetchall())  # type: ignore[arg-type]
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        try:
            async with self._conn.execute(self._sql(sql), args) as cur:
                row = await cur.fetchone()
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None
        return row  # type: ignore[return-value]

    async def execute(self, sql: str, *args: Any) -> int:
        try:
            async with self._conn.execute(self._sql(sql), args) as cur:
                return cur.rowcount
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None


class SqliteStore(SqlStore):
    """Every storage port on one SQLite file."""

    single_node = True

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()
        self._cache: dict[str, str] = {}

    async def open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        conn.row_factory = sqlite3.Row
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute("PRAGMA synchronous=NORMAL")
        await conn.execute("PRAGMA foreign_keys=ON")
        await conn.execute("PRAGMA busy_timeout=5000")
        self._conn = conn
        await self.migrate()

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    def _db(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise RuntimeError("the SQLite store is not open")
        return self._conn

    @asynccontextmanager
    async def tx(self) -> AsyncIterator[Executor]:
        conn = self._db()
        async with self._lock:
            await conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteExecutor(conn, self._cache)
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
            else:
                await conn.execute("COMMIT")

    @asynccontextmanager
    async def read(self) -> AsyncIterator[Executor]:
        conn = self._db()
        async with self._lock:
            yield _SqliteExecutor(conn, self._cache)
