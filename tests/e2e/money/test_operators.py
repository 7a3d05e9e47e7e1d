"""Operators with roles (issue 37, build item 3), on a served gateway over SQLite and
PostgreSQL: for each of ``viewer``, ``billing`` and ``admin``, every admin route of
the served OpenAPI document is called with its key. A viewer gets 403
``insufficient_role`` on every write and no 403 on a read; billing exactly on the
routes above billing; admin exactly on the owner's routes (operators, the admin key). The audit log names the
operator; a revoked operator key is 401 at once; a user key is 403 everywhere; and
``bourse admin operators create|list|revoke``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.money.support import new_caller
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[products.unit]
sim_overrides = true
[[products.unit.deployments]]
engine = "sim"
slots = 4
floor = 1.0
"""

BILLING_WRITES = {
    ("POST", "/admin/accounts/{account_id}/credit"),
    ("POST", "/admin/accounts/{account_id}/debit"),
    ("POST", "/admin/accounts/{account_id}/refund"),
    ("POST", "/admin/holds/{hold_id}/settle"),
    ("POST", "/admin/holds/{hold_id}/release"),
}
"""The writes billing may make (credit, refunds, holds); the usage export is a read."""
OWNER_WRITES = {
    ("POST", "/admin/operators"),
    ("POST", "/admin/operators/{operator_id}/revoke"),
    ("POST", "/admin/admin_key/rotate"),
}
"""The owner's own: operators and the admin key."""


@pytest.fixture(scope="module")
def gw(module_db: str | None) -> Iterator[Gateway]:
    with running_gateway(CONFIG, database=module_db) as g:
        yield g


def _create(gw: Gateway, name: str, role: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        gw.url + "/admin/operators",
        json={"name": name, "role": role},
        headers=headers or gw.admin_headers,
        timeout=30,
    )


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys(gw: Gateway) -> dict[str, str]:
    out = {}
    for role in ("viewer", "billing", "admin"):
        r = _create(gw, f"ada-{role}", role)
        assert r.status_code == 201, r.text
        doc = r.json()
        assert doc["role"] == role and doc["key"].startswith("bo_"), doc
        out[role] = doc["key"]
    return out


def admin_operations(gw: Gateway) -> list[tuple[str, str]]:
    """Every admin (method, route) of the served OpenAPI document."""
    doc = httpx.get(gw.url + "/openapi.json", timeout=30).json()
    ops = sorted(
        (method.upper(), path)
        for path, item in doc["paths"].items()
        if path.startswith("/admin")
        for method in item
    )
    assert len(ops) >= 25 and set(ops) >= OWNER_WRITES and set(ops) >= BILLING_WRITES, ops
    return ops


