"""Operators in the dashboard (issue 37): each signs in with their own key and gets a
session with their name and role; each action needs the least role of the admin
route doing the same work (settling a hold: ``billing``), a viewer reads everything
and changes nothing, the audit log names the operator, a revoked operator's session
ends on its next request, and a user key never takes an operator's action."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from bourse.http.dashboard.roles import ACTIONS, OWN_ACTIONS
from tests.e2e.dashboard.conftest import World, _reconciling
from tests.support.gateway import ADMIN_KEY

SETTLE = "hold.settle"


def _operator(world: World, name: str, role: str) -> dict[str, str]:
    r = world.gw.admin("POST", "/admin/operators", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    doc: dict[str, str] = r.json()
    return doc


def _hold(world: World, account: str, request_id: str) -> str:
    return asyncio.run(_reconciling(Path(world.gw.data_dir) / "bourse.db", account, request_id, 20_000))


@pytest.fixture(scope="module")
def ops(world: World) -> dict[str, dict[str, str]]:
    return {role: _operator(world, f"dash-{role}", role) for role in ("viewer", "billing", "admin")}


def test_an_operator_key_signs_in_with_its_name_and_role(
    world: World, ops: dict[str, dict[str, str]]
) -> None:
    with world.browser(ops["viewer"]["key"]) as c:
        me = c.get("/dashboard/api/session").json()
        assert (me["role"], me["operator"], me["operator_id"], me["staff"]) == (
            "viewer", "dash-viewer", ops["viewer"]["id"], True,
        )  # fmt: skip
        assert me["account"] is None and me["actions"] == ["account.read", "key.list", "market.read"], me
        # a viewer reads everything
        accounts = {a["id"] for a in c.get("/dashboard/api/accounts").json()["data"]}
        assert {"alice", "bob", "test"} <= accounts
        held = {h["account_id"] for h in c.get("/dashboard/api/holds").json()["data"]}
        assert {"alice", "bob"} <= held
        assert c.get("/dashboard/api/usage.csv").status_code == 200
    with world.browser(ops["billing"]["key"]) as c:
        me = c.get("/dashboard/api/session").json()
        assert me["role"] == "billing" and SETTLE in me["actions"], me
        assert "job.cancel" not in me["actions"] and "key.create" not in me["actions"]
    with world.browser(ADMIN_KEY) as c:
        me = c.get("/dashboard/api/session").json()
        assert (me["role"], me["operator"]) == ("owner", None)
        assert sorted(me["actions"]) == sorted([a.name for a in ACTIONS] + [a.name for a in OWN_ACTIONS])


@pytest.mark.parametrize("verb", ["settle", "release"])
def test_a_viewer_may_not_close_a_hold_and_billing_may(
    world: World, ops: dict[str, dict[str, str]], verb: str
) -> None:
    hold = _hold(world, "alice", f"chatcmpl-dash-{verb}")
    with world.browser(ops["viewer"]["key"]) as c:
        r = c.post(f"/dashboard/api/holds/{hold}/{verb}", json={})
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_role", err
        assert "'billing'" in err["message"] and "operator 'dash-viewer' has 'viewer'" in err["message"]
    states = {h["id"]: h["state"] for h in world.gw.admin("GET", "/admin/holds").json()["data"]}
    assert states[hold] == "reconciling", "a refused action changed nothing"
    with world.browser(ops["billing"]["key"]) as c:
        r = c.post(f"/dashboard/api/holds/{hold}/{verb}", json={})
        assert r.status_code == 200, r.text
        assert r.json()["state"] == ("settled" if verb == "settle" else "released")
    audit = world.gw.admin("GET", "/admin/audit", params={"target": hold}).json()["data"]
    assert [(e["action"], e["actor"]) for e in audit] == [(f"hold.{verb}", "operator:dash-billing")], audit


def test_cancelling_any_job_needs_admin(world: World, ops: dict[str, dict[str, str]]) -> None:
    r = httpx.post(
        world.url + "/v1/jobs",
        json={
            "endpoint": "/v1/chat/completions",
            "body": {"model": "dash-fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        },
        headers={"authorization": f"Bearer {world.keys['bob']}"},
        timeout=30,
    )
    assert r.status_code in (200, 201, 202), r.text
    job = r.json()["id"]
    with world.browser(ops["billing"]["key"]) as c:
        r = c.post(f"/dashboard/api/jobs/{job}/cancel", json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role", r.text
    with world.browser(ops["admin"]["key"]) as c:
        r = c.post(f"/dashboard/api/jobs/{job}/cancel", json={})
        assert r.status_code in (200, 409), r.text
    if r.status_code == 200:
        audit = world.gw.admin("GET", "/admin/audit", params={"target": job}).json()["data"]
        assert [e["actor"] for e in audit] == ["operator:dash-admin"], audit


def test_a_revoked_operators_session_ends_on_its_next_request(world: World) -> None:
    op = _operator(world, "dash-leaving", "billing")
    with world.browser(op["key"]) as c:
        assert c.get("/dashboard/api/accounts").status_code == 200
        r = world.gw.admin("POST", f"/admin/operators/{op['id']}/revoke", json={})
        assert r.status_code == 200, r.text
        r = c.get("/dashboard/api/accounts")
        assert r.status_code == 401 and r.json()["error"]["code"] == "not_signed_in", r.text
        assert c.get("/dashboard/api/session").json() == {"signed_in": False}
    with world.browser() as c:
        r = c.post("/dashboard/api/session", json={"key": op["key"]})
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("verb", ["settle", "release"])
def test_a_user_key_never_takes_an_operators_action(world: World, verb: str) -> None:
    hold = _hold(world, "bob", f"chatcmpl-user-{verb}")
    with world.browser(world.keys["bob"]) as c:
        me = c.get("/dashboard/api/session").json()
        assert (me["role"], me["staff"], me["operator"]) == ("user", False, None)
        assert me["actions"] == ["job.cancel"]
        r = c.post(f"/dashboard/api/holds/{hold}/{verb}", json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", r.text
        # nor any admin route, with the cookie or the key
        assert c.get("/admin/accounts").status_code == 401
    r = httpx.get(world.url + "/admin/accounts", headers={"authorization": f"Bearer {world.keys['bob']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
