"""Rotating the admin key live (issue 37, build item 2), through the served gateway on
SQLite and PostgreSQL: the new key (shown once) works at once, the old one during its
grace period and then 401 with a message saying it was rotated and when it stopped;
the rotation is audited and owner-only. Two replicas on one PostgreSQL database agree
within a second. ``bourse admin admin-key rotate`` with the data folder's key: the
gateway rewrites that file, and a restart with a rotated-out ``BOURSE_ADMIN_KEY``
warns once (never showing the key) and refuses it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet

from tests.e2e.money.support import new_caller
from tests.support.databases import fresh_postgres_database
from tests.support.errors import assert_error_envelope
from tests.support.gateway import ADMIN_KEY, running_gateway
from tests.support.processes import serve_process

CONFIG = """
[products.unit]
[[products.unit.deployments]]
engine = "sim"
slots = 2
floor = 1.0
tokens_per_s = 0
ttft_ms = 0
"""
STOPPED = re.compile(
    r"^The admin key was rotated; this key stopped working at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\.$"
)


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _ledger(url: str, key: str) -> httpx.Response:
    return httpx.get(url + "/admin/ledger", headers=_bearer(key), timeout=30)


def _until(pred: Callable[[], bool], within_s: float, what: str) -> float:
    """Poll ``pred`` until true; the seconds it took (fails past ``within_s``)."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < within_s, f"not within {within_s} s: {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_the_old_key_works_for_its_grace_then_is_refused_saying_so(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        r = gw.admin("POST", "/admin/admin_key/rotate", json={"grace_s": 1.5})
        assert r.status_code == 200, r.text
        doc = r.json()
        new = doc["key"]
        assert new.startswith("bk_admin_") and new != ADMIN_KEY and doc["object"] == "bourse.admin_key"
        assert doc["old_key_valid_until"] == pytest.approx(doc["rotated_at"] + 1.5)
        assert doc["key_file"] is None  # the key came from BOURSE_ADMIN_KEY: no file written
        assert _ledger(gw.url, new).status_code == 200
        assert _ledger(gw.url, ADMIN_KEY).status_code == 200  # in its grace
        audit = httpx.get(
            gw.url + "/admin/audit", params={"action": "admin_key.rotate"}, headers=_bearer(new)
        )
        entries = audit.json()["data"]
        assert [(e["actor"], e["target"], e["detail"]["grace_s"]) for e in entries] == [
            ("admin", "admin_key", 1.5)
        ]
        assert new not in audit.text
        _until(lambda: _ledger(gw.url, ADMIN_KEY).status_code == 401, 3.0, "the old key refused")
        err = assert_error_envelope(_ledger(gw.url, ADMIN_KEY), 401, "invalid_api_key")
        assert STOPPED.match(err["message"]), err
        assert _ledger(gw.url, new).status_code == 200
        # the new key is an admin key: not for /v1
        assert_error_envelope(httpx.get(gw.url + "/v1/account", headers=_bearer(new), timeout=30), 403,
                              "admin_key_not_allowed")  # fmt: skip
        # bounded grace; owners only; never a user key
        for bad in (-1, 7 * 86_400 + 1, "soon"):
            r = httpx.post(gw.url + "/admin/admin_key/rotate", json={"grace_s": bad}, headers=_bearer(new))
            assert r.status_code == 400, (bad, r.text)
        r = httpx.post(
            gw.url + "/admin/operators", json={"name": "ak-admin", "role": "admin"}, headers=_bearer(new)
        )
        admin_op = r.json()["key"]
        r = httpx.post(gw.url + "/admin/admin_key/rotate", json={}, headers=_bearer(admin_op))
        assert_error_envelope(r, 403, "insufficient_role")
        gw.admin_key = new
        me = new_caller(gw, "ak-user", 1.0)
        r = httpx.post(gw.url + "/admin/admin_key/rotate", json={}, headers=me.auth)
        assert_error_envelope(r, 403, "admin_only")
        # an owner operator may rotate; default grace one hour
        r = httpx.post(
            gw.url + "/admin/operators", json={"name": "ak-owner", "role": "owner"}, headers=_bearer(new)
        )
        owner = r.json()["key"]
        r = httpx.post(gw.url + "/admin/admin_key/rotate", json={}, headers=_bearer(owner))
        assert r.status_code == 200, r.text
        assert r.json()["grace_s"] == 3600
        assert _ledger(gw.url, new).status_code == 200 and _ledger(gw.url, r.json()["key"]).status_code == 200
        gw.admin_key = r.json()["key"]
        audit = gw.admin("GET", "/admin/audit", params={"action": "admin_key.rotate"}).json()["data"]
        assert [e["actor"] for e in audit] == ["operator:ak-owner", "admin"]


@pytest.mark.postgres
def test_two_replicas_agree_on_a_rotation_within_a_second(tmp_path: Path) -> None:
    folders = [tmp_path / "a", tmp_path / "b"]
    secret = Fernet.generate_key()
    for folder in folders:  # replicas of one database share BOURSE_SECRET_KEY
        folder.mkdir(mode=0o700)
        (folder / "secret_key").write_bytes(secret + b"\n")
    with fresh_postgres_database() as dsn, ExitStack() as stack:
        a = stack.enter_context(running_gateway(CONFIG, database=dsn, data_dir=str(folders[0])))
        b = stack.enter_context(running_gateway(CONFIG, database=dsn, data_dir=str(folders[1])))
        # sessions on b: the admin key's and an operator's
        r = a.admin("POST", "/admin/operators", json={"name": "ak-viewer", "role": "viewer"})
        viewer = r.json()["key"]
        sessions = {}
        for name, key in (("admin", ADMIN_KEY), ("viewer", viewer)):
            c = stack.enter_context(httpx.Client(base_url=b.url, headers={"origin": b.url}, timeout=30))
            assert c.post("/dashboard/api/session", json={"key": key}).status_code == 200
            sessions[name] = c
        assert _ledger(b.url, ADMIN_KEY).status_code == 200  # b has the admin keys cached now
        r = a.admin("POST", "/admin/admin_key/rotate", json={"grace_s": 0})
        assert r.status_code == 200, r.text
        new = r.json()["key"]
        assert_error_envelope(_ledger(a.url, ADMIN_KEY), 401, "invalid_api_key")  # at once on a
        assert _ledger(a.url, new).status_code == 200
        took = _until(lambda: _ledger(b.url, ADMIN_KEY).status_code == 401, 1.0, "b refuses the old key")
        took = max(took, _until(lambda: _ledger(b.url, new).status_code == 200, 1.0, "b takes the new key"))
        assert took < 1.0
        err = assert_error_envelope(_ledger(b.url, ADMIN_KEY), 401, "invalid_api_key")
        assert STOPPED.match(err["message"]), err
        # the old key's dashboard session on b ended; the operator's goes on (the secret is the database's)
        assert sessions["admin"].get("/dashboard/api/accounts").status_code == 401
        assert sessions["viewer"].get("/dashboard/api/accounts").status_code == 200
        # a session made on a is good on b
        with httpx.Client(base_url=a.url, headers={"origin": a.url}, timeout=30) as c:
            assert c.post("/dashboard/api/session", json={"key": new}).status_code == 200
            cookie = c.cookies.get("bourse_session")
        r = httpx.get(b.url + "/dashboard/api/session", cookies={"bourse_session": cookie or ""})
        assert r.json()["role"] == "owner", r.text
        for gw in (a, b):
            gw.admin_key = new


def _cli(url: str, data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", url, "--data-dir", str(data), *args],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def _log(tmp: Path, name: str) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.log")))


