"""Editing an API key (``PATCH /admin/keys/{id}``) on a served gateway, over SQLite and
PostgreSQL: a change of products or limits is in force for the very next request on
the replica that made it (the others within the key cache's TTL, at most 1 s, as a
revocation), each edit is validated as a new key is and audited as ``key.update``
with the fields it set; a change of the spend cap's period while a hold is open keeps
the key-spend invariant (tests/faults/ledger.py, invariant 6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.money.support import As, new_caller
from tests.faults.ledger import check_ledger
from tests.support.gateway import ADMIN_KEY, Gateway, running_gateway

CONFIG = """
[products.edited]
max_output_tokens = 512
sim_overrides = true
[[products.edited.deployments]]
engine = "sim"
slots = 50
floor = 1.0

[products.other]
max_output_tokens = 512
[[products.other.deployments]]
engine = "sim"
slots = 50
floor = 1.0
"""
BODY: dict[str, Any] = {"model": "edited", "max_tokens": 8}


def _key_id(gw: Gateway, account: str) -> str:
    r = gw.admin("GET", "/admin/keys", params={"account": account})
    assert r.status_code == 200, r.text
    key_id: str = r.json()["data"][0]["id"]
    return key_id


def _patch(gw: Gateway, key_id: str, body: Any) -> httpx.Response:
    return gw.admin("PATCH", f"/admin/keys/{key_id}", json=body)


def test_an_edit_is_in_force_for_the_next_request_and_audited(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        caller = new_caller(gw, "edit-me", 10.0)
        key_id = _key_id(gw, "edit-me")
        assert caller.post(BODY).status_code == 200

        r = _patch(gw, key_id, {"products": ["other"], "name": "robot"})
        assert r.status_code == 200, r.text
        assert r.json()["products"] == ["other"] and r.json()["name"] == "robot" and "key" not in r.json()
        r = caller.post(BODY)  # at once on this replica: no wait for the key cache
        assert (r.status_code, r.json()["error"]["code"]) == (403, "model_not_allowed"), r.text

        r = _patch(gw, key_id, {"products": None, "rpm": 1})
        assert r.status_code == 200, r.text
        assert r.json()["products"] is None and r.json()["rpm"] == 1
        statuses = [caller.post(BODY).status_code for _ in range(2)]
        assert statuses[-1] == 429, statuses
        r = _patch(gw, key_id, {"rpm": None, "expires_in_s": 3600})
        assert r.status_code == 200 and r.json()["rpm"] is None and r.json()["expires_at"] > time.time()
        assert caller.post(BODY).status_code == 200

        r = _patch(gw, key_id, {"expires_at": None, "spend_cap_usd": 0.5, "spend_cap_period": "day"})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert (doc["expires_at"], doc["spend_cap_micros"], doc["spend_cap_period"]) == (None, 500_000, "day")

        r = gw.admin("GET", "/admin/audit", params={"target": key_id, "action": "key.update"})
        details = [e["detail"] for e in r.json()["data"]]
        assert len(details) == 4, details
        assert details[0] == {"expires_at": None, "spend_cap_micros": 500_000, "spend_cap_period": "day"}
        assert set(details[1]) == {"rpm", "expires_at"} and details[1]["rpm"] is None
        assert details[1]["expires_at"] > time.time()
        assert details[2:] == [{"products": None, "rpm": 1}, {"products": ["other"], "name": "robot"}]
        assert caller.key not in r.text

        assert _patch(gw, key_id, {"spend_cap_usd": None}).json()["spend_cap_period"] is None
        r = _patch(gw, key_id, {"spend_cap_usd": 1})  # a first cap, no period given: total
        assert (r.json()["spend_cap_micros"], r.json()["spend_cap_period"]) == (1_000_000, "total"), r.text
        r = _patch(gw, key_id, {"spend_cap_usd": 2})  # a new amount keeps the period
        assert (r.json()["spend_cap_micros"], r.json()["spend_cap_period"]) == (2_000_000, "total"), r.text


def test_an_edit_is_validated_as_a_new_key_is(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        caller = new_caller(gw, "edit-bad", 10.0)
        key_id = _key_id(gw, "edit-bad")
        bad: list[Any] = [
            {},
            {"rpm": 0},
            {"tpm": 2**31},
            {"max_streams": "3"},
            {"products": ["nosuch"]},
            {"expires_at": time.time() - 10},
            {"expires_at": time.time() + 60, "expires_in_s": 60},
            {"spend_cap_usd": 0.0000001},
            {"spend_cap_period": "day"},  # the key has no cap to give a period
            {"spend_cap_period": None},
            {"key": "bk_x"},
            [1],
        ]
        for body in bad:
            r = _patch(gw, key_id, body)
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request"), (body, r.text)
        r = _patch(gw, "key_nosuch", {"rpm": 5})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = httpx.patch(f"{gw.url}/admin/keys/{key_id}", json={"rpm": 5}, headers=caller.auth)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
        assert gw.admin("POST", f"/admin/keys/{key_id}/revoke", json={}).status_code == 200
        r = _patch(gw, key_id, {"rpm": 5})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "key_revoked")
        r = gw.admin("GET", "/admin/audit", params={"target": key_id, "action": "key.update"})
        assert r.json()["data"] == []


def _spend(gw: Gateway, key_id: str, account: str) -> int:
    r = gw.admin("GET", "/admin/keys", params={"account": account})
    spend: int = next(k["spend_micros"] for k in r.json()["data"] if k["id"] == key_id)
    return spend


def test_changing_the_cap_period_with_a_hold_open_keeps_the_key_spend_invariant(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        caller: As = new_caller(gw, "edit-cap", 10.0, spend_cap_usd=1.0)
        key_id = _key_id(gw, "edit-cap")
        slow = {**BODY, "sim": {"ttft_ms": 1500, "output_tokens": 4}}
        done: list[httpx.Response] = []
        t = threading.Thread(target=lambda: done.append(caller.post(slow)))
        t.start()
        deadline = time.monotonic() + 10
        while not caller.holds("open") and time.monotonic() < deadline:
            time.sleep(0.02)
        held = _spend(gw, key_id, "edit-cap")
        assert held > 0  # the open hold counts on the total cap

        r = _patch(gw, key_id, {"spend_cap_period": "day"})
        assert r.status_code == 200, r.text
        assert r.json()["spend_micros"] == 0  # a new period: today's count starts at zero
        check_ledger(Path(gw.data_dir), db)  # the counter still equals its period's holds
        t.join(30)
        assert done and done[0].status_code == 200, done
        assert not caller.wait_settled()
        check_ledger(Path(gw.data_dir), db)

        assert caller.post(BODY).status_code == 200  # counted on today's period now
        assert not caller.wait_settled()
        today = _spend(gw, key_id, "edit-cap")
        assert today > 0
        r = _patch(gw, key_id, {"spend_cap_usd": 2.0})  # the amount alone: the count stays
        assert r.status_code == 200 and r.json()["spend_micros"] == today
        r = _patch(gw, key_id, {"spend_cap_usd": None})  # no cap: nothing counted any more
        assert r.status_code == 200 and r.json()["spend_cap_period"] is None
        assert caller.post(BODY).status_code == 200
        assert not caller.wait_settled()
        check_ledger(Path(gw.data_dir), db)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", url, "--admin-key", ADMIN_KEY, *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_the_admin_cli_edits_a_key() -> None:
    with running_gateway(CONFIG) as gw:
        new_caller(gw, "edit-cli", 10.0)
        key_id = _key_id(gw, "edit-cli")
        p = _cli(gw.url, "keys", "update", key_id, "--rpm", "60", "--products", "other", "--cap-usd", "0.5",
                 "--cap-period", "day", "--expires-in", "30d", "--name", "robot")  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert "rpm: 60" in p.stdout and "spend_cap_period: day" in p.stdout and "name: robot" in p.stdout
        p = _cli(gw.url, "--json", "keys", "update", key_id, "--rpm", "none", "--products", "all",
                 "--cap-usd", "none", "--expires-in", "never")  # fmt: skip
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert [doc[f] for f in ("rpm", "products", "spend_cap_micros", "expires_at")] == [None] * 4
        r = gw.admin("GET", "/admin/audit", params={"target": key_id, "action": "key.update"})
        assert [e["actor"] for e in r.json()["data"]] == ["admin:cli", "admin:cli"]
        p = _cli(gw.url, "keys", "update", key_id, "--rpm", "0")
        assert p.returncode == 2 and "400 invalid_request" in p.stderr and p.stderr.count("\n") == 1
        p = _cli(gw.url, "keys", "update", key_id)
        assert p.returncode == 2 and "400 invalid_request" in p.stderr
