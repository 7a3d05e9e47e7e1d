"""The reporting port (:class:`~bourse.ports.reports.ReportStore`) over the SQL stores.

Read-only queries across accounts for the dashboard and the operator's CSV export,
written once for SQLite and PostgreSQL. The two differ in one place: reading the key
id out of a usage record's JSON text (``json_extract`` against ``->>``) and rounding
a time down to its bucket; :data:`_DIALECTS` holds both spellings. Each query runs
as one read on the store's database thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bourse.domain.values import immutable
from bourse.ports.reports import SpendPoint, UsageFilter
from bourse.ports.stores import Account, Job, JobStatus, UsageRecord
from bourse.storage.accounts import account
from bourse.storage.executor import Executor
from bourse.storage.jobs import job_row
from bourse.storage.sql import SqlStore
from bourse.storage.sqlite import SqliteStore
from bourse.storage.usage import usage_row

MAX_ROWS = 1000
"""The most rows one call returns (callers page with the keyset cursor)."""


@immutable
class _Dialect:
    key_id: str
    """The SQL expression of a usage record's key id."""
    bucket: str
    """The SQL expression of ``created_at`` rounded down to ``{b}`` seconds."""


_DIALECTS = {
    "sqlite": _Dialect("json_extract(record, '$.key_id')", "CAST(created_at / {b} AS INTEGER) * {b}"),
    "postgres": _Dialect("(record::jsonb ->> 'key_id')", "FLOOR(created_at / {b}) * {b}"),
}


def _where(d: _Dialect, f: UsageFilter) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    args: list[Any] = []
    for column, value in (
        ("account_id", f.account_id),
        (d.key_id, f.key_id),
        ("product", f.product),
        ("outcome", f.outcome),
    ):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    for op, t in ((">=", f.since), ("<=", f.until)):
        if t is not None:
            args.append(t)
            where.append(f"created_at {op} ${len(args)}")
    return where, args


def _usage_rows(
    db: Executor, d: _Dialect, f: UsageFilter, limit: int, after: str | None
) -> list[UsageRecord]:
    where, args = _where(d, f)
    if after is not None:
        row = db.fetchrow("SELECT created_at FROM usage WHERE request_id = $1", after)
        if row is None:
            return []
        args.extend((row["created_at"], after))
        t, r = len(args) - 1, len(args)
        where.append(f"(created_at < ${t} OR (created_at = ${t} AND request_id < ${r}))")
    sql = "SELECT * FROM usage" + (" WHERE " + " AND ".join(where) if where else "")
    sql += f" ORDER BY created_at DESC, request_id DESC LIMIT {max(1, min(limit, MAX_ROWS))}"
    return [usage_row(r) for r in db.fetch(sql, *args)]


def _spend(db: Executor, d: _Dialect, f: UsageFilter, bucket_s: int) -> list[SpendPoint]:
    where, args = _where(d, f)
    b = max(1, int(bucket_s))
    sql = (
        f"SELECT {d.bucket.format(b=b)} AS t, account_id, {d.key_id} AS key_id, "
        "SUM(cost_micros) AS cost, COUNT(*) AS n FROM usage"
        + (" WHERE " + " AND ".join(where) if where else "")
        + f" GROUP BY {d.bucket.format(b=b)}, account_id, {d.key_id} ORDER BY t, account_id"
    )
    return [
        SpendPoint(float(r["t"]), r["account_id"], r["key_id"], int(r["cost"]), int(r["n"]))
        for r in db.fetch(sql, *args)
    ]


def _accounts(db: Executor, limit: int) -> list[Account]:
    ids = db.fetch(f"SELECT id FROM accounts ORDER BY id LIMIT {max(1, min(limit, MAX_ROWS))}")
    out = [account(db, r["id"]) for r in ids]
    return [a for a in out if a is not None]


def _jobs(db: Executor, account_id: str | None, status: str | None, limit: int) -> list[Job]:
    where: list[str] = []
    args: list[Any] = []
    for column, value in (("account_id", account_id), ("status", status)):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    sql = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
    sql += f" ORDER BY created_at DESC, id DESC LIMIT {max(1, min(limit, MAX_ROWS))}"
    return [job_row(r) for r in db.fetch(sql, *args)]


class SqlReports:
    """:class:`~bourse.ports.reports.ReportStore` on the database of ``store``."""

    def __init__(self, store: SqlStore) -> None:
        self._store = store
        self._d = _DIALECTS["sqlite" if isinstance(store, SqliteStore) else "postgres"]

    async def accounts(self, limit: int) -> Sequence[Account]:
        return await self._store._read(_accounts, limit)

    async def usage_rows(
        self, where: UsageFilter, *, limit: int, after: str | None = None
    ) -> Sequence[UsageRecord]:
        return await self._store._read(_usage_rows, self._d, where, limit, after)

    async def spend(self, where: UsageFilter, bucket_s: int) -> Sequence[SpendPoint]:
        return await self._store._read(_spend, self._d, where, bucket_s)

    async def jobs(self, account_id: str | None, status: JobStatus | None, limit: int) -> Sequence[Job]:
        return await self._store._read(_jobs, account_id, status, limit)
