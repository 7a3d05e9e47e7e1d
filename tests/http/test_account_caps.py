"""An account's spend cap through the admin API, in process (issue 37, item 4): set at
``POST /admin/accounts`` and changed with ``PATCH /admin/accounts/{id}``, every bad
value a 400 naming its field (never a 500), the change audited with its actor and in
force here at once; a request past the cap, whichever key it comes by, is 402
``account_budget_exceeded`` saying it is the account's cap and when it starts again,
and takes nothing; the account views show the cap and what its period has taken."""

from __future__ import annotations

import calendar
import os
import time
from typing import Any

import pytest

from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope

pytestmark = pytest.mark.anyio


async def _account(gw: InProcessGateway, **fields: Any) -> str:
    account = "caps-" + os.urandom(4).hex()
    r = await gw.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": 1.0, **fields})
    assert r.status_code == 201, r.text
    return account


async def _key(gw: InProcessGateway, account: str, **fields: Any) -> str:
    r = await gw.admin("POST", "/admin/keys", json={"account": account, **fields})
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


async def _chat(gw: InProcessGateway, key: str, max_tokens: int = 4) -> Any:
    body = {"model": "default", "messages": USER, "max_tokens": max_tokens}
    return await gw.client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


BAD = [
    ({"spend_cap_usd": 0}, "spend_cap_usd"),
    ({"spend_cap_usd": -1}, "spend_cap_usd"),
    ({"spend_cap_usd": 1e-9}, "spend_cap_usd"),  # under one micro-USD
    ({"spend_cap_usd": 1e10}, "spend_cap_usd"),
    ({"spend_cap_usd": "5"}, "spend_cap_usd"),
    ({"spend_cap_usd": 1, "spend_cap_period": "year"}, "spend_cap_period"),
    ({"spend_cap_usd": 1, "spend_cap_period": 7}, "spend_cap_period"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_a_bad_cap_is_refused_at_create(
    gw: InProcessGateway, fields: dict[str, Any], param: str
) -> None:
    account = "caps-" + os.urandom(4).hex()
    r = await gw.admin("POST", "/admin/accounts", json={"id": account, **fields})
    assert assert_error_envelope(r, 400, "invalid_request")["param"] == param
    assert (await gw.admin("GET", f"/admin/accounts/{account}")).status_code == 404


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        *BAD,
        ({"spend_cap_period": None}, "spend_cap_period"),
        ({"spend_cap_period": "day"}, "spend_cap_period"),  # no cap to give a period to
        ({"balance_micros": 5}, "balance_micros"),
        ({}, None),
    ],
)
async def test_a_bad_edit_is_refused_and_changes_nothing(
    gw: InProcessGateway, fields: dict[str, Any], param: str | None
) -> None:
    account = await _account(gw)
    r = await gw.admin("PATCH", f"/admin/accounts/{account}", json=fields)
    assert assert_error_envelope(r, 400, "invalid_request")["param"] == param
    view = (await gw.admin("GET", f"/admin/accounts/{account}")).json()
    assert (view["spend_cap_micros"], view["spend_cap_period"]) == (None, None)
    assert (await gw.admin("GET", f"/admin/audit?target={account}&action=account.update")).json()[
        "data"
    ] == []


async def test_an_edit_of_no_account_or_a_closed_one(gw: InProcessGateway) -> None:
    r = await gw.admin("PATCH", "/admin/accounts/nobody-here", json={"spend_cap_usd": 1})
    assert_error_envelope(r, 404, "not_found")
    account = await _account(gw)
    assert (await gw.admin("POST", f"/admin/accounts/{account}/close", json={})).status_code == 200
    r = await gw.admin("PATCH", f"/admin/accounts/{account}", json={"spend_cap_usd": 1})
    assert_error_envelope(r, 409, "account_closed")
    assert_error_envelope(await gw.client.patch(f"/admin/accounts/{account}", json={}, headers=gw.headers),
                          403, "admin_only")  # fmt: skip


