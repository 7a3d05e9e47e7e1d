"""The live market on one gateway (issue 37): a price set through the admin API
survives a restart with the same config file; a config file edited since it was last
applied is the market after the next start (the change logged); ``bourse admin config
apply`` shows the diff (``--dry-run`` changes nothing) and applies it; a product and
a deployment's slots set with ``bourse admin products|deployments set``; bad input is
a 400 naming the key, never a 500."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.support.bodies import USER
from tests.support.processes import clean_env, serve_process

ADMIN_KEY = "bk_admin_live_market_test"
CONFIG = """
[products.live]
[[products.live.deployments]]
engine = "sim"
name = "live-a"
slots = 2
floor = {floor}
"""


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
    )


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", url, "--admin-key", ADMIN_KEY, *args],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip


def _floor(url: str) -> float:
    floor: float = httpx.get(url + "/v1/market/live", timeout=10).json()["deployments"][0]["floor"]
    return floor


def test_a_live_price_survives_a_restart_and_an_edited_file_wins_at_the_next_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "lm", CONFIG.format(floor=1.0), data, ADMIN_KEY) as (url, _):
        r = _admin(url, "PATCH", "/admin/products/live", json={"deployments": {"live-a": {"floor": 2.0}}})
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "market.change", "version": 2, "applied": True,
                            "changes": ["live/live-a floor: 1 -> 2"]}  # fmt: skip
        assert _floor(url) == 2.0
    with serve_process(tmp_path, "lm", CONFIG.format(floor=1.0), data, ADMIN_KEY) as (url, _):
        assert _floor(url) == 2.0  # the same file: the database's market
        assert _admin(url, "GET", "/admin/market").json()["version"] == 2
    with serve_process(tmp_path, "lm", CONFIG.format(floor=3.0), data, ADMIN_KEY) as (url, _):
        assert _floor(url) == 3.0  # the file was edited since: it is the market now
        doc = _admin(url, "GET", "/admin/market").json()
        assert doc["version"] == 3 and doc["actor"].startswith("config-file:"), doc
    log = (tmp_path / "lm-0.log").read_text()
    assert "changed since it was last applied: live/live-a floor: 2 -> 3" in log, log


def test_config_apply_shows_the_diff_and_products_and_deployments_are_set_from_the_cli(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "lc", CONFIG.format(floor=1.0), data, ADMIN_KEY) as (url, _):
        edited = tmp_path / "edited.toml"
        edited.write_text(
            CONFIG.format(floor=1.5) + '\n[products.more]\n[[products.more.deployments]]\nengine = "sim"\n'
        )
        dry = _cli(url, "config", "apply", str(edited), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.splitlines() == [
            "market version 1: not applied (a dry run, or nothing to change)",
            "  product more added",
            "  live/live-a floor: 1 -> 1.5",
        ], dry.stdout
        assert _floor(url) == 1.0
        done = _cli(url, "config", "apply", str(edited))
        assert done.returncode == 0 and done.stdout.startswith("market version 2: applied"), done
        assert _floor(url) == 1.5
        key = _admin(url, "POST", "/admin/accounts", json={"id": "lc", "credit_usd": 1.0})
        assert key.status_code == 201
        secret = _admin(url, "POST", "/admin/keys", json={"account": "lc", "products": ["more"]}).json()[
            "key"
        ]
        ok = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                        json={"model": "more", "messages": USER, "max_tokens": 2}, timeout=30)  # fmt: skip
        assert ok.status_code == 200, ok.text

        s = _cli(url, "deployments", "set", "live", "live-a", "slots=7", "floor=0.5")
        assert s.returncode == 0, s.stderr
        assert "live/live-a slots: 2 -> 7" in s.stdout and "live/live-a floor: 1.5 -> 0.5" in s.stdout, (
            s.stdout
        )
        view = httpx.get(url + "/v1/market/live", timeout=10).json()["deployments"][0]
        assert (view["slots"], view["floor"]) == (7, 0.5)
        p = _cli(url, "products", "set", "live", "default_bid=2.5", 'description="priced live"')
        assert p.returncode == 0 and "live default_bid: unset -> 2.5" in p.stdout, p
        gone = _cli(url, "products", "remove", "more")
        assert gone.returncode == 0 and "product more removed" in gone.stdout, gone

        bad = _admin(url, "PATCH", "/admin/products/live", json={"deployments": {"live-a": {"slots": 0}}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_config", bad.text
        assert "slots" in bad.json()["error"]["message"], bad.text
        bad = _admin(url, "PATCH", "/admin/products/live", json={"set": {"no_such_term": 1}})
        assert bad.status_code == 400 and "unknown key" in bad.json()["error"]["message"], bad.text
        missing = _admin(url, "PATCH", "/admin/products/nope", json={"set": {"default_bid": 1}})
        assert missing.status_code == 404, missing.text
        last = _admin(url, "DELETE", "/admin/products/live")
        assert last.status_code == 409, last.text
        cli_bad = _cli(url, "config", "apply", str(tmp_path / "missing.toml"))
        assert cli_bad.returncode == 2 and "missing.toml" in cli_bad.stderr, cli_bad
