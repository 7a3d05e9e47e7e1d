"""An operator manages accounts and keys from the dashboard (issue 37): each action is
the admin route's use case under a session, audited with the session's actor, refused
to a user session (403), without the CSRF token (403) and with a bad body (400)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bourse.http.admin_roles import LEAST_ROLE
from bourse.http.dashboard import roles
from bourse.http.dashboard.roles import ACTIONS, BY_NAME, OWN_ACTIONS, Action
from bourse.ports.operators import Role, role_at_least
from tests.e2e.dashboard.conftest import USER, World
from tests.support.gateway import ADMIN_KEY

_n = itertools.count()


@dataclass
class Target:
    """A fresh account (credited 10 USD) with a fresh key, for one action."""

    account: str
    key_id: str
    key: str


def _target(world: World) -> Target:
    account = f"mng-{next(_n)}"
    r = world.gw.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": 10.0})
    assert r.status_code == 201, r.text
    r = world.gw.admin("POST", "/admin/keys", json={"account": account, "name": "first"})
    assert r.status_code == 201, r.text
    return Target(account, r.json()["id"], r.json()["key"])


def _path(action: Action, t: Target, hold: str = "hold_none") -> str:
    return action.path.format(account_id=t.account, key_id=t.key_id, hold_id=hold, product="dash-fast")


def _audit(world: World, target: str) -> list[dict[str, Any]]:
    r = world.gw.admin("GET", "/admin/audit", params={"target": target})
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def _chat(world: World, key: str) -> httpx.Response:
    return httpx.post(world.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      json={"model": "dash-fast", "messages": USER, "max_tokens": 5}, timeout=30)  # fmt: skip


@dataclass
class Case:
    """One action done right: its body, its status, what it audits and on what, and a
    check of its answer and its effect."""

    name: str
    body: Callable[[Target], dict[str, Any]]
    status: int
    audited: str
    target: Callable[[Target, dict[str, Any]], str]
    check: Callable[[World, Target, dict[str, Any]], None]


def _on_account(t: Target, doc: dict[str, Any]) -> str:
    return t.account


def _on_key(t: Target, doc: dict[str, Any]) -> str:
    return t.key_id


def _created(world: World, t: Target, doc: dict[str, Any]) -> None:
    assert doc["id"] == f"{t.account}-new" and doc["balance_micros"] == 2_500_000, doc


def _balance(micros: int) -> Callable[[World, Target, dict[str, Any]], None]:
    def check(world: World, t: Target, doc: dict[str, Any]) -> None:
        assert doc["balance_micros"] == micros, doc
        assert world.gw.admin("GET", f"/admin/accounts/{t.account}").json()["balance_micros"] == micros

    return check


def _status(status: str) -> Callable[[World, Target, dict[str, Any]], None]:
    def check(world: World, t: Target, doc: dict[str, Any]) -> None:
        assert doc["status"] == status, doc
        if status == "suspended":
            r = _chat(world, t.key)
            assert r.status_code == 403 and r.json()["error"]["code"] == "account_suspended", r.text

    return check


def _closed(world: World, t: Target, doc: dict[str, Any]) -> None:
    assert doc["status"] == "closed" and doc["balance_micros"] == 10_000_000 and doc["revoked_keys"] == 1, doc


def _new_key(world: World, t: Target, doc: dict[str, Any]) -> None:
    assert doc["key"].startswith("bk_") and doc["account_id"] == t.account and doc["rpm"] == 60, doc
    assert (doc["spend_cap_micros"], doc["spend_cap_period"]) == (1_000_000, "day"), doc
    assert _chat(world, doc["key"]).status_code == 200


def _edited(world: World, t: Target, doc: dict[str, Any]) -> None:
    assert (doc["rpm"], doc["products"], doc["max_streams"]) == (7, ["dash-other"], 2), doc
    assert (doc["spend_cap_micros"], doc["spend_cap_period"]) == (500_000, "week"), doc
    assert doc["expires_at"] is not None
    r = _chat(world, t.key)  # dash-fast is no longer among the key's products
    assert r.status_code == 403, r.text


def _revoked(world: World, t: Target, doc: dict[str, Any]) -> None:
    assert doc["state"] == "revoked", doc
    assert _chat(world, t.key).status_code == 401


def _rotated(world: World, t: Target, doc: dict[str, Any]) -> None:
    assert doc["key"] != t.key and doc["old_key_valid_until"] is not None, doc
    assert _chat(world, doc["key"]).status_code == 200
    assert _chat(world, t.key).status_code == 200  # within its grace


CASES = [
    Case("account.create", lambda t: {"id": f"{t.account}-new", "credit_usd": 2.5}, 201, "account.create",
         lambda t, d: d["id"], _created),
    Case("account.credit", lambda t: {"amount_usd": 1.5}, 200, "account.credit", _on_account,
         _balance(11_500_000)),
    Case("account.debit", lambda t: {"amount_usd": 2, "reason": "chargeback"}, 200, "account.debit",
         _on_account, _balance(8_000_000)),
    Case("account.refund", lambda t: {"amount_usd": 0.25, "reason": "outage"}, 200, "account.refund",
         _on_account, _balance(10_250_000)),
    Case("account.suspend", lambda t: {"reason": "unpaid"}, 200, "account.suspend", _on_account,
         _status("suspended")),
    Case("account.resume", lambda t: {}, 200, "account.resume", _on_account, _status("active")),
    Case("account.close", lambda t: {"reason": "asked"}, 200, "account.close", _on_account, _closed),
    Case("key.create", lambda t: {"account": t.account, "name": "second", "rpm": 60, "spend_cap_usd": 1,
                                  "spend_cap_period": "day"}, 201, "key.create", lambda t, d: d["id"], _new_key),
    Case("key.update", lambda t: {"rpm": 7, "products": ["dash-other"], "max_streams": 2, "spend_cap_usd": 0.5,
                                  "spend_cap_period": "week", "expires_in_s": 3600}, 200, "key.update", _on_key,
         _edited),
    Case("key.revoke", lambda t: {"reason": "leaked"}, 200, "key.revoke", _on_key, _revoked),
    Case("key.rotate", lambda t: {"grace_s": 60}, 200, "key.rotate", _on_key, _rotated),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_action_is_the_admin_use_case_audited_with_the_session(world: World, case: Case) -> None:
    t = _target(world)
    action = BY_NAME[case.name]
    with world.browser(ADMIN_KEY) as c:
        r = c.request(action.method, _path(action, t), json=case.body(t))
        assert r.status_code == case.status, r.text
        doc = r.json()
        case.check(world, t, doc)
        entries = [e for e in _audit(world, case.target(t, doc)) if e["action"] == case.audited]
        assert len(entries) == 1, entries
        assert entries[0]["actor"] == "admin:dashboard", entries
        if "key" in doc:  # a secret shown once is never cached
            assert r.headers["cache-control"] == "no-store"
            assert doc["key"] not in str(entries)


def test_the_reads_list_an_accounts_keys_and_the_actions_allowed(world: World) -> None:
    t = _target(world)
    with world.browser(ADMIN_KEY) as c:
        keys = c.get("/dashboard/api/keys", params={"account": t.account}).json()
        assert [k["id"] for k in keys["data"]] == [t.key_id] and keys["has_more"] is False
        assert "key" not in keys["data"][0] and keys["data"][0]["state"] == "active"
        assert c.get(f"/dashboard/api/accounts/{t.account}").json()["balance_micros"] == 10_000_000
        assert c.get("/dashboard/api/accounts/nobody").status_code == 404
        assert c.get("/dashboard/api/keys", params={"limit": "0"}).status_code == 400
        doc = c.get("/dashboard/api/accounts").json()
        assert set(doc["allowed"]) == {a.name for a in ACTIONS} | {"job.cancel"}
    with world.browser(world.keys["alice"]) as c:
        assert c.get("/dashboard/api/accounts").json()["allowed"] == ["job.cancel"]  # their own jobs


def test_a_resume_after_the_suspend_lets_the_key_in_again(world: World) -> None:
    t = _target(world)
    with world.browser(ADMIN_KEY) as c:
        assert c.post(f"/dashboard/api/accounts/{t.account}/suspend", json={}).status_code == 200
        assert _chat(world, t.key).status_code == 403
        assert c.post(f"/dashboard/api/accounts/{t.account}/resume", json={}).status_code == 200
        assert _chat(world, t.key).status_code == 200
        assert c.post(f"/dashboard/api/accounts/{t.account}/close", json={}).status_code == 200
        r = c.post(f"/dashboard/api/accounts/{t.account}/resume", json={})
        assert r.status_code == 409 and r.json()["error"]["code"] == "account_closed"
        r = c.post("/dashboard/api/keys", json={"account": t.account})
        assert r.status_code == 409


MANAGE = [a for a in ACTIONS if not a.name.startswith("hold.")]


@pytest.mark.parametrize("action", MANAGE, ids=[a.name for a in MANAGE])
def test_a_user_session_may_take_no_action(world: World, action: Action) -> None:
    t = _target(world)
    before = world.gw.admin("GET", f"/admin/accounts/{t.account}").json()
    with world.browser(t.key) as c:
        body = {"account": t.account, "id": "by-user", "amount_usd": 1, "reason": "r"}
        r = c.request(action.method, _path(action, t), json=body if action.method != "GET" else None)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", r.text
    assert world.gw.admin("GET", f"/admin/accounts/{t.account}").json() == before
    assert [e["action"] for e in _audit(world, t.account)] == ["account.create"]
    assert [e["action"] for e in _audit(world, t.key_id)] == ["key.create"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_action_needs_the_csrf_token_and_the_same_origin(world: World, case: Case) -> None:
    t = _target(world)
    action = BY_NAME[case.name]
    with world.browser(ADMIN_KEY) as c:
        token = c.headers.pop("x-csrf-token")
        r = c.request(action.method, _path(action, t), json=case.body(t))
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", r.text
        r = c.request(action.method, _path(action, t), json=case.body(t),
                      headers={"x-csrf-token": token, "origin": "http://evil.example"})  # fmt: skip
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site", r.text
    with world.browser() as c:  # no session
        r = c.request(action.method, _path(action, t), json=case.body(t))
        assert r.status_code == 401
    assert [e["action"] for e in _audit(world, t.account)] == ["account.create"]
    assert [e["action"] for e in _audit(world, t.key_id)] == ["key.create"]


BAD: dict[str, list[Any]] = {
    "account.create": [{}, {"id": ""}, {"id": "a b"}, {"id": "x" * 129}, {"id": "ok", "credit_usd": -1},
                       {"id": "ok", "credit_usd": 1e10}, {"id": "ok", "credit_usd": "5"}, {"id": 5}],
    "account.credit": [{}, {"amount_usd": 0}, {"amount_usd": -5}, {"amount_usd": 1e10}, {"amount_usd": "1"},
                       {"amount_usd": 1, "reason": "no such field"}],
    "account.debit": [{"amount_usd": 1}, {"amount_usd": 1, "reason": ""}, {"amount_usd": 1, "reason": "x" * 501},
                      {"amount_usd": -1, "reason": "r"}, {"amount_usd": 1, "reason": "   "}],
    "account.refund": [{"reason": "r"}, {"amount_usd": 1e10, "reason": "r"}, {"amount_usd": 1, "reason": 5}],
    "account.suspend": [{"reason": "x" * 501}, {"reason": 5}, {"x": 1}, []],
    "account.resume": [{"reason": ["r"]}],
    "account.close": [{"reason": "x" * 501}],
    "key.create": [{}, {"account": "nobody-here"}, {"account": "A", "rpm": 0}, {"account": "A", "products": ["nope"]},
                   {"account": "A", "spend_cap_period": "year"}, {"account": "A", "expires_at": 1.0},
                   {"account": "A", "expires_at": 4e9, "expires_in_s": 5}, {"account": "A", "tpm": 2**31}],
    "key.update": [{}, {"rpm": 0}, {"products": ["nope"]}, {"spend_cap_period": None}, {"spend_cap_usd": -1},
                   {"expires_in_s": -1}, {"secret": "x"}, {"max_streams": 2.5}],
    "key.revoke": [{"reason": "x" * 501}, {"reason": 1}],
    "key.rotate": [{"grace_s": -1}, {"grace_s": 7 * 86_400 + 1}, {"grace_s": "1h"}],
}  # fmt: skip
"""Bodies each action refuses with 400 (``"A"``: the target account; an unknown account: 404)."""


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_body_is_a_400_and_changes_nothing(world: World, name: str) -> None:
    t = _target(world)
    action = BY_NAME[name]
    with world.browser(ADMIN_KEY) as c:
        for i, bad in enumerate(BAD[name]):
            if isinstance(bad, dict) and bad.get("account") == "A":
                bad = {**bad, "account": t.account}
            r = c.request(action.method, _path(action, t), json=bad)
            want = 404 if bad == {"account": "nobody-here"} else 400
            assert r.status_code == want, (i, bad, r.text)
            assert r.json()["error"]["code"] in ("invalid_request", "not_found"), r.text
        for raw in (b"not json", b"[" * 100 + b"]" * 100):
            headers = {"content-type": "application/json"}
            r = c.request(action.method, _path(action, t), content=raw, headers=headers)
            assert r.status_code == 400, (raw[:10], r.text)
        bad_id = action.path.replace("{account_id}", "a b").replace("{key_id}", "k%20y")
        if bad_id != action.path:
            r = c.request(action.method, bad_id, json={})
            assert r.status_code in (400, 404), r.text
    assert [e["action"] for e in _audit(world, t.account)] == ["account.create"]
    assert [e["action"] for e in _audit(world, t.key_id)] == ["key.create"]
    assert world.gw.admin("GET", f"/admin/accounts/{t.account}").json()["balance_micros"] == 10_000_000


def test_unknown_targets_are_404(world: World) -> None:
    with world.browser(ADMIN_KEY) as c:
        for method, path, body in (
            ("POST", "/dashboard/api/accounts/nobody/credit", {"amount_usd": 1}),
            ("POST", "/dashboard/api/accounts/nobody/debit", {"amount_usd": 1, "reason": "r"}),
            ("POST", "/dashboard/api/accounts/nobody/close", {}),
            ("PATCH", "/dashboard/api/keys/key_nobody", {"rpm": 5}),
            ("POST", "/dashboard/api/keys/key_nobody/rotate", {}),
            ("POST", "/dashboard/api/keys/key_nobody/revoke", {}),
        ):
            r = c.request(method, path, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        t = _target(world)
        too_much = {"amount_usd": 11, "reason": "too much"}
        r = c.post(f"/dashboard/api/accounts/{t.account}/debit", json=too_much)
        assert r.status_code == 402 and r.json()["error"]["code"] == "insufficient_funds"
        r = c.post("/dashboard/api/accounts", json={"id": t.account})
        assert r.status_code == 409 and r.json()["error"]["code"] == "account_exists"


@pytest.mark.parametrize("role", ["viewer", "billing", "admin", "owner"])
def test_each_action_needs_the_least_role_of_the_admin_route_it_mirrors(
    world: World, role: Role, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The role comes from :func:`session_role` (set here: each role in turn) and is
    judged by ``LEAST_ROLE`` of the mirrored admin route."""
    monkeypatch.setattr(roles, "session_role", lambda s: None if s.account_id else role)
    t = _target(world)
    with world.browser(ADMIN_KEY) as c:
        allowed = set(c.get("/dashboard/api/accounts").json()["allowed"])
        assert allowed == {a.name for a in ACTIONS if role_at_least(role, LEAST_ROLE[a.mirrors])} | {
            a.name for a in OWN_ACTIONS if role_at_least(role, a.need)
        }
        for case in CASES:
            action = BY_NAME[case.name]
            r = c.request(action.method, _path(action, t), json=case.body(t))
            if case.name in allowed:
                assert r.status_code != 403, (role, case.name, r.text)
            else:
                assert r.status_code == 403, (role, case.name, r.text)
                assert r.json()["error"]["code"] == "insufficient_role"
                assert f"'{LEAST_ROLE[action.mirrors]}'" in r.json()["error"]["message"]
        assert c.get("/dashboard/api/keys", params={"account": t.account}).status_code == 200
    writes = allowed - {a.name for a in ACTIONS if a.method == "GET"}
    if role == "viewer":
        assert writes == set()
    if role == "billing":
        assert writes == {"account.credit", "account.debit", "account.refund", "hold.settle", "hold.release"}
