"""Redis killed (``kill -9``) and restarted empty under load, with two replicas
(issue 14, item 2).

Before the fix the rate limiter kept the connections Redis had closed in its pool
(keyed requests got 503 "shared rate limits are unreachable" long after Redis was
back), waiting orders were forgotten by the restarted Redis while their replica
still waited on them (they hung until their book timeout with the market showing
nothing busy or waiting), and slots in use were no longer counted.

Here: a Redis of the test's own on a free port (the suite's shared Redis is never
touched), two ``bourse serve`` replicas on one PostgreSQL ledger, clients sending
streamed and unary requests with a rate-limited key to both, Redis killed and
restarted on the same port under that load. Then:

- no request is stranded: each one ends with a 200, or a clean 503 with
  ``retry-after`` (inside the stream once it began); never a 500, and never a 408:
  the book timeout (20 s) is far above any honest wait here (about 3 s), so an
  order that reaches it waited on a book that had forgotten it;
- the limits (and the book) are back within 5 s of the restart: every request
  begun from then on succeeds, including a burst as wide as the load before the
  kill (it checks out every pooled connection, the ones Redis closed too);
- the book is empty at the end (nothing waits, nothing is busy), and the money
  invariant holds to the micro-USD: credits = balances + holds + revenue, with no
  hold left open.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.bodies import USER
from tests.support.processes import CLUSTER_ENV, REDIS_SERVER, free_port, redis_server, serve_process

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.skipif(
        REDIS_SERVER is None,
        reason="needs the redis-server binary on PATH (Debian: apt-get install redis-server)",
    ),
]

ADMIN_KEY = "bk_admin_redis_restart"
LEASE_S = 1.0
BOOK_TIMEOUT_S = 20.0
GENERATION_S = 0.2
"""Each request asks for 4 tokens at 20 tokens/s."""
MARGIN_S = 3.0
"""A loaded machine's slack on top of the book timeout and the generation."""
CLIENTS = 40
"""Clients before the kill and in the burst at the end."""
FEW = 4
"""Clients from the kill until the burst."""
LOAD_BEFORE_S = 2.5
REDIS_DOWN_S = 1.0
BACK_WITHIN_S = 5.0
BURST_S = 3.0


@dataclass
class Outcome:
    replica: int
    stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    code: str | None = None
    retry_after: str | None = None
    content: bool = False
    failure: str | None = None


