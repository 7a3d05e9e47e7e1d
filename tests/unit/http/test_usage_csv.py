"""The CSV of usage records: cells, the formula guard, and the export's paging."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

import pytest

from bourse.http import usage_csv
from bourse.ports.reports import SpendPoint, UsageFilter
from bourse.ports.stores import Account, Job, JobStatus, UsageRecord

pytestmark = pytest.mark.anyio


def _rec(rid: str, **doc: Any) -> UsageRecord:
    return UsageRecord(rid, "acme", "p", 1.0, "completed", 7, {"id": rid, **doc})


def test_a_row_follows_the_record() -> None:
    rec = _rec(
        "r1", created=1700000000, key_id="key_1", model="p", outcome="completed",
        usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "cost_micros": 7, "cost": 7e-06,
               "x_market": {"bid": 0.2, "cleared_price": 0.1, "level": None, "queued_ms": 1.5, "deployment": "p/0"}},
        receipt={"ttft_ms": 12.25, "latency_ms": 40.0, "quote_micros": 99},
    )  # fmt: skip
    row = dict(zip(usage_csv.header(), usage_csv.row(rec), strict=True))
    assert row["request_id"] == "r1" and row["account"] == "acme" and row["key_id"] == "key_1"
    assert row["cost_usd"] == "0.000007" and float(row["cost_usd"]) == 7e-06
    assert row["level"] == "" and row["usage_estimated"] == ""
    assert (row["bid"], row["cleared_price"]) == ("0.200000", "0.100000")
    assert (row["ttft_ms"], row["quote_micros"]) == ("12.25", "99")
    assert (row["reconciled"], row["reconciled_at"]) == ("", "")


@pytest.mark.parametrize(
    ("micros", "cost", "usd"),
    [
        (3, 3e-06, "0.000003"),
        (0, 0.0, "0.000000"),
        (1_000_000, 1.0, "1.000000"),
        (1_234_567_891, 1234.567891, "1234.567891"),
        # past 2**53 micro-USD the float has lost the last digit; the integer has not
        (12_345_678_901_234_567, 12345678901.234567, "12345678901.234567"),
    ],
)
def test_usd_is_written_with_six_decimals_from_the_micros(micros: int, cost: float, usd: str) -> None:
    rec = _rec(
        "r4", usage={"cost_micros": micros, "cost": cost, "x_market": {"bid": 3e-06, "cleared_price": 1e-06}}
    )
    row = dict(zip(usage_csv.header(), usage_csv.row(rec), strict=True))
    assert row["cost_usd"] == usd
    assert (row["bid"], row["cleared_price"]) == ("0.000003", "0.000001")


def test_a_float_usd_without_its_micros_is_rounded_to_the_micro_usd() -> None:
    rec = _rec("r5", usage={"cost": 2.5e-05, "x_market": {"bid": 0.1 + 0.2, "cleared_price": 1e-07}})
    row = dict(zip(usage_csv.header(), usage_csv.row(rec), strict=True))
    assert (row["cost_usd"], row["bid"], row["cleared_price"]) == ("0.000025", "0.300000", "0.000000")


def test_other_numbers_are_never_in_scientific_notation() -> None:
    rec = _rec("r6", usage={"x_market": {"queued_ms": 1e-05}}, receipt={"ttft_ms": 1.5e16})
    row = dict(zip(usage_csv.header(), usage_csv.row(rec), strict=True))
    assert (row["queued_ms"], row["ttft_ms"]) == ("0.00001", "15000000000000000")


def test_a_deadline_orders_start_bid_and_deadline_have_their_columns() -> None:
    rec = _rec(
        "r8", usage={"x_market": {"bid": 0.9, "start_bid": 0.4, "deadline_s": 7.5, "cleared_price": 0.35}}
    )
    row = dict(zip(usage_csv.header(), usage_csv.row(rec), strict=True))
    assert (row["bid"], row["start_bid"], row["cleared_price"]) == ("0.900000", "0.400000", "0.350000")
    assert row["deadline_s"] == "7.5"
    fixed = dict(
        zip(usage_csv.header(), usage_csv.row(_rec("r9", usage={"x_market": {"bid": 0.2}})), strict=True)
    )
    assert (fixed["start_bid"], fixed["deadline_s"]) == ("", "")


def test_an_operators_close_of_a_hold_follows_the_older_columns() -> None:
    rec = _rec(
        "r7", outcome="reconciling", usage={"cost_micros": 0, "cost": 0.0},
        reconciliation={"action": "released", "charged_micros": 0, "at": 1700000123.5, "note": "crash"},
    )  # fmt: skip
    header = usage_csv.header()
    at = header.index("quote_micros")
    assert header[at + 1 : at + 3] == ["reconciled", "reconciled_at"]
    assert header[-2:] == ["start_bid", "deadline_s"]  # new columns at the end
    row = dict(zip(header, usage_csv.row(rec), strict=True))
    assert (row["outcome"], row["reconciled"], row["reconciled_at"]) == (
        "reconciling",
        "released",
        "1700000123.5",
    )


def test_cells_that_a_spreadsheet_would_run_are_quoted() -> None:
    rec = _rec(
        "r2",
        model="=HYPERLINK(1)",
        endpoint="@SUM",
        outcome="-1",
        key_id="+x",
        usage={"usage_estimated": True},
    )
    row = dict(zip(usage_csv.header(), usage_csv.row(rec), strict=True))
    assert (row["model"], row["endpoint"], row["outcome"], row["key_id"]) == (
        "'=HYPERLINK(1)",
        "'@SUM",
        "'-1",
        "'+x",
    )
    assert row["usage_estimated"] == "true"
    text = usage_csv.render([_rec("r3", model='a "quoted", name\nnext')])
    back = list(csv.reader(io.StringIO(text)))
    assert back[1][usage_csv.header().index("model")] == 'a "quoted", name\nnext'


class Rows:
    """A report store of ``n`` usage rows (newest first), paged by the cursor."""

    def __init__(self, n: int) -> None:
        self.rows = [_rec(f"r{i:05d}") for i in range(n, 0, -1)]
        self.calls = 0

    async def usage_rows(
        self, where: UsageFilter, *, limit: int, after: str | None = None
    ) -> Sequence[UsageRecord]:
        self.calls += 1
        start = 0 if after is None else [r.request_id for r in self.rows].index(after) + 1
        return self.rows[start : start + limit]

    async def accounts(self, limit: int) -> Sequence[Account]:
        return []

    async def spend(self, where: UsageFilter, bucket_s: int) -> Sequence[SpendPoint]:
        return []

    async def jobs(self, account_id: str | None, status: JobStatus | None, limit: int) -> Sequence[Job]:
        return []


@pytest.mark.parametrize("n", [0, 1, usage_csv.EXPORT_PAGE, 2 * usage_csv.EXPORT_PAGE + 17])
async def test_the_export_streams_every_row_once(n: int) -> None:
    store = Rows(n)
    text = "".join([part async for part in usage_csv._pages(store, UsageFilter())])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["request_id"] for r in rows] == [r.request_id for r in store.rows]
    assert store.calls == n // usage_csv.EXPORT_PAGE + 1
