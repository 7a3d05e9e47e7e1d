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
connections (so the retry does not pick up another dead one).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from bourse.ports.stores import Hold, HoldNotOpen, UnknownAccount
from bourse.retrying import retrying
from bourse.storage.sql import (
    HOLD_COLUMNS,
    BatchShort,
    Closing,
    Executor,
    IntegrityError,
    Row,
    SqlStore,
    hold_row,
    values_list,
)

T = TypeVar("T")
_PARAM = re.compile(r"\$(\d+)")

CONNECT_TIMEOUT_S = 10.0
"""How long opening a connection, or waiting for a free one, may take."""
RECONNECT_ATTEMPTS = 3
"""Attempts of a transaction whose connection the server dropped (the first included)."""


class ConnectionLost(psycopg.OperationalError):
    """The transaction's connection broke (the server went away), so it is run again on
    another one: a break before COMMIT rolled it back; in the rare break during COMMIT
    the repeat meets the ledger's own guards (a hold id exists, a hold is no longer open)."""


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

    def __init__(self, dsn: str, *, max_size: int = 8) -> None:
        self.dsn = dsn
        self._size = max(1, max_size)
        self._threads: ThreadPoolExecutor | None = None
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._cache: dict[str, str] = {}

    async def open(self) -> None:
        pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            self.dsn,
            min_size=1,
            max_size=self._size,
            kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": int(CONNECT_TIMEOUT_S)},
            timeout=CONNECT_TIMEOUT_S,
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

    def _tx(self, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> T:
        """One transaction on a worker thread: ``fn(executor, *args)`` on a pooled connection."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("the PostgreSQL store is not open")
        conn = pool.getconn()
        try:
            ex = _PgExecutor(conn, self._cache)
            if not write:
                return fn(ex, *args)
            with conn.transaction():
                return fn(ex, *args)
        except psycopg.OperationalError as exc:
            if not conn.broken:
                raise
            lost = exc
        finally:
            pool.putconn(conn)  # a broken one is discarded and replaced
        pool.check()  # its idle siblings may be dead too (the server restarted)
        raise ConnectionLost(str(lost)) from lost

    async def _call(self, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> T:
        threads = self._threads
        if threads is None:
            raise RuntimeError("the PostgreSQL store is not open")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(threads, self._tx, fn, args, write)
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
                return await loop.run_in_executor(threads, self._tx, fn, args, write)
        raise AssertionError("unreachable: retrying re-raises the last failure")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._call(fn, args, True)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._call(fn, args, False)

    async def _place_many(self, holds: list[Hold]) -> list[Exception | None]:
        if any(h.spend_period is not None for h in holds):  # key rows to lock first
            return await super()._place_many(holds)
        try:  # one statement: its own transaction
            return await self._call(_place_many, (holds,), False)
        except BatchShort:
            return await self._place_each(holds)

    async def _close_many(self, items: list[Closing]) -> list[Hold | Exception]:
        return await self._call(_close_many, (items,), False)


def _open_pool(pool: ConnectionPool[psycopg.Connection[Any]], dsn: str) -> None:
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

_PLACE_MANY = (
    "WITH ins AS (INSERT INTO holds ({cols}) SELECT column1, column2, column3, column4, 0, 'open', column5, "
    "column6, NULL, column7, column7, column8, NULL FROM (VALUES {values}) AS v "
    "WHERE EXISTS (SELECT 1 FROM accounts WHERE id = column2) ON CONFLICT DO NOTHING RETURNING id, account_id, "
    "amount_micros), "
    "debit AS (UPDATE accounts SET balance_micros = balance_micros - d.total "
    "FROM (SELECT account_id, SUM(amount_micros) AS total FROM ins GROUP BY account_id) AS d "
    "WHERE accounts.id = d.account_id) "
    "SELECT id FROM ins"
)


def _place_many(db: Executor, holds: list[Hold]) -> list[Exception | None]:
    """Uncapped holds of one account in one statement: the rows, then the account's
    debit; an overdraft breaks the balance's CHECK and the statement does nothing."""
    args: list[Any] = []
    for h in holds:
        args += (
            h.id,
            h.account_id,
            h.request_id,
            h.amount_micros,
            h.owner,
            h.product,
            h.created_at,
            h.key_id,
        )
    try:
        rows = db.fetch(_PLACE_MANY.format(cols=HOLD_COLUMNS, values=values_list(len(holds), 8)), *args)
    except IntegrityError:
        raise BatchShort(holds[0].account_id) from None
    placed = {r["id"] for r in rows}
    out: list[Exception | None] = [None] * len(holds)
    for i, h in enumerate(holds):
        if h.id not in placed:
            known = db.fetchrow("SELECT 1 AS x FROM accounts WHERE id = $1", h.account_id) is not None
            out[i] = IntegrityError(f"hold {h.id} exists") if known else UnknownAccount(h.account_id)
    return out


_CLOSE_MANY = (
    "WITH closed AS (UPDATE holds SET state = v.column2, "
    "charged_micros = CASE WHEN v.column3 < amount_micros THEN v.column3 ELSE amount_micros END, "
    "note = COALESCE(v.column4, note), updated_at = v.column5 FROM (VALUES {values}) AS v "
    "WHERE holds.id = v.column1 AND holds.state IN ('open', 'reconciling') RETURNING holds.*), "
    "refund AS (UPDATE accounts SET balance_micros = balance_micros + r.unused "
    "FROM (SELECT account_id, SUM(amount_micros - charged_micros) AS unused FROM closed GROUP BY account_id) AS r "
    "WHERE accounts.id = r.account_id)"
    "{usage} SELECT * FROM closed"
)
_CLOSE_USAGE = (
    ", used AS (INSERT INTO usage (request_id, account_id, product, created_at, outcome, cost_micros, record) "
    "SELECT column2, column3, column4, column5, column6, column7, column8 FROM (VALUES {values}) AS u "
    "WHERE u.column1 IN (SELECT id FROM closed) "
    "ON CONFLICT (request_id) DO UPDATE SET outcome = excluded.outcome, cost_micros = excluded.cost_micros, "
    "record = excluded.record)"
)


def _close_many(db: Executor, items: list[Closing]) -> list[Hold | Exception]:
    """Settles and releases of uncapped holds in one statement: the hold rows, the
    account's refund of what was not charged, the usage records of the holds closed."""
    args: list[Any] = []
    for hold_id, state, charge, _, note, now in items:
        args += (hold_id, state, max(0, charge) if state == "settled" else 0, note, now)
    usage = ""
    usages = {u.request_id: (hold_id, u) for hold_id, _, _, u, _, _ in items if u is not None}
    if usages:
        base = len(args)
        for hold_id, u in usages.values():
            args += (hold_id, u.request_id, u.account_id, u.product, u.created_at, u.outcome, u.cost_micros)
            args.append(orjson.dumps(dict(u.record)).decode())
        usage = _CLOSE_USAGE.format(values=values_list(len(usages), 8, start=base))
    values = values_list(len(items), 5, ("", "", "BIGINT", "TEXT", "DOUBLE PRECISION"))
    rows = db.fetch(_CLOSE_MANY.format(values=values, usage=usage), *args)
    by_id = {r["id"]: hold_row(r) for r in rows}
    return [by_id.get(item[0]) or HoldNotOpen(item[0]) for item in items]
