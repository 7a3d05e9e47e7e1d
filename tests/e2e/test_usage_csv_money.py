"""The usage CSV's money and reconciliation columns, through the served gateway
(issue 37).

Before the fix a cost of a few micro-USD was written ``2e-05`` (a float's repr), and a
reconciling hold an operator settled or released through the admin API exported
``outcome=reconciling`` with no column saying it was closed. The CSV now writes USD
with six decimals from the record's integer micro-USD, and its last columns,
``reconciled`` and ``reconciled_at``, carry the operator's close that the admin call
wrote into the usage record.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.bodies import USER
from tests.support.config import Dep, Product, config_toml
from tests.support.gateway import Gateway, running_gateway
from tests.support.usage_rows import assert_row_is_record, parse_csv

PRODUCTS = [
    Product("cheap", [Dep("cheap-a", floor=1.0)]),
    # aigrid: a stream that ends without usage keeps its hold reconciling
    Product("grid", [Dep("grid-a", floor=1.0)], {"policy": "aigrid"}),
]
"""1 USD per 1M tokens: a request's cost in micro-USD is its token count."""


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(config_toml(PRODUCTS)) as g:
        yield g


def _admin_rows(gw: Gateway) -> dict[str, dict[str, str]]:
    r = gw.admin("GET", "/admin/usage.csv", params={"account": gw.account})
    assert r.status_code == 200, r.text
    return {row["request_id"]: row for row in parse_csv(r.text)}


def _own_rows(gw: Gateway) -> dict[str, dict[str, str]]:
    r = httpx.get(gw.v1 + "/usage", params={"format": "csv", "limit": "100"}, headers=gw.headers, timeout=30)
    assert r.status_code == 200, r.text
    return {row["request_id"]: row for row in parse_csv(r.text)}


def _record(gw: Gateway, rid: str) -> dict[str, Any]:
    r = httpx.get(gw.v1 + f"/usage/{rid}", headers=gw.headers, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _reconciling(gw: Gateway) -> tuple[str, str]:
    """A streamed request whose engine sent no usage: (its request id, its hold id)."""
    body = {"model": "grid", "messages": USER, "max_tokens": 8, "stream": True,
            "sim": {"omit_usage": True, "output_tokens": 5}}  # fmt: skip
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, headers=gw.headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        assert "[DONE]" in "".join(r.iter_text())
    deadline = time.monotonic() + 10
    while True:
        r = gw.admin(
            "GET", "/admin/holds", params={"account": gw.account, "state": "reconciling", "limit": "100"}
        )
        assert r.status_code == 200, r.text
        holds = [h for h in r.json()["data"] if h["request_id"] == rid]
        if holds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(holds) == 1, r.json()
    return rid, holds[0]["id"]


def test_a_tiny_cost_is_written_with_six_decimals(gw: Gateway) -> None:
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "cheap", "messages": USER, "max_tokens": 4},
        headers=gw.headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    rid, micros = r.headers["x-request-id"], r.json()["usage"]["cost_micros"]
    assert 0 < micros < 100, micros  # a few tokens at 1 USD per 1M
    for rows in (_own_rows(gw), _admin_rows(gw)):
        row = rows[rid]
        assert row["cost_usd"] == f"0.0000{micros:02d}", row
        assert row["cost_micros"] == str(micros)
        assert (row["bid"], row["cleared_price"]) == ("1.000000", "1.000000"), row
        assert (row["reconciled"], row["reconciled_at"]) == ("", ""), row
        assert_row_is_record(row, _record(gw, rid), gw.account)


@pytest.mark.parametrize("close", ["release", "settle"])
def test_an_operators_close_of_a_reconciling_hold_is_in_the_csv(gw: Gateway, close: str) -> None:
    rid, hold = _reconciling(gw)
    before = _admin_rows(gw)[rid]
    assert (before["outcome"], before["reconciled"], before["reconciled_at"]) == ("reconciling", "", "")
    t0 = time.time()
    r = gw.admin("POST", f"/admin/holds/{hold}/{close}", json={})
    assert r.status_code == 200, r.text
    charged = r.json()["charged_micros"]
    assert (charged == 0) == (close == "release"), r.json()
    record = _record(gw, rid)
    for rows in (_own_rows(gw), _admin_rows(gw)):
        row = rows[rid]
        assert row["reconciled"] == {"release": "released", "settle": "settled"}[close], row
        assert t0 - 1 <= float(row["reconciled_at"]) <= time.time() + 1, row
        # the outcome column is the record's outcome now: the run's own, kept after the
        # close (which the reconciled columns say)
        assert row["outcome"] == record["outcome"] == "reconciling", (row, record)
        assert row["cost_micros"] == str(charged)
        assert row["cost_usd"] == f"0.{charged:06d}", row
        assert_row_is_record(row, record, gw.account)
