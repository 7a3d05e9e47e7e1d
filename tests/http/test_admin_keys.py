"""Keys and accounts through the admin API, in process: creating keys (unknown
products, expiry and cap refused with 400), listing keys and accounts in pages,
revoking and rotating (the replica that did it refuses the old secret at once), the
spend cap's 402, and the audit log of every action with its actor."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _account(gw: InProcessGateway, credit_usd: float = 1.0) -> str:
    account = "keys-" + os.urandom(4).hex()
    r = await gw.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": credit_usd})
    assert r.status_code == 201, r.text
    return account


async def _key(gw: InProcessGateway, account: str, **fields: Any) -> dict[str, Any]:
    r = await gw.admin("POST", "/admin/keys", json={"account": account, **fields})
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


async def _chat(gw: InProcessGateway, key: str, max_tokens: int = 4) -> Any:
    body = {"model": "default", "messages": USER, "max_tokens": max_tokens}
    return await gw.client.post(CHAT, json=body, headers=_auth(key))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"products": ["default", "nosuch"]}, "products"),
        ({"expires_at": 1_000_000.0}, "expires_at"),
        ({"expires_at": time.time() + 60, "expires_in_s": 60}, "expires_in_s"),
        ({"spend_cap_usd": 0}, "spend_cap_usd"),
        ({"spend_cap_usd": 1e-9}, "spend_cap_usd"),
        ({"spend_cap_usd": 1, "spend_cap_period": "year"}, "spend_cap_period"),
        ({"name": "bad\nname"}, "name"),
    ],
)
async def test_a_bad_key_is_refused_at_create(
    gw: InProcessGateway, fields: dict[str, Any], param: str
) -> None:
    account = await _account(gw)
    r = await gw.admin("POST", "/admin/keys", json={"account": account, **fields})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert err["param"] == param, err
    listed = await gw.admin("GET", f"/admin/keys?account={account}")
    assert listed.json()["data"] == []


async def test_unknown_products_are_named(gw: InProcessGateway) -> None:
    account = await _account(gw)
    r = await gw.admin("POST", "/admin/keys", json={"account": account, "products": ["nosuch", "default"]})
    assert "'nosuch'" in assert_error_envelope(r, 400)["message"]
    ok = await _key(gw, account, products=["default", "hips"], name="ci")
    assert (ok["products"], ok["name"], ok["state"]) == (["default", "hips"], "ci", "active")


async def test_keys_and_accounts_are_listed_in_pages_without_secrets(gw: InProcessGateway) -> None:
    account = await _account(gw)
    made = [await _key(gw, account, name=f"k{i}") for i in range(5)]
    r = await gw.admin("GET", f"/admin/keys?account={account}&limit=3")
    assert r.status_code == 200, r.text
    page = r.json()
    assert [k["name"] for k in page["data"]] == ["k4", "k3", "k2"]
    assert page["has_more"] is True
    r = await gw.admin("GET", f"/admin/keys?account={account}&limit=3&after={page['next_after']}")
    rest = r.json()
    assert [k["name"] for k in rest["data"]] == ["k1", "k0"]
    assert (rest["has_more"], rest["next_after"]) == (False, None)
    for row in page["data"] + rest["data"]:
        assert "key" not in row and "key_hash" not in row
        assert all(m["key"] not in str(row) for m in made)
        assert {"created_at", "last_used_at", "expires_at", "revoked_at", "spend_cap_micros"} <= set(row)

    ids: list[str] = []
    after = ""
    while True:
        r = await gw.admin("GET", "/admin/accounts?limit=2" + (f"&after={after}" if after else ""))
        assert r.status_code == 200, r.text
        doc = r.json()
        ids += [a["id"] for a in doc["data"]]
        if not doc["has_more"]:
            break
        after = doc["next_after"]
    assert ids == sorted(ids) and account in ids and len(ids) == len(set(ids))
    for bad in ("limit=0", "limit=501", "limit=x"):
        assert_error_envelope(await gw.admin("GET", f"/admin/keys?{bad}"), 400, "invalid_request")


async def test_revoke_and_rotate_take_effect_at_once_here(gw: InProcessGateway) -> None:
    account = await _account(gw)
    revoked = await _key(gw, account)
    assert (await _chat(gw, revoked["key"])).status_code == 200
    r = await gw.admin("POST", f"/admin/keys/{revoked['id']}/revoke", json={"reason": "leaked"})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["revoked_at"] is not None) == ("revoked", True)
    err = assert_error_envelope(await _chat(gw, revoked["key"]), 401, "invalid_api_key")
    assert err["message"] == "This API key was revoked."
    r = await gw.admin("POST", f"/admin/keys/{revoked['id']}/rotate", json={})
    assert_error_envelope(r, 409, "key_revoked")

    rotated = await _key(gw, account)
    assert (await _chat(gw, rotated["key"])).status_code == 200
    r = await gw.admin("POST", f"/admin/keys/{rotated['id']}/rotate", json={"grace_s": 0})
    assert r.status_code == 200, r.text
    fresh = r.json()
    assert fresh["id"] == rotated["id"] and fresh["key"] != rotated["key"]
    assert fresh["old_key_valid_until"] is None
    assert_error_envelope(await _chat(gw, rotated["key"]), 401, "invalid_api_key")
    assert (await _chat(gw, fresh["key"])).status_code == 200

    for path, body, status, code in [
        ("/admin/keys/key_nosuch/revoke", {}, 404, "not_found"),
        ("/admin/keys/key_nosuch/rotate", {}, 404, "not_found"),
        (f"/admin/keys/{fresh['id']}/rotate", {"grace_s": 8 * 86_400}, 400, "invalid_request"),
        (f"/admin/keys/{fresh['id']}/rotate", {"grace_s": -1}, 400, "invalid_request"),
    ]:
        assert_error_envelope(await gw.admin("POST", path, json=body), status, code)


async def test_an_expired_key_is_refused(gw: InProcessGateway) -> None:
    account = await _account(gw)
    key = await _key(gw, account, expires_in_s=0.3)
    assert key["expires_at"] == pytest.approx(time.time() + 0.3, abs=5)
    assert (await _chat(gw, key["key"])).status_code == 200
    deadline = time.monotonic() + 10
    while (r := await _chat(gw, key["key"])).status_code == 200:
        assert time.monotonic() < deadline, "the key never expired"
        await asyncio.sleep(0.05)
    assert "expired at" in assert_error_envelope(r, 401, "invalid_api_key")["message"]
    listed = (await gw.admin("GET", f"/admin/keys?account={account}")).json()["data"]
    assert [k["state"] for k in listed] == ["expired"]


async def test_a_request_past_the_keys_cap_is_402_and_takes_nothing(gw: InProcessGateway) -> None:
    account = await _account(gw)
    key = await _key(gw, account, spend_cap_usd=0.000_100)  # 100 micro-USD: 100 tokens at 1 USD per 1M
    before = await gw.balance(account)
    r = await _chat(gw, key["key"], max_tokens=100)
    err = assert_error_envelope(r, 402, "key_budget_exceeded")
    assert "spend cap is 100 micro-USD in total" in err["message"], err
    assert await gw.balance(account) == before
    assert (await _chat(gw, key["key"], max_tokens=4)).status_code == 200  # a small one (51 tokens) fits
    listed = (await gw.admin("GET", f"/admin/keys?account={account}")).json()["data"][0]
    assert 0 < listed["spend_micros"] <= 51
    assert listed["last_used_at"] is not None


async def test_every_admin_action_is_audited_with_its_actor(gw: InProcessGateway) -> None:
    alice = {**gw.admin_headers, "x-bourse-actor": "alice"}
    account = "audit-" + os.urandom(4).hex()
    r = await gw.client.post("/admin/accounts", json={"id": account, "credit_usd": 1}, headers=alice)
    assert r.status_code == 201, r.text
    assert (
        await gw.admin("POST", f"/admin/accounts/{account}/credit", json={"amount_usd": 2})
    ).status_code == 200
    key = await _key(gw, account, name="audited", spend_cap_usd=0.5)
    assert (await gw.admin("POST", f"/admin/keys/{key['id']}/rotate", json={"grace_s": 5})).status_code == 200
    assert (
        await gw.admin("POST", f"/admin/keys/{key['id']}/revoke", json={"reason": "done"})
    ).status_code == 200

    r = await gw.admin("GET", f"/admin/audit?target={account}")
    assert r.status_code == 200, r.text
    rows = r.json()["data"]
    assert [(e["action"], e["actor"]) for e in rows] == [
        ("account.credit", "admin"),
        ("account.create", "admin:alice"),
    ]
    assert rows[0]["detail"] == {"amount_micros": 2_000_000}
    rows = (await gw.admin("GET", f"/admin/audit?target={key['id']}")).json()["data"]
    assert [e["action"] for e in rows] == ["key.revoke", "key.rotate", "key.create"]
    assert rows[0]["detail"] == {"reason": "done"}
    assert rows[1]["detail"]["grace_s"] == 5
    assert rows[2]["detail"]["name"] == "audited" and rows[2]["detail"]["spend_cap_micros"] == 500_000
    assert key["key"] not in r.text and all(key["key"] not in str(e) for e in rows)
    revokes = (await gw.admin("GET", "/admin/audit?action=key.revoke&limit=1")).json()
    assert revokes["data"][0]["target"] == key["id"]
    bad_actor = {**gw.admin_headers, "x-bourse-actor": "a\tb"}
    assert_error_envelope(await gw.client.get("/admin/audit", headers=bad_actor), 400)
    assert_error_envelope(await gw.client.get("/admin/audit", headers=gw.headers), 403, "admin_only")