@dataclass
class Load:
    urls: list[str]
    key: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    active: int = CLIENTS
    """Clients numbered below this send requests; the others wait."""

    def client(self, n: int) -> None:
        with httpx.Client(timeout=BOOK_TIMEOUT_S + GENERATION_S + 30) as http:
            i = n
            while not self.stop.is_set():
                if n >= self.active:
                    time.sleep(0.01)
                    continue
                out = Outcome(replica=i % 2, stream=bool((i // 2) % 2), started=time.monotonic())
                try:
                    self._one(http, out)
                except httpx.HTTPError as exc:
                    out.failure = f"{type(exc).__name__}: {exc}"
                out.ended = time.monotonic()
                self.outcomes.append(out)
                i += 1
                if out.status != 200 or out.code is not None:
                    time.sleep(0.05)  # a client backs off a little on an error

    def _one(self, http: httpx.Client, out: Outcome) -> None:
        body = {"model": "p", "messages": USER, "stream": out.stream, "timeout": BOOK_TIMEOUT_S, "max_tokens": 4,
                "sim": {"output_tokens": 4, "tokens_per_s": 20}}  # fmt: skip
        headers = {"authorization": f"Bearer {self.key}"}
        url = self.urls[out.replica] + "/v1/chat/completions"
        with http.stream("POST", url, json=body, headers=headers) as resp:
            out.status = resp.status_code
            out.retry_after = resp.headers.get("retry-after")
            if not out.stream or resp.status_code != 200:
                doc = json.loads(resp.read())
                if "error" in doc:
                    out.code = doc["error"].get("code")
                else:
                    out.content = bool(doc["choices"][0]["message"]["content"])
                return
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.code = chunk["error"].get("code")
                elif chunk.get("choices"):
                    out.content = True


def _admin(url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
    )


def _wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def replicas(tmp_path: Path, postgres_dsn: str) -> Iterator[tuple[list[str], int]]:
    port = free_port()
    config = f"""
[server]
log_level = "warning"
quiet_interval_s = 0.5

[cluster]
redis_url = "redis://127.0.0.1:{port}/0"
lease_s = {LEASE_S}

[products.p]
sim_overrides = true
[[products.p.deployments]]
engine = "sim"
slots = 3
floor = 0.1
"""
    with ExitStack() as stack:
        stack.enter_context(redis_server(port, tmp_path))
        urls = []
        for i in range(2):
            data = tmp_path / f"data{i}"
            data.mkdir()
            url, _ = stack.enter_context(
                serve_process(tmp_path, f"replica{i}", config, data, ADMIN_KEY, postgres_dsn, env=CLUSTER_ENV)
            )
            urls.append(url)
        yield urls, port


def test_redis_killed_and_restarted_under_load(replicas: tuple[list[str], int], tmp_path: Path) -> None:
    urls, port = replicas
    assert (
        _admin(urls[0], "POST", "/admin/accounts", json={"id": "acme", "credit_usd": 100.0}).status_code < 300
    )
    r = _admin(urls[0], "POST", "/admin/keys", json={"account": "acme", "rpm": 100_000, "tpm": 100_000_000})
    r.raise_for_status()
    load = Load(urls, r.json()["key"])
    threads = [threading.Thread(target=load.client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    killed_at = back_at = 0.0
    try:
        time.sleep(LOAD_BEFORE_S)
        pid = int(_redis_pid(port))
        load.active = FEW
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(REDIS_DOWN_S)
        with redis_server(port, tmp_path):
            back_at = time.monotonic()
            time.sleep(BACK_WITHIN_S)
            load.active = CLIENTS  # the burst
            time.sleep(BURST_S)
            load.stop.set()
            for t in threads:
                t.join(BOOK_TIMEOUT_S + GENERATION_S + 40)
            assert not any(t.is_alive() for t in threads), "a client is still waiting (a stranded order)"
            _check(load.outcomes, killed_at, back_at)
            _check_book_and_money(urls)
    finally:
        load.stop.set()


def _redis_pid(port: int) -> str:
    import redis

    client = redis.Redis(port=port)
    try:
        info: dict[str, Any] = client.info("server")
        return str(info["process_id"])
    finally:
        client.close()


def _check(outcomes: list[Outcome], killed_at: float, back_at: float) -> None:
    assert len(outcomes) > 50, len(outcomes)
    assert [o for o in outcomes if o.started < killed_at and o.status == 200 and o.content], "no load before"
    longest = BOOK_TIMEOUT_S + GENERATION_S + MARGIN_S
    stranded = [o for o in outcomes if o.ended - o.started > longest or o.failure]
    assert not stranded, f"{len(stranded)} requests stranded or failed, e.g. {stranded[:3]}"
    timed_out = [o for o in outcomes if o.status == 408 or o.code == "book_timeout"]
    assert not timed_out, f"{len(timed_out)} orders waited their whole book timeout, e.g. {timed_out[:3]}"
    for o in outcomes:
        assert o.status in (200, 503), o
        if o.status == 503:
            assert o.retry_after is not None and int(o.retry_after) >= 1, o
        if o.status == 200 and o.code is None:
            assert o.content, o
        assert o.code in (None, "no_capacity"), o
    late = [o for o in outcomes if o.started >= back_at + BACK_WITHIN_S]
    assert len(late) > CLIENTS, len(late)
    failed_late = [o for o in late if o.status != 200 or o.code is not None or not o.content]
    assert not failed_late, (
        f"{len(failed_late)} of {len(late)} requests begun {BACK_WITHIN_S:g} s after Redis came back "
        f"failed, e.g. {failed_late[:3]}"
    )


def _check_book_and_money(urls: list[str]) -> None:
    def book_empty() -> bool:
        views = [httpx.get(u + "/v1/market/p", timeout=10).json() for u in urls]
        return all(v["slots"]["busy"] == 0 and v["waiting"] == 0 for v in views)

    _wait_for(book_empty, "the book to empty on both replicas")

    def settled() -> dict[str, Any] | None:
        led: dict[str, Any] = _admin(urls[1], "GET", "/admin/ledger").json()
        return led if led["holds_micros"] == 0 else None

    led = _wait_for(settled, "every hold to close")
    assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"], led
    assert led["balanced"] is True, led
    assert led["revenue_micros"] > 0, led
