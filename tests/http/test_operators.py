"""Operators through the admin API, in process: an operator's key reaches the routes
of its role and is 403 ``insufficient_role`` above it, each action audited under
``operator:<name>``; a revoked operator's key is 401 at once on the replica that
revoked it (the cached lookup is dropped); an admin operator cannot manage
operators; bad bodies and unknown ids."""

from __future__ import annotations

import os

import pytest

from tests.support.asgi import InProcessGateway
from tests.support.errors import assert_error_envelope

pytestmark = pytest.mark.anyio


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _operator(gw: InProcessGateway, role: str) -> tuple[str, str, str]:
    """A new operator: (id, name, key)."""
    name = f"{role}-{os.urandom(4).hex()}"
    r = await gw.admin("POST", "/admin/operators", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    doc = r.json()
    assert doc["object"] == "operator" and doc["role"] == role and doc["revoked_at"] is None, doc
    return doc["id"], name, doc["key"]


async def test_a_billing_operator_credits_but_cannot_make_a_key(gw: InProcessGateway) -> None:
    _, name, key = await _operator(gw, "billing")
    r = await gw.client.post(
        f"/admin/accounts/{gw.account}/credit", json={"amount_usd": 1}, headers=_auth(key)
    )
    assert r.status_code == 200, r.text
    r = await gw.client.post("/admin/keys", json={"account": gw.account}, headers=_auth(key))
    err = assert_error_envelope(r, 403, "insufficient_role")
    assert "'admin'" in err["message"] and "'billing'" in err["message"], err
    r = await gw.admin("GET", "/admin/audit", params={"action": "account.credit", "target": gw.account})
    assert r.json()["data"][0]["actor"] == f"operator:{name}", r.json()
    # the x-bourse-actor label does not rename an operator
    r = await gw.client.get("/admin/ledger", headers={**_auth(key), "x-bourse-actor": "someone"})
    assert r.status_code == 200, r.text


async def test_a_revoked_operator_is_401_at_once(gw: InProcessGateway) -> None:
    op_id, _, key = await _operator(gw, "viewer")
    assert (await gw.client.get("/admin/ledger", headers=_auth(key))).status_code == 200  # cached now
    r = await gw.admin("POST", f"/admin/operators/{op_id}/revoke")
    assert r.status_code == 200 and r.json()["revoked_at"] is not None, r.text
    assert_error_envelope(await gw.client.get("/admin/ledger", headers=_auth(key)), 401, "invalid_api_key")
    again = await gw.admin("POST", f"/admin/operators/{op_id}/revoke")
    assert again.json()["revoked_at"] == r.json()["revoked_at"], again.text
    listed = (await gw.admin("GET", "/admin/operators")).json()["data"]
    assert any(o["id"] == op_id and o["revoked_at"] is not None for o in listed), listed


async def test_an_admin_operator_cannot_manage_operators(gw: InProcessGateway) -> None:
    op_id, _, key = await _operator(gw, "admin")
    r = await gw.client.post("/admin/operators", json={"name": "x", "role": "owner"}, headers=_auth(key))
    assert_error_envelope(r, 403, "insufficient_role")
    r = await gw.client.post(f"/admin/operators/{op_id}/revoke", headers=_auth(key))
    assert_error_envelope(r, 403, "insufficient_role")
    assert (await gw.client.get("/admin/operators", headers=_auth(key))).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x"},
        {"name": "x", "role": "root"},
        {"name": "", "role": "viewer"},
        {"name": "a b", "role": "viewer"},
    ],
    ids=repr,
)
async def test_a_bad_operator_is_400(gw: InProcessGateway, body: dict[str, str]) -> None:
    assert_error_envelope(await gw.admin("POST", "/admin/operators", json=body), 400, "invalid_request")


async def test_unknown_operators_and_keys(gw: InProcessGateway) -> None:
    assert_error_envelope(await gw.admin("POST", "/admin/operators/op_nobody/revoke"), 404, "not_found")
    r = await gw.client.get("/admin/ledger", headers=_auth("bo_nobody"))
    assert_error_envelope(r, 401, "invalid_api_key")
    _, name, _ = await _operator(gw, "viewer")
    r = await gw.admin("POST", "/admin/operators", json={"name": name, "role": "owner"})
    assert_error_envelope(r, 409, "operator_exists")
