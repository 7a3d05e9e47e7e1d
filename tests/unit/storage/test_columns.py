"""Each storage name is written once: the statements derived from the usage columns
(:data:`bourse.storage.usage.USAGE_COLUMNS`) and from a new hold's row
(:data:`bourse.storage.ledger.NEW_HOLD_ROW`) are checked here against their source,
and the sources against the migrated tables and the records they store."""

from __future__ import annotations

import dataclasses
import re

import pytest

from bourse.ports.stores import Hold, UsageRecord
from bourse.storage import ledger, postgres, usage
from bourse.storage.executor import Executor, values_list
from bourse.storage.sqlite import SqliteStore
from bourse.storage.usage_codec import encode

_INSERT = re.compile(r"INSERT INTO (\w+) \(([^)]*)\) (?:SELECT (.*?) (?:FROM|WHERE) |VALUES )")

USAGE = UsageRecord("req_1", "acct_1", "prod", 1_700_000_000.5, "ok", 42, {"receipt": {"cost_micros": 42}})
HOLD = Hold("h_1", "acct_1", "req_1", 500, "open", 0, "gw_1", "prod", 1_700_000_000.25, None, "k_1", None)


def _insert(sql: str) -> tuple[str, list[str], list[str]]:
    """The table, columns and (for INSERT ... SELECT) selected values of an insert."""
    match = _INSERT.search(sql)
    assert match is not None, sql
    values = [] if match.group(3) is None else match.group(3).split(", ")
    return match.group(1), match.group(2).split(", "), values


async def _table_columns(table: str) -> list[str]:
    store = SqliteStore(":memory:")
    await store.open()
    try:

        def read(db: Executor) -> list[str]:
            return [str(r["name"]) for r in db.fetch(f"PRAGMA table_info({table})")]

        return await store._read(read)
    finally:
        await store.close()


@pytest.mark.anyio
async def test_the_usage_columns_are_the_tables_and_the_records_fields() -> None:
    assert list(usage.USAGE_COLUMNS) == await _table_columns("usage")
    assert tuple(f.name for f in dataclasses.fields(UsageRecord)) == usage.USAGE_COLUMNS
    assert set(usage.USAGE_REWRITTEN) < set(usage.USAGE_COLUMNS)


def test_a_usage_records_values_follow_its_columns_and_read_back() -> None:
    values = usage.usage_values(USAGE)
    record = encode(dict(USAGE.record), USAGE.request_id, USAGE.product, USAGE.created_at)
    expected = [getattr(USAGE, c) for c in usage.USAGE_COLUMNS[:-1]] + [record]
    assert list(values) == expected
    assert usage.usage_row(dict(zip(usage.USAGE_COLUMNS, values, strict=True))) == USAGE


def test_every_usage_insert_lists_the_usage_columns() -> None:
    n = len(usage.USAGE_COLUMNS)
    one = usage._UPSERT
    many = usage._UPSERT_MANY.format(values=values_list(3, n))
    batch = postgres._USED.format(values=values_list(2, n + 1))
    for sql in (one, many, batch):
        table, columns, _ = _insert(sql)
        assert (table, tuple(columns)) == ("usage", usage.USAGE_COLUMNS), sql
    for sql in (one, many):
        assert sql.endswith(usage.USAGE_ON_CONFLICT), sql
    # postgres's batch inserts plainly (no speculative insertion's extra WAL record): a
    # record that exists breaks the statement, and its writes are made one by one
    assert "ON CONFLICT" not in batch and "ON CONFLICT" not in postgres._NEW_HOLDS
    assert f"VALUES {values_list(1, n)} " in one
    assert f"VALUES {values_list(3, n)} " in many
    # postgres's batch: column1 is the hold's id, the record's values follow
    assert _insert(batch)[2] == [f"column{i}" for i in range(2, n + 2)]
    for column in usage.USAGE_REWRITTEN:
        assert f"{column} = excluded.{column}" in usage.USAGE_ON_CONFLICT


@pytest.mark.anyio
async def test_a_new_holds_row_names_every_column_of_holds() -> None:
    columns = [c for c, _ in ledger.NEW_HOLD_ROW]
    assert columns == await _table_columns("holds")
    assert ", ".join(columns) == ledger.HOLD_COLUMNS
    fields = {f.name for f in dataclasses.fields(Hold)}
    assert set(ledger.HOLD_PARAMS) <= fields and set(ledger.HOLD_PARAMS) <= set(columns)
    named = {value for _, value in ledger.NEW_HOLD_ROW if value in fields}
    assert named == {*ledger.HOLD_PARAMS, "spend_period", "account_period"}


def _expected_values(param: str, spend_period: str, account_period: str) -> list[str]:
    """What each column of a new hold's row should be set to, read off NEW_HOLD_ROW."""
    spelled = {name: param.format(n) for n, name in enumerate(ledger.HOLD_PARAMS, 1)}
    spelled["spend_period"] = spend_period
    spelled["account_period"] = account_period
    return [spelled.get(value, value) for _, value in ledger.NEW_HOLD_ROW]


def test_every_hold_insert_sets_each_column_as_the_new_row_says() -> None:
    n = len(ledger.HOLD_PARAMS)
    single = ledger._INSERT_HOLD
    batch = ledger._INSERT_HOLDS.format(values=values_list(2, n))
    pg_batch = postgres._NEW_HOLDS.format(values=values_list(2, n))
    assert _insert(single) == (
        "holds",
        ledger.HOLD_COLUMNS.split(", "),
        _expected_values("${}", f"${n + 1}", f"${n + 2}"),
    )
    for sql in (batch, pg_batch):  # uncapped holds: no spend period, neither the key's nor the account's
        assert _insert(sql) == (
            "holds",
            ledger.HOLD_COLUMNS.split(", "),
            _expected_values("column{}", "NULL", "NULL"),
        )
        assert f"FROM (VALUES {values_list(2, n)}) AS v " in sql
    assert ledger.HOLD_PARAMS[ledger.HOLD_ACCOUNT_PARAM - 1] == "account_id"
    assert f"WHERE id = ${ledger.HOLD_ACCOUNT_PARAM})" in single
    assert f"WHERE id = column{ledger.HOLD_ACCOUNT_PARAM})" in pg_batch


def test_a_new_holds_values_follow_its_params_and_read_back() -> None:
    other = Hold("h_2", "acct_2", "req_2", 7, "open", key_id=None)
    assert ledger.hold_row_args([HOLD, other]) == [
        getattr(h, name) for h in (HOLD, other) for name in ledger.HOLD_PARAMS
    ]
    row = {c: getattr(HOLD, c, None) for c in ledger.HOLD_COLUMNS.split(", ")}
    assert ledger.hold_row(row) == HOLD
