"""Secrets at rest: a served data folder is its owner's only, webhook secrets are stored
sealed, and generated keys never reach a log.

Before the fix ``bourse.db`` was created 0644 (its ``-wal`` and ``-shm`` too), webhook
secrets were stored in clear, the admin and demo keys were printed to stderr whatever
it was (a log file here), and a start on a taken port printed both keys (and wrote the
admin key) before it failed to bind.
"""

from __future__ import annotations

import os
import re
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
from cryptography.fernet import Fernet

from bourse.ports.stores import WebhookSecretUnreadable
from bourse.settings import read_environment
from bourse.storage.private import SEALED, SecretBox, key_notices
from bourse.storage.sqlite import SqliteStore
from tests.support.ledgers import watched
from tests.support.processes import clean_env, serve_process

CONFIG = """
[products.one]
[[products.one.deployments]]
engine = "sim"
"""
KEY = re.compile(rb"bk_[A-Za-z0-9_-]{20,}")
"""Any API or admin key (``bk_…``)."""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _logs(tmp: Path, name: str) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(tmp.glob(f"{name}-*.log")))


def _raw_database(data: Path) -> bytes:
    return b"".join(p.read_bytes() for p in data.glob("bourse.db*") if p.is_file())


def test_a_served_data_folder_keeps_its_secrets(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "first", CONFIG, data, admin_key="", extra_args=["--demo"]) as (url, _proc):
        admin_key = (data / "admin_key").read_text().strip()
        demo_key = (data / "demo_key").read_text().strip()
        admin = {"authorization": f"Bearer {admin_key}"}
        # the key files work
        assert (
            httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {demo_key}"}).status_code == 200
        )
        r = httpx.post(url + "/admin/accounts", json={"id": "hooked", "credit_usd": 1}, headers=admin)
        assert r.status_code == 201, r.text
        r = httpx.post(url + "/admin/keys", json={"account": "hooked"}, headers=admin)
        assert r.status_code == 201, r.text
        webhook_secret = r.json()["webhook_secret"]
        assert isinstance(webhook_secret, str) and len(webhook_secret) >= 32, r.json()
        # modes while it runs: the folder, the database and its WAL files, every key file
        assert _mode(data) == 0o700
        for name in ("bourse.db", "bourse.db-wal", "bourse.db-shm", "admin_key", "demo_key", "secret_key"):
            assert _mode(data / name) == 0o600, (name, oct(_mode(data / name)))
        # the webhook secret is nowhere in the database files, in clear
        assert webhook_secret.encode() not in _raw_database(data)
        with sqlite3.connect(f"file:{data / 'bourse.db'}?mode=ro", uri=True) as conn:
            [(stored,)] = conn.execute(
                "SELECT secret FROM webhook_secrets WHERE account_id = 'hooked'"
            ).fetchall()
        assert stored.startswith(SEALED) and webhook_secret not in stored, stored
    log = _logs(tmp_path, "first")
    assert not KEY.search(log), log  # stderr is not a terminal: no key, only where it is
    assert str(data / "admin_key").encode() in log and str(data / "demo_key").encode() in log, log
    # a restart on the same folder announces nothing (the demo account is there) and
    # still opens the sealed secret
    with serve_process(tmp_path, "again", CONFIG, data, admin_key="", extra_args=["--demo"]) as (url, _proc):
        r = httpx.post(url + "/admin/keys", json={"account": "hooked"}, headers=admin)
        assert r.status_code == 201 and r.json()["webhook_secret"] == webhook_secret, r.text
    again = _logs(tmp_path, "again")
    assert not KEY.search(again) and b"demo_key" not in again and b"admin_key" not in again, again


def test_a_start_on_a_taken_port_writes_and_prints_no_key(tmp_path: Path) -> None:
    (tmp_path / "gw.toml").write_text(CONFIG)
    data = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [sys.executable, "-m", "bourse", "serve", "--config", str(tmp_path / "gw.toml"),
                "--data-dir", str(data), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        proc = subprocess.run(
            args, capture_output=True, env=clean_env(), timeout=60, stdin=subprocess.DEVNULL
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert b"cannot listen" in proc.stderr, out
    assert not KEY.search(out), out
    assert not data.exists(), sorted(p.name for p in data.iterdir())


def test_keys_are_shown_on_a_terminal_and_not_written(tmp_path: Path) -> None:
    shown = "\n".join(key_notices(tmp_path, "bk_admin_" + "a" * 40, "bk_" + "d" * 43, terminal=True))
    assert "bk_admin_" + "a" * 40 in shown and "bk_" + "d" * 43 in shown, shown
    assert not (tmp_path / "demo_key").exists()


def test_an_existing_database_is_narrowed_and_old_secrets_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"

    async def before() -> str | None:
        legacy = SqliteStore(path)  # as before: no secret box
        await legacy.open()
        try:
            await legacy.create_account("old", 1, time.time())
            return await legacy.webhook_secret("old")
        finally:
            await legacy.close()

    async def after(clear: str | None) -> None:
        store = SqliteStore(path)
        store.secret_box = SecretBox.for_folder(tmp_path)
        await store.open()
        try:
            assert _mode(path) == 0o600
            assert await store.webhook_secret("old") == clear  # stored in clear: read as it is
            await store.create_account("new", 1, time.time())
            new = await store.webhook_secret("new")
            assert new is not None and len(new) == 48
            # another key (another replica without the same BOURSE_SECRET_KEY) cannot open it
            store.secret_box = SecretBox.for_folder(tmp_path / "elsewhere")
            with pytest.raises(WebhookSecretUnreadable):  # never read as "" (a signature anyone can make)
                await store.webhook_secret("new")
        finally:
            await store.close()

    with watched(tmp_path, None):  # the suite's ledger check runs on its books after
        clear = anyio.run(before)
        for p in tmp_path.glob("bourse.db*"):
            os.chmod(p, 0o644)  # a database made by an earlier version
        anyio.run(after, clear)
    assert _mode(tmp_path / "secret_key") == 0o600


def test_replicas_share_the_key_given_in_the_environment(tmp_path: Path) -> None:
    key = Fernet.generate_key().decode()
    env = read_environment({"BOURSE_SECRET_KEY": key})
    one = SecretBox.for_folder(tmp_path / "one", env.secret_key)
    two = SecretBox.for_folder(tmp_path / "two", env.secret_key)
    assert two.open(one.seal("s3cret")) == "s3cret"
    assert one.fingerprints == two.fingerprints and len(one.fingerprints[0]) == 64
    # a rotation: NEW,OLD opens what OLD sealed and seals with NEW
    new = Fernet.generate_key().decode()
    rolled = SecretBox.for_folder(tmp_path, f"{new}, {key}")
    assert rolled.opened(one.seal("s3cret")) == ("s3cret", 1)
    assert rolled.fingerprints[1] == one.fingerprints[0]
    assert SecretBox.for_folder(tmp_path, new).open(rolled.seal("s3cret")) == "s3cret"
    with pytest.raises(ValueError, match="BOURSE_SECRET_KEY: key 2 is not a Fernet key"):
        SecretBox.for_folder(tmp_path, f"{new},not-a-key")
    assert not (tmp_path / "one").exists() and not (tmp_path / "two").exists()