async def test_a_request_past_the_accounts_cap_is_402_whichever_key_and_takes_nothing(
    gw: InProcessGateway,
) -> None:
    account = await _account(gw, spend_cap_usd=0.000_120, spend_cap_period="day")  # 120 micro-USD a day
    first, second = await _key(gw, account), await _key(gw, account, spend_cap_usd=1)
    assert (await _chat(gw, first, max_tokens=4)).status_code == 200  # 51 tokens at 1 USD per 1M
    before = await gw.balance(account)
    r = await _chat(gw, second, max_tokens=100)  # its own cap is far: the account's refuses it
    err = assert_error_envelope(r, 402, "account_budget_exceeded")
    assert "account's spend cap is 120 micro-USD per UTC day, for all its keys" in err["message"], err
    now = time.time()
    midnight = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((now // 86_400 + 1) * 86_400))
    assert f"It starts again at {midnight} (the next UTC day)" in err["message"], err
    assert await gw.balance(account) == before
    view = (await gw.admin("GET", f"/admin/accounts/{account}")).json()
    assert (view["spend_cap_micros"], view["spend_cap_period"]) == (120, "day")
    assert 0 < view["spend_micros"] <= 51 and "spend_period" not in view
    assert view["spend_cap_resets_at"] == (now // 86_400 + 1) * 86_400
    mine = (await gw.client.get("/v1/account", headers={"authorization": f"Bearer {second}"})).json()
    assert {k: mine[k] for k in ("spend_cap_micros", "spend_cap_period", "spend_micros")} == {
        "spend_cap_micros": 120, "spend_cap_period": "day", "spend_micros": view["spend_micros"],
    }  # fmt: skip

    # raised: in force at once on this replica (its cached keys of the account dropped)
    r = await gw.admin("PATCH", f"/admin/accounts/{account}", json={"spend_cap_usd": 0.001})
    assert r.status_code == 200 and r.json()["spend_cap_micros"] == 1_000, r.text
    assert (await _chat(gw, second, max_tokens=100)).status_code == 200
    # a total cap says it never starts again; removed, nothing is counted
    r = await gw.admin("PATCH", f"/admin/accounts/{account}", json={"spend_cap_period": "total"})
    assert (r.json()["spend_cap_period"], r.json()["spend_micros"], r.json()["spend_cap_resets_at"]) == (
        "total", 0, None,
    )  # fmt: skip
    r = await gw.admin("PATCH", f"/admin/accounts/{account}", json={"spend_cap_usd": 0.000_050})
    err = assert_error_envelope(await _chat(gw, first, max_tokens=100), 402, "account_budget_exceeded")
    assert "50 micro-USD in total" in err["message"] and "does not start again" in err["message"], err
    r = await gw.admin("PATCH", f"/admin/accounts/{account}", json={"spend_cap_usd": None})
    assert (r.json()["spend_cap_micros"], r.json()["spend_cap_period"]) == (None, None)
    assert (await _chat(gw, first, max_tokens=100)).status_code == 200


async def test_the_cap_is_audited_with_its_actor(gw: InProcessGateway) -> None:
    bob = {**gw.admin_headers, "x-bourse-actor": "bob"}
    account = "caps-" + os.urandom(4).hex()
    body = {"id": account, "credit_usd": 1, "spend_cap_usd": 2.5, "spend_cap_period": "month"}
    r = await gw.client.post("/admin/accounts", json=body, headers=bob)
    assert r.status_code == 201, r.text
    y, m = time.gmtime()[:2]
    assert r.json()["spend_cap_resets_at"] == calendar.timegm((y + m // 12, m % 12 + 1, 1, 0, 0, 0))
    r = await gw.client.patch(f"/admin/accounts/{account}", json={"spend_cap_period": "week"}, headers=bob)
    assert r.status_code == 200, r.text
    rows = (await gw.admin("GET", f"/admin/audit?target={account}")).json()["data"]
    assert [(e["action"], e["actor"], e["detail"]) for e in rows] == [
        ("account.update", "admin:bob", {"spend_cap_period": "week"}),
        ("account.create", "admin:bob",
         {"credit_micros": 1_000_000, "spend_cap_micros": 2_500_000, "spend_cap_period": "month"}),
    ]  # fmt: skip
