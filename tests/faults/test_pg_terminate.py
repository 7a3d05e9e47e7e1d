"""PostgreSQL connections terminated under load (issue 14: "a fault suite that keeps it so").

A ``bourse serve`` process on a fresh PostgreSQL database takes the mixed load of
``tests/faults/load.py`` (100 clients at once) while a separate connection, on that
test database only, terminates every other backend of it (``pg_terminate_backend``)
every :data:`EVERY_S` seconds. No client sees a 500, a trace or an ``internal_error``
frame (a request whose database transaction cannot run gets 503 with ``retry-after``);
once at rest the books balance to the micro-USD with every charge recorded,
and the gateway's views agree with the database.

Bounded: :data:`REQUESTS` requests within :data:`LOAD_S` seconds, at least
:data:`MIN_TERMINATED` backends terminated, at rest within :data:`SETTLE_S`.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from tests.faults.load import ALLOWED_STATUS, Load, Tally, config
from tests.faults.served import ADMIN_KEY, Served
from tests.support.databases import fresh_postgres_database
from tests.support.processes import serve_process

pytestmark = pytest.mark.postgres

REQUESTS = 600
CONCURRENCY = 100
LOAD_S = 120.0
SETTLE_S = 30.0
EVERY_S = 0.25
MIN_TERMINATED = 10
ACCOUNTS = 4
ALLOWED = ALLOWED_STATUS | {503}
"""A transaction whose connections keep breaking past the adapter's retries answers 503
(``retry-after``: nothing was held), never 500."""
TERMINATE = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
)
"""Every other backend of this test's own database (``current_database()``), never another's."""


def _terminator(dsn: str, stop: threading.Event, killed: list[int]) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        assert conn.info.dbname.startswith("bourse_t_"), conn.info.dbname  # a test database only
        while not stop.wait(EVERY_S):
            row = conn.execute(TERMINATE).fetchone()
            killed.append(int(row[0]) if row else 0)


async def _load_while_terminating(gw: Served, keys: list[str], dsn: str) -> tuple[Tally, int]:
    stop = threading.Event()
    killed: list[int] = []
    thread = threading.Thread(target=_terminator, args=(dsn, stop, killed), name="pg-terminator", daemon=True)
    thread.start()
    try:
        tally = await Load(gw.url, keys, seed=5, allowed=ALLOWED).run(
            requests=REQUESTS, concurrency=CONCURRENCY, seconds=LOAD_S
        )
    finally:
        stop.set()
        thread.join(10)
    return tally, sum(killed)


def test_terminated_postgres_connections_under_load_give_no_500_and_the_books_balance(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with (
        fresh_postgres_database() as dsn,
        serve_process(tmp_path, "pg", config(), data_dir, ADMIN_KEY, dsn) as (
            url,
            _proc,
        ),
    ):
        gw = Served(url, data_dir, dsn)
        keys = gw.accounts("pgt", ACCOUNTS, 50.0)
        tally, terminated = asyncio.run(_load_while_terminating(gw, keys, dsn))
        assert terminated >= MIN_TERMINATED, terminated
        assert tally.forbidden == [], tally.forbidden[:5]
        assert tally.transport_errors == 0, tally.seen
        assert tally.requests == REQUESTS, tally.seen
        books = gw.at_rest(SETTLE_S)
        books.assert_balanced()
        gw.assert_served_books(books, "pgt", ACCOUNTS)
