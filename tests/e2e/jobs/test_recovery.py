"""Jobs survive a crash: ``bourse serve`` (a real process) is killed with SIGKILL while
one job runs and another waits behind it (one slot); restarted on the same data
(SQLite data folder, or PostgreSQL with ``--database``), it completes both, in their
original order, each charged exactly once: the ledger balances, no hold is left open
or reconciling, the balance moved by exactly the two final costs, and each job's
request id has one usage record.

On PostgreSQL the dead instance's holds would only become ``reconciling`` once its
lease (15 s) lapses; resuming a job releases its old hold itself, so the test does
not wait for the lease.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.jobs.support import Jobs, chat_body, text_body, usage_records
from tests.support.databases import fresh_postgres_database
from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_jobs_recovery_test"
CREDIT_USD = 1.0
CREDIT = 1_000_000

CONFIG = """
[server]
log_level = "warning"

[products.slow]
sim_overrides = true
[[products.slow.deployments]]
engine = "sim"
slots = 1
floor = 1.0
tokens_per_s = 10
"""


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], ids=["sqlite", "postgres"]
)
def db(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None
        return
    with fresh_postgres_database() as dsn:
        yield dsn


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
    )


def _holds(url: str, account: str, state: str | None = None) -> list[dict[str, Any]]:
    params = {"account": account, "limit": "1000"}
    if state:
        params["state"] = state
    r = _admin(url, "GET", "/admin/holds", params=params)
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def _ledger(url: str) -> dict[str, Any]:
    r = _admin(url, "GET", "/admin/ledger")
    assert r.status_code == 200, r.text
    led: dict[str, Any] = r.json()
    assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"], led
    assert led["balanced"] is True, led
    return led


def test_kill_9_with_a_running_and_a_queued_job_completes_both_charged_once(
    tmp_path: Path, db: str | None
) -> None:
    data_dir = tmp_path / "data"
    body_a = chat_body("slow", seed=31, tokens=20)  # 2 s at 10 tokens/s
    body_b = text_body("slow", seed=32, tokens=8)  # the queued one is a legacy completion
    with serve_process(tmp_path, "first", CONFIG, data_dir, ADMIN_KEY, db) as (url, proc):
        assert (
            _admin(url, "POST", "/admin/accounts", json={"id": "crash", "credit_usd": CREDIT_USD}).status_code
            == 201
        )
        r = _admin(url, "POST", "/admin/keys", json={"account": "crash"})
        assert r.status_code == 201, r.text
        key = r.json()["key"]
        jobs = Jobs(url, key, "crash")
        a = jobs.submit(body_a)
        jobs.wait(a["id"], lambda j: j["status"] == "running" and j["progress"]["tokens"] >= 2,
                  what="running with tokens")  # fmt: skip
        b = jobs.submit(body_b, "/v1/completions")
        got_b = jobs.get(b["id"])
        assert got_b["status"] == "queued" and got_b["queue"]["position"] == 0, got_b
        running_a = jobs.get(a["id"])
        assert running_a["status"] == "running" and running_a["progress"]["tokens"] < 20, running_a
        assert len(_holds(url, "crash", "open")) == 2

        proc.kill()  # SIGKILL: no shutdown, no settlement
        assert proc.wait(timeout=10) == -signal.SIGKILL

    with serve_process(tmp_path, "second", CONFIG, data_dir, ADMIN_KEY, db) as (url, _proc):
        jobs = Jobs(url, key, "crash")
        done_a = jobs.wait_status(a["id"], "succeeded", "failed", "canceled", "expired", timeout=30)
        done_b = jobs.wait_status(b["id"], "succeeded", "failed", "canceled", "expired", timeout=30)
        assert done_a["status"] == "succeeded", done_a
        assert done_b["status"] == "succeeded", done_b
        # the same jobs, the same request ids; the one that ran first runs first again
        assert done_a["request_id"] == a["request_id"] and done_b["request_id"] == b["request_id"]
        assert done_a["started_at"] < done_b["started_at"], (done_a, done_b)
        assert done_b["result"]["object"] == "text_completion", done_b["result"]
        # run again from the start: the complete answer
        assert done_a["result"]["usage"]["completion_tokens"] == 20, done_a["result"]["usage"]
        assert done_b["result"]["usage"]["completion_tokens"] == 8, done_b["result"]["usage"]
        cost_a = done_a["result"]["usage"]["cost_micros"]
        cost_b = done_b["result"]["usage"]["cost_micros"]
        assert cost_a > 0 and cost_b > 0, (cost_a, cost_b)

        # charged exactly once each
        led = _ledger(url)
        assert led["holds_micros"] == 0, led
        assert _holds(url, "crash", "open") == [], _holds(url, "crash")
        assert _holds(url, "crash", "reconciling") == [], _holds(url, "crash")
        settled = [h for h in _holds(url, "crash") if h["state"] == "settled"]
        assert sorted(h["charged_micros"] for h in settled) == sorted([cost_a, cost_b]), _holds(url, "crash")
        view = httpx.get(url + "/v1/account", headers=jobs.auth, timeout=10).json()
        assert view["spent_micros"] == cost_a + cost_b, view
        assert view["balance_micros"] == CREDIT - cost_a - cost_b, view
        assert view["open_holds_micros"] == 0 and view["reconciling_micros"] == 0, view
        recs = usage_records(url, key)
        assert len(recs) == 2, recs
        assert sorted(r["usage"]["cost_micros"] for r in recs) == sorted([cost_a, cost_b]), recs
        # ... under each job's own request id (the job's, its result's, its hold's, its record's)
        assert done_a["result"]["id"] == a["request_id"], done_a["result"]
        assert done_b["result"]["id"] == b["request_id"], done_b["result"]
        assert sorted(h["request_id"] for h in settled) == sorted([a["request_id"], b["request_id"]]), settled
        assert sorted(r["id"] for r in recs) == sorted([a["request_id"], b["request_id"]]), recs
        by_id = {r["id"]: r for r in recs}
        assert by_id[a["request_id"]]["usage"]["cost_micros"] == cost_a, by_id
        assert by_id[b["request_id"]]["usage"]["cost_micros"] == cost_b, by_id
        assert {r["receipt"]["outcome"] for r in recs} == {"completed"}, recs
