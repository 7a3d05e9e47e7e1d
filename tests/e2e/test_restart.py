"""Safe restarts with real ``bourse serve`` processes (issue 13 item 4, issue 14 item 9).

- SIGTERM drains: ``/readyz`` turns 503 at once, a new request gets 503 ``draining``
  with ``retry-after``, an order still waiting in the book ends in-band with the same
  error and ``[DONE]``, a running stream finishes within ``drain_timeout_s``, and the
  process exits 0 with no hold left open.
- With a short ``drain_timeout_s`` a stream still running at the deadline ends with an
  error frame, its hold settled by its policy.
- A data folder is locked by the process serving it: a second ``serve`` on it exits at
  once, non-zero, with one line naming the holder's pid, and changes nothing.
- A draining gateway hands its detached jobs back: a second gateway on the same data
  (folder or database) runs each once, charged once.

Before the fix SIGTERM cut streams after uvicorn's 5 s graceful timeout (a traceback
in the log, no frame to the client, the process killed by its own signal), and a
second ``serve`` on a live data folder served beside it.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest

from tests.e2e.jobs.support import Jobs, chat_body, usage_records
from tests.support.databases import fresh_postgres_database
from tests.support.processes import CLUSTER_ENV, clean_env, free_port, serve_process

ADMIN_KEY = "bk_admin_restart_test"
USER = [{"role": "user", "content": "Tell me about the market."}]
EXIT_S = 60.0
"""Generous bound on a draining process's exit (the machine may be loaded)."""


def _config(drain_timeout_s: float, *, tokens_per_s: float = 5, slots: int = 1, policy: str = "") -> str:
    return f"""
[server]
log_level = "info"
drain_timeout_s = {drain_timeout_s}
quiet_interval_s = 0.5

[products.slow]
sim_overrides = true
{policy}
[[products.slow.deployments]]
engine = "sim"
slots = {slots}
floor = 1.0
tokens_per_s = {tokens_per_s}
"""


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
    )


def _new_key(url: str, account: str) -> str:
    r = _admin(url, "POST", "/admin/accounts", json={"id": account, "credit_usd": 1.0})
    assert r.status_code == 201, r.text
    r = _admin(url, "POST", "/admin/keys", json={"account": account})
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


@dataclass
class Stream:
    """One SSE response read line by line: its data payloads (``[DONE]`` included) and comments."""

    resp: httpx.Response
    lines: Iterator[str]
    data: list[str] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    ended: bool = False

    def _next(self) -> bool:
        try:
            line = next(self.lines)
        except StopIteration:
            self.ended = True
            return False
        if line.startswith("data: "):
            self.data.append(line[6:])
        elif line.startswith(":"):
            self.comments.append(line)
        return True

    def until_chunks(self, n: int) -> None:
        while len(self.chunks) < n and self._next():
            pass
        assert len(self.chunks) >= n, (self.data, self.comments)

    def until_comment(self, prefix: str) -> None:
        while not any(c.startswith(prefix) for c in self.comments) and self._next():
            pass
        assert any(c.startswith(prefix) for c in self.comments), self.comments

    def to_end(self) -> None:
        while self._next():
            pass

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [orjson.loads(d) for d in self.data if d != "[DONE]"]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [c["error"] for c in self.chunks if "error" in c]


def _stream(stack: ExitStack, http: httpx.Client, url: str, key: str, tokens: int) -> Stream:
    req = http.build_request(
        "POST", url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
        json={"model": "slow", "messages": USER, "max_tokens": tokens, "stream": True,
              "sim": {"output_tokens": tokens}},
    )  # fmt: skip
    resp = http.send(req, stream=True)
    stack.callback(resp.close)
    assert resp.status_code == 200, resp.read()
    return Stream(resp, resp.iter_lines())


