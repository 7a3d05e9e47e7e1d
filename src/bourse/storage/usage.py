"""Usage records (a request's receipt as stored, table ``usage``): their columns,
written once in :data:`USAGE_COLUMNS`, and the transactions that write and page them.
A record is written with its hold's close (:mod:`bourse.storage.ledger`, and the
PostgreSQL ledger batch in :mod:`bourse.storage.postgres`, both built from the
statements here) or alone (``put_usage``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from bourse.ports.stores import UsageRecord
from bourse.storage.executor import Executor, Row, values_list
from bourse.storage.usage_codec import decode, encode

USAGE_COLUMNS = ("request_id", "account_id", "product", "created_at", "outcome", "cost_micros", "record")
"""The ``usage`` table's columns, in the order every insert of a record lists them and
:func:`usage_values` gives their values: each names a :class:`UsageRecord` field,
``record`` (last) stored as its compact JSON text (:mod:`bourse.storage.usage_codec`)."""
USAGE_REWRITTEN = ("outcome", "cost_micros", "record")
"""What a second write of a request's record replaces (its outcome and cost; whose and when stay)."""

USAGE_INSERT = f"INSERT INTO usage ({', '.join(USAGE_COLUMNS)}) "
"""The head of every insert of usage records (its rows follow: VALUES or a SELECT)."""
USAGE_ON_CONFLICT = "ON CONFLICT (request_id) DO UPDATE SET " + ", ".join(
    f"{c} = excluded.{c}" for c in USAGE_REWRITTEN
)
"""The tail of every insert of usage records: a request's record is written over."""
_UPSERT_MANY = USAGE_INSERT + "VALUES {values} " + USAGE_ON_CONFLICT
_UPSERT = _UPSERT_MANY.format(values=values_list(1, len(USAGE_COLUMNS)))
_PLAIN_FIELDS = operator.attrgetter(*USAGE_COLUMNS[:-1])


def usage_values(usage: UsageRecord) -> tuple[Any, ...]:
    """The record's values in :data:`USAGE_COLUMNS` order (``record`` as compact JSON text)."""
    return (
        *_PLAIN_FIELDS(usage),
        encode(usage.record, usage.request_id, usage.product, usage.created_at),
    )


def usage_row(row: Row) -> UsageRecord:
    request_id, product, created_at = row["request_id"], row["product"], float(row["created_at"])
    return UsageRecord(
        request_id=request_id,
        account_id=row["account_id"],
        product=product,
        created_at=created_at,
        outcome=row["outcome"],
        cost_micros=int(row["cost_micros"]),
        record=decode(row["record"], request_id, product, created_at),
    )


def put_usage(db: Executor, usage: UsageRecord) -> None:
    db.execute(_UPSERT, *usage_values(usage))


def put_usages(db: Executor, usages: Sequence[UsageRecord]) -> None:
    """Several records in one statement (each request once: one statement cannot write a row twice)."""
    args: list[Any] = []
    for u in usages:
        args += usage_values(u)
    db.execute(_UPSERT_MANY.format(values=values_list(len(usages), len(USAGE_COLUMNS))), *args)


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
