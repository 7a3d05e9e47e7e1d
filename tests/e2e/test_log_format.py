"""``log_format = "json"`` as a real ``bourse serve`` process: every line it writes on
stderr is one JSON object, from its first line (the address it serves, the keys it
made) to its last (the drain after SIGTERM), and so is the one line of a start that
fails (a bad config, a port in use). With ``text`` the command's own lines keep their
``bourse: …`` shape (tests/e2e/test_cli.py reads them)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.bodies import USER
from tests.support.processes import clean_env, serve_process

ADMIN_KEY = "bk_admin_log_format_test"

CONFIG = """
[server]
log_format = "json"
demo = true  # the demo key's line is one of the first start's lines to check

[products.fast]
[[products.fast.deployments]]
engine = "sim"
slots = 2
"""


def not_json(text: str) -> list[str]:
    """The non-empty lines of ``text`` that are not one JSON object each."""
    bad = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if not isinstance(doc, dict):
            bad.append(line)
    return bad


def records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_json_gateway_writes_only_json_lines_from_start_to_stop(tmp_path: Path) -> None:
    data = tmp_path / "data"  # a fresh folder: the first start's lines (the demo key's file) too
    with serve_process(tmp_path, "json", CONFIG, data, ADMIN_KEY) as (url, proc):
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.post(url + "/admin/accounts", json={"id": "logs", "credit_usd": 10}, headers=admin)
        assert r.status_code == 201, r.text
        r = httpx.post(url + "/admin/keys", json={"account": "logs"}, headers=admin)
        key = r.json()["key"]
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "fast", "messages": USER, "max_tokens": 4},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    log = max(tmp_path.glob("json-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert not not_json(log), "lines that are not JSON:\n" + "\n".join(not_json(log))
    got = records(log)
    msgs = [d["msg"] for d in got]
    # the lines that used to be plain text, now records with their fields
    [serving] = [d for d in got if d["msg"].startswith("serving ")]
    assert serving["url"] == url + "/v1" and serving["products"] == ["fast"], serving
    assert any("demo_key" in m for m in msgs), msgs
    assert any(d["logger"] == "bourse.access" and d.get("product") == "fast" for d in got), got
    assert any(m.startswith("drained") for m in msgs), msgs  # the shutdown's last word
    assert all({"ts", "level", "logger", "msg"} <= d.keys() for d in got), got


def _taken_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port: int = sock.getsockname()[1]
    return sock, port


@pytest.mark.parametrize("failure", ["bad config", "port in use"])
def test_a_json_gateway_that_cannot_start_says_why_in_json(tmp_path: Path, failure: str) -> None:
    config = tmp_path / "c.toml"
    holder, port = _taken_port()
    with holder:
        if failure == "bad config":
            config.write_text(CONFIG.replace("slots = 2", 'slots = "many"'))
            port = 0
        else:
            config.write_text(CONFIG)
        p = subprocess.run(
            [sys.executable, "-m", "bourse", "serve", "--config", str(config),
             "--data-dir", str(tmp_path / "data"), "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=60, env=clean_env(), stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert not not_json(p.stderr), "lines that are not JSON:\n" + "\n".join(not_json(p.stderr))
    [line] = records(p.stderr)
    assert line["level"] == "ERROR", line
    needle = (
        "products.fast.deployments[0].slots"
        if failure == "bad config"
        else f"cannot listen on 127.0.0.1:{port}"
    )
    assert needle in line["msg"], line
    assert not (tmp_path / "data").exists()
