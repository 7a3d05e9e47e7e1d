"""The SQLite adapter (the embedded default): one database file in the data folder.

One connection on one dedicated thread: every transaction is one function run
there, so transactions are serialized without locks, and concurrent ones are
group-committed (see ``_drain``): one hop off the event loop and one commit for a
whole batch. WAL journal, ``synchronous=NORMAL``, checkpoints off the commit path
(see ``_checkpoint``). Statements use the shared ``$n`` parameters of
:mod:`bourse.storage.sql`, rewritten to ``?n`` once per statement text.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from bourse.retrying import retrying
from bourse.storage.sql import IntegrityError, Row, SqlStore

T = TypeVar("T")
log = logging.getLogger("bourse.storage")
_PARAM = re.compile(r"\$(\d+)")

WAL_ATTEMPTS = 25
"""Attempts at switching a new database file to WAL while another connection holds it
(full-jitter back-off up to 0.5 s: several seconds in all)."""


class _Locked(sqlite3.OperationalError):
    """The file is locked by another connection (worth another try)."""


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
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = deque()
        self._draining = False
        # checkpoints run on their own connection and thread (see _checkpoint)
        self._checkpointer: ThreadPoolExecutor | None = None
        self._checkpoint_conn: sqlite3.Connection | None = None
        self._checkpointing = False
        self._commits = 0

    def _connect(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        conn.row_factory = sqlite3.Row
        self._conn = conn  # closed by close(), also after a failed open()
        conn.execute("PRAGMA busy_timeout=5000")

    def _use_wal(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):
                raise _Locked(str(exc)) from exc
            raise

    def _configure(self) -> None:
        conn = self._conn
        assert conn is not None
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        if self.path != ":memory:":
            # no checkpoint (and its fsyncs) inside a commit: _checkpoint does them
            conn.execute("PRAGMA wal_autocheckpoint=0")
        self._exec = _SqliteExecutor(conn, self._cache)

    async def open(self) -> None:
        pool = self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bourse-sqlite")
        if self.path != ":memory:":
            self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bourse-sqlite-wal")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool, self._connect)
        # switching a new file to WAL answers "locked" at once (no busy wait) while
        # another connection writes it (another process starting on the same file)
        async for attempt in retrying(
            attempts=WAL_ATTEMPTS,
            base_s=0.02,
            max_s=0.5,
            retry_on=_Locked,
            what="switching SQLite to WAL",
            logger=log,
        ):
            with attempt:
                await loop.run_in_executor(pool, self._use_wal)
        await loop.run_in_executor(pool, self._configure)
        await self.migrate()

    async def close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.submit(self._close_checkpoint_conn)
            checkpointer.shutdown(wait=True)
        pool, conn = self._pool, self._conn
        self._pool = self._conn = self._exec = None
        if pool is not None:
            if conn is not None:
                await asyncio.get_running_loop().run_in_executor(pool, conn.close)
            pool.shutdown(wait=True)

    # -- group commit ---------------------------------------------------------------------
    #
    # Transactions queue up on the event loop side; the database thread takes every
    # queued one at once and runs them in a single SQLite transaction, each inside its
    # own SAVEPOINT (a failing one rolls back alone; a batch of one needs none), then
    # answers them all with one wake-up of the event loop. Under load this turns N
    # thread hops and N commits into one; alone, a transaction costs what it did.

    MAX_BATCH = 256

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        if self._pool is None:
            raise RuntimeError("the SQLite store is not open")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((fn, args, fut))
        if not self._draining:
            self._draining = True
            self._pool.submit(self._drain, loop)
        return fut

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        queue = self._queue
        while True:
            batch: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
            while queue and len(batch) < self.MAX_BATCH:
                batch.append(queue.popleft())
            if not batch:
                self._draining = False
                if not queue:  # nothing arrived between the check and the flag
                    return
                self._draining = True
                continue
            results = self._run_batch(batch)
            try:
                loop.call_soon_threadsafe(_resolve, results)
            except RuntimeError:  # the loop is closed (shutdown)
                return
            self._commits += 1
            if self._commits >= self.CHECKPOINT_EVERY and not self._checkpointing:
                checkpointer = self._checkpointer
                if checkpointer is not None:
                    self._commits = 0
                    self._checkpointing = True
                    try:
                        checkpointer.submit(self._checkpoint)
                    except RuntimeError:  # shut down meanwhile
                        self._checkpointing = False

    # -- checkpoints -------------------------------------------------------------------------
    #
    # SQLite's automatic checkpoint runs inside the commit that crosses its threshold,
    # with two fsyncs: that commit, and every transaction queued behind it, waits
    # milliseconds. Here the commit thread only counts commits; every CHECKPOINT_EVERY
    # of them a PASSIVE checkpoint (it never blocks writers) runs on a second connection
    # in a second thread. Closing the last connection checkpoints what is left.

    CHECKPOINT_EVERY = 256

    def _checkpoint(self) -> None:
        try:
            conn = self._checkpoint_conn
            if conn is None:
                conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
                self._checkpoint_conn = conn
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            log.exception("WAL checkpoint failed; the next one retries")
        finally:
            self._checkpointing = False

    def _close_checkpoint_conn(self) -> None:
        conn, self._checkpoint_conn = self._checkpoint_conn, None
        if conn is not None:
            conn.close()

    def _run_batch(
        self, batch: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]]
    ) -> list[Any]:
        conn, ex = self._conn, self._exec
        assert conn is not None and ex is not None
        out: list[tuple[asyncio.Future[Any], bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return [(fut, False, exc) for _, _, fut in batch]
        if len(batch) == 1:  # alone (no load): its own transaction, no savepoint
            fn, args, fut = batch[0]
            try:
                value = fn(ex, *args)
            except Exception as exc:
                conn.execute("ROLLBACK")
                return [(fut, False, exc)]
            out.append((fut, True, value))
            batch = []
        for fn, args, fut in batch:
            conn.execute("SAVEPOINT op")
            try:
                value = fn(ex, *args)
            except Exception as exc:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                out.append((fut, False, exc))
                continue
            conn.execute("RELEASE op")
            out.append((fut, True, value))
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            conn.execute("ROLLBACK")
            return [(fut, False, exc) for fut, _, _ in out]
        return out

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        result: T = await self._submit(fn, args)
        return result

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        result: T = await self._submit(fn, args)
        return result


def _resolve(results: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for fut, ok, value in results:
        if fut.done():  # the caller was cancelled; its transaction stands
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
