"""The money invariant after 200 concurrent clients who leave at random and meet every
sim fault (issue 14: "a fault suite that keeps it so").

A ``bourse serve`` process (SQLite) takes :data:`REQUESTS` requests from 200 clients
at once, a seeded mix (``tests/faults/load.py``): complete answers streamed and not,
clients leaving mid-stream and while queued, failures before and after output,
stalls below and past ``stall_timeout_s``, missing usage, book timeouts, jobs (some
canceled). No client sees a 500, a trace or an ``internal_error`` frame; once every
hold is closed and every job finished, the database's books balance to the
micro-USD (credits = balances + holds + revenue; every charge has its usage record;
the records add up to the revenue), the gateway's own ledger, account views and
market views agree, and no slot is left taken.

Bounded: :data:`REQUESTS` requests within :data:`LOAD_S` seconds, then at most
:data:`SETTLE_S` seconds to come to rest.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.faults.load import Load, config
from tests.faults.served import ADMIN_KEY, Served
from tests.support.processes import serve_process

REQUESTS = 1000
CONCURRENCY = 200
LOAD_S = 120.0
SETTLE_S = 30.0
ACCOUNTS = 8
SEED = 14


def test_the_books_balance_after_200_concurrent_clients_with_disconnects_and_sim_faults(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    with serve_process(tmp_path, "load", config(), data_dir, ADMIN_KEY) as (url, _proc):
        gw = Served(url, data_dir, None)
        keys = gw.accounts("load", ACCOUNTS, 50.0)
        tally = asyncio.run(
            Load(url, keys, seed=SEED).run(requests=REQUESTS, concurrency=CONCURRENCY, seconds=LOAD_S)
        )
        assert tally.forbidden == [], tally.forbidden[:5]
        assert tally.transport_errors == 0, tally.seen
        assert tally.requests == REQUESTS, f"{tally.requests} of {REQUESTS} requests in {LOAD_S} s"
        for kind in (
            "complete",
            "leave_streaming",
            "leave_at_once",
            "fault",
            "stall_long",
            "book_timeout",
            "job",
        ):
            assert any(k.startswith(kind + "/") for k in tally.seen), (kind, tally.seen)
        books = gw.at_rest(SETTLE_S)
        books.assert_balanced()
        assert books.revenue > 0 and len(books.ids("settled")) > REQUESTS // 2, books
        gw.assert_served_books(books, "load", ACCOUNTS)
