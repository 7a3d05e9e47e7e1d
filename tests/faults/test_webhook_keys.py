"""Webhook secrets fail closed, and replicas of one PostgreSQL database seal them with
one key.

Served replicas (``bourse serve`` processes) on a fresh PostgreSQL database, in front of
a real webhook receiver on 127.0.0.1 that checks every signature (``[jobs]
allow_loopback_webhooks``; the URLs are literal loopback addresses, nothing is looked up).

Before the fix, docs/replicas.md never said to share ``BOURSE_SECRET_KEY``: a second
replica with its own data folder started with its own key, logged that a webhook secret
"cannot be decrypted" and delivered anyway, signed with the key ``""`` (the receiver's
real secret did not verify; the empty key did). Now the database keeps a check value of
the key that seals its secrets: a replica whose keys do not include it refuses to start
with one line naming ``BOURSE_SECRET_KEY``; a secret that still cannot be opened (sealed
by a key no replica has) holds its webhook, says why on the job and in the log, and the
delivery goes out once an admin sets a new secret (or re-seals); a key is rotated by
giving every replica ``NEW,OLD`` and re-sealing, with no receiver's secret changing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from cryptography.fernet import Fernet

from tests.faults.webhook_rig import Receiver
from tests.support.processes import clean_env, free_port, serve_process
from tests.support.servers import serve_app_in_thread

pytestmark = pytest.mark.postgres

ADMIN_KEY = "bk_admin_webhook_keys"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CONFIG = """
[products.one]
[[products.one.deployments]]
engine = "sim"
slots = 4