def _call(gw: Gateway, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    """The route with ids that name nothing (a write allowed changes nothing: 400 or 404)."""
    filled = (
        path.replace("{account_id}", "nobody-here")
        .replace("{key_id}", "key_nobody")
        .replace("{hold_id}", "hold_nobody")
        .replace("{operator_id}", "op_nobody")
    )
    return httpx.request(method, gw.url + filled, json={}, headers=headers, timeout=30)


@pytest.mark.parametrize("role", ["viewer", "billing", "admin"])
def test_each_role_is_refused_exactly_the_admin_routes_above_it(
    gw: Gateway, keys: dict[str, str], role: str
) -> None:
    refused: set[tuple[str, str]] = set()
    for method, path in admin_operations(gw):
        r = _call(gw, method, path, _bearer(keys[role]))
        assert r.status_code != 401, (method, path, r.text)
        if r.status_code == 403:
            err = assert_error_envelope(r, 403, "insufficient_role")
            assert f"'{role}'" in err["message"], err
            refused.add((method, path))
    ops = admin_operations(gw)
    writes = {op for op in ops if op[0] != "GET"}
    expected = {
        "viewer": writes,
        "billing": writes - BILLING_WRITES,
        "admin": OWNER_WRITES,
    }[role]
    assert refused == expected, (sorted(refused - expected), sorted(expected - refused))


def test_a_user_key_is_refused_every_admin_route(gw: Gateway) -> None:
    me = new_caller(gw, "operators-user", 1.0)
    for method, path in admin_operations(gw):
        assert_error_envelope(_call(gw, method, path, me.auth), 403, "admin_only")


def test_the_audit_log_names_the_operator(gw: Gateway, keys: dict[str, str]) -> None:
    me = new_caller(gw, "operators-audited", 1.0)
    r = httpx.post(
        gw.url + f"/admin/accounts/{me.account}/credit",
        json={"amount_usd": 2},
        headers=_bearer(keys["billing"]),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    r = gw.admin("GET", "/admin/audit", params={"action": "account.credit", "target": me.account})
    assert [e["actor"] for e in r.json()["data"]] == ["operator:ada-billing"], r.json()
    r = gw.admin("GET", "/admin/audit", params={"action": "operator.create"})
    created = {e["detail"]["name"]: e["actor"] for e in r.json()["data"]}
    assert created["ada-viewer"] == "admin", created


def test_a_revoked_operator_key_is_401_and_the_list_shows_no_key(gw: Gateway) -> None:
    r = _create(gw, "ada-leaving", "owner")
    op = r.json()
    key = op["key"]
    # an owner operator manages operators
    r = _create(gw, "ada-made-by-owner", "viewer", _bearer(key))
    assert r.status_code == 201, r.text
    assert httpx.get(gw.url + "/admin/ledger", headers=_bearer(key), timeout=30).status_code == 200
    listed = gw.admin("GET", "/admin/operators").json()["data"]
    assert {o["name"] for o in listed} >= {"ada-leaving", "ada-made-by-owner"}
    assert all("key" not in o and "key_hash" not in o for o in listed), listed
    r = gw.admin("POST", f"/admin/operators/{op['id']}/revoke", json={})
    assert r.status_code == 200 and r.json()["revoked_at"] is not None, r.text
    assert_error_envelope(
        httpx.get(gw.url + "/admin/ledger", headers=_bearer(key), timeout=30), 401, "invalid_api_key"
    )
    r = gw.admin("GET", "/admin/audit", params={"action": "operator.revoke", "target": op["id"]})
    assert [e["actor"] for e in r.json()["data"]] == ["admin"], r.json()
    # a wrong operator key, a taken name, an operator key on /v1
    assert_error_envelope(
        httpx.get(gw.url + "/admin/ledger", headers=_bearer("bo_not-a-key"), timeout=30),
        401,
        "invalid_api_key",
    )
    assert_error_envelope(_create(gw, "ada-leaving", "viewer"), 409, "operator_exists")
    r = httpx.get(gw.url + "/v1/account", headers=_bearer(key), timeout=30)
    assert r.status_code == 401, r.text


def _cli(url: str, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", url, "--admin-key", key, *args],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_the_cli_creates_lists_and_revokes_operators(gw: Gateway) -> None:
    out = _cli(gw.url, gw.admin_key, "operators", "create", "cli-viewer", "--role", "viewer")
    assert out.returncode == 0, out.stderr
    shown = re.search(r"operator key \(shown once, keep it now\): (bo_\S+)", out.stdout)
    assert shown is not None, out.stdout
    key = shown.group(1)
    me = new_caller(gw, "operators-cli", 1.0)
    out = _cli(gw.url, key, "accounts", "credit", me.account, "--amount-usd", "1")
    assert out.returncode == 2 and "403 insufficient_role" in out.stderr, (out.stdout, out.stderr)
    out = _cli(gw.url, key, "--json", "operators", "list")
    assert out.returncode == 0, out.stderr
    row = next(o for o in json.loads(out.stdout)["data"] if o["name"] == "cli-viewer")
    assert row["role"] == "viewer" and row["revoked_at"] is None, row
    out = _cli(gw.url, gw.admin_key, "operators", "revoke", row["id"])
    assert out.returncode == 0 and "revoked_at: " in out.stdout, out.stderr
    out = _cli(gw.url, key, "operators", "list")
    assert out.returncode == 2 and "401 invalid_api_key" in out.stderr, out.stderr
