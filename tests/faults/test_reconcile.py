"""An operator's decision on a reconciling hold leaves the usage history and the ledger
in agreement, over SQLite and PostgreSQL, through the served gateway's admin API:

- settling a hold that went to ``reconciling`` for missing usage, or that a crashed
  gateway left behind without any usage record, writes the charge into the request's
  usage record: the sum of the usage records' costs is the account's spend;
- releasing one records that nothing was charged;
- an amount above the hold is a 400 and changes nothing;
- and ``credits = balances + holds + revenue`` holds after each step.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bourse.ports.stores import Hold
from tests.faults.databases import DATABASES, database
from tests.support.databases import StoreFactory
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[server]
log_level = "warning"

[products.rec]
missing_usage = "reconcile"
[[products.rec.deployments]]
engine = "sim"
slots = 4
floor = 1.0
omit_usage = true
output_tokens = 12
"""
USER = [{"role": "user", "content": "Tell me something about rivers."}]
WAIT_S = 15.0


@pytest.fixture(scope="module", params=DATABASES)
def gw(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    with database(request.param) as dsn, running_gateway(CONFIG, database=dsn) as g:
        g.extra["dsn"] = dsn
        yield g


_n = 0


def _account(gw: Gateway) -> tuple[str, dict[str, str]]:
    """A new account with 1 USD and its key's auth header."""
    global _n
    _n += 1
    account = f"rec-{_n}"
    return account, {"authorization": f"Bearer {gw.new_account(account, 1.0)}"}


def _holds(gw: Gateway, account: str, state: str) -> list[dict[str, Any]]:
    r = gw.admin("GET", "/admin/holds", params={"account": account, "state": state})
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def _wait_reconciling(gw: Gateway, account: str, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + WAIT_S
    while True:
        holds = _holds(gw, account, "reconciling")
        if len(holds) >= n or time.monotonic() > deadline:
            assert len(holds) == n, holds
            return holds
        time.sleep(0.02)


def _usage_records(gw: Gateway, auth: dict[str, str]) -> dict[str, dict[str, Any]]:
    r = httpx.get(gw.url + "/v1/usage", params={"limit": "100"}, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    return {rec["id"]: rec for rec in r.json()["data"]}


def _assert_books(gw: Gateway, account: str, auth: dict[str, str]) -> dict[str, Any]:
    """The ledger balances, the account's books add up, and its spend is the sum of its
    usage records' costs (every charge has its usage record)."""
    led = gw.ledger()
    assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"], led
    assert led["balanced"] is True, led
    a = gw.admin("GET", f"/admin/accounts/{account}").json()
    assert a["credited_micros"] == (
        a["balance_micros"] + a["open_holds_micros"] + a["reconciling_micros"] + a["spent_micros"]
    ), a
    records = _usage_records(gw, auth)
    assert sum(int(rec["usage"]["cost_micros"]) for rec in records.values()) == a["spent_micros"], (
        a,
        records,
    )
    out: dict[str, Any] = a
    return out


def _reconciling_for_missing_usage(gw: Gateway, account: str, auth: dict[str, str]) -> dict[str, Any]:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "rec", "messages": USER, "max_tokens": 30},
        headers=auth,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    (hold,) = _wait_reconciling(gw, account, 1)
    assert hold["request_id"] == r.headers["x-request-id"], hold
    return hold


def _orphan(gw: Gateway, account: str, amount: int) -> dict[str, Any]:
    """A hold left open by a gateway that died, gone to reconciling (no usage record),
    written through a second store on the gateway's database."""
    target = gw.extra["dsn"] or str(Path(gw.data_dir) / "bourse.db")
    factory = StoreFactory("sqlite" if gw.extra["dsn"] is None else "postgres", target)
    hold = Hold(
        id="hold_" + os.urandom(12).hex(),
        account_id=account,
        request_id="chatcmpl-" + os.urandom(12).hex(),
        amount_micros=amount,
        state="open",
        owner="gw_dead",
        product="rec",
        created_at=time.time(),
    )

    async def make() -> None:
        async with factory() as store:
            await store.place_hold(hold)
            await store.to_reconciling(hold.id, None, "open when its gateway stopped", time.time())

    asyncio.run(make())
    (view,) = _wait_reconciling(gw, account, 1)
    assert view["id"] == hold.id, view
    return view


def test_settling_a_reconciling_hold_writes_the_charge_into_its_usage_record(gw: Gateway) -> None:
    account, auth = _account(gw)
    hold = _reconciling_for_missing_usage(gw, account, auth)
    before = _usage_records(gw, auth)[hold["request_id"]]
    assert before["usage"]["cost_micros"] == 0, before
    charge = hold["amount_micros"] // 2
    r = gw.admin("POST", f"/admin/holds/{hold['id']}/settle", json={"amount_micros": charge})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["charged_micros"]) == ("settled", charge)
    rec = _usage_records(gw, auth)[hold["request_id"]]
    assert rec["usage"]["cost_micros"] == charge and rec["receipt"]["cost_micros"] == charge, rec
    assert rec["reconciliation"]["action"] == "settled", rec
    assert rec["usage"]["prompt_tokens"] == before["usage"]["prompt_tokens"], rec
    one = httpx.get(gw.url + f"/v1/usage/{hold['request_id']}", headers=auth, timeout=30).json()
    assert one == rec
    a = _assert_books(gw, account, auth)
    assert a["spent_micros"] == charge and a["reconciling_micros"] == 0, a


def test_settling_an_orphaned_hold_writes_a_usage_record(gw: Gateway) -> None:
    account, auth = _account(gw)
    hold = _orphan(gw, account, 700)
    assert hold["request_id"] not in _usage_records(gw, auth)
    _assert_books(gw, account, auth)
    r = gw.admin("POST", f"/admin/holds/{hold['id']}/settle", json={})  # default: the whole hold
    assert r.status_code == 200, r.text
    assert r.json()["charged_micros"] == 700
    rec = _usage_records(gw, auth)[hold["request_id"]]
    assert rec["usage"]["cost_micros"] == 700 and rec["model"] == "rec", rec
    assert rec["outcome"] == "reconciling" and rec["reconciliation"]["action"] == "settled", rec
    a = _assert_books(gw, account, auth)
    assert a["spent_micros"] == 700, a


def test_releasing_a_reconciling_hold_records_that_nothing_was_charged(gw: Gateway) -> None:
    account, auth = _account(gw)
    hold = _orphan(gw, account, 300)
    r = gw.admin("POST", f"/admin/holds/{hold['id']}/release", json={})
    assert r.status_code == 200, r.text
    rec = _usage_records(gw, auth)[hold["request_id"]]
    assert rec["usage"]["cost_micros"] == 0 and rec["reconciliation"]["action"] == "released", rec
    a = _assert_books(gw, account, auth)
    assert a["spent_micros"] == 0 and a["balance_micros"] == 1_000_000, a


@pytest.mark.parametrize("over", [1, 10**6])
def test_an_amount_above_the_hold_is_400_and_changes_nothing(gw: Gateway, over: int) -> None:
    account, auth = _account(gw)
    hold = _reconciling_for_missing_usage(gw, account, auth)
    records, ledger = _usage_records(gw, auth), gw.ledger()
    acc = gw.admin("GET", f"/admin/accounts/{account}").json()
    r = gw.admin(
        "POST", f"/admin/holds/{hold['id']}/settle", json={"amount_micros": hold["amount_micros"] + over}
    )
    err = assert_error_envelope(r, 400, "invalid_request")
    assert err["param"] == "amount_micros", err
    assert _holds(gw, account, "reconciling") == [hold]
    assert _usage_records(gw, auth) == records
    assert gw.ledger() == ledger
    assert gw.admin("GET", f"/admin/accounts/{account}").json() == acc
    # the whole hold is still a valid amount
    r = gw.admin("POST", f"/admin/holds/{hold['id']}/settle", json={"amount_micros": hold["amount_micros"]})
    assert r.status_code == 200, r.text
    a = _assert_books(gw, account, auth)
    assert a["spent_micros"] == hold["amount_micros"], a
