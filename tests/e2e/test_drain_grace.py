"""``[server] drain_grace_s`` (SPEC 11's drain, issue 37): after SIGTERM an idle gateway
keeps its listener open, ``/readyz`` answering 503, for the grace, so that a load
balancer polling it sees it leave before its connections are refused; then it exits 0.
``BOURSE_DRAIN_GRACE_S`` overrides the setting; a value that is not seconds is refused
at start, naming the variable."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.processes import clean_env, free_port, serve_process

CONFIG = """
[server]
log_level = "warning"
drain_grace_s = {grace}

[products.chat]
[[products.chat.deployments]]
engine = "sim"
slots = 2
"""


def _readyz_after_sigterm(url: str, proc: subprocess.Popen[bytes]) -> list[tuple[float, int | None]]:
    """SIGTERM, then ``/readyz`` every 50 ms until the listener refuses: (seconds since
    the signal, status; None once refused)."""
    assert httpx.get(url + "/readyz", timeout=5).status_code == 200
    seen: list[tuple[float, int | None]] = []
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while time.monotonic() - t0 < 30:
        try:
            status: int | None = httpx.get(url + "/readyz", timeout=2).status_code
        except httpx.HTTPError:
            status = None
        seen.append((time.monotonic() - t0, status))
        if status is None:
            break
        time.sleep(0.05)
    return seen


def test_an_idle_gateway_says_503_for_its_grace_before_it_closes(tmp_path: Path) -> None:
    config = CONFIG.replace("drain_grace_s = {grace}\n", "")  # the default: 5 s
    env = {"BOURSE_DRAIN_GRACE_S": ""}  # the config's grace, not the suite's 0
    with serve_process(tmp_path, "grace", config, tmp_path / "data", "bk_admin_grace", env=env) as (
        url,
        proc,
    ):
        seen = _readyz_after_sigterm(url, proc)
        assert proc.wait(timeout=20) == 0
    unready = [t for t, status in seen if status == 503]
    assert seen[-1][1] is None and unready, seen
    assert unready[0] < 0.5, seen  # the drain says so at once
    assert unready[-1] >= 4.8, seen  # and for the whole grace
    assert seen[-1][0] < 5 + 3, seen


def test_the_environment_overrides_the_grace(tmp_path: Path) -> None:
    config = CONFIG.format(grace=600)
    env = {"BOURSE_DRAIN_GRACE_S": "0.3"}
    with serve_process(tmp_path, "env", config, tmp_path / "data", "bk_admin_grace", env=env) as (url, proc):
        seen = _readyz_after_sigterm(url, proc)
        assert proc.wait(timeout=20) == 0
    assert seen[-1][1] is None and seen[-1][0] < 3, seen


def test_a_grace_that_is_not_seconds_is_refused_at_start(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text(CONFIG.format(grace=1))
    r = subprocess.run(
        [sys.executable, "-m", "bourse", "serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"),
         "--port", str(free_port())],
        env=clean_env(BOURSE_DRAIN_GRACE_S="soon"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode != 0
    assert "BOURSE_DRAIN_GRACE_S: expected seconds from 0 to 3600, got 'soon'" in r.stderr, r.stderr
    assert not (tmp_path / "d" / "lock").exists()


def test_a_busy_gateway_keeps_its_grace_after_its_last_stream_ends(tmp_path: Path) -> None:
    """Busy at the signal: the running stream ends well inside the grace (2 s of 4); the
    listener still stays open, ``/readyz`` 503, until the grace has passed."""
    config = CONFIG.format(grace=4) + "tokens_per_s = 20\n"  # 40 tokens: 2 s
    admin = {"authorization": "Bearer bk_admin_grace"}
    env = {"BOURSE_DRAIN_GRACE_S": ""}  # the config's grace, not the suite's 0
    with serve_process(tmp_path, "busy", config, tmp_path / "data", "bk_admin_grace", env=env) as (url, proc):
        assert httpx.post(url + "/admin/accounts", json={"id": "g", "credit_usd": 1.0}, headers=admin,
                          timeout=30).status_code == 201  # fmt: skip
        key = httpx.post(url + "/admin/keys", json={"account": "g"}, headers=admin, timeout=30).json()["key"]
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40,
            "stream": True,
        }
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST", url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            ) as resp,
        ):
            lines = resp.iter_lines()
            assert resp.status_code == 200 and any(line.startswith("data: ") for line in lines)
            seen = _readyz_after_sigterm(url, proc)
            rest = list(lines)
        assert proc.wait(timeout=20) == 0
    rest = [line for line in rest if line]
    assert rest[-1] == "data: [DONE]" and not [r for r in rest if '"error"' in r], rest[-5:]
    unready = [t for t, status in seen if status == 503]
    assert seen[-1][1] is None and unready and unready[-1] >= 3.8, seen
