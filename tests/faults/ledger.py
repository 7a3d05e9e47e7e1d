"""The books read straight from a gateway's database (its SQLite file or a PostgreSQL
database), independently of the gateway, which may be dead (after ``kill -9``).

:func:`read_books` takes one consistent snapshot (one read transaction):
credits, balances, holds by state, revenue, the usage records' costs, the charges
without their usage record, and the holds of jobs not yet finished.
:meth:`Books.assert_balanced` is the money invariant: credits = balances + holds +
revenue, to the micro-USD, no balance below 0, and (at rest) every charge has its
usage record, no request is charged twice, and the usage records add up to the revenue.

:func:`check_ledger` is the suite's ten invariants in one check, run on every
gateway's database after every fault test (tests/faults/conftest.py):

1. credits = balances + open and reconciling holds + charges, overall and per account;
2. no negative balance;
3. no charge above its hold;
4. every charge has its usage record of that cost, and every charged usage record its charge;
5. no request charged twice;
6. each capped key's spend counter = what its holds of the current period hold or charged,
   and each capped account's = what its holds counted on its cap in its period do;
7. job and hold states agree (a finished job's hold is not open; a job's hold is of its request);
8. each usage record's document says the cost of its column;
9. a settled hold's charge is a whole number of micro-USD at or above 0 (no hold amount below 0);
10. each account row's own totals (credited, pending, posted) equal the sums they stand
    for (its credits; its open and reconciling holds; its settled and pruned charges).

Records deleted by retention (``[storage] retention_s``) count through the sums kept in
their place: ``pruned`` (per account: its charges are revenue, its usage costs usage
records' costs), ``pruned_key_spend`` and ``pruned_account_spend`` (per capped key or
account and period: charges its spend counter still counts).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bourse.storage.usage_codec import decode

T = TypeVar("T")

TOTALS = (
    "SELECT "
    "COALESCE((SELECT SUM(amount_micros) FROM credits), 0), "
    "COALESCE((SELECT SUM(balance_micros) FROM accounts), 0), "
    "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE state IN ('open', 'reconciling')), 0), "
    "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE state = 'settled'), 0) "
    "+ COALESCE((SELECT SUM(charged_micros) FROM pruned), 0), "
    "COALESCE((SELECT SUM(cost_micros) FROM usage), 0) + COALESCE((SELECT SUM(usage_cost_micros) FROM pruned), 0), "
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


def in_snapshot(data_dir: Path, dsn: str | None, read: Callable[[Any], T]) -> T:
    """``read(cursor)`` in one read transaction on the gateway's database: the data
    folder's SQLite file (``dsn`` None) or the PostgreSQL database ``dsn``."""
    if dsn is None:
        conn = sqlite3.connect(f"file:{data_dir / 'bourse.db'}?mode=ro", uri=True, timeout=30)
        try:
            lite = conn.cursor()
            lite.execute("BEGIN")
            return read(lite)
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(dsn, connect_timeout=10) as pg, pg.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return read(cur)


def read_books(data_dir: Path, dsn: str | None) -> Books:
    """The books of the gateway whose data folder is ``data_dir`` (SQLite) or whose
    database is ``dsn`` (PostgreSQL), read in one transaction."""
    return in_snapshot(data_dir, dsn, _books)


# -- the ten invariants ---------------------------------------------------------------

PER_ACCOUNT = (
    "SELECT a.id, a.balance_micros, a.credited_micros, a.pending_micros, a.posted_micros, "
    "COALESCE((SELECT SUM(amount_micros) FROM credits c WHERE c.account_id = a.id), 0), "
    "COALESCE((SELECT SUM(amount_micros) FROM holds h WHERE h.account_id = a.id "
    "AND h.state IN ('open', 'reconciling')), 0), "
    "COALESCE((SELECT SUM(charged_micros) FROM holds h WHERE h.account_id = a.id AND h.state = 'settled'), 0) "
    "+ COALESCE((SELECT charged_micros FROM pruned p WHERE p.account_id = a.id), 0) "
    "FROM accounts a"
)
ABOVE_HOLD = (
    "SELECT id FROM holds WHERE charged_micros > amount_micros OR charged_micros < 0 OR amount_micros < 0"
)
UNCHARGED_RECORDS = (
    "SELECT u.request_id FROM usage u WHERE u.cost_micros > 0 AND NOT EXISTS ("
    "SELECT 1 FROM holds h WHERE h.request_id = u.request_id AND h.state = 'settled' "
    "AND h.charged_micros = u.cost_micros)"
)
KEY_CAPS = (
    "SELECT k.id, k.spend_micros, COALESCE((SELECT SUM(CASE WHEN h.state IN ('open', 'reconciling') "
    "THEN h.amount_micros WHEN h.state = 'settled' THEN h.charged_micros ELSE 0 END) FROM holds h "
    "WHERE h.key_id = k.id AND h.spend_period = k.spend_period), 0) "
    "+ COALESCE((SELECT charged_micros FROM pruned_key_spend p WHERE p.key_id = k.id "
    "AND p.spend_period = k.spend_period), 0) "
    "FROM api_keys k WHERE k.spend_cap_micros IS NOT NULL"
)
ACCOUNT_CAPS = (
    "SELECT a.id, a.spend_micros, COALESCE((SELECT SUM(CASE WHEN h.state IN ('open', 'reconciling') "
    "THEN h.amount_micros WHEN h.state = 'settled' THEN h.charged_micros ELSE 0 END) FROM holds h "
    "WHERE h.account_id = a.id AND h.account_period = a.spend_period), 0) "
    "+ COALESCE((SELECT charged_micros FROM pruned_account_spend p WHERE p.account_id = a.id "
    "AND p.spend_period = a.spend_period), 0) "
    "FROM accounts a WHERE a.spend_cap_micros IS NOT NULL"
)
FINISHED_JOB_HOLDS = (
    "SELECT j.id, j.status, h.state, h.request_id, j.request_id FROM jobs j JOIN holds h ON h.id = j.hold_id "
    "WHERE (j.status NOT IN ('queued', 'running') AND h.state = 'open') OR h.request_id <> j.request_id"
)
RECORDS = "SELECT request_id, cost_micros, record, product, created_at FROM usage"