[jobs]
allow_loopback_webhooks = true
webhook_attempts = 3
webhook_backoff_s = 0.1
sweep_interval_s = 0.2
"""
BODY = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _key() -> str:
    return Fernet.generate_key().decode()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    rec = Receiver()
    with serve_app_in_thread(rec.app()) as url:
        yield rec, url


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, url + path, headers=ADMIN, timeout=30, **kw)


def _account(url: str, account: str) -> tuple[str, str]:
    """A funded account and an API key for it; (API key, webhook secret)."""
    r = _admin(url, "POST", "/admin/accounts", json={"id": account, "credit_usd": 5})
    assert r.status_code == 201, r.text
    r = _admin(url, "POST", "/admin/keys", json={"account": account})
    assert r.status_code == 201, r.text
    return r.json()["key"], r.json()["webhook_secret"]


def _submit(url: str, key: str, webhook_url: str) -> str:
    doc = {"endpoint": "/v1/chat/completions", "body": BODY, "webhook_url": webhook_url}
    r = httpx.post(url + "/v1/jobs", json=doc, headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]
    return job_id


def _job(url: str, key: str, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def _webhook_state(url: str, key: str, job_id: str, state: str, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = _job(url, key, job_id)
        if (job.get("webhook") or {}).get("state") == state:
            return job
        assert time.monotonic() < deadline, f"webhook of {job_id} not {state}: {job}"
        time.sleep(0.05)


def _refused(tmp: Path, name: str, data: Path, dsn: str, env: dict[str, str]) -> str:
    """``bourse serve`` that must refuse to start; its stderr."""
    config = tmp / f"{name}.toml"
    config.write_text(CONFIG)
    args = [sys.executable, "-m", "bourse", "serve", "--config", str(config), "--data-dir", str(data),
            "--host", "127.0.0.1", "--port", str(free_port()), "--database", dsn]  # fmt: skip
    try:
        proc = subprocess.run(
            args, capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
            env=clean_env(BOURSE_ADMIN_KEY=ADMIN_KEY, **env),
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{name}: started (still serving after 30 s) with another key") from exc
    err = proc.stderr.decode()
    assert proc.returncode != 0, (name, err)
    assert "Traceback" not in err, err
    reasons = [line for line in err.splitlines() if "BOURSE_SECRET_KEY" in line]
    assert len(reasons) == 1 and reasons[0].startswith("bourse: "), err
    return reasons[0]


def _log(tmp: Path, name: str) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.log")))


def test_a_replica_with_another_key_refuses_to_start(
    tmp_path: Path, postgres_dsn: str, receiver: tuple[Receiver, str]
) -> None:
    """The first replica (its data folder's key) runs; a second with its own folder key,
    or another BOURSE_SECRET_KEY, is refused; given the first one's key it runs, and both
    deliver signed with the account's secret."""
    rec, hooks = receiver
    data_a, data_b = tmp_path / "a", tmp_path / "b"
    with serve_process(tmp_path, "a", CONFIG, data_a, ADMIN_KEY, postgres_dsn) as (url_a, _):
        key, secret = _account(url_a, "acme")
        line = _refused(tmp_path, "b-folder", data_b, postgres_dsn, {})
        assert "secret_key" in line, line
        _refused(tmp_path, "b-other", data_b, postgres_dsn, {"BOURSE_SECRET_KEY": _key()})
        shared = {"BOURSE_SECRET_KEY": (data_a / "secret_key").read_text().strip()}
        with serve_process(tmp_path, "b", CONFIG, data_b, ADMIN_KEY, postgres_dsn, env=shared) as (url_b, _):
            for name, url in (("a", url_a), ("b", url_b)):
                job_id = _submit(url, key, f"{hooks}/hook/{name}")
                _webhook_state(url, key, job_id, "delivered")
                for delivery in rec.wait(f"/hook/{name}"):  # (either replica's sweep may send it too)
                    assert delivery.signed_with(secret) and not delivery.signed_with(""), (
                        name,
                        delivery.headers,
                    )


def test_a_secret_no_replica_can_open_is_held_until_an_admin_sets_a_new_one(
    tmp_path: Path, postgres_dsn: str, receiver: tuple[Receiver, str]
) -> None:
    rec, hooks = receiver
    shared = {"BOURSE_SECRET_KEY": _key()}
    with ExitStack() as stack:
        url_a, _ = stack.enter_context(
            serve_process(tmp_path, "a", CONFIG, tmp_path / "a", ADMIN_KEY, postgres_dsn, env=shared)
        )
        url_b, _ = stack.enter_context(
            serve_process(tmp_path, "b", CONFIG, tmp_path / "b", ADMIN_KEY, postgres_dsn, env=shared)
        )
        key, secret = _account(url_a, "acme")
        # the account's secret as a replica with another key sealed it (before the keys were checked)
        lost = "fernet:" + Fernet(_key().encode()).encrypt(b"sealed-with-a-lost-key").decode()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute("UPDATE webhook_secrets SET secret = %s WHERE account_id = 'acme'", (lost,))
        job_id = _submit(url_b, key, f"{hooks}/hook/held")
        deadline = time.monotonic() + 20
        while (
            not rec.at("/hook/held")
            and (_job(url_b, key, job_id).get("webhook") or {}).get("state") != "held"
        ):
            assert time.monotonic() < deadline, _job(url_b, key, job_id)
            time.sleep(0.05)
        time.sleep(1.0)  # a second sweep, a retry: still nothing
        sent = rec.at("/hook/held")
        assert not sent, f"delivered anyway, signed with the empty key: {[d.signed_with('') for d in sent]}"
        job = _webhook_state(url_a, key, job_id, "held")
        assert job["status"] == "succeeded", job
        why = job["webhook"]["error"]
        assert "BOURSE_SECRET_KEY" in why and "/admin/accounts/acme/webhook_secret" in why, why
        log = _log(tmp_path, "a") + _log(tmp_path, "b")  # either replica's sweep may have tried it
        assert job_id in log and "BOURSE_SECRET_KEY" in log, log[-2000:]
        for text in (secret, lost, "sealed-with-a-lost-key", shared["BOURSE_SECRET_KEY"]):
            assert text not in log, "a secret in the log"
        # an admin sets a new secret: the held delivery goes out, signed with it
        r = _admin(url_a, "POST", "/admin/accounts/acme/webhook_secret")
        assert r.status_code == 200, r.text
        new = r.json()
        assert new["account"] == "acme" and new["released_jobs"] == 1, new
        assert new["webhook_secret"] not in (secret, ""), new
        assert _webhook_state(url_b, key, job_id, "delivered")["webhook"]["error"] is None
        for delivery in rec.wait("/hook/held"):
            assert delivery.signed_with(new["webhook_secret"]) and not delivery.signed_with(""), (
                delivery.headers
            )
        # the new secret is the account's from now on, and the audit log names the change, not the secret
        r = _admin(url_b, "POST", "/admin/keys", json={"account": "acme"})
        assert r.json()["webhook_secret"] == new["webhook_secret"], r.text
        r = _admin(url_a, "GET", "/admin/audit", params={"action": "account.webhook_secret"})
        [entry] = r.json()["data"]
        assert entry["target"] == "acme" and new["webhook_secret"] not in r.text, entry


def test_a_rotated_key_keeps_every_secret(
    tmp_path: Path, postgres_dsn: str, receiver: tuple[Receiver, str]
) -> None:
    """OLD on every replica; then NEW,OLD on each (the database still seals with OLD) and
    a re-seal; a replica left with OLD alone holds its webhooks (never signs with ``""``)
    and is refused at its next start; NEW alone works, and no receiver's secret changed."""
    rec, hooks = receiver
    old, new = _key(), _key()
    data_a, data_b, data_c = tmp_path / "a", tmp_path / "b", tmp_path / "c"

    def delivered(url: str, key: str, path: str, secret: str) -> None:
        job_id = _submit(url, key, hooks + path)
        _webhook_state(url, key, job_id, "delivered")
        for delivery in rec.wait(path):  # (another replica's sweep may send it too)
            assert delivery.signed_with(secret) and not delivery.signed_with(""), (path, delivery.headers)

    # C's sweep never comes during the test, so it does not try the others' webhooks (a
    # replica's sweep sends any pending webhook that it does not run itself: the one
    # lacking NEW would hold theirs, which only a re-seal sends; rotation step 3 does)
    lazy = CONFIG.replace("sweep_interval_s = 0.2", "sweep_interval_s = 3600")
    with serve_process(
        tmp_path, "c", lazy, data_c, ADMIN_KEY, postgres_dsn, env={"BOURSE_SECRET_KEY": old}
    ) as (url_c, _):
        key, secret = _account(url_c, "acme")
        both = {"BOURSE_SECRET_KEY": f"{new},{old}"}
        with ExitStack() as stack:
            url_a, _ = stack.enter_context(
                serve_process(tmp_path, "a", CONFIG, data_a, ADMIN_KEY, postgres_dsn, env=both)
            )
            url_b, _ = stack.enter_context(
                serve_process(tmp_path, "b", CONFIG, data_b, ADMIN_KEY, postgres_dsn, env=both)
            )
            delivered(url_b, key, "/hook/rolled", secret)
            r = _admin(url_a, "POST", "/admin/webhook_secrets/reseal")
            assert r.status_code == 200, r.text
            report = r.json()
            assert report["resealed"] >= 1 and report["unreadable"] == [], report  # acme at least
            late_key, late_secret = _account(url_b, "late")  # sealed with NEW: the database's key now
            delivered(url_a, key, "/hook/resealed", secret)
        # the replica still on OLD alone (the others stopped) cannot open what NEW sealed:
        # held, never signed with ""
        held = _submit(url_c, key, hooks + "/hook/old-only")
        assert _webhook_state(url_c, key, held, "held")["webhook"]["error"]
        time.sleep(0.5)
        assert rec.at("/hook/old-only") == []
    _refused(tmp_path, "c-again", data_c, postgres_dsn, {"BOURSE_SECRET_KEY": old})
    with serve_process(
        tmp_path, "a-new", CONFIG, data_a, ADMIN_KEY, postgres_dsn, env={"BOURSE_SECRET_KEY": new}
    ) as (url, _):
        delivered(url, key, "/hook/new-only", secret)
        delivered(url, late_key, "/hook/late", late_secret)
        # a re-seal (here from the command line) releases what the replica with only the old key held
        cli = subprocess.run(
            [sys.executable, "-m", "bourse", "admin", "--url", url, "--admin-key", ADMIN_KEY,
             "webhook-secrets", "reseal", "--json"],
            capture_output=True, timeout=60, env=clean_env(), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        report = json.loads(cli.stdout)
        assert (report["released_jobs"], report["resealed"], report["unreadable_count"]) == (1, 0, 0), report
        _webhook_state(url, key, held, "delivered")
        for delivery in rec.wait("/hook/old-only"):
            assert delivery.signed_with(secret), delivery.headers


def test_a_database_sealed_before_the_check_and_a_lost_key(
    tmp_path: Path, postgres_dsn: str, receiver: tuple[Receiver, str]
) -> None:
    """A database whose secrets were sealed before it named a key (an earlier version):
    a replica that opens none of them is refused, the one that sealed them is not. Its
    key then lost, ``--adopt-secret-key`` gives the secrets up: their webhooks are held
    until each account gets a new secret, and the old key is refused from then on."""
    rec, hooks = receiver
    data_a, data_b = tmp_path / "a", tmp_path / "b"
    with serve_process(tmp_path, "a", CONFIG, data_a, ADMIN_KEY, postgres_dsn) as (url, _):
        key, _secret = _account(url, "acme")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM sealing_key")  # as a database of the version before the check
    line = _refused(tmp_path, "b", data_b, postgres_dsn, {})
    assert "opens none of the webhook secrets" in line, line
    with serve_process(tmp_path, "a-again", CONFIG, data_a, ADMIN_KEY, postgres_dsn) as (url, _):
        assert _admin(url, "GET", "/admin/accounts/acme").status_code == 200
    # the key of data_a is lost: another one takes the database over
    with serve_process(
        tmp_path, "b-adopts", CONFIG, data_b, ADMIN_KEY, postgres_dsn, extra_args=["--adopt-secret-key"]
    ) as (url, _):
        assert "instead of the key" in _log(tmp_path, "b-adopts")
        job_id = _submit(url, key, hooks + "/hook/adopted")
        assert "webhook_secret" in _webhook_state(url, key, job_id, "held")["webhook"]["error"]
        r = _admin(url, "POST", "/admin/webhook_secrets/reseal")
        assert r.json()["unreadable"] == ["acme"] and r.json()["released_jobs"] == 0, r.text
        r = _admin(url, "POST", "/admin/accounts/acme/webhook_secret")
        assert r.status_code == 200 and r.json()["released_jobs"] == 1, r.text
        _webhook_state(url, key, job_id, "delivered")
        for delivery in rec.wait("/hook/adopted"):
            assert delivery.signed_with(r.json()["webhook_secret"]), delivery.headers
    _refused(tmp_path, "a-refused", data_a, postgres_dsn, {})