def test_the_cli_rotates_the_data_folders_key_and_a_rotated_out_env_key_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "first", CONFIG, data, admin_key="") as (url, _):
        old = (data / "admin_key").read_text().strip()
        out = _cli(url, data, "admin-key", "rotate", "--grace-s", "0")
        assert out.returncode == 0, out.stderr
        shown = re.search(r"admin key \(shown once, keep it now\): (bk_admin_\S+)", out.stdout)
        assert shown is not None, out.stdout
        new = shown.group(1)
        assert (data / "admin_key").read_text().strip() == new
        assert f"key_file: {data / 'admin_key'}" in out.stdout
        assert _cli(url, data, "accounts", "list").returncode == 0  # the CLI reads the new key from the file
        err = assert_error_envelope(_ledger(url, old), 401, "invalid_api_key")
        assert STOPPED.match(err["message"]), err
    # a restart with the file: its key is the database's, nothing to say
    with serve_process(tmp_path, "again", CONFIG, data, admin_key="") as (url, _):
        assert _ledger(url, new).status_code == 200
    assert "admin key" not in _log(tmp_path, "again")
    # a restart told the rotated-out key: one warning, without the key; refused; the database's key works
    with serve_process(tmp_path, "stale", CONFIG, data, admin_key=old) as (url, _):
        assert_error_envelope(_ledger(url, old), 401, "invalid_api_key")
        assert _ledger(url, new).status_code == 200
    log = _log(tmp_path, "stale")
    warnings = [line for line in log.splitlines() if "configured admin key (BOURSE_ADMIN_KEY)" in line]
    assert len(warnings) == 1 and "rotated away" in warnings[0] and "WARNING" in warnings[0].upper(), log
    assert old not in log and new not in log
