"""The PostgreSQL adapter: a shared database for several gateway replicas.

psycopg (3) connections from a :class:`psycopg_pool.ConnectionPool`, used by the
worker threads of a small executor (as many threads as connections): every
transaction is one function run on a worker (one hop off the event loop), its
statements on one pooled connection. Holds are owned by gateway instances with
leases (``instances``), so a replica's orphaned holds are found by the others once
its lease lapses. The pool opens connections as the load needs them (one at
start-up) and closes the extra ones after ten idle minutes.

A connection the server dropped (a restart, a failover) is discarded by the pool,
which opens a new one in the background; the transaction that found it broken is
retried with :func:`bourse.retrying.retrying` after the pool has checked its idle
connections (so the retry does not pick up another dead one). A connection failure
that remains after those retries (or a pool with no connection to give) is
:class:`~bourse.ports.stores.StoreUnavailable`, on every path (one transaction, a
batch of one account's ledger writes), within ``[storage] unavailable_timeout_s`` of
the call: the HTTP layer answers it 503 ``no_capacity`` with ``retry-after``.

A connection that takes no answer (a frozen server, a partition, a lock wait) is
bounded the same way: at the call's deadline the event loop gives the call up
(:class:`StoreUnavailable`) and shuts down the socket of the connection it was using
(:class:`_Call`), which wakes its worker thread with an error, and the pool discards
that connection. Whether a write given up that way was committed is unknown, as with a
connection lost during COMMIT: the ledger's callers keep what they could not write for
the hold sweeper, whose writes meet the ledger's guards (a hold closes once). As
defence in depth the server itself ends a statement past ``unavailable_timeout_s``
(``statement_timeout``) and a transaction left idle (``idle_in_transaction_session_timeout``,
so a partitioned replica's row locks do not outlive it), and TCP keepalives with
``tcp_user_timeout`` find a dead peer of an idle pooled connection. Only the migrations
at start-up run unbounded (a large table's may take long; replicas wait for each other's).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from bourse.ports.stores import Hold, StoreUnavailable, UnknownAccount
from bourse.retrying import retrying
from bourse.storage.executor import Executor, IntegrityError, Row, values_list
from bourse.storage.ledger import (
    CLOSE_FROM_VALUES,
    HOLD_ACCOUNT_PARAM,
    HOLD_PARAMS,
    HOLDS_FROM_VALUES,
    BatchShort,
    Closing,
    LedgerWrite,
    closing_charge,
    counted,
    hold_row,
    hold_row_args,
    refusal,
)
from bourse.storage.sql import SqlStore, migrate_in
from bourse.storage.usage import USAGE_COLUMNS, USAGE_INSERT, usage_values

T = TypeVar("T")
_PARAM = re.compile(r"\$(\d+)")

CONNECT_TIMEOUT_S = 10.0
"""How long opening a connection may take (the pool opens them in the background; a
transaction waits for one at most ``unavailable_timeout_s``)."""
MIN_WAIT_S = 0.001
"""The shortest wait for a pooled connection (see ``_tx``)."""
RECONNECT_ATTEMPTS = 3
"""Attempts of a transaction whose connection the server dropped (the first included)."""
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3}
"""TCP keepalives: an idle pooled connection whose peer is gone is found within ~20 s."""
TCP_USER_TIMEOUT_MS = 15_000
"""A connection whose sent data stays unacknowledged this long is closed by the kernel
(a partition): the pool's idle connections and background connection attempts; a call
is given up sooner, at its deadline."""
IDLE_IN_TRANSACTION_FACTOR = 2
"""The server ends a transaction left idle this many ``unavailable_timeout_s`` (its
replica gave it up, or cannot reach the server), releasing its locks."""


class ConnectionLost(psycopg.OperationalError):
    """The transaction's connection broke (the server went away), so it is run again on
    another one: a break before COMMIT rolled it back; in the rare break during COMMIT
    the repeat meets the ledger's own guards (a hold id exists, a hold is no longer open)."""


class _GivenUp(psycopg.OperationalError):
    """The call was given up at its deadline (see :class:`_Call`)."""