def _sqlite_rows(data: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{data / 'bourse.db'}?mode=ro", uri=True) as conn:
        return list(conn.execute(sql).fetchall())


def _rows(data: Path, database: str | None, sql: str) -> list[tuple[Any, ...]]:
    if database is None:
        return _sqlite_rows(data, sql)
    with psycopg.connect(database) as conn:
        return list(conn.execute(sql).fetchall())


def _log(tmp: Path, name: str) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.log")))


def _wait_ready_status(url: str, status: int, timeout_s: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url + "/readyz", timeout=5)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_sigterm_lets_a_running_stream_finish_and_refuses_new_work(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ExitStack() as stack:
        url, proc = stack.enter_context(serve_process(tmp_path, "drain", _config(30), data, ADMIN_KEY))
        key = _new_key(url, "drain")
        http = stack.enter_context(httpx.Client(timeout=60))
        running = _stream(stack, http, url, key, 50)  # 10 s at 5 tokens/s
        running.until_chunks(1)
        waiting = _stream(stack, http, url, key, 5)  # behind it: the only slot is taken
        waiting.until_comment(": queued")

        proc.send_signal(signal.SIGTERM)
        ready = _wait_ready_status(url, 503)
        assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
        fresh = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": "slow", "messages": USER, "max_tokens": 2}, timeout=30)  # fmt: skip
        assert fresh.status_code == 503, fresh.text
        assert fresh.json()["error"]["code"] == "draining", fresh.text
        assert int(fresh.headers["retry-after"]) >= 1, dict(fresh.headers)

        waiting.to_end()  # in-band: the error frame, then [DONE] (default policy)
        assert [e["code"] for e in waiting.errors] == ["draining"], waiting.data
        assert waiting.data[-1] == "[DONE]", waiting.data
        assert not [c for c in waiting.chunks if "error" not in c], waiting.data  # nothing generated

        running.to_end()
        assert running.errors == [], running.data
        assert running.data[-1] == "[DONE]", running.data
        assert (
            sum(1 for c in running.chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 50
        )
        rid_running = running.resp.headers["x-request-id"]
        rid_waiting = waiting.resp.headers["x-request-id"]

        assert proc.wait(timeout=EXIT_S) == 0, _log(tmp_path, "drain")
    holds = dict(_sqlite_rows(data, "SELECT request_id, state FROM holds"))
    assert holds == {rid_running: "settled", rid_waiting: "released"}, holds
    outcomes = dict(_sqlite_rows(data, "SELECT request_id, outcome FROM usage"))
    assert outcomes == {rid_running: "completed", rid_waiting: "error"}, outcomes
    log = _log(tmp_path, "drain")
    assert "Traceback" not in log and "timeout graceful shutdown" not in log, log


def test_sigint_drains_too(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ExitStack() as stack:
        url, proc = stack.enter_context(serve_process(tmp_path, "sigint", _config(30), data, ADMIN_KEY))
        key = _new_key(url, "sigint")
        http = stack.enter_context(httpx.Client(timeout=60))
        running = _stream(stack, http, url, key, 10)  # 2 s at 5 tokens/s
        running.until_chunks(1)
        proc.send_signal(signal.SIGINT)
        assert _wait_ready_status(url, 503).json()["status"] == "draining"
        running.to_end()
        assert running.data[-1] == "[DONE]" and running.errors == [], running.data
        assert proc.wait(timeout=EXIT_S) == 0, _log(tmp_path, "sigint")
    assert _sqlite_rows(data, "SELECT state FROM holds") == [("settled",)]
    log = _log(tmp_path, "sigint")
    assert "SIGINT: draining" in log
    last = log.strip().splitlines()[-1]
    assert re.fullmatch(r"bourse: stopped \d+\.\d s after the signal", last), log  # the process's last line


def test_a_stream_still_running_at_the_drain_deadline_ends_with_an_error_frame(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(1, policy='charge_on_error = "generated"')
    with ExitStack() as stack:
        url, proc = stack.enter_context(serve_process(tmp_path, "deadline", config, data, ADMIN_KEY))
        key = _new_key(url, "deadline")
        http = stack.enter_context(httpx.Client(timeout=60))
        running = _stream(stack, http, url, key, 50)  # 10 s at 5 tokens/s
        running.until_chunks(2)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        running.to_end()
        took = time.monotonic() - t0
        assert [e["code"] for e in running.errors] == ["draining"], running.data
        assert running.data[-1] == "[DONE]", running.data
        generated = sum(
            1 for c in running.chunks if c.get("choices") and c["choices"][0]["delta"].get("content")
        )
        assert 2 <= generated < 50, running.data
        assert took < 8.0, took  # the deadline (1 s), not the stream's 10 s
        rid = running.resp.headers["x-request-id"]
        assert proc.wait(timeout=EXIT_S) == 0, _log(tmp_path, "deadline")
    [(state, charged)] = _sqlite_rows(
        data, f"SELECT state, charged_micros FROM holds WHERE request_id = '{rid}'"
    )
    [(outcome, cost)] = _sqlite_rows(
        data, f"SELECT outcome, cost_micros FROM usage WHERE request_id = '{rid}'"
    )
    # charge_on_error = generated: the tokens it relayed are charged, with their usage record
    assert (state, outcome) == ("settled", "error") and charged == cost > 0, (state, outcome, charged, cost)
    assert _sqlite_rows(data, "SELECT count(*) FROM holds WHERE state IN ('open', 'reconciling')") == [(0,)]
    log = _log(tmp_path, "deadline")
    assert "Traceback" not in log, log


def test_a_second_serve_on_a_live_data_folder_exits_and_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (tmp_path / "second.toml").write_text(_config(30))
    with ExitStack() as stack:
        url, proc = stack.enter_context(serve_process(tmp_path, "live", _config(30), data, ADMIN_KEY))
        key = _new_key(url, "live")
        http = stack.enter_context(httpx.Client(timeout=60))
        running = _stream(stack, http, url, key, 50)
        running.until_chunks(1)
        held = _admin(url, "GET", "/admin/holds", params={"state": "open"}).json()["data"]
        assert len(held) == 1, held
        ledger = _admin(url, "GET", "/admin/ledger").json()

        args = [sys.executable, "-m", "bourse", "serve", "--config", str(tmp_path / "second.toml"),
                "--data-dir", str(data), "--host", "127.0.0.1", "--port", str(free_port())]  # fmt: skip
        t0 = time.monotonic()
        second = subprocess.run(args, capture_output=True, env=clean_env(BOURSE_ADMIN_KEY=ADMIN_KEY),
                                stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
        assert time.monotonic() - t0 < 30
        out = (second.stdout + second.stderr).decode()
        assert second.returncode != 0, out
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) == 1 and str(proc.pid) in lines[0], out

        # the live server's hold is still open, the ledger as it was
        still = _admin(url, "GET", "/admin/holds", params={"state": "open"}).json()["data"]
        assert [(h["id"], h["state"]) for h in still] == [(h["id"], "open") for h in held], still
        assert _admin(url, "GET", "/admin/ledger").json() == ledger
        assert not _admin(url, "GET", "/admin/holds", params={"state": "reconciling"}).json()["data"]
        running.to_end()
        assert running.data[-1] == "[DONE]" and running.errors == [], running.data


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], ids=["sqlite", "postgres"]
)
def database(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None
        return
    with fresh_postgres_database() as dsn:
        yield dsn


@contextmanager
def _served(tmp: Path, name: str, config: str, data: Path, database: str | None) -> Iterator[tuple[str, Any]]:
    with serve_process(
        tmp, name, config, data, ADMIN_KEY, database, env=CLUSTER_ENV if database else None
    ) as served:
        yield served


def test_a_draining_gateway_hands_its_jobs_back_and_the_next_runs_each_once(
    tmp_path: Path, database: str | None
) -> None:
    """SIGTERM with one job running (past the 1 s drain) and one queued behind it: both are
    handed back (holds released, no usage record), the process exits 0; the next gateway
    (the same data folder; on PostgreSQL another replica's folder) runs each once."""
    config = _config(1, tokens_per_s=10)
    first_data = tmp_path / "data"
    with _served(tmp_path, "first", config, first_data, database) as (url, proc):
        key = _new_key(url, "jobs")
        jobs = Jobs(url, key, "jobs")
        a = jobs.submit(chat_body("slow", seed=31, tokens=60))  # 6 s at 10 tokens/s
        jobs.wait(
            a["id"], lambda j: j["status"] == "running" and j["progress"]["tokens"] >= 2, what="running"
        )
        b = jobs.submit(chat_body("slow", seed=32, tokens=5))
        assert jobs.get(b["id"])["status"] == "queued"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_S) == 0, _log(tmp_path, "first")
    rows = _rows(first_data, database, "SELECT id, status, owner, hold_id FROM jobs ORDER BY created_at")
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (a["id"], "queued", None, None),
        (b["id"], "queued", None, None),
    ]
    states = _rows(first_data, database, "SELECT state, count(*) FROM holds GROUP BY state")
    assert dict(states) == {"released": 2}, states
    assert _rows(first_data, database, "SELECT count(*) FROM usage") == [(0,)]
    assert "Traceback" not in _log(tmp_path, "first")

    second_data = first_data if database is None else tmp_path / "replica"
    with _served(tmp_path, "second", config, second_data, database) as (url, _proc):
        jobs = Jobs(url, key, "jobs")
        done_a = jobs.wait_status(a["id"], "succeeded", "failed", "canceled", "expired", timeout=40)
        done_b = jobs.wait_status(b["id"], "succeeded", "failed", "canceled", "expired", timeout=40)
        assert done_a["status"] == done_b["status"] == "succeeded", (done_a, done_b)
        assert done_a["result"]["usage"]["completion_tokens"] == 60
        cost = done_a["result"]["usage"]["cost_micros"] + done_b["result"]["usage"]["cost_micros"]
        settled = _admin(url, "GET", "/admin/holds", params={"account": "jobs", "state": "settled"}).json()[
            "data"
        ]
        assert sorted(h["request_id"] for h in settled) == sorted([a["request_id"], b["request_id"]]), settled
        assert sum(h["charged_micros"] for h in settled) == cost > 0
        for state in ("open", "reconciling"):
            assert (
                _admin(url, "GET", "/admin/holds", params={"account": "jobs", "state": state}).json()["data"]
                == []
            )
        usage = usage_records(url, key)
        assert sorted(u["id"] for u in usage) == sorted([a["request_id"], b["request_id"]]), usage
        view = httpx.get(url + "/v1/account", headers=jobs.auth, timeout=30).json()
        assert view["spent_micros"] == cost and view["balance_micros"] == 1_000_000 - cost, view
