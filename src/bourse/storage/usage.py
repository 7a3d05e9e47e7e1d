"""Usage records (a request's receipt as stored, table ``usage``): the transactions
that write and page them. A record is written with its hold's close
(:mod:`bourse.storage.ledger`) or alone (``put_usage``).
"""

from __future__ import annotations

from typing import Any

import orjson

from bourse.ports.stores import UsageRecord
from bourse.storage.executor import Executor, Row

USAGE_UPSERT = (
    "INSERT INTO usage (request_id, account_id, product, created_at, outcome, cost_micros, record) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7) "
    "ON CONFLICT (request_id) DO UPDATE SET outcome = excluded.outcome, cost_micros = excluded.cost_micros, "
    "record = excluded.record"
)


def usage_row(row: Row) -> UsageRecord:
    return UsageRecord(
        request_id=row["request_id"],
        account_id=row["account_id"],
        product=row["product"],
        created_at=float(row["created_at"]),
        outcome=row["outcome"],
        cost_micros=int(row["cost_micros"]),
        record=orjson.loads(row["record"]),
    )


def put_usage(db: Executor, usage: UsageRecord) -> None:
    db.execute(
        USAGE_UPSERT,
        usage.request_id, usage.account_id, usage.product, usage.created_at, usage.outcome,
        usage.cost_micros, orjson.dumps(dict(usage.record)).decode(),
    )  # fmt: skip


def usage_page(
    db: Executor,
    account_id: str,
    limit: int,
    before: float | None,
    since: float | None,
    until: float | None,
    after: str | None,
) -> list[UsageRecord]:
    args: list[Any] = [account_id]
    where = ["account_id = $1"]
    for op, value in (("<", before), (">=", since), ("<=", until)):
        if value is not None:
            args.append(value)
            where.append(f"created_at {op} ${len(args)}")
    if after is not None:
        # keyset cursor: strictly after the record ``after`` in (created_at, request_id) order
        row = db.fetchrow(
            "SELECT created_at FROM usage WHERE account_id = $1 AND request_id = $2", account_id, after
        )
        if row is None:
            return []
        args.extend((row["created_at"], after))
        t, r = len(args) - 1, len(args)
        where.append(f"(created_at < ${t} OR (created_at = ${t} AND request_id < ${r}))")
    sql = (
        f"SELECT * FROM usage WHERE {' AND '.join(where)} ORDER BY created_at DESC, request_id DESC "
        f"LIMIT {max(1, min(limit, 1000))}"
    )
    return [usage_row(r) for r in db.fetch(sql, *args)]
