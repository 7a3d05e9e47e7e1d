"""The SQLite adapter (the embedded default): one database file in the data folder.

One connection on one dedicated thread: every transaction is one function run
there (``BEGIN IMMEDIATE`` … ``COMMIT``), so a ledger change costs one hop off the
event loop and transactions are serialized without locks. WAL journal,
``synchronous=NORMAL``. Statements use the shared ``$n`` parameters of
:mod:`bourse.storage.sql`, rewritten to ``?n`` once per statement text.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from bourse.storage.sql import IntegrityError, Row, SqlStore

T = TypeVar("T")
_PARAM = re.compile(r"\$(\d+)")


class _SqliteExecutor:
    __slots__ = ("_cache", "_conn")

    def __init__(self, conn: sqlite3.Connection, cache: dict[str, str]) -> None:
        self._conn = conn
        self._cache = cache

    def _sql(self, sql: str) -> str:
        out = self._cache.get(sql)
        if out is None:
            out = self._cache[sql] = _PARAM.sub(r"?\1", sql)
        return out

    def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            return self._conn.execute(self._sql(sql), args).fetchall()
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None

    def fetchrow(self, sql: str, *args: Any) -> Row | None:
        try:
            row: Row | None = self._conn.execute(self._sql(sql), args).fetchone()
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None
        return row

    def execute(self, sql: str, *args: Any) -> int:
        try:
            return self._conn.execute(self._sql(sql), args).rowcount
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None


class SqliteStore(SqlStore):
    """Every storage port on one SQLite file."""

    single_node = True

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._pool: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._exec: _SqliteExecutor | None = None
        self._cache: dict[str, str] = {}

    def _connect(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=5000")
            # switching a new file to WAL answers "locked" at once (no busy wait)
            # while another connection writes it: retry until a deadline
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._exec = _SqliteExecutor(conn, self._cache)

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bourse-sqlite")
        await asyncio.get_running_loop().run_in_executor(self._pool, self._connect)
        await self.migrate()

    async def close(self) -> None:
        pool, conn = self._pool, self._conn
        self._pool = self._conn = self._exec = None
        if pool is not None:
            if conn is not None:
                await asyncio.get_running_loop().run_in_executor(pool, conn.close)
            pool.shutdown(wait=True)

    def _tx(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn, ex = self._conn, self._exec
        assert conn is not None and ex is not None
        conn.execute("BEGIN IMMEDIATE")
        try:
            out = fn(ex, *args)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return out

    def _plain(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        assert self._exec is not None
        return fn(self._exec, *args)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("the SQLite store is not open")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._tx, fn, args)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("the SQLite store is not open")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._plain, fn, args)
