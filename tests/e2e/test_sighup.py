"""SIGHUP on a served gateway (issue 37): the config file read again and its products
written as the market's next version (a floor changed while a stream runs on to
``[DONE]``; an engine's setting rebuilds its deployment), each change logged and
audited; a file that cannot be used changes nothing; what only a restart applies
(``[server]``) is named. Before, SIGHUP killed the gateway and cut the stream."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import serve_process
from tests.support.sse import open_sse

ADMIN_KEY = "bk_admin_sighup_test"
CONFIG = """
[server]
log_level = "info"

[products.slow]
sim_overrides = true
[[products.slow.deployments]]
engine = "sim"
name = "slow-a"
slots = 1
floor = {floor}
tokens_per_s = 20
"""
USER = [{"role": "user", "content": "Tell me about the market."}]


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
    )


def _key(url: str) -> dict[str, str]:
    assert _admin(url, "POST", "/admin/accounts", json={"id": "hup", "credit_usd": 1.0}).status_code == 201
    r = _admin(url, "POST", "/admin/keys", json={"account": "hup"})
    assert r.status_code == 201, r.text
    return {"authorization": f"Bearer {r.json()['key']}"}


def _deployment(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(url + "/v1/market/slow", timeout=10).json()["deployments"][0]
    return doc


def _until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


def test_sighup_changes_a_floor_while_a_stream_runs_to_done(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with serve_process(tmp_path, "hup", CONFIG.format(floor=1.0), data, ADMIN_KEY) as (url, proc):
        auth = _key(url)
        body = {"model": "slow", "messages": USER, "max_tokens": 40, "max_price": 5.0,
                "stream_options": {"include_usage": True}, "sim": {"output_tokens": 40}}  # fmt: skip
        with open_sse(url, body, headers=auth) as s:
            s.read_content(2)
            (tmp_path / "hup.toml").write_text(CONFIG.format(floor=2.0))
            proc.send_signal(signal.SIGHUP)
            _until(lambda: _deployment(url)["floor"] == 2.0)
            for _ in s.frames():
                pass
            result = s.result()
        assert proc.poll() is None, "SIGHUP stopped the gateway"
        assert result.data_frames[-1].is_done, result.raw[-400:]
        assert not [c for c in result.chunks if "error" in c], result.raw[-400:]
        assert len(result.content_chunks) == 40
        usage = [c["usage"] for c in result.chunks if c.get("usage")][-1]
        assert usage["x_market"]["cleared_price"] == 1.0  # cleared before the change: its price kept

        after = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=30,
                           json={"model": "slow", "messages": USER, "max_tokens": 2, "max_price": 5.0})  # fmt: skip
        assert after.status_code == 200, after.text
        assert after.json()["usage"]["x_market"]["cleared_price"] == 2.0
        audit = _admin(url, "GET", "/admin/audit", params={"action": "market.change"}).json()["data"]
        assert [(e["actor"], e["target"], e["detail"]["changes"]) for e in audit] == [
            ("sighup", "market", ["slow/slow-a floor: 1 -> 2"])
        ], audit
    log = (tmp_path / "hup-0.log").read_text()
    assert "SIGHUP: slow/slow-a floor: 1 -> 2" in log, log


def test_a_file_that_cannot_be_used_changes_nothing_and_a_server_change_is_named(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    config = tmp_path / "hup2.toml"
    with serve_process(tmp_path, "hup2", CONFIG.format(floor=1.0), data, ADMIN_KEY) as (url, proc):
        config.write_text("[products.slow\nbroken")
        proc.send_signal(signal.SIGHUP)
        log = tmp_path / "hup2-0.log"
        _until(lambda: "SIGHUP: nothing changed" in log.read_text())
        assert proc.poll() is None and _deployment(url)["floor"] == 1.0

        config.write_text(CONFIG.format(floor=1.0).replace("tokens_per_s = 20", "tokens_per_s = 30")
                          .replace("slots = 1", "slots = 3").replace('"info"', '"info"\nbook_timeout_s = 9'))  # fmt: skip
        proc.send_signal(signal.SIGHUP)
        _until(lambda: _deployment(url)["slots"] == 3)
        _until(lambda: "SIGHUP: [server] changed: needs a restart" in log.read_text())
        assert "SIGHUP: deployment slow/slow-a: tokens_per_s changed" in log.read_text()
        assert proc.poll() is None
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200
