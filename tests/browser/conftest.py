"""The browser suite's world: one served gateway (``bourse serve`` as a child process
on 127.0.0.1) that was killed with SIGKILL mid-request and restarted on the same data
folder, so it starts with a reconciling hold; and one headless Chromium.

Accounts: ``crash`` (its request was running when the gateway died), ``alice`` and
``bob`` (a few finished requests each, made before the crash). Products: ``sim-market``
(one slot), ``sim-fast``, ``slow`` and ``flaky`` (a dead deployment below a working one).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.browser import Watch, open_browser, require_chromium
from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_browser_test"
USER = [{"role": "user", "content": "Tell me about rivers."}]

CONFIG = """
[server]
log_level = "info"

[products.sim-market]
description = "Simulated model with one slot, to watch the order book work"
[[products.sim-market.deployments]]
engine = "sim"
slots = 1
floor = 0.10
tokens_per_s = 50
ttft_ms = 20

[products.sim-fast]
[[products.sim-fast.deployments]]
engine = "sim"
slots = 4
floor = 0.05
tokens_per_s = 0
ttft_ms = 0

[products.slow]
[[products.slow.deployments]]
engine = "sim"
slots = 2
floor = 1.0
tokens_per_s = 5

[products.flaky]
description = "A dead deployment at the lower floor (every attempt fails before output), a working one above"
[[products.flaky.deployments]]
name = "flaky-dead"
engine = "sim"
slots = 1
floor = 0.05
fail_before_output = -1
[[products.flaky.deployments]]
name = "flaky-ok"
engine = "sim"
slots = 1
floor = 0.10
"""


@dataclass
class Floor:
    url: str
    keys: dict[str, str]
    crash_hold: dict[str, Any]
    tmp: Path
    proc: subprocess.Popen[bytes]
    request_ids: dict[str, list[str]] = field(default_factory=dict)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"},
                             timeout=30, **kw)  # fmt: skip

    def as_user(self, account: str, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"authorization": f"Bearer {self.keys[account]}"},
                             timeout=60, **kw)  # fmt: skip

    def complete(self, account: str, product: str, **body: Any) -> httpx.Response:
        r = self.as_user(account, "POST", "/v1/chat/completions",
                         json={"model": product, "messages": USER, "max_tokens": 5, **body})  # fmt: skip
        assert r.status_code == 200, r.text
        return r

    def server_log(self) -> str:
        return "".join(p.read_text() for p in sorted(self.tmp.glob("second-*.log")))


def _setup(url: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    keys: dict[str, str] = {}
    for account, credit in (("crash", 1.0), ("alice", 5.0), ("bob", 5.0)):
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.post(url + "/admin/accounts", json={"id": account, "credit_usd": credit}, headers=headers)
        assert r.status_code == 201, r.text
        r = httpx.post(url + "/admin/keys", json={"account": account}, headers=headers)
        keys[account] = r.json()["key"]
    ids: dict[str, list[str]] = {}
    for account, n in (("alice", 3), ("bob", 2)):
        for _ in range(n):
            r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys[account]}"},
                           json={"model": "sim-fast", "messages": USER, "max_tokens": 5}, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            ids.setdefault(account, []).append(r.headers["x-request-id"])
    return keys, ids


def _crash_mid_request(url: str, key: str, proc: subprocess.Popen[bytes]) -> str:
    """Start a slow stream, read two chunks, SIGKILL the gateway; the request id."""
    with httpx.Client(timeout=30) as http:
        req = http.build_request("POST", url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                 json={"model": "slow", "messages": USER, "max_tokens": 50, "stream": True})  # fmt: skip
        resp = http.send(req, stream=True)
        try:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            chunks = 0
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 2:
                        break
            proc.kill()
            assert proc.wait(timeout=10) == -signal.SIGKILL
            return resp.headers["x-request-id"]
        finally:
            resp.close()


@pytest.fixture(scope="package")
def floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Floor]:
    require_chromium()  # skip before starting anything
    tmp = tmp_path_factory.mktemp("browser")
    data = tmp / "data"
    with ExitStack() as stack:
        url, proc = stack.enter_context(serve_process(tmp, "first", CONFIG, data, ADMIN_KEY))
        keys, ids = _setup(url)
        crashed = _crash_mid_request(url, keys["crash"], proc)
    with serve_process(tmp, "second", CONFIG, data, ADMIN_KEY) as (url, proc):
        r = httpx.get(url + "/admin/holds", params={"state": "reconciling", "account": "crash"},
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip
        held = r.json()["data"]
        assert [h["request_id"] for h in held] == [crashed], held
        yield Floor(url, keys, held[0], tmp, proc, ids)


@pytest.fixture(scope="package")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Watch]]:
    chromium = require_chromium()
    with open_browser(tmp_path_factory.mktemp("chromium-profile"), chromium) as opened:
        yield opened


@pytest.fixture
def page(browser: tuple[Any, Watch]) -> Iterator[Any]:
    """A new tab with no session; the watch must be clean when the test ends."""
    context, watch = browser
    watch.reset()
    context.clear_cookies()
    p = watch.attach(context.new_page())
    try:
        yield p
    finally:
        p.close()
    watch.assert_clean()
