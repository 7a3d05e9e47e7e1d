"""The books read straight from a gateway's database (its SQLite file or a PostgreSQL
database), independently of the gateway, which may be dead (after ``kill -9``).

:func:`read_books` takes one consistent snapshot (one read transaction):
credits, balances, holds by state, revenue, the usage records' costs, the charges
without their usage record, and the holds of jobs not yet finished.
:meth:`Books.assert_balanced` is the money invariant: credits = balances + holds +
revenue, to the micro-USD, no balance below 0, and (at rest) every charge has its
usage record, no request is charged twice, and the usage records add up to the revenue.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOTALS = (
    "SELECT "
    "COALESCE((SELECT SUM(amount_micros) FROM credits), 0), "
    "COALESCE((SELECT SUM(balance_micros) FROM accounts), 0), "
    "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE state IN ('open', 'reconciling')), 0), "
    "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE state = 'settled'), 0), "
    "COALESCE((SELECT SUM(cost_micros) FROM usage), 0), "
    "COALESCE((SELECT MIN(balance_micros) FROM accounts), 0)"
)
HOLDS = "SELECT id, state, request_id FROM holds"
UNRECORDED = (
    "SELECT h.id FROM holds h LEFT JOIN usage u ON u.request_id = h.request_id "
    "WHERE h.state = 'settled' AND h.charged_micros > 0 AND (u.request_id IS NULL OR u.cost_micros <> h.charged_micros)"
)
CHARGED_TWICE = (
    "SELECT request_id FROM holds WHERE state = 'settled' AND charged_micros > 0 "
    "GROUP BY request_id HAVING COUNT(*) > 1"
)
JOB_HOLDS = "SELECT hold_id FROM jobs WHERE status IN ('queued', 'running') AND hold_id IS NOT NULL"
UNFINISHED_JOBS = "SELECT id, status, request_id FROM jobs WHERE status IN ('queued', 'running')"


@dataclass
class Books:
    credits: int
    balances: int
    holds: int
    """Open and reconciling holds, micro-USD."""
    revenue: int
    usage_cost: int
    lowest_balance: int
    states: dict[str, set[str]] = field(default_factory=dict)
    """hold state -> hold ids"""
    requests: dict[str, str] = field(default_factory=dict)
    """hold id -> its request id"""
    unrecorded: list[str] = field(default_factory=list)
    """Settled holds with a charge and no usage record of that cost."""
    charged_twice: list[str] = field(default_factory=list)
    """Requests charged by more than one hold (a job run again after it was charged)."""
    job_holds: set[str] = field(default_factory=set)
    """The holds of jobs still queued or running."""
    unfinished: list[tuple[str, str, str]] = field(default_factory=list)
    """(job id, status, request id) of the jobs still queued or running."""

    @property
    def unfinished_jobs(self) -> int:
        return len(self.unfinished)

    def ids(self, state: str) -> set[str]:
        return self.states.get(state, set())

    def assert_balanced(self, *, at_rest: bool = True) -> None:
        """credits = balances + holds + revenue exactly; at rest also: every charge has
        its usage record and the usage records add up to the revenue."""
        assert self.credits == self.balances + self.holds + self.revenue, self
        assert self.lowest_balance >= 0, self
        if at_rest:
            assert self.unrecorded == [], self.unrecorded[:10]
            assert self.charged_twice == [], self.charged_twice[:10]
            assert self.usage_cost == self.revenue, (self.usage_cost, self.revenue)


def _books(cur: Any) -> Books:
    cur.execute(TOTALS)
    credits, balances, holds, revenue, usage_cost, lowest = (int(v) for v in cur.fetchone())
    books = Books(credits, balances, holds, revenue, usage_cost, lowest)
    cur.execute(HOLDS)
    for hold_id, state, request_id in cur.fetchall():
        books.states.setdefault(str(state), set()).add(str(hold_id))
        books.requests[str(hold_id)] = str(request_id)
    cur.execute(UNRECORDED)
    books.unrecorded = [str(r[0]) for r in cur.fetchall()]
    cur.execute(CHARGED_TWICE)
    books.charged_twice = [str(r[0]) for r in cur.fetchall()]
    cur.execute(JOB_HOLDS)
    books.job_holds = {str(r[0]) for r in cur.fetchall()}
    cur.execute(UNFINISHED_JOBS)
    books.unfinished = [(str(a), str(b), str(c)) for a, b, c in cur.fetchall()]
    return books


def read_books(data_dir: Path, dsn: str | None) -> Books:
    """The books of the gateway whose data folder is ``data_dir`` (SQLite) or whose
    database is ``dsn`` (PostgreSQL), read in one transaction."""
    if dsn is None:
        conn = sqlite3.connect(f"file:{data_dir / 'bourse.db'}?mode=ro", uri=True, timeout=30)
        try:
            lite = conn.cursor()
            lite.execute("BEGIN")
            return _books(lite)
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(dsn, connect_timeout=10) as pg, pg.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return _books(cur)
