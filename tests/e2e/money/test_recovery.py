"""Crash recovery with real processes: ``bourse serve`` killed with SIGKILL while two
streams run, restarted on the same data (SQLite data folder, or PostgreSQL with
``--database``). The two holds it left open show as ``reconciling`` (admin API and
the account's own view); resolving them (one settled through the admin API, one
released with the ``bourse admin holds`` CLI) restores the ledger with nothing open.

On SQLite (one node) the holds move at start-up. On PostgreSQL (replicas) they move
once the dead instance's lease lapses (SPEC 8); the test waits for that, bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.bodies import USER
from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_recovery_test"
START_TIMEOUT_S = 20.0
LEASE_WAIT_S = 40.0
"""Bound on the wait for a dead replica's lease to lapse (PostgreSQL)."""

CONFIG = """
[server]
log_level = "warning"

[products.slow]
[[products.slow.deployments]]
engine = "sim"
slots = 4
floor = 1.0
tokens_per_s = 5
"""


@contextmanager
def _serve(
    tmp: Path, name: str, data_dir: Path, database: str | None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``bourse serve`` with this module's config; (base URL, process) once healthy."""
    with serve_process(tmp, name, CONFIG, data_dir, ADMIN_KEY, database, START_TIMEOUT_S) as served:
        yield served


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
    )


def _cli(url: str, *args: str) -> tuple[int, Any, str]:
    p = subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--json", "--url", url, "--admin-key", ADMIN_KEY, *args],
        capture_output=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")},
    )
    out = p.stdout.decode()
    try:
        doc = json.loads(out)
    except ValueError:
        doc = None
    return p.returncode, doc, out + p.stderr.decode()


def _ledger(url: str) -> dict[str, Any]:
    r = _admin(url, "GET", "/admin/ledger")
    assert r.status_code == 200, r.text
    led: dict[str, Any] = r.json()
    assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"], led
    assert led["balanced"] is True, led
    return led


def _holds(url: str, state: str, account: str) -> list[dict[str, Any]]:
    r = _admin(url, "GET", "/admin/holds", params={"state": state, "account": account})
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def _crash_and_recover(tmp: Path, database: str | None) -> None:
    data_dir = tmp / "data"
    credit = 1_000_000
    with ExitStack() as stack:
        url, proc = stack.enter_context(_serve(tmp, "first", data_dir, database))
        r = _admin(url, "POST", "/admin/accounts", json={"id": "crash", "credit_usd": 1.0})
        assert r.status_code == 201, r.text
        r = _admin(url, "POST", "/admin/keys", json={"account": "crash"})
        assert r.status_code == 201, r.text
        key = r.json()["key"]
        auth = {"authorization": f"Bearer {key}"}

        # two slow streams, each two chunks in
        http = stack.enter_context(httpx.Client(timeout=30))
        streams = []
        for _ in range(2):
            req = http.build_request(
                "POST",
                url + "/v1/chat/completions",
                json={"model": "slow", "messages": USER, "max_tokens": 50, "stream": True},
                headers=auth,
            )
            resp = http.send(req, stream=True)
            stack.callback(resp.close)
            assert resp.status_code == 200, resp.read()
            streams.append(resp)
        open_ids = {}
        readers = []  # kept alive: a closed line iterator closes its connection
        for resp in streams:
            chunks = 0
            lines = resp.iter_lines()
            readers.append(lines)
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 2:
                        break
            assert chunks == 2
            open_ids[resp.headers["x-request-id"]] = int(resp.headers["x-bourse-quote-micros"])
        held = _holds(url, "open", "crash")
        assert {h["request_id"] for h in held} == set(open_ids), held
        assert sum(open_ids.values()) < credit

        proc.kill()  # SIGKILL: no shutdown, no settlement
        assert proc.wait(timeout=10) == -signal.SIGKILL

    with _serve(tmp, "second", data_dir, database) as (url, _proc):
        auth = {"authorization": f"Bearer {key}"}
        # the holds are not lost: still counted, and (at once on one node; after the
        # dead instance's lease on PostgreSQL) reconciling
        _ledger(url)
        deadline = time.monotonic() + (0 if database is None else LEASE_WAIT_S)
        while True:
            rec = _holds(url, "reconciling", "crash")
            if len(rec) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert {h["request_id"]: h["amount_micros"] for h in rec} == open_ids, rec
        assert _holds(url, "open", "crash") == []
        view = httpx.get(url + "/v1/account", headers=auth, timeout=10).json()
        assert view["reconciling_micros"] == sum(open_ids.values()), view
        assert view["open_holds_micros"] == 0, view
        assert {h["request_id"] for h in view["reconciling_holds"]} == set(open_ids), view
        assert view["balance_micros"] == credit - sum(open_ids.values()), view
        _ledger(url)

        first, second = sorted(rec, key=lambda h: h["request_id"])
        # one settled through the admin API (without usage: the whole hold at most)
        r = _admin(url, "POST", f"/admin/holds/{first['id']}/settle", json={})
        assert r.status_code == 200, r.text
        settled = r.json()
        assert settled["state"] == "settled" and 0 <= settled["charged_micros"] <= first["amount_micros"]
        assert _admin(url, "POST", f"/admin/holds/{first['id']}/settle", json={}).status_code == 409

        # the other through the CLI: list, then release
        rc, doc, out = _cli(url, "holds", "list", "--account", "crash")
        assert rc == 0, out
        assert [h["id"] for h in doc["data"]] == [second["id"]], out
        rc, doc, out = _cli(url, "holds", "release", second["id"])
        assert rc == 0, out
        assert doc["state"] == "released", out

        led = _ledger(url)
        assert led["holds_micros"] == 0, led
        assert _holds(url, "reconciling", "crash") == [] and _holds(url, "open", "crash") == []
        view = httpx.get(url + "/v1/account", headers=auth, timeout=10).json()
        assert view["reconciling_micros"] == 0 and view["open_holds_micros"] == 0, view
        assert view["spent_micros"] == settled["charged_micros"], view
        assert view["balance_micros"] == credit - settled["charged_micros"], view
        # and the restarted gateway serves and charges as before
        ok = httpx.post(url + "/v1/chat/completions", json={"model": "slow", "messages": USER, "max_tokens": 2},
                        headers=auth, timeout=30)  # fmt: skip
        assert ok.status_code == 200, ok.text
        _ledger(url)


def test_kill_9_mid_stream_leaves_reconciling_holds(tmp_path: Path, db: str | None) -> None:
    _crash_and_recover(tmp_path, db)
