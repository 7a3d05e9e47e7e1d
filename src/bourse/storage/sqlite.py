"""The SQLite adapter (the embedded default): one database file in the data folder.

One connection on one dedicated thread: every transaction is one function run
there, serialized, and concurrent ones are group-committed (see ``_serve``): one hop
off the event loop and one commit for a whole batch. A lone hold or close, with
nothing handed to that thread, runs on the loop's thread instead, under the same lock
(``_run_small``, :mod:`bourse.storage.inline`). The database files are the owner's only (0600). WAL journal, ``synchronous=NORMAL``, checkpoints off the commit path and a WAL kept
bounded (see ``_checkpoint``). Statements use the shared ``$n`` parameters
(:mod:`bourse.storage.executor`), rewritten to ``?n`` once per statement text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from bourse.ports.stores import StoreUnavailable
from bourse.retrying import retrying
from bourse.storage.executor import IntegrityError, Row
from bourse.storage.inline import InlineGate, running_loop
from bourse.storage.private import narrow_files, private_file
from bourse.storage.sql import SqlStore
from bourse.storage.sqlite_errors import unavailable_as_such

T = TypeVar("T")
log = logging.getLogger("bourse.storage")
_PARAM = re.compile(r"\$(\d+)")
STATEMENTS_CACHED = 1024
"""Compiled statements the connection keeps (Python's default is 128). A batch of
ledger writes is one statement per size (up to 128 rows, for the holds, the closes and
their usage records), so under load the default cache was refilled all the time and
each statement compiled again: ~2 % of the instructions per request at 64 connections.
SQLite's compiler looks up each ``?n`` by a linear scan, so a long one costs much."""
PAGE_SIZE = 512
"""The page size of a new database file (SQLite's default is 4096; 512 is its least). A
commit logs every page it touched, whole, to the WAL, and the checkpoint writes it
again: a request's hold and settle, one at a time, touch ~22 pages (each table and
index they change, in two commits), so the page, not the row, is what a request costs
on disk. bench/disk.py, the gateway's bytes written a request at c=1 and c=32: 89 and
85 KB at 4 KiB, 24 and 6 KB at 1 KiB, 14 and 4 KB at 512 bytes (with the indexes of
migration 0017 and time-ordered ids; docs/design.md). The ledger's CPU a request is the
same at each (bench/ledger.py); a large value (a stored response) spans more overflow
pages. An existing file keeps the page size it was made with."""
WAL_ATTEMPTS = 25
"""Tries to switch a new file to WAL while another process writes it (about 10 s)."""


_Item = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]
"""A transaction for the commit thread: its function, arguments and future."""
_Result = tuple["asyncio.Future[Any]", bool, Any]
"""A transaction's answer: its future, whether it succeeded, its value or exception."""


class _Locked(sqlite3.OperationalError):
    """The file is locked by another connection (retried)."""


