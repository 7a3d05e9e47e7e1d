"""What each session sees and may do: an operator every account, a user their own;
settling and releasing are the operator's, audited; holds and balances move."""

from __future__ import annotations

import pytest

from tests.e2e.dashboard.conftest import World
from tests.support.gateway import ADMIN_KEY


def test_operator_sees_every_account(world: World) -> None:
    with world.browser(ADMIN_KEY) as c:
        accounts = {a["id"] for a in c.get("/dashboard/api/accounts").json()["data"]}
        assert {"alice", "bob", "test"} <= accounts
        held = {
            h["account_id"]
            for h in c.get("/dashboard/api/holds", params={"state": "reconciling"}).json()["data"]
        }
        assert {"alice", "bob"} <= held
        rows = c.get("/dashboard/api/requests", params={"limit": 200}).json()["data"]
        assert {"alice", "bob"} <= {r["account"] for r in rows}
        alice_only = c.get("/dashboard/api/requests", params={"account": "alice"}).json()["data"]
        assert alice_only and {r["account"] for r in alice_only} == {"alice"}
        one = alice_only[0]
        detail = c.get(f"/dashboard/api/requests/{one['id']}", params={"account": "alice"}).json()
        assert detail["id"] == one["id"] and detail["record"]["id"] == one["id"] and "receipt" in detail


def test_user_sees_only_their_account(world: World) -> None:
    with world.browser(world.keys["alice"]) as c:
        me = c.get("/dashboard/api/session").json()
        assert (me["role"], me["account"]) == ("user", "alice")
        assert [a["id"] for a in c.get("/dashboard/api/accounts").json()["data"]] == ["alice"]
        for state in ("reconciling", "open", "settled"):
            holds = c.get("/dashboard/api/holds", params={"state": state}).json()["data"]
            assert {h["account_id"] for h in holds} <= {"alice"}
        # asking for another account's requests still shows only one's own
        for params in ({}, {"account": "bob"}):
            rows = c.get("/dashboard/api/requests", params=params).json()["data"]
            assert rows and {r["account"] for r in rows} == {"alice"}
        bobs = world.usage_json("bob").json()["data"]
        r = c.get(f"/dashboard/api/requests/{bobs[0]['id']}", params={"account": "bob"})
        assert r.status_code == 404
        spend = c.get("/dashboard/api/spend", params={"since": 0, "bucket_s": 3600}).json()["data"]
        assert spend and {p["account"] for p in spend} == {"alice"}
        jobs = c.get("/dashboard/api/jobs").json()["data"]
        assert all(j["account"] == "alice" for j in jobs)


@pytest.mark.parametrize("verb", ["settle", "release"])
def test_a_user_may_not_close_holds(world: World, verb: str) -> None:
    with world.browser(world.keys["alice"]) as c:
        r = c.post(f"/dashboard/api/holds/{world.holds['alice']}/{verb}", json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"


def test_operator_release_is_audited_and_returns_the_money(world: World) -> None:
    hold = world.holds["alice"]
    with world.browser(ADMIN_KEY) as c:
        before = next(a for a in c.get("/dashboard/api/accounts").json()["data"] if a["id"] == "alice")
        r = c.post(f"/dashboard/api/holds/{hold}/release", json={})
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "released"
        after = next(a for a in c.get("/dashboard/api/accounts").json()["data"] if a["id"] == "alice")
        assert after["balance_micros"] == before["balance_micros"] + 50_000
        assert after["reconciling_micros"] == before["reconciling_micros"] - 50_000
        audit = world.gw.admin("GET", "/admin/audit", params={"target": hold}).json()["data"]
        assert [e["action"] for e in audit] == ["hold.release"], audit
        assert audit[0]["actor"] == "admin:dashboard", audit
        again = c.post(f"/dashboard/api/holds/{hold}/release", json={})
        assert again.status_code == 409


def test_unknown_product_and_bad_filters(world: World) -> None:
    with world.browser(ADMIN_KEY) as c:
        assert c.get("/dashboard/api/markets/nope/events").status_code == 404
        assert c.get("/dashboard/api/holds", params={"state": "lost"}).status_code == 400
        assert c.get("/dashboard/api/jobs", params={"status": "lost"}).status_code == 400
        assert c.get("/dashboard/api/spend", params={"bucket_s": "7"}).status_code == 400
        assert c.get("/dashboard/api/requests", params={"limit": "0"}).status_code == 400
        assert c.get("/dashboard/api/requests", params={"since": "nan"}).status_code == 400
        markets = c.get("/dashboard/api/markets").json()["data"]
        assert {m["product"] for m in markets} == {"dash-fast", "dash-other"}