def _per_account(cur: Any) -> list[str]:
    """Invariants 1 (per account), 2 and 10."""
    out: list[str] = []
    cur.execute(PER_ACCOUNT)
    for account, balance, *kept, credited, held, charged in cur.fetchall():
        if [int(v) for v in kept] != [int(credited), int(held), int(charged)]:
            out.append(f"10: account {account}: its row's credited, pending, posted {kept} "
                       f"!= the sums {[credited, held, charged]}")  # fmt: skip
        if int(credited) != int(balance) + int(held) + int(charged):
            out.append(f"1: account {account}: credits {credited} != {balance} + {held} + {charged}")
        if int(balance) < 0:
            out.append(f"2: account {account} balance {balance} < 0")
    return out


def violations(cur: Any) -> tuple[list[str], list[str]]:
    """What breaks the ten invariants in the snapshot ``cur`` reads: what no snapshot
    may show, and what may only for a moment while work finishes (a finished job's
    open hold)."""
    out: list[str] = []
    settling: list[str] = []
    books = _books(cur)
    if books.credits != books.balances + books.holds + books.revenue:
        out.append(f"1: credits {books.credits} != balances {books.balances} + holds {books.holds} "
                   f"+ charges {books.revenue}")  # fmt: skip
    out += _per_account(cur)
    cur.execute(ABOVE_HOLD)
    out += [f"3/9: hold {r[0]} charged above its amount (or below 0)" for r in cur.fetchall()]
    out += [f"4: settled hold {h} has no usage record of its charge" for h in books.unrecorded]
    cur.execute(UNCHARGED_RECORDS)
    out += [f"4: usage record {r[0]} has a cost and no settled hold of that charge" for r in cur.fetchall()]
    out += [f"5: request {r} charged twice" for r in books.charged_twice]
    cur.execute(KEY_CAPS)
    for key, counter, counted in cur.fetchall():
        if int(counter) != int(counted):
            out.append(f"6: key {key} spend counter {counter} != its holds' {counted}")
    cur.execute(ACCOUNT_CAPS)
    for account, counter, counted in cur.fetchall():
        if int(counter) != int(counted):
            out.append(f"6: account {account} spend counter {counter} != its holds' {counted}")
    cur.execute(FINISHED_JOB_HOLDS)
    for job, status, state, hold_request, job_request in cur.fetchall():
        if hold_request != job_request:
            out.append(f"7: job {job}'s hold is of request {hold_request}, not {job_request}")
        else:
            settling.append(f"7: job {job} is {status} and its hold still {state}")
    cur.execute(RECORDS)
    for request_id, cost, record, product, created_at in cur.fetchall():
        doc = decode(record, request_id, product, float(created_at))
        said = [
            part.get("cost_micros")
            for part in (doc.get("usage"), doc.get("receipt"))
            if isinstance(part, dict)
        ]
        if any(v is not None and v != int(cost) for v in said):
            out.append(f"8: usage record {request_id} says {said}, its column {cost}")
    if books.usage_cost != books.revenue:
        out.append(f"4: usage records cost {books.usage_cost} != charges {books.revenue}")
    return out, settling


def check_ledger(data_dir: Path, dsn: str | None, *, settle_s: float = 5.0) -> None:
    """Assert the ten invariants on a gateway's database. What holds in every snapshot
    is asserted at once; a finished job's open hold is given ``settle_s`` to close (the
    job's status is written before its hold is closed)."""
    deadline = time.monotonic() + settle_s
    while True:
        broken, settling = in_snapshot(data_dir, dsn, violations)
        assert not broken, f"ledger invariants broken ({len(broken)}): {(broken + settling)[:10]}"
        if not settling:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"ledger invariants broken at rest ({len(settling)}): {settling[:10]}")
        time.sleep(0.1)
