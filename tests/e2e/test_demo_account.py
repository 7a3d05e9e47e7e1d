"""The ``demo`` account is the embedded start's convenience, not a production default
(issue 37): ``bourse serve`` with no config file on SQLite (the README's first command)
makes it on a fresh ledger; a config file or PostgreSQL makes none and the start-up log
names no demo key, unless ``--demo`` or ``[server] demo = true`` asks for it.

Before the fix every fresh ledger got the account, PostgreSQL clusters included, with
no way to turn it off.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_demo_account_test"
CONFIG = """
[products.one]
[[products.one.deployments]]
engine = "sim"
"""
KEY_FILE = re.compile(
    r"demo account 'demo' with \$5\.00 of credit; its API key is in the file (\S+) \(mode 600\)"
)
ANY_KEY = re.compile(r"bk_[A-Za-z0-9_-]{20,}")


def _admin(url: str, path: str) -> httpx.Response:
    return httpx.get(url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)


def _log(tmp: Path, name: str) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.log")))


def _no_demo(url: str, tmp: Path, name: str, data: Path) -> None:
    """No account, no key, no key file, and no line about one in the log."""
    r = _admin(url, "/admin/accounts")
    assert r.status_code == 200, r.text
    assert "demo" not in {a["id"] for a in r.json()["data"]}, r.json()
    assert _admin(url, "/admin/accounts/demo").status_code == 404
    r = _admin(url, "/admin/keys?account=demo")
    assert r.status_code == 200 and r.json()["data"] == [], r.text
    assert not (data / "demo_key").exists()
    log = _log(tmp, name)
    assert "demo account" not in log and "demo_key" not in log and not ANY_KEY.search(log), log


def _demo_key_works(url: str, tmp: Path, name: str) -> str:
    """The account with its $5.00, and the key whose file the log names answers."""
    r = _admin(url, "/admin/accounts/demo")
    assert r.status_code == 200, r.text
    assert r.json()["balance_micros"] == 5_000_000, r.json()
    log = _log(tmp, name)
    match = KEY_FILE.search(log)
    assert match is not None, log
    key = Path(match.group(1)).read_text().strip()
    r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    return key


def test_a_config_file_on_sqlite_makes_no_demo_account(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "sqlite", CONFIG, data, ADMIN_KEY) as (url, _proc):
        _no_demo(url, tmp_path, "sqlite", data)
        r = httpx.post(
            url + "/admin/accounts", json={"id": "acme", "credit_usd": 1},
            headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10,
        )  # fmt: skip
        assert r.status_code == 201, r.text
    # nor does a later start without a config file on that ledger: one with accounts is
    # no first start
    with serve_process(tmp_path, "embedded-later", None, data, ADMIN_KEY) as (url, _proc):
        _no_demo(url, tmp_path, "embedded-later", data)


@pytest.mark.postgres
@pytest.mark.parametrize("config", [CONFIG, None], ids=["config-file", "built-in-config"])
def test_postgresql_makes_no_demo_account(tmp_path: Path, postgres_dsn: str, config: str | None) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "pg", config, data, ADMIN_KEY, postgres_dsn) as (url, _proc):
        _no_demo(url, tmp_path, "pg", data)


@pytest.mark.postgres
def test_demo_flag_makes_it_on_postgresql(tmp_path: Path, postgres_dsn: str) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "asked", CONFIG, data, ADMIN_KEY, postgres_dsn, extra_args=["--demo"]) as (
        url,
        _proc,
    ):
        key = _demo_key_works(url, tmp_path, "asked")
    # asked again on a restart: the account is there, nothing new is made or shown
    with serve_process(
        tmp_path, "asked-again", CONFIG, data, ADMIN_KEY, postgres_dsn, extra_args=["--demo"]
    ) as (url, _proc):
        r = _admin(url, "/admin/keys?account=demo")
        assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
        assert "demo account" not in _log(tmp_path, "asked-again")
        r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, r.text


def test_demo_setting_makes_it_on_sqlite(tmp_path: Path) -> None:
    config = "[server]\ndemo = true\n" + CONFIG
    with serve_process(tmp_path, "setting", config, tmp_path / "data", ADMIN_KEY) as (url, _proc):
        _demo_key_works(url, tmp_path, "setting")


def test_the_embedded_first_start_makes_it(tmp_path: Path) -> None:
    """``bourse serve`` with no config file on a fresh SQLite folder: the README's first command."""
    with serve_process(tmp_path, "embedded", None, tmp_path / "data", ADMIN_KEY) as (url, _proc):
        _demo_key_works(url, tmp_path, "embedded")
