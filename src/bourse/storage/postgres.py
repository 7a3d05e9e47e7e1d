"""The PostgreSQL adapter: a shared database for several gateway replicas.

psycopg (3) connections, one per worker thread of a small pool: every transaction
is one function run on a worker (one hop off the event loop), its statements on
that thread's connection. Holds are owned by gateway instances with leases
(``instances``), so a replica's orphaned holds are found by the others once its
lease lapses. A broken connection is replaced and the transaction retried once; a
connection failure that remains is :class:`~bourse.ports.stores.StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from bourse.ports.stores import StoreUnavailable
from bourse.storage.sql import IntegrityError, Row, SqlStore

T = TypeVar("T")
_PARAM = re.compile(r"\$(\d+)")


class _PgExecutor:
    __slots__ = ("_cache", "_conn")

    def __init__(self, conn: psycopg.Connection[Any], cache: dict[str, str]) -> None:
        self._conn = conn
        self._cache = cache

    def _sql(self, sql: str) -> str:
        out = self._cache.get(sql)
        if out is None:
            out = self._cache[sql] = _PARAM.sub(r"%(p\1)s", sql)
        return out

    @staticmethod
    def _args(args: tuple[Any, ...]) -> dict[str, Any]:
        return {f"p{i}": v for i, v in enumerate(args, 1)}

    def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            return self._conn.execute(self._sql(sql), self._args(args)).fetchall()
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None

    def fetchrow(self, sql: str, *args: Any) -> Row | None:
        try:
            row: Row | None = self._conn.execute(self._sql(sql), self._args(args)).fetchone()
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None
        return row

    def execute(self, sql: str, *args: Any) -> int:
        try:
            return self._conn.execute(self._sql(sql), self._args(args) if args else None).rowcount
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None


class PostgresStore(SqlStore):
    """Every storage port on one PostgreSQL database."""

    single_node = False
    migration_lock_sql = "SELECT pg_advisory_xact_lock(7243001)"

    def __init__(self, dsn: str, *, max_size: int = 8, min_size: int = 0) -> None:
        self.dsn = dsn
        self._size = max(1, max_size)
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._conns: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._cache: dict[str, str] = {}

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row, connect_timeout=10)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _tx(self, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> T:
        for attempt in (1, 2):
            conn = self._conn()
            try:
                ex = _PgExecutor(conn, self._cache)
                if not write:
                    return fn(ex, *args)
                with conn.transaction():
                    return fn(ex, *args)
            except psycopg.OperationalError:
                if attempt == 2 or not conn.closed:
                    raise
                self._local.conn = None  # the server went away: reconnect and retry once
        raise AssertionError("unreachable")

    async def open(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix="bourse-pg")
        await self.migrate()

    async def close(self) -> None:
        pool = self._pool
        self._pool = None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("the PostgreSQL store is not open")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._tx, fn, args, True)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL: {exc}") from exc

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("the PostgreSQL store is not open")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._tx, fn, args, False)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL: {exc}") from exc