class _Call:
    """One store call's claim on the connection its worker thread is using, shared with the
    event loop, which gives the call up at its deadline: then that connection's socket is
    shut down (never closed here: its worker still owns the descriptor), so the worker's
    wait for the server ends at once with an error and the pool discards the connection;
    a worker that takes a connection after that hands it back unused."""

    __slots__ = ("_conn", "_lock", "given_up")

    def __init__(self) -> None:
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self.given_up = False

    def take(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if self.given_up:
                raise _GivenUp("the call was given up")
            self._conn = conn

    def drop(self) -> None:
        with self._lock:
            self._conn = None

    def give_up(self) -> None:
        with self._lock:
            self.given_up = True
            conn, self._conn = self._conn, None
            if conn is not None:
                _shut_down(conn)


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    """Shut ``conn``'s socket down for both directions (through a duplicate of its
    descriptor, so the connection's own stays valid until its owner closes it)."""
    try:
        fd = conn.pgconn.socket
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, psycopg.Error):
        pass  # closed already


class _Pool(ConnectionPool[psycopg.Connection[Any]]):
    """The connection pool, whose check of its idle connections (after a lost one) is given
    up with the call that asked for it: a frozen server would hold that check for ever."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._checking = threading.local()

    def check_for(self, call: _Call) -> None:
        self._checking.call = call
        try:
            self.check()
        finally:
            self._checking.call = None

    def check_connection(self, conn: psycopg.Connection[Any]) -> None:  # type: ignore[override]
        call: _Call | None = getattr(self._checking, "call", None)
        if call is None:
            ConnectionPool.check_connection(conn)
            return
        call.take(conn)  # _GivenUp: the pool discards this idle one (the server is not answering)
        try:
            ConnectionPool.check_connection(conn)
        finally:
            call.drop()


def server_options(dsn: str, unavailable_timeout_s: float) -> str:
    """The ``options`` of every connection: the server's own bounds (see the module's
    docstring), before any the DSN gives (which win)."""
    ms = max(1, int(unavailable_timeout_s * 1000))
    ours = (
        f"-c statement_timeout={ms} -c idle_in_transaction_session_timeout={ms * IDLE_IN_TRANSACTION_FACTOR}"
    )
    theirs = conninfo_to_dict(dsn).get("options")
    return f"{ours} {theirs}" if theirs else ours


class _PgExecutor:
    """One transaction's statements on one connection. A statement whose parameters are
    ``$1`` to ``$n``, each given (nearly all), goes through psycopg's
    :class:`~psycopg.RawCursor` as written: psycopg parses a statement longer than 4 KB
    (a batch of ledger writes) again on every execution to turn its ``%(name)s`` into
    ``$n``, a quarter of the database thread's Python a batch (issue 40 item 4). Any
    other statement has its ``$n`` rewritten as named parameters, as before."""

    __slots__ = ("_cache", "_conn")

    # the server's clock, stable within one statement (unlike clock_timestamp()); every
    # replica's leases are written and judged on it
    clock = "EXTRACT(EPOCH FROM statement_timestamp())::DOUBLE PRECISION"

    def __init__(self, conn: psycopg.Connection[Any], cache: dict[str, tuple[str, int]]) -> None:
        self._conn = conn
        self._cache = cache

    def _cursor(self, sql: str, args: tuple[Any, ...]) -> psycopg.Cursor[Any]:
        """``sql`` run with ``args``: raw when its parameters are ``$1``..``$n``, n of them."""
        got = self._cache.get(sql)
        if got is None:
            got = self._cache[sql] = _converted(sql)
        named, n = got
        if n == len(args):
            return psycopg.RawCursor(self._conn).execute(sql, args or None)
        return self._conn.execute(named, {f"p{i}": v for i, v in enumerate(args, 1)} if args else None)

    def fetch(self, sql: str, *args: Any) -> list[Row]:
        try:
            return self._cursor(sql, args).fetchall()
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None

    def fetchrow(self, sql: str, *args: Any) -> Row | None:
        try:
            row: Row | None = self._cursor(sql, args).fetchone()
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None
        return row

    def execute(self, sql: str, *args: Any) -> int:
        try:
            return self._cursor(sql, args).rowcount
        except psycopg.errors.IntegrityError as exc:
            raise IntegrityError(str(exc)) from None


def _converted(sql: str) -> tuple[str, int]:
    """``sql`` with its ``$n`` as psycopg's named parameters; how many parameters it
    takes as written (``$1``..``$n`` each present: n), or -1 (then only named)."""
    used = {int(m) for m in _PARAM.findall(sql)}
    raw = len(used) if used == set(range(1, len(used) + 1)) else -1
    return _PARAM.sub(r"%(p\1)s", sql), raw


class PostgresStore(SqlStore):
    """Every storage port on one PostgreSQL database."""

    single_node = False
    migration_lock_sql = "SELECT pg_advisory_xact_lock(7243001)"

    def __init__(self, dsn: str, *, max_size: int = 8, unavailable_timeout_s: float = 5.0) -> None:
        self.dsn = dsn
        self.unavailable_timeout_s = unavailable_timeout_s
        """How long a transaction may wait for a connection (with its retries) before it
        is :class:`StoreUnavailable` (``[storage] unavailable_timeout_s``)."""
        self._size = max(1, max_size)
        self._threads: ThreadPoolExecutor | None = None
        self._pool: _Pool | None = None
        self._cache: dict[str, tuple[str, int]] = {}

    async def open(self) -> None:
        pool = _Pool(
            self.dsn,
            min_size=1,
            max_size=self._size,
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                "connect_timeout": int(CONNECT_TIMEOUT_S),
                "options": server_options(self.dsn, self.unavailable_timeout_s),
                # text as str whatever the database's encoding: in a SQL_ASCII database
                # (a bare initdb under the C locale) psycopg would read it as bytes
                "client_encoding": "utf8",
                "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
                **KEEPALIVES,
            },
            timeout=self.unavailable_timeout_s,
            # psycopg_pool doubles the wait between reconnection attempts, without a cap,
            # until this much time has passed; then it gives the attempt up and the next
            # transaction that finds no connection starts a new one at once. Its default
            # (5 min) let the waits grow to a minute in a long outage, which then kept the
            # gateway refusing for up to that long after the database was back.
            reconnect_timeout=self.unavailable_timeout_s,
            open=False,
            name="bourse-pg",
        )
        threads = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix="bourse-pg")
        try:
            await asyncio.get_running_loop().run_in_executor(threads, _open_pool, pool, self.dsn)
        except BaseException:
            threads.shutdown(wait=False)
            raise
        self._pool, self._threads = pool, threads
        await self.migrate()

    async def close(self) -> None:
        threads, pool = self._threads, self._pool
        self._threads = self._pool = None
        if threads is not None:
            threads.shutdown(wait=True)
        if pool is not None:
            pool.close()

    def _tx(
        self, fn: Callable[..., T], args: tuple[Any, ...], write: bool, deadline: float, call: _Call
    ) -> T:
        """One transaction on a worker thread: ``fn(executor, *args)`` on a pooled
        connection, waiting for one no later than ``deadline`` (monotonic), the
        connection claimed by ``call`` while in use."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("the PostgreSQL store is not open")
        # a pool with no connection to give (the server refuses them) answers PoolTimeout
        # at the deadline; psycopg_pool gives up at once on a timeout of 0, even with an
        # idle connection in hand, so a call past its deadline still takes one that is free
        conn = pool.getconn(max(MIN_WAIT_S, deadline - time.monotonic()))
        try:
            call.take(conn)
            ex = _PgExecutor(conn, self._cache)
            if not write:
                return fn(ex, *args)
            with conn.transaction():
                return fn(ex, *args)
        except psycopg.OperationalError as exc:
            if not conn.broken or call.given_up:
                raise
            lost = exc
        finally:
            call.drop()  # before it goes back: a give-up never shuts a pooled one down
            pool.putconn(conn)  # a broken one is discarded and replaced
        pool.check_for(call)  # its idle siblings may be dead too (the server restarted)
        raise ConnectionLost(str(lost)) from lost

    async def _call(
        self, fn: Callable[..., T], args: tuple[Any, ...], write: bool, bounded: bool = True
    ) -> T:
        """Every transaction's way to the database: run on a worker, again (twice at most)
        after a lost connection, and given up ``unavailable_timeout_s`` after the call
        (unless not ``bounded``: the migrations); a connection failure that outlasts that
        (the server is gone, refuses connections or does not answer, the pool has none to
        give) is :class:`StoreUnavailable`."""
        threads = self._threads
        if threads is None:
            raise RuntimeError("the PostgreSQL store is not open")
        loop = asyncio.get_running_loop()
        timeout_s = self.unavailable_timeout_s if bounded else CONNECT_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        call = _Call()
        try:
            async with asyncio.timeout(timeout_s if bounded else None):
                try:
                    return await loop.run_in_executor(threads, self._tx, fn, args, write, deadline, call)
                except ConnectionLost:
                    pass  # the retries below, off the fast path (no retry state per transaction)
                async for attempt in retrying(
                    attempts=RECONNECT_ATTEMPTS - 1,
                    base_s=0.05,
                    max_s=1.0,
                    retry_on=ConnectionLost,
                    what="a PostgreSQL transaction after a lost connection",
                ):
                    with attempt:
                        return await loop.run_in_executor(threads, self._tx, fn, args, write, deadline, call)
        except TimeoutError:
            call.give_up()
            raise StoreUnavailable(f"PostgreSQL: no answer within {timeout_s:g} s") from None
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL: {exc}") from exc
        raise AssertionError("unreachable: retrying re-raises the last failure")

    async def migrate(self) -> int:
        """Apply pending migrations, unbounded (a large table's may take long; replicas
        starting together wait for the one that migrates)."""
        return await self._call(migrate_in, (self.migration_lock_sql, time.time(), _UNBOUNDED), True, False)

    def _run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return self._call(fn, args, True)

    def _read(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return self._call(fn, args, False)

    def _write_one(self, item: LedgerWrite) -> Awaitable[Hold | None]:
        if isinstance(item, Hold) and counted(item):
            return super()._write_one(item)
        return self._write_alone(item)

    async def _write_alone(self, item: LedgerWrite) -> Hold | None:
        """An uncapped hold or a close as a batch of one: one statement, where the
        single path is three or four (and its inserts, ON CONFLICT, log one more WAL
        record a row); the single path when the statement is refused (an overdraft)."""
        try:
            [out] = await self._call(_write_many, ([item],), False)
        except BatchShort:
            return await super()._write_one(item)
        if isinstance(out, Exception):
            raise out
        return out

    async def _write_many(self, items: list[LedgerWrite]) -> list[Hold | Exception | None]:
        if any(isinstance(i, Hold) and counted(i) for i in items):
            return await super()._write_many(items)  # caps to count: keys' rows before the account's
        try:  # one statement: its own transaction
            return await self._call(_write_many, (items,), False)
        except BatchShort:
            return await self._write_each(items)


_UNBOUNDED = ("SET LOCAL statement_timeout = 0",)
"""What a migration's transaction runs first: the server's statement bound lifted."""


def _open_pool(pool: _Pool, dsn: str) -> None:
    """Open ``pool`` and wait for its first connections. One plain connection first, so
    a database that refuses us fails at once with the server's own reason (the pool
    would keep trying until its timeout)."""
    psycopg.connect(dsn, connect_timeout=int(CONNECT_TIMEOUT_S)).close()
    try:
        pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
    except BaseException:
        pool.close()
        raise


# -- a batch of one account's ledger writes as one statement (no BEGIN, no COMMIT trip) --

# No ON CONFLICT on the batch's inserts: a speculative insertion logs one more WAL record
# a row (its confirmation, ~50 bytes; issue 40). A hold id that exists (a batch retried
# after a lost connection) or a request whose usage record exists (a close after
# reconciling) breaks the statement, which then rolls back whole, and its writes are
# made one by one (``_write_each``: the single statements, which do handle them).
_NEW_HOLDS = (
    HOLDS_FROM_VALUES
    + f"WHERE EXISTS (SELECT 1 FROM accounts WHERE id = column{HOLD_ACCOUNT_PARAM}) RETURNING *"
)
_CLOSED = CLOSE_FROM_VALUES + " RETURNING holds.*"
_USED_VALUES = ", ".join(f"column{n}" for n in range(2, len(USAGE_COLUMNS) + 2))  # column1: the hold's id
_USED = (
    f", used AS ({USAGE_INSERT}SELECT {_USED_VALUES} FROM (VALUES {{values}}) AS u "
    "WHERE u.column1 IN (SELECT id FROM closed))"
)
_BATCH = (
    "WITH ins AS ({ins}), closed AS ({closed}), "
    "net AS (UPDATE accounts SET balance_micros = balance_micros + d.delta, "
    "pending_micros = pending_micros + d.pending, posted_micros = posted_micros + d.posted FROM "
    "(SELECT account_id, SUM(delta) AS delta, SUM(pending) AS pending, SUM(posted) AS posted FROM "
    "(SELECT account_id, -amount_micros AS delta, amount_micros AS pending, 0 AS posted FROM ins UNION ALL "
    "SELECT account_id, amount_micros - charged_micros, -amount_micros, charged_micros FROM closed) AS x "
    "GROUP BY account_id) AS d "
    "WHERE accounts.id = d.account_id AND (d.delta <> 0 OR d.pending <> 0 OR d.posted <> 0)){used} "
    "SELECT *, true AS placed FROM ins UNION ALL SELECT *, false FROM closed"
)
_NONE = "SELECT * FROM holds WHERE false"


def _write_many(db: Executor, items: list[LedgerWrite]) -> list[Hold | Exception | None]:
    """Uncapped holds and closes of one account in one statement: the new hold rows,
    the closed ones and their usage records, then the account's row once, for the net
    of its debits and refunds. An overdraft breaks the balance's CHECK and the
    statement does nothing (:class:`BatchShort`)."""
    holds = [i for i in items if isinstance(i, Hold)]
    closes = [i for i in items if not isinstance(i, Hold)]
    args: list[Any] = hold_row_args(holds)
    ins = _NEW_HOLDS.format(values=values_list(len(holds), len(HOLD_PARAMS))) if holds else _NONE
    closed, used = _close_parts(closes, args)
    try:
        rows = db.fetch(_BATCH.format(ins=ins, closed=closed, used=used), *args)
    except IntegrityError:  # an overdraft, a hold id or a usage record that exists
        raise BatchShort(holds[0].account_id if holds else "") from None
    placed = {r["id"] for r in rows if r["placed"]}
    done = {r["id"]: hold_row(r) for r in rows if not r["placed"]}
    out: list[Hold | Exception | None] = []
    for item in items:
        if not isinstance(item, Hold):
            out.append(done.get(item[0]) or refusal(db, item[0], closing_charge(item)))
        elif item.id in placed:
            out.append(None)
        else:
            known = db.fetchrow("SELECT 1 AS x FROM accounts WHERE id = $1", item.account_id) is not None
            out.append(IntegrityError(f"hold {item.id} exists") if known else UnknownAccount(item.account_id))
    return out


def _close_parts(closes: list[Closing], args: list[Any]) -> tuple[str, str]:
    """The closing CTE and the usage one of a batch's closes, their parameters added to ``args``."""
    if not closes:
        return _NONE, ""
    start = len(args)
    for item in closes:
        args += (item[0], item[1], closing_charge(item), item[4], item[5])
    closed = _CLOSED.format(
        values=values_list(len(closes), 5, ("", "", "BIGINT", "TEXT", "DOUBLE PRECISION"), start=start)
    )
    usages = {u.request_id: (hold_id, u) for hold_id, _, _, u, _, _ in closes if u is not None}
    if not usages:
        return closed, ""
    start = len(args)
    for hold_id, u in usages.values():
        args.append(hold_id)
        args += usage_values(u)
    return closed, _USED.format(values=values_list(len(usages), 1 + len(USAGE_COLUMNS), start=start))
