"""A key's own records and the admin API, from the app in process: GET /v1/account and
/v1/usage after a request, crediting, the ledger totals, a key's rate limit (429 with
``retry-after``) and the admin API's own errors (404, 409)."""

from __future__ import annotations

import os

import pytest

from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _account(gw: InProcessGateway, credit_usd: float = 1.0) -> tuple[str, str]:
    """A new account: (its id, its key)."""
    account = "acct-" + os.urandom(4).hex()
    return account, await gw.new_account(account, credit_usd)


async def test_the_account_view_after_a_request(gw: InProcessGateway) -> None:
    account, key = await _account(gw)
    r = await gw.post(CHAT, {"model": "default", "messages": USER, "seed": 1}, headers=_auth(key))
    assert r.status_code == 200, r.text
    cost = r.json()["usage"]["cost_micros"]
    view = (await gw.get("/v1/account", headers=_auth(key))).json()
    assert view["id"] == account and view["object"] == "bourse.account"
    assert view["credited_micros"] == 1_000_000
    assert view["spent_micros"] == cost
    assert view["balance_micros"] == 1_000_000 - cost
    assert view["balance_usd"] == view["balance_micros"] / 1_000_000
    assert (view["open_holds_micros"], view["reconciling_micros"], view["reconciling_holds"]) == (0, 0, [])
    assert view["key"]["products"] is None


async def test_usage_records_in_pages(gw: InProcessGateway) -> None:
    _, key = await _account(gw)
    rids = []
    for seed in (1, 2, 3):
        r = await gw.post(CHAT, {"model": "default", "messages": USER, "seed": seed}, headers=_auth(key))
        rids.append(r.headers["x-request-id"])
    first = (await gw.get("/v1/usage?limit=2", headers=_auth(key))).json()
    assert first["object"] == "list" and first["has_more"] is True and len(first["data"]) == 2
    rest = (await gw.get(f"/v1/usage?limit=2&after={first['next_after']}", headers=_auth(key))).json()
    assert rest["has_more"] is False and rest["next_after"] is None
    records = first["data"] + rest["data"]
    assert sorted(rec["id"] for rec in records) == sorted(rids)
    for rec in records:
        assert rec["object"] == "bourse.usage" and rec["outcome"] == "completed"
        assert rec["endpoint"] == CHAT and rec["model"] == "default"


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=ten", "since=yesterday"])
async def test_a_bad_usage_query_is_400(gw: InProcessGateway, query: str) -> None:
    assert_error_envelope(await gw.get(f"/v1/usage?{query}"), 400, "invalid_request")


async def test_credit_and_the_ledger_stays_balanced(gw: InProcessGateway) -> None:
    account, _ = await _account(gw, 0.5)
    r = await gw.admin("POST", f"/admin/accounts/{account}/credit", json={"amount_usd": 0.25})
    assert r.status_code == 200, r.text
    assert await gw.balance(account) == 750_000
    ledger = (await gw.admin("GET", "/admin/ledger")).json()
    assert ledger["balanced"] is True, ledger
    assert (
        ledger["credits_micros"]
        == ledger["balances_micros"] + ledger["holds_micros"] + ledger["revenue_micros"]
    )


async def test_a_key_over_its_requests_per_minute_is_429_with_retry_after(gw: InProcessGateway) -> None:
    account, _ = await _account(gw)
    key = await gw.new_key(account, rpm=1)
    body = {"model": "default", "messages": USER}
    assert (await gw.post(CHAT, body, headers=_auth(key))).status_code == 200
    r = await gw.post(CHAT, body, headers=_auth(key))
    err = assert_error_envelope(r, 429, "rate_limited")
    assert "retry" in err["message"]
    assert float(r.headers["retry-after"]) > 0


@pytest.mark.parametrize(
    ("method", "path", "json", "status", "code"),
    [
        ("GET", "/admin/accounts/no-such-account", None, 404, "not_found"),
        ("POST", "/admin/accounts/no-such-account/credit", {"amount_usd": 1}, 404, "not_found"),
        ("POST", "/admin/accounts", {"id": "test", "credit_usd": 1}, 409, "account_exists"),
        ("POST", "/admin/accounts", {"id": "has space"}, 400, "invalid_request"),
        ("POST", "/admin/keys", {"account": "no-such-account"}, 404, "not_found"),
        ("POST", "/admin/holds/hold_missing/release", None, 404, "not_found"),
        ("GET", "/admin/holds?state=lost", None, 400, "invalid_request"),
    ],
)
async def test_admin_errors(
    gw: InProcessGateway, method: str, path: str, json: object, status: int, code: str
) -> None:
    assert_error_envelope(await gw.admin(method, path, json=json), status, code)