class _RolledBack(Exception):
    """SQLite ended the batch's transaction itself when one of its functions failed."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _SqliteExecutor:
    __slots__ = ("_cache", "_conn")

    # one process owns the file: the database's clock is this process's (julianday('now')
    # reads the system clock, to the millisecond, once per statement)
    clock = "((julianday('now') - 2440587.5) * 86400.0)"

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

    def __init__(self, path: str | Path, *, unavailable_timeout_s: float = 5.0) -> None:
        self.path = str(path)
        self.unavailable_timeout_s = unavailable_timeout_s
        """How long a transaction waits for a file another connection has locked (SQLite's
        busy timeout) before it is :class:`StoreUnavailable` (``[storage]
        unavailable_timeout_s``); a full or failing disk answers at once."""
        self._pool: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._exec: _SqliteExecutor | None = None
        self._cache: dict[str, str] = {}
        self._inbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        """Transactions for the commit thread (None: stop), in the order they came."""
        self._committer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # checkpoints run on their own connection and thread (see _checkpoint)
        self._checkpointer: threading.Thread | None = None
        self._checkpoint_conn: sqlite3.Connection | None = None
        self._ckpt_wake = threading.Event()
        self._ckpt_stop = False
        self._commits = 0
        self._unsized = 0
        """Writes committed since the WAL's size was last read (a stat: every SIZE_EVERY
        writes, not every commit; ~5 µs a request on this thread, and a GIL hand-off)."""
        self._dirty = False
        """Commits since the WAL was last reset."""
        self._last_commit = 0.0
        """When (monotonic) a batch last changed a row (``total_changes``): reads and empty
        sweeps do not count."""
        self._wake_at = self.WAL_STEP_BYTES
        """WAL size at which the commit thread next wakes the checkpoint thread."""
        self._frame_size = 0
        self._pass_done = threading.Event()
        self._readers_block_reset = False
        """The last reset gave up (another process reads the WAL): commits do not wait."""
        self._writers = threading.Event()
        """Clear while a WAL reset holds the commit thread."""
        self._writers.set()
        self._batch_lock = threading.Lock()
        """Held by the commit thread while it runs a batch."""
        self.longest_reset_s = 0.0
        self._pending = 0
        """Transactions handed to the commit thread and not answered yet (the loop's count)."""
        self._gate = InlineGate()
        self.inline_runs = 0
        """Small transactions run on the event loop's thread (see ``_run_small``)."""
        """The longest time a WAL reset held the commit thread (for tests and reports)."""

    def _connect(self) -> None:
        if self.path != ":memory:":
            # owner-only: SQLite gives the -wal and -shm files the database file's mode
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            private_file(Path(self.path))
            narrow_files(Path(self.path + "-wal"), Path(self.path + "-shm"))
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=self.unavailable_timeout_s,
            cached_statements=STATEMENTS_CACHED,
        )  # fmt: skip
        conn.row_factory = sqlite3.Row
        self._conn = conn  # closed by close(), also after a failed open()
        conn.execute(f"PRAGMA busy_timeout={int(self.unavailable_timeout_s * 1000)}")

    def _use_wal(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            # a new file's pages (an existing file keeps its own: the setting is then a no-op)
            conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
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
            conn.execute(f"PRAGMA journal_size_limit={int(2 * self.WAL_LIMIT_BYTES)}")
        self._exec = _SqliteExecutor(conn, self._cache)

    async def open(self) -> None:
        pool = self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bourse-sqlite")
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
        self._start_committer()
        if self.path != ":memory:":
            self._start_checkpointer()
        await self.migrate()

    async def close(self) -> None:
        pool, conn = self._pool, self._conn
        committer, self._committer, self._loop = self._committer, None, None
        if committer is not None:
            # put on the loop's thread: what was submitted before runs first, and a
            # transaction submitted after is refused ("not open"), never left waiting
            self._inbox.put(None)
            await asyncio.get_running_loop().run_in_executor(pool, committer.join)
        if self._checkpointer is not None and pool is not None:
            await asyncio.get_running_loop().run_in_executor(pool, self._stop_checkpointer)
        self._pool = self._conn = self._exec = None
        if pool is not None:
            if conn is not None:
                await asyncio.get_running_loop().run_in_executor(pool, conn.close)
            pool.shutdown(wait=True)

    # -- group commit ---------------------------------------------------------------------
    #
    # Transactions queue up on the event loop side; the commit thread takes every
    # queued one at once and runs them in a single SQLite transaction, each inside its
    # own SAVEPOINT (a failing one rolls back alone; a batch of one needs none), then
    # answers them all with one wake-up of the event loop. Under load this turns N
    # thread hops and N commits into one; alone, a transaction costs what it did.
    #
    # The thread is the store's own, fed by a ``queue.SimpleQueue`` (one C call a
    # transaction on the loop's side, and a wake-up only when the thread waits), not an
    # executor's ``submit``: that builds a future and a work item and takes two locks and
    # a semaphore in Python on every call (the executor cost streams c=32 2.7 % more
    # instructions and 3.7 % more CPU a stream; docs/design.md).

    MAX_BATCH = 256

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        loop = self._loop
        if loop is None:
            raise RuntimeError("the SQLite store is not open")
        fut: asyncio.Future[Any] = loop.create_future()
        self._inbox.put((fn, args, fut))
        self._pending += 1
        return fut

    def _answer(self, results: list[_Result]) -> None:
        self._pending -= len(results)
        _resolve(results)

    def _run_small(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """A small write (a hold, a close): on the loop's thread when nothing is handed
        to the commit thread and the gate admits it (:mod:`bourse.storage.inline`),
        else handed off like any other."""
        if self._pending == 0 and self._conn is not None:
            loop = self._loop
            if loop is not None and loop is running_loop() and self._gate.admit(loop):
                fut = self._inline(loop, fn, args)
                if fut is not None:
                    return fut
        elif self._pending:
            self._gate.loaded()  # another write in flight: under load, the commit thread's
        return self._submit(fn, args)

    def _inline(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> asyncio.Future[Any] | None:
        """Run one transaction here and now; None (nothing done) when the commit thread
        or a WAL reset holds the connection, or the file's write lock is not free at
        once (no busy wait on this thread: the commit thread waits instead)."""
        conn = self._conn
        if conn is None or not self._writers.is_set() or not self._batch_lock.acquire(blocking=False):
            return None
        t0 = time.perf_counter()
        fut: asyncio.Future[Any] = loop.create_future()
        try:
            try:
                conn.execute("PRAGMA busy_timeout = 0")
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:  # locked (or failing): the commit thread waits, and says
                self._roll_back()
                return None
            finally:
                conn.execute(f"PRAGMA busy_timeout = {int(self.unavailable_timeout_s * 1000)}")
            changes = conn.total_changes
            try:
                results = self._run_batch([(fn, args, fut)], begun=True)
            except Exception as exc:  # a fault of this module, as in _serve
                log.exception("SQLite transaction failed")
                results = [(fut, False, exc)]
                self._roll_back()
            except BaseException:
                self._roll_back()
                raise
            check = self._committed(conn.total_changes != changes, 1)
        finally:
            self._batch_lock.release()
        self.inline_runs += 1
        if check and self._after_commit(wait=False):
            self._gate.back_off()  # the WAL is past twice its limit: the commit thread waits for it
        self._gate.ran(time.perf_counter() - t0)
        _resolve(results)
        return fut

    def _start_committer(self) -> None:
        """The commit thread, answering on the running loop (the store's one loop)."""
        self._loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._serve, args=(self._loop,), name="bourse-sqlite", daemon=True)
        thread.start()
        self._committer = thread

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """The commit thread: each batch of what is queued, in one transaction."""
        inbox, conn = self._inbox, self._conn
        assert conn is not None
        while True:
            item = inbox.get()
            if item is None:
                return
            self._writers.wait()  # a WAL reset is under way (see _reset_wal): more may queue
            batch = [item]
            stop = False
            while len(batch) < self.MAX_BATCH and not inbox.empty():
                item = inbox.get_nowait()
                if item is None:
                    stop = True
                    break
                batch.append(item)
            with self._batch_lock:
                changes = conn.total_changes
                try:
                    results = self._run_batch(batch)
                except BaseException as exc:  # a fault of this module: fail the batch, keep serving
                    log.exception("SQLite batch failed")
                    results = [(fut, False, exc) for _, _, fut in batch]
                    self._roll_back()
                check = self._committed(conn.total_changes != changes, len(batch))
            try:
                loop.call_soon_threadsafe(self._answer, results)
            except RuntimeError:  # the loop is closed (shutdown)
                return
            if stop:
                return
            if check:
                self._after_commit()

    def _committed(self, wrote: bool, writes: int) -> bool:
        """Count a committed batch (under ``_batch_lock``); whether to look at the WAL."""
        if not wrote:
            # reads, and sweeps that found nothing to change: nothing reached the WAL,
            # so the store stays idle (a sweeper every half second would otherwise
            # keep the idle pass, which empties the WAL, from ever coming)
            return False
        self._dirty = True
        self._last_commit = time.monotonic()
        self._commits += writes  # writes: a batch of many writes grows the log as much
        self._unsized += writes
        if self._checkpointer is not None and (
            self._unsized >= self.SIZE_EVERY or self._commits >= self.CHECKPOINT_EVERY
        ):
            self._unsized = 0
            return True
        return False

    def _roll_back(self) -> None:
        conn = self._conn
        if conn is not None and conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                log.exception("SQLite rollback failed")

    def _after_commit(self, wait: bool = True) -> bool:
        """Wake the checkpoint thread every CHECKPOINT_EVERY writes or WAL_STEP_BYTES
        of WAL growth; wait for it (at most a second; not ``wait``: on the loop's thread)
        if the WAL is over twice its limit. Whether it is."""
        size = self._wal_bytes()
        if self._commits >= self.CHECKPOINT_EVERY or size >= self._wake_at:
            self._commits = 0
            self._wake_at = size + self.WAL_STEP_BYTES
            self._ckpt_wake.set()
        if size > 2 * self.WAL_LIMIT_BYTES and not self._readers_block_reset:
            self._pass_done.clear()
            self._ckpt_wake.set()
            if wait:
                self._pass_done.wait(1.0)
            return True
        return False

    # -- checkpoints -------------------------------------------------------------------------
    #
    # SQLite's automatic checkpoint runs inside the commit that crosses its threshold,
    # with two fsyncs: that commit, and every transaction queued behind it, waits
    # milliseconds. Here the commit thread only counts commits and wakes the checkpoint
    # thread every CHECKPOINT_EVERY writes (not commits: a restarted log reuses its file,
    # whose size then says nothing of the log's length until it outgrows it, and one
    # group commit may carry a hundred writes); that thread, on its own connection:
    #
    # - runs a PASSIVE checkpoint (it never blocks writers): the bulk of the copying and
    #   the database fsync, while commits go on;
    # - if the log (the frames the PASSIVE pass reports, not the file's size) is then
    #   above WAL_LIMIT_BYTES, resets it: a PASSIVE checkpoint alone never does, since
    #   under constant writes new frames always follow the ones it copied, SQLite never
    #   restarts the log and the file grows without bound. The commit thread is held
    #   before its next batch (the batch running ends first) while a RESTART checkpoint
    #   copies the few frames written since the PASSIVE one; the next commit writes the
    #   log from its start again, in the same file. Not TRUNCATE: freeing an 8 MiB file's
    #   blocks (a filesystem mounted with ``discard`` trims them at once) held the commit
    #   thread ~4 ms a reset, several times a second under load, and that was the p99 of
    #   scenario (a) (5-6 ms against a p90 of 1.3 ms). If readers of another process
    #   still use the WAL, it gives up after CHECKPOINT_BUSY_MS (the next pass tries again);
    # - wakes also when the WAL file grows by WAL_STEP_BYTES past its size at the last
    #   reset (a batch of group-committed transactions may write many pages), and past
    #   twice the limit the commit thread waits for the pass (at most a second): the WAL
    #   stays bounded even when this thread is starved of CPU (not when another process's
    #   readers hold the log: waiting would not help);
    # - when no row was written for IDLE_CHECKPOINT_S, empties a WAL that is not
    #   (TRUNCATE: nothing waits on it then), so an idle gateway keeps no log behind.
    #   Idle means no work written, not no commit called: reads, and periodic sweeps
    #   that find nothing to change (each a transaction on the commit thread, with no
    #   row changed, so no WAL frame), leave the store idle (``_serve``).
    #
    # ``journal_size_limit`` (twice WAL_LIMIT_BYTES) trims the file when the log restarts
    # and the file had grown past it: not at the limit itself, since a reset comes only
    # once the log is past the limit, so every reset would trim the file and the next
    # cycle allocate its blocks again (in the first commit after the reset: bench (a)'s
    # p99 and ~15 % of its CPU a request). Closing the last connection checkpoints what
    # is left.

    CHECKPOINT_EVERY = 64
    SIZE_EVERY = 16
    WAL_LIMIT_BYTES = 128 * 1024 * 1024
    """A reset holds the commit thread for its RESTART pass and its two fsyncs, 5-13 ms
    here: at c=1 (bench (a)) the ledger writes ~40 MB of log a second, so at 32 MiB a
    reset came every second and delayed ~1 % of the requests, (a)'s p99 (docs/design.md).
    Past 128 MiB, one every ~3 s. Under writes the file holds up to twice this (the
    commit thread waits for the pass beyond it); idle, it is emptied."""
    WAL_STEP_BYTES = 2 * 1024 * 1024
    IDLE_CHECKPOINT_S = 1.0
    CHECKPOINT_BUSY_MS = 250

    def _start_checkpointer(self) -> None:
        self._ckpt_stop = False
        self._ckpt_wake.clear()
        thread = threading.Thread(target=self._checkpoint_loop, name="bourse-sqlite-wal", daemon=True)
        thread.start()
        self._checkpointer = thread

    def _stop_checkpointer(self) -> None:
        thread, self._checkpointer = self._checkpointer, None
        if thread is not None:
            self._ckpt_stop = True
            self._ckpt_wake.set()
            thread.join()

    def _checkpoint_loop(self) -> None:
        try:
            while True:
                woken = self._ckpt_wake.wait(self.IDLE_CHECKPOINT_S)
                self._ckpt_wake.clear()
                if self._ckpt_stop:
                    return
                if woken:
                    self._checkpoint()
                elif self._dirty and time.monotonic() - self._last_commit >= self.IDLE_CHECKPOINT_S:
                    self._checkpoint(reset=True)
                self._pass_done.set()
        finally:
            self._close_checkpoint_conn()

    def _checkpoint(self, reset: bool = False) -> None:
        """One pass: PASSIVE, then a reset when the WAL is over its limit (or ``reset``)."""
        try:
            conn = self._checkpoint_conn
            if conn is None:
                conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
                conn.execute(f"PRAGMA busy_timeout={int(self.CHECKPOINT_BUSY_MS)}")
                self._checkpoint_conn = conn
            row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            log_frames = 0 if row is None or row[1] < 0 else int(row[1])
            if reset or log_frames * self._frame_bytes(conn) > self.WAL_LIMIT_BYTES:
                # the frames written during the first pass: copied while writers run,
                # so the held part below has little left to copy
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self._reset_wal(conn, "TRUNCATE" if reset else "RESTART")
        except sqlite3.Error as exc:
            if isinstance(unavailable_as_such(exc), StoreUnavailable):  # a full disk: no trace each second
                log.warning("WAL checkpoint failed: %s; the next one retries", exc)
            else:
                log.exception("WAL checkpoint failed; the next one retries")

    def _frame_bytes(self, conn: sqlite3.Connection) -> int:
        """The size of one WAL frame (a page and its 24-byte header)."""
        if not self._frame_size:
            self._frame_size = int(conn.execute("PRAGMA page_size").fetchone()[0]) + 24
        return self._frame_size

    def _reset_wal(self, conn: sqlite3.Connection, mode: str = "RESTART") -> None:
        """A RESTART (or, idle, TRUNCATE) checkpoint with the commit thread held between
        two batches."""
        t0 = time.monotonic()
        self._writers.clear()
        try:
            with self._batch_lock:
                row = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        finally:
            self._writers.set()
        # the file keeps its size after a RESTART: wake again once it grows past it
        self._wake_at = self._wal_bytes() + self.WAL_STEP_BYTES
        self.longest_reset_s = max(self.longest_reset_s, time.monotonic() - t0)
        self._readers_block_reset = bool(row is not None and row[0])
        if self._readers_block_reset:
            log.info("WAL reset postponed: another connection is still reading it")
        elif mode == "TRUNCATE":
            self._dirty = False  # a RESTART leaves the file's blocks: the idle pass empties it

    def _wal_bytes(self) -> int:
        try:
            return os.path.getsize(self.path + "-wal")
        except OSError:
            return 0

    def _close_checkpoint_conn(self) -> None:
        conn, self._checkpoint_conn = self._checkpoint_conn, None
        if conn is not None:
            conn.close()

    def _run_batch(self, batch: list[_Item], begun: bool = False) -> list[_Result]:
        conn, ex = self._conn, self._exec
        assert conn is not None and ex is not None
        out: list[_Result] = []
        try:
            if not begun:
                conn.execute("BEGIN IMMEDIATE")
            if len(batch) == 1:  # alone (no load): its own transaction, no savepoint
                fn, args, fut = batch[0]
                try:
                    value = fn(ex, *args)
                except Exception as exc:
                    self._roll_back()
                    return [(fut, False, unavailable_as_such(exc))]
                out.append((fut, True, value))
            else:
                for fn, args, fut in batch:
                    conn.execute("SAVEPOINT op")
                    try:
                        value = fn(ex, *args)
                    except Exception as exc:
                        if not conn.in_transaction:  # SQLite rolled the whole batch back itself
                            raise _RolledBack(exc) from exc
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                        out.append((fut, False, unavailable_as_such(exc)))
                        continue
                    conn.execute("RELEASE op")
                    out.append((fut, True, value))
            conn.execute("COMMIT")
        except (sqlite3.Error, _RolledBack) as exc:
            # the transaction could not begin or commit, or SQLite rolled it back (after
            # SQLITE_FULL, IOERR, NOMEM or BUSY it may do so itself): nothing of the
            # batch stands, and a ROLLBACK of a transaction SQLite ended would fail
            self._roll_back()
            cause = exc.cause if isinstance(exc, _RolledBack) else exc
            lost = StoreUnavailable(f"SQLite: {cause}")
            lost.__cause__ = cause
            return [(fut, False, lost) for _, _, fut in batch]
        return out

    def _run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        # reads too (SqlStore._read): one connection, one thread, reads and writes alike
        return self._submit(fn, args)


def _resolve(results: list[_Result]) -> None:
    for fut, ok, value in results:
        if fut.done():  # the caller was cancelled; its transaction stands
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
