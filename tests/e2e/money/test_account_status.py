"""Suspending, resuming and closing an account on a served gateway, over SQLite and
PostgreSQL: a suspended account's keys get 403 ``account_suspended`` (OpenAI's
envelope) on new requests while a stream it started runs to ``[DONE]`` and is
charged; the account shows its status and reason; a closed account's keys are
revoked (403 ``account_closed``), its balance reported, and it cannot be resumed,
suspended, closed again or given a key; every action is audited; a user key cannot
call them; and the ``bourse admin accounts suspend|resume|close`` commands do the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from tests.e2e.money.support import new_caller, read_until
from tests.support.gateway import ADMIN_KEY, Gateway, running_gateway

CONFIG = """
[products.acct]
max_output_tokens = 512
sim_overrides = true
[[products.acct.deployments]]
engine = "sim"
slots = 20
floor = 1.0
"""
BODY = {"model": "acct", "max_tokens": 8}


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"]) == ("account_suspended", "permission_error"), err
    assert "suspended" in err["message"] and "too soon" not in err["message"]  # the reason stays internal


def test_a_suspended_account_is_refused_new_requests_and_its_running_stream_finishes(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        me = new_caller(gw, "susp", 10.0)
        assert me.post(BODY).status_code == 200
        slow = {
            "model": "acct",
            "max_tokens": 30,
            "stream": True,
            "sim": {"tokens_per_s": 20, "output_tokens": 30},
        }
        with me.open_stream(slow) as s:
            assert s.status == 200
            read_until(s, data_chunks=1)
            r = gw.admin("POST", "/admin/accounts/susp/suspend", json={"reason": "too soon after signup"})
            assert r.status_code == 200, r.text
            assert (r.json()["status"], r.json()["status_reason"]) == ("suspended", "too soon after signup")
            _refused(me.post(BODY))  # at once on this replica
            _refused(me.get("/v1/account"))
            frames = list(s.frames())
            assert frames and frames[-1].is_done, frames[-3:]
        assert me.wait_settled() == []
        view = gw.admin("GET", "/admin/accounts/susp").json()
        assert (view["status"], view["status_reason"]) == ("suspended", "too soon after signup")
        assert view["spent_micros"] > 0 and view["open_holds_micros"] == 0
        me.assert_books()

        r = httpx.post(f"{gw.url}/admin/accounts/susp/resume", json={}, headers=me.auth)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
        r = gw.admin("POST", "/admin/accounts/susp/resume", json={})
        assert r.status_code == 200 and r.json()["status"] == "active" and r.json()["status_reason"] is None
        assert me.post(BODY).status_code == 200

        entries = gw.admin("GET", "/admin/audit", params={"target": "susp"}).json()["data"]
        assert [(e["action"], e["detail"]) for e in entries[:2]] == [
            ("account.resume", {}),
            ("account.suspend", {"reason": "too soon after signup"}),
        ]
        assert gw.admin("POST", "/admin/accounts/nosuch/suspend", json={}).status_code == 404
        r = gw.admin("POST", "/admin/accounts/susp/suspend", json={"reason": 5})
        assert r.status_code == 400
        assert gw.admin("GET", "/admin/accounts/test").json()["status"] == "active"


def _cli(gw: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", gw.url, "--admin-key", ADMIN_KEY, *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_the_admin_cli_suspends_and_resumes_an_account() -> None:
    with running_gateway(CONFIG) as gw:
        me = new_caller(gw, "susp-cli", 10.0)
        p = _cli(gw, "accounts", "suspend", "susp-cli", "--reason", "chargeback")
        assert p.returncode == 0, p.stderr
        assert "status: suspended" in p.stdout and "status_reason: chargeback" in p.stdout
        assert me.post(BODY).status_code == 403
        p = _cli(gw, "--json", "accounts", "resume", "susp-cli")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["status"] == "active"
        assert me.post(BODY).status_code == 200
        p = _cli(gw, "accounts", "suspend", "nosuch")
        assert p.returncode == 2 and "404" in p.stderr


def test_a_closed_account_has_its_keys_revoked_its_balance_reported_and_stays_closed(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        me = new_caller(gw, "closing", 10.0)
        second = gw.new_key("closing")
        slow = {
            "model": "acct",
            "max_tokens": 30,
            "stream": True,
            "sim": {"tokens_per_s": 20, "output_tokens": 30},
        }
        with me.open_stream(slow) as s:
            assert s.status == 200
            read_until(s, data_chunks=1)
            r = gw.admin("POST", "/admin/accounts/closing/close", json={"reason": "customer left"})
            assert r.status_code == 200, r.text
            doc = r.json()
            assert (doc["status"], doc["status_reason"], doc["revoked_keys"]) == (
                "closed",
                "customer left",
                2,
            )
            assert doc["open_holds_micros"] > 0  # the running stream's hold, reported with the balance
            assert doc["balance_micros"] + doc["open_holds_micros"] == 10_000_000 - doc["spent_micros"]
            r = me.post(BODY)
            assert (r.status_code, r.json()["error"]["code"]) == (403, "account_closed"), r.text
            r = httpx.post(f"{gw.url}/v1/chat/completions", json={**BODY, "messages": []},
                           headers={"authorization": f"Bearer {second}"})  # fmt: skip
            assert (r.status_code, r.json()["error"]["code"]) == (403, "account_closed"), r.text
            frames = list(s.frames())
            assert frames and frames[-1].is_done, frames[-3:]
        assert me.wait_settled() == []
        me.assert_books()
        keys = gw.admin("GET", "/admin/keys", params={"account": "closing"}).json()["data"]
        assert [k["state"] for k in keys] == ["revoked", "revoked"]
        for action in ("resume", "suspend", "close"):
            r = gw.admin("POST", f"/admin/accounts/closing/{action}", json={})
            assert (r.status_code, r.json()["error"]["code"]) == (409, "account_closed"), (action, r.text)
        r = gw.admin("POST", "/admin/keys", json={"account": "closing"})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "account_closed"), r.text
        entries = gw.admin(
            "GET", "/admin/audit", params={"target": "closing", "action": "account.close"}
        ).json()
        assert [e["detail"] for e in entries["data"]] == [{"reason": "customer left"}]
        r = httpx.post(f"{gw.url}/admin/accounts/test/close", json={}, headers=me.auth)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
        assert gw.admin("GET", "/admin/accounts/test").json()["status"] == "active"
        p = _cli(gw, "accounts", "close", "test", "--reason", "cli")
        assert p.returncode == 0, p.stderr
        assert "status: closed" in p.stdout and "revoked_keys: 1" in p.stdout
